"""How a benchmark driver runs its workers: their environment, the commands of each
launch mode, and running them under tf_smb.supervisor (the launcher's supervisor).

Launch modes (`commands`): "tf_smb.run" (python -m tf_smb.run -np N), "mpirun",
"horovodrun" (--gloo), "mwms" (N processes, TF_CONFIG for a 127.0.0.1 cluster) and
"single" (one process).
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from benchmarks.common import REPO_ROOT
from tf_smb import supervisor

Command = Tuple[List[str], Dict[str, str]]
LAUNCHES = ("tf_smb.run", "mpirun", "horovodrun", "mwms", "single")
STOP_GRACE_S = 10.0  # lets tf_smb.run, mpirun and horovodrun stop their own workers
# The command that starts a worker's Python on this node (default: this interpreter).
# The tests point it at their preload fork server's client (tests/preload.py), which
# starts workers with TensorFlow already imported.
PYTHON_VAR = "TF_SMB_BENCH_PYTHON"


def python() -> List[str]:
    """How workers started on this node run Python: $TF_SMB_BENCH_PYTHON, split
    as a shell would, else this interpreter."""
    return shlex.split(os.environ.get(PYTHON_VAR, "")) or [sys.executable]


def subprocess_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """A benchmark subprocess's environment (tf_smb.supervisor.worker_env): no launcher
    variables, the checkout on PYTHONPATH, quiet TensorFlow, oneDNN off, unbuffered."""
    return supervisor.worker_env(pythonpath=[REPO_ROOT], overrides={
        "TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0", **(extra or {})})


def role_argv(role: str, *args: str, local: bool = True) -> List[str]:
    """`python -m benchmarks.roles.ROLE args...`; `local=False` for a command run in
    another node (this interpreter's path, never `python()`'s command)."""
    return [*(python() if local else [sys.executable]), "-m", f"benchmarks.roles.{role}", *args]


def free_ports(n: int) -> List[int]:
    """`n` distinct free TCP ports on 127.0.0.1 (bound to port 0, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def mpirun_prefix(world: int) -> List[str]:
    root = ["--allow-run-as-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    # Bound as tf_smb.run binds its workers (and mpirun by default): one core each
    # while there are cores enough, else unbound.
    bind = "core" if world <= len(os.sched_getaffinity(0)) else "none"
    return ["mpirun", *root, "--oversubscribe", "--bind-to", bind, "-np", str(world)]


def horovodrun_path() -> Optional[str]:
    return (shutil.which("horovodrun", path=os.path.dirname(sys.executable))
            or shutil.which("horovodrun"))


def commands(launch: str, world: int, argv: List[str], env: Dict[str, str],
             launcher_args: Sequence[str] = ()) -> List[Command]:
    """The commands that run `argv` as `world` workers under `launch` (see LAUNCHES);
    `launcher_args` go to tf_smb.run (e.g. --heap-bytes)."""
    if launch == "tf_smb.run":
        return [([*python(), "-m", "tf_smb.run", "-np", str(world), *launcher_args,
                  *argv], env)]
    if launch == "mpirun":
        return [([*mpirun_prefix(world), *argv], env)]
    if launch == "horovodrun":
        return [([horovodrun_path() or "horovodrun", "-np", str(world), "--gloo", *argv], env)]
    if launch == "mwms":
        hosts = [f"127.0.0.1:{p}" for p in free_ports(world)]
        return [(argv, dict(env, TF_CONFIG=json.dumps(
            {"cluster": {"worker": hosts}, "task": {"type": "worker", "index": i}})))
            for i in range(world)]
    if launch == "single":
        return [(argv, env)]
    raise ValueError(f"unknown launch {launch!r}; known: {', '.join(LAUNCHES)}")


def run_processes(cmds: Sequence[Command], timeout: float) -> Tuple[bool, List[str], str]:
    """Runs the commands together (from the checkout); stops them all when one fails or
    `timeout` passes. Returns (all succeeded, each one's output, why not)."""
    # Workers started here directly (MWMS) get their own CPUs, as tf_smb.run's and
    # mpirun's do; a launcher (one command) places its own workers.
    cpus = supervisor.split_cpus(len(cmds)) if len(cmds) > 1 else None
    try:
        workers = supervisor.Workers(cmds, output="merged", cwd=REPO_ROOT,
                                     names=[f"process {i}" for i in range(len(cmds))],
                                     grace_s=STOP_GRACE_S, cpus=cpus)
    except supervisor.StartError as e:
        return False, [""] * len(cmds), str(e)
    with workers:
        outcome = workers.wait(timeout_s=timeout)
    return outcome.ok, [workers.output(i) for i in range(len(cmds))], outcome.reason
