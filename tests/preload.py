"""A fork server for the tests' worker processes: TensorFlow and Keras imported once.

`import tensorflow, keras` costs ~6 s of CPU on these machines, and the suite
starts hundreds of worker processes. The server imports them once; each worker is
then a fork of it, a fresh process with its own pid, environment, working
directory, standard streams and arguments, that runs its script as `__main__`
(`python script.py`, `python -m module` or `python -c code`) and exits the way
that script would. Nothing of tf_smb is loaded before the fork, so each worker
gets its own box, op library state and MPI (which is never initialised in the
server, so no fork happens after MPI_Init).

Workers are started through a small client, `preload_client.py`, that the
harness puts where it would put `python`:

    [sys.executable, "-S", CLIENT, "script.py", args...]

The client hands its own standard streams to the server with the arguments and
environment, relays signals to the forked worker, and exits with its status, so
to the supervisor watching it the client *is* the worker. If the client dies,
the worker sees its "lifeline" pipe close and kills its own process group: no
worker outlives the test that started it. Without a server (or for arguments it
does not handle) the client execs the real interpreter: same result, slower.

Test infrastructure only: tf_smb itself never forks a server, and the socket
is a Unix-domain one in a private (0700) directory.
"""
from __future__ import annotations

import array
import gc
import io
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from typing import Dict, List, Optional, Tuple

SOCKET_VAR = "TF_SMB_TEST_PRELOAD"  # where the client finds the server
# Read while TensorFlow and Keras are imported: the server imports them with these
# values, and a worker that asks for another value gets a fresh interpreter.
# oneDNN is off, as the examples and benchmarks set it before importing TensorFlow
# (with it on, Conv2D fails on a replica's empty batch).
IMPORT_TIME_ENV = {"TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPP_MIN_LOG_LEVEL": "2",
                   "TF_CPP_MAX_VLOG_LEVEL": None, "TF_CPP_VMODULE": None,
                   "KERAS_BACKEND": None, "KERAS_HOME": None, "CUDA_VISIBLE_DEVICES": None}
CLIENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "preload_client.py")
HEADER = struct.Struct("!I")  # the request's length, sent with the client's fds
N_FDS = 4                      # stdin, stdout, stderr, lifeline


# ----------------------------------------------------------------- the server side

def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError("client went away")
        data += chunk
    return data


def _receive_request(conn: socket.socket) -> Tuple[dict, List[int]]:
    fds = array.array("i")
    msg, anc, _, _ = conn.recvmsg(HEADER.size, socket.CMSG_SPACE(N_FDS * fds.itemsize))
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - (len(data) % fds.itemsize)])
    if len(msg) < HEADER.size:
        msg += _recv_exact(conn, HEADER.size - len(msg))
    (length,) = HEADER.unpack(msg)
    return json.loads(_recv_exact(conn, length)), list(fds)


def _serve(path: str) -> dict:
    """Accepts requests until told to stop; in a forked child, returns its request."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    children: Dict[int, socket.socket] = {}  # worker pid -> its client's connection
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("ready", flush=True)
    while True:
        ready, _, _ = select.select([listener], [], [], 0.05)
        while children:  # report the workers that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"exit {status}\n".encode())
                except OSError:
                    pass  # the client died; its worker was killed through the lifeline
                conn.close()
        if not ready:
            continue
        conn, _ = listener.accept()
        try:
            request, fds = _receive_request(conn)
        except (OSError, EOFError, ValueError):
            conn.close()
            continue
        if len(fds) != N_FDS or not compatible(request["env"]):
            for fd in fds:
                os.close(fd)
            conn.sendall(b"fresh\n")  # the client execs a fresh interpreter
            conn.close()
            continue
        pid = os.fork()
        if pid == 0:
            listener.close()
            conn.close()
            for other in children.values():
                other.close()
            request["fds"] = fds
            return request
        for fd in fds:
            os.close(fd)
        conn.sendall(f"pid {pid}\n".encode())
        children[pid] = conn


def _watch_lifeline(fd: int) -> None:
    """Kills this worker's process group once its client is gone."""
    try:
        while os.read(fd, 1):
            pass
    except OSError:
        pass
    os.killpg(0, signal.SIGKILL)


def _become_worker(request: dict, base_path: List[str]) -> List[str]:
    """Turns this fork into the requested worker; returns how to run its main."""
    os.setsid()  # its own process group, as the supervisor starts workers
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    stdin, stdout, stderr, lifeline = request["fds"]
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.set_inheritable(lifeline, False)
    threading.Thread(target=_watch_lifeline, args=(lifeline,), daemon=True,
                     name="preload-lifeline").start()
    if request.get("cpus"):  # as the launcher placed the client (tf_smb.run, mpirun bind)
        os.sched_setaffinity(0, request["cpus"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(open(0, "rb", closefd=False))
    sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0 if unbuffered else -1,
                                       closefd=False),
                                  line_buffering=True, write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False),
                                  errors="backslashreplace", line_buffering=True,
                                  write_through=True)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    args = request["args"]
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = os.getcwd() if args[0] in ("-m", "-c") else os.path.dirname(
        os.path.abspath(args[0]))
    sys.path[:] = [first, *pythonpath, *base_path]
    # A fresh process gets fresh randomness; numpy does not reseed on fork.
    import numpy  # pylint: disable=import-outside-toplevel
    numpy.random.seed()
    return args


def _run_main(args: List[str]) -> None:
    import runpy  # pylint: disable=import-outside-toplevel
    if args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        code = compile(args[1], "<string>", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})  # noqa: S102
    elif args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        runpy.run_path(args[0], run_name="__main__")


def compatible(env: Dict[str, str]) -> bool:
    """Whether a worker with `env` may share the server's imports: it sets none of
    IMPORT_TIME_ENV to a value other than the server's (unset is fine: a script's
    os.environ.setdefault then agrees)."""
    return all(env.get(key, value) == value for key, value in IMPORT_TIME_ENV.items())


def supported(args: List[str]) -> bool:
    """Whether the server runs `python args...` itself (else the client execs python)."""
    if not args:
        return False
    if args[0] in ("-c", "-m"):
        return len(args) >= 2
    return not args[0].startswith("-") and args[0].endswith(".py")


# ----------------------------------------------------------------- the test side

def serve_argv(path: str) -> List[str]:
    """The command that runs a server on `path` (its directory is made, 0700)."""
    return [sys.executable, os.path.abspath(__file__), "serve", path]


def wait_ready(stdout, timeout_s: float) -> None:
    """Waits for a starting server's "ready" line on its `stdout` (a text pipe)."""
    ready, _, _ = select.select([stdout], [], [], timeout_s)
    line = stdout.readline() if ready else ""
    if line.strip() != "ready":
        raise RuntimeError(f"the preload server did not start (got {line!r})")


class Server:
    """The fork server as a subprocess of the test session; `env()` points clients at it."""

    def __init__(self, env: Optional[Dict[str, str]] = None, timeout_s: float = 300):
        env = server_env(env)
        self._dir = tempfile.mkdtemp(prefix="tf_smb-preload-")  # 0700
        self.path = os.path.join(self._dir, "socket")
        self._proc = subprocess.Popen(serve_argv(self.path), env=env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, text=True)
        try:
            wait_ready(self._proc.stdout, timeout_s)
        except RuntimeError:
            self.close()
            raise

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.rmdir(self._dir)


def server_env(env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """`env` (default: os.environ) with IMPORT_TIME_ENV's values, for a server."""
    env = {k: v for k, v in (os.environ if env is None else env).items()
           if k not in IMPORT_TIME_ENV}
    env.update((k, v) for k, v in IMPORT_TIME_ENV.items() if v is not None)
    return env


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] != "serve":
        sys.exit(f"usage: {sys.argv[0]} serve SOCKET_PATH")
    path = sys.argv[2]
    here = os.path.dirname(os.path.abspath(__file__))
    own = {here, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))}
    base_path = [p for p in sys.path if p not in own]
    # What every worker imports first, loaded once.
    import numpy  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    import tensorflow  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    import keras  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    # Out of the collector's sight: the workers' collections, and their exits (the
    # interpreter's last collection walked these objects for ~2 s), skip them.
    gc.freeze()
    request = _serve(path)
    # From here on this is a forked worker.
    args = _become_worker(request, base_path)
    del request
    _run_main(args)


if __name__ == "__main__":
    main()
