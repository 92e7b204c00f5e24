"""One rank of a tf_smb.horovod scenario (Horovod's API, as a Horovod user
writes it); prints one JSON result line. With no launcher variables it is the
single-process reference on the global batch.

Each rank starts from weights seeded by its own rank (so only the broadcast
makes them equal) and trains on its own slice of every global batch.
"""
import argparse
import sys

import keras
import numpy as np
import tensorflow as tf

import tf_smb.horovod.keras as hvd
import tf_smb.horovod as hvd_tf
from common import data, report

GLOBAL_BATCH = 24  # split evenly at 2 and 3 processes


def model_for(rank):
    keras.utils.set_random_seed(100 + rank)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(3)])


def my_rows(x, y):
    """This rank's slice of each global batch, in order."""
    rank, size = hvd.rank(), hvd.size()
    local = GLOBAL_BATCH // size
    keep = np.concatenate([np.arange(start + rank * local, start + (rank + 1) * local)
                           for start in range(0, len(x), GLOBAL_BATCH)])
    return x[keep], y[keep], local


def scenario_fit(passes):
    x, y, local = my_rows(*data())
    model = model_for(hvd.rank())
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(0.05),
                                         backward_passes_per_step=passes,
                                         average_aggregated_gradients=True)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    history = model.fit(x, y, batch_size=local, epochs=3, shuffle=False, verbose=0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                   hvd.callbacks.MetricAverageCallback()])
    counter = optimizer.aggregation_counter
    return {"weights": [w.tolist() for w in model.get_weights()],
            "loss": history.history["loss"],
            "counter": None if counter is None else int(counter.numpy())}


def scenario_tape():
    x, y, local = my_rows(*data())
    model = model_for(hvd.rank())
    optimizer = keras.optimizers.SGD(0.1)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    hvd_tf.broadcast_variables(model.variables, root_rank=0)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        tape = hvd_tf.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for epoch in range(2):
        for start in range(0, len(x), local):
            step(x[start:start + local], y[start:start + local])
    return {"weights": [w.tolist() for w in model.get_weights()]}


def scenario_disagree():
    """A collective whose ranks disagree fails on every rank; the next works."""
    caught = ""
    try:
        hvd_tf.allreduce(tf.ones([3 + hvd.rank()]), op=hvd_tf.Sum)
    except tf.errors.FailedPreconditionError as e:
        caught = e.message
    after = hvd_tf.allreduce(tf.ones([3]), op=hvd_tf.Sum).numpy().tolist()

    @tf.function
    def in_graph(x):
        return hvd_tf.allreduce(x, op=hvd_tf.Sum)

    caught_in_graph = ""
    try:
        in_graph(tf.ones([3 + hvd.rank()]))
    except tf.errors.FailedPreconditionError as e:
        caught_in_graph = e.message
    # The same traced function, agreed once, runs again without the check.
    after_in_graph = [in_graph(tf.ones([2])).numpy().tolist() for _ in range(3)]
    return {"caught": caught, "after": after, "caught_in_graph": caught_in_graph,
            "after_in_graph": after_in_graph}


def scenario_partial():
    """PartialDistributedOptimizer: the shared layer's gradient is averaged over
    ranks, the local layer's stays this rank's, divided by size (Horovod's
    scale_local_gradients). Both kernels start at 0; SGD(1); input rank + 1."""
    shared = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")
    local = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")
    inputs = keras.Input((1,))
    model = keras.Model(inputs, [shared(inputs), local(inputs)])
    opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=[local])
    with tf.GradientTape() as tape:
        a, b = model(tf.constant([[float(hvd.rank() + 1)]]))
        loss = tf.reduce_sum(a) + tf.reduce_sum(b)
    opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    return {"partial_shared": float(shared.kernel.numpy()[0, 0]),
            "partial_local": float(local.kernel.numpy()[0, 0])}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("scenario")
    a = p.parse_args()
    hvd.init()
    result = {}
    for scenario in a.scenario.split(","):  # several in one run: "disagree,partial"
        if scenario.startswith("fit"):
            result.update(scenario_fit(int(scenario[3:] or 1)))
        else:
            result.update({"tape": scenario_tape, "disagree": scenario_disagree,
                           "partial": scenario_partial}[scenario]())
    result.update(rank=hvd.rank(), size=hvd.size())
    report(result)


if __name__ == "__main__":
    sys.exit(main())
