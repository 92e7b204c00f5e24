"""Asynchronous local replicas: 3 replica threads each push "+1" through the
parameter-server thread `--steps` times; prints one JSON line with the final
value, the server's applied count, and the smallest lead of the applied
updates over what a replica read at the start of each step.

    python local_async_worker.py --staleness=0 --steps=2000
"""
import argparse
import json

import tf_smb

REPLICAS = 3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--staleness", type=int, default=None)
    a = p.parse_args()
    strategy = tf_smb.SMBStrategy(mode="async", update="sgd", staleness=a.staleness,
                                  local_replicas=REPLICAS)
    import numpy as np
    import tensorflow as tf
    import keras
    from tf_smb import ops

    with strategy.scope():
        v = tf.Variable(0.0)
        opt = keras.optimizers.SGD(1.0)  # w -= 1 * (-1): +1 per push
        opt.build([v])

    def replica_step():
        seen = v.read_value()
        with tf.control_dependencies([seen]):
            opt.apply([tf.constant(-1.0)], [v])
        return seen

    @tf.function
    def step():
        return strategy.run(replica_step)

    seen = np.array([[float(s) for s in strategy.experimental_local_results(step())]
                     for _ in range(a.steps)])
    strategy.finish_training()
    # Before step k every replica's pushes of the steps before k - staleness
    # must be applied: seen >= REPLICAS * (k - staleness).
    due = REPLICAS * (np.arange(a.steps) - (a.staleness or 0))
    print(json.dumps({"value": float(v.numpy()), "applied": int(ops.server_wait(0)),
                      "min_lead": float(np.min(seen - due[:, None])),
                      "replicas": strategy.num_replicas_in_sync}), flush=True)


if __name__ == "__main__":
    main()
