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
import os
import pathlib
import statistics
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from absl import app, flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402  (shared helpers: shapes, processes, the timed loop)
# Shared helpers, under the names this module has always had.
from bench_common import (free_ports, fmt, median_ms, memcpy_times, ratio,  # noqa: E402
                          run_processes, set_bytes)

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
    # This script's "mlp" is bench_common's 32-64-64-10 "tiny_mlp".
    return bc.model_shapes("tiny_mlp" if name == "mlp" else name)


# --------------------------------------------------------------------------- workers

def run_worker(role: str, set_name: str, iters: int, warmup: int) -> None:
    """Times the all-reduce of one set; rank 0 prints one RESULT_TAG + JSON line."""
    # The collective first: MWMS must start before a Keras model initializes TensorFlow.
    rank, world, reduce_fn, barrier = bc.collective(role)
    result = bc.time_collective(role, set_name, set_shapes(set_name), iters, warmup,
                                rank, world, reduce_fn, barrier)
    if rank == 0:
        print(RESULT_TAG + json.dumps(result), flush=True)


# --------------------------------------------------------------------------- driver

def worker_args(role: str, set_name: str, iters: int, warmup: int) -> List[str]:
    return [sys.executable, str(SCRIPT), f"--role={role}", f"--sets={set_name}",
            f"--iters={iters}", f"--warmup={warmup}"]


def parse_result(output: str) -> Optional[dict]:
    results = bc.parse_tagged(output, RESULT_TAG)
    return results[0] if results else None


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
