"""What `strategy.gather` moves across nodes: the bytes each node sends against
what a gather needs, side by side with the sum of zero-padded buffers it replaced.

On simulated nodes (tests/simnodes.py, links shaped to `--rate`), for each layout
of `--layouts` ("2x1": 2 nodes x 1 worker), one mpirun job gathers `--mb` MB
(every worker's part `mb / workers`) `--iters` times with each method
(benchmarks/roles/gather.py). A gather needs each node to send its own workers'
rows once to every other node that needs them: with one worker a node, at 2
nodes, exactly its part. The ratio is what a node sent per gather over that.

    python -m benchmarks.gather_bytes --out_dir=/tmp/gather          # 2x1, 64 MB
    python -m benchmarks.gather_bytes --smoke --out_dir=/tmp/gather  # 8 MB

Needs root (namespaces, tc) and Open MPI's mpirun; run from the checkout's root.
Writes gather.md (the table, also printed) and gather.json. Exits 1 when the
gather moved more than `TARGET` x what it needs, or a number is missing.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from typing import Optional, Sequence

from benchmarks import common
from benchmarks.nodes_scaling import Cluster, parse_layout
from benchmarks.report import fmt, markdown

sys.path.insert(0, str(common.REPO_ROOT / "tests"))
import simnodes  # noqa: E402

TARGET = 1.05


def needed_bytes(layout, part_bytes: float) -> float:
    """What a node must send per gather, at least: its workers' rows, once (every
    other node needs them; a broadcast tree or a ring sends each node's rows once
    from it when nodes are two; more nodes may forward)."""
    return max(layout) * part_bytes


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gather_bytes")
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--layouts", default="2x1")
    parser.add_argument("--mb", type=float, default=64.0)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--smoke", action="store_true", help="8 MB, 2 steps")
    args = parser.parse_args(argv)
    if args.smoke:
        args.mb, args.iters = 8.0, 2
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    layouts = {name: parse_layout(name) for name in common.split_list(args.layouts, "")}
    cluster = Cluster(max(len(l) for l in layouts.values()),
                      max(max(l) for l in layouts.values()), timeout=600.0)
    rows, ok = [], True
    try:
        cluster.shape(args.rate)
        for name, layout in layouts.items():
            job = cluster.mpirun(layout, [sys.executable, "-m", "benchmarks.roles.gather",
                                          f"--mb={args.mb}", f"--iters={args.iters}",
                                          f"--link_dev={simnodes.SIMNET_DEV}"])
            if not job["ok"]:
                ok = False
                print(f"{name}: FAILED {job['reason'][-1500:]}", flush=True)
            for r in job["results"]:
                need = needed_bytes(layout, r["part_bytes"])
                per_step = [b / args.iters for b in r["node_sent_bytes"]]
                rows.append({"layout": name, "method": r["role"], "mb": r["bytes"] / 2**20,
                             "ms": 1e3 * statistics.median(r["times_s"]),
                             "node_sent_per_step": per_step, "needed": need,
                             "ratio": max(per_step) / need if per_step else None,
                             "cpu_busy": r["cpu_busy"]})
    finally:
        cluster.close()
    table = markdown(["layout", "method", "result MB", "median ms", "sent a node a gather, MB",
                      "x what a gather needs"],
                     [[r["layout"], r["method"], fmt(r["mb"]), fmt(r["ms"]),
                       ", ".join(fmt(b / 2**20) for b in r["node_sent_per_step"]),
                       fmt(r["ratio"])] for r in rows])
    text = (f"# strategy.gather across nodes ({args.rate} links, {time.strftime('%Y-%m-%d')})"
            f"\n\n{table}\n")
    print(text, flush=True)
    (out_dir / "gather.md").write_text(text)
    (out_dir / "gather.json").write_text(json.dumps({"args": vars(args), "rows": rows},
                                                    indent=1))
    gathers = [r for r in rows if r["method"] == "gather"]
    if not gathers or any(r["ratio"] is None or r["ratio"] > TARGET for r in gathers):
        print(f"gather moved more than {TARGET}x what it needs, or did not run", flush=True)
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
