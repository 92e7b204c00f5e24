"""Benchmarks tf_smb's synchronous and asynchronous modes: cost per step and time to accuracy.

Part 1, communication per step. For the float32 trainable-variable shapes of a model
(`mlp`: Dense 784-512-512-10; `resnet50` / `vgg16` / `inception_v3`:
`keras.applications.*(weights=None)`; see benchmarks.common.model_shapes), on each
number of `--workers`, every worker (benchmarks/roles/async_steps.py) times these steps,
each one tf.function call:
  * sync all-reduce: one fused `tf_smb.allreduce(grads)`, the collective of a
    synchronous step (SMBStrategy(mode="sync"));
  * async read+push: one `ops.segments_push_read` that reads every parameter into the
    worker's copy, then one that pushes a delta for each (segment += delta in the box),
    what SMBStrategy(mode="async") does per step (at its start and end);
  * async push+read: one op that pushes each delta and reads the segment back in the
    same pass, what SMBStrategy(mode="async", read_at="push") does at a step's end;
  * async read+sgd: the same read, then `ops.segment_apply_sgd` of a gradient for each
    (the box runs momentum SGD, `--sgd_momentum`; update="sgd").
The workers pass one barrier before and one after each timed loop, none in between: each
runs its steps back to back, so the sync steps wait for one another in the all-reduce and
the async ones do not. Each step is timed separately (perf_counter around the call and the
fetch of one scalar); the table shows the median over every worker's timed steps. The
async read+push and push+read runs are checked: afterwards every segment holds the sum of all pushes.

Part 1 needs a box with room for a model's parameters (VGG16: 528 MiB, twice that with
the momentum buffers, and the sync all-reduce's result buffers): the workers run under
`python -m tf_smb.run --heap-bytes=H`, H the launcher's default heap
(tf_smb._box.DEFAULT_HEAP_BYTES, sparse) or what the model needs if that is more.

Part 2, time to accuracy: `python -m tf_smb.run -np 2 python -m
benchmarks.digits_curve` (examples/keras_digits.py with rank 0's accuracy curve) with
--mode=sync, --mode=async and --mode=async --update=sgd, and the reference
`mpirun -np 2 ... --strategy=horovod`, each `--repeats` times: the wall time of the whole
run, rank 0's printed `test accuracy`, and the training seconds until rank 0's weights
first reach `--target_accuracy` on the test set, taken after every `--tta_curve_every`
of rank 0's batches and at every epoch's end (digits_curve's --accuracy_curve; medians).
`accuracy.png` plots test accuracy against training seconds.

    python -m benchmarks.async_step                     # full run (from the checkout)
    python -m benchmarks.async_step --models=resnet50 --workers=2 \\
        --iters=5 --tta_modes=                          # part 1 only
    python -m benchmarks.async_step --smoke --out_dir=/tmp/bench

`--smoke`: a tiny MLP's shapes, 2 workers, 3 iterations, keras_digits with --epochs=2.
Prints both markdown tables and writes them (`async_results.md`), their numbers
(`async_comm.csv`, `async_accuracy.csv`), every timing and curve (`async_results.json`,
`curve_<mode>_<i>.json`) and the plot (`accuracy.png`) to
`--out_dir`. A subprocess that fails or passes `--timeout` is killed; its cells read n/a
and its last output lines are printed and kept in the markdown.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import statistics
import time
from typing import Dict, List, NamedTuple, Optional, Sequence

from absl import app, flags

from benchmarks import common
from benchmarks.common import MODELS
from benchmarks import processes
from benchmarks.processes import commands, role_argv, run_processes, subprocess_env
from benchmarks.report import (Failure, error_tail, fmt, markdown, pooled_median_ms, ratio,
                               report_failure, write_csv)
from tf_smb import _box

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # the driver builds the models' shapes
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

FLAGS = flags.FLAGS

# examples/keras_digits.py with rank 0's accuracy curve (benchmarks/digits_curve.py).
DIGITS_CURVE = [*processes.python(), "-m", "benchmarks.digits_curve"]
FULL_MODELS, SMOKE_MODELS = "mlp,resnet50,vgg16", "tiny_mlp"
# Per-step kinds of part 1 (benchmarks/roles/async_steps.py): name -> table column.
COMM_MODES = {"sync": "sync all-reduce ms", "push": "async read+push ms",
              "pushread": "async push+read ms (read_at=push)", "sgd": "async read+sgd ms"}
# Runs of part 2: name -> keras_digits flags (horovod: under mpirun, the reference).
TTA_MODES = {"sync": ["--mode=sync"], "async": ["--mode=async"],
             "async_sgd": ["--mode=async", "--update=sgd"], "horovod": ["--strategy=horovod"]}
TTA_LABELS = {"sync": "sync", "async": "async (delta)", "async_sgd": "async (sgd in box)",
              "horovod": "Horovod-MPI"}

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
flags.DEFINE_integer("tta_curve_every", 4, "part 2: a point of the accuracy curve after "
                     "every this many of rank 0's batches (about 11 an epoch at 2 workers), "
                     "besides every epoch's end; 0: epoch ends only", lower_bound=0)
flags.DEFINE_integer("repeats", 1, "runs of each part-2 mode (medians)")
flags.DEFINE_float("target_accuracy", 0.95, "part 2: the test accuracy whose time is reported")
flags.DEFINE_bool("smoke", False, "tiny model, 2 workers, few steps and epochs (for CI)")
flags.DEFINE_float("timeout", 900.0, "seconds each subprocess may run before it is killed")
flags.DEFINE_string("out_dir", "bench_out", "where the results go")


def bench_comm(model: str, world: int, modes: List[str], iters: int, warmup: int,
               nbytes: int, failures: List[Failure]) -> Dict[str, List[dict]]:
    """One job of `world` workers times every step kind; each kind's per-rank results."""
    # Segments (and, with momentum, their velocities) at 64-byte offsets, the sync
    # all-reduce's result buffers (its sums stay in the box; the check's sums may
    # still be held when the timed steps start), plus room.
    copies = (2 if "sgd" in modes and FLAGS.sgd_momentum else 1) + 2 * ("sync" in modes)
    heap = max(_box.DEFAULT_HEAP_BYTES, copies * nbytes + (64 << 20))
    argv = role_argv("async_steps", f"--models={model}", f"--comm_modes={','.join(modes)}",
                     f"--iters={iters}", f"--warmup={warmup}",
                     f"--sgd_momentum={FLAGS.sgd_momentum}")
    ok, outputs, reason = run_processes(
        commands("tf_smb.run", world, argv, subprocess_env(), [f"--heap-bytes={heap}"]),
        FLAGS.timeout)
    results: Dict[str, List[dict]] = {m: [] for m in modes}
    for out in outputs:  # results printed before a failure still count
        for r in common.parse_tagged(out):
            results[r["mode"]].append(r)
    missing = [m for m in modes if len(results[m]) != world]
    if not ok or missing:
        report_failure(failures, f"{model} at {world} workers ({', '.join(missing) or 'all'})",
                       reason or "no result line", error_tail(outputs))
        for m in missing:
            results[m] = []
    return results


class TtaRun(NamedTuple):
    wall_s: float         # the whole run, start-up included
    accuracy: float       # rank 0's final test accuracy
    curve: List[dict]     # per point: train_s (since training began), test_accuracy, ...
    record_s: float       # rank 0's training time spent taking the curve's points


def seconds_to(curve: Sequence[dict], target: float) -> Optional[float]:
    """Training seconds at the curve's first point whose test accuracy reaches `target`."""
    return next((p["train_s"] for p in curve if p["test_accuracy"] >= target), None)


def run_tta(mode: str, epochs: Optional[int], curve_path: pathlib.Path,
            failures: List[Failure]) -> Optional[TtaRun]:
    """One keras_digits run (tf_smb.run; Horovod: mpirun) with rank 0's accuracy curve."""
    argv = [*DIGITS_CURVE, *TTA_MODES[mode], f"--accuracy_curve={curve_path}",
            f"--accuracy_curve_every={FLAGS.tta_curve_every}"]
    if epochs is not None:
        argv.append(f"--epochs={epochs}")
    launch = "mpirun" if mode == "horovod" else "tf_smb.run"
    start = time.perf_counter()
    ok, outputs, reason = run_processes(
        commands(launch, FLAGS.tta_workers, argv, subprocess_env()), FLAGS.timeout)
    wall = time.perf_counter() - start
    # tf_smb.run tags rank 0's lines "[0]: "; under mpirun rank 0 is the one that
    # writes the curve, and every rank prints the same final accuracy, untagged: an
    # unbuffered print writes its text and its newline apart, so two ranks' lines
    # can share one ("test accuracy: 0.9600test accuracy: 0.9600"), hence no "$".
    def rank0_line(pattern: str) -> Optional[re.Match]:
        return re.search(r"^(?:\[0\]: )?" + pattern, outputs[0], re.MULTILINE)

    m = rank0_line(r"test accuracy: ([0-9.]+)")
    taking = rank0_line(r"accuracy curve: \d+ points, ([0-9.]+) s")
    if not ok or m is None or taking is None or not curve_path.exists():
        report_failure(failures, f"keras_digits {mode}",
                       reason or "no test accuracy line or accuracy curve", error_tail(outputs))
        return None
    return TtaRun(wall, float(m.group(1)), json.loads(curve_path.read_text()),
                  float(taking.group(1)))


def plot_accuracy(path: pathlib.Path, curves: Dict[str, List[dict]], target: float) -> None:
    """Test accuracy against training seconds, one line per mode."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.6))
    for mode, curve in curves.items():
        ax.plot([p["train_s"] for p in curve], [p["test_accuracy"] for p in curve],
                marker="o", markersize=4, linewidth=2, label=TTA_LABELS[mode],
                markevery=[i for i, p in enumerate(curve) if p.get("epoch_end", True)])
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"{target:g}")
    ax.set_xlabel("training seconds (rank 0)")
    ax.set_ylabel("test accuracy")
    lowest = min((p["test_accuracy"] for c in curves.values() for p in c), default=0.0)
    # Near the target, where the modes differ; earlier epochs' points may fall below.
    ax.set_ylim(max(lowest - 0.02, target - 0.15, 0.0), 1.0)
    ax.set_title(f"keras_digits, {FLAGS.tta_workers} workers: accuracy against time")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
            shapes = common.model_shapes(model)
            nbytes, params = common.set_bytes(shapes), common.num_params(shapes)
            for world in worlds:
                results = bench_comm(model, world, modes, iters, warmup, nbytes, failures)
                raw["comm"][f"{model}/{world}"] = results
                ms = {m: pooled_median_ms(results[m]) for m in modes}
                comm_rows.append([model, world, params / 1e6, nbytes / 2**20,
                                  *(ms[m] for m in modes),
                                  ratio(ms.get("sync"), ms.get("push"))])
                print(f"{model} at {world} workers: " + ", ".join(
                    f"{m} {fmt(ms[m])} ms" for m in modes), flush=True)
        table = markdown(header, [[str(r[0]), str(r[1]), *(fmt(x, ".4g") for x in r[2:-1]),
                                   fmt(r[-1], ".2f")] for r in comm_rows])
        note = (f"float32; MB = MiB of parameters; ms per step, medians over every "
                f"worker's {iters} timed steps after {warmup} warm-up; sync/async = sync "
                f"all-reduce / async read+push; read+sgd momentum {FLAGS.sgd_momentum}.")
        sections.append(f"## Communication per step\n\n{table}\n\n{note}")
        write_csv(out_dir / "async_comm.csv", header,
                  [[r[0], r[1], *(fmt(x, ".6g") for x in r[2:])] for r in comm_rows])

    if tta_modes:
        target = FLAGS.target_accuracy
        to_target = f"training s to {target:g}"
        header = ["mode", "wall s", "test accuracy", to_target, "s taking curve points"]
        tta_rows: List[List[object]] = []
        curves: Dict[str, List[dict]] = {}  # the first run of each mode, plotted
        for mode in tta_modes:
            runs = [r for r in (run_tta(mode, epochs, out_dir / f"curve_{mode}_{i}.json",
                                        failures) for i in range(FLAGS.repeats))
                    if r is not None]
            raw["accuracy"][mode] = [r._asdict() for r in runs]
            wall = statistics.median(r.wall_s for r in runs) if runs else None
            acc = statistics.median(r.accuracy for r in runs) if runs else None
            # A run that never reached the target counts as never (infinite).
            times = [seconds_to(r.curve, target) for r in runs]
            reached = statistics.median(t if t is not None else float("inf")
                                        for t in times) if runs else None
            if reached == float("inf"):
                reached = None
            if runs:
                curves[mode] = runs[0].curve
            taking = statistics.median(r.record_s for r in runs) if runs else None
            tta_rows.append([TTA_LABELS[mode], wall, acc, reached, taking])
            print(f"keras_digits {mode}: {fmt(wall)} s, test accuracy {fmt(acc)}, "
                  f"{fmt(reached)} training s to {target:g}", flush=True)
        table = markdown(header, [[r[0], fmt(r[1], ".1f"), fmt(r[2], ".4f"), fmt(r[3], ".2f"),
                                   fmt(r[4], ".3f")] for r in tta_rows])
        points = (f"point (after every {FLAGS.tta_curve_every} of its batches, and every "
                  f"epoch end)" if FLAGS.tta_curve_every else "epoch end")
        note = (f"`python -m tf_smb.run -np {FLAGS.tta_workers} python -m "
                f"benchmarks.digits_curve --mode=...` (Horovod-MPI: "
                f"`mpirun -np {FLAGS.tta_workers} ... "
                f"--strategy=horovod`), epochs {epochs if epochs is not None else 'its default (15)'};"
                f" wall s = the whole run (start-up included), test accuracy = rank 0's; "
                f"{to_target} = rank 0's training time (from the start of `fit`) at the "
                f"first {points} whose weights reach {target:g} on the test set (n/a: "
                f"never); s taking curve points = rank 0's training time spent copying "
                f"the weights for the curve (counted in its training s); medians of "
                f"{FLAGS.repeats} run(s). Plot: `accuracy.png`.")
        sections.append(f"## Time to accuracy (keras_digits)\n\n{table}\n\n{note}")
        write_csv(out_dir / "async_accuracy.csv", header,
                  [[r[0], *(fmt(x, ".6g") for x in r[1:])] for r in tta_rows])
        if curves:
            plot_accuracy(out_dir / "accuracy.png", curves, target)

    if failures:
        sections.append("## Failures\n\n" + "\n\n".join(
            f"{f.what}: {f.reason}\n\n```\n{f.tail}\n```" for f in failures))
    text = "\n\n".join(sections) + "\n"
    (out_dir / "async_results.md").write_text(text)
    raw["failures"] = [f._asdict() for f in failures]
    (out_dir / "async_results.json").write_text(json.dumps(raw, indent=1))
    print(text, flush=True)


def main(argv: Sequence[str]) -> None:
    del argv
    models = common.split_list(FLAGS.models, SMOKE_MODELS if FLAGS.smoke else FULL_MODELS)
    modes = common.split_list(FLAGS.comm_modes, "")
    iters = FLAGS.iters if FLAGS.iters is not None else (3 if FLAGS.smoke else 10)
    warmup = FLAGS.warmup if FLAGS.warmup is not None else (1 if FLAGS.smoke else 2)
    unknown = ([m for m in models if m not in MODELS] + [m for m in modes if m not in COMM_MODES])
    if unknown:
        raise app.UsageError(f"unknown models or --comm_modes: {unknown}")
    if iters < 1 or warmup < 0:
        raise app.UsageError("need --iters >= 1 and --warmup >= 0")
    try:
        worlds = [int(w) for w in common.split_list(FLAGS.workers, "2" if FLAGS.smoke else "2,3")]
    except ValueError as e:
        raise app.UsageError(f"--workers must be a comma list of integers: {e}") from e
    tta_modes = common.split_list(FLAGS.tta_modes, "")
    if [m for m in tta_modes if m not in TTA_MODES] or min(worlds, default=1) < 1:
        raise app.UsageError(f"bad --tta_modes {tta_modes} or --workers {worlds}")
    if FLAGS.repeats < 1 or FLAGS.tta_workers < 1:
        raise app.UsageError("need --repeats >= 1 and --tta_workers >= 1")
    epochs = FLAGS.epochs if FLAGS.epochs is not None else (2 if FLAGS.smoke else None)
    run_driver(models, worlds, modes, tta_modes, iters, warmup, epochs)


if __name__ == "__main__":
    app.run(main)
