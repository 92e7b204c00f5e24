"""gather: the bytes (and time) of `strategy.gather` across nodes, against the sum of
zero-padded buffers it replaced.

    mpirun ... python -m benchmarks.roles.gather --mb=64 --iters=3 --link_dev=simeth0

Every worker holds `mb / world` MB of float32 rows (1,024 columns); a step gathers
them on every worker: `strategy.gather` of SMBStrategy (each worker's rows sent once,
Collectives.allgather), and "sum", each worker's rows placed in a zero buffer of the
whole result and the buffers summed (tf_smb before). Rank 0 prints one result per
method: the timed steps' seconds and the bytes each node sent on its link.
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Callable, List, Optional, Sequence

from benchmarks import common
from benchmarks.roles.allreduce import cpu_times, sent_bytes

COLUMNS = 1024


def gather_by_sum(local, rank: int, world: int):
    """The whole result as a sum: each worker's rows at its offset in zeros."""
    import tensorflow as tf
    import tf_smb
    rows = local.shape[0]
    slots = tf.scatter_nd([[rank]], local[tf.newaxis], [world, rows, COLUMNS])
    return tf.reshape(tf_smb.allreduce([slots])[0], [world * rows, COLUMNS])


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.roles.gather")
    parser.add_argument("--mb", type=float, default=64.0, help="the gathered result's MB")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--methods", default="gather,sum")
    parser.add_argument("--link_dev", default="simeth0")
    args = parser.parse_args(argv)
    import numpy as np
    import tensorflow as tf
    import tf_smb

    strategy = tf_smb.SMBStrategy()
    rank, world = strategy.rank, strategy.size
    rows = int(args.mb * 2**20 / 4 / COLUMNS / world)
    local = tf.fill([rows, COLUMNS], float(rank + 1))
    expected = np.repeat(np.arange(1, world + 1, dtype=np.float32), rows)
    first_of_node = os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0") == "0"
    methods = {"gather": lambda: strategy.gather(local, axis=0),
               "sum": lambda: gather_by_sum(local, rank, world)}
    for name in common.split_list(args.methods, ""):
        run: Callable = methods[name]
        got = run().numpy()
        if got.shape != (world * rows, COLUMNS) or not np.array_equal(got[:, 0], expected):
            raise AssertionError(f"{name}: gathered shape {got.shape}, first column "
                                 f"{np.unique(got[:, 0])[:5]}")
        del got
        times: List[float] = []
        for it in range(args.warmup + args.iters):
            strategy.barrier()
            if it == args.warmup:
                cpu_before = cpu_times()
                sent_before = sent_bytes(args.link_dev) if first_of_node else 0
            start = time.perf_counter()
            tf.reshape(run(), [-1])[:1].numpy()
            if it >= args.warmup:
                times.append(time.perf_counter() - start)
        busy, total = (a - b for a, b in zip(cpu_times(), cpu_before))
        strategy.barrier()
        time.sleep(0.5)  # what the last step queued leaves the socket
        mine = float(sent_bytes(args.link_dev) - sent_before) if first_of_node else 0.0
        slots = tf_smb.allreduce([tf.one_hot(rank, world, dtype=tf.float64) * mine])[0]
        if rank == 0:
            common.print_result({
                "role": name, "world": world, "bytes": world * rows * COLUMNS * 4,
                "part_bytes": rows * COLUMNS * 4, "times_s": times,
                "node_sent_bytes": [float(v) for v in slots.numpy() if v > 0],
                "cpu_busy": busy / total if total > 0 else None})
    strategy.barrier()


if __name__ == "__main__":
    main()
