"""allreduce: times a summing all-reduce of tensor sets with SMB, MWMS or Horovod.

    python -m tf_smb.run -np 2 python -m benchmarks.roles.allreduce --kind=smb --sets=1MB,mlp
    mpirun -np 2 python -m benchmarks.roles.allreduce --kind=horovod --sets=resnet50

A set is one flat float32 tensor (common.FLAT_SETS) or a model's trainable-variable
shapes (common.MODELS). The workers run the sets in turn, one job; rank 0 prints one
result per set (every worker starts each step together, after a barrier).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Callable, List, Optional, Sequence, Tuple

from benchmarks import common

KINDS = ("smb", "mwms", "horovod")


def collective(kind: str) -> Tuple[int, int, Callable, Callable[[], None]]:
    """(rank, world, reduce_fn, barrier) of a summing all-reduce of a list of tensors.

    kind: "smb" (tf_smb.allreduce, one fused op), "mwms" (MultiWorkerMirroredStrategy,
    RING, from TF_CONFIG) or "horovod" (hvd.grouped_allreduce; under horovodrun or
    mpirun). Call it before anything else initializes TensorFlow's context (MWMS needs
    that). The barrier of MWMS and Horovod is an all-reduce of one scalar.
    """
    import tensorflow as tf

    if kind == "smb":
        import tf_smb
        tf_smb.init()

        @tf.function
        def reduce_fn(xs: List[tf.Tensor]) -> List[tf.Tensor]:
            return tf_smb.allreduce(xs)

        return tf_smb.rank(), tf_smb.size(), reduce_fn, tf_smb.barrier
    if kind == "mwms":
        cluster = json.loads(os.environ["TF_CONFIG"])
        rank, world = cluster["task"]["index"], len(cluster["cluster"]["worker"])
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING)
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)

        def replica_fn(xs: List[tf.Tensor]) -> List[tf.Tensor]:
            # The function's inputs have no device, and all_reduce sends each result to
            # its input's device; tf.identity (no copy) places them on the replica's.
            xs = [tf.identity(x) for x in xs]
            return tf.distribute.get_replica_context().all_reduce("sum", xs)

        @tf.function
        def reduce_fn(xs: List[tf.Tensor]) -> List[tf.Tensor]:
            return strategy.experimental_local_results(strategy.run(replica_fn, args=(xs,)))[0]
    elif kind == "horovod":
        import horovod.tensorflow as hvd
        hvd.init()
        rank, world = hvd.rank(), hvd.size()

        @tf.function
        def reduce_fn(xs: List[tf.Tensor]) -> List[tf.Tensor]:
            return list(hvd.grouped_allreduce(xs, op=hvd.Sum))
    else:
        raise ValueError(f"unknown collective {kind!r}")

    one = tf.ones([])

    def barrier() -> None:
        reduce_fn([one])[0].numpy()

    return rank, world, reduce_fn, barrier


def sent_bytes(dev: str) -> int:
    """Bytes this process's network namespace has sent on interface `dev`."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == dev:
                return int(rest.split()[8])
    raise RuntimeError(f"no interface {dev!r} in /proc/net/dev")


def cpu_times() -> Tuple[float, float]:
    """(busy, total) time of every core of the machine so far (/proc/stat's jiffies)."""
    with open("/proc/stat") as f:
        fields = [float(v) for v in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)  # less idle and iowait


def time_collective(kind: str, label: str, shapes: Sequence[Tuple[int, ...]], iters: int,
                    warmup: int, rank: int, world: int, reduce_fn: Callable,
                    barrier: Callable[[], None], link_dev: str = "") -> dict:
    """Checks the all-reduce of `shapes` once, then times `warmup + iters` of them.

    Every worker passes a barrier before each step, so all start it together; a step is
    the call plus the fetch of one element of the last result. Returns the result
    (the timed steps' seconds and what was reduced). `link_dev`: also the bytes each
    node sent on that interface over the timed steps (read by each node's first
    worker in its own network namespace; the barriers' bytes included), in node
    order: "node_sent_bytes". "cpu_busy": the share of the machine's cores busy
    over the timed steps.
    """
    import numpy as np
    import tensorflow as tf

    inputs = [tf.fill(s, float(rank + 1)) for s in shapes]
    outputs = reduce_fn(inputs)
    expected = world * (world + 1) / 2
    for i, (o, s) in enumerate(zip(outputs, shapes)):
        got = o.numpy()
        if got.shape != tuple(s) or not np.all(got == expected):
            raise AssertionError(f"{kind} on {label}: tensor {i} {s}: all-reduce gave shape "
                                 f"{got.shape}, values {np.unique(got)[:5]}, want all {expected}")
    del outputs, got
    times: List[float] = []
    first_of_node = os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0") == "0"
    sent_before = 0
    for it in range(warmup + iters):
        barrier()
        if it == warmup:
            cpu_before = cpu_times()
            if link_dev and first_of_node:
                sent_before = sent_bytes(link_dev)
        start = time.perf_counter()
        outputs = reduce_fn(inputs)
        # Forces the result by fetching one element: numpy() of the whole tensor
        # would copy a sum that stays in SMB's box (a tensor TF does not own).
        tf.reshape(outputs[-1], [-1])[:1].numpy()
        elapsed = time.perf_counter() - start
        del outputs
        if it >= warmup:
            times.append(elapsed)
    busy, total = (a - b for a, b in zip(cpu_times(), cpu_before))
    result = {"role": kind, "set": label, "world": world, "bytes": common.set_bytes(shapes),
              "tensors": len(shapes), "times_s": times,
              "cpu_busy": busy / total if total > 0 else None}
    if link_dev:
        # What the last step queued in the node's socket and shaper leaves first.
        barrier()
        time.sleep(0.5)
        # Each node's count in its first worker's slot, summed to every worker.
        mine = float(sent_bytes(link_dev) - sent_before) if first_of_node else 0.0
        slots = reduce_fn([tf.one_hot(rank, world) * mine])[0].numpy()
        result["node_sent_bytes"] = [float(v) for v in slots if v > 0]
    barrier()
    return result


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.roles.allreduce")
    parser.add_argument("--kind", required=True, choices=KINDS)
    parser.add_argument("--sets", required=True, help="comma list of tensor sets")
    parser.add_argument("--iters", type=int, required=True, help="timed steps per set")
    parser.add_argument("--warmup", type=int, required=True, help="untimed steps first")
    parser.add_argument("--link_dev", default="", help="report the bytes each node sent on "
                        "this interface over the timed steps (simulated nodes: simeth0)")
    args = parser.parse_args(argv)
    # The collective first: MWMS must start before a Keras model initializes TensorFlow.
    rank, world, reduce_fn, barrier = collective(args.kind)
    for name in common.split_list(args.sets, ""):
        result = time_collective(args.kind, name, common.set_shapes(name), args.iters,
                                 args.warmup, rank, world, reduce_fn, barrier, args.link_dev)
        if rank == 0:
            common.print_result(result)


if __name__ == "__main__":
    main()
