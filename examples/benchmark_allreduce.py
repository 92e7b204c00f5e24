"""Benchmarks tf_smb's all-reduce against MultiWorkerMirroredStrategy (RING) and memcpy.

For each tensor set the driver runs, on `--workers` local workers:
  * SMB: `python -m tf_smb.run -np N python examples/benchmark_allreduce.py --role=smb`,
    timing `tf_smb.allreduce` of the whole set (one fused collective) in a tf.function;
  * MWMS-RING: N processes with TF_CONFIG for a 127.0.0.1 cluster, timing
    `strategy.run` of `get_replica_context().all_reduce("sum", tensors)` in a tf.function;
  * memcpy: one `np.copyto` of the same total bytes in the driver (the floor).
Each worker warms up, then times every iteration separately (a barrier first, so the
workers start together); the table shows medians. Every set is checked once: the
all-reduced tensors must equal the sum over ranks of the inputs.

Sets: 1MB, 16MB, 100MB (one float32 tensor each, MiB) and resnet50 (the shapes of
`keras.applications.ResNet50(weights=None)`'s trainable variables, ~102 MB, one fused list).
`--smoke` uses 4KB, 64KB and a small MLP's shapes with fewer iterations (for CI).

    PYTHONPATH=. python examples/benchmark_allreduce.py                 # full run
    PYTHONPATH=. python examples/benchmark_allreduce.py --sets=1MB,16MB --iters=5
    PYTHONPATH=. python examples/benchmark_allreduce.py --smoke --out_dir=/tmp/bench

Prints the markdown table and writes it (`results.md`), the medians (`results.csv`) and
every timing (`results.json`) to `--out_dir`.
"""
from __future__ import annotations

import csv
import json
import math
import os
import pathlib
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

from absl import app, flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = pathlib.Path(__file__).resolve()
RESULT_TAG = "BENCH_RESULT "
FULL_SETS = "1MB,16MB,100MB,resnet50"
SMOKE_SETS = "4KB,64KB,mlp"
# Sets of one float32 tensor: name -> number of elements.
FLAT_SETS = {"4KB": 1 << 10, "64KB": 1 << 14, "1MB": 1 << 18, "16MB": 1 << 22,
             "100MB": 25 << 20}
MODEL_SETS = ("resnet50", "mlp")

FLAGS = flags.FLAGS
flags.DEFINE_enum("role", "driver", ["driver", "smb", "mwms"], "driver, or a worker kind")
flags.DEFINE_string("sets", None, f"comma list of sets (default {FULL_SETS}; "
                    f"with --smoke {SMOKE_SETS}); a worker takes exactly one")
flags.DEFINE_bool("smoke", False, "tiny sets and few iterations, for CI")
flags.DEFINE_integer("workers", 2, "number of workers")
flags.DEFINE_integer("iters", None, "timed iterations (default 10; 3 with --smoke)")
flags.DEFINE_integer("warmup", None, "untimed iterations first (default 3; 1 with --smoke)")
flags.DEFINE_integer("staging_bytes", 0, "tf_smb.run --staging-bytes (0: its default)")
flags.DEFINE_float("timeout", 600.0, "seconds each benchmark subprocess may run")
flags.DEFINE_string("out_dir", "bench_out", "where results.md, .csv and .json go")


# --------------------------------------------------------------------------- sets

def set_shapes(name: str) -> List[Tuple[int, ...]]:
    """The float32 tensor shapes of the set `name`."""
    if name in FLAT_SETS:
        return [(FLAT_SETS[name],)]
    if name not in MODEL_SETS:
        raise ValueError(f"unknown set {name!r}; known: {sorted(FLAT_SETS) + list(MODEL_SETS)}")
    import keras  # only the model sets need Keras
    if name == "resnet50":
        model = keras.applications.ResNet50(weights=None)
    else:
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(10)])
    shapes = [tuple(int(d) for d in v.shape) for v in model.trainable_variables]
    del model
    keras.backend.clear_session()
    return shapes


def set_bytes(shapes: Sequence[Tuple[int, ...]]) -> int:
    return sum(4 * math.prod(s) for s in shapes)


# --------------------------------------------------------------------------- workers

def run_worker(role: str, set_name: str, iters: int, warmup: int) -> None:
    """Times the all-reduce of one set; rank 0 prints one RESULT_TAG + JSON line."""
    import numpy as np
    import tensorflow as tf

    if role == "smb":
        import tf_smb
        tf_smb.init()
        rank, world = tf_smb.rank(), tf_smb.size()

        @tf.function
        def reduce_fn(xs: List[tf.Tensor]) -> List[tf.Tensor]:
            return tf_smb.allreduce(xs)

        barrier = tf_smb.barrier
    else:
        cluster = json.loads(os.environ["TF_CONFIG"])
        rank, world = cluster["task"]["index"], len(cluster["cluster"]["worker"])
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING)
        # Before anything else initializes TensorFlow's context (building a Keras model does).
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)

        def replica_fn(xs: List[tf.Tensor]) -> List[tf.Tensor]:
            # The function's inputs have no device, and all_reduce sends each result to
            # its input's device; tf.identity (no copy) places them on the replica's.
            xs = [tf.identity(x) for x in xs]
            return tf.distribute.get_replica_context().all_reduce("sum", xs)

        @tf.function
        def reduce_fn(xs: List[tf.Tensor]) -> List[tf.Tensor]:
            return strategy.experimental_local_results(strategy.run(replica_fn, args=(xs,)))[0]

        one = tf.ones([])

        def barrier() -> None:
            reduce_fn([one])[0].numpy()

    shapes = set_shapes(set_name)
    inputs = [tf.fill(s, float(rank + 1)) for s in shapes]
    outputs = reduce_fn(inputs)
    expected = world * (world + 1) / 2
    for i, (o, s) in enumerate(zip(outputs, shapes)):
        got = o.numpy()
        if got.shape != s or not np.all(got == expected):
            raise AssertionError(f"{role}: tensor {i} {s}: all-reduce gave shape {got.shape}, "
                                 f"values {np.unique(got)[:5]}, want all {expected}")
    del outputs
    times: List[float] = []
    for it in range(warmup + iters):
        barrier()
        start = time.perf_counter()
        outputs = reduce_fn(inputs)
        outputs[-1].numpy().flat[:1]  # forces the result; numpy() of a CPU tensor is no copy
        elapsed = time.perf_counter() - start
        del outputs
        if it >= warmup:
            times.append(elapsed)
    barrier()
    if rank == 0:
        print(RESULT_TAG + json.dumps({"role": role, "set": set_name, "world": world,
                                       "bytes": set_bytes(shapes), "tensors": len(shapes),
                                       "times_s": times}), flush=True)


# --------------------------------------------------------------------------- driver

def free_ports(n: int) -> List[int]:
    """`n` distinct free TCP ports on 127.0.0.1 (bound to port 0, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def run_processes(cmds: Sequence[Tuple[List[str], Dict[str, str]]],
                  timeout: float) -> Tuple[bool, List[str], str]:
    """Runs the commands together; stops them all when one fails or `timeout` passes.

    Returns (all succeeded, each one's output, a reason when they did not).
    """
    files = [tempfile.TemporaryFile(mode="w+") for _ in cmds]
    procs = [subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
                              stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
             for (cmd, env), f in zip(cmds, files)]
    deadline, reason = time.monotonic() + timeout, ""
    while any(p.poll() is None for p in procs):
        failed = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
        if failed:
            reason = f"process {failed[0]} exited with code {procs[failed[0]].returncode}"
            break
        if time.monotonic() > deadline:
            reason = f"timed out after {timeout:.0f} s"
            break
        time.sleep(0.1)
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        for p in procs:  # SIGTERM lets tf_smb.run stop its own workers
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + grace
        while time.monotonic() < end and any(p.poll() is None for p in procs):
            time.sleep(0.1)
    outputs = []
    for f in files:
        f.seek(0)
        outputs.append(f.read())
        f.close()
    if not reason and any(p.returncode != 0 for p in procs):
        reason = "exit codes " + ", ".join(str(p.returncode) for p in procs)
    return not reason, outputs, reason


def worker_args(role: str, set_name: str, iters: int, warmup: int) -> List[str]:
    return [sys.executable, str(SCRIPT), f"--role={role}", f"--sets={set_name}",
            f"--iters={iters}", f"--warmup={warmup}"]


def parse_result(output: str) -> Optional[dict]:
    m = re.search(re.escape(RESULT_TAG) + r"(\{.*\})", output)
    return json.loads(m.group(1)) if m else None


def bench_collective(role: str, set_name: str, iters: int, warmup: int) -> Optional[dict]:
    """Runs one kind of worker on one set; the rank-0 result, or None after printing why."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    args = worker_args(role, set_name, iters, warmup)
    if role == "smb":
        staging = [f"--staging-bytes={FLAGS.staging_bytes}"] if FLAGS.staging_bytes else []
        cmds = [([sys.executable, "-m", "tf_smb.run", "-np", str(FLAGS.workers), *staging,
                  *args], env)]
    else:
        hosts = [f"127.0.0.1:{p}" for p in free_ports(FLAGS.workers)]
        cmds = [(args, dict(env, TF_CONFIG=json.dumps(
            {"cluster": {"worker": hosts}, "task": {"type": "worker", "index": i}})))
            for i in range(FLAGS.workers)]
    ok, outputs, reason = run_processes(cmds, FLAGS.timeout)
    result = parse_result(outputs[0]) if ok else None
    if result is None:
        tail = "\n".join("\n".join(o.splitlines()[-15:]) for o in outputs)
        print(f"--- {role} on {set_name} failed: {reason or 'no result line'}\n{tail}\n---",
              file=sys.stderr, flush=True)
    return result


def memcpy_times(nbytes: int, repeats: int) -> List[float]:
    """Seconds of `np.copyto` of `nbytes` between two touched buffers, after one warm-up."""
    import numpy as np
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return times


def median_ms(result: Optional[dict]) -> Optional[float]:
    return 1e3 * statistics.median(result["times_s"]) if result else None


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def fmt(x: Optional[float], spec: str = ".4g") -> str:
    return "n/a" if x is None else format(x, spec)


def run_driver(sets: List[str], iters: int, warmup: int) -> None:
    """Benchmarks every set; prints the markdown table, writes it, the CSV and the JSON."""
    header = ["set", "MB", "SMB ms", "MWMS-RING ms", "memcpy ms", "MWMS/SMB", "SMB/memcpy"]
    rows: List[List[Optional[float]]] = []  # the numbers of each row, after the set name
    raw: Dict[str, dict] = {}  # every timing, for results.json
    for name in sets:
        nbytes = set_bytes(set_shapes(name))
        smb = bench_collective("smb", name, iters, warmup)
        mwms = bench_collective("mwms", name, iters, warmup)
        for r in (smb, mwms):
            if r is not None and r["bytes"] != nbytes:
                raise RuntimeError(f"{r['role']} all-reduced {r['bytes']} bytes, want {nbytes}")
        copies = memcpy_times(nbytes, max(iters, 20))
        copy = 1e3 * statistics.median(copies)
        raw[name] = {"smb": smb, "mwms": mwms, "memcpy_times_s": copies}
        s, m = median_ms(smb), median_ms(mwms)
        rows.append([nbytes / 2**20, s, m, copy, ratio(m, s), ratio(s, copy)])
        print(f"{name}: SMB {fmt(s)} ms, MWMS-RING {fmt(m)} ms, memcpy {fmt(copy)} ms",
              flush=True)
    lines = [header, ["---"] * len(header)]
    lines += [[name, *(fmt(x, ".1f" if i >= 4 else ".4g") for i, x in enumerate(row))]
              for name, row in zip(sets, rows)]
    table = "\n".join("| " + " | ".join(line) + " |" for line in lines)
    note = (f"\n\n{FLAGS.workers} workers, float32, MB = MiB; medians of {iters} timed "
            f"iterations after {warmup} warm-up; memcpy: one np.copyto of the same bytes.\n")
    out_dir = pathlib.Path(FLAGS.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.md").write_text(table + note)
    (out_dir / "results.json").write_text(json.dumps(raw, indent=1))
    with open(out_dir / "results.csv", "w", newline="") as f:
        csv.writer(f).writerows([header] + [[name, *(fmt(x, ".6g") for x in row)]
                                            for name, row in zip(sets, rows)])
    print(table + note, flush=True)


def main(argv: Sequence[str]) -> None:
    del argv
    sets = [s for s in (FLAGS.sets or (SMOKE_SETS if FLAGS.smoke else FULL_SETS)).split(",") if s]
    iters = FLAGS.iters if FLAGS.iters is not None else (3 if FLAGS.smoke else 10)
    warmup = FLAGS.warmup if FLAGS.warmup is not None else (1 if FLAGS.smoke else 3)
    if iters < 1 or warmup < 0 or FLAGS.workers < 1:
        raise app.UsageError("need --iters >= 1, --warmup >= 0 and --workers >= 1")
    if FLAGS.role == "driver":
        run_driver(sets, iters, warmup)
    elif len(sets) != 1:
        raise app.UsageError(f"a worker takes exactly one set, got {sets}")
    else:
        run_worker(FLAGS.role, sets[0], iters, warmup)


if __name__ == "__main__":
    app.run(main)
