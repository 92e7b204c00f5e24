"""Resident memory a model's parameters cost under a strategy: prints
{"copy_mb", "grown_mb", "replicas"} as one JSON line.

    python memory_worker.py plain 1      # one process, no strategy
    python memory_worker.py smb 3        # SMBStrategy(local_replicas=3)
    python memory_worker.py mirrored 3   # tf.distribute.MirroredStrategy, 3 logical CPUs

The model is one 4096x4096 dense layer (64 MiB of float32 parameters),
trained three steps with SGD (no optimizer slots). `grown_mb` is VmRSS after
that minus VmRSS before the model existed, each after malloc_trim, with
TensorFlow, the strategy and a tiny model's first fit already done. It holds
the parameters' copies plus what creating and training them leaves behind
(initialiser buffers, gradients), so tests compare it with the plain process's:
the difference is the copies (and per-replica gradients) a strategy adds.
"""
import ctypes
import json
import sys


def rss_mb() -> float:
    """This process's resident memory, MiB, after returning freed heap to the OS."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS in /proc/self/status")


def main():
    kind, replicas = sys.argv[1], int(sys.argv[2])
    import tensorflow as tf
    if kind == "smb":
        import tf_smb
        strategy = tf_smb.SMBStrategy(local_replicas=replicas)
    elif kind == "mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
        strategy = tf.distribute.MirroredStrategy(
            [d.name for d in tf.config.list_logical_devices("CPU")])
    else:
        strategy = tf.distribute.get_strategy()
    import keras
    import numpy as np

    def fitted(width, steps):
        with strategy.scope():
            model = keras.Sequential([keras.Input((width,)),
                                      keras.layers.Dense(width, use_bias=False)])
            model.compile(keras.optimizers.SGD(0.01), "mse")
        x = np.ones((12, width), np.float32)
        model.fit(x, x, batch_size=12, epochs=steps, verbose=0)
        return model

    fitted(4, 1)  # loads and traces what every first fit needs
    before = rss_mb()
    model = fitted(4096, 3)
    grown = rss_mb() - before
    copy_mb = sum(w.numpy().nbytes for w in model.weights) / 2**20
    print(json.dumps({"copy_mb": copy_mb, "grown_mb": grown,
                      "replicas": strategy.num_replicas_in_sync}), flush=True)


if __name__ == "__main__":
    main()
