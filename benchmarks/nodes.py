"""The cross-node benchmark: 2 simulated nodes, every strategy side by side in one run.

On two simulated nodes of this machine (tests/simnodes.py: a network namespace each,
joined by a veth pair; a private /dev/shm each; mpirun across them), for each shape of
the link (`--links`: unshaped, 10 Gbit/s, 5 Gbit/s; `tc qdisc` tbf on both veth ends,
inside the namespaces, with netem's 20 us delay where the kernel has netem) and each
layout (`--layouts`: 2x2 = 2 nodes x 2 workers, 2x1 = 2 nodes x 1 worker):

1. the link itself: one TCP stream's rate one way, two streams' (one each way at once)
   and the median round trip of 1 byte (benchmarks/roles/nodes_link.py);
2. all-reduce of the ResNet-50 and VGG-16 gradient sets (float32 trainable-variable
   shapes) for SMB hierarchical (tf_smb.allreduce under mpirun across the nodes: tf_smb
   finds the job spans nodes from OMPI_COMM_WORLD_LOCAL_SIZE), Horovod-MPI flat
   (hvd.grouped_allreduce under mpirun), Horovod with HOROVOD_HIERARCHICAL_ALLREDUCE=1
   and MultiWorkerMirroredStrategy (RING, TF_CONFIG with the nodes' veth addresses):
   benchmarks/roles/nodes_comm.py, a barrier before each step, rank 0's times;
3. the SMB async step (one segments_push_read that reads every parameter, one that pushes
   a delta for each, as benchmarks/roles/async_steps.py), every worker's steps back to back;
4. the bytes that crossed the link per step for each of 2 and 3: the veth counters
   (rx_bytes + tx_bytes in node 0's namespace) read by rank 0 before and after the
   timed steps, over the steps (async: a step = one step of every worker);
5. model.fit throughput of the small CNN, the MLP and the 11.6M-parameter MLP
   (benchmarks/roles/fit.py) for SMBStrategy sync and HorovodStrategy under mpirun
   across the nodes (in the same jobs as SMB sync's and Horovod flat's steps, after them:
   the workers start once), and for SMBStrategy async (a job of its own).

The floor of an all-reduce between two nodes: every gradient byte crosses the link
once each way, so bytes / link rate (one way; both ways run at once); the link rate is
the shaped rate, or for the unshaped veth the measured one-way rate of one stream.

Everything goes to `--out_dir`: nodes.md (the tables, ratios, targets, failures; also
printed), nodes.csv (every number), nodes.json (every timing) and nodes.png.
A strategy that cannot run reads n/a with the reason; the run goes on. Every job has a
timeout (`--timeout`), after which everything in the nodes is killed; the shaping and
the nodes are always removed at the end.

    python -m benchmarks.nodes --out_dir=/tmp/bench_nodes          # everything (~90 min)
    python -m benchmarks.nodes --smoke --out_dir=/tmp/nodes_smoke  # ~3 min, MLP, 2x2, 10 Gbit/s
    python -m benchmarks.nodes --links=5gbit --models=resnet50 --fit_models=mlp,mlp10m

Needs root (namespaces, tc) and Open MPI's mpirun; run from the checkout's root.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from benchmarks import common
from benchmarks.processes import PYTHON_VAR, role_argv, run_processes, subprocess_env


def node_role_argv(role: str, *args: str, python: Optional[List[str]] = None) -> List[str]:
    """A role run inside a simulated node: `python` (see node_python), else its own
    interpreter; never this node's fork server (whose forks would run in this
    node's namespaces)."""
    if python:
        return [*python, "-m", f"benchmarks.roles.{role}", *args]
    return role_argv(role, *args, local=False)


def node_python(sim: "simnodes.SimulatedNodes") -> List[str]:
    """How the jobs' ranks in the simulated nodes start Python: where the tests point
    the benchmarks at a fork server ($TF_SMB_BENCH_PYTHON), the nodes' own
    (tests/simnodes.py: TensorFlow imported once a node, not once a rank); else this
    interpreter, so that a full run's processes are what a user's are. The ranks'
    environment needs sim.preload_env(python) too."""
    return sim.python() if os.environ.get(PYTHON_VAR) else [sys.executable]
from benchmarks.report import Cell, error_excerpt, failure_reason, fmt, markdown, ratio, write_csv
from benchmarks.strategies import availability

sys.path.insert(0, str(common.REPO_ROOT / "tests"))
import simnodes  # noqa: E402  (tests/simnodes.py: the simulated nodes)

PER_NODE = 2  # workers per node unless --layouts says otherwise
# name -> workers per node ("2x1": 2 nodes x 1 worker)
LAYOUTS = {"2x2": 2, "2x1": 1}
# name -> (label, tc rate or None, rate in bit/s or None)
LINKS: Dict[str, Tuple[str, Optional[str], Optional[float]]] = {
    "unshaped": ("unshaped veth", None, None),
    "10gbit": ("10 Gbit/s", "10gbit", 10e9),
    "5gbit": ("5 Gbit/s", "5gbit", 5e9),
}
DELAY = "20us"
COMM = ("smb_sync", "horovod_mpi", "horovod_hier", "mwms", "smb_async")
LABELS = {"smb_sync": "SMB sync (hierarchical)", "horovod_mpi": "Horovod-MPI flat",
          "horovod_hier": "Horovod-MPI hierarchical", "mwms": "MWMS-RING",
          "smb_async": "SMB async step", "floor": "floor (bytes / link)",
          "smb_fit": "SMB sync", "smb_async_fit": "SMB async", "horovod_fit": "Horovod-MPI"}
COLORS = {"smb_sync": "tab:red", "horovod_mpi": "tab:blue", "horovod_hier": "tab:purple",
          "mwms": "tab:green", "smb_async": "tab:orange", "smb_fit": "tab:red",
          "smb_async_fit": "tab:orange", "horovod_fit": "tab:blue"}
FIT = ("smb_fit", "smb_async_fit", "horovod_fit")
FIT_KINDS = {"smb_fit": "smb_sync", "smb_async_fit": "smb_async", "horovod_fit": "horovod"}
FULL = dict(models="resnet50,vgg16", links="unshaped,10gbit,5gbit", layouts="2x2,2x1",
            iters=10, warmup=2, fit_models="cnn,mlp,mlp10m", fit_epochs=5, fit_batch=256,
            samples="cnn:8192,mlp:32768,mlp10m:4096", timeout=900.0, link_seconds=2.0,
            combine_pushes=1)
SMOKE = dict(models="mlp", links="10gbit", layouts="2x2", iters=40, warmup=1, fit_models="mlp",
             fit_epochs=2, fit_batch=64, samples="mlp:512", timeout=240.0, link_seconds=0.5,
             combine_pushes=1)
# Required numbers of a smoke run (others, e.g. MWMS, may read n/a with a reason).
SMOKE_REQUIRED = ("smb_sync", "horovod_mpi", "horovod_hier", "smb_async")


class Stop(Exception):
    """SIGTERM/SIGHUP: leave through the finally blocks (shaping and nodes removed)."""


@dataclasses.dataclass
class Job:
    ok: bool
    outputs: List[str]
    reason: str
    seconds: float
    load: float = dataclasses.field(default_factory=lambda: os.getloadavg()[0])  # at the end


# =========================================================================== the nodes

def tc(nodes: simnodes.SimulatedNodes, node: int, *args: str) -> subprocess.CompletedProcess:
    """`tc ARGS` inside node `node`'s network namespace."""
    return subprocess.run(["ip", "netns", "exec", nodes.netns[node], "tc", *args],
                          capture_output=True, text=True, timeout=30)


def unshape(nodes: simnodes.SimulatedNodes) -> None:
    for node, dev in enumerate(nodes.veth):
        tc(nodes, node, "qdisc", "del", "dev", dev, "root")  # fails when there is none


def shape(nodes: simnodes.SimulatedNodes, rate: Optional[str]) -> Tuple[str, str]:
    """Shapes both veth ends (egress) to `rate` with DELAY (netem, when the kernel has it,
    under a tbf); (the qdisc applied, a note on what could not be). None: unshaped."""
    unshape(nodes)
    if rate is None:
        return "none (pfifo)", ""
    tbf = ["tbf", "rate", rate, "burst", "1mb", "latency", "1ms"]
    applied, note = f"netem delay {DELAY} + tbf rate {rate} burst 1mb latency 1ms", ""
    for node, dev in enumerate(nodes.veth):
        p = tc(nodes, node, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
               "delay", DELAY)
        if p.returncode == 0:
            q = tc(nodes, node, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:",
                   *tbf)
        else:
            note = (f"no {DELAY} delay: `tc qdisc add ... netem` failed "
                    f"({p.stderr.strip() or p.returncode}): this kernel has no netem "
                    "(CONFIG_NET_SCH_NETEM); the rate alone is shaped")
            applied = "tbf rate " + rate + " burst 1mb latency 1ms (no netem)"
            tc(nodes, node, "qdisc", "del", "dev", dev, "root")
            q = tc(nodes, node, "qdisc", "add", "dev", dev, "root", *tbf)
        if q.returncode != 0:
            raise RuntimeError(f"tc could not shape {dev}: {q.stderr.strip()}")
    return applied, note


def measure_link(nodes: simnodes.SimulatedNodes, env: Dict[str, str], seconds: float,
                 port: int) -> dict:
    """One stream node 0 -> node 1 (with 200 round trips first), then one each way at
    once: {"one_way_gbit", "both_ways_gbit" (the slower direction), "rtt_us"}."""
    def pair(src: int, dst: int, p: int, pings: int):
        server = nodes.start(dst, node_role_argv("nodes_link", "serve", "--bind",
                                            nodes.addresses[dst], "--port", str(p),
                                            "--pings", str(pings), "--wait", "60"), env)
        client = nodes.start(src, node_role_argv("nodes_link", "send", "--to", nodes.addresses[dst],
                                            "--port", str(p), "--pings", str(pings),
                                            "--seconds", str(seconds), "--wait", "60"), env)
        return server, client

    def results(runs) -> List[dict]:
        found = []
        for server, client in runs:
            launch = client.wait(120)
            server.wait(60)
            r = common.parse_tagged(launch.stdout)
            if not r:
                raise RuntimeError(f"link test failed: {launch.stderr[-1000:]}")
            found.append(r[0])
        return found

    one = results([pair(0, 1, port, 200)])[0]
    both = results([pair(0, 1, port + 1, 0), pair(1, 0, port + 2, 0)])
    return {"one_way_gbit": one["gbit_s"], "rtt_us": one["rtt_us"],
            "both_ways_gbit": min(r["gbit_s"] for r in both),
            "runs": {"one_way": one, "both_ways": both}}


def run_mpirun(nodes: simnodes.SimulatedNodes, argv: List[str], env: Dict[str, str],
               timeout: float, per_node: int = PER_NODE) -> Job:
    """mpirun of `argv` on 2 nodes x `per_node`; everything in the nodes killed on a
    timeout."""
    start = time.monotonic()
    try:
        launch = nodes.mpirun(2 * per_node, per_node, argv, timeout, env)
    except simnodes.NodesTimeout as e:
        return Job(False, [str(e)], f"timed out after {timeout:.0f} s (killed)",
                   time.monotonic() - start)
    ok = launch.returncode == 0
    return Job(ok, [launch.stdout + "\n" + launch.stderr],
               "" if ok else f"mpirun exited with {launch.returncode}", launch.seconds)


def run_mwms(nodes: simnodes.SimulatedNodes, argv: List[str], env: Dict[str, str],
             timeout: float, port: int, per_node: int = PER_NODE) -> Job:
    """2 x `per_node` processes of `argv`, TF_CONFIG naming the nodes' veth addresses;
    the others are killed as soon as one fails."""
    world = 2 * per_node
    hosts = [f"{nodes.addresses[i // per_node]}:{port + i}" for i in range(world)]
    start = time.monotonic()
    runs = [nodes.start(i // per_node, argv, dict(env, TF_CONFIG=json.dumps(
        {"cluster": {"worker": hosts}, "task": {"type": "worker", "index": i}})))
        for i in range(world)]
    ends: List[object] = [None] * world

    def wait(i: int) -> None:
        try:
            ends[i] = runs[i].wait(timeout)
        except simnodes.NodesTimeout as e:
            ends[i] = e

    threads = [threading.Thread(target=wait, args=(i,), daemon=True) for i in range(world)]
    for t in threads:
        t.start()
    failed = None
    while any(t.is_alive() for t in threads):
        codes = [r.proc.poll() for r in runs]
        bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if bad and failed is None:
            failed = f"process {bad[0]} exited with {codes[bad[0]]}"
            time.sleep(1.0)  # its peers' own errors first
            nodes.kill_processes()
        time.sleep(0.2)
    for t in threads:
        t.join()
    outputs, timed_out = [], False
    for end in ends:
        if isinstance(end, simnodes.Launch):
            outputs.append(end.stdout + "\n" + end.stderr)
        else:
            timed_out = True
            outputs.append(str(end))
    reason = failed or (f"timed out after {timeout:.0f} s (killed)" if timed_out else "")
    if not reason and any(r.proc.returncode != 0 for r in runs):
        reason = "a process failed"
    return Job(not reason, outputs, reason, time.monotonic() - start)


# =========================================================================== measuring

def link_bytes(result: dict) -> Dict[str, float]:
    """Bytes that crossed the link per step: {"total", "tx" (node 0 -> 1), "rx"}."""
    steps = result["steps"]
    tx = result["link_after"]["tx"] - result["link_before"]["tx"]
    rx = result["link_after"]["rx"] - result["link_before"]["rx"]
    return {"total": (tx + rx) / steps, "tx": tx / steps, "rx": rx / steps}


def comm_cells(strategy: str, job: Job, models: Sequence[str], world: int
               ) -> Dict[Tuple[str, str], Cell]:
    """(model, strategy) cells from a nodes_comm job; strategy smb_sync also gives smb_async."""
    found: Dict[Tuple[str, str], List[dict]] = {}
    for out in job.outputs:
        for r in common.parse_tagged(out):
            if "step" not in r:  # a fit result
                continue
            name = "smb_async" if r.get("step") == "push" else strategy
            found.setdefault((r.get("set"), name), []).append(r)
    names = [strategy, "smb_async"] if strategy == "smb_sync" else [strategy]
    why = failure_reason(job.reason or "no result line", job.outputs)
    cells = {}
    for model in models:
        for name in names:
            rs = found.get((model, name), [])
            need = world if name == "smb_async" else 1
            first = [r for r in rs if r.get("rank") == 0]
            if len(rs) < need or not first:
                cells[(model, name)] = Cell(None, why)
                continue
            times = [t for r in rs for t in r["times_s"]]
            cells[(model, name)] = Cell(1e3 * statistics.median(times), detail={
                "times_s": [r["times_s"] for r in sorted(rs, key=lambda r: r["rank"])],
                "link": link_bytes(first[0]), "bytes": first[0]["bytes"],
                "home_bytes": first[0].get("home_bytes"), "job_s": job.seconds,
                "load_1min": job.load})
    return cells


def fit_cells(strategy: str, job: Job, models: Sequence[str], world: int
              ) -> Dict[Tuple[str, str], Cell]:
    from benchmarks.suite import fit_throughput  # pylint: disable=import-outside-toplevel
    found: Dict[str, List[dict]] = {}
    for out in job.outputs:
        for r in common.parse_tagged(out):
            if "samples_per_epoch" in r:
                found.setdefault(r.get("model"), []).append(r)
    cells = {}
    for model in models:
        rs = found.get(model, [])
        if len(rs) == world and all(r.get("median_step_s") for r in rs):
            sps, epoch_s, timed = fit_throughput(rs)
            cells[(model, strategy)] = Cell(sps, detail={
                "epoch_s": epoch_s, "epochs_timed": timed,
                "ranks_epoch_s": [r["epoch_s"] for r in rs],
                "median_step_s": [r["median_step_s"] for r in rs], "job_s": job.seconds,
                "load_1min": job.load})
        else:
            cells[(model, strategy)] = Cell(None, failure_reason(job.reason or "no result line",
                                                                  job.outputs))
    return cells


# =========================================================================== reporting

def floor_ms(nbytes: float, gbit: Optional[float]) -> Optional[float]:
    return 1e3 * 8 * nbytes / (gbit * 1e9) if gbit else None


def mb(x: Optional[float]) -> str:
    return fmt(None if x is None else x / 2**20, ".4g")


def target_rows(links: Sequence[str], models: Sequence[str], link_info: Dict[str, dict],
                comm: Dict[Tuple[str, str, str], Cell], model_bytes: Dict[str, int]
                ) -> List[List[str]]:
    def row(what, measured, goal, ok):
        return [what, measured, goal, "n/a" if ok is None else ("met" if ok else "missed")]

    rows = []
    for link in links:
        gbit = link_info[link].get("floor_gbit")
        for model in models:
            where = f"{model}, {link_info[link]['label']}"
            get = lambda s: comm.get((link, model, s), Cell(None, "not measured"))  # noqa: E731
            smb, flat, hier, asy = (get("smb_sync"), get("horovod_mpi"), get("horovod_hier"),
                                    get("smb_async"))
            floor = floor_ms(model_bytes[model], gbit)
            r = ratio(smb.value, floor)
            smb_link = smb.detail.get("link", {})
            rows.append(row(
                f"SMB sync within 1.25x of the floor ({where})",
                f"{fmt(r, '.2f')}x (SMB {fmt(smb.value)} ms, floor {fmt(floor)} ms at "
                f"{fmt(gbit, '.3g')} Gbit/s; SMB moved {mb(smb_link.get('total'))} MB/step, "
                f"{fmt(ratio(smb_link.get('total'), 2 * model_bytes[model]), '.2f')}x the "
                "minimum)" if r else f"n/a ({smb.reason or 'no floor'})",
                "<= 1.25x", None if r is None else r <= 1.25))
            for other in (flat, hier):
                name = "Horovod-MPI flat" if other is flat else "Horovod-MPI hierarchical"
                r = ratio(other.value, smb.value)
                rows.append(row(
                    f"SMB sync faster than {name} ({where})",
                    f"{fmt(r, '.2f')}x ({name} {fmt(other.value)} ms, SMB {fmt(smb.value)} ms)"
                    if r else f"n/a ({other.reason or smb.reason})", "> 1x",
                    None if r is None else r > 1))
            # The 1.4x target holds where the link is the bottleneck: where Horovod flat's
            # own bytes (the busier direction) need at least half its step on the link.
            r = ratio(flat.value, smb.value)
            flat_link = flat.detail.get("link")
            link_ms = (floor_ms(max(flat_link["tx"], flat_link["rx"]), gbit)
                       if flat_link and gbit else None)
            share = ratio(link_ms, flat.value)
            if r is None or share is None:
                rows.append(row(f">= 1.4x Horovod-MPI flat where the link is the bottleneck "
                                f"({where})", f"n/a ({flat.reason or smb.reason})", ">= 1.4x",
                                None))
            elif share < 0.5:
                rows.append(row(
                    f">= 1.4x Horovod-MPI flat where the link is the bottleneck ({where})",
                    "n/a: link not the bottleneck (Horovod flat's "
                    f"{mb(max(flat_link['tx'], flat_link['rx']))} MB/direction need "
                    f"{fmt(link_ms)} ms on the link, {100 * share:.0f}% of its "
                    f"{fmt(flat.value)} ms step); measured {r:.2f}x", ">= 1.4x", None))
            else:
                rows.append(row(
                    f">= 1.4x Horovod-MPI flat where the link is the bottleneck ({where})",
                    f"{r:.2f}x (link {100 * share:.0f}% of Horovod flat's step: "
                    f"{fmt(link_ms)} of {fmt(flat.value)} ms)", ">= 1.4x", r >= 1.4))
            r = ratio(flat.value, asy.value)
            al, fl = asy.detail.get("link", {}), flat.detail.get("link", {})
            over_minimum = ratio(al.get("total"), 2 * model_bytes[model])
            if r is None:
                measured = f"n/a ({asy.reason or flat.reason})"
            else:
                measured = (f"{r:.2f}x (async step {fmt(asy.value)} ms, Horovod flat "
                            f"{fmt(flat.value)} ms)")
            rows.append(row(f"SMB async step >= 2x faster than Horovod-MPI flat ({where})",
                            measured, ">= 2x", None if r is None else r >= 2))
            # The minimum: every gradient byte once each way, as an all-reduce moves.
            if over_minimum is None:
                measured = f"n/a ({asy.reason or 'no link counters'})"
            else:
                measured = (
                    f"{over_minimum:.2f}x (an async step, one step of every worker: "
                    f"{mb(al.get('total'))} MB, {mb(al.get('tx'))} MB node0->1, "
                    f"{mb(al.get('rx'))} MB node1->0; the minimum "
                    f"{mb(2 * model_bytes[model])} MB; Horovod flat {mb(fl.get('total'))} MB, "
                    f"SMB sync {mb(smb_link.get('total'))} MB)")
            rows.append(row(f"SMB async step's bytes on the link <= 1.05x the minimum ({where})",
                            measured, "<= 1.05x",
                            None if over_minimum is None else over_minimum <= 1.05))
    return rows


def plot(path: pathlib.Path, links: Sequence[str], labels: Dict[str, str],
         models: Sequence[str],
         comm: Dict[Tuple[str, str, str], Cell], floors: Dict[Tuple[str, str], Optional[float]],
         fit: Dict[Tuple[str, str, str], Cell], fit_models: Sequence[str],
         model_bytes: Dict[str, int]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = len(models) + (1 if fit_models else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 5.0), squeeze=False)
    for ax, model in zip(axes[0], models):
        width = 0.8 / len(COMM)
        for i, s in enumerate(COMM):
            for j, link in enumerate(links):
                cell = comm.get((link, model, s), Cell())
                x = j + (i - (len(COMM) - 1) / 2) * width
                ax.bar(x, cell.value or 0.0, width, color=COLORS[s],
                       label=LABELS[s] if j == 0 else None)
                if cell.value is None:
                    ax.text(x, 1.0, "n/a", rotation=90, ha="center", va="bottom", fontsize=7)
        for j, link in enumerate(links):
            f = floors.get((link, model))
            if f:
                ax.hlines(f, j - 0.45, j + 0.45, colors="black", linestyles="--",
                          label=LABELS["floor"] if j == 0 else None)
        ax.set_yscale("log")
        ax.set_xticks(range(len(links)))
        ax.set_xticklabels([labels[l] for l in links], fontsize=8)
        ax.set_title(f"{model} all-reduce / async step ({model_bytes[model] / 2**20:.0f} MB)")
        ax.set_ylabel("ms per step (log, lower is better)")
        ax.grid(True, axis="y", which="both", alpha=0.3)
    if fit_models:
        ax = axes[0][-1]
        series = [(m, s) for m in fit_models for s in FIT]
        width = 0.8 / len(series)
        for i, (m, s) in enumerate(series):
            for j, link in enumerate(links):
                cell = fit.get((link, m, s), Cell())
                x = j + (i - (len(series) - 1) / 2) * width
                ax.bar(x, cell.value or 0.0, width, color=COLORS[s],
                       hatch="//" if m == "cnn" else None, edgecolor="white",
                       label=f"{LABELS[s]}, {m}" if j == 0 else None)
        ax.set_xticks(range(len(links)))
        ax.set_xticklabels([labels[l] for l in links], fontsize=8)
        ax.set_title("model.fit throughput (higher is better)")
        ax.set_ylabel("samples/s")
        ax.grid(True, axis="y", alpha=0.3)
    handles: Dict[str, object] = {}
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=5,
               fontsize=8, frameon=False)
    fig.suptitle("2 simulated nodes x 1 or 2 workers (the rows' layouts), across a veth link")
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# =========================================================================== the run

def run(args: argparse.Namespace) -> int:
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    load = os.getloadavg()
    models = common.split_list(args.models, "")
    links = common.split_list(args.links, "")
    layouts = common.split_list(args.layouts, "")
    fit_models = common.split_list(args.fit_models, "")
    samples = {k: int(v) for k, _, v in (s.partition(":") for s in args.samples.split(","))}
    for link in links:
        if link not in LINKS:
            raise SystemExit(f"--links: unknown {link!r}; known: {', '.join(LINKS)}")
    for layout in layouts:
        if layout not in LAYOUTS:
            raise SystemExit(f"--layouts: unknown {layout!r}; known: {', '.join(LAYOUTS)}")
    tmp = tempfile.TemporaryDirectory(prefix="tf_smb_nodes_")
    shapes_path = pathlib.Path(tmp.name) / "shapes.json"
    env = subprocess_env({common.SHAPES_ENV: str(shapes_path)})

    def log(text: str) -> None:
        print(f"[{time.time() - started:6.0f} s] {text}", flush=True)

    ok, outputs, reason = run_processes(
        [(role_argv("probe", f"--models={','.join(models)}", f"--shapes_out={shapes_path}"),
          env)], args.timeout)
    probe = [r["probe"] for r in common.parse_tagged(outputs[0]) if "probe" in r]
    if not ok or not probe:
        print(f"the probe failed ({reason}):\n{error_excerpt(outputs)}", file=sys.stderr)
        return 1
    info = probe[0]
    model_bytes = {m: info["models"][m]["bytes"] for m in models}
    total = sum(model_bytes.values())
    unavailable = availability(info)
    unavailable["horovod_hier"] = unavailable["horovod_mpi"]
    job_env = {"TF_ENABLE_ONEDNN_OPTS": "0", common.SHAPES_ENV: str(shapes_path),
               "TF_SMB_TIMEOUT": str(int(args.timeout)),
               # room for the sums and the async segments of every set, with a
               # node's pending sum, copy and fetched value of each remote one (sparse)
               "TF_SMB_HEAP_BYTES": str(4 * total + (256 << 20))}
    if not args.combine_pushes:  # each async worker pushes and fetches on its own
        job_env["TF_SMB_COMBINE_PUSHES"] = "0"
    steps = [f"--iters={args.iters}", f"--warmup={args.warmup}", f"--sets={','.join(models)}"]

    link_info: Dict[str, dict] = {}
    comm: Dict[Tuple[str, str, str], Cell] = {}
    fit: Dict[Tuple[str, str, str], Cell] = {}
    failures: List[Tuple[str, str, str]] = []
    port = 23400

    def note_failure(what: str, job: Job) -> None:
        why = failure_reason(job.reason or "no result line", job.outputs)
        excerpt = error_excerpt(job.outputs)
        failures.append((what, why, excerpt))
        print(f"--- {what} failed: {why}\n{excerpt[-3000:]}\n---", file=sys.stderr, flush=True)

    def run_layout(row: str, label: str, per_node: int, port: int) -> int:
        """Every strategy's jobs on `per_node` workers a node, the link as shaped;
        their cells under `row`. Returns the next free port."""
        world = 2 * per_node
        iface = ["--iface", nodes.veth[0]]
        fit_args = [f"--fit_models={','.join(fit_models)}", f"--fit_epochs={args.fit_epochs}",
                    f"--fit_batch={args.fit_batch}",
                    "--samples=" + ",".join(f"{m}:{samples[m]}" for m in fit_models)]
        for strategy in (*COMM[:-1], "smb_async_fit"):
            t0 = time.perf_counter()
            # model.fit rides in the SMB sync and Horovod flat jobs (after the steps);
            # async fit has a job of its own (a process runs one mode).
            fit_strategy = {"smb_sync": "smb_fit", "horovod_mpi": "horovod_fit",
                            "smb_async_fit": "smb_async_fit"}.get(strategy) if fit_models else None
            if strategy == "smb_async_fit" and not fit_strategy:
                continue
            job = None
            cells: Dict[Tuple[str, str], Cell] = {}
            unavailable_here = unavailable.get("smb_sync" if strategy == "smb_async_fit"
                                               else strategy)
            if unavailable_here:
                cells = {(m, strategy): Cell(None, "unavailable: " + unavailable_here)
                         for m in models} if strategy != "smb_async_fit" else {}
            elif strategy == "smb_async_fit":
                job = run_mpirun(nodes, node_role_argv("fit", "--kind=smb_async", *fit_args,
                                                python=python),
                                 dict(job_env), args.timeout, per_node)
            elif strategy == "mwms":
                job = run_mwms(nodes, node_role_argv("nodes_comm", "--kind=mwms", *steps, *iface,
                                              python=python),
                               dict(env, **job_env), args.timeout, port, per_node)
                port += 10
                cells = comm_cells(strategy, job, models, world)
            else:
                kind = "smb" if strategy == "smb_sync" else "horovod"
                extra = ["--push"] if strategy == "smb_sync" else []
                if fit_strategy:
                    extra += [f"--fit_kind={FIT_KINDS[fit_strategy]}", *fit_args]
                e = dict(job_env)
                if strategy == "horovod_hier":
                    e["HOROVOD_HIERARCHICAL_ALLREDUCE"] = "1"
                job = run_mpirun(nodes, node_role_argv("nodes_comm", f"--kind={kind}", *steps,
                                                       *iface, *extra, python=python), e, args.timeout,
                                 per_node)
                cells = comm_cells(strategy, job, models, world)
            fcells = {}
            if fit_strategy:
                if job is None:
                    fcells = {(m, fit_strategy): Cell(None, "unavailable: " + unavailable_here)
                              for m in fit_models}
                else:
                    fcells = fit_cells(fit_strategy, job, fit_models, world)
            if job is not None and any(c.value is None for c in
                                       [*cells.values(), *fcells.values()]):
                note_failure(f"{label}: {LABELS[strategy]}", job)
            for (m, s), c in cells.items():
                comm[(row, m, s)] = c
            for (m, s), c in fcells.items():
                fit[(row, m, s)] = c
            log(f"{label}, {LABELS[strategy]}: " + ", ".join(
                f"{m} {LABELS[s] if s != strategy else ''} {fmt(c.value)} ms "
                f"({mb(c.detail.get('link', {}).get('total'))} MB/step on the link)"
                .replace("  ", " ") for (m, s), c in cells.items())
                + "".join(f", fit {m} {fmt(c.value, '.0f')} samples/s"
                          for (m, _), c in fcells.items())
                + f"  ({time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.1f})")
        return port

    nodes = simnodes.SimulatedNodes().__enter__()
    python = node_python(nodes)
    job_env.update(nodes.preload_env(python))
    nodes_info = {"netns": nodes.netns, "veth": nodes.veth, "hostnames": nodes.hostnames,
                  "addresses": nodes.addresses}
    log(f"nodes up: {nodes.hostnames}, veth {nodes.veth}, {nodes.addresses}")
    try:
        for link in links:
            label, rate, bits = LINKS[link]
            try:
                applied, note = shape(nodes, rate)
                measured = measure_link(nodes, env, args.link_seconds, port)
            except (RuntimeError, OSError, subprocess.SubprocessError,
                    simnodes.NodesTimeout) as e:
                # A link that cannot be shaped or measured: its cells read n/a, the run
                # goes on with the next shape.
                why = f"link {label}: {type(e).__name__}: {e}"
                for layout in layouts:
                    row = f"{layout} {link}"
                    link_info[row] = {"label": f"{layout}, {label}", "qdisc": "n/a",
                                      "note": why, "floor_gbit": None, "one_way_gbit": None,
                                      "both_ways_gbit": None, "rtt_us": None}
                    for m in models:
                        for strategy in COMM:
                            comm[(row, m, strategy)] = Cell(None, why)
                    for m in fit_models:
                        for strategy in FIT:
                            fit[(row, m, strategy)] = Cell(None, why)
                log(why)
                continue
            port += 10
            if rate and not note:
                label += f", {DELAY} delay"
            floor_gbit = bits / 1e9 if bits else measured["one_way_gbit"]
            log(f"link {label}: {applied}; one way {measured['one_way_gbit']:.2f} Gbit/s, both "
                f"ways {measured['both_ways_gbit']:.2f} Gbit/s each, rtt "
                f"{fmt(measured['rtt_us'], '.0f')} us {note}")
            for layout in layouts:
                row = f"{layout} {link}"
                row_label = f"{layout}, {label}"
                link_info[row] = {"label": row_label, "qdisc": applied, "note": note,
                                  "floor_gbit": floor_gbit, "layout": layout, **measured}
                port = run_layout(row, row_label, LAYOUTS[layout], port)
    finally:
        try:
            unshape(nodes)
        finally:
            nodes.close()
            tmp.cleanup()
        log("link unshaped, nodes removed")

    rows = [f"{layout} {link}" for link in links for layout in layouts]
    return report(args, out_dir, started, load, info, models, rows, fit_models, samples,
                  model_bytes, link_info, comm, fit, failures, nodes_info)


def report(args, out_dir, started, load, info, models, links, fit_models, samples,
           model_bytes, link_info, comm, fit, failures, nodes_info) -> int:
    """Writes and prints the tables; 1 when a number is missing (smoke), not finite or
    not positive."""
    labels = {l: link_info[l]["label"] for l in links}
    floors = {(l, m): floor_ms(model_bytes[m], link_info[l]["floor_gbit"])
              for l in links for m in models}
    csv_rows: List[List[object]] = []

    def csv_row(section, link, model, strategy, metric, value, unit, reason=""):
        csv_rows.append([section, link, model, strategy, metric,
                         "n/a" if value is None else f"{value:.6g}", unit,
                         "ok" if value is not None else "n/a", reason])

    sections = [
        "# tf_smb across nodes: 2 simulated nodes\n\n"
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, {platform.node()}, "
        f"Linux {platform.release()}, {info.get('cpus')} CPUs (load average at the start "
        f"{load[0]:.2f}; the machine is shared), Python {info.get('python')}, TensorFlow "
        f"{info.get('tensorflow')}, Keras {info.get('keras')}, Horovod "
        f"{info.get('horovod', 'n/a')}. Two network namespaces joined by a veth pair, a "
        f"private /dev/shm each, mpirun across them (tests/simnodes.py); each row's layout "
        f"is nodes x workers a node (2x2: 4 workers, 2x1: 2) on {info.get('cpus')} cores. "
        f"Command: `python -m benchmarks.nodes "
        f"{'--smoke ' if args.smoke else ''}--out_dir {args.out_dir}`."]

    # The link.
    rows = []
    for l in links:
        li = link_info[l]
        rows.append([li["label"], li["qdisc"], fmt(li["one_way_gbit"], ".3g"),
                     fmt(li["both_ways_gbit"], ".3g"), fmt(li["rtt_us"], ".0f"),
                     fmt(li["floor_gbit"], ".3g")])
        csv_row("link", l, "", "tcp", "one_way_gbit_s", li["one_way_gbit"], "Gbit/s",
                li["note"])
        csv_row("link", l, "", "tcp", "both_ways_gbit_s", li["both_ways_gbit"], "Gbit/s",
                li["note"])
        csv_row("link", l, "", "tcp", "rtt_us", li["rtt_us"], "us", li["note"])
    notes = sorted({link_info[l]["note"] for l in links if link_info[l]["note"]})
    sections.append(
        "## The link\n\n" + markdown(["link", "qdisc (both ends)", "one stream one way Gbit/s",
                                      "one stream each way at once Gbit/s", "round trip us",
                                      "floor uses Gbit/s"], rows) + "\n\n"
        "Measured with Python TCP streams between the nodes (benchmarks/roles/nodes_link.py; "
        "one Python stream is CPU-bound on this machine, so the unshaped rate is a lower "
        "bound of the veth's). The floor uses the shaped rate, or the unshaped link's measured "
        "one-way rate." + ("".join(f"\n\n**Note:** {n}." for n in notes)))

    # Communication.
    header = ["link", "model", "MB", "floor ms", *(f"{LABELS[s]} ms" for s in COMM)]
    rows, ratio_rows, byte_rows = [], [], []
    for l in links:
        for m in models:
            cells = [comm.get((l, m, s), Cell(None, "not run")) for s in COMM]
            rows.append([labels[l], m, f"{model_bytes[m] / 2**20:.4g}", fmt(floors[(l, m)]),
                         *(fmt(c.value) for c in cells)])
            g = {s: comm.get((l, m, s), Cell()).value for s in COMM}
            ratio_rows.append([labels[l], m, fmt(ratio(g["smb_sync"], floors[(l, m)]), ".2f"),
                               *(fmt(ratio(g[s], g["smb_sync"]), ".2f")
                                 for s in ("horovod_mpi", "horovod_hier", "mwms")),
                               fmt(ratio(g["horovod_mpi"], g["smb_async"]), ".2f")])
            brow = [labels[l], m, f"{2 * model_bytes[m] / 2**20:.4g}"]
            for s, c in zip(COMM, cells):
                lb = c.detail.get("link")
                brow.append(f"{mb(lb['total'])} ({lb['total'] / (2 * model_bytes[m]):.2f}x)"
                            if lb else "n/a")
                csv_row("comm", l, m, LABELS[s], "ms_per_step", c.value, "ms", c.reason)
                csv_row("comm", l, m, LABELS[s], "link_MB_per_step",
                        lb["total"] / 2**20 if lb else None, "MB", c.reason)
            byte_rows.append(brow)
            csv_row("comm", l, m, "floor", "ms_per_step", floors[(l, m)], "ms",
                    link_info[l]["note"])
    sections.append(
        "## All-reduce and async step across the nodes (ms per step)\n\n"
        + markdown(header, rows) + "\n\n"
        f"float32 gradient sets (MB = MiB); medians of {args.iters} timed steps after "
        f"{args.warmup} warm-up (each sum checked first). All-reduce: a barrier before each "
        "step, rank 0's times. SMB async step: one op reading every parameter, one pushing a "
        "delta for each, steps back to back, every worker's times "
        "(segments spread over the two nodes' boxes by bytes; every pushed value checked). "
        "Horovod hierarchical: HOROVOD_HIERARCHICAL_ALLREDUCE=1 (in Horovod 0.28 only its "
        "NCCL/GPU all-reduce is hierarchical, so on CPU tensors it runs the flat MPI "
        "all-reduce). Floor: the bytes once each way at the link rate.\n\n"
        "### Ratios (time / time)\n\n"
        + markdown(["link", "model", "SMB sync / floor",
                    *(f"{LABELS[s]} / SMB sync" for s in ("horovod_mpi", "horovod_hier", "mwms")),
                    "Horovod-MPI flat / SMB async"], ratio_rows) + "\n\n"
        "### Bytes across the link per step (MB, both directions; x the minimum)\n\n"
        + markdown(["link", "model", "minimum MB (once each way)",
                    *(LABELS[s] for s in COMM)], byte_rows) + "\n\n"
        "From the veth's rx_bytes + tx_bytes in node 0's namespace (headers included), read "
        "by rank 0 after a barrier before and after the timed steps, over the steps (the "
        "barriers' own bytes included). Async: one step = one step of each "
        "worker.")

    # The machine's load at the end of each job (it is shared: another's load slows
    # every strategy's steps, unevenly).
    loads = []
    for l in links if any("load_1min" in c.detail for c in comm.values()) else ():
        row = [labels[l]]
        for s in COMM[:-1]:
            c = next((c for (l2, _, s2), c in comm.items() if l2 == l and s2 == s
                      and "load_1min" in c.detail), None)
            row.append(fmt(c.detail["load_1min"], ".1f") if c else "n/a")
        loads.append(row)
    if loads:
        sections.append(
            "### Load average (1 min) at the end of each job\n\n"
            + markdown(["link", *(LABELS[s] for s in COMM[:-1])], loads) + "\n\n"
            f"Up to 4 workers on {info.get('cpus')} cores; above the row's workers, other "
            "processes (this machine is shared) competed for the cores during the job.")

    # Fit.
    if fit_models:
        rows = []
        for l in links:
            for m in fit_models:
                cells = [fit.get((l, m, s), Cell(None, "not run")) for s in FIT]
                sync, asy, hvd = cells
                rows.append([labels[l], m, *(fmt(c.value, ".0f") for c in cells),
                             fmt(ratio(sync.value, hvd.value), ".2f"),
                             fmt(ratio(asy.value, hvd.value), ".2f")])
                for s, c in zip(FIT, cells):
                    csv_row("fit", l, m, LABELS[s], "samples_per_s", c.value, "samples/s",
                            c.reason)
        sections.append(
            "## model.fit throughput across the nodes (samples/s)\n\n"
            + markdown(["link", "model", *(LABELS[s] for s in FIT), "SMB sync / Horovod",
                        "SMB async / Horovod"], rows)
            + f"\n\nSynthetic data, global batch {args.fit_batch} over the row's workers, "
            f"{args.fit_epochs} epochs of " + ", ".join(f"{m} {samples[m]}" for m in fit_models)
            + " samples; the epochs after the first at the median step time, the slowest "
            "worker's (as benchmarks/suite.py). SMBStrategy (sync) and tf_smb.HorovodStrategy "
            "under mpirun across the nodes, each in the job of its all-reduce steps, after "
            "them; SMBStrategy(mode=\"async\") in a job of its own (a worker takes every "
            "N-th global batch whole).")

    # Targets.
    targets = target_rows(links, models, link_info, comm, model_bytes)
    sections.append("## Targets\n\n" + markdown(["target", "measured", "goal", "status"],
                                                targets))

    # Failures and n/a.
    na = sorted({(LABELS.get(k[-1], k[-1]), c.reason) for k, c in [*comm.items(), *fit.items()]
                 if c.value is None})
    if failures or na:
        text = "## n/a and failures\n\n" + "\n".join(f"* {s}: {r}" for s, r in na)
        for what, why, excerpt in failures:
            text += f"\n\n### {what}\n\n{why}\n\n```\n{excerpt[-2500:]}\n```"
        sections.append(text)

    md = "\n\n".join(sections) + "\n"
    (out_dir / "nodes.md").write_text(md)
    print(md, flush=True)
    write_csv(out_dir / "nodes.csv", ["section", "link", "model", "strategy", "metric", "value",
                                      "unit", "status", "reason"], csv_rows)
    write_csv(out_dir / "targets.csv", ["target", "measured", "goal", "status"], targets)

    def cells_json(d):
        return [{"key": list(k), "value": c.value, "reason": c.reason, **c.detail}
                for k, c in d.items()]

    (out_dir / "nodes.json").write_text(json.dumps({
        "args": vars(args), "probe": info, "nodes": nodes_info, "started": started, "load": load,
        "links": link_info, "model_bytes": model_bytes,
        "floors_ms": [{"link": l, "model": m, "ms": v} for (l, m), v in floors.items()],
        "comm": cells_json(comm), "fit": cells_json(fit), "targets": targets,
        "failures": [{"what": w, "reason": r, "output": e} for w, r, e in failures]}, indent=1))
    plot(out_dir / "nodes.png", links, labels, models, comm, floors, fit, fit_models,
         model_bytes)

    # Every number reported must be finite and positive; in a smoke run the required
    # strategies must have numbers.
    bad = [r for r in csv_rows if r[7] == "ok" and not (math.isfinite(float(r[5]))
                                                          and float(r[5]) > 0)]
    if args.smoke:
        bad += [r for r in csv_rows if r[7] != "ok" and r[0] in ("comm", "fit", "link")
                and (r[0] != "comm" or any(LABELS[s] == r[3] for s in SMOKE_REQUIRED))]
    if bad:
        print("numbers missing, not finite or not positive:\n" +
              "\n".join(",".join(map(str, r)) for r in bad), file=sys.stderr)
        return 1
    return 0


def report_from(path: str, out_dir: str) -> int:
    """The tables, CSV and plot again, from a run's nodes.json, into `out_dir`."""
    data = json.loads(pathlib.Path(path).read_text())
    args = argparse.Namespace(**data["args"])
    links = common.split_list(args.links, "")
    # Rows: each layout on each link (runs before --layouts: 2x2, keyed by the link).
    rows = ([f"{layout} {link}" for link in links
             for layout in common.split_list(args.layouts, "")]
            if getattr(args, "layouts", None) else links)
    link_info = data["links"]
    for row in rows:  # runs before the labels said whether the delay was applied
        if link_info[row].get("note") and link_info[row]["label"].endswith(", 20 us"):
            link_info[row]["label"] = link_info[row]["label"][:-len(", 20 us")]

    def cells(items):
        out = {}
        for item in items:
            item = dict(item)
            key = tuple(item.pop("key"))
            out[key] = Cell(item.pop("value"), item.pop("reason"), detail=item)
        return out

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    samples = {k: int(v) for k, _, v in (x.partition(":") for x in args.samples.split(","))}
    return report(args, out, data["started"], data["load"], data["probe"],
                  common.split_list(args.models, ""), rows,
                  common.split_list(args.fit_models, ""), samples, data["model_bytes"],
                  link_info, cells(data["comm"]), cells(data["fit"]),
                  [(f["what"], f["reason"], f["output"]) for f in data["failures"]],
                  data.get("nodes", {}))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = common.parse_driver_args(
        "python -m benchmarks.nodes", __doc__.split("\n\n")[0], argv, "bench_nodes",
        "MLP only, few steps, the 10 Gbit/s link (a few minutes)", FULL, SMOKE, "nodes.json")
    if args.report_from:
        return report_from(args.report_from, args.out_dir)
    return run_stoppable(run, args)


def run_stoppable(run_fn, args: argparse.Namespace) -> int:
    """run_fn(args), where SIGTERM and SIGHUP leave through its finally blocks (the
    shaping and the nodes removed): 2 when nodes cannot be made here, 3 when stopped."""
    def stop(signum, _frame):
        raise Stop(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    try:
        return run_fn(args)
    except simnodes.NodesUnavailable as e:
        print(f"simulated nodes cannot be made here: {e}", file=sys.stderr)
        return 2
    except Stop as e:
        print(f"stopped by {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
