"""One worker of SMBStrategy(mode="async", update="sgd") scenarios about box
parameters: how they are named, what happens when workers create different
variables, which variable updates the box applies as SGD steps. Prints one
JSON line. Run 2 workers with TF_SMB_RANK/TF_SMB_SIZE set.
"""
import argparse
import json
import os
import sys

import tensorflow as tf
import keras

import tf_smb


def _box_value(strategy, variable):
    """The box's current value of a box-held variable."""
    from tf_smb import ops as smb_ops
    param = strategy.extended._box_segments[variable.ref()]  # pylint: disable=protected-access
    return smb_ops.segment_read(param.name, param.dtype, param.shape).numpy()


def scenario_order(strategy, a):
    """Rank 0 creates 'a' then 'b', the others 'b' then 'a': same shape and
    dtype, different initial values (a: ones, b: twos)."""
    order = ["a", "b"] if strategy.rank == 0 else ["b", "a"]
    initial = {"a": 1.0, "b": 2.0}
    created, error = {}, None
    try:
        with strategy.scope():
            for name in order:
                created[name] = tf.Variable(tf.fill([2, 2], initial[name]), name=name)
    except ValueError as e:
        error = str(e)
    # Without the check, a worker's variable would silently take another's value.
    values = {k: float(v.numpy()[0, 0]) for k, v in created.items()}
    return {"order_error": error, "order_values": values}


def scenario_sgd_args(strategy, a):
    """Direct extended.update calls on a box-held variable; each step between
    barriers so that the box's value is known (2 workers push each step)."""
    out = {}
    with strategy.scope():
        v = tf.Variable(tf.ones([3]), name="sgd_args_v")
    average = tf.Variable(tf.fill([3], 3.0))  # outside the scope: not in the box
    ext = strategy.extended
    try:  # a gradient without a learning rate (as tf_keras passes it)
        ext.update(v, lambda var, g: var.assign_sub(g), args=(tf.ones([3]),))
        out["one_tensor_error"] = None
    except ValueError as e:
        out["one_tensor_error"] = str(e)
    strategy.barrier()
    out["after_error"] = _box_value(strategy, v).tolist()            # still 1
    strategy.barrier()
    ext.update(v, lambda var: var.assign(var * 0.5))                  # weight decay: delta
    strategy.barrier()
    out["after_no_args"] = _box_value(strategy, v).tolist()          # 1 - 2*0.5 = 0
    strategy.barrier()
    ext.update(v, lambda var, g, lr: var.assign_sub(lr * g),
               args=(tf.ones([3]), tf.constant(0.1)))                 # the box's SGD step
    strategy.barrier()
    out["after_sgd"] = _box_value(strategy, v).tolist()              # 0 - 2*0.1
    strategy.barrier()
    ext.update(v, lambda var, avg: var.assign(avg), args=(average,))  # EMA overwrite: delta
    strategy.barrier()
    out["after_variable_arg"] = _box_value(strategy, v).tolist()     # -0.2 + 2*(3-0.5)
    strategy.barrier()

    # In a tf.function the engine leaves ordering to TF's automatic control
    # dependencies: the snapshot before the in-place update, the push's read
    # after it, and a step's reads after the box's values are assigned.
    @tf.function
    def decay_in_function():
        ext.update(v, lambda var: var.assign_sub(var * 0.25))         # local 3 -> 2.25

    decay_in_function()
    strategy.barrier()
    out["after_function_update"] = _box_value(strategy, v).tolist()  # 4.8 - 2*0.75
    strategy.barrier()
    v.assign(tf.zeros([3]))  # this worker's copy only

    # A training step reads the box at its start, or (read_at="push") at its
    # end for the next step, after the step's own ops.
    @tf.function
    def value_in_step():
        return strategy.run(lambda: v.read_value() + 0.0)

    out["read_in_step"] = value_in_step().numpy().tolist()
    out["after_step"] = v.numpy().tolist()
    strategy.barrier()
    return out


class _Sub(keras.Model):
    def __init__(self):
        super().__init__(name="sub")
        self.first = keras.layers.Dense(2)
        self.second = keras.layers.Dense(2)

    def call(self, x):
        return self.second(self.first(x))


def scenario_names(strategy, a):
    """Segment names of Keras models (sequential, subclassed), of plain
    variables with one name, and of a very long name."""
    with strategy.scope():
        seq = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="hidden"),
                                keras.layers.Dense(2, name="out")], name="seq")
        sub = _Sub()
        sub(tf.zeros([1, 3]))
        dup = [tf.Variable(tf.zeros([1]), name="dup") for _ in range(2)]
        long = tf.Variable(tf.zeros([1]), name="layer_" * 30 + "kernel")
    params = strategy.extended._box_segments  # pylint: disable=protected-access

    def names(variables):
        return [params[(v.value if isinstance(v, keras.Variable) else v).ref()].name
                for v in variables]

    return {"keras": [[v.path, n] for model in (seq, sub)
                      for v, n in zip(model.trainable_variables, names(model.trainable_variables))],
            "dup": names(dup), "long": names([long])[0]}


def scenario_loads(strategy, a):
    """Weights set outside training reach the box (rank 0's, between
    barriers): Model.set_weights, a layer's set_weights, Model.load_weights
    and keras.saving.load_model under the scope; then a fit at learning
    rate 0 keeps the loaded weights."""
    import tempfile
    directory = tempfile.mkdtemp(prefix=f"loads{strategy.rank}_")

    def make(name):
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="d")], name=name)

    def plain_file(value, suffix):
        # Written by a model of no strategy: each worker its own file.
        plain = make("plain")
        plain.set_weights([w * 0 + value for w in plain.get_weights()])
        path = os.path.join(directory, "w" + suffix)
        if suffix == ".keras":
            plain.save(path)
        else:
            plain.save_weights(path)
        return path

    def box(model):
        # The placed tf.Variable: with local replicas inside an AggregatingVariable.
        placed = [getattr(v._value, "get", lambda v=v: v._value)()  # pylint: disable=protected-access
                  for v in model.trainable_variables]
        return [float(_box_value(strategy, v).flat[0]) for v in placed]

    with strategy.scope():
        model = make("loaded")
    result = {"loads_initial": box(model)}
    model.set_weights([w * 0 + 1.5 for w in model.get_weights()])
    result["after_set_weights"] = box(model)
    layer = model.get_layer("d")
    layer.set_weights([w * 0 + 4.5 for w in layer.get_weights()])
    result["after_layer_set_weights"] = box(model)
    model.load_weights(plain_file(2.5, ".weights.h5"))
    result["after_load_weights"] = box(model)
    saved = plain_file(3.5, ".keras")
    with strategy.scope():
        loaded = keras.models.load_model(saved)
    result["after_load_model"] = box(loaded)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.0), loss="mse")
    x = tf.ones([16, 3])
    # A callback's set_weights inside an async fit stays local (no barrier):
    # here rank 0 alone calls it, which would wait forever for the others.
    same = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: strategy.rank == 0 and model.set_weights(
            model.get_weights()))
    model.fit(x, tf.zeros([16, 2]), batch_size=4, epochs=1, verbose=0, callbacks=[same])
    result["after_fit"] = [float(v.numpy().flat[0]) for v in model.trainable_variables]
    return result


def scenario_evaluating(strategy, a):
    """A custom loop's evaluation, marked with tf_smb.evaluating(): its steps are
    no training steps, and a dataset distributed in it gives this worker all the
    data; outside it a worker trains on every size-th batch."""
    engine = strategy.extended.async_engine
    data = tf.data.Dataset.range(8).batch(2)  # 4 batches
    before = int(engine.steps.numpy())
    with tf_smb.evaluating():
        eval_batches = sum(1 for _ in strategy.experimental_distribute_dataset(data))
        strategy.run(lambda: tf.constant(1.0))
    during = int(engine.steps.numpy())
    train_batches = sum(1 for _ in strategy.experimental_distribute_dataset(data))
    strategy.run(lambda: tf.constant(1.0))
    return {"eval_batches": eval_batches, "eval_steps": during - before,
            "train_batches": train_batches, "train_steps": int(engine.steps.numpy()) - during}


def scenario_no_batch(strategy, a):
    """`fit` on 16 rows with batch 32 (arrays, then a tf.data dataset): one
    batch, which rank 0 trains on; the others get none. Every worker finishes
    fit, evaluate and predict, and ends with the box's values."""
    x = tf.reshape(tf.range(16 * 3, dtype=tf.float32), [16, 3]) / 48.0
    y = tf.reduce_sum(x, axis=1, keepdims=True)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    out = {}
    for kind, data in (("arrays", (x.numpy(), y.numpy())),
                       ("dataset", (tf.data.Dataset.from_tensor_slices((x, y)).batch(32),))):
        kwargs = {"batch_size": 32} if kind == "arrays" else {}
        # No barrier before fit: an async fit waits at its end for every worker
        # to finish the same fit, also one that has not started it yet.
        history = model.fit(*data, epochs=2, verbose=0, shuffle=False, **kwargs)
        kernel = model.layers[0].kernel
        out[kind] = {
            "epochs": len(history.history.get("loss", [])),
            "steps": int(model.optimizer.iterations.numpy()),
            "kernel": kernel.numpy().ravel().tolist(),
            "box_kernel": _box_value(strategy, kernel.value if hasattr(kernel, "value")
                                     else kernel).ravel().tolist(),
        }
        strategy.barrier()  # no worker trains the next fit before all have read
        out[kind]["evaluated"] = float(model.evaluate(*data, verbose=0, **kwargs))
        out[kind]["predicted_rows"] = int(model.predict(data[0], verbose=0, **kwargs).shape[0])
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("scenarios", help="scenarios separated by commas")
    p.add_argument("--read_at", default="start")
    p.add_argument("--local_replicas", type=int, default=1)
    a = p.parse_args()
    keras.utils.set_random_seed(7)
    strategy = tf_smb.SMBStrategy(mode="async", update="sgd", read_at=a.read_at,
                                  local_replicas=a.local_replicas,
                                  timeout_s=float(os.environ.get("TEST_TIMEOUT", "60")))
    result = {"rank": strategy.rank, "size": strategy.size}
    for scenario in a.scenarios.split(","):
        result.update(globals()["scenario_" + scenario](strategy, a))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
