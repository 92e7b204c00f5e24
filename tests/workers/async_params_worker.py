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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("scenarios", help="scenarios separated by commas")
    p.add_argument("--read_at", default="start")
    a = p.parse_args()
    keras.utils.set_random_seed(7)
    strategy = tf_smb.SMBStrategy(mode="async", update="sgd", read_at=a.read_at,
                                  timeout_s=float(os.environ.get("TEST_TIMEOUT", "60")))
    result = {"rank": strategy.rank, "size": strategy.size}
    for scenario in a.scenarios.split(","):
        result.update(globals()["scenario_" + scenario](strategy, a))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
