"""Benchmarks what elastic training costs: a job that could change its members but
does not, the commits, and a worker's death (docs/elastic.md, "Measured").

Side by side, repeats alternating, each a fit job of benchmarks/roles/fit.py on
`--workers` processes (synthetic data, SGD with momentum):

  smb          `tf_smb.SMBStrategy()` under `tf_smb.run -np N` (today's job);
  smb_elastic  `SMBStrategy(elastic=True, commit_steps=K)` under tf_smb.run's elastic
               launcher (`--min-np N --max-np N -H localhost:1,127.0.0.1:1,...`):
               the same job able to lose and gain workers, none changing.

Reported per model (medians over repeats): the epoch's wall time after the first (the
slowest rank's) and the median step, elastic against today's (the ratio: target within
1.03); a commit's median seconds (numpy copies of the model's and optimizer's variables,
and the host-update check: one small broadcast), and its share of the K steps between
commits (target <= 5% for ResNet-50 at K = 10).

Then, per model, one elastic job in which the last worker kills itself (SIGKILL) at
epoch 1, batch 3: the seconds from its death to the survivors' catching it (a collective
fails), and from then to their first step done in the next generation (rejoin, Keras'
step traced again, the commit restored, the resumed epoch's batches skipped; target
<= 15 s on one node).

    python -m benchmarks.elastic                             # cnn, resnet50; 3 repeats
    python -m benchmarks.elastic --models=resnet50 --repeats=1 --out=/tmp/elastic.json
    python -m benchmarks.elastic --smoke                     # small, 1 repeat, tiny

The process exits 1 when a job failed (the table and `--out` are still written).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
from typing import Dict, List, Optional, Sequence

from benchmarks import common
from benchmarks.processes import commands, role_argv, run_processes, subprocess_env
from benchmarks.report import fmt, markdown

HOSTS = ("localhost", "127.0.0.1")  # this machine's names: one host (and slot) per worker
SAMPLES = {"cnn": 8192, "small": 8192, "mlp10m": 2048, "resnet50": 512}
SMOKE_SAMPLES = {"cnn": 2048, "small": 2048, "mlp10m": 1024, "resnet50": 192}
BATCH = {"cnn": 256, "small": 256, "mlp10m": 256, "resnet50": 32}
KILL_AT = (1, 3)  # epoch, batch


def launcher_args(config: str, workers: int) -> List[str]:
    """tf_smb.run's options for a config (its -np comes from `commands`)."""
    if config != "smb_elastic":
        return []
    if workers > len(HOSTS):
        raise ValueError(f"at most {len(HOSTS)} workers: each needs a host name of its own")
    return ["--min-np", "1" if workers == 1 else str(workers - 1), "--max-np", str(workers),
            "-H", ",".join(f"{h}:1" for h in HOSTS[:workers])]


def run_job(config: str, model: str, workers: int, epochs: int, samples: int,
            commit_steps: int, timeout: float, kill: str = "") -> dict:
    kind = "smb_elastic" if config == "smb_elastic" else "smb_sync"
    argv = role_argv("fit", f"--kind={kind}", f"--fit_models={model}", f"--fit_epochs={epochs}",
                     f"--fit_batch={BATCH[model]}", f"--samples={model}:{samples}",
                     f"--fit_commit_steps={commit_steps}",
                     *([f"--fit_kill={kill}"] if kill else []))
    ok, outputs, reason = run_processes(
        commands("tf_smb.run", workers, argv, subprocess_env(),
                 launcher_args(config, workers)), timeout)
    found = [r for out in outputs for r in common.parse_tagged(out)]
    results = [r for r in found if r.get("model") == model and r.get("kind") == kind]
    killed = [r["at"] for r in found if r.get("kind") == "killed"]
    expected = workers - (1 if kill else 0)
    if not ok or len(results) != expected:
        tail = " | ".join(line for out in outputs for line in out.strip().splitlines()[-3:])
        return {"ok": False, "reason": reason or f"{len(results)} of {expected} results",
                "tail": tail[-1500:]}
    epochs_done = min(len(r["epoch_s"]) for r in results)
    walls = [max(r["epoch_s"][e] for r in results) for e in range(epochs_done)]
    job = {"ok": True, "epoch_s": statistics.median(walls[1:] or walls),
           "step_s": max(r["median_step_s"] for r in results)}
    commits = [r["median_commit_s"] for r in results if r.get("median_commit_s") is not None]
    if commits:
        job["commit_s"] = max(commits)
    if kill:
        changes = [c for r in results for c in r.get("changes", [])
                   if c.get("cause") == "member lost"]
        if not killed or not changes or any("resumed_s" not in c for c in changes):
            return {"ok": False, "reason": f"no death and recovery recorded: {changes}",
                    "tail": ""}
        job["detect_s"] = max(c["caught_at"] for c in changes) - killed[0]
        job["resume_s"] = max(c["resumed_s"] for c in changes)
    return job


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.elastic")
    p.add_argument("--models", default="cnn,resnet50")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--commit_steps", type=int, default=10)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--smoke", action="store_true", help="small model, 1 repeat, tiny data")
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args(argv)
    models = ["small"] if a.smoke else common.split_list(a.models, "")
    repeats = 1 if a.smoke else a.repeats
    sizes = SMOKE_SAMPLES if a.smoke else SAMPLES
    failed = False
    jobs: Dict[str, Dict[str, List[dict]]] = {}
    for model in models:
        jobs[model] = {"smb": [], "smb_elastic": [], "killed": []}
        for repeat in range(repeats):
            order = ("smb", "smb_elastic") if repeat % 2 == 0 else ("smb_elastic", "smb")
            for config in order:
                job = run_job(config, model, a.workers, a.epochs, sizes[model],
                              a.commit_steps, a.timeout)
                jobs[model][config].append(job)
                failed |= not job["ok"]
                print(f"# {model} {config} repeat {repeat}: {json.dumps(job)}", flush=True)
        kill = f"{a.workers - 1}:{KILL_AT[0]}:{KILL_AT[1]}"
        job = run_job("smb_elastic", model, a.workers, max(a.epochs, KILL_AT[0] + 2),
                      sizes[model], a.commit_steps, a.timeout, kill=kill)
        jobs[model]["killed"].append(job)
        failed |= not job["ok"]
        print(f"# {model} killed: {json.dumps(job)}", flush=True)
    rows = []
    for model, by_config in jobs.items():
        def med(config: str, key: str) -> Optional[float]:
            values = [j[key] for j in by_config[config] if j.get("ok") and key in j]
            return statistics.median(values) if values else None
        epoch, epoch_e = med("smb", "epoch_s"), med("smb_elastic", "epoch_s")
        step, step_e = med("smb", "step_s"), med("smb_elastic", "step_s")
        commit = med("smb_elastic", "commit_s")
        rows.append({
            "model": model, "workers": a.workers, "epoch_s": epoch, "elastic_epoch_s": epoch_e,
            "epoch_ratio": epoch_e / epoch if epoch and epoch_e else None,
            "step_s": step, "elastic_step_s": step_e,
            "step_ratio": step_e / step if step and step_e else None,
            "commit_s": commit,
            "commit_share": commit / (a.commit_steps * step_e) if commit and step_e else None,
            "detect_s": med("killed", "detect_s"), "resume_s": med("killed", "resume_s")})
    print(markdown(
        ["model", "workers", "epoch s", "elastic", "ratio", "step s", "elastic", "ratio",
         "commit s", f"of {a.commit_steps} steps", "death->caught s", "caught->step s"],
        [[r["model"], str(r["workers"]), fmt(r["epoch_s"]), fmt(r["elastic_epoch_s"]),
          fmt(r["epoch_ratio"]), fmt(r["step_s"]), fmt(r["elastic_step_s"]),
          fmt(r["step_ratio"]), fmt(r["commit_s"]),
          f"{100 * r['commit_share']:.2f}%" if r["commit_share"] is not None else "-",
          fmt(r["detect_s"]), fmt(r["resume_s"])] for r in rows]))
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps({"rows": rows, "jobs": jobs}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
