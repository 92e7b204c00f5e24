"""nodes_link: what the link between two simulated nodes carries, one TCP stream.

    python -m benchmarks.roles.nodes_link serve --bind 10.231.7.2 --port 5301
    python -m benchmarks.roles.nodes_link send --to 10.231.7.2 --port 5301 --seconds 2

`serve` accepts one connection, echoes `--pings` 1-byte messages, counts what it
receives until the sender closes its side, answers the count (8 bytes) and exits
(`--wait` s at most for the sender). `send` first times `--pings` round trips of 1 byte
(TCP_NODELAY), then sends 4 MiB buffers for `--seconds`, closes its side, waits for the
count and prints a result line: the median round trip, the bytes the server received
and the seconds from the first send to the answer (so every byte was received within
them). Plain sockets of the benchmark driver, used only to measure the simulated
link; nothing of tf_smb.
"""
from __future__ import annotations

import argparse
import socket
import statistics
import struct
import time
from typing import Optional, Sequence

from benchmarks import common

CHUNK = 4 << 20


def serve(bind: str, port: int, wait: float, pings: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((bind, port))
        listener.listen(1)
        listener.settimeout(wait)
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(wait)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(pings):
                conn.sendall(conn.recv(1))
            buf = bytearray(CHUNK)
            view, total = memoryview(buf), 0
            while True:
                n = conn.recv_into(view)
                if n == 0:
                    break
                total += n
            conn.sendall(struct.pack("!Q", total))


def send(to: str, port: int, seconds: float, wait: float, pings: int) -> None:
    deadline = time.monotonic() + wait
    while True:  # the server may not listen yet
        try:
            sock = socket.create_connection((to, port), timeout=wait)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(pings):
            t0 = time.perf_counter()
            sock.sendall(b"x")
            sock.recv(1)
            rtts.append(time.perf_counter() - t0)
        data = bytes(CHUNK)
        start = time.perf_counter()
        sent = 0
        while time.perf_counter() - start < seconds:
            sock.sendall(data)
            sent += len(data)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while len(answer) < 8:
            more = sock.recv(8 - len(answer))
            if not more:
                break
            answer += more
        elapsed = time.perf_counter() - start
    received = struct.unpack("!Q", answer)[0] if len(answer) == 8 else 0
    common.print_result({"link": "tcp", "to": to, "sent": sent, "received": received,
                         "seconds": elapsed,
                         "rtt_us": 1e6 * statistics.median(rtts) if rtts else None,
                         "gbit_s": 8e-9 * received / elapsed})


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.roles.nodes_link")
    parser.add_argument("mode", choices=("serve", "send"))
    parser.add_argument("--bind", default="0.0.0.0")
    parser.add_argument("--to", default="")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--pings", type=int, default=0, help="round trips timed first")
    parser.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the peer")
    args = parser.parse_args(argv)
    if args.mode == "serve":
        serve(args.bind, args.port, args.wait, args.pings)
    else:
        send(args.to, args.port, args.seconds, args.wait, args.pings)


if __name__ == "__main__":
    main()
