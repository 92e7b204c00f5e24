"""Stops one thread of another process, the rest of it running on: how a thread
stuck in a call that never returns (an MPI call, say) looks from outside.

ptrace(PTRACE_SEIZE, PTRACE_INTERRUPT) stops the one thread (a signal would
stop the whole process). It is stopped only while it sleeps in a futex (a
condition variable's wait, which holds no lock), so the threads running on are
not blocked by a lock the frozen one holds. Linux x86-64; needs ptrace rights
over the process (root, or CAP_SYS_PTRACE). Every ptrace call comes from the
thread that made the object.
"""
from __future__ import annotations

import ctypes
import errno
import os
import time

PTRACE_CONT, PTRACE_DETACH = 7, 17
PTRACE_SEIZE, PTRACE_INTERRUPT = 0x4206, 0x4207
WALL = 0x40000000  # __WALL: wait for threads too
SYS_FUTEX = 202    # x86-64

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_libc.ptrace.restype = ctypes.c_long


def _ptrace(request: int, tid: int) -> None:
    if _libc.ptrace(request, tid, None, None) == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"ptrace({request:#x}, {tid}): {os.strerror(err)}")


def thread_named(pid: int, name: str) -> int:
    """The id of process `pid`'s thread called `name` (its comm)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            if f.read().strip() == name:
                return int(tid)
    raise LookupError(f"process {pid} has no thread named {name!r}")


class FrozenThread:
    """Process `pid`'s thread `name`, stopped until release() or its exit."""

    def __init__(self, pid: int, name: str, timeout: float = 10.0):
        self.pid, self.tid = pid, thread_named(pid, name)
        self.alive = True
        _ptrace(PTRACE_SEIZE, self.tid)
        deadline = time.monotonic() + timeout
        seen = set()  # the system calls it was found in instead
        while True:
            _ptrace(PTRACE_INTERRUPT, self.tid)
            os.waitpid(self.tid, WALL)
            syscall = self._syscall()
            if syscall == str(SYS_FUTEX):
                return
            seen.add(syscall)
            if time.monotonic() > deadline:
                self.release()
                raise TimeoutError(f"thread {self.tid} of {pid} ({name}) never slept in a "
                                   f"futex within {timeout} s (found in system calls "
                                   f"{sorted(seen)})")
            _ptrace(PTRACE_CONT, self.tid)
            time.sleep(0.003)

    def _syscall(self) -> str:
        """The number of the system call the stopped thread is in ("running": none)."""
        with open(f"/proc/{self.pid}/task/{self.tid}/syscall") as f:
            return f.read().split()[0]

    def reap(self) -> None:
        """Collects the thread once its process has exited (a traced thread
        is reported to its tracer, which must collect it before the process is
        gone for its parent too). Call while waiting for the process to end."""
        if not self.alive:
            return
        try:
            tid, _ = os.waitpid(self.tid, os.WNOHANG | WALL)
        except ChildProcessError:
            tid = self.tid
        if tid == self.tid:
            self.alive = False

    def release(self) -> None:
        """Lets the thread run on (if it still exists)."""
        if not self.alive:
            return
        self.alive = False
        try:
            _ptrace(PTRACE_DETACH, self.tid)
        except OSError as e:
            if e.errno != errno.ESRCH:
                raise
