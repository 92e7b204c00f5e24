"""Benchmarks tf_smb's all-reduce against MultiWorkerMirroredStrategy (RING) and memcpy.

For each tensor set the driver runs, on `--workers` local workers:
  * SMB: `python -m tf_smb.run -np N python -m benchmarks.roles.allreduce --kind=smb`,
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

    python -m benchmarks.allreduce                      # full run (from the checkout)
    python -m benchmarks.allreduce --sets=1MB,16MB --iters=5
    python -m benchmarks.allreduce --smoke --out_dir=/tmp/bench

Prints the markdown table and writes it (`results.md`), the medians (`results.csv`) and
every timing (`results.json`) to `--out_dir`.
"""
from __future__ import annotations

import json
import os
import pathlib
import statistics
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from absl import app, flags

from benchmarks import common
from benchmarks.common import FLAT_SETS
from benchmarks.processes import commands, role_argv, run_processes, subprocess_env
from benchmarks.report import fmt, markdown, median_ms, ratio, write_csv
from benchmarks.roles.memcpy import memcpy_times

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # the driver builds resnet50's shapes

FULL_SETS = "1MB,16MB,100MB,resnet50"
SMOKE_SETS = "4KB,64KB,mlp"
# Sets of a model's shapes; this benchmark's "mlp" is common's 32-64-64-10 "tiny_mlp".
MODEL_SETS = {"resnet50": "resnet50", "mlp": "tiny_mlp"}

FLAGS = flags.FLAGS
flags.DEFINE_string("sets", None, f"comma list of sets (default {FULL_SETS}; "
                    f"with --smoke {SMOKE_SETS})")
flags.DEFINE_bool("smoke", False, "tiny sets and few iterations, for CI")
flags.DEFINE_integer("workers", 2, "number of workers")
flags.DEFINE_integer("iters", None, "timed iterations (default 10; 3 with --smoke)")
flags.DEFINE_integer("warmup", None, "untimed iterations first (default 3; 1 with --smoke)")
flags.DEFINE_integer("staging_bytes", 0, "tf_smb.run --staging-bytes (0: its default)")
flags.DEFINE_float("timeout", 600.0, "seconds each benchmark subprocess may run")
flags.DEFINE_string("out_dir", "bench_out", "where results.md, .csv and .json go")


def set_shapes(name: str) -> List[Tuple[int, ...]]:
    """The float32 tensor shapes of the set `name`."""
    return common.set_shapes(MODEL_SETS.get(name, name))


def bench_collective(role: str, set_name: str, iters: int, warmup: int) -> Optional[dict]:
    """Runs one kind of worker on one set; the rank-0 result, or None after printing why."""
    argv = role_argv("allreduce", f"--kind={role}",
                     f"--sets={MODEL_SETS.get(set_name, set_name)}", f"--iters={iters}",
                     f"--warmup={warmup}")
    staging = [f"--staging-bytes={FLAGS.staging_bytes}"] if FLAGS.staging_bytes else []
    cmds = commands("tf_smb.run" if role == "smb" else "mwms", FLAGS.workers, argv,
                    subprocess_env(), staging)
    ok, outputs, reason = run_processes(cmds, FLAGS.timeout)
    results = common.parse_tagged(outputs[0]) if ok else []
    if not results:
        tail = "\n".join("\n".join(o.splitlines()[-15:]) for o in outputs)
        print(f"--- {role} on {set_name} failed: {reason or 'no result line'}\n{tail}\n---",
              file=sys.stderr, flush=True)
    return results[0] if results else None


def run_driver(sets: List[str], iters: int, warmup: int) -> None:
    """Benchmarks every set; prints the markdown table, writes it, the CSV and the JSON."""
    header = ["set", "MB", "SMB ms", "MWMS-RING ms", "memcpy ms", "MWMS/SMB", "SMB/memcpy"]
    rows: List[List[Optional[float]]] = []  # the numbers of each row, after the set name
    raw: Dict[str, dict] = {}  # every timing, for results.json
    for name in sets:
        nbytes = common.set_bytes(set_shapes(name))
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
    table = markdown(header, [[name, *(fmt(x, ".1f" if i >= 4 else ".4g")
                                       for i, x in enumerate(row))]
                              for name, row in zip(sets, rows)])
    note = (f"\n\n{FLAGS.workers} workers, float32, MB = MiB; medians of {iters} timed "
            f"iterations after {warmup} warm-up; memcpy: one np.copyto of the same bytes.\n")
    out_dir = pathlib.Path(FLAGS.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.md").write_text(table + note)
    (out_dir / "results.json").write_text(json.dumps(raw, indent=1))
    write_csv(out_dir / "results.csv", header,
              [[name, *(fmt(x, ".6g") for x in row)] for name, row in zip(sets, rows)])
    print(table + note, flush=True)


def main(argv: Sequence[str]) -> None:
    del argv
    sets = common.split_list(FLAGS.sets or None, SMOKE_SETS if FLAGS.smoke else FULL_SETS)
    iters = FLAGS.iters if FLAGS.iters is not None else (3 if FLAGS.smoke else 10)
    warmup = FLAGS.warmup if FLAGS.warmup is not None else (1 if FLAGS.smoke else 3)
    if iters < 1 or warmup < 0 or FLAGS.workers < 1:
        raise app.UsageError("need --iters >= 1, --warmup >= 0 and --workers >= 1")
    unknown = [s for s in sets if s not in FLAT_SETS and s not in MODEL_SETS]
    if unknown:
        raise app.UsageError(f"unknown sets {unknown}; known: {[*FLAT_SETS, *MODEL_SETS]}")
    run_driver(sets, iters, warmup)


if __name__ == "__main__":
    app.run(main)
