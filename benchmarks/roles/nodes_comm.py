"""nodes_comm: all-reduce and async steps across nodes, with the bytes that crossed the link.

    mpirun -np 4 --hostfile H ... python -m benchmarks.roles.nodes_comm --kind=smb --push \
        --sets=resnet50,vgg16 --iters=10 --warmup=2 --iface=veth0

The cross-node driver (benchmarks/nodes.py) runs it on two simulated nodes. Per set:
  * the all-reduce of `--kind` (smb, horovod, mwms: roles.allreduce.collective), first
    checked and warmed up (roles.allreduce.time_collective, untimed), then `--iters`
    timed steps, each after a barrier, as roles.allreduce times them;
  * with --push (smb only): the async step of roles.async_steps (one `segments_push_read`
    that reads every parameter, one that pushes a delta for each), `--warmup` untimed then
    `--iters` timed steps back to back, every pushed value checked afterwards.
With --fit_kind, the same job then runs roles.fit (model.fit throughput of
--fit_models), so the workers start once (TensorFlow's start dominates a short job).
Rank 0 (on node 0) reads the link's byte counters (/sys/class/net/IFACE/statistics,
in its own network namespace: the node's) after the barrier before the timed steps
and after the one that follows them; its result carries both readings. Every rank
prints its async times; rank 0 alone prints the all-reduce times (the steps start
together).
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Dict, List, Optional, Sequence

from benchmarks import common
from benchmarks.roles.allreduce import KINDS, collective, time_collective


def link_counters(iface: str) -> Dict[str, int]:
    """{"rx": bytes, "tx": bytes} of interface `iface` in this process's network
    namespace (/sys/class/net; /proc/net/dev, all interfaces but lo, without one)."""
    base = f"/sys/class/net/{iface}/statistics"
    if iface and os.path.isdir(base):
        out = {}
        for key in ("rx", "tx"):
            with open(f"{base}/{key}_bytes") as f:
                out[key] = int(f.read())
        return out
    rx = tx = 0
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            name, _, data = line.partition(":")
            if name.strip() == "lo":
                continue
            fields = data.split()
            rx, tx = rx + int(fields[0]), tx + int(fields[8])
    return {"rx": rx, "tx": tx}


def time_allreduce(kind: str, name: str, iters: int, warmup: int, iface: str,
                   rank: int, world: int, reduce_fn, barrier) -> Optional[dict]:
    """The timed all-reduce steps of set `name`, with the link counters around them
    (rank 0's result; None elsewhere)."""
    import tensorflow as tf

    shapes = common.set_shapes(name)
    # Checks the sum once, then `warmup` untimed steps (the function is traced).
    time_collective(kind, name, shapes, max(warmup, 1), 0, rank, world, reduce_fn, barrier)
    inputs = [tf.fill(s, float(rank + 1)) for s in shapes]
    barrier()
    before = link_counters(iface) if rank == 0 else None
    times: List[float] = []
    for _ in range(iters):
        barrier()
        start = time.perf_counter()
        outputs = reduce_fn(inputs)
        tf.reshape(outputs[-1], [-1])[:1].numpy()
        times.append(time.perf_counter() - start)
        del outputs
    barrier()
    if rank != 0:
        return None
    return {"kind": kind, "step": "allreduce", "set": name, "world": world, "rank": rank,
            "bytes": common.set_bytes(shapes), "tensors": len(shapes), "times_s": times,
            "link_before": before, "link_after": link_counters(iface), "steps": iters}


def time_push(name: str, iters: int, warmup: int, iface: str) -> dict:
    """roles.async_steps' push step on set `name` across the nodes (every rank's result;
    rank 0's carries the link counters around the timed steps of all ranks)."""
    import numpy as np
    import tensorflow as tf
    import tf_smb
    from tf_smb import ops

    rank, world = tf_smb.rank(), tf_smb.size()
    shapes = common.set_shapes(name)
    names = [f"{name}/p{i}" for i in range(len(shapes))]
    deltas = [tf.fill(s, float(rank + 1)) for s in shapes]
    if rank == 0:  # segments start at zero
        for n, s in zip(names, shapes):
            ops.segment_create(tf.zeros(s), n, write=True)
    tf_smb.barrier()
    if rank != 0:
        for n, d in zip(names, deltas):
            ops.segment_create(d, n, write=False)
    homes = [ops.segment_home(n) for n in names]

    copies = [tf.Variable(tf.zeros(s)) for s in shapes]  # the worker's copies, read into

    @tf.function
    def push_step(ds: List[tf.Tensor]) -> tf.Tensor:
        ops.segments_push_read(copies, names)  # ordered by the copies they share
        ops.segments_push_read(copies, names, ds, read=False)
        return tf.reshape(copies[-1], [-1])[0]

    for _ in range(warmup):
        push_step(deltas).numpy()
    tf_smb.barrier()
    before = link_counters(iface) if rank == 0 else None
    times: List[float] = []
    for _ in range(iters):
        start = time.perf_counter()
        push_step(deltas).numpy()
        times.append(time.perf_counter() - start)
    tf_smb.barrier()
    after = link_counters(iface) if rank == 0 else None
    expected = (warmup + iters) * world * (world + 1) / 2
    for n, s in zip(names, shapes):  # every push of every worker landed
        value = ops.segment_read(n, tf.float32, s).numpy()
        if not np.all(value == expected):
            raise AssertionError(f"segment {n} {s} holds {np.unique(value)[:5]} after the "
                                 f"pushes, want all {expected}")
    tf_smb.barrier()
    seg_bytes = [4 * int(np.prod(s)) for s in shapes]
    result = {"kind": "smb", "step": "push", "set": name, "world": world, "rank": rank,
              "bytes": common.set_bytes(shapes), "tensors": len(shapes), "times_s": times,
              "steps": iters, "local_size": int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE",
                                                               world))}
    if rank == 0:
        result.update(link_before=before, link_after=after,
                      home_bytes=[sum(b for b, h in zip(seg_bytes, homes) if h == node)
                                  for node in range(max(homes) + 1)])
    return result


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.roles.nodes_comm")
    parser.add_argument("--kind", required=True, choices=KINDS)
    parser.add_argument("--sets", required=True, help="comma list of tensor sets")
    parser.add_argument("--iters", type=int, required=True, help="timed steps per set")
    parser.add_argument("--warmup", type=int, required=True, help="untimed steps first")
    parser.add_argument("--iface", default="", help="the link's interface on node 0")
    parser.add_argument("--push", action="store_true",
                        help="also time the async push step (kind smb only)")
    parser.add_argument("--no_allreduce", action="store_true", help="the push step alone")
    parser.add_argument("--fit_kind", default="", help="then roles.fit with this --kind")
    parser.add_argument("--fit_models", default="")
    parser.add_argument("--fit_epochs", type=int, default=0)
    parser.add_argument("--fit_batch", type=int, default=0)
    parser.add_argument("--samples", default="", help="roles.fit --samples")
    args = parser.parse_args(argv)
    if args.push and args.kind != "smb":
        parser.error("--push needs --kind=smb")
    rank, world, reduce_fn, barrier = collective(args.kind)
    sets = common.split_list(args.sets, "")
    if not args.no_allreduce:
        for name in sets:
            result = time_allreduce(args.kind, name, args.iters, args.warmup, args.iface,
                                    rank, world, reduce_fn, barrier)
            if result is not None:
                common.print_result(result)
    if args.push:
        for name in sets:
            common.print_result(time_push(name, args.iters, args.warmup, args.iface))
    if args.fit_kind:
        from benchmarks.roles import fit  # pylint: disable=import-outside-toplevel
        fit.run(args.fit_kind, common.split_list(args.fit_models, ""), args.fit_epochs,
                args.fit_batch, fit.parse_samples(args.samples))


if __name__ == "__main__":
    main()
