"""Benchmarks tf_smb's synchronous and asynchronous modes: cost per step and time to accuracy.

Part 1, communication per step. For the float32 trainable-variable shapes of a model
(`mlp`: Dense 784-512-512-10; `resnet50` / `vgg16` / `inception_v3`:
`keras.applications.*(weights=None)`; see bench_common.model_shapes),
on each number of `--workers`, every worker times these steps, each one tf.function call:
  * sync all-reduce: one fused `tf_smb.allreduce(grads)`, the collective of a
    synchronous step (SMBStrategy(mode="sync"));
  * async read+push: `ops.param_read` of every parameter, then `ops.param_push` of a delta
    for each (segment += delta in the box), what SMBStrategy(mode="async") does per step;
  * async read+sgd: `param_read` of every parameter, then `ops.param_apply_sgd` of a
    gradient for each (the box runs momentum SGD, `--sgd_momentum`; update="sgd").
The workers pass one barrier before and one after each timed loop, none in between: each
runs its steps back to back, so the sync steps wait for one another in the all-reduce and
the async ones do not. Each step is timed separately (perf_counter around the call and the
fetch of one scalar); the table shows the median over every worker's timed steps. The
async read+push run is checked: afterwards every segment holds the sum of all pushes.

Part 1 needs a box with room for a model's parameters (VGG16: 528 MiB, twice that with
the momentum buffers), more than `python -m tf_smb.run` gives its box (a 256 MiB heap), so
the driver does the launcher's job itself: it creates the box (`tf_smb._box.create_box`)
sized to the model, then starts the workers with TF_SMB_RANK, TF_SMB_SIZE, TF_SMB_JOB_ID
and TF_SMB_BOX_CREATED=1, as tf_smb.run does.

Part 2, time to accuracy: `python -m tf_smb.run -np 2 python examples/keras_digits.py`
with --mode=sync, --mode=async and --mode=async --update=sgd, each `--repeats` times:
the wall time of the whole run and rank 0's printed `test accuracy` (medians).

    PYTHONPATH=. python examples/benchmark_async.py                      # full run
    PYTHONPATH=. python examples/benchmark_async.py --models=resnet50 --workers=2 \\
        --iters=5 --tta_modes=                                           # part 1 only
    PYTHONPATH=. python examples/benchmark_async.py --smoke --out_dir=/tmp/bench

`--smoke`: a tiny MLP's shapes, 2 workers, 3 iterations, keras_digits with --epochs=2.
Prints both markdown tables and writes them (`async_results.md`), their numbers
(`async_comm.csv`, `async_accuracy.csv`) and every timing (`async_results.json`) to
`--out_dir`. A subprocess that fails or passes `--timeout` is killed; its cells read n/a
and its last output lines are printed and kept in the markdown.
"""
from __future__ import annotations

import csv
import json
import math
import os
import pathlib
import re
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from absl import app, flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402  (shared helpers: shapes, processes, tables)
from bench_common import (ASYNC_RESULT_TAG, Failure, error_tail, markdown,  # noqa: E402
                          model_shapes, pooled_median_ms, report_failure, subprocess_env)

FLAGS = flags.FLAGS

REPO_ROOT = bc.REPO_ROOT
SCRIPT = pathlib.Path(__file__).resolve()
DIGITS = REPO_ROOT / "examples" / "keras_digits.py"
RESULT_TAG = ASYNC_RESULT_TAG  # what the worker prints before each result
FULL_MODELS, SMOKE_MODELS = "mlp,resnet50,vgg16", "tiny_mlp"
MODELS = bc.MODELS  # tiny_mlp, mlp, resnet50, vgg16, inception_v3
# Per-step kinds of part 1: name -> table column.
COMM_MODES = {"sync": "sync all-reduce ms", "push": "async read+push ms",
              "sgd": "async read+sgd ms"}
# Runs of part 2: name -> keras_digits flags.
TTA_MODES = {"sync": ["--mode=sync"], "async": ["--mode=async"],
             "async_sgd": ["--mode=async", "--update=sgd"]}
TTA_LABELS = {"sync": "sync", "async": "async (delta)", "async_sgd": "async (sgd in box)"}
DEFAULT_HEAP_BYTES = 256 << 20  # tf_smb.run's box
SGD_LEARNING_RATE = 1e-3

flags.DEFINE_enum("role", "driver", ["driver", "worker"], "driver, or one part-1 worker")
flags.DEFINE_string("models", None, f"comma list of {', '.join(MODELS)} (default "
                    f"{FULL_MODELS}; with --smoke {SMOKE_MODELS})")
flags.DEFINE_string("workers", None, "comma list of worker counts (default 2,3; smoke 2)")
flags.DEFINE_string("comm_modes", ",".join(COMM_MODES),
                    f"part-1 step kinds, from {', '.join(COMM_MODES)}; empty skips part 1")
flags.DEFINE_integer("iters", None, "timed steps per kind (default 10; 3 with --smoke)")
flags.DEFINE_integer("warmup", None, "untimed steps first (default 2; 1 with --smoke)")
flags.DEFINE_float("sgd_momentum", 0.9, "momentum of the read+sgd steps (keras_digits' "
                   "--update=sgd uses 0.9)")
flags.DEFINE_string("tta_modes", ",".join(TTA_MODES),
                    f"part-2 runs, from {', '.join(TTA_MODES)}; empty skips part 2")
flags.DEFINE_integer("tta_workers", 2, "workers of the part-2 runs")
flags.DEFINE_integer("epochs", None, "keras_digits --epochs (default: its own, 15; "
                     "2 with --smoke)")
flags.DEFINE_integer("repeats", 1, "runs of each part-2 mode (medians)")
flags.DEFINE_bool("smoke", False, "tiny model, 2 workers, few steps and epochs (for CI)")
flags.DEFINE_float("timeout", 900.0, "seconds each subprocess may run before it is killed")
flags.DEFINE_string("out_dir", "bench_out", "where the results go")


# --------------------------------------------------------------------------- worker

def run_worker(model: str, modes: Sequence[str], iters: int, warmup: int) -> None:
    """Times each step kind of `modes` on `model`'s shapes; prints one RESULT_TAG line each."""
    import numpy as np
    import tensorflow as tf
    import tf_smb
    from tf_smb import ops

    tf_smb.init()
    rank, world = tf_smb.rank(), tf_smb.size()
    shapes = model_shapes(model)
    names = [f"{model}/p{i}" for i in range(len(shapes))]  # one box may hold several models
    # The gradients (sync, sgd) and deltas (push): rank + 1 everywhere, so the sums are known.
    grads = [tf.fill(s, float(rank + 1)) for s in shapes]
    learning_rate = tf.constant(SGD_LEARNING_RATE)
    if "push" in modes or "sgd" in modes:
        if rank == 0:  # segments start at zero
            for n, s in zip(names, shapes):
                ops.param_create(tf.zeros(s), n, write=True)
        tf_smb.barrier()
        if rank != 0:
            for n, g in zip(names, grads):
                ops.param_create(g, n, write=False)

    def first(x: tf.Tensor) -> tf.Tensor:
        return tf.reshape(x, [-1])[0]

    @tf.function
    def sync_step(xs: List[tf.Tensor]) -> tf.Tensor:
        return first(tf_smb.allreduce(xs)[-1])

    def read_all() -> List[tf.Tensor]:
        return [ops.param_read(n, tf.float32, s) for n, s in zip(names, shapes)]

    # The updates wait for every read, as in a step (the gradients come from the reads).
    @tf.function
    def push_step(deltas: List[tf.Tensor]) -> tf.Tensor:
        reads = read_all()
        with tf.control_dependencies(reads):
            for d, n in zip(deltas, names):
                ops.param_push(d, n)
        return first(reads[-1])  # a tf.function runs all its stateful ops before returning

    @tf.function
    def sgd_step(gs: List[tf.Tensor]) -> tf.Tensor:
        reads = read_all()
        with tf.control_dependencies(reads):
            for g, n in zip(gs, names):
                ops.param_apply_sgd(g, learning_rate, n, momentum=FLAGS.sgd_momentum)
        return first(reads[-1])

    steps = {"sync": sync_step, "push": push_step, "sgd": sgd_step}
    if "sync" in modes:  # check the all-reduce once
        got = [o.numpy() for o in tf_smb.allreduce(grads)]
        expected = world * (world + 1) / 2
        if not all(np.all(g == expected) for g in got):
            raise AssertionError(f"all-reduce: want every value {expected}")
        del got
    for mode in modes:
        step = steps[mode]
        for _ in range(warmup):
            step(grads).numpy()
        tf_smb.barrier()
        times: List[float] = []
        for _ in range(iters):
            start = time.perf_counter()
            step(grads).numpy()
            times.append(time.perf_counter() - start)
        tf_smb.barrier()
        if mode == "push":  # every push of every worker landed
            expected = (warmup + iters) * world * (world + 1) / 2
            for n, s in zip(names, shapes):
                value = ops.param_read(n, tf.float32, s).numpy()
                if not np.all(value == expected):
                    raise AssertionError(f"segment {n} {s} holds {np.unique(value)[:5]} "
                                         f"after the pushes, want all {expected}")
            tf_smb.barrier()  # before the sgd steps change the segments
        print(RESULT_TAG + json.dumps({"model": model, "mode": mode, "world": world,
                                       "rank": rank, "bytes": bc.set_bytes(shapes),
                                       "params": sum(math.prod(s) for s in shapes),
                                       "tensors": len(shapes), "times_s": times}), flush=True)


# --------------------------------------------------------------------------- driver

def bench_comm(model: str, world: int, modes: List[str], iters: int, warmup: int,
               nbytes: int, failures: List[Failure]) -> Dict[str, List[dict]]:
    """One job of `world` workers times every step kind; each kind's per-rank results."""
    # Segments (and, with momentum, their velocities) at 64-byte offsets, the sync
    # all-reduce's result buffers (its sums stay in the box; the check's sums may
    # still be held when the timed steps start), plus room.
    copies = (2 if "sgd" in modes and FLAGS.sgd_momentum else 1) + 2 * ("sync" in modes)
    heap = max(DEFAULT_HEAP_BYTES, copies * nbytes + (64 << 20))
    argv = [sys.executable, str(SCRIPT), "--role=worker", f"--models={model}",
            f"--comm_modes={','.join(modes)}", f"--iters={iters}", f"--warmup={warmup}",
            f"--sgd_momentum={FLAGS.sgd_momentum}"]
    try:
        ok, outputs, reason = bc.run_box_job(argv, world, heap, FLAGS.timeout)
    except (RuntimeError, ValueError, OSError) as e:
        ok, outputs, reason = False, [], f"cannot create the box: {e}"
    results: Dict[str, List[dict]] = {m: [] for m in modes}
    for out in outputs:  # results printed before a failure still count
        for r in bc.parse_tagged(out, RESULT_TAG):
            results[r["mode"]].append(r)
    missing = [m for m in modes if len(results[m]) != world]
    if not ok or missing:
        report_failure(failures, f"{model} at {world} workers ({', '.join(missing) or 'all'})",
                       reason or "no result line", error_tail(outputs))
        for m in missing:
            results[m] = []
    return results


def run_tta(mode: str, epochs: Optional[int], failures: List[Failure]
            ) -> Optional[Tuple[float, float]]:
    """One keras_digits run under tf_smb.run: (wall seconds, rank 0's test accuracy)."""
    argv = [sys.executable, "-m", "tf_smb.run", "-np", str(FLAGS.tta_workers),
            sys.executable, str(DIGITS), *TTA_MODES[mode]]
    if epochs is not None:
        argv.append(f"--epochs={epochs}")
    start = time.perf_counter()
    ok, outputs, reason = bc.run_processes([(argv, subprocess_env())], FLAGS.timeout)
    wall = time.perf_counter() - start
    m = re.search(r"^\[0\]: test accuracy: ([0-9.]+)\s*$", outputs[0], re.MULTILINE)
    if not ok or m is None:
        report_failure(failures, f"keras_digits {mode}", reason or "no test accuracy line",
                       error_tail(outputs))
        return None
    return wall, float(m.group(1))


def run_driver(models: List[str], worlds: List[int], modes: List[str],
               tta_modes: List[str], iters: int, warmup: int, epochs: Optional[int]) -> None:
    out_dir = pathlib.Path(FLAGS.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    failures: List[Failure] = []
    raw: Dict[str, dict] = {"comm": {}, "accuracy": {}}
    sections: List[str] = []

    if modes:
        header = ["model", "workers", "params (M)", "MB",
                  *(COMM_MODES[m] for m in modes), "sync/async"]
        comm_rows: List[List[object]] = []  # model, workers, then numbers or None
        for model in models:
            shapes = model_shapes(model)
            nbytes, params = bc.set_bytes(shapes), sum(math.prod(s) for s in shapes)
            for world in worlds:
                results = bench_comm(model, world, modes, iters, warmup, nbytes, failures)
                raw["comm"][f"{model}/{world}"] = results
                ms = {m: pooled_median_ms(results[m]) for m in modes}
                comm_rows.append([model, world, params / 1e6, nbytes / 2**20,
                                  *(ms[m] for m in modes),
                                  bc.ratio(ms.get("sync"), ms.get("push"))])
                print(f"{model} at {world} workers: " + ", ".join(
                    f"{m} {bc.fmt(ms[m])} ms" for m in modes), flush=True)
        table = markdown(header, [[str(r[0]), str(r[1]), *(bc.fmt(x, ".4g") for x in r[2:-1]),
                                   bc.fmt(r[-1], ".2f")] for r in comm_rows])
        note = (f"float32; MB = MiB of parameters; ms per step, medians over every "
                f"worker's {iters} timed steps after {warmup} warm-up; sync/async = sync "
                f"all-reduce / async read+push; read+sgd momentum {FLAGS.sgd_momentum}.")
        sections.append(f"## Communication per step\n\n{table}\n\n{note}")
        with open(out_dir / "async_comm.csv", "w", newline="") as f:
            csv.writer(f).writerows([header] + [[r[0], r[1], *(bc.fmt(x, ".6g") for x in r[2:])]
                                                for r in comm_rows])

    if tta_modes:
        header = ["mode", "wall s", "test accuracy"]
        tta_rows: List[List[object]] = []
        for mode in tta_modes:
            runs = [r for r in (run_tta(mode, epochs, failures) for _ in range(FLAGS.repeats))
                    if r is not None]
            raw["accuracy"][mode] = [{"wall_s": w, "test_accuracy": a} for w, a in runs]
            wall = statistics.median(w for w, _ in runs) if runs else None
            acc = statistics.median(a for _, a in runs) if runs else None
            tta_rows.append([TTA_LABELS[mode], wall, acc])
            print(f"keras_digits {mode}: {bc.fmt(wall)} s, test accuracy {bc.fmt(acc)}",
                  flush=True)
        table = markdown(header, [[r[0], bc.fmt(r[1], ".1f"), bc.fmt(r[2], ".4f")]
                                  for r in tta_rows])
        note = (f"`python -m tf_smb.run -np {FLAGS.tta_workers} python examples/keras_digits.py"
                f" --mode=...`, epochs {epochs if epochs is not None else 'its default (15)'}; "
                f"wall s = the whole run (start-up included), test accuracy = rank 0's; "
                f"medians of {FLAGS.repeats} run(s).")
        sections.append(f"## Time to accuracy (keras_digits)\n\n{table}\n\n{note}")
        with open(out_dir / "async_accuracy.csv", "w", newline="") as f:
            csv.writer(f).writerows([header] + [[r[0], bc.fmt(r[1], ".6g"), bc.fmt(r[2], ".6g")]
                                                for r in tta_rows])

    if failures:
        sections.append("## Failures\n\n" + "\n\n".join(
            f"{f.what}: {f.reason}\n\n```\n{f.tail}\n```" for f in failures))
    text = "\n\n".join(sections) + "\n"
    (out_dir / "async_results.md").write_text(text)
    raw["failures"] = [f._asdict() for f in failures]
    (out_dir / "async_results.json").write_text(json.dumps(raw, indent=1))
    print(text, flush=True)


def split_list(value: Optional[str], default: str) -> List[str]:
    return [s for s in (default if value is None else value).split(",") if s]


def main(argv: Sequence[str]) -> None:
    del argv
    models = split_list(FLAGS.models, SMOKE_MODELS if FLAGS.smoke else FULL_MODELS)
    modes = split_list(FLAGS.comm_modes, "")
    iters = FLAGS.iters if FLAGS.iters is not None else (3 if FLAGS.smoke else 10)
    warmup = FLAGS.warmup if FLAGS.warmup is not None else (1 if FLAGS.smoke else 2)
    unknown = ([m for m in models if m not in MODELS] + [m for m in modes if m not in COMM_MODES])
    if unknown:
        raise app.UsageError(f"unknown models or --comm_modes: {unknown}")
    if iters < 1 or warmup < 0:
        raise app.UsageError("need --iters >= 1 and --warmup >= 0")
    if FLAGS.role == "worker":  # one model after the other, in the same box
        if not models or not modes:
            raise app.UsageError(f"a worker takes models and modes, got {models}, {modes}")
        for model in models:
            run_worker(model, modes, iters, warmup)
        return
    try:
        worlds = [int(w) for w in split_list(FLAGS.workers, "2" if FLAGS.smoke else "2,3")]
    except ValueError as e:
        raise app.UsageError(f"--workers must be a comma list of integers: {e}") from e
    tta_modes = split_list(FLAGS.tta_modes, "")
    if [m for m in tta_modes if m not in TTA_MODES] or min(worlds, default=1) < 1:
        raise app.UsageError(f"bad --tta_modes {tta_modes} or --workers {worlds}")
    if FLAGS.repeats < 1 or FLAGS.tta_workers < 1:
        raise app.UsageError("need --repeats >= 1 and --tta_workers >= 1")
    epochs = FLAGS.epochs if FLAGS.epochs is not None else (2 if FLAGS.smoke else None)
    run_driver(models, worlds, modes, tta_modes, iters, warmup, epochs)


if __name__ == "__main__":
    app.run(main)
