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
    python -m benchmarks.elastic --nodes                     # across 2 simulated nodes
    python -m benchmarks.elastic --mode=async                # async mode (also --nodes)

With --mode=async the two jobs train asynchronously (`SMBStrategy(mode="async")`, and
with `elastic=True`): a commit is the position only and asks no one (the launcher's
generation file read); the killed job's survivors learn of the change from the launcher
at their next commit, end their part of the generation without a rollback, and go on.

With --nodes (root: tests/simnodes.py) the jobs run on two simulated nodes, one worker
each: today's under mpirun, the elastic one under tf_smb.run in node 0 (each generation
one mpirun, docs/elastic.md "Across nodes"; commits also go to each node's commit box).
The killed job's worker on node 1 dies; node 1 is blacklisted and node 0 goes on alone in
a new mpirun: "death->caught" is then from the death to the new process's resume
(mpirun's end, the relaunch, Python and TensorFlow starting, the model built), and
"caught->step" from there to its first step (the commit read, Keras' trace, the step;
target for both together <= 30 s).

The process exits 1 when a job failed (the table and `--out` are still written).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import statistics
import sys
from typing import Dict, List, Optional, Sequence

from benchmarks import common
from benchmarks.processes import commands, role_argv, run_processes, subprocess_env
from benchmarks.report import fmt, markdown
from tf_smb import env as env_lib

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


# The fit role's strategy kind of each config, by --mode.
KINDS = {"sync": {"smb": "smb_sync", "smb_elastic": "smb_elastic"},
         "async": {"smb": "smb_async", "smb_elastic": "smb_async_elastic"}}
# The change a killed worker's survivors record (async: the launcher's next generation).
CAUGHT = {"sync": "member lost", "async": "members changed"}


def run_job(config: str, model: str, workers: int, epochs: int, samples: int,
            commit_steps: int, timeout: float, kill: str = "", nodes: object = None,
            mode: str = "sync") -> dict:
    kind = KINDS[mode][config]
    args = (f"--kind={kind}", f"--fit_models={model}", f"--fit_epochs={epochs}",
            f"--fit_batch={BATCH[model]}", f"--samples={model}:{samples}",
            f"--fit_commit_steps={commit_steps}", *([f"--fit_kill={kill}"] if kill else []))
    if nodes is None:
        ok, outputs, reason = run_processes(
            commands("tf_smb.run", workers, role_argv("fit", *args), subprocess_env(),
                     launcher_args(config, workers)), timeout)
    else:
        ok, outputs, reason = run_on_nodes(nodes, config, role_argv("fit", *args, local=False),
                                           timeout)
    found = [r for out in outputs for r in common.parse_tagged(out)]
    results = [r for r in found if r.get("model") == model and r.get("kind") == kind]
    killed = [r["at"] for r in found if r.get("kind") == "killed"]
    # Across nodes the killed worker's node is left out, and its survivors are new
    # processes: one worker (node 0) reports.
    expected = (1 if nodes is not None else workers - 1) if kill else workers
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
                   if c.get("cause") == ("resumed" if nodes is not None else CAUGHT[mode])]
        if not killed or not changes or any("resumed_s" not in c for c in changes):
            return {"ok": False, "reason": f"no death and recovery recorded: {changes}",
                    "tail": ""}
        job["detect_s"] = max(c["caught_at"] for c in changes) - killed[0]
        job["resume_s"] = max(c["resumed_s"] for c in changes)
    return job


def run_on_nodes(nodes: object, config: str, argv: List[str], timeout: float):
    """One job of 2 workers across the two simulated nodes (one each): today's under
    mpirun, the elastic one under tf_smb.run in node 0. (ok, [output], why not)."""
    import simnodes  # pylint: disable=import-outside-toplevel  (tests/, on sys.path)
    env = {k: v for k, v in subprocess_env().items()
           if not k.startswith("TF_SMB_") and k not in env_lib.LAUNCHER_VARS}
    try:
        if config == "smb":
            launch = nodes.mpirun(2, 1, argv, timeout, env)
        else:
            hosts = ",".join(f"{h}:1" for h in nodes.hostnames)
            launch = nodes.start(0, [sys.executable, "-m", "tf_smb.run", "-np", "2",
                                     "--min-np", "1", "--max-np", "2", "-H", hosts,
                                     "--mpi-args", shlex.join(nodes.mpirun_options()), *argv],
                                 env, owns_nodes=True, drain=True).wait(timeout)
    except simnodes.NodesTimeout as e:
        return False, [str(e)], f"timed out after {timeout:.0f} s"
    ok = launch.returncode == 0
    return ok, [launch.stdout + launch.stderr], "" if ok else f"exit status {launch.returncode}"


def open_nodes() -> object:
    """Two simulated nodes of one worker slot each (tests/simnodes.py), entered."""
    sys.path.insert(0, str(common.REPO_ROOT / "tests"))
    import simnodes  # pylint: disable=import-outside-toplevel
    return simnodes.SimulatedNodes(nodes=2, workers=1).__enter__()


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.elastic")
    p.add_argument("--models", default="cnn,resnet50")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--commit_steps", type=int, default=10)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--smoke", action="store_true", help="small model, 1 repeat, tiny data")
    p.add_argument("--nodes", action="store_true",
                   help="across two simulated nodes, one worker each (needs root)")
    p.add_argument("--mode", choices=("sync", "async"), default="sync",
                   help="the strategy's mode")
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args(argv)
    models = ["small"] if a.smoke else common.split_list(a.models, "")
    repeats = 1 if a.smoke else a.repeats
    sizes = SMOKE_SAMPLES if a.smoke else SAMPLES
    failed = False
    jobs: Dict[str, Dict[str, List[dict]]] = {}
    if a.nodes and a.workers != 2:
        p.error("--nodes runs 2 workers (one a node)")
    nodes = open_nodes() if a.nodes else None
    try:
        failed = measure(a, models, repeats, sizes, nodes, jobs)
    finally:
        if nodes is not None:
            nodes.close()
    report(a, jobs)
    return 1 if failed else 0


def measure(a: argparse.Namespace, models: List[str], repeats: int, sizes: Dict[str, int],
            nodes: object, jobs: Dict[str, Dict[str, List[dict]]]) -> bool:
    """Runs every job (see the module) into `jobs`; whether one failed."""
    failed = False
    for model in models:
        jobs[model] = {"smb": [], "smb_elastic": [], "killed": []}
        for repeat in range(repeats):
            order = ("smb", "smb_elastic") if repeat % 2 == 0 else ("smb_elastic", "smb")
            for config in order:
                job = run_job(config, model, a.workers, a.epochs, sizes[model],
                              a.commit_steps, a.timeout, nodes=nodes, mode=a.mode)
                jobs[model][config].append(job)
                failed |= not job["ok"]
                print(f"# {model} {config} repeat {repeat}: {json.dumps(job)}", flush=True)
        kill = f"{a.workers - 1}:{KILL_AT[0]}:{KILL_AT[1]}"
        job = run_job("smb_elastic", model, a.workers, max(a.epochs, KILL_AT[0] + 2),
                      sizes[model], a.commit_steps, a.timeout, kill=kill, nodes=nodes,
                      mode=a.mode)
        jobs[model]["killed"].append(job)
        failed |= not job["ok"]
        print(f"# {model} killed: {json.dumps(job)}", flush=True)
    return failed


def report(a: argparse.Namespace, jobs: Dict[str, Dict[str, List[dict]]]) -> None:
    """Prints the table (and writes --out)."""
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
            "detect_s": med("killed", "detect_s"), "resume_s": med("killed", "resume_s"),
            "where": "2 simulated nodes x 1" if a.nodes else "one node", "mode": a.mode})
    print(f"# {'2 simulated nodes x 1 worker' if a.nodes else f'{a.workers} workers, one node'}"
          f", mode={a.mode}")
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


if __name__ == "__main__":
    sys.exit(main())
