"""One worker of a Keras fit for the timeline tests (tests/test_timeline.py):
a small MLP, sync or async SMBStrategy; prints one JSON line with the steps
run and the median step time (begin to begin of consecutive training steps).
TF_SMB_TIMELINE in the environment turns the timeline on.
"""
import argparse
import json
import statistics
import sys
import time

import numpy as np
import tensorflow as tf
import keras

import tf_smb
import tf_smb.timeline


class StepTimes(keras.callbacks.Callback):
    """Seconds between the starts of consecutive training steps."""

    def __init__(self):
        super().__init__()
        self.begins = []

    def on_train_batch_begin(self, batch, logs=None):
        self.begins.append(time.perf_counter())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="sync", choices=("sync", "async"))
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="steps per epoch")
    p.add_argument("--batch", type=int, default=16, help="per-worker batch")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--flush", action="store_true", help="also call tf_smb.timeline.flush()")
    a = p.parse_args()
    keras.utils.set_random_seed(1)
    kwargs = {"mode": "async", "staleness": 2, "update": "sgd"} if a.mode == "async" else {}
    strategy = tf_smb.SMBStrategy(timeout_s=120, **kwargs)
    world = strategy.num_replicas_in_sync
    n = a.steps * a.batch * world
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 32)).astype(np.float32)
    y = (x[:, :16].sum(1) > x[:, 16:].sum(1)).astype(np.int32)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((32,)),
            keras.layers.Dense(a.width, activation="relu"),
            keras.layers.Dense(a.width, activation="relu"),
            keras.layers.Dense(2),
        ])
        optimizer = keras.optimizers.SGD(0.05) if a.mode == "async" else keras.optimizers.Adam(1e-3)
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(a.batch * world)
    times = StepTimes()
    hist = model.fit(ds, epochs=a.epochs, verbose=0, callbacks=[times])
    gaps = [b - a_ for a_, b in zip(times.begins, times.begins[1:])]
    # The first epoch traces the step function: time the later ones.
    later = gaps[a.steps:] if len(gaps) > a.steps else gaps
    written = tf_smb.timeline.flush() if a.flush else None
    from tf_smb.keras_support import timeline as keras_timeline
    print(json.dumps({"rank": strategy.rank, "size": strategy.size, "steps": len(times.begins),
                      "timeline_hooked": keras_timeline._HOOKED,  # pylint: disable=protected-access
                      "median_step_s": statistics.median(later) if later else None,
                      "loss": hist.history["loss"], "flushed": written}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
