"""Runs `python ARGS...` as a fork of the tests' preload server (tests/preload.py).

Usage: python -S preload_client.py ARGS...   (the server's socket in $TF_SMB_TEST_PRELOAD)

Stays small and imports only the standard library: it starts in ~20 ms. It hands
the server its standard streams, a lifeline pipe, its arguments, environment and
working directory; relays the signals it gets to the worker; and ends the way the
worker ended (the same exit code, or killed by the same signal). Without a server,
or for arguments the server does not run, it execs the real interpreter.
"""
import array
import json
import os
import signal
import socket
import struct
import sys

SOCKET_VAR = "TF_SMB_TEST_PRELOAD"
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
           signal.SIGUSR2)


def _supported(args):
    if not args:
        return False
    if args[0] in ("-c", "-m"):
        return len(args) >= 2
    return not args[0].startswith("-") and args[0].endswith(".py")


def _exec_python(args):
    os.execv(sys.executable, [sys.executable, *args])


def _readline(conn):
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(64)
        if not chunk:
            return None
        data += chunk
    return data.decode().split()


def main():
    args = sys.argv[1:]
    path = os.environ.get(SOCKET_VAR)
    if not path or not _supported(args):
        _exec_python(args)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        _exec_python(args)
    # The worker keeps SOCKET_VAR: what it starts in turn (a launcher's workers,
    # a benchmark's jobs) forks from the server too.
    env = dict(os.environ)
    payload = json.dumps({"args": args, "env": env, "cwd": os.getcwd(),
                          "cpus": sorted(os.sched_getaffinity(0))}).encode()
    lifeline_r, lifeline_w = os.pipe()
    fds = array.array("i", [0, 1, 2, lifeline_r])
    conn.sendmsg([struct.pack("!I", len(payload))],
                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds.tobytes())])
    conn.sendall(payload)
    os.close(lifeline_r)
    reply = _readline(conn)
    if reply and reply[0] == "fresh":  # the server's imports do not fit this worker
        os.close(lifeline_w)
        _exec_python(args)
    if not reply or reply[0] != "pid":
        sys.stderr.write("preload_client: the preload server did not start the worker\n")
        sys.exit(70)
    worker = int(reply[1])

    def relay(signum, _frame):
        try:
            os.kill(worker, signum)
        except ProcessLookupError:
            pass

    for signum in RELAYED:
        signal.signal(signum, relay)
    reply = _readline(conn)
    if not reply or reply[0] != "exit":
        sys.stderr.write("preload_client: lost the preload server before the worker ended\n")
        try:
            os.killpg(worker, signal.SIGKILL)
        except OSError:
            pass
        sys.exit(70)
    status = int(reply[1])
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        sys.exit(128 + signum)  # a signal whose default is not to end a process
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
