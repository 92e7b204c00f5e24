"""Horovod's API on the box, side by side with SMBStrategy and with Horovod 0.28.1's
own collectives, 2 workers on one node.

    python -m benchmarks.horovod_api [--rounds=3] [--models=mlp,cnn] [--np=2]

1. `fit`: the median step of the same model with `tf_smb.horovod.keras.DistributedOptimizer`
   (each rank fits its shard, as a Horovod script does; tf_smb.run), with
   `tf_smb.SMBStrategy()` (tf_smb.run) and with `tf_smb.HorovodStrategy()` (Horovod's
   collectives; mpirun), jobs alternating; per model each kind's median over rounds of
   the slower rank's median step, and the ratios to tf_smb.horovod (target: tf_smb.horovod
   at most 1.03x SMBStrategy's step).
2. Horovod's `tensorflow2_synthetic_benchmark.py` (tools/run_horovod_example.py's copy,
   ResNet-50) on tf_smb.horovod and on Horovod 0.28.1 itself: its own img/s line, or
   the error that stopped it.
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
SYNTHETIC_ARGS = ["--batch-size", "8", "--num-warmup-batches", "2",
                  "--num-batches-per-iter", "3", "--num-iters", "3"]


def run_job(kind: str, args: argparse.Namespace) -> List[dict]:
    samples = ",".join(f"{m}:{args.samples}" for m in args.models.split(","))
    argv = [*processes.python(), "-m", "benchmarks.roles.fit", f"--kind={kind}",
            f"--fit_models={args.models}", f"--fit_epochs={args.epochs}",
            f"--fit_batch={args.batch}", f"--samples={samples}"]
    launch = "mpirun" if kind == "horovod" else "tf_smb.run"
    ok, outputs, why = processes.run_processes(
        processes.commands(launch, args.np, argv, processes.subprocess_env()), 1800)
    if not ok:
        raise RuntimeError(f"{kind} job failed ({why}):\n{outputs[0][-3000:]}")
    return common.parse_tagged(outputs[0])


def synthetic(horovod: bool, np_: int) -> Tuple[str, str]:
    """(its 'Total img/sec' figure or "n/a", the last error line or "")."""
    sys.path.insert(0, str(common.REPO_ROOT / "tools"))
    import run_horovod_example as examples  # pylint: disable=import-outside-toplevel
    with tempfile.TemporaryDirectory() as tmp:
        copy = examples.prepare("tensorflow2_synthetic_benchmark.py", tmp, keep_horovod=horovod)
        launch = "mpirun" if horovod else "tf_smb.run"
        ok, outputs, why = processes.run_processes(processes.commands(
            launch, np_, [*processes.python(), copy, *SYNTHETIC_ARGS],
            processes.subprocess_env()), 1800)
    out = outputs[0]
    m = re.search(r"Total img/sec on \d+ GPU\(s\): ([0-9.]+ \+-[0-9.]+)", out)
    errors = re.findall(r"^(?:\[[^\]]*\]<?\w*>?:? ?)?(\w+Error: .*)$", out, flags=re.M)
    return (m.group(1) if ok and m else "n/a"), (errors[-1] if errors else ("" if ok else why))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.horovod_api")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--models", default="mlp,cnn")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch", type=int, default=128, help="global batch")
    p.add_argument("--samples", type=int, default=16384)
    p.add_argument("--no_synthetic", action="store_true")
    args = p.parse_args(argv)
    steps: Dict[str, Dict[str, List[float]]] = {}
    for r in range(args.rounds):
        for kind in (KINDS if r % 2 == 0 else KINDS[::-1]):
            job: Dict[str, List[float]] = {}
            for result in run_job(kind, args):
                job.setdefault(result["model"], []).append(result["median_step_s"])
            for model, medians in job.items():
                # A step ends when the slowest rank's does: the ranks' largest median.
                steps.setdefault(model, {}).setdefault(kind, []).append(max(medians))
    print(f"## fit, {args.np} workers, one node: median step (ms)\n")
    print("| model | " + " | ".join(LABELS[k] for k in KINDS)
          + " | tf_smb.horovod / SMBStrategy | HorovodStrategy / tf_smb.horovod |")
    print("|---" * (len(KINDS) + 3) + "|")
    for model, kinds in steps.items():
        med = {k: statistics.median(v) * 1e3 for k, v in kinds.items()}
        print(f"| {model} | " + " | ".join(f"{med[k]:.2f}" for k in KINDS)
              + f" | {med['hvd_api'] / med['smb_sync']:.3f}"
              + f" | {med['horovod'] / med['hvd_api']:.3f} |")
    if not args.no_synthetic:
        print(f"\n## tensorflow2_synthetic_benchmark.py (ResNet-50, {' '.join(SYNTHETIC_ARGS)}), "
              f"{args.np} workers: total img/s\n")
        print("| run on | img/s | error |\n|---|---|---|")
        for horovod, label in ((False, "tf_smb.horovod"), (True, "Horovod 0.28.1")):
            figure, error = synthetic(horovod, args.np)
            print(f"| {label} | {figure} | {error[:160]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
