"""A worker's side of an elastic job (tf_smb/elastic/protocol.py): which
generation it is in, joining the next one in this same process, and hearing of
host updates as they come.

    worker = ElasticWorker.from_env()        # None outside an elastic job
    job = worker.rejoin(timeout_s=600)       # after the members changed (one node)
    worker.end_generation()                  # after the members changed (across nodes)

Across nodes (`worker.across_nodes`) a generation is one `mpirun` and a worker
does not move to the next one: it ends (`end_generation`), and the launcher
starts the next generation's processes, which resume from the nodes' commit
boxes (`worker.commit_box`, tf_smb/elastic/commit_box.py).
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import Callable, Dict, Mapping, Optional

from tf_smb import env as env_lib
from tf_smb.elastic import protocol
from tf_smb.elastic.commit_box import CommitBox

POLL_S = 0.05   # how often a waiting worker reads generation.json
FOLLOW_S = 0.1  # how often hosts.json is read for updates


class WorkerRemoved(Exception):
    """The launcher left this worker out of the next generation (its host was
    removed or blacklisted): it has nothing more to do."""


class ElasticWorker:
    """This process in an elastic job: its worker id and current generation."""

    def __init__(self, directory: str, worker_id: int, generation: int,
                 across_nodes: str = "", local_rank: int = 0) -> None:
        self.directory = directory
        self.worker_id = worker_id
        self.generation = generation
        # Across nodes: the elastic job's id (its commit boxes' name); "" on one node.
        self.across_nodes = across_nodes
        # Across nodes, each node's first rank keeps the node's commit box.
        self.keeps_node_commit = bool(across_nodes) and local_rank == 0
        self.commit_box = CommitBox.for_job(across_nodes) if across_nodes else None
        self._writer: Optional[threading.Thread] = None  # the node commit being written
        self._write_error: Optional[BaseException] = None
        self._flush_at_exit = False
        self._followers: Dict[int, Callable[[protocol.HostUpdate], None]] = {}
        self._follower_thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        # Host updates until now made the generation this worker starts in.
        update = self.latest_host_update()
        self._seen_serial = update.serial if update is not None else 0

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> Optional["ElasticWorker"]:
        """The worker the launcher's variables describe, or None outside an elastic job."""
        env = os.environ if env is None else env
        directory = env.get(protocol.DIR_VAR)
        if not directory:
            return None
        try:
            return cls(directory, int(env[protocol.WORKER_ID_VAR]),
                       int(env.get(protocol.GENERATION_VAR, "0")),
                       across_nodes=env.get(protocol.ACROSS_NODES_VAR, ""),
                       local_rank=int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")))
        except (KeyError, ValueError) as e:
            raise ValueError(f"{protocol.DIR_VAR} is set, but {protocol.WORKER_ID_VAR} and "
                             f"{protocol.GENERATION_VAR} are not integers: {e}") from e

    def next_generation(self, timeout_s: float) -> protocol.Generation:
        """Waits for a generation after this worker's.

        Raises:
          WorkerRemoved: the next generation does not include this worker.
          TimeoutError: none came within `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            generation = protocol.read_generation(self.directory)
            if generation is not None and generation.number > self.generation:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"worker {self.worker_id}: the launcher published no generation after "
                    f"{self.generation} within {timeout_s:g} s")
            time.sleep(POLL_S)
        self._rank_in(generation)
        return generation

    def _rank_in(self, generation: protocol.Generation) -> int:
        rank = generation.rank_of(self.worker_id)
        if rank is None:
            raise WorkerRemoved(f"worker {self.worker_id} is not in generation "
                                f"{generation.number}")
        return rank

    def job_in(self, generation: protocol.Generation) -> env_lib.JobInfo:
        """This worker's place in `generation` (whose box the launcher made).

        Raises:
          WorkerRemoved: `generation` does not include this worker.
        """
        return env_lib.JobInfo(rank=self._rank_in(generation), size=len(generation.members),
                               job_id=generation.job_id, box_created=True,
                               launcher="tf_smb")

    def rejoin(self, timeout_s: float) -> env_lib.JobInfo:
        """Joins the next generation in this process (`next_generation`, then
        `tf_smb.ops.rejoin`) and returns the job joined."""
        from tf_smb import ops  # pylint: disable=import-outside-toplevel
        generation = self.next_generation(timeout_s)
        job = self.job_in(generation)
        ops.rejoin(job)
        self.generation = generation.number
        self.mark_joined()
        return job

    def generation_moved_on(self) -> bool:
        """Whether the launcher published a generation after this worker's:
        how an asynchronous worker learns of a change of the members (it runs
        no collective that a lost member would fail)."""
        generation = protocol.read_generation(self.directory)
        return generation is not None and generation.number > self.generation

    def resumes(self) -> bool:
        """Whether this process starts a later generation across nodes: it
        resumes from the newest commit its nodes' boxes hold."""
        return bool(self.across_nodes) and self.generation > 0

    def node_commit(self) -> Optional[Dict]:
        """This node's commit (a record of commit_box), or None."""
        return None if self.commit_box is None else self.commit_box.read()

    def keep_on_node(self, record: Dict) -> None:
        """Across nodes, on each node's first rank: makes `record` (whose values
        nothing changes afterwards) the node's commit, written by a thread while
        training goes on (one write at a time: a commit waits for the one before).

        Raises:
          RuntimeError: the commit before could not be written (e.g. /dev/shm full).
        """
        if not self.keeps_node_commit or self.commit_box is None:
            return
        if not self._flush_at_exit:
            self._flush_at_exit = True
            atexit.register(self.flush_node_commit)  # a normal exit writes the last one
        self.flush_node_commit()
        self._writer = threading.Thread(target=self._write_node_commit, args=(record,),
                                        name="tf_smb-commit-box", daemon=True)
        self._writer.start()

    def _write_node_commit(self, record: Dict) -> None:
        try:
            self.commit_box.write(record)
        except BaseException as e:  # pylint: disable=broad-except  (raised by flush)
            self._write_error = e

    def flush_node_commit(self) -> None:
        """Waits until the node's last commit is written.

        Raises:
          RuntimeError: it could not be written.
        """
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.join()
        error, self._write_error = self._write_error, None
        if error is not None:
            raise RuntimeError(f"tf_smb: could not keep the commit in this node's commit box "
                               f"{self.commit_box.path}: {error}") from error

    def end_generation(self) -> None:
        """Across nodes: ends this process, its generation over (the launcher
        starts the next one's processes). Exits at once (os._exit): MPI may not
        finalize once a peer died, and the commit is in the node's box."""
        try:
            self.flush_node_commit()
        except RuntimeError as e:  # the next generation resumes from the commit before
            sys.stderr.write(f"{e}\n")
        sys.stdout.flush()
        sys.stderr.write(f"tf_smb: worker {self.worker_id}: generation {self.generation} ends "
                         "for a change of the members; the next one resumes from the last "
                         "commit\n")  # one write: mpirun would tag a line in two pieces
        sys.stderr.flush()
        os._exit(protocol.NEXT_GENERATION_EXIT)  # pylint: disable=protected-access

    def mark_joined(self) -> None:
        """Tells the launcher this worker is in its current generation."""
        protocol.mark_joined(self.directory, self.generation, self.worker_id)

    def latest_host_update(self) -> Optional[protocol.HostUpdate]:
        """The launcher's latest host update (None: the hosts never changed)."""
        return protocol.read_host_update(self.directory)

    def follow_host_updates(self, key: int,
                            callback: Callable[[protocol.HostUpdate], None]) -> None:
        """Calls `callback` (on a thread of its own) with each host update after
        those that made this worker's first generation; one callback per `key`."""
        with self._lock:
            self._followers[key] = callback
            if self._follower_thread is None:
                self._follower_thread = threading.Thread(
                    target=self._follow, name="tf_smb-elastic-hosts", daemon=True)
                self._follower_thread.start()

    def _follow(self) -> None:
        seen = self._seen_serial
        while True:
            update = self.latest_host_update()
            if update is not None and update.serial > seen:
                seen = update.serial
                with self._lock:
                    listeners = list(self._followers.values())
                for callback in listeners:
                    callback(update)
            time.sleep(FOLLOW_S)
