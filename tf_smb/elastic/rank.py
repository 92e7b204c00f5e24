"""One rank of an elastic job across nodes: `python -m tf_smb.elastic.rank -- COMMAND...`,
which the elastic launcher starts under each generation's `mpirun` (docs/elastic.md,
"Across nodes").

It runs COMMAND (the worker) as its child and stands between it and the launcher:

  * it gives the worker the files a worker on one node reads (protocol.py), in a
    directory of its own: generation.json (this generation; members are ranks)
    and hosts.json, written when mpirun forwards SIGUSR1 (hosts added) or
    SIGUSR2 (removed) from the launcher;
  * it tells the launcher, in event lines on its standard output (mpirun carries
    them): started (host, pid), joined (the worker synced its state), exit
    (the worker's status: 0 done, NEXT_GENERATION_EXIT its generation ended for
    a change, else a failure, with the signal that killed it if one did);
  * it exits with 0 when the worker ended well or for the next generation, else
    with 1, so that mpirun stops the others (Open MPI ends a job whose rank fails).

The worker runs in a process group of its own: mpirun signals a rank's whole
process group (SIGUSR1 would kill a worker that does not catch it); it stays in
the wrapper's session, since Linux's autogroup scheduling shares the CPU by
session (in a session of its own a worker ran ~5% slower, measured across 2
simulated nodes on 2 cores). It dies with this process (PR_SET_PDEATHSIG) when
mpirun kills the wrapper. Imports no TensorFlow.
"""
from __future__ import annotations

import ctypes
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Sequence

from tf_smb.elastic import protocol

POLL_S = 0.05
TERM_GRACE_S = 3.0  # the worker's time between SIGTERM and SIGKILL when mpirun stops us
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when this wrapper dies."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class _Rank:
    def __init__(self, command: Sequence[str]) -> None:
        env = os.environ
        self.command = list(command)
        self.rank = int(env.get("OMPI_COMM_WORLD_RANK", env.get("PMIX_RANK", "0")))
        self.size = int(env.get("OMPI_COMM_WORLD_SIZE", "1"))
        self.generation = int(env.get(protocol.GENERATION_VAR, "0"))
        self.dir = protocol.make_private_dir(tempfile.mkdtemp(prefix="tf_smb-elastic-rank-"))
        self.child: Optional[subprocess.Popen] = None
        self.serial = 0
        self.stopping = False

    def say(self, event: str, **fields: object) -> None:
        sys.stdout.flush()
        # One write: mpirun tags what it reads in pieces, and a line in two would mix
        # with another rank's.
        os.write(sys.stdout.fileno(), (protocol.rank_event(event, self.rank, **fields)
                                       + "\n").encode())

    def on_hosts_updated(self, signum: int, _frame: object) -> None:
        self.serial += 1
        protocol.write_host_update(self.dir, protocol.HostUpdate(
            self.serial, added=signum == signal.SIGUSR1, removed=signum == signal.SIGUSR2))

    def on_stop(self, signum: int, _frame: object) -> None:
        self.stopping = True
        if self.child is not None and self.child.poll() is None:
            try:
                os.killpg(self.child.pid, signum)
            except ProcessLookupError:
                pass

    def run(self) -> int:
        protocol.write_generation(self.dir, protocol.Generation(
            self.generation, job_id="", members=list(range(self.size))))
        for signum in (signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(signum, self.on_hosts_updated)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.on_stop)
        env = dict(os.environ, **{protocol.DIR_VAR: self.dir,
                                  protocol.WORKER_ID_VAR: str(self.rank)})
        try:
            self.child = subprocess.Popen(self.command, env=env, process_group=0,
                                          preexec_fn=_die_with_parent)
        except OSError as e:
            print(f"tf_smb elastic rank {self.rank}: cannot start {self.command[0]!r}: {e}",
                  file=sys.stderr, flush=True)
            self.say("exit", code=127, host=platform.node())
            return 1
        self.say("started", host=platform.node(), pid=self.child.pid)
        joined = os.path.join(self.dir, f"joined-{self.generation}-{self.rank}")
        told_joined = False
        stop_at: Optional[float] = None
        while self.child.poll() is None:
            if not told_joined and os.path.exists(joined):
                told_joined = True
                self.say("joined", generation=self.generation)
            if self.stopping and stop_at is None:
                stop_at = time.monotonic() + TERM_GRACE_S
            if stop_at is not None and time.monotonic() > stop_at:
                os.killpg(self.child.pid, signal.SIGKILL)
            time.sleep(POLL_S)
        code = self.child.returncode
        fields = {"code": code, "host": platform.node()}
        if code < 0:
            fields["signal"] = signal.Signals(-code).name
        if self.stopping:
            fields["stopped"] = 1  # by mpirun, as another rank failed
        self.say("exit", **fields)
        shutil.rmtree(self.dir, ignore_errors=True)
        return 0 if code in (0, protocol.NEXT_GENERATION_EXIT) else 1


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the wrapper (see the module); its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("usage: python -m tf_smb.elastic.rank -- COMMAND...", file=sys.stderr)
        return 2
    return _Rank(argv).run()


if __name__ == "__main__":
    sys.exit(main())
