"""Benchmarks the wall time of a `model.fit` epoch, not only its steps: what a user
waits for between epochs.

Side by side, repeats alternating the configurations, each a fit job of
benchmarks/roles/fit.py (synthetic data, SGD with momentum, loss only, no XLA):

  single      one plain process, no strategy, the same global batch;
  smb         `--workers` processes of `tf_smb.SMBStrategy()` under tf_smb.run
              (finished input iterators destroyed on tf_smb's releaser thread, the
              default: tf_smb/iterator_release.py);
  smb_owner   the same with TF_SMB_ITERATOR_RELEASE=owner: iterators destroyed where
              Keras drops them, on the training thread, as TensorFlow's strategies do;
  smb_autotune_owner  smb_owner on a dataset whose options turn tf.data's autotuning
              on (tf_smb turns its thread off only where the user left it unset):
              what the epoch boundary costs without either of tf_smb's measures;
  horovod_mpi `--workers` processes of tf_smb.HorovodStrategy under mpirun: the reference,
              through tf_smb's machinery, so its iterators go to the releaser too.
(MultiWorkerMirroredStrategy cannot run Keras 3's `fit`, see docs/benchmarks.md.)

Per job: the epoch's wall time (the slowest rank's), the median over the epochs after
the first (which traces the step function); the median step time (slowest rank); and
the time outside the steps, epoch - steps x median step (input iterators made and
destroyed, callbacks, the end-of-data agreement). Reported: the median over repeats.

    python -m benchmarks.epoch_time                        # mlp10m and cnn, 3 repeats
    python -m benchmarks.epoch_time --models=cnn --repeats=5 --out=/tmp/epoch.json
    python -m benchmarks.epoch_time --smoke                # cnn, 1 repeat, tiny

The process exits 1 when a job failed (the table and `--out` are still written).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

from benchmarks import common
from benchmarks.processes import commands, role_argv, run_processes, subprocess_env
from benchmarks.report import fmt, markdown

OWNER = {"TF_SMB_ITERATOR_RELEASE": "owner"}
CONFIGS = {  # name: (launch, fit kind, extra environment, extra fit arguments)
    "single": ("single", "single", {}, ()),
    "smb": ("tf_smb.run", "smb_sync", {}, ()),
    "smb_owner": ("tf_smb.run", "smb_sync", OWNER, ()),
    "smb_autotune_owner": ("tf_smb.run", "smb_sync", OWNER, ("--fit_autotune=on",)),
    "horovod_mpi": ("mpirun", "horovod", {}, ()),
}
SAMPLES = {"cnn": 8192, "mlp": 32768, "mlp10m": 4096}
SMOKE_SAMPLES = {"cnn": 512, "mlp": 1024, "mlp10m": 256}


def job_times(results: Sequence[dict]) -> dict:
    """Epoch wall, step and outside-step seconds of one job (all its ranks' results)."""
    epochs = min(len(r["epoch_s"]) for r in results)
    walls = [max(r["epoch_s"][e] for r in results) for e in range(epochs)]
    timed = walls[1:] or walls
    step_s = max(r["median_step_s"] for r in results)
    steps = statistics.median(results[0]["steps_per_epoch"][1:] or results[0]["steps_per_epoch"])
    epoch_s = statistics.median(timed)
    return {"epoch_s": epoch_s, "step_s": step_s, "steps": steps,
            "outside_s": epoch_s - steps * step_s, "epoch_walls": walls}


def run_job(config: str, model: str, workers: int, epochs: int, batch: int, samples: int,
            timeout: float) -> dict:
    launch, kind, extra, fit_args = CONFIGS[config]
    world = 1 if config == "single" else workers
    argv = role_argv("fit", f"--kind={kind}", f"--fit_models={model}", f"--fit_epochs={epochs}",
                     f"--fit_batch={batch}", f"--samples={model}:{samples}", *fit_args)
    ok, outputs, reason = run_processes(commands(launch, world, argv, subprocess_env(extra)),
                                        timeout)
    found = [r for out in outputs for r in common.parse_tagged(out)
             if r["model"] == model and r["kind"] in (kind, "none_1")]
    if not ok or len(found) != world or not all(r.get("median_step_s") for r in found):
        tail = " | ".join(line for out in outputs for line in out.strip().splitlines()[-2:])
        return {"ok": False, "error": f"{reason or 'no result line'}: {tail[-400:]}"}
    return {"ok": True, **job_times(found)}


def summarize(runs: List[dict]) -> dict:
    good = [r for r in runs if r["ok"]]
    if not good:
        return {"ok": False, "error": runs[-1]["error"] if runs else "not run"}
    return {"ok": True, "repeats": len(good),
            **{k: statistics.median(r[k] for r in good)
               for k in ("epoch_s", "step_s", "outside_s")}}


def table(model: str, entries: Dict[str, dict]) -> str:
    base = entries.get("smb", {})
    rows = []
    for config in CONFIGS:
        e = entries.get(config)
        if e is None:
            continue
        if not e["ok"]:
            rows.append([config, "failed: " + e["error"][:120], "", "", ""])
            continue
        vs = e["epoch_s"] / base["epoch_s"] if base.get("ok") else None
        rows.append([config, fmt(e["epoch_s"], ".3f"), fmt(1000 * e["step_s"], ".1f"),
                     fmt(e["outside_s"], ".3f"), fmt(vs, ".2f")])
    return markdown(["config", f"{model} epoch s", "step ms", "outside steps s",
                     "epoch vs smb"], rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.epoch_time")
    parser.add_argument("--models", default="mlp10m,cnn")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=256, help="global batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    models = common.split_list(args.models, "")
    configs = common.split_list(args.configs, "")
    unknown = sorted(set(configs) - set(CONFIGS)) + sorted(set(models) - set(SAMPLES))
    if unknown:
        parser.error(f"unknown config or model: {', '.join(unknown)}")
    samples = SMOKE_SAMPLES if args.smoke else SAMPLES
    if args.smoke:
        models, args.repeats, args.epochs, args.batch = ["cnn"], 1, 3, 64

    started = time.time()
    runs: Dict[str, Dict[str, List[dict]]] = {m: {c: [] for c in configs} for m in models}
    for repeat in range(args.repeats):
        for model in models:
            order = configs[repeat % len(configs):] + configs[:repeat % len(configs)]
            for config in order:
                run = run_job(config, model, args.workers, args.epochs, args.batch,
                              samples[model], args.timeout)
                runs[model][config].append(run)
                print(f"# {model} {config} repeat {repeat}: "
                      + (f"epoch {run['epoch_s']:.3f} s, outside steps {run['outside_s']:.3f} s"
                         if run["ok"] else run["error"]), flush=True)
    summary = {m: {c: summarize(r) for c, r in per.items()} for m, per in runs.items()}
    text = "\n\n".join(table(m, summary[m]) for m in models)
    print(f"\n## Epoch wall time, {args.workers} workers, global batch {args.batch}, "
          f"median of {args.repeats} repeats ({time.time() - started:.0f} s)\n\n{text}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(
            {"args": vars(args), "runs": runs, "summary": summary, "markdown": text}, indent=1))
    return 0 if all(s["ok"] for per in summary.values() for s in per.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
