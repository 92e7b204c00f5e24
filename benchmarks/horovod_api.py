"""Horovod's API on the box, side by side with SMBStrategy and with Horovod 0.28.1's
own collectives, 2 workers on one node.

    python -m benchmarks.horovod_api [--rounds=3] [--models=mlp,cnn] [--np=2] [--nodes]

1. `fit`: the median step of the same model with `tf_smb.horovod.keras.DistributedOptimizer`
   (each rank fits its shard, as a Horovod script does; tf_smb.run), with
   `tf_smb.SMBStrategy()` (tf_smb.run) and with `tf_smb.HorovodStrategy()` (Horovod's
   collectives; mpirun), jobs alternating; per model each kind's median over rounds of
   the slower rank's median step, and the ratios to tf_smb.horovod (target: tf_smb.horovod
   at most 1.03x SMBStrategy's step).
2. Horovod's `tensorflow2_synthetic_benchmark.py` (tools/run_horovod_example.py's copy,
   ResNet-50) on tf_smb.horovod and on Horovod 0.28.1 itself: its own img/s line, or
   the error that stopped it.

--nodes: the same, then again across the two simulated nodes (tests/simnodes.py, one
worker per node, every kind under mpirun; needs root).
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from typing import Dict, List, Tuple

from benchmarks import common, processes

KINDS = ("smb_sync", "hvd_api", "horovod")
LABELS = {"smb_sync": "SMBStrategy", "hvd_api": "tf_smb.horovod",
          "horovod": "HorovodStrategy (Horovod's collectives)"}
TIMEOUT_S = 1800
SYNTHETIC_ARGS = ["--batch-size", "8", "--num-warmup-batches", "2",
                  "--num-batches-per-iter", "3", "--num-iters", "3"]


def launch(np_: int, argv: List[str], nodes=None,
           horovod: bool = False) -> Tuple[bool, str, str]:
    """(ok, the job's output, why not) of `argv` (after the interpreter) as `np_`
    workers: on this node under tf_smb.run (mpirun for Horovod's own, `horovod`), or
    across `nodes` (simnodes.SimulatedNodes, one worker per node) under mpirun."""
    if nodes is not None:
        job = nodes.mpirun(np_, 1, [sys.executable, *argv], TIMEOUT_S,
                           {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0"},
                           cwd=str(common.REPO_ROOT))
        return (job.returncode == 0, job.stdout + job.stderr,
                f"mpirun exited with {job.returncode}")
    how = "mpirun" if horovod else "tf_smb.run"
    ok, outputs, why = processes.run_processes(processes.commands(
        how, np_, [*processes.python(), *argv], processes.subprocess_env()), TIMEOUT_S)
    return ok, outputs[0], why


def run_job(kind: str, args: argparse.Namespace, nodes=None) -> List[dict]:
    samples = ",".join(f"{m}:{args.samples}" for m in args.models.split(","))
    ok, out, why = launch(args.np, [
        "-m", "benchmarks.roles.fit", f"--kind={kind}", f"--fit_models={args.models}",
        f"--fit_epochs={args.epochs}", f"--fit_batch={args.batch}", f"--samples={samples}"],
        nodes, horovod=kind == "horovod")
    if not ok:
        raise RuntimeError(f"{kind} job failed ({why}):\n{out[-3000:]}")
    return common.parse_tagged(out)


def synthetic(horovod: bool, np_: int, nodes=None) -> Tuple[str, str]:
    """(its 'Total img/sec' figure or "n/a", the last error line or "")."""
    sys.path.insert(0, str(common.REPO_ROOT / "tools"))
    import run_horovod_example as examples  # pylint: disable=import-outside-toplevel
    with tempfile.TemporaryDirectory() as tmp:
        copy = examples.prepare("tensorflow2_synthetic_benchmark.py", tmp, keep_horovod=horovod)
        ok, out, why = launch(np_, [copy, *SYNTHETIC_ARGS], nodes, horovod=horovod)
    m = re.search(r"Total img/sec on \d+ GPU\(s\): ([0-9.]+ \+-[0-9.]+)", out)
    errors = [e for e in re.findall(r"^(?:\[[^\]]*\]<?\w*>?:? ?)?\s*(\w+Error: .*)$", out,
                                    flags=re.M) if not e.endswith("in user code:")]
    return (m.group(1) if ok and m else "n/a"), (errors[-1] if errors else ("" if ok else why))


def fit_table(args: argparse.Namespace, where: str, nodes=None) -> None:
    """Prints the fit table: each kind's median over rounds of the slower rank's
    median step (jobs alternate kinds, reversed every other round)."""
    steps: Dict[str, Dict[str, List[float]]] = {}
    for r in range(args.rounds):
        for kind in (KINDS if r % 2 == 0 else KINDS[::-1]):
            job: Dict[str, List[float]] = {}
            for result in run_job(kind, args, nodes):
                job.setdefault(result["model"], []).append(result["median_step_s"])
            for model, medians in job.items():
                # A step ends when the slowest rank's does: the ranks' largest median.
                steps.setdefault(model, {}).setdefault(kind, []).append(max(medians))
    print(f"## fit, {args.np} workers, {where}: median step (ms)\n")
    print("| model | " + " | ".join(LABELS[k] for k in KINDS)
          + " | tf_smb.horovod / SMBStrategy | HorovodStrategy / tf_smb.horovod |")
    print("|---" * (len(KINDS) + 3) + "|")
    for model, kinds in steps.items():
        med = {k: statistics.median(v) * 1e3 for k, v in kinds.items()}
        print(f"| {model} | " + " | ".join(f"{med[k]:.2f}" for k in KINDS)
              + f" | {med['hvd_api'] / med['smb_sync']:.3f}"
              + f" | {med['horovod'] / med['hvd_api']:.3f} |", flush=True)


def synthetic_table(args: argparse.Namespace, where: str, nodes=None) -> None:
    print(f"\n## tensorflow2_synthetic_benchmark.py (ResNet-50, {' '.join(SYNTHETIC_ARGS)}), "
          f"{args.np} workers, {where}: total img/s\n")
    print("| run on | img/s | error |\n|---|---|---|")
    for horovod, label in ((False, "tf_smb.horovod"), (True, "Horovod 0.28.1")):
        figure, error = synthetic(horovod, args.np, nodes)
        print(f"| {label} | {figure} | {error[:160]} |", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.horovod_api")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--models", default="mlp,cnn")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch", type=int, default=128, help="global batch")
    p.add_argument("--samples", type=int, default=16384)
    p.add_argument("--no_synthetic", action="store_true")
    p.add_argument("--nodes", action="store_true",
                   help="also across the two simulated nodes (needs root)")
    args = p.parse_args(argv)
    fit_table(args, "one node")
    if not args.no_synthetic:
        synthetic_table(args, "one node")
    if args.nodes:
        sys.path.insert(0, str(common.REPO_ROOT / "tests"))
        import simnodes  # pylint: disable=import-outside-toplevel
        with simnodes.SimulatedNodes() as nodes:
            print()
            fit_table(args, "two simulated nodes", nodes)
            if not args.no_synthetic:
                synthetic_table(args, "two simulated nodes", nodes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
