"""One worker of the "same as one process, or a clear error" scenarios: uneven
batches, Keras' default shuffle under a seed, a model built outside the scope,
reductions in async mode, AutoShardPolicy.OFF in async mode, a rank that
leaves early. Prints one JSON line: each scenario's result."""
import argparse
import os
import sys

import numpy as np
import tensorflow as tf
import keras

import tf_smb
from common import build, data, report


def fit_weights(strategy, **fit_kwargs):
    """Trains a fresh model with `fit_kwargs` (seeded alike everywhere); its weights."""
    keras.utils.set_random_seed(1234)
    model = build(strategy)
    model.fit(verbose=0, **fit_kwargs)
    return [w.tolist() for w in model.get_weights()]


def error_of(fn):
    """The message of the ValueError `fn()` raises, or None (and its value)."""
    try:
        return {"value": fn()}
    except ValueError as e:
        return {"error": str(e)}


def scenario(strategy, name):
    if name == "odd_global":  # every global batch splits unevenly (33 rows)
        x, y = data(n=99)
        return fit_weights(strategy, x=tf.data.Dataset.from_tensor_slices((x, y)).batch(33),
                           epochs=2)
    if name == "partial_last":  # the last batch (25 of 249 rows) splits unevenly
        x, y = data(n=249)
        return fit_weights(strategy, x=tf.data.Dataset.from_tensor_slices((x, y)).batch(32),
                           epochs=2)
    if name == "default_shuffle":  # fit(x, y): Keras shuffles, with the user's seed
        x, y = data(n=96)
        return fit_weights(strategy, x=x, y=y, batch_size=24, epochs=2)
    if name in ("custom_step", "custom_step_sgd"):  # a subclassed model's own train_step
        class Custom(keras.Model):
            def train_step(self, batch):
                x, y = batch
                with tf.GradientTape() as tape:
                    loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
                grads = tape.gradient(loss, self.trainable_variables)
                self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
                return {"loss": loss}
        keras.utils.set_random_seed(1234)
        x, y = data(n=96)
        with strategy.scope():
            inputs = keras.Input((6,))
            outputs = keras.layers.Dense(3)(keras.layers.Dense(8, activation="tanh")(inputs))
            model = Custom(inputs, outputs)
            optimizer = (keras.optimizers.SGD(0.1) if name == "custom_step_sgd"
                         else keras.optimizers.Adam(0.05))
            model.compile(optimizer=optimizer,
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(24), epochs=2, verbose=0)
        return [w.tolist() for w in model.get_weights()]
    if name == "mixed":  # mixed_float16
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            x, y = data(n=96)
            return fit_weights(strategy, x=tf.data.Dataset.from_tensor_slices((x, y)).batch(24),
                               epochs=2)
        finally:
            keras.mixed_precision.set_global_policy("float32")
    if name == "outside_scope":  # built and compiled outside strategy.scope()
        x, y = data(n=48)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        return error_of(lambda: model.fit(x, y, batch_size=8, epochs=1, verbose=0) and None)
    if name == "reduce":  # replica r of all adds r + 1
        def value():
            ctx = tf.distribute.get_replica_context()
            return tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)[None]
        per_replica = strategy.run(value)
        return {"in_sync": strategy.num_replicas_in_sync,
                "reduce": error_of(lambda: float(strategy.reduce("SUM", per_replica, axis=None)[0])),
                "gather": error_of(lambda: strategy.gather(per_replica, axis=0).numpy().tolist())}
    if name in ("shard_off", "shard"):  # 10 batches; sharding turned off, or not
        x, y = data(n=80)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
        if name == "shard_off":
            options = tf.data.Options()
            options.experimental_distribute.auto_shard_policy = (
                tf.data.experimental.AutoShardPolicy.OFF)
            ds = ds.with_options(options)
        model = build(strategy)
        model.fit(ds, epochs=1, verbose=0)
        return int(model.optimizer.iterations.numpy())
    if name in ("leave_early", "raise_early"):  # rank 0 stops after one epoch
        class StopRank0(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                if strategy.rank == 0 and name == "raise_early":
                    raise RuntimeError("rank 0 gives up")
                if strategy.rank == 0:
                    self.model.stop_training = True
        x, y = data(n=96)
        model = build(strategy)
        model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[StopRank0()])
        return "finished"
    raise ValueError(f"no scenario {name!r}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--scenarios", required=True)
    p.add_argument("--mode", default="sync")
    a = p.parse_args()
    strategy = tf_smb.SMBStrategy(
        mode=a.mode, timeout_s=float(os.environ.get("TEST_TIMEOUT", "60")),
        local_replicas=int(os.environ.get("TEST_LOCAL_REPLICAS", "1")))
    out = {"rank": strategy.rank, "size": strategy.size,
           "replicas": strategy.num_replicas_in_sync}
    for name in a.scenarios.split(","):
        out[name] = scenario(strategy, name)
    report(out)


if __name__ == "__main__":
    sys.exit(main())
