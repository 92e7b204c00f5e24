"""Starts a group of worker processes and watches them: the one supervisor of tf_smb.

Used by the launcher (tf_smb/run.py), the tests' harness (tests/harness.py) and the
benchmarks (benchmarks/processes.py):

  * `worker_env` builds a worker's environment: the parent's without launcher
    variables (tf_smb.env.LAUNCHER_VARS), WORKER_ENV_DEFAULTS under it, unbuffered
    Python, optional PYTHONPATH entries, then the rank variables;
  * `Workers` starts the processes, each in a session of its own, and pumps their
    output: to our stdout with a ``[rank]: `` prefix ("prefix"), kept merged
    ("merged"), or kept as separate stdout and stderr ("split"); each one's last
    lines are kept for `report`;
  * `Workers.wait` polls them until all have ended, one fails (unless told to go on),
    the timeout passes or `interrupted()` names a signal; `Workers.stop` (also run on
    the way out of ``with``) sends SIGTERM to each process group and to every process
    the workers started (launchers such as mpirun put theirs in other groups), then
    SIGKILL to what is left after a grace.

Nothing here imports TensorFlow.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from typing import (IO, Callable, Deque, Dict, Iterable, Iterator, List, Mapping, Optional,
                    Sequence, Set, Tuple)

from tf_smb import env as env_lib

POLL_S = 0.05        # how often the workers are polled
TERM_GRACE_S = 5.0   # how long stopped workers get between SIGTERM and SIGKILL
TAIL_LINES = 20      # lines of each worker's output kept for the failure report
# Worker environment defaults, each unless already set: TensorFlow's C++ log level 2
# drops the INFO banners and warnings every worker would print (errors stay).
WORKER_ENV_DEFAULTS = {"TF_CPP_MIN_LOG_LEVEL": "2"}
OUTPUTS = ("prefix", "merged", "split")

Command = Tuple[Sequence[str], Mapping[str, str]]  # argv, environment


def worker_env(base: Optional[Mapping[str, str]] = None, *, rank: Optional[int] = None,
               size: Optional[int] = None, job_id: Optional[str] = None,
               box_created: bool = False, timeout_s: Optional[float] = None,
               pythonpath: Iterable[object] = (),
               overrides: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """A worker's environment.

    `base` (default: os.environ) without launcher variables, over WORKER_ENV_DEFAULTS;
    PYTHONUNBUFFERED=1; `pythonpath` entries put first on PYTHONPATH; TF_SMB_RANK,
    TF_SMB_SIZE and TF_SMB_JOB_ID when `rank` is given (TF_SMB_BOX_CREATED=1 too when
    the box already exists); TF_SMB_TIMEOUT when `timeout_s` is given; `overrides` last.
    """
    base = os.environ if base is None else base
    env = dict(WORKER_ENV_DEFAULTS)
    env.update((k, v) for k, v in base.items() if k not in env_lib.LAUNCHER_VARS)
    env["PYTHONUNBUFFERED"] = "1"
    paths = [str(p) for p in pythonpath]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths + list(filter(None, [env.get("PYTHONPATH")])))
    if rank is not None:
        if size is None or job_id is None:
            raise ValueError("a rank needs a size and a job id")
        env.update(TF_SMB_RANK=str(rank), TF_SMB_SIZE=str(size), TF_SMB_JOB_ID=job_id)
        if box_created:
            env["TF_SMB_BOX_CREATED"] = "1"
    if timeout_s is not None:
        env["TF_SMB_TIMEOUT"] = repr(float(timeout_s))
    env.update(overrides or {})
    return env


def describe(code: int) -> str:
    """'exited with code C' or 'was killed by signal NAME' for a Popen return code."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = str(-code)
    return f"was killed by signal {name}"


class StartError(RuntimeError):
    """A worker's command could not be started (the ones already started are stopped)."""

    def __init__(self, name: str, argv: Sequence[str], cause: OSError):
        super().__init__(f"cannot start {argv[0]!r} for {name}: {cause}")
        self.name, self.argv, self.cause = name, list(argv), cause


@dataclasses.dataclass
class Outcome:
    """How a wait ended.

    returncodes: each worker's exit code (negative: killed by that signal).
    failed: workers (indices) that exited non-zero on their own, in the order seen.
    running: workers still running when the wait gave up (timeout or signal); stopped since.
    timeout_s: the timeout, when it passed.
    signal: the signal `interrupted` named, when it ended the wait.
    names: the workers' names ("rank 0", ...).
    """

    returncodes: List[Optional[int]]
    failed: List[int]
    running: List[int]
    names: List[str]
    timeout_s: Optional[float] = None
    signal: Optional[int] = None

    @property
    def ok(self) -> bool:
        return (not self.failed and not self.running and self.signal is None
                and all(code == 0 for code in self.returncodes))

    @property
    def reason(self) -> str:
        """Why the workers did not all succeed ("" when they did)."""
        if self.signal is not None:
            return f"received {signal.Signals(self.signal).name}"
        if self.failed:
            first = self.failed[0]
            return f"{self.names[first]} {describe(self.returncodes[first])}"
        if self.running:
            return f"timed out after {self.timeout_s:.0f} s"
        bad = [i for i, code in enumerate(self.returncodes) if code != 0]
        return ", ".join(f"{self.names[i]} {describe(self.returncodes[i])}" for i in bad)


@contextlib.contextmanager
def _affinity(cpus: Optional[Set[int]]) -> Iterator[None]:
    """Runs the block on `cpus` (None: unchanged): a child started in it inherits
    them, with every thread it will start. Only this thread moves, and it moves
    back, so no other thread of this process is affected."""
    if cpus is None:
        yield
        return
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous)


def split_cpus(workers: int, cpus: Optional[Sequence[int]] = None) -> List[Optional[Set[int]]]:
    """Each worker's own CPUs: `cpus` (default: those this process may run on) in
    contiguous blocks as even as can be, or None for every worker when there are
    more workers than CPUs (binding would stack some on one CPU)."""
    available = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if workers > len(available):
        return [None] * workers
    share, extra = divmod(len(available), workers)
    blocks, start = [], 0
    for i in range(workers):
        end = start + share + (1 if i < extra else 0)
        blocks.append(set(available[start:end]))
        start = end
    return blocks


class _Process:
    """One worker process, the threads that read its output, and what they read."""

    def __init__(self, name: str, prefix: bytes, argv: Sequence[str], env: Mapping[str, str],
                 cwd: Optional[str], output: str, lock: threading.Lock,
                 cpus: Optional[Set[int]] = None):
        self.name, self._prefix, self._output, self._lock = name, prefix, output, lock
        self.tail: Deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.chunks: Dict[str, List[bytes]] = {"stdout": [], "stderr": []}
        split = output == "split"
        with _affinity(cpus):
            self.popen = subprocess.Popen(
                list(argv), env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE if split else subprocess.STDOUT,
                start_new_session=True)
        streams = [("stdout", self.popen.stdout)] + ([("stderr", self.popen.stderr)]
                                                     if split else [])
        self.readers = [threading.Thread(target=self._pump, args=s, daemon=True,
                                         name=f"tf_smb-reader-{name}-{s[0]}")
                        for s in streams]
        for reader in self.readers:
            reader.start()

    def _pump(self, which: str, stream: IO[bytes]) -> None:
        out = getattr(sys.stdout, "buffer", None)
        for raw in iter(stream.readline, b""):
            self.tail.append(raw.decode("utf-8", errors="replace").rstrip("\n"))
            if self._output != "prefix":
                self.chunks[which].append(raw)
                continue
            line = self._prefix + (raw if raw.endswith(b"\n") else raw + b"\n")
            with self._lock:
                if out is not None:
                    out.write(line)
                    out.flush()
                else:
                    sys.stdout.write(line.decode("utf-8", errors="replace"))
                    sys.stdout.flush()
        stream.close()

    def join_readers(self, timeout_s: float = 2.0) -> None:
        for reader in self.readers:
            reader.join(timeout=timeout_s)

    def text(self, which: str) -> str:
        return b"".join(self.chunks[which]).decode("utf-8", errors="replace")


class Workers:
    """Worker processes started together; use with ``with`` so they never outlive it.

    commands: (argv, environment) of each worker; worker i is named names[i]
      (default "rank i") and, with output="prefix", its lines read ``[i]: ...``.
    output: "prefix" (to our stdout as it comes), "merged" (stdout and stderr kept
      together: `output(i)`) or "split" (kept apart: `output(i)`, `stderr(i)`).
    grace_s: how long stopped workers get between SIGTERM and SIGKILL.
    log: where the supervisor's own messages go (default: stderr).
    cpus: the CPUs each worker (and every thread it starts) may run on; None
      for a worker, or no list, leaves it this process's (see `split_cpus`).
    labels: what worker i's lines start with in brackets (default: i).
    Raises StartError when a command cannot start.
    """

    def __init__(self, commands: Sequence[Command], *, output: str = "merged",
                 cwd: Optional[object] = None, names: Optional[Sequence[str]] = None,
                 grace_s: float = TERM_GRACE_S,
                 log: Optional[Callable[[str], None]] = None,
                 cpus: Optional[Sequence[Optional[Set[int]]]] = None,
                 labels: Optional[Sequence[str]] = None):
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        self.names = list(names) if names else [f"rank {i}" for i in range(len(commands))]
        self.labels = list(labels) if labels else [str(i) for i in range(len(commands))]
        self.grace_s = grace_s
        self._log = log or (lambda message: print(message, file=sys.stderr, flush=True))
        self._procs: List[_Process] = []
        lock = threading.Lock()
        for i, (argv, env) in enumerate(commands):
            try:
                self._procs.append(_Process(self.names[i], f"[{self.labels[i]}]: ".encode(),
                                            argv, env,
                                            None if cwd is None else str(cwd), output, lock,
                                            cpus[i] if cpus else None))
            except OSError as e:
                self.close()
                raise StartError(self.names[i], argv, e) from e

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stops whatever is left and collects the rest of the output."""
        self.stop()
        for p in self._procs:
            p.join_readers()

    @property
    def pids(self) -> List[int]:
        return [p.popen.pid for p in self._procs]

    def returncode(self, i: int) -> Optional[int]:
        """Worker i's exit status (negative: the signal that ended it), None while it runs."""
        return self._procs[i].popen.poll()

    def output(self, i: int) -> str:
        """Worker i's stdout (with stderr unless output="split"); empty with "prefix"."""
        return self._procs[i].text("stdout")

    def stderr(self, i: int) -> str:
        return self._procs[i].text("stderr")

    def report(self, i: int, prefix: str = "") -> str:
        """'NAME exited with code C' (or the signal) and the last lines worker i printed."""
        p = self._procs[i]
        p.join_readers()  # let its last lines arrive
        lines = [f"{prefix}{p.name} {describe(p.popen.returncode)}"]
        if p.tail:
            lines.append(f"{prefix}last output of {p.name}:")
            lines.extend(f"  [{self.labels[i]}]: {line}" for line in p.tail)
        return "\n".join(lines)

    def wait(self, timeout_s: Optional[float] = None, stop_on_failure: bool = True,
             interrupted: Optional[Callable[[], Optional[int]]] = None,
             on_failure: Optional[Callable[[int], None]] = None) -> Outcome:
        """Waits until every worker has ended, and returns how.

        A worker that exits non-zero stops the others (SIGTERM, then SIGKILL), unless
        `stop_on_failure` is False: then only what it left in its process group is killed
        and the others go on. `on_failure(i)` is called for each failure, after that.
        Past `timeout_s`, or when `interrupted()` returns a signal number, every worker
        is stopped.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        failed: List[int] = []

        def outcome(running: Sequence[int] = (), **kw: object) -> Outcome:
            return Outcome([p.popen.poll() for p in self._procs], list(failed), list(running),
                           self.names, **kw)  # type: ignore[arg-type]

        while True:
            signum = interrupted() if interrupted else None
            if signum:
                running = self._running()
                self._log(f"received {signal.Signals(signum).name}, stopping workers")
                self.stop()
                return outcome(running, signal=signum)
            for i, p in enumerate(self._procs):
                if i in failed or p.popen.poll() in (None, 0):
                    continue
                failed.append(i)
                if stop_on_failure:
                    self.stop()  # also clears anything left in the failed worker's group
                else:
                    _signal_groups([p.popen.pid], signal.SIGKILL)  # its children, if any
                if on_failure:
                    on_failure(i)
                if stop_on_failure:
                    return outcome()
            if not self._running():
                self.close()  # what they left in their groups would hold their output open
                return outcome()
            if deadline is not None and time.monotonic() > deadline:
                running = self._running()
                self.stop()
                return outcome(running, timeout_s=timeout_s)
            time.sleep(POLL_S)

    def _running(self) -> List[int]:
        return [i for i, p in enumerate(self._procs) if p.popen.poll() is None]

    def stop(self) -> None:
        """SIGTERM to every worker's process group and every process it started, then
        SIGKILL to what is left after the grace; returns once the workers are reaped."""
        groups = self.pids
        started: Dict[int, str] = {}  # descendants: pid -> start time (pids get reused)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            live = _live_processes() or {}
            started.update(_descendants(groups, live))
            if not self._anything_left(groups, started):
                break
            _signal_groups(groups, sig)
            for pid, start in started.items():
                if pid in live and live[pid][2] == start:
                    _kill(pid, sig)
            end = time.monotonic() + self.grace_s
            while time.monotonic() < end and self._anything_left(groups, started):
                time.sleep(POLL_S)
        for p in self._procs:
            try:
                p.popen.wait(timeout=self.grace_s)
            except subprocess.TimeoutExpired:
                self._log(f"{p.name} (pid {p.popen.pid}) did not exit after SIGKILL")

    def _anything_left(self, groups: Sequence[int], started: Mapping[int, str]) -> bool:
        if any(p.popen.poll() is None for p in self._procs):
            return True
        live = _live_processes()
        if live is None:  # no /proc: ask the kernel (a zombie counts as alive then)
            return any(_group_alive(g) for g in groups)
        return any(pgrp in groups or started.get(pid) == start
                   for pid, (_, pgrp, start) in live.items())


# --------------------------------------------------------------------------- processes

def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_groups(groups: Sequence[int], sig: int) -> None:
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _live_processes() -> Optional[Dict[int, Tuple[int, int, str]]]:
    """Every live (not zombie) process: pid -> (parent pid, process group, start time in
    clock ticks, which tells a process from a later one with its pid); None without /proc.
    """
    proc = pathlib.Path("/proc")
    if not (proc / "self" / "stat").exists():
        return None
    found = {}
    for entry in proc.glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] != "Z":
                found[int(entry.name)] = (int(fields[1]), int(fields[2]), fields[19])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return found


def _descendants(pids: Sequence[int], live: Mapping[int, Tuple[int, int, str]]
                 ) -> Dict[int, str]:
    """The descendants of `pids` among the `live` processes, with their start times."""
    children: Dict[int, List[Tuple[int, str]]] = {}
    for pid, (ppid, _, start) in live.items():
        children.setdefault(ppid, []).append((pid, start))
    found: Dict[int, str] = {}
    todo = list(pids)
    while todo:
        for child, start in children.get(todo.pop(), []):
            if child not in found:
                found[child] = start
                todo.append(child)
    return found
