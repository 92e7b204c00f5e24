"""Box segments pushed to by every worker at once, for the asynchronous mode
across nodes (tests/test_nodes_async.py); it runs on one node as well.

Rank 0 creates SEGMENTS (each element's initial value: its index mod 7) before
a barrier, the others attach after it, as tf_smb/async_mode.py does. Every rank
then:
  1. asks where each segment lives (ops.segment_home);
  2. pushes a delta of the wrong shape to every segment (local or remote home)
     and keeps the error text;
  3. adds +1 to every element of every segment `--pushes` times: segment_push,
     and on the float segments every other time segment_apply_sgd(grad=-1,
     lr=1, momentum=0) instead; all exact. MOMENTUM_SEGMENT instead gets
     `--pushes` momentum SGD steps. Every `--check_every` rounds it reads
     one segment (consistent read) and records it when its elements did not all
     gain the same amount (a torn read: half an update);
  4. after a barrier, reads every segment.
Writes rank<r>.json in --result_dir: every segment's home, the wrong-shape
errors, the torn reads, the final values, and the seconds taken; prints it all
but the final values.
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_smb  # noqa: E402
from tf_smb import ops  # noqa: E402

# name, dtype, shape. In creation order the placement rule (the node holding the
# fewest segment bytes so far, ties to the lowest index) puts them on nodes
# 0, 1, 0, 1, 0, 0 of two: 1028 B -> 0; 1028 B -> 1; 264 B -> 0 (tie); 8000 B -> 1;
# then 512 B and 160000 B -> 0.
SEGMENTS = [
    ("nodes-async-f32", tf.float32, [257]),
    ("nodes-async-i32", tf.int32, [257]),
    ("nodes-async-f64", tf.float64, [3, 11]),
    ("nodes-async-i64", tf.int64, [1000]),
    ("nodes-async-momentum", tf.float64, [64]),  # 512 B -> 0
    # Larger than the 128 KiB pieces sums cross the nodes in.
    ("nodes-async-big", tf.float32, [40000]),  # 160000 B -> 0 (1804 B there, 9028 B on 1)
]
# Gets only segment_apply_sgd(grad=-1, lr=1, momentum=MOMENTUM): v = m*v + 1;
# w += v, with one velocity for the segment (in its home's box), whichever rank
# applies. All gradients being equal, the result depends only on their number.
MOMENTUM_SEGMENT, MOMENTUM = "nodes-async-momentum", 0.75


def initial(dtype, shape):
    """What rank 0 stores: each element's flat index mod 7."""
    n = int(np.prod(shape))
    return (np.arange(n) % 7).reshape(shape).astype(dtype.as_numpy_dtype)


def spec(dtype, shape):
    return f"{dtype.name}[{','.join(str(d) for d in shape)}]"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pushes", type=int, default=2000)
    p.add_argument("--check_every", type=int, default=50)
    p.add_argument("--result_dir", default=None)
    a = p.parse_args()

    ops.init()
    rank, size = tf_smb.rank(), tf_smb.size()
    result = {"rank": rank, "size": size, "pushes": a.pushes, "momentum": MOMENTUM,
              "momentum_segment": MOMENTUM_SEGMENT,
              "segments": [[name, spec(dtype, shape)] for name, dtype, shape in SEGMENTS]}

    # Create: rank 0 first (write=True), a collective orders it before the others.
    if rank == 0:
        for name, dtype, shape in SEGMENTS:
            ops.segment_create(tf.constant(initial(dtype, shape)), name, True)
    ops.barrier()
    if rank != 0:
        for name, dtype, shape in SEGMENTS:
            ops.segment_create(tf.zeros(shape, dtype), name, False)
    result["homes"] = {name: int(ops.segment_home(name)) for name, _, _ in SEGMENTS}

    # Wrong shape: refused with both shapes named, nothing changed (the final
    # values show it).
    errors = {}
    for name, dtype, shape in SEGMENTS:
        bad_shape = list(shape[:-1]) + [shape[-1] + 1]
        try:
            ops.segment_push(tf.ones(bad_shape, dtype), name)
            errors[name] = None
        except tf.errors.InvalidArgumentError as e:
            errors[name] = e.message
        except Exception as e:  # noqa: BLE001 - any other error is a test failure
            errors[name] = f"not InvalidArgumentError: {type(e).__name__}: {e}"
    result["bad_push_errors"] = errors
    ops.barrier()

    ones = {name: tf.ones(shape, dtype) for name, dtype, shape in SEGMENTS}
    minus_ones = {name: -tf.ones(shape, dtype) for name, dtype, shape in SEGMENTS
                  if dtype.is_floating}
    lr = tf.constant(1.0)
    torn = []
    start = time.monotonic()
    for i in range(a.pushes):
        for name, dtype, shape in SEGMENTS:
            if name == MOMENTUM_SEGMENT:
                ops.segment_apply_sgd(minus_ones[name], lr, name, MOMENTUM)
            elif dtype.is_floating and i % 2:
                ops.segment_apply_sgd(minus_ones[name], lr, name, 0.0)  # w -= 1 * (-1)
            else:
                ops.segment_push(ones[name], name)
        if a.check_every and i % a.check_every == 0:
            name, dtype, shape = SEGMENTS[(i // a.check_every) % len(SEGMENTS)]
            gained = (ops.segment_read(name, dtype, shape).numpy().astype(np.float64)
                      - initial(dtype, shape))
            # (The momentum segment's values are not integers: rounding differs
            # by the element's initial value.)
            if gained.max() - gained.min() > 1e-6 and len(torn) < 10:
                torn.append({"segment": name, "round": i, "min": float(gained.min()),
                             "max": float(gained.max())})
    result["push_seconds"] = time.monotonic() - start
    result["torn"] = torn
    ops.barrier()

    result["final"] = {name: ops.segment_read(name, dtype, shape).numpy().ravel().tolist()
                       for name, dtype, shape in SEGMENTS}
    ops.barrier()  # no rank leaves while another still reads from its node
    # The output shows all but the final values (long); the file holds everything.
    print(json.dumps({k: v for k, v in result.items() if k != "final"}), flush=True)
    if a.result_dir:
        with open(os.path.join(a.result_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    sys.exit(main())
