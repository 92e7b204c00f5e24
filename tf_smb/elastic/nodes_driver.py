"""The elastic launcher across nodes: each generation of the job is one Open MPI
`mpirun` over the generation's hosts (docs/elastic.md, "Across nodes").

Open MPI's world is fixed at launch and ends with any of its ranks, so a change
of the members cannot happen inside a running mpirun: the launcher ends it and
starts the next generation's mpirun with the hosts then available. What
training did survives in each node's commit box (tf_smb/elastic/commit_box.py),
written at every commit by the node's first rank; the next generation's
processes resume from the newest commit their nodes hold, not from disk.

Each rank runs under tf_smb/elastic/rank.py, which reports on its standard
output (mpirun forwards it here) when its worker started, joined (synced its
state) and how it ended; the launcher tells the ranks of host updates by
signalling mpirun (SIGUSR1: hosts added, SIGUSR2: removed), which forwards the
signal to every rank. tf_smb opens no socket: the traffic is mpirun's.

  * a rank that fails (non-zero exit, a signal) blacklists its host (Driver's
    Blacklist, cooldown and all); its wrapper exits non-zero, so mpirun stops
    the others; a node lost whole (its ranks never report how they ended, and
    mpirun fails) blacklists its host too;
  * hosts added or removed (discovery, once every rank joined): the ranks stop
    at their next commit (they exit with protocol.NEXT_GENERATION_EXIT) and the
    next generation starts: no rollback;
  * the job ends when its ranks end with 0; fewer than --min-np slots for
    --elastic-timeout, more resets than --reset-limit, every host blacklisted or
    an mpirun that starts no rank end it non-zero, naming why.

Imports no TensorFlow.
"""
from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from tf_smb import env as env_lib
from tf_smb.elastic import commit_box, protocol
from tf_smb.elastic.driver import (DISCOVER_S, FAILED_MESSAGE, POLL_S, Driver, JobFailed,
                                   Options, assignment_order)

START_TIMEOUT_S = 120.0  # how long every rank of a generation may take to start
STOP_GRACE_S = 15.0      # how long mpirun gets to end after SIGTERM
REMOVE_TIMEOUT_S = 60.0  # how long removing the commit boxes at the end may take
# Every rank gets the launcher's environment (mpirun -x each name, as horovodrun
# does) but for these: the machine's, the shell's, and other launchers'.
NOT_FORWARDED = ("HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "DISPLAY", "TERM", "TMUX")
NOT_FORWARDED_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "SLURM_", "SSH_", "BASH_FUNC")
_TAGGED = re.compile(r"^\[\d+,(\d+)\]<(stdout|stderr)>:(.*)$")


class NodesDriver(Driver):
    """Runs one elastic job across nodes (see the module); `run` returns its exit status."""

    def __init__(self, options: Options, log: Callable[[str], None],
                 interrupted: Callable[[], Optional[int]]) -> None:
        super().__init__(options, log, interrupted)
        self._mpirun_path = shutil.which("mpirun")
        self._mpirun: Optional[subprocess.Popen] = None
        self._used: List[str] = []  # hosts the job ran on (their nodes hold commits)
        self._lost: Set[str] = set()  # hosts whose ranks ended without a word

    def _check_hosts(self, hosts: Dict[str, int]) -> None:
        del hosts  # any host: mpirun reaches it

    def run(self) -> int:
        if self._mpirun_path is None:
            self._log("the job failed: elastic jobs across nodes need Open MPI's mpirun "
                      "on PATH (apt-get install openmpi-bin)")
            return 1
        try:
            hosts = self._wait_for_slots([])
            while True:
                ranks = self._place(hosts)
                self._next_generation()
                code = self._run_generation(ranks)
                if code is not None:
                    return code
                hosts = self._wait_for_slots([])
        except JobFailed as e:
            self._log(f"the job failed: {e}")
            return 1
        except KeyboardInterrupt as e:
            signum = e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT
            self._log(f"received {signal.Signals(signum).name}, stopping the workers")
            return 128 + signum
        finally:
            self._stop_mpirun()
            self._remove_commits()
            shutil.rmtree(self._dir, ignore_errors=True)

    # -- one generation ---------------------------------------------------------
    def _place(self, hosts: Dict[str, int]) -> List[str]:
        """Each rank's host: every slot, up to --max-np, the hosts of the last
        generation first (`assignment_order`)."""
        self._host_order = assignment_order(self._host_order, list(hosts))
        ranks = [h for h in self._host_order for _ in range(hosts[h])]
        return ranks[:self.options.max_np]

    def _argv(self, ranks: Sequence[str], forward: Sequence[str]) -> List[str]:
        counts: Dict[str, int] = {}
        for host in ranks:
            counts[host] = counts.get(host, 0) + 1
        argv = [str(self._mpirun_path)]
        if os.geteuid() == 0:
            argv.append("--allow-run-as-root")
        argv += ["-np", str(len(ranks)), "-H", ",".join(f"{h}:{n}" for h, n in counts.items()),
                 "--tag-output"]
        if "--map-by" not in self.options.mpi_args:
            argv += ["--map-by", "slot"]  # ranks fill each host in turn: our rank -> host map
        argv += list(self.options.mpi_args)
        for name in forward:
            argv += ["-x", name]
        return argv + [sys.executable, "-m", "tf_smb.elastic.rank", "--",
                       *self.options.command]

    def _env(self) -> Tuple[Dict[str, str], List[str]]:
        """mpirun's environment, and the names it forwards to every rank."""
        env = dict(os.environ)
        for name in list(env):  # another launcher's, had this one been started by one
            if name in env_lib.LAUNCHER_VARS:
                del env[name]
        env[protocol.ACROSS_NODES_VAR] = self._job
        env[protocol.GENERATION_VAR] = str(self._generation)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        if self.options.timeout_s is not None:
            env["TF_SMB_TIMEOUT"] = f"{self.options.timeout_s:g}"
        forward = [n for n in env if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n)
                   and n not in NOT_FORWARDED and not n.startswith(NOT_FORWARDED_PREFIXES)]
        return env, forward

    def _run_generation(self, ranks: List[str]) -> Optional[int]:
        """Runs generation `self._generation` on `ranks`' hosts; the job's exit
        status when it ended, None when the next generation follows."""
        generation, size = self._generation, len(ranks)
        env, forward = self._env()
        self._log(f"generation {generation}: {size} workers ({', '.join(ranks)}) under mpirun")
        self._used += [h for h in dict.fromkeys(ranks) if h not in self._used]
        self._slots_seen = {(h, i) for h, n in self._hosts.items() for i in range(n)}
        self._mpirun = subprocess.Popen(self._argv(ranks, forward), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                        env=env, start_new_session=True)
        lines: "queue.Queue[Optional[Tuple[str, str]]]" = queue.Queue()
        readers = [threading.Thread(target=_read, args=(stream, which, lines), daemon=True)
                   for stream, which in ((self._mpirun.stdout, "out"),
                                         (self._mpirun.stderr, "err"))]
        for reader in readers:
            reader.start()
        started: Set[int] = set()
        joined: Set[int] = set()
        exits: Dict[int, Dict[str, str]] = {}
        open_streams, launched, announced = 2, time.monotonic(), False
        while open_streams:
            try:
                item = lines.get(timeout=POLL_S)
            except queue.Empty:
                item = ("", "")
            if item is None:
                open_streams -= 1
                continue
            which, line = item
            if line:
                event = self._show(which, line)
                if event is not None:
                    name, rank, fields = event
                    {"started": started, "joined": joined}.get(name, set()).add(rank)
                    if name == "exit":
                        exits[rank] = fields
            self._check_interrupted()
            if len(started) < size and time.monotonic() - launched > START_TIMEOUT_S:
                self._log(f"generation {generation}: ranks "
                          f"{sorted(set(range(size)) - started)} did not start within "
                          f"{START_TIMEOUT_S:g} s; stopping mpirun")
                self._stop_mpirun()
            if (not announced and len(joined) == size and len(exits) == 0
                    and time.monotonic() - self._discovered_at >= DISCOVER_S):
                announced = self._announce(ranks, self._discover())
        code = self._mpirun.wait()
        self._mpirun = None
        return self._outcome(ranks, started, exits, code)

    def _show(self, which: str, line: str) -> Optional[Tuple[str, int, Dict[str, str]]]:
        """Prints a line of mpirun's output (a rank's as `[rank]: ...`); the
        rank event it holds, if any (not printed)."""
        tagged = _TAGGED.match(line)
        text = line
        if tagged:
            # mpirun tags each piece it reads: a line the rank wrote in two writes
            # (unbuffered Python prints the text, then the newline) holds its tag again.
            tag = line[:len(line) - len(tagged.group(3))]
            text = tagged.group(3).replace(tag, "")
        event = protocol.parse_rank_event(text)
        if event is not None:
            return event
        if text.startswith("mpirun: Forwarding signal"):
            return None  # our own host-update signals
        stream = sys.stdout if (tagged and tagged.group(2) == "stdout") or (
            not tagged and which == "out") else sys.stderr
        stream.write(f"[{tagged.group(1)}]: {text}\n" if tagged else f"{line}\n")
        stream.flush()
        return None

    def _announce(self, ranks: Sequence[str], hosts: Dict[str, int]) -> bool:
        """Tells the ranks of hosts added (free slots discovered since this
        generation began, below --max-np) or removed (members' hosts gone):
        they stop at their next commit. Whether it told them."""
        members = set(ranks)
        removed = bool(members - set(hosts))
        taken: Dict[str, int] = {}
        for host in ranks:
            taken[host] = taken.get(host, 0) + 1
        free = [(h, i) for h, n in hosts.items() for i in range(taken.get(h, 0), n)]
        added = len(ranks) < self.options.max_np and any(
            slot not in self._slots_seen for slot in free)
        if not (added or removed):
            return False
        self._log(f"generation {self._generation}: hosts "
                  f"{'added' if added else ''}{' and ' if added and removed else ''}"
                  f"{'removed' if removed else ''}; the workers stop at their next commit")
        if self._mpirun is not None:
            for flag, signum in ((added, signal.SIGUSR1), (removed, signal.SIGUSR2)):
                if flag:
                    self._mpirun.send_signal(signum)
        return True

    def _outcome(self, ranks: List[str], started: Set[int], exits: Dict[int, Dict[str, str]],
                 code: int) -> Optional[int]:
        size = len(ranks)
        finished = [r for r, f in exits.items() if f.get("code") == "0"]
        failed = [r for r, f in exits.items()
                  if f.get("code") not in ("0", str(protocol.NEXT_GENERATION_EXIT))
                  and not f.get("stopped")]
        unknown = [r for r in range(size) if r not in exits]
        for rank in failed:
            how = exits[rank].get("signal") or f"exit code {exits[rank].get('code')}"
            self._log(f"worker rank {rank} on host {ranks[rank]} failed ({how})")
        if finished:
            if failed:
                raise JobFailed(f"{FAILED_MESSAGE}: training ended on ranks {finished}, "
                                f"but ranks {failed} failed")
            self._log(f"generation {self._generation}: the job is done")
            return 0
        if not started:
            raise JobFailed(f"mpirun (exit status {code}) started no worker of generation "
                            f"{self._generation}; its messages are above")
        bad = {ranks[r] for r in failed}
        if not bad and unknown and code != 0:
            # No rank said how it ended: their node (or its mpirun daemon) is gone.
            bad = {ranks[r] for r in unknown}
            self._lost |= bad
            self._log(f"ranks {unknown} ({', '.join(sorted(bad))}) ended without a word "
                      f"(mpirun exit status {code}): taken as lost")
        if not bad and len(exits) < size:
            raise JobFailed(f"mpirun ended with exit status {code} and ranks {unknown} did "
                            "not say how they ended")
        for host in bad:
            self._blacklist.add(host)
        if bad and not self._free_slots(self._discover(), []):
            raise JobFailed(f"{FAILED_MESSAGE}, and no host is left to go on with")
        return None

    def _remove_commits(self) -> None:
        """Removes the job's commit boxes from the nodes it ran on (those not lost):
        one rank on each, through mpirun."""
        hosts = [h for h in self._used if h not in self._lost]
        if not hosts:
            return
        argv = [str(self._mpirun_path), *(["--allow-run-as-root"] if os.geteuid() == 0 else []),
                "-np", str(len(hosts)), "-H", ",".join(f"{h}:1" for h in hosts),
                *self.options.mpi_args, sys.executable, "-m",
                "tf_smb.elastic.commit_box", "--remove", self._job]
        try:
            done = subprocess.run(argv, capture_output=True, text=True,
                                  timeout=REMOVE_TIMEOUT_S, env=self._env()[0])
            failed = done.returncode != 0 and (done.stderr or done.stdout)[-2000:]
        except (OSError, subprocess.TimeoutExpired) as e:
            failed = str(e)
        if failed:
            self._log(f"could not remove the job's commits ({commit_box.SHM_DIR}/"
                      f"{commit_box.PREFIX}-*-{self._job}) on every node of "
                      f"{', '.join(hosts)}: {failed}")

    def _stop_mpirun(self) -> None:
        proc = self._mpirun
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()  # mpirun stops every rank
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _read(stream, which: str, lines: "queue.Queue[Optional[Tuple[str, str]]]") -> None:
    for raw in iter(stream.readline, b""):
        lines.put((which, raw.decode("utf-8", "replace").rstrip("\n")))
    lines.put(None)
