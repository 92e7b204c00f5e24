"""A straggler across nodes: time to accuracy of async, sync and Horovod when one
node's workers are slower than the other's.

On the two simulated nodes of tests/simnodes.py (`--per_node` workers each, the link
shaped as benchmarks.nodes shapes it), examples/keras_digits.py trains through
benchmarks/digits_curve.py, once per mode and delay: every worker of node 1 sleeps
`--slow_ms` after each of its training batches (a slower or busier machine; delay 0
is the baseline). Modes: SMBStrategy async (workers do not wait for each other),
SMBStrategy sync and tf_smb.HorovodStrategy (Horovod 0.28.1's collectives): both
synchronous, so every step waits for the slowest worker. Rank 0, on node 0 and never
slowed, records its test accuracy against its training seconds; the table gives the
seconds until it first reaches `--target_accuracy` (medians over `--repeats`).

Everything goes to `--out_dir`: straggler.md (the table, also printed),
straggler.csv, straggler.json (every curve) and straggler.png (accuracy against
time, a panel per delay).

    python -m benchmarks.straggler --out_dir=/tmp/straggler          # ~6 min
    python -m benchmarks.straggler --smoke --out_dir=/tmp/straggler  # ~1 min

This environment's TF_SMB_* variables reach the workers (e.g. TF_SMB_TIMELINE).
Needs root (namespaces, tc) and Open MPI's mpirun; run from the checkout's root.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import re
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

from benchmarks import common, nodes
from benchmarks.async_step import seconds_to
from benchmarks.processes import subprocess_env
from benchmarks.report import Cell, error_excerpt, failure_reason, fmt, markdown, ratio, write_csv

simnodes = nodes.simnodes
MODES = {"async": ["--mode=async"], "sync": ["--mode=sync"], "horovod": ["--strategy=horovod"]}
LABELS = {"async": "SMB async", "sync": "SMB sync", "horovod": "Horovod-MPI"}
COLORS = {"async": "tab:orange", "sync": "tab:red", "horovod": "tab:blue"}
FULL = dict(per_node=2, delays="0,30", modes="async,sync,horovod", epochs=15, repeats=1,
            link="5gbit", curve_every=4, target_accuracy=0.95, timeout=600.0)
SMOKE = dict(per_node=1, delays="20", modes="async,sync,horovod", epochs=2, repeats=1,
             link="unshaped", curve_every=4, target_accuracy=0.3, timeout=300.0)


def run_one(sim: simnodes.SimulatedNodes, args: argparse.Namespace, mode: str, delay: float,
            curve_path: pathlib.Path) -> Cell:
    """One keras_digits run across the nodes; a Cell whose value is the seconds to the
    target accuracy (None, with the reason, when it failed or never reached it)."""
    world = 2 * args.per_node
    slow = [str(r) for r in range(args.per_node, world)]  # mpirun fills node 0 first
    python = nodes.node_python(sim)
    argv = [*python, "-m", "benchmarks.digits_curve", *MODES[mode],
            f"--epochs={args.epochs}", f"--accuracy_curve={curve_path}",
            f"--accuracy_curve_every={args.curve_every}",
            f"--slow_ranks={','.join(slow)}", f"--slow_ms={delay:g}"]
    env = {k: v for k, v in subprocess_env({"TF_SMB_TIMEOUT": str(int(args.timeout))}).items()
           if (k.startswith("TF_SMB_") and not k.startswith("TF_SMB_TEST_")) or k in ("PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL",
                                                  "TF_ENABLE_ONEDNN_OPTS", "PYTHONUNBUFFERED")}
    env.update(sim.preload_env(python))
    job = nodes.run_mpirun(sim, argv, env, args.timeout, per_node=args.per_node)
    # Rank 0's lines whole: mpirun --tag-output may split a line between ranks' chunks.
    said = simnodes.rank_output(0, *job.outputs)
    final = re.search(r"^test accuracy: ([0-9.]+)", said, re.MULTILINE)
    if not job.ok or final is None or not curve_path.exists():
        excerpt = error_excerpt(job.outputs)
        print(f"--- {LABELS[mode]}, delay {delay:g} ms failed:\n{excerpt[-3000:]}\n---",
              file=sys.stderr, flush=True)
        return Cell(None, failure_reason(job.reason or "no test accuracy line or curve",
                                         job.outputs), detail={"output": excerpt})
    curve = json.loads(curve_path.read_text())
    last = curve[-1] if curve else {}
    detail = {"curve": curve, "final_accuracy": float(final.group(1)), "job_s": job.seconds,
              "rank0_batches_per_s": (last["batches"] / last["train_s"]
                                      if last.get("train_s") else None)}
    reached = seconds_to(curve, args.target_accuracy)
    return Cell(reached, "" if reached is not None else
                f"never reached {args.target_accuracy} (best "
                f"{max((p['test_accuracy'] for p in curve), default=0.0):.3f})", detail=detail)


def median_cell(cells: List[Cell]) -> Cell:
    """The median seconds of the runs that reached the target (n/a if none did); the
    first run's details (its curve is the one plotted)."""
    reached = [c.value for c in cells if c.value is not None]
    first = next((c for c in cells if c.value is not None), cells[0])
    return Cell(statistics.median(reached) if reached else None, first.reason,
                detail=dict(first.detail, runs=[c.value for c in cells],
                            final_accuracy=statistics.median(
                                [c.detail["final_accuracy"] for c in cells
                                 if "final_accuracy" in c.detail] or [math.nan])))


def plot(path: pathlib.Path, delays: Sequence[float], modes: Sequence[str],
         cells: Dict[tuple, Cell], target: float, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(delays), figsize=(5.5 * len(delays), 4.2), squeeze=False,
                             sharey=True)
    for ax, delay in zip(axes[0], delays):
        for mode in modes:
            curve = cells[(delay, mode)].detail.get("curve") or []
            if curve:
                ax.plot([p["train_s"] for p in curve], [p["test_accuracy"] for p in curve],
                        color=COLORS[mode], label=LABELS[mode], marker=".", markersize=3)
        ax.axhline(target, color="gray", linestyle="--", linewidth=0.8)
        ax.set_title("no straggler" if delay == 0 else
                     f"node 1's workers sleep {delay:g} ms a step")
        ax.set_xlabel("rank 0's training seconds")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("test accuracy (rank 0's weights)")
    axes[0][0].legend(loc="lower right", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    delays = [float(d) for d in common.split_list(args.delays, "")]
    modes = common.split_list(args.modes, "")
    if [m for m in modes if m not in MODES] or args.link not in nodes.LINKS or args.per_node < 1:
        raise SystemExit(f"--modes from {list(MODES)}, --link from {list(nodes.LINKS)}, "
                         "--per_node >= 1")
    started = time.time()
    cells: Dict[tuple, Cell] = {}
    with tempfile.TemporaryDirectory(prefix="tf_smb_straggler_") as tmp:
        sim = simnodes.SimulatedNodes().__enter__()
        try:
            label, rate, _ = nodes.LINKS[args.link]
            applied, note = nodes.shape(sim, rate)
            for delay in delays:
                for mode in modes:
                    runs = []
                    for i in range(args.repeats):
                        path = pathlib.Path(tmp) / f"curve_{mode}_{delay:g}_{i}.json"
                        runs.append(run_one(sim, args, mode, delay, path))
                        c = runs[-1]
                        print(f"[{time.time() - started:5.0f} s] {LABELS[mode]}, delay "
                              f"{delay:g} ms: {fmt(c.value, '.3g')} s to "
                              f"{args.target_accuracy} ({c.reason or 'ok'}), final accuracy "
                              f"{fmt(c.detail.get('final_accuracy'), '.3f')}", flush=True)
                    cells[(delay, mode)] = median_cell(runs)
        finally:
            try:
                nodes.unshape(sim)
            finally:
                sim.close()
    return report(args, out_dir, started, delays, modes, cells, label, applied, note)


def report(args, out_dir, started, delays, modes, cells, label, applied, note) -> int:
    world = 2 * args.per_node
    rows, csv_rows = [], []
    for delay in delays:
        sync = cells.get((delay, "sync"), Cell()).value
        horovod = cells.get((delay, "horovod"), Cell()).value
        for mode in modes:
            c = cells[(delay, mode)]
            d = c.detail
            rows.append([f"{delay:g}", LABELS[mode], fmt(c.value, ".3g"),
                         fmt(ratio(sync, c.value), ".2f"), fmt(ratio(horovod, c.value), ".2f"),
                         fmt(d.get("final_accuracy"), ".3f"),
                         fmt(d.get("rank0_batches_per_s"), ".3g"), fmt(d.get("job_s"), ".3g")])
            csv_rows.append([f"{delay:g}", mode, "n/a" if c.value is None else f"{c.value:.6g}",
                             d.get("final_accuracy"), d.get("rank0_batches_per_s"),
                             d.get("job_s"), c.reason])
    title = (f"keras_digits on 2 simulated nodes x {args.per_node} workers, {label}; "
             f"node 1's workers slowed")
    md = (f"# A straggler across nodes\n\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}"
          f", {world} workers on 2 simulated nodes (tests/simnodes.py), link {label} "
          f"({applied}{'; ' + note if note else ''}). Command: `python -m benchmarks.straggler "
          f"{'--smoke ' if args.smoke else ''}--out_dir {args.out_dir}`.\n\n"
          + markdown(["node 1 sleeps ms/step", "mode", f"s to {args.target_accuracy}",
                      "SMB sync / this", "Horovod-MPI / this", "final test accuracy", "rank 0 batches/s", "job s"], rows)
          + f"\n\nexamples/keras_digits.py ({args.epochs} epochs, global batch 64) through "
          "benchmarks/digits_curve.py; s to accuracy: rank 0's training seconds until its "
          f"weights first reach {args.target_accuracy} on the test set (checked after every "
          f"{args.curve_every} of its batches and at each epoch's end; median of "
          f"{args.repeats} run(s)). Rank 0 is on node 0 and never sleeps. X / this > 1: "
          "this mode reached the target faster than X.\n")
    na = [(k, c.reason) for k, c in cells.items() if c.value is None]
    if na:
        md += "\n## n/a\n\n" + "\n".join(
            f"* {LABELS[m]}, delay {d:g} ms: {why}" for (d, m), why in na) + "\n"
    (out_dir / "straggler.md").write_text(md)
    print(md, flush=True)
    write_csv(out_dir / "straggler.csv", ["delay_ms", "mode", "s_to_target", "final_accuracy",
                                          "rank0_batches_per_s", "job_s", "reason"], csv_rows)
    (out_dir / "straggler.json").write_text(json.dumps({
        "args": {k: v for k, v in vars(args).items() if k != "report_from"},
        "started": started, "link": label, "qdisc": applied + ("; " + note if note else ""),
        "cells": [{"delay_ms": d, "mode": m, "value": c.value, "reason": c.reason, **c.detail}
                  for (d, m), c in cells.items()]}, indent=1))
    plot(out_dir / "straggler.png", delays, modes, cells, args.target_accuracy, title)
    # Every run must have finished with a curve (reaching the target is the measurement,
    # not a requirement, except in a smoke run whose target is low).
    failed = [k for k, c in cells.items() if not c.detail.get("curve")
              or (args.smoke and c.value is None)]
    if failed:
        print(f"runs without a result: {failed}", file=sys.stderr)
        return 1
    return 0


def report_from(path: str, out_dir: str) -> int:
    """The table, CSV and plot again, from a run's straggler.json, into `out_dir`."""
    data = json.loads(pathlib.Path(path).read_text())
    args = argparse.Namespace(**data["args"])
    cells = {}
    for item in data["cells"]:
        item = dict(item)
        key = (item.pop("delay_ms"), item.pop("mode"))
        cells[key] = Cell(item.pop("value"), item.pop("reason"), detail=item)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    delays = list(dict.fromkeys(d for d, _ in cells))
    modes = list(dict.fromkeys(m for _, m in cells))
    applied, _, note = data["qdisc"].partition("; ")
    return report(args, out, data["started"], delays, modes, cells, data["link"], applied,
                  note)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = common.parse_driver_args(
        "python -m benchmarks.straggler", __doc__.split("\n\n")[0], argv, "bench_straggler",
        "1 worker a node, 2 epochs, one delay, unshaped link", FULL, SMOKE, "straggler.json")
    if args.report_from:
        return report_from(args.report_from, args.out_dir)
    return nodes.run_stoppable(run, args)


if __name__ == "__main__":
    sys.exit(main())
