"""Runs groups of worker processes for multi-process tests: every process is
waited for with a timeout and killed on the way out, and failures name the rank."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(REPO, "tests", "workers")


def base_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


@dataclasses.dataclass
class Result:
    rank: int
    returncode: int
    stdout: str
    stderr: str

    def json(self) -> dict:
        """The last JSON line the worker printed."""
        for line in reversed(self.stdout.splitlines()):
            if line.startswith("{"):
                return json.loads(line)
        raise AssertionError(f"rank {self.rank} printed no JSON result "
                             f"(exit {self.returncode}); stderr:\n{self.stderr[-3000:]}")

    def check(self) -> "Result":
        assert self.returncode == 0, (
            f"rank {self.rank} exited with {self.returncode}; stderr:\n{self.stderr[-3000:]}")
        return self


def run_ranks(args: Sequence[str], world: int, timeout: float,
              env: Optional[Dict[str, str]] = None,
              per_rank_env: Optional[List[Dict[str, str]]] = None) -> List[Result]:
    """Starts `world` copies of `python args...` with TF_SMB_RANK/SIZE set (no
    launcher, so rank 0 creates the box) and waits for all of them."""
    procs = []
    job = f"test-{os.getpid()}-{time.monotonic_ns()}"
    try:
        for rank in range(world):
            e = base_env({"TF_SMB_RANK": str(rank), "TF_SMB_SIZE": str(world),
                          "TF_SMB_JOB_ID": job, **(env or {})})
            if per_rank_env:
                e.update(per_rank_env[rank])
            procs.append(subprocess.Popen(
                [sys.executable, *args], env=e, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, start_new_session=True))
        deadline = time.monotonic() + timeout
        results = []
        for rank, p in enumerate(procs):
            remaining = max(0.1, deadline - time.monotonic())
            try:
                out, err = p.communicate(timeout=remaining)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"rank {rank} did not finish within {timeout}s")
            results.append(Result(rank, p.returncode, out, err))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def run_single(args: Sequence[str], timeout: float,
               env: Optional[Dict[str, str]] = None) -> Result:
    """Runs one process with no launcher variables at all."""
    e = base_env(env)
    for key in ("TF_SMB_RANK", "TF_SMB_SIZE", "TF_SMB_JOB_ID", "HOROVOD_RANK",
                "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        e.pop(key, None)
    p = subprocess.run([sys.executable, *args], env=e, capture_output=True,
                       text=True, timeout=timeout)
    return Result(0, p.returncode, p.stdout, p.stderr)


def run_launcher(np_: int, args: Sequence[str], timeout: float,
                 env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Runs `python -m tf_smb.run -np N python args...`."""
    return subprocess.run(
        [sys.executable, "-m", "tf_smb.run", "-np", str(np_), sys.executable, *args],
        env=base_env(env), capture_output=True, text=True, timeout=timeout, cwd=REPO)


def rank_lines(output: str, rank: int) -> List[str]:
    """Lines the launcher printed for `rank`, without the prefix."""
    prefix = f"[{rank}]: "
    return [l[len(prefix):] for l in output.splitlines() if l.startswith(prefix)]
