"""Horovod's API on the box against SMBStrategy: the median `fit` step of the same
model, with `tf_smb.horovod.keras.DistributedOptimizer` (each rank fits its shard, as
a Horovod script does) and with `tf_smb.SMBStrategy()`, jobs alternating, 2 workers.

    python -m benchmarks.horovod_api [--rounds=3] [--models=mlp,cnn] [--np=2]

Prints, per model, each kind's median over rounds of the ranks' median step time and
the ratio hvd_api / smb_sync (issue target: at most 1.03).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from typing import Dict, List

from benchmarks import common

KINDS = ("smb_sync", "hvd_api")


def run_job(kind: str, args: argparse.Namespace) -> List[dict]:
    samples = ",".join(f"{m}:{args.samples}" for m in args.models.split(","))
    argv = [sys.executable, "-m", "tf_smb.run", "-np", str(args.np), sys.executable, "-m",
            "benchmarks.roles.fit", f"--kind={kind}", f"--fit_models={args.models}",
            f"--fit_epochs={args.epochs}", f"--fit_batch={args.batch}", f"--samples={samples}"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{kind} job failed ({out.returncode}):\n{out.stdout[-3000:]}"
                           f"{out.stderr[-3000:]}")
    return common.parse_tagged(out.stdout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.horovod_api")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--models", default="mlp,cnn")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch", type=int, default=128, help="global batch")
    p.add_argument("--samples", type=int, default=16384)
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
    print(f"| model | SMBStrategy step (ms) | tf_smb.horovod step (ms) | ratio |")
    print("|---|---|---|---|")
    for model, kinds in steps.items():
        med = {k: statistics.median(v) * 1e3 for k, v in kinds.items()}
        print(f"| {model} | {med['smb_sync']:.2f} | {med['hvd_api']:.2f} | "
              f"{med['hvd_api'] / med['smb_sync']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
