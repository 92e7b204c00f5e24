"""async_steps: times SMB's per-step box operations on a model's parameter shapes.

    python -m tf_smb.run -np 2 python -m benchmarks.roles.async_steps --models=mlp \
        --comm_modes=sync,push,sgd --iters=10 --warmup=2

Step kinds, each one tf.function call:
  * sync: one fused `tf_smb.allreduce(grads)`, the collective of a synchronous step;
  * push: one `ops.segments_push_read` that reads every parameter into the worker's
    copy, as SMBStrategy(mode="async") starts a step, then one that pushes a delta
    for each (segment += delta in the box), as the step ends;
  * pushread: one `ops.segments_push_read` that pushes a delta for every parameter
    and reads each back into the worker's copy in the same pass, as a step ends
    with SMBStrategy(mode="async", read_at="push");
  * sgd: the same read, then `ops.segment_apply_sgd` of a gradient for each
    parameter (the box runs momentum SGD; update="sgd").
One barrier before and one after each timed loop, none in between: the sync steps wait
for one another in the all-reduce, the async ones do not. The push and pushread runs
are checked: the segments start at zero, and afterwards each holds the sum of the run's
pushes. Every rank prints one result per
model and kind. The box must have room for the parameters (tf_smb.run --heap-bytes).
"""
from __future__ import annotations

import argparse
import time
from typing import List, Optional, Sequence

from benchmarks import common

COMM_MODES = ("sync", "push", "pushread", "sgd")
PUSH_MODES = ("push", "pushread")
SGD_LEARNING_RATE = 1e-3


def run(model: str, modes: Sequence[str], iters: int, warmup: int, sgd_momentum: float
        ) -> None:
    """Times each step kind of `modes` on `model`'s shapes; prints one result each."""
    import numpy as np
    import tensorflow as tf
    import tf_smb
    from tf_smb import ops

    tf_smb.init()
    rank, world = tf_smb.rank(), tf_smb.size()
    shapes = common.model_shapes(model)
    names = [f"{model}/p{i}" for i in range(len(shapes))]  # one box may hold several models
    # The gradients (sync, sgd) and deltas (push): rank + 1 everywhere, so the sums are known.
    grads = [tf.fill(s, float(rank + 1)) for s in shapes]
    learning_rate = tf.constant(SGD_LEARNING_RATE)
    box_modes = [m for m in modes if m != "sync"]

    def zero_segments() -> None:
        if rank == 0:
            for n, s in zip(names, shapes):
                ops.segment_create(tf.zeros(s), n, write=True)
        tf_smb.barrier()

    if box_modes:
        zero_segments()
        if rank != 0:
            for n, g in zip(names, grads):
                ops.segment_create(g, n, write=False)

    def first(x: tf.Tensor) -> tf.Tensor:
        return tf.reshape(x, [-1])[0]

    @tf.function
    def sync_step(xs: List[tf.Tensor]) -> tf.Tensor:
        return first(tf_smb.allreduce(xs)[-1])

    # The worker's copies of the parameters, which the async steps read the box into.
    copies = [tf.Variable(tf.zeros(s)) for s in shapes] if box_modes else []

    # Ops on the copies run in program order (TensorFlow's automatic control
    # dependencies); a tf.function runs all its stateful ops before returning.
    @tf.function
    def push_step(deltas: List[tf.Tensor]) -> tf.Tensor:
        ops.segments_push_read(copies, names)
        ops.segments_push_read(copies, names, deltas, read=False)
        return first(copies[-1])

    @tf.function
    def pushread_step(deltas: List[tf.Tensor]) -> tf.Tensor:
        ops.segments_push_read(copies, names, deltas)
        return first(copies[-1])

    @tf.function
    def sgd_step(gs: List[tf.Tensor]) -> tf.Tensor:
        read = ops.segments_push_read(copies, names)
        with tf.control_dependencies([read]):
            for g, n in zip(gs, names):
                ops.segment_apply_sgd(g, learning_rate, n, momentum=sgd_momentum)
        return first(copies[-1])

    steps = {"sync": sync_step, "push": push_step, "pushread": pushread_step, "sgd": sgd_step}
    if "sync" in modes:  # check the all-reduce once
        got = [o.numpy() for o in tf_smb.allreduce(grads)]
        expected = world * (world + 1) / 2
        if not all(np.all(g == expected) for g in got):
            raise AssertionError(f"all-reduce: want every value {expected}")
        del got
    for mode in modes:
        step = steps[mode]
        if mode in PUSH_MODES:
            zero_segments()
        for _ in range(warmup):
            step(grads).numpy()
        tf_smb.barrier()
        times: List[float] = []
        for _ in range(iters):
            start = time.perf_counter()
            step(grads).numpy()
            times.append(time.perf_counter() - start)
        tf_smb.barrier()
        if mode in PUSH_MODES:  # every push of every worker landed
            expected = (warmup + iters) * world * (world + 1) / 2
            for n, s in zip(names, shapes):
                value = ops.segment_read(n, tf.float32, s).numpy()
                if not np.all(value == expected):
                    raise AssertionError(f"segment {n} {s} holds {np.unique(value)[:5]} "
                                         f"after the pushes, want all {expected}")
            tf_smb.barrier()  # before the sgd steps change the segments
        common.print_result({"model": model, "mode": mode, "world": world, "rank": rank,
                             "bytes": common.set_bytes(shapes),
                             "params": common.num_params(shapes), "tensors": len(shapes),
                             "times_s": times})


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.roles.async_steps")
    parser.add_argument("--models", required=True, help="comma list of models, in turn "
                        "(one box holds them all)")
    parser.add_argument("--comm_modes", required=True, help=f"comma list of {COMM_MODES}")
    parser.add_argument("--iters", type=int, required=True, help="timed steps per kind")
    parser.add_argument("--warmup", type=int, required=True, help="untimed steps first")
    parser.add_argument("--sgd_momentum", type=float, default=0.9)
    args = parser.parse_args(argv)
    modes = common.split_list(args.comm_modes, "")
    if not modes or any(m not in COMM_MODES for m in modes):
        parser.error(f"--comm_modes: want some of {COMM_MODES}, got {modes}")
    for model in common.split_list(args.models, ""):
        run(model, modes, args.iters, args.warmup, args.sgd_momentum)


if __name__ == "__main__":
    main()
