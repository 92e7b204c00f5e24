"""What an elastic launcher and its workers tell each other: JSON files in a
directory private to the user (0700, files 0600), written whole (a temporary
file renamed over the old one), so a reader sees the old or the new one.

  generation.json  the current generation: its number, job id (its box) and
                   members (worker ids, in rank order);
  hosts.json       the latest host update: a serial number and whether hosts
                   were added and/or removed;
  joined-G-W       (empty) worker W joined generation G.

Across nodes (each generation one `mpirun`; docs/elastic.md) the launcher and a
rank's wrapper (tf_smb/elastic/rank.py) talk through what Open MPI carries
anyway: the wrapper writes event lines (`rank_event`) on its standard output,
which mpirun forwards to the launcher, and the launcher signals mpirun, which
forwards SIGUSR1 (hosts added) and SIGUSR2 (hosts removed) to every rank; the
wrapper keeps the files above for its worker in a directory of its own.

Imports nothing of tf_smb or TensorFlow (the launcher reads and writes these too).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
from typing import Any, Dict, List, Optional, Set, Tuple

DIR_VAR = "TF_SMB_ELASTIC_DIR"          # the directory, given to every worker
WORKER_ID_VAR = "TF_SMB_WORKER_ID"      # this worker's id (fixed for its life)
GENERATION_VAR = "TF_SMB_ELASTIC_GENERATION"  # the generation a worker starts in
# Across nodes: the elastic job's id (its nodes' commit boxes are named after it).
ACROSS_NODES_VAR = "TF_SMB_ELASTIC_ACROSS_NODES"
# A worker across nodes exits with this when its generation ends for a change of
# the members (the launcher starts the next one); its wrapper then exits with 0.
NEXT_GENERATION_EXIT = 75
RANK_EVENT_MARK = "@@tf_smb-elastic"

GENERATION_FILE = "generation.json"
HOSTS_FILE = "hosts.json"


@dataclasses.dataclass(frozen=True)
class Generation:
    """One membership of the job: a tf_smb job of its own (its box: `job_id`)."""

    number: int
    job_id: str
    members: List[int]  # worker ids, rank order

    def rank_of(self, worker_id: int) -> Optional[int]:
        """`worker_id`'s rank in this generation, or None when it is not a member."""
        return self.members.index(worker_id) if worker_id in self.members else None


@dataclasses.dataclass(frozen=True)
class HostUpdate:
    """The latest change of the hosts: serial numbers grow by one per change."""

    serial: int
    added: bool
    removed: bool


def make_private_dir(path: str) -> str:
    """Creates `path` (0700) and returns it."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def _write(directory: str, name: str, value: Dict[str, Any]) -> None:
    path = os.path.join(directory, name)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def _read(directory: str, name: str) -> Optional[Dict[str, Any]]:
    try:
        with open(os.path.join(directory, name)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def write_generation(directory: str, generation: Generation) -> None:
    """Publishes `generation` (the launcher)."""
    _write(directory, GENERATION_FILE, dataclasses.asdict(generation))


def read_generation(directory: str) -> Optional[Generation]:
    """The published generation, or None before the first."""
    value = _read(directory, GENERATION_FILE)
    return None if value is None else Generation(int(value["number"]), str(value["job_id"]),
                                                 [int(m) for m in value["members"]])


def mark_joined(directory: str, generation: int, worker_id: int) -> None:
    """Records that `worker_id` joined `generation` (the worker)."""
    fd = os.open(os.path.join(directory, f"joined-{generation}-{worker_id}"),
                 os.O_WRONLY | os.O_CREAT, 0o600)
    os.close(fd)


def joined(directory: str, generation: int) -> Set[int]:
    """The workers that joined `generation` so far."""
    prefix = f"joined-{generation}-"
    return {int(name[len(prefix):]) for name in os.listdir(directory)
            if name.startswith(prefix) and name[len(prefix):].isdigit()}


def write_host_update(directory: str, update: HostUpdate) -> None:
    """Publishes a host update (the launcher)."""
    _write(directory, HOSTS_FILE, dataclasses.asdict(update))


def read_host_update(directory: str) -> Optional[HostUpdate]:
    """The latest host update, or None when the hosts never changed."""
    value = _read(directory, HOSTS_FILE)
    return None if value is None else HostUpdate(int(value["serial"]), bool(value["added"]),
                                                 bool(value["removed"]))


def rank_event(event: str, rank: int, **fields: Any) -> str:
    """One line telling the launcher about `rank` (a wrapper writes it)."""
    words = [RANK_EVENT_MARK, event, f"rank={rank}"] + [f"{k}={v}" for k, v in fields.items()]
    return " ".join(shlex.quote(str(w)) for w in words)


def parse_rank_event(line: str) -> Optional[Tuple[str, int, Dict[str, str]]]:
    """(event, rank, fields) of a `rank_event` line (anywhere in `line`: mpirun
    may tag it), or None for any other line."""
    at = line.find(RANK_EVENT_MARK + " ")
    if at < 0:
        return None
    try:
        words = shlex.split(line[at:])
        fields = dict(w.split("=", 1) for w in words[2:])
        return words[1], int(fields.pop("rank")), fields
    except (ValueError, IndexError, KeyError):
        return None
