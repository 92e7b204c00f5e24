"""The elastic launcher's side (`python -m tf_smb.run --min-np ... COMMAND`): it
keeps a job running while its workers come and go (docs/elastic.md).

  * hosts and slots come from `--host-discovery-script` (prints `host:slots`
    lines; run every DISCOVER_S) or a fixed `-H host:slots,...`; host names that
    are this machine start local workers, each name a host of its own;
  * a worker that fails (non-zero exit or a signal) blacklists its host (for a
    cooldown drawn from `--blacklist-cooldown-range`, doubling with each failure;
    for good without one); its host's other workers leave the job;
  * each change of the members is a new generation: a tf_smb job of its own whose
    box this launcher makes; the workers that stay join it in their processes
    (tf_smb.elastic.worker), new ones start in it; hosts added or removed are
    announced first (hosts.json) so that the workers change at a commit;
  * the job ends when every member of the last generation ended well (0), or with
    an error: fewer than `--min-np` slots for `--elastic-timeout` seconds, more
    resets than `--reset-limit`, every worker failed.

Imports no TensorFlow (only the box's C++ module, to make the boxes).
"""
from __future__ import annotations

import dataclasses
import os
import random
import shutil
import platform
import signal
import subprocess
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from tf_smb import supervisor
from tf_smb.elastic import protocol

DISCOVER_S = 1.0          # how often the discovery script runs
DISCOVERY_TIMEOUT_S = 30  # how long one run of it may take
POLL_S = 0.05             # how often the workers are checked
REMOVED_GRACE_S = 30.0    # how long a worker left out of the job may take to end
FAILED_MESSAGE = "one or more processes exited with non-zero status"


@dataclasses.dataclass
class Options:
    """The elastic launcher's options (tf_smb/run.py parses them)."""

    command: Sequence[str]
    np: int
    min_np: int
    max_np: int  # the job grows into every free slot up to this
    discovery_script: Optional[str] = None
    hosts: Optional[str] = None
    reset_limit: Optional[int] = None
    cooldown_range: Optional[Tuple[float, float]] = None
    elastic_timeout: float = 600.0
    timeout_s: Optional[float] = None
    staging_bytes: int = 0
    heap_bytes: int = 0
    bind: bool = True  # each worker on its own block of CPUs (tf_smb.run --bind-to core)
    across_nodes: bool = False  # each generation one mpirun (else: when a host is another machine)
    mpi_args: Sequence[str] = ()  # extra mpirun arguments, across nodes


def parse_hosts(lines: Sequence[str]) -> Dict[str, int]:
    """`host:slots` lines (or `host`, one slot; or one comma-separated line), in order.

    Raises:
      ValueError: a line is not `host[:slots]` with slots >= 1.
    """
    hosts: Dict[str, int] = {}
    for line in lines:
        for entry in line.split(","):
            entry = entry.strip()
            if not entry:
                continue
            host, _, slots = entry.partition(":")
            try:
                count = int(slots) if slots else 1
            except ValueError:
                count = 0
            if not host or count < 1:
                raise ValueError(f"expected host:slots (slots >= 1), got {entry!r}")
            hosts[host] = hosts.get(host, 0) + count
    return hosts


def is_this_machine(host: str) -> bool:
    """Whether `host` names this machine (its workers start here)."""
    return host in {"localhost", "127.0.0.1", "::1", platform.node(),
                    platform.node().split(".")[0]}


@dataclasses.dataclass
class _Worker:
    id: int
    host: str
    slot: int
    start_rank: int
    processes: supervisor.Workers
    cpu_block: Optional[int] = None  # which of the launcher's blocks of CPUs it runs on
    removed: bool = False       # left out of the job by the launcher
    removed_at: float = 0.0

    @property
    def returncode(self) -> Optional[int]:
        return self.processes.returncode(0)


class Blacklist:
    """Hosts where a worker failed: for good, or for a cooldown that doubles
    with each failure of the host, within `cooldown_range` (seconds)."""

    def __init__(self, cooldown_range: Optional[Tuple[float, float]] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._range = cooldown_range
        self._clock = clock
        self._failures: Dict[str, int] = {}
        self._until: Dict[str, float] = {}

    def add(self, host: str) -> None:
        failures = self._failures[host] = self._failures.get(host, 0) + 1
        if self._range is None:
            self._until[host] = float("inf")
            return
        low, high = self._range
        delay = min(high, low * 2 ** (failures - 1)) * random.uniform(1.0, 1.25)
        self._until[host] = self._clock() + min(delay, high)

    def allows(self, host: str) -> bool:
        return self._clock() >= self._until.get(host, 0.0)


class JobFailed(Exception):
    """The job cannot go on (the message says why)."""


def assignment_order(previous: Sequence[str], available: Sequence[str]) -> List[str]:
    """The hosts of a new generation in rank order: those of the last one still
    available, in their order, then the others in discovery order. The oldest
    hosts keep the lowest ranks (as in Horovod), so rank 0, whose state a new
    generation starts from, is on a host that has trained, not one just added
    (or back from its cooldown) that a discovery script happens to list first."""
    now = set(available)
    kept = [h for h in previous if h in now]
    return kept + [h for h in available if h not in set(kept)]


class _MemberFailed(Exception):
    """A member the driver counted on failed while it waited for slots."""


class Driver:
    """Runs one elastic job (see the module); `run` returns its exit status."""

    def __init__(self, options: Options, log: Callable[[str], None],
                 interrupted: Callable[[], Optional[int]]) -> None:
        self.options = options
        self._log = log
        self._interrupted = interrupted
        self._blacklist = Blacklist(options.cooldown_range)
        self._dir = protocol.make_private_dir(tempfile.mkdtemp(prefix="tf_smb-elastic-"))
        self._job = f"elastic-{os.getpid()}-{random.getrandbits(32):08x}"
        self._started: List[_Worker] = []
        self._members: List[_Worker] = []
        self._generation = -1
        self._resets = 0
        self._host_serial = 0
        self._boxes: List[object] = []
        self._hosts: Dict[str, int] = {}
        self._host_order: List[str] = []  # the last generation's hosts, in rank order
        self._slots_seen: Set[Tuple[str, int]] = set()  # discovered by the last generation
        self._discovered_at = 0.0
        self._ids_taken = 0
        self._all_joined = False  # every member joined this generation (read till then)
        # Blocks of CPUs for --max-np workers, as tf_smb.run binds a fixed job's (none
        # when they may be more than the CPUs).
        self._cpu_blocks = (supervisor.split_cpus(options.max_np) if options.bind and (
            options.max_np <= len(os.sched_getaffinity(0))) else [])

    # -- hosts ----------------------------------------------------------------
    def _read_hosts(self) -> Dict[str, int]:
        """The hosts the discovery script prints now (or -H).

        Raises:
          OSError, subprocess.SubprocessError, ValueError: the script failed.
        """
        if self.options.discovery_script:
            out = subprocess.run([self.options.discovery_script], capture_output=True,
                                 text=True, timeout=DISCOVERY_TIMEOUT_S, check=True).stdout
            return parse_hosts(out.splitlines())
        return parse_hosts([self.options.hosts or f"localhost:{self.options.np}"])

    def hosts_now(self) -> List[str]:
        """The host names discovery gives now (blacklist or not); [] when it fails."""
        try:
            return list(self._read_hosts())
        except (OSError, subprocess.SubprocessError, ValueError):
            return []

    def _discover(self) -> Dict[str, int]:
        """The hosts now available: discovered (or given), not blacklisted."""
        if self.options.discovery_script:
            try:
                self._hosts = self._read_hosts()
            except (OSError, subprocess.SubprocessError, ValueError) as e:
                self._log(f"host discovery failed ({e}); keeping the hosts found before")
        elif not self._hosts:
            self._hosts = self._read_hosts()
        self._check_hosts(self._hosts)
        self._discovered_at = time.monotonic()
        return {h: n for h, n in self._hosts.items() if self._blacklist.allows(h)}

    def _check_hosts(self, hosts: Dict[str, int]) -> None:
        for host in hosts:
            if not is_this_machine(host):
                raise JobFailed(
                    f"host {host!r} is not this machine, and this job started on this "
                    "machine alone, where its workers move from one generation to the next "
                    "in their processes: for a job across nodes, list another machine from "
                    "the start or pass --across-nodes (docs/elastic.md)")

    def _free_slots(self, hosts: Dict[str, int],
                    staying: Sequence[_Worker]) -> List[Tuple[str, int]]:
        taken = {(w.host, w.slot) for w in staying}
        return [(h, s) for h, n in hosts.items() for s in range(n) if (h, s) not in taken]

    # -- generations --------------------------------------------------------------
    def _publish(self, staying: List[_Worker], hosts: Dict[str, int]) -> None:
        """Makes the next generation: `staying` and new workers on free slots
        (up to --max-np), in host order; starts the new ones."""
        free = self._free_slots(hosts, staying)
        room = max(0, self.options.max_np - len(staying))  # every free slot, as Horovod
        self._host_order = assignment_order(self._host_order, list(hosts))
        order = {h: i for i, h in enumerate(self._host_order)}
        free.sort(key=lambda p: (order[p[0]], p[1]))
        placed = [(w.host, w.slot, w) for w in staying] + [(h, s, None) for h, s in free[:room]]
        # Staying workers first on their host: rank 0 is one of them whenever any stays.
        placed.sort(key=lambda p: (order.get(p[0], len(order)), p[2] is None, p[1]))
        self._next_generation()
        job_id = f"{self._job}-g{self._generation}"
        self._slots_seen = {(h, i) for h, n in self._hosts.items() for i in range(n)}
        ids = [w.id if w is not None else self._take_id() for _, _, w in placed]
        if len(ids) > 1:
            from tf_smb import _box  # pylint: disable=import-outside-toplevel
            self._boxes.append(_box.create_box(job_id, len(ids),
                                               staging_bytes=self.options.staging_bytes,
                                               heap_bytes=self.options.heap_bytes))
        protocol.write_generation(self._dir, protocol.Generation(self._generation, job_id, ids))
        members = []
        for rank, ((host, slot, worker), wid) in enumerate(zip(placed, ids)):
            if worker is None:
                worker = self._start_worker(wid, host, slot, rank, len(ids), job_id)
            members.append(worker)
        self._members = members
        self._all_joined = False
        self._log(f"generation {self._generation}: {len(members)} workers "
                  f"({', '.join(f'{w.id}@{w.host}' for w in members)})")

    def _next_generation(self) -> None:
        """Counts a new generation (a reset after the first), within --reset-limit."""
        self._generation += 1
        if self._generation > 0:
            self._resets += 1
            limit = self.options.reset_limit
            if limit is not None and self._resets > limit:
                raise JobFailed(f"Job has been reset {self._resets} times, exceeding the "
                                f"reset limit ({limit}).")

    def _take_id(self) -> int:
        self._ids_taken += 1
        return self._ids_taken - 1

    def _start_worker(self, wid: int, host: str, slot: int, rank: int, size: int,
               job_id: str) -> _Worker:
        env = supervisor.worker_env(
            rank=rank, size=size, job_id=job_id, box_created=size > 1,
            timeout_s=self.options.timeout_s,
            overrides={protocol.DIR_VAR: self._dir, protocol.WORKER_ID_VAR: str(wid),
                       protocol.GENERATION_VAR: str(self._generation),
                       "HOROVOD_HOSTNAME": host, "HOROVOD_RANK": str(rank)})
        taken = {w.cpu_block for w in self._started if w.returncode is None}
        block = next((i for i, cpus in enumerate(self._cpu_blocks)
                      if cpus is not None and i not in taken), None)
        processes = supervisor.Workers([(list(self.options.command), env)], output="prefix",
                                       names=[f"worker {wid} ({host})"], labels=[str(wid)],
                                       log=self._log,
                                       cpus=None if block is None else [self._cpu_blocks[block]])
        worker = _Worker(wid, host, slot, rank, processes, cpu_block=block)
        self._started.append(worker)
        return worker

    def _wait_for_slots(self, staying: List[_Worker]) -> Dict[str, int]:
        """The hosts once --min-np slots are there (with `staying` counted).

        Raises:
          _MemberFailed: one of `staying` failed meanwhile.
        """
        deadline = time.monotonic() + self.options.elastic_timeout
        while True:
            if any(w.returncode not in (None, 0) for w in staying):
                raise _MemberFailed()
            hosts = self._discover()
            slots = len(staying) + len(self._free_slots(hosts, staying))
            if slots >= self.options.min_np:
                return hosts
            if time.monotonic() > deadline:
                raise JobFailed(f"timed out after {self.options.elastic_timeout:g} s waiting "
                                f"for --min-np {self.options.min_np} slots (found {slots})")
            self._check_interrupted()
            time.sleep(DISCOVER_S)

    def _check_interrupted(self) -> None:
        signum = self._interrupted()
        if signum:
            raise KeyboardInterrupt(signum)

    # -- the loop -----------------------------------------------------------------
    def run(self) -> int:
        try:
            self._publish([], self._wait_for_slots([]))
            while True:
                self._check_interrupted()
                if self._look():
                    return 0
                time.sleep(POLL_S)
        except JobFailed as e:
            self._log(f"the job failed: {e}")
            return 1
        except KeyboardInterrupt as e:
            signum = e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT
            self._log(f"received {signal.Signals(signum).name}, stopping workers")
            return 128 + signum
        finally:
            self._stop_all()

    def _look(self) -> bool:
        """One look at the workers and hosts; True when the job is done."""
        failed = [w for w in self._members if w.returncode not in (None, 0)]
        for worker in self._started:  # the removed ones past their grace
            if worker.removed and worker.returncode is None and (
                    time.monotonic() - worker.removed_at > REMOVED_GRACE_S):
                worker.processes.stop()
        if failed:
            self._go_on_without(failed)
            return False
        if all(w.returncode == 0 for w in self._members):
            return all(w.returncode is not None for w in self._started) or self._ended_removed()
        earlier: List[_Worker] = []
        if not self._all_joined:
            joined = protocol.joined(self._dir, self._generation)
            earlier = [w for w in self._members if w.id not in joined]
            self._all_joined = not earlier
        if any(w.returncode == 0 for w in earlier):
            # The job ended before this generation formed (its last commit came
            # first): once the rest of the earlier generation ended, so has the job.
            return all(w.returncode == 0 for w in earlier) and self._ended_removed()
        if time.monotonic() - self._discovered_at >= DISCOVER_S:
            hosts = self._discover()
            # One change at a time: the next once every member joined this generation.
            if not earlier:
                self._hosts_changed(hosts)
        return False

    def _go_on_without(self, failed: List[_Worker]) -> None:
        """Blacklists the hosts of the `failed` members and makes the next
        generation of the members on other hosts once --min-np slots are there;
        members that fail meanwhile go the same way (all of them failing ends the
        job now, not after --elastic-timeout)."""
        told: Set[int] = set()
        bad: Set[str] = set()
        while True:
            for worker in [w for w in failed if w.id not in told]:
                told.add(worker.id)
                self._log(worker.processes.report(0, "tf_smb.run: "))
                if worker.host not in bad:  # once per host and change (its cooldown doubles)
                    bad.add(worker.host)
                    self._blacklist.add(worker.host)
            staying = [w for w in self._members
                       if w not in failed and w.host not in bad and w.returncode is None]
            for worker in self._members:
                if worker not in staying and worker not in failed:
                    self._remove(worker)
            if not staying and not self._free_slots(self._discover(), []):
                raise JobFailed(f"{FAILED_MESSAGE}, and no host is left to go on with")
            try:
                hosts = self._wait_for_slots(staying)
            except _MemberFailed:
                failed = [w for w in self._members if w.returncode not in (None, 0)]
                continue
            self._publish(staying, hosts)
            return

    def _ended_removed(self) -> bool:
        """Stops the removed workers still running once the job is done: True."""
        for worker in self._started:
            if worker.returncode is None:
                worker.processes.stop()
        return True

    def _hosts_changed(self, hosts: Dict[str, int]) -> None:
        """Announces hosts added (free slots discovered since the last generation,
        below --max-np) or removed (members' hosts gone), then makes the next
        generation. A host back from its cooldown is used at the next change
        but starts none itself (as in Horovod)."""
        live = [w for w in self._members if w.returncode is None]
        removed = [w for w in live if w.host not in hosts]
        staying = [w for w in live if w.host in hosts]
        added = (len(staying) < self.options.max_np and any(
            slot not in self._slots_seen for slot in self._free_slots(hosts, staying)))
        if not removed and not added:
            return
        self._host_serial += 1
        protocol.write_host_update(self._dir, protocol.HostUpdate(
            self._host_serial, added=added, removed=bool(removed)))
        for worker in removed:
            self._remove(worker)
        if len(staying) + len(self._free_slots(hosts, staying)) < self.options.min_np:
            try:
                hosts = self._wait_for_slots(staying)
            except _MemberFailed:
                return  # the next look goes on without it
        self._publish(staying, hosts)

    def _remove(self, worker: _Worker) -> None:
        worker.removed = True
        worker.removed_at = time.monotonic()

    def _stop_all(self) -> None:
        for worker in self._started:
            worker.processes.close()
        for box in self._boxes:
            try:
                box.unlink()
                box.close()
            except (OSError, RuntimeError):
                pass
        shutil.rmtree(self._dir, ignore_errors=True)


def run(options: Options, log: Callable[[str], None],
        interrupted: Callable[[], Optional[int]]) -> int:
    """Runs an elastic job; its exit status. Across nodes (--across-nodes, or a
    first host that is another machine) each generation is one mpirun
    (tf_smb/elastic/nodes_driver.py)."""
    across = options.across_nodes
    if not across:
        probe = Driver(options, log, interrupted)
        try:
            across = not all(is_this_machine(h) for h in probe.hosts_now())
        finally:
            shutil.rmtree(probe._dir, ignore_errors=True)  # pylint: disable=protected-access
    if across:
        from tf_smb.elastic.nodes_driver import NodesDriver  # pylint: disable=import-outside-toplevel
        return NodesDriver(options, log, interrupted).run()
    return Driver(options, log, interrupted).run()
