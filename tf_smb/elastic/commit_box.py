"""A node's commit box: the last commit of an elastic job across nodes, in the
node's shared memory (/dev/shm), where it outlives the processes that wrote it.

Across nodes each generation of an elastic job is a new `mpirun` (Open MPI's
world is fixed at launch), so its processes are new ones: they resume from
what a node's commit box holds, not from disk (docs/elastic.md, "Across nodes").

    box = CommitBox.for_job(job)           # this node's, for elastic job `job`
    box.write({"serial": 7, "values": [...]})   # local rank 0, at each commit
    record = box.read()                    # None: this node holds no commit

A record is a dict whose "serial" (an int) grows with each commit; the newest
commit among a generation's nodes is the one with the largest serial
(`newest`). Writes are whole (a private temporary file renamed over the old
one): a process killed while writing leaves the commit before. The file is
private to the user (0600) and is read only when this user owns it.

The launcher removes every node's commit box when the job ends, through
`python -m tf_smb.elastic.commit_box --remove JOB` run on each node by mpirun.

Imports nothing of TensorFlow.
"""
from __future__ import annotations

import argparse
import os
import pickle
import re
import stat
import sys
from typing import Any, Dict, List, Optional, Sequence

SHM_DIR = "/dev/shm"
PREFIX = "tf_smb_commit"  # not the boxes' prefix: the box reaper must not take it


class CommitBox:
    """One node's commit of one elastic job (see the module)."""

    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def for_job(cls, job: str, directory: str = SHM_DIR) -> "CommitBox":
        """This node's commit box of elastic job `job` (letters, digits, '-', '_', '.')."""
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", job or ""):
            raise ValueError(f"an elastic job id may hold only letters, digits, '-', '_' and "
                             f"'.', got {job!r}")
        return cls(os.path.join(directory, f"{PREFIX}-{os.getuid()}-{job}"))

    def write(self, record: Dict[str, Any]) -> None:
        """Makes `record` (picklable, with an int "serial") this node's commit."""
        if not isinstance(record.get("serial"), int):
            raise ValueError(f"a commit record needs an int 'serial', got {record.get('serial')!r}")
        tmp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump(record, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    def read(self) -> Optional[Dict[str, Any]]:
        """This node's commit, or None when it holds none.

        Raises:
          PermissionError: the file is not this user's private file (0600).
        """
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
                raise PermissionError(
                    f"{self.path} is not this user's private file (owner {info.st_uid}, "
                    f"mode {stat.S_IMODE(info.st_mode):o}); not reading it")
            return pickle.load(f)

    def serial(self) -> int:
        """The serial of this node's commit (0: none)."""
        record = self.read()
        return 0 if record is None else int(record["serial"])

    def unlink(self) -> None:
        """Removes this node's commit (the job is done), and what a process killed
        while writing one left."""
        directory, name = os.path.split(self.path)
        for entry in os.listdir(directory):
            if entry == name or (entry.startswith(name + ".") and entry.endswith(".tmp")):
                try:
                    os.unlink(os.path.join(directory, entry))
                except FileNotFoundError:
                    pass


def newest(serials: Sequence[int]) -> int:
    """The rank holding the newest commit (the lowest such rank), given each
    rank's serial (0: none); 0 when no rank holds one."""
    best = max(serials) if serials else 0
    return list(serials).index(best) if best > 0 else 0


def main(argv: Optional[List[str]] = None) -> int:
    """`--remove JOB`: removes this node's commit box of elastic job JOB."""
    parser = argparse.ArgumentParser(prog="python -m tf_smb.elastic.commit_box")
    parser.add_argument("--remove", required=True, metavar="JOB")
    CommitBox.for_job(parser.parse_args(argv).remove).unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
