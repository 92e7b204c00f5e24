"""One worker of a Keras optimizer scenario (clipping, loss scaling, async
reductions); prints one JSON result line.

Run with TF_SMB_RANK/TF_SMB_SIZE set for N workers, or without launcher
variables for a one-process reference (plain Keras, or MirroredStrategy over
--devices logical CPUs).
"""
import argparse
import os
import sys

import numpy as np
import tensorflow as tf
import keras

import tf_smb
from common import data, report

CLIPS = {  # small enough that clipping changes every update
    "clipnorm": {"clipnorm": 0.05},
    "clipvalue": {"clipvalue": 0.01},
    "global_clipnorm": {"global_clipnorm": 0.08},
    "accumulate_clipnorm": {"clipnorm": 0.05, "gradient_accumulation_steps": 2},
}




def initial_weights(hidden=4):
    """The same starting weights in every process, whatever its strategy."""
    rng = np.random.default_rng(42)
    return [rng.normal(scale=0.8, size=(6, hidden)).astype(np.float32),
            rng.normal(scale=0.1, size=(hidden,)).astype(np.float32),
            rng.normal(scale=0.8, size=(hidden, 3)).astype(np.float32),
            rng.normal(scale=0.1, size=(3,)).astype(np.float32)]


def build(optimizer, dtype=None):
    model = keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(4, activation="tanh"),
        keras.layers.Dense(3, dtype=dtype),  # float32 logits under mixed precision
    ])
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.set_weights(initial_weights())
    return model


def weights(model):
    return [w.tolist() for w in model.get_weights()]


def scenario_clip(strategy, a):
    """Trains one model per clipping option on the same data and global batch."""
    global_batch = a.global_batch
    x, y = data(4 * global_batch)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    out = {}
    for name in a.variants.split(","):
        with strategy.scope():
            model = build(keras.optimizers.SGD(0.5, **CLIPS[name]))
        model.fit(ds, epochs=2, verbose=0)
        out[name] = weights(model)
    with strategy.scope():
        plain = tf.Variable(1.0)
        on_read = tf.Variable(0.0, synchronization=tf.VariableSynchronization.ON_READ,
                              aggregation=tf.VariableAggregation.SUM)
    out["synchronization"] = {
        "tf.Variable": plain.synchronization.name,
        "keras_weights": sorted({w.value.synchronization.name for w in model.weights}),
        "optimizer": sorted({v.value.synchronization.name for v in model.optimizer.variables}),
        "on_read": on_read.synchronization.name,
    }
    return out


def scenario_mixed(strategy, a):
    """LossScaleOptimizer with a non-finite input row in one rank's shard of
    global batch --bad_step: every rank must skip that step."""
    global_batch, workers = a.global_batch, a.workers
    x, y = data(4 * global_batch)
    # Rows [r*B, (r+1)*B) of each global batch are rank r's shard (B = global/workers).
    x[a.bad_step * global_batch + a.bad_rank * (global_batch // workers), 0] = np.nan
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    out = {}
    for policy in ("float32", "mixed_float16"):
        keras.mixed_precision.set_dtype_policy(policy)
        with strategy.scope():
            if policy == "float32":  # explicit loss scaling, float32 compute
                model = build(keras.optimizers.LossScaleOptimizer(
                    keras.optimizers.SGD(0.2), initial_scale=2.0 ** 8), dtype="float32")
            else:  # compile wraps the optimizer in a LossScaleOptimizer itself
                model = build(keras.optimizers.SGD(0.2), dtype="float32")
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        scales, iterations = [], []

        class Record(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                scales.append(float(model.optimizer.dynamic_scale.numpy()))
                # The inner optimizer's updates (Keras 3.3's LossScaleOptimizer
                # counts none of its own).
                iterations.append(int(model.optimizer.inner_optimizer.iterations.numpy()))

        model.fit(ds, epochs=1, verbose=0, callbacks=[Record()])
        out[policy] = {"weights": weights(model), "scales": scales, "iterations": iterations,
                       "finite": bool(all(np.isfinite(w).all() for w in model.get_weights()))}
    keras.mixed_precision.set_dtype_policy("float32")
    if isinstance(strategy, tf_smb.SMBStrategy) and strategy.size > 1:
        # Which steps' local shards held a non-finite value, seen by this rank.
        local = []
        for step, (xb, _) in enumerate(strategy.experimental_distribute_dataset(ds)):
            xb = strategy.experimental_local_results(xb)[0]
            if not np.isfinite(xb.numpy()).all():
                local.append(step)
        out["nonfinite_local_steps"] = local
    return out


def scenario_async_api(strategy, a):
    """Async mode: reduce/gather in a custom loop fail clearly; Keras' fit,
    evaluate and predict still work."""
    errors = {}

    def per_worker():
        return strategy.run(lambda: tf.constant([1.0, 2.0]) * float(strategy.rank + 1))

    calls = {
        "reduce": lambda: strategy.reduce("SUM", per_worker(), axis=None),
        "reduce_axis": lambda: strategy.reduce("MEAN", per_worker(), axis=0),
        "gather": lambda: strategy.gather(per_worker(), axis=0),
        "reduce_in_function": tf.function(
            lambda: strategy.reduce("SUM", per_worker(), axis=None)),
    }
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    x, y = data(64)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    hist = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=2, verbose=0)
    ev = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    pred = model.predict(x, batch_size=16, verbose=0)
    return {"errors": errors, "loss": hist.history["loss"], "eval": ev,
            "pred_shape": list(pred.shape)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("scenario", help="one scenario, or several separated by commas")
    p.add_argument("--strategy", default="smb", choices=["smb", "horovod", "plain", "mirrored"])
    p.add_argument("--mode", default="sync")
    p.add_argument("--gradient_clipping", default="after_sum")
    p.add_argument("--devices", type=int, default=2, help="logical CPUs for --strategy mirrored")
    p.add_argument("--global_batch", type=int, default=16)
    p.add_argument("--variants", default=",".join(CLIPS),
                   help="clip: which optimizer settings of CLIPS to train with")
    p.add_argument("--workers", type=int, default=2, help="workers the data is laid out for")
    p.add_argument("--bad_step", type=int, default=1)
    p.add_argument("--bad_rank", type=int, default=1)
    p.add_argument("--result_dir", default=None,
                   help="also write the result to RESULT_DIR/rank<r>.json")
    a = p.parse_args()
    keras.utils.set_random_seed(1234)
    if a.strategy == "mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * a.devices)
    timeout = float(os.environ.get("TEST_TIMEOUT", "60"))
    if a.strategy == "horovod":
        strategy = tf_smb.HorovodStrategy(gradient_clipping=a.gradient_clipping)
    elif a.strategy == "smb":
        strategy = tf_smb.SMBStrategy(mode=a.mode, gradient_clipping=a.gradient_clipping,
                                      timeout_s=timeout)
    else:
        # A one-worker SMBStrategy installs tf_smb's Keras hooks in this
        # process: they must leave every other strategy's optimizers alone.
        tf_smb.SMBStrategy()
        strategy = (tf.distribute.get_strategy() if a.strategy == "plain" else
                    tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(a.devices)]))
    result = {}
    for scenario in a.scenario.split(","):  # several scenarios share one process start
        result.update(globals()["scenario_" + scenario](strategy, a))
    result["rank"] = getattr(strategy, "rank", 0)
    result["size"] = getattr(strategy, "size", strategy.num_replicas_in_sync)
    report(result, a.result_dir)


if __name__ == "__main__":
    sys.exit(main())
