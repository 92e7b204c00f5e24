"""Job launcher: ``python -m tf_smb.run -np N [--timeout S] [--staging-bytes B] [--] COMMAND...``.

Creates the job's shared-memory box, starts N copies of COMMAND with TF_SMB_RANK,
TF_SMB_SIZE and TF_SMB_JOB_ID set (and TF_CPP_MIN_LOG_LEVEL=1 unless set: no
TensorFlow INFO banners from every worker), prints their merged output prefixed
with ``[rank]: `` and, when one worker fails, stops the others and names the
failing rank.
"""
from __future__ import annotations

import argparse
import collections
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from typing import Deque, List, Optional, Sequence

try:
    from tf_smb import _box
except ImportError as e:  # e.g. a source checkout whose extensions are not built
    raise ImportError(
        f"tf_smb's C++ module tf_smb._box is missing or does not load ({e}). Build "
        "it: `pip install .` in the tf_smb source checkout (or `bash tools/install.sh`), "
        "or `python setup.py build_ext --inplace` to build it in the checkout") from e

POLL_S = 0.05        # how often the workers are polled
TERM_GRACE_S = 5.0   # how long stopped workers get between SIGTERM and SIGKILL
TAIL_LINES = 20      # lines of each worker's output kept for the failure summary
# Worker environment defaults, each unless already set: TensorFlow's C++ log
# level 1 drops the INFO banners every worker would print (warnings stay).
WORKER_ENV_DEFAULTS = {"TF_CPP_MIN_LOG_LEVEL": "1"}
_PREFIX = "tf_smb.run: "


def _parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tf_smb.run",
        description="Runs N workers of a tf_smb job on this machine.")
    parser.add_argument("-np", dest="np", type=int, required=True,
                        help="number of workers (>= 1)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="collective timeout in seconds, passed as TF_SMB_TIMEOUT")
    parser.add_argument("--staging-bytes", type=int, default=1 << 20,
                        help="staging area of the box in bytes (default 1 MiB)")
    parser.add_argument("--heap-bytes", type=int, default=4 << 30,
                        help="room for all-reduce result buffers and parameter "
                             "segments (async mode) in bytes (default 4 GiB; "
                             "sparse, only what is used costs memory)")
    parser.add_argument("--keep-going", action="store_true",
                        help="when a worker fails, let the others finish (for "
                             "SMBStrategy(mode='async')); exit non-zero at the end")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the command each worker runs")
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if args.np < 1:
        parser.error(f"-np must be at least 1, got {args.np}")
    if args.timeout is not None and args.timeout <= 0:
        parser.error(f"--timeout must be positive, got {args.timeout}")
    if args.heap_bytes < 0:
        parser.error(f"--heap-bytes must be non-negative, got {args.heap_bytes}")
    if args.staging_bytes < 1:
        parser.error(f"--staging-bytes must be positive, got {args.staging_bytes}")
    if not args.command:
        parser.error("missing COMMAND to run")
    return args


class _Worker:
    """One worker process, the thread that prints its output, and its last lines."""

    def __init__(self, rank: int, command: List[str], env: dict, lock: threading.Lock):
        self.rank = rank
        self.tail: Deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._lock = lock
        self.reader = threading.Thread(target=self._pump, daemon=True,
                                       name=f"tf_smb.run-reader-{rank}")
        self.reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        prefix = f"[{self.rank}]: ".encode()
        out = getattr(sys.stdout, "buffer", None)
        for raw in iter(self.proc.stdout.readline, b""):
            if not raw.endswith(b"\n"):
                raw += b"\n"
            self.tail.append(raw.decode("utf-8", errors="replace").rstrip("\n"))
            with self._lock:
                if out is not None:
                    out.write(prefix + raw)
                    out.flush()
                else:
                    sys.stdout.write((prefix + raw).decode("utf-8", errors="replace"))
                    sys.stdout.flush()
        self.proc.stdout.close()

    def signal_group(self, sig: int) -> None:
        """Sends ``sig`` to the worker's process group, if it still exists."""
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _stop(workers: List[_Worker]) -> None:
    """SIGTERM to every worker group, then SIGKILL to what is left after the grace."""
    for w in workers:
        w.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE_S
    while time.monotonic() < deadline and any(w.proc.poll() is None for w in workers):
        time.sleep(POLL_S)
    for w in workers:
        w.signal_group(signal.SIGKILL)  # also catches children left in the group
    for w in workers:
        try:
            w.proc.wait(timeout=TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            print(f"{_PREFIX}rank {w.rank} (pid {w.proc.pid}) did not exit after SIGKILL",
                  file=sys.stderr)


def _describe(code: int) -> str:
    """'exited with code C' or 'was killed by signal NAME' for a Popen return code."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = str(-code)
    return f"was killed by signal {name}"


def _report_failure(worker: _Worker) -> None:
    worker.reader.join(timeout=2.0)  # let the last lines of the failing rank arrive
    lines = [f"{_PREFIX}rank {worker.rank} {_describe(worker.proc.returncode)}"]
    if worker.tail:
        lines.append(f"{_PREFIX}last output of rank {worker.rank}:")
        lines.extend(f"  [{worker.rank}]: {line}" for line in worker.tail)
    print("\n".join(lines), file=sys.stderr, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the launcher with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    try:
        args = _parse_args(argv)
    except SystemExit as e:  # argparse usage errors and --help
        return e.code if isinstance(e.code, int) else 2
    job_id = f"run-{os.getpid()}-{secrets.token_hex(4)}"

    received: List[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signum)

    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            box = _box.create_box(job_id, args.np, staging_bytes=args.staging_bytes,
                                  heap_bytes=args.heap_bytes)
        except (RuntimeError, ValueError) as e:
            print(f"{_PREFIX}cannot create the box for job {job_id}: {e}", file=sys.stderr)
            return 1
        try:
            return _run_workers(args, job_id, received)
        finally:
            try:
                box.unlink()
            finally:
                box.close()
    finally:
        for s, h in old_handlers.items():
            signal.signal(s, h)


def _exit_code(worker: _Worker) -> int:
    code = worker.proc.returncode
    return code if code > 0 else 1


def _run_workers(args: argparse.Namespace, job_id: str, received: List[int]) -> int:
    """Starts and monitors the workers; stops them all on failure or signal."""
    lock = threading.Lock()
    workers: List[_Worker] = []
    failures: List[_Worker] = []
    try:
        for rank in range(args.np):
            env = dict(WORKER_ENV_DEFAULTS)
            env.update(os.environ, TF_SMB_RANK=str(rank), TF_SMB_SIZE=str(args.np),
                       TF_SMB_JOB_ID=job_id, TF_SMB_BOX_CREATED="1", PYTHONUNBUFFERED="1")
            if args.timeout is not None:
                env["TF_SMB_TIMEOUT"] = repr(args.timeout)
            try:
                workers.append(_Worker(rank, args.command, env, lock))
            except OSError as e:
                print(f"{_PREFIX}cannot start {args.command[0]!r} for rank {rank}: {e}",
                      file=sys.stderr)
                return 127
        while True:
            if received:
                signum = received[0]
                print(f"{_PREFIX}received {signal.Signals(signum).name}, stopping workers",
                      file=sys.stderr, flush=True)
                _stop(workers)
                return 128 + signum
            newly_failed = [w for w in workers if w not in failures and
                            w.proc.poll() is not None and w.proc.returncode != 0]
            for failed in newly_failed:
                failures.append(failed)
                if not args.keep_going:
                    _stop(workers)  # also clears anything left in the failed rank's group
                    _report_failure(failed)
                    return _exit_code(failed)
                failed.signal_group(signal.SIGKILL)  # its children, if any
                _report_failure(failed)
                print(f"{_PREFIX}--keep-going: the other workers continue",
                      file=sys.stderr, flush=True)
            if all(w.proc.poll() is not None for w in workers):
                for w in workers:
                    w.reader.join(timeout=2.0)
                return _exit_code(failures[0]) if failures else 0
            time.sleep(POLL_S)
    finally:
        if any(w.proc.poll() is None for w in workers):
            _stop(workers)


if __name__ == "__main__":
    sys.exit(main())
