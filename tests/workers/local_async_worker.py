"""Asynchronous local replicas: `--replicas` threads each push "+1" (to every
element of a `--size` vector) through the parameter-server thread `--steps`
times; prints one JSON line with the final value, the server's applied count,
the smallest lead of the applied updates over what a replica read at the start
of each step, and the largest spread (max - min) within one read: 0 unless a
read caught an update half applied.

    python local_async_worker.py --staleness=0 --steps=2000
    TF_SMB_RANK=r TF_SMB_SIZE=2 ... local_async_worker.py --replicas=2   # through the box
    python local_async_worker.py --size=1000000 --steps=200 --consistency=hogwild
"""
import argparse
import json

import tf_smb



def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--staleness", type=int, default=None)
    p.add_argument("--size", type=int, default=1)
    p.add_argument("--consistency", default="consistent")
    p.add_argument("--replicas", type=int, default=3)
    a = p.parse_args()
    strategy = tf_smb.SMBStrategy(mode="async", update="sgd", staleness=a.staleness,
                                  consistency=a.consistency, local_replicas=a.replicas)
    import numpy as np
    import tensorflow as tf
    import keras
    from tf_smb import ops

    with strategy.scope():
        v = tf.Variable(tf.zeros([a.size]))
        opt = keras.optimizers.SGD(1.0)  # w -= 1 * (-1): +1 per push
        opt.build([v])

    def replica_step():
        seen = v.read_value()
        with tf.control_dependencies([seen]):
            opt.apply([-tf.ones([a.size])], [v])
        return tf.reduce_min(seen), tf.reduce_max(seen) - tf.reduce_min(seen)

    @tf.function
    def step():
        return strategy.run(replica_step)

    seen, spread = [], 0.0
    for _ in range(a.steps):
        low, width = step()
        seen.append([float(s) for s in strategy.experimental_local_results(low)])
        spread = max([spread] + [float(w) for w in strategy.experimental_local_results(width)])
    seen = np.array(seen)
    strategy.finish_training()
    # One process: before step k every replica's pushes of the steps before
    # k - staleness must be applied: seen >= replicas * (k - staleness).
    due = a.replicas * (np.arange(a.steps) - (a.staleness or 0))
    final = v.numpy()
    print(json.dumps({"value": float(final.min()), "value_max": float(final.max()),
                      "applied": int(ops.server_wait(0)), "spread": spread,
                      "min_lead": float(np.min(seen - due[:, None])),
                      "replicas": strategy.num_replicas_in_sync,
                      "rank": strategy.rank}), flush=True)


if __name__ == "__main__":
    main()
