"""The cross-node scaling benchmark: SMB against Horovod-MPI on N simulated nodes.

On one cluster of simulated nodes (tests/simnodes.py: a network namespace each,
joined by a bridge; every node's link shaped both ways with `tc tbf` to `--rate`),
for each layout of `--layouts` ("4x1": 4 nodes x 1 worker; "3+2+1": uneven), side
by side in one run:

1. sync all-reduce of ResNet-50's gradients (102 MB, float32) and of 1 MB, SMB
   (tf_smb.allreduce) and Horovod-MPI (hvd.grouped_allreduce: one MPI_Allreduce
   per fused buffer), both under one mpirun across the nodes
   (benchmarks/roles/allreduce.py, a barrier before each step, rank 0's times), and
   the bytes each node sent on its link over the timed steps (its interface's
   counter, read in the node) against the minimum, 2 (N - 1) / N of the bytes;
2. at the `--async_layouts`, SMB's async step on ResNet-50's parameters (read every
   parameter, push a delta for each; benchmarks/roles/async_steps.py, every
   worker's steps back to back) against Horovod's sync all-reduce of item 1;
3. the small model's `fit` step (3 x Dense(256) on 1,024 inputs, global batch 16)
   at `--fit_layout` on `--fit_rate`: SMBStrategy against tf_smb.HorovodStrategy.

The floor of a sync all-reduce: every node must send (and receive) 2 (N - 1) / N
of the bytes; at the link's rate that takes floor = 2 (N - 1) / N x bytes / rate.
Every job reports how busy the machine's cores were while it ran (/proc/stat),
so a reader can tell the link, not the cores, was the bottleneck.

Everything goes to `--out_dir`: scaling.md (the tables and targets, also printed),
scaling.json (every timing) and scaling.png (time and efficiency against N).

    python -m benchmarks.nodes_scaling --out_dir=/tmp/scaling          # the sweep (~30 min)
    python -m benchmarks.nodes_scaling --smoke --out_dir=/tmp/scaling  # 3 x 1, SMB, a few steps

Needs root (namespaces, tc) and Open MPI's mpirun; run from the checkout's root.
`--smoke` exits 1 when a node sent more than 1.05x the minimum, or a number is missing.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from benchmarks import common
from benchmarks.report import fmt, markdown, ratio

sys.path.insert(0, str(common.REPO_ROOT / "tests"))
import simnodes  # noqa: E402  (tests/simnodes.py: the simulated nodes)

FULL = dict(layouts="2x1,3x1,4x1,6x1,8x1,2x2,3x2,4x2,2+1,3+2+1", rate="1gbit",
            sets="resnet50,1MB", iters=5, warmup=2, async_layouts="2x1,4x1,8x1",
            fit_layout="2x2", fit_rate="5gbit", timeout=600.0, kinds="smb,horovod")
# The smoke (in the fast test tier): SMB alone, its bytes and sums checked.
SMOKE = dict(layouts="3x1", rate="1gbit", sets="16MB", iters=3, warmup=1, async_layouts="",
             fit_layout="", fit_rate="5gbit", timeout=300.0, kinds="smb")
BYTES_TARGET = 1.05  # bytes a node sends per step, x the minimum
FIT_SAMPLES, FIT_BATCH, FIT_EPOCHS = 1600, 16, 3


def parse_layout(name: str) -> List[int]:
    """'4x2' -> [2, 2, 2, 2]; '3+2+1' -> [3, 2, 1]."""
    if "x" in name:
        nodes, per = name.split("x")
        return [int(per)] * int(nodes)
    return [int(w) for w in name.split("+")]


def cpu_times() -> Tuple[float, float]:
    """(busy, total) jiffies of every core so far."""
    with open("/proc/stat") as f:
        fields = [float(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


class Cluster:
    """The simulated nodes, each job on the first len(layout) of them."""

    def __init__(self, nodes: int, workers: int, timeout: float):
        self.sim = simnodes.open_or_skip(nodes=nodes, workers=workers)
        self.timeout = timeout

    def shape(self, rate: str) -> None:
        for n in range(self.sim.count):
            self.sim.shape_link(n, rate)

    def mpirun(self, layout: List[int], argv: List[str]) -> dict:
        """Runs argv under mpirun on `layout`; {"ok", "results", "reason", "cpu_busy", "s"}."""
        per_node = layout + [0] * (self.sim.count - len(layout))
        env = {"TF_CPP_MIN_LOG_LEVEL": "2"}
        busy0, total0 = cpu_times()
        start = time.monotonic()
        try:
            launch = self.sim.mpirun(sum(layout), per_node, argv, self.timeout, env=env)
            ok, out = launch.returncode == 0, launch.stdout + "\n" + launch.stderr
        except simnodes.NodesTimeout as e:
            ok, out = False, f"timed out after {self.timeout:.0f} s: {e}"
        busy1, total1 = cpu_times()
        results = common.parse_tagged(out)
        reason = "" if ok and results else ("no result: " + out[-1500:])
        return {"ok": ok and bool(results), "results": results, "reason": reason,
                "cpu_busy": (busy1 - busy0) / max(1.0, total1 - total0),
                "s": time.monotonic() - start}

    def close(self) -> None:
        try:
            for n in range(self.sim.count):
                self.sim.shape_link(n, None)
        finally:
            self.sim.close()


def rate_bits(rate: str) -> float:
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * scale
    raise ValueError(f"a rate like 1gbit or 500mbit, got {rate!r}")


def floor_ms(nbytes: float, nodes: int, bits: float) -> float:
    return 1e3 * 8 * nbytes * 2 * (nodes - 1) / nodes / bits


def run(args: argparse.Namespace) -> int:
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    layouts = common.split_list(args.layouts, "")
    async_layouts = common.split_list(args.async_layouts, "")
    sets = common.split_list(args.sets, "")
    shapes = {name: parse_layout(name) for name in [*layouts, *async_layouts,
                                                    *([args.fit_layout] if args.fit_layout
                                                      else [])]}
    nodes = max(len(s) for s in shapes.values())
    workers = max(max(s) for s in shapes.values())
    bits = rate_bits(args.rate)
    py = [sys.executable, "-m"]
    records: Dict[str, dict] = {"args": vars(args), "started": time.time(), "rows": [],
                                "async": [], "fit": []}
    cluster = Cluster(nodes, workers, args.timeout)

    def log(text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)

    try:
        cluster.shape(args.rate)
        for name in layouts:
            layout = shapes[name]
            row = {"layout": name, "nodes": len(layout), "workers": sum(layout)}
            for kind in common.split_list(args.kinds, ""):
                job = cluster.mpirun(layout, [*py, "benchmarks.roles.allreduce",
                                              f"--kind={kind}", f"--sets={args.sets}",
                                              f"--iters={args.iters}",
                                              f"--warmup={args.warmup}",
                                              f"--link_dev={simnodes.SIMNET_DEV}"])
                row[f"{kind}_cpu_busy"] = job["cpu_busy"]
                row[f"{kind}_reason"] = job["reason"]
                for r in job["results"]:
                    row[f"{kind}_{r['set']}"] = {
                        "ms": 1e3 * statistics.median(r["times_s"]), "bytes": r["bytes"],
                        "times_s": r["times_s"], "cpu_busy": r.get("cpu_busy"),
                        "node_sent_per_step": [b / args.iters
                                               for b in r.get("node_sent_bytes", [])]}
                log(f"{name} {kind}: " + ", ".join(
                    f"{s} {fmt(row.get(f'{kind}_{s}', {}).get('ms'))} ms" for s in sets)
                    + f" (cores {100 * job['cpu_busy']:.0f}% busy)"
                    + (f" FAILED {job['reason'][-300:]}" if job["reason"] else ""))
            records["rows"].append(row)
        for name in async_layouts:
            layout = shapes[name]
            job = cluster.mpirun(layout, [*py, "benchmarks.roles.async_steps",
                                          "--models=resnet50", "--comm_modes=push",
                                          f"--iters={args.iters}", f"--warmup={args.warmup}"])
            times = [t for r in job["results"] for t in r.get("times_s", [])]
            item = {"layout": name, "nodes": len(layout), "workers": sum(layout),
                    "ms": 1e3 * statistics.median(times) if times else None,
                    "cpu_busy": job["cpu_busy"], "reason": job["reason"]}
            records["async"].append(item)
            log(f"{name} async step: {fmt(item['ms'])} ms" +
                (f" FAILED {job['reason'][-300:]}" if job["reason"] else ""))
        if args.fit_layout:
            cluster.shape(args.fit_rate)
            layout = shapes[args.fit_layout]
            for kind in ("smb_sync", "horovod"):
                job = cluster.mpirun(layout, [*py, "benchmarks.roles.fit", f"--kind={kind}",
                                              "--fit_models=small",
                                              f"--fit_epochs={FIT_EPOCHS}",
                                              f"--fit_batch={FIT_BATCH}",
                                              f"--samples=small:{FIT_SAMPLES}"])
                steps = [r["median_step_s"] for r in job["results"] if r.get("median_step_s")]
                item = {"kind": kind, "layout": args.fit_layout,
                        "ms": 1e3 * max(steps) if len(steps) == sum(layout) else None,
                        "ranks_ms": [1e3 * s for s in steps], "cpu_busy": job["cpu_busy"],
                        "reason": job["reason"]}
                records["fit"].append(item)
                log(f"fit {kind}: {fmt(item['ms'])} ms a step" +
                    (f" FAILED {job['reason'][-300:]}" if job["reason"] else ""))
    finally:
        cluster.close()
    (out_dir / "scaling.json").write_text(json.dumps(records, indent=1))
    return report(records, out_dir, bits)


def report(records: dict, out_dir: pathlib.Path, bits: float) -> int:
    """Writes scaling.md and scaling.png from the records; 1 when a number is missing
    or (smoke) a node sent more than BYTES_TARGET x the minimum."""
    args = argparse.Namespace(**records["args"])
    sets = common.split_list(args.sets, "")
    problems: List[str] = []
    sections = [f"# tf_smb across N nodes\n\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(records['started']))}, "
                f"{os.cpu_count()} cores shared by every node; every link shaped to "
                f"{args.rate} both ways (tbf); medians of {args.iters} steps after "
                f"{args.warmup}. Command: `python -m benchmarks.nodes_scaling "
                f"{'--smoke ' if args.smoke else ''}--out_dir {args.out_dir}`."]
    rows, byte_rows = [], []
    for row in records["rows"]:
        n = row["nodes"]
        for s in sets:
            smb, hvd = row.get(f"smb_{s}"), row.get(f"horovod_{s}")
            if smb is None:
                problems.append(f"{row['layout']} {s}: SMB has no number "
                                f"({row.get('smb_reason', '')[-200:]})")
            floor = floor_ms(smb["bytes"] if smb else (hvd or {}).get("bytes", 0), n, bits)
            sm, hm = (smb or {}).get("ms"), (hvd or {}).get("ms")
            rows.append([row["layout"], s, fmt(floor, ".4g"), fmt(sm), fmt(ratio(sm, floor), ".2f"),
                         fmt(hm), fmt(ratio(hm, floor), ".2f"), fmt(ratio(hm, sm), ".2f"),
                         " / ".join(fmt(None if (c or {}).get("cpu_busy") is None
                                        else 100 * c["cpu_busy"], ".0f") + "%"
                                    for c in (smb, hvd))])
            if smb and smb["node_sent_per_step"]:
                minimum = 2 * (n - 1) / n * smb["bytes"]
                worst = max(smb["node_sent_per_step"]) / minimum
                hw = (max(hvd["node_sent_per_step"]) / minimum
                      if hvd and hvd["node_sent_per_step"] else None)
                byte_rows.append([row["layout"], s, f"{minimum / 2**20:.4g}",
                                  ", ".join(f"{b / minimum:.3f}" for b in smb["node_sent_per_step"]),
                                  fmt(hw, ".3f")])
                if args.smoke and worst > BYTES_TARGET:
                    problems.append(f"{row['layout']} {s}: a node sent {worst:.3f}x the "
                                    f"minimum per step (target <= {BYTES_TARGET}x)")
            elif smb:
                problems.append(f"{row['layout']} {s}: no byte counts")
    sections.append("## Sync all-reduce (ms a step)\n\n" + markdown(
        ["layout", "set", "floor ms", "SMB ms", "SMB / floor", "Horovod-MPI ms",
         "Horovod / floor", "Horovod / SMB", "cores busy (SMB / Horovod)"], rows)
        + "\n\nCores busy: the machine's cores over the timed steps (/proc/stat), all "
        "nodes' processes included.")
    sections.append("## Bytes each node sent per step (x the minimum, 2 (N-1)/N of the bytes)\n\n"
                    + markdown(["layout", "set", "minimum MB", "SMB, each node",
                                "Horovod-MPI, busiest node"], byte_rows)
                    + "\n\nThe node's interface counter over the timed steps (headers and "
                    "the barriers' bytes included), per step.")
    if records["async"]:
        arows = []
        for item in records["async"]:
            sync = next((r.get("horovod_resnet50", {}).get("ms") for r in records["rows"]
                         if r["layout"] == item["layout"]), None)
            sps = 1e3 * item["workers"] / item["ms"] if item["ms"] else None
            arows.append([item["layout"], fmt(item["ms"]), fmt(sync),
                          fmt(ratio(sync, item["ms"]), ".2f"), fmt(sps, ".3g")])
        sections.append("## Async step (ResNet-50's parameters) against Horovod's sync "
                        "all-reduce\n\n" + markdown(
                            ["layout", "SMB async step ms", "Horovod-MPI sync ms",
                             "Horovod / SMB async", "SMB async steps/s, all workers"], arows)
                        + "\n\nAsync step: read every parameter from the box, push a delta "
                        "for each (segments spread over the nodes' boxes), every worker's "
                        "steps back to back, the median over all workers.")
    if records["fit"]:
        frows = [[f["kind"], f["layout"], fmt(f["ms"]), ", ".join(fmt(v) for v in f["ranks_ms"]),
                  f"{100 * f['cpu_busy']:.0f}%"] for f in records["fit"]]
        by = {f["kind"]: f["ms"] for f in records["fit"]}
        sections.append(f"## The small model's fit step ({args.fit_rate})\n\n" + markdown(
            ["strategy", "layout", "ms a step (slowest rank)", "each rank", "cores busy"], frows)
            + f"\n\nHorovodStrategy / SMBStrategy: "
              f"{fmt(ratio(by.get('horovod'), by.get('smb_sync')), '.2f')}x.")
    model = cost_model_section(records, bits)
    if model:
        sections.append(model)
    if problems:
        sections.append("## Problems\n\n" + "\n".join(f"* {p}" for p in problems))
    md = "\n\n".join(sections) + "\n"
    (out_dir / "scaling.md").write_text(md)
    print(md, flush=True)
    plot(records, out_dir / "scaling.png", bits)
    return 1 if problems else 0


def steps(n: int, nbytes: float) -> int:
    """The steps of one NodesAllReduce piece (cc/smb/transport/nodes_allreduce.h):
    1 at 2 nodes, 2 log2 N for a power of two, else 2 (N - 1), up to 2 MiB a piece;
    the ring's 2 (N - 1) above."""
    if n == 2 and nbytes <= 2 << 20:
        return 1
    if n & (n - 1) == 0 and nbytes <= 2 << 20:
        return 2 * int(math.log2(n))
    return 2 * (n - 1)


def fit_cost_model(records: dict, bits: float) -> Optional[dict]:
    """SMB's all-reduce at one worker a node as T = k x floor + steps(N) x alpha:
    alpha (what each step of a piece's schedule costs beyond its bytes: a message's
    latency and the link thread's wake-up, exposed as the pipeline fills and drains)
    fitted with a constant to the smallest set's points, T = c + steps(N) x alpha
    (c: its bytes' time, below the floor where the shaper's burst lets 1 MB through
    at once); then k (the bandwidth term, 1 = at the floor) the least-squares fit of
    the largest set's T - steps(N) x alpha to its floor. {"alpha_ms", "c_ms", "k",
    "small", "large" (the sets' bytes), "residuals": [(set, N, measured, model)]};
    None without two sets of two points."""
    import numpy as np
    by_bytes: Dict[float, List[Tuple[str, int, float]]] = {}
    for row in records["rows"]:
        if "x1" not in row["layout"]:
            continue
        for key, cell in row.items():
            if key.startswith("smb_") and isinstance(cell, dict) and cell.get("ms"):
                by_bytes.setdefault(cell["bytes"], []).append((key[4:], row["nodes"],
                                                                cell["ms"]))
    if len(by_bytes) < 2 or min(len(v) for v in by_bytes.values()) < 2:
        return None
    small, large = min(by_bytes), max(by_bytes)
    a = np.array([[1.0, steps(n, small)] for _, n, _ in by_bytes[small]])
    (c, alpha), *_ = np.linalg.lstsq(a, np.array([ms for *_, ms in by_bytes[small]]),
                                     rcond=None)
    floors = np.array([floor_ms(large, n, bits) for _, n, _ in by_bytes[large]])
    rest = np.array([ms - steps(n, large) * alpha for _, n, ms in by_bytes[large]])
    k = float(floors @ rest / (floors @ floors))
    fit = {"alpha_ms": float(alpha), "c_ms": float(c), "k": k, "small": small, "large": large}
    fit["residuals"] = (
        [(name, n, ms, float(c + steps(n, small) * alpha)) for name, n, ms in by_bytes[small]]
        + [(name, n, ms, model_ms(fit, n, large, bits)) for name, n, ms in by_bytes[large]])
    return fit


def model_ms(fit: dict, n: int, nbytes: float, bits: float) -> float:
    return fit["k"] * floor_ms(nbytes, n, bits) + steps(n, nbytes) * fit["alpha_ms"]


def cost_model_section(records: dict, bits: float) -> str:
    """The fitted model, how well it fits, and its extrapolation to 64-1024 nodes."""
    fit = fit_cost_model(records, bits)
    if not fit:
        return ""
    busy = {(row["layout"], key[4:]): row[key].get("cpu_busy") for row in records["rows"]
            for key in row if key.startswith("smb_") and isinstance(row[key], dict)}
    points = [[name, f"{n}x1", fmt(ms), fmt(model), f"{100 * (ms / model - 1):+.0f}%",
               fmt(None if busy.get((f"{n}x1", name)) is None
                   else 100 * busy[(f"{n}x1", name)], ".0f") + "%"]
              for name, n, ms, model in fit["residuals"]]
    rows = []
    for gbit in (1, 10, 25):
        for n in (8, 64, 128, 256, 512, 1024):
            for nbytes, label in ((fit["large"], "large"), (fit["small"], "small")):
                t = (model_ms(fit, n, nbytes, gbit * 1e9) if nbytes == fit["large"] else
                     max(fit["c_ms"] * bits / (gbit * 1e9), 0) + steps(n, nbytes) * fit["alpha_ms"])
                floor = floor_ms(nbytes, n, gbit * 1e9)
                rows.append([f"{nbytes / 2**20:.4g} MB", f"{gbit} Gbit/s", str(n), fmt(t, ".4g"),
                             fmt(floor, ".4g"), fmt(floor / t, ".2f")])

    def limit(nbytes: float, gbit: float) -> str:
        # The first N where the steps' latency exceeds a quarter of the bytes' time.
        for n in range(2, 4097):
            if steps(n, nbytes) * fit["alpha_ms"] > 0.25 * floor_ms(nbytes, n, gbit * 1e9):
                return str(n)
        return "> 4096"
    limits = [[f"{b / 2**20:.4g} MB", *(limit(b, g) for g in (1, 10, 25))]
              for b in (fit["large"], fit["small"])]
    return ("## Cost model\n\n"
            f"SMB's all-reduce at one worker a node: T = k x floor + steps(N) x alpha, with "
            f"alpha = {fit['alpha_ms']:.3f} ms (fitted with a constant, {fit['c_ms']:.2f} ms, "
            f"to the {fit['small'] / 2**20:.4g} MB points) and k = {fit['k']:.3f} (the "
            f"{fit['large'] / 2**20:.4g} MB points). steps(N), one piece's schedule: 1 at 2 "
            "nodes and 2 log2 N for a power of two up to 2 MiB a piece, else 2 (N - 1) (the "
            "ring). alpha is what a step costs beyond its bytes as the pipeline fills and "
            "drains (a message's latency, the link thread's wake-up); k the share of the "
            "link the bytes get. How the points fit (the cores' load beside: where they "
            "were saturated, the model's link terms do not explain the time):\n\n"
            + markdown(["set", "layout", "measured ms", "model ms", "off", "cores busy"],
                       points)
            + "\n\nExtrapolated (the same k and alpha on faster links and more nodes is an "
            "assumption: alpha here includes the simulated nodes' shared cores; a real network "
            "adds switch hops; the small set's constant scales with the link):\n\n"
            + markdown(["set", "link", "nodes", "model ms", "floor ms",
                        "efficiency (floor / model)"], rows)
            + "\n\nWhere it stops holding: the node count past which the steps' latency "
            "exceeds a quarter of the bytes' time (efficiency under 0.8). Past it the ring's "
            "2 (N - 1) steps want 2 log2 N at every size (halving and doubling, with "
            "Rabenseifner's folding for other node counts) or rings within racks and a ring "
            "of racks:\n\n"
            + markdown(["set", "1 Gbit/s", "10 Gbit/s", "25 Gbit/s"], limits))


def plot(records: dict, path: pathlib.Path, bits: float) -> None:
    """Time and efficiency (floor / time) of ResNet-50's all-reduce against N, one
    worker a node."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in records["rows"] if "x1" in r["layout"] and r.get("smb_resnet50")]
    if not rows:
        return
    n = [r["nodes"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for kind, color in (("smb", "tab:red"), ("horovod", "tab:blue")):
        ms = [r.get(f"{kind}_resnet50", {}).get("ms") for r in rows]
        pts = [(x, y) for x, y in zip(n, ms) if y]
        a.plot(*zip(*pts), "o-", color=color, label="SMB" if kind == "smb" else "Horovod-MPI")
        eff = [(x, floor_ms(r["smb_resnet50"]["bytes"], x, bits) / y) for (x, y), r
               in zip(pts, rows)]
        b.plot(*zip(*eff), "o-", color=color)
    a.plot(n, [floor_ms(r["smb_resnet50"]["bytes"], r["nodes"], bits) for r in rows], "k--",
           label="floor")
    model = fit_cost_model(records, bits)
    if model:
        a.plot(n, [model_ms(model, r["nodes"], r["smb_resnet50"]["bytes"], bits) for r in rows],
               ":", color="tab:red", label="SMB cost model")
    a.set(xlabel="nodes (1 worker each)", ylabel="ms per all-reduce",
          title="ResNet-50 gradients")
    b.set(xlabel="nodes (1 worker each)", ylabel="floor / time", ylim=(0, 1.1),
          title="efficiency")
    a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.nodes_scaling",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out_dir", default="/tmp/bench_scaling")
    parser.add_argument("--smoke", action="store_true",
                        help="3 x 1, a few steps of 16 MB, SMB only")
    parser.add_argument("--report_from", default="", help="a run's scaling.json: report again")
    for key, value in FULL.items():
        parser.add_argument(f"--{key}", type=type(value), default=None)
    args = parser.parse_args(argv)
    for key, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.report_from:
        records = json.loads(pathlib.Path(args.report_from).read_text())
        pathlib.Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        return report(records, pathlib.Path(args.out_dir),
                      rate_bits(records["args"]["rate"]))
    try:
        return run(args)
    except simnodes.NodesUnavailable as e:
        print(f"simulated nodes cannot be made here: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
