"""Runs groups of worker processes for multi-process tests: every process is
waited for with a timeout and killed on the way out, and failures name the rank.
The processes are started and watched by tf_smb.supervisor, with its worker
environment (tf_smb.supervisor.worker_env)."""
from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(REPO, "tests", "workers")
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from tf_smb import env as env_lib, supervisor  # noqa: E402
import preload  # noqa: E402

_server: Optional[preload.Server] = None
FRESH_VAR = "TF_SMB_TEST_FRESH"  # =1: every worker a fresh interpreter, no fork server


def python() -> List[str]:
    """How tests start `python`: a client of the preload fork server (TensorFlow and
    Keras imported once, tests/preload.py), started on first use; the plain
    interpreter when TF_SMB_TEST_FRESH=1."""
    global _server
    if os.environ.get(FRESH_VAR) == "1":
        return [sys.executable]
    if _server is None:
        _server = preload.Server(env=supervisor.worker_env(
            pythonpath=[REPO], overrides={"TF_CPP_MIN_LOG_LEVEL": "2"}))
        atexit.register(_server.close)
        os.environ[preload.SOCKET_VAR] = _server.path
    return [sys.executable, "-S", preload.CLIENT]


def base_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """This environment for a test process: no launcher variables, the checkout on
    PYTHONPATH, quiet TensorFlow, unbuffered output, the preload server's socket
    (started here if need be); then `extra`."""
    bench_python = shlex.join(python())  # benchmarks start their workers with it too
    return supervisor.worker_env(pythonpath=[REPO],
                                 overrides={"TF_CPP_MIN_LOG_LEVEL": "2",
                                            "TF_SMB_BENCH_PYTHON": bench_python,
                                            **(extra or {})})


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


def _run(commands: Sequence[Tuple[Sequence[str], Dict[str, str]]], timeout: float,
         cwd: Optional[str] = None) -> Tuple[supervisor.Outcome, List[Result]]:
    """Runs the commands together until all end (a failure does not stop the others)
    or `timeout` passes (then all are stopped); each one's result."""
    with supervisor.Workers(commands, output="split", cwd=cwd, grace_s=2.0) as workers:
        outcome = workers.wait(timeout_s=timeout, stop_on_failure=False)
    return outcome, [Result(i, code, workers.output(i), workers.stderr(i))
                     for i, code in enumerate(outcome.returncodes)]


def run_ranks(args: Sequence[str], world: int, timeout: float,
              env: Optional[Dict[str, str]] = None,
              per_rank_env: Optional[List[Dict[str, str]]] = None) -> List[Result]:
    """Starts `world` copies of `python args...` with TF_SMB_RANK/SIZE set (no
    launcher, so rank 0 creates the box) and waits for all of them."""
    job = f"test-{os.getpid()}-{time.monotonic_ns()}"
    commands = []
    for rank in range(world):
        e = supervisor.worker_env(base_env(), rank=rank, size=world, job_id=job,
                                  overrides={**(env or {}),
                                             **(per_rank_env[rank] if per_rank_env else {})})
        commands.append(([*python(), *args], e))
    outcome, results = _run(commands, timeout)
    if outcome.running:
        tails = "\n".join(f"--- rank {r.rank} (exit status {r.returncode}):\n"
                          f"{r.stdout[-1500:]}{r.stderr[-3000:]}" for r in results)
        raise AssertionError(f"rank(s) {outcome.running} did not finish within {timeout}s; "
                             f"what each rank printed:\n{tails}")
    return results


def pid_with_env(pids: Sequence[int], name: str, value: str) -> Optional[int]:
    """The first of `pids` whose environment sets `name` to `value` (None: none does)."""
    wanted = f"{name}={value}".encode()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if wanted in f.read().split(b"\0"):
                    return pid
        except OSError:
            continue
    return None


def run_command(argv: Sequence[str], timeout: float, env: Dict[str, str],
                cwd: Optional[str] = None) -> Result:
    """Runs `argv` with exactly `env`; kills it (and raises TimeoutExpired) at `timeout`."""
    outcome, (result,) = _run([(argv, env)], timeout, cwd)
    if outcome.running:
        raise subprocess.TimeoutExpired(list(argv), timeout, result.stdout, result.stderr)
    return result


def run_single(args: Sequence[str], timeout: float,
               env: Optional[Dict[str, str]] = None, fresh: bool = False) -> Result:
    """Runs one process with no launcher variables at all; `fresh`: a new
    interpreter, not a fork of the preload server (for what `import` itself does)."""
    e = {k: v for k, v in base_env(env).items() if k not in env_lib.LAUNCHER_VARS}
    return run_command([*([sys.executable] if fresh else python()), *args], timeout, e)


def run_launcher(np_: int, args: Sequence[str], timeout: float,
                 env: Optional[Dict[str, str]] = None,
                 launcher_args: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """Runs `python -m tf_smb.run [launcher_args] -np N python args...`."""
    argv = [*python(), "-m", "tf_smb.run", *launcher_args, "-np", str(np_),
            *python(), *args]
    r = run_command(argv, timeout, base_env(env), cwd=REPO)
    return subprocess.CompletedProcess(argv, r.returncode, r.stdout, r.stderr)


def rank_lines(output: str, rank: int) -> List[str]:
    """Lines the launcher printed for `rank`, without the prefix."""
    prefix = f"[{rank}]: "
    return [l[len(prefix):] for l in output.splitlines() if l.startswith(prefix)]


def run_mpirun(np_: int, args: Sequence[str], timeout: float, result_dir: str,
               env: Optional[Dict[str, str]] = None) -> List[dict]:
    """Runs `mpirun -np N python args... --result_dir DIR` (no tf_smb launcher
    variables: ranks come from Open MPI) and returns each rank's result file."""
    e = {k: v for k, v in base_env(env).items() if not k.startswith("TF_SMB_")}
    argv = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(np_),
            *python(), *args, "--result_dir", result_dir]
    r = run_command(argv, timeout, e, cwd=REPO)
    assert r.returncode == 0, f"mpirun exited with {r.returncode}:\n{r.stderr[-4000:]}{r.stdout[-2000:]}"
    results = []
    for rank in range(np_):
        with open(os.path.join(result_dir, f"rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


def require_horovod() -> None:
    """Fails (does not skip) when Horovod is missing: tools/test.sh installs it."""
    p = subprocess.run([sys.executable, "-c", "import horovod.tensorflow"],
                       capture_output=True, timeout=300)
    assert p.returncode == 0, "tools/test.sh installs Horovod (tools/install_horovod.sh)"


def max_diff(a, b) -> float:
    """The largest |a - b| over two lists of arrays (e.g. model weights)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))


def run_python(code: str, timeout: float = 300) -> str:
    """Runs `python -c code` from the repository; fails with its stderr if it
    fails; returns its stdout."""
    p = subprocess.run([*python(), "-c", code], capture_output=True, text=True,
                       timeout=timeout, cwd=REPO, env=base_env())
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout
