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


def scenario_process_sets():
    """At 3 processes: set A = [0, 2] given to init, set B = [1, 2] added later
    (rank 2 in both). Each set's collectives run among its ranks only, roots
    and gathers by job rank, gradients within the set, a tape averaging over
    the set; a rank outside a set, a set never added and a disagreeing add all
    fail clearly, and the job goes on."""
    rank = hvd.rank()
    out = {}
    set_a = hvd_tf.ProcessSet([0, 2])
    hvd_tf.init(process_sets=[set_a])
    set_b = hvd_tf.add_process_set([1, 2])
    out["ids"] = [set_a.process_set_id, set_b.process_set_id]
    out["sizes"] = [int(hvd_tf.size_op(process_set_id=i)) for i in out["ids"]]
    out["included"] = [int(hvd_tf.process_set_included_op(process_set_id=i))
                       for i in out["ids"]]
    out["set_ranks"] = [set_a.rank(), set_b.rank()]
    mine = tf.constant([float(rank + 1)] * 2)

    @tf.function
    def summed_with_grad(x, process_set):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = hvd_tf.allreduce(x, op=hvd_tf.Sum, process_set=process_set)
        return y, tape.gradient(y, x)

    for name, pset in (("a", set_a), ("b", set_b)):
        if not pset.included():
            try:
                hvd_tf.allreduce(mine, process_set=pset)
                out[f"outside_{name}"] = "no error"
            except tf.errors.InvalidArgumentError as e:
                out[f"outside_{name}"] = e.message
            continue
        y, grad = summed_with_grad(mine, pset)
        out[f"sum_{name}"] = y.numpy().tolist()
        out[f"grad_{name}"] = grad.numpy().tolist()
        out[f"average_{name}"] = hvd_tf.grouped_allreduce(
            [mine, tf.constant([rank])], process_set=pset)[0].numpy().tolist()
        out[f"gather_{name}"] = hvd_tf.allgather(
            tf.fill([rank + 1], rank), process_set=pset).numpy().tolist()
        root = pset.ranks[-1]
        out[f"broadcast_{name}"] = int(hvd_tf.broadcast(
            tf.constant(rank * 10), root_rank=root, process_set=pset))
        out[f"objects_{name}"] = hvd_tf.allgather_object({"r": rank}, process_set=pset)
        hvd_tf.barrier(process_set=pset)
    # A tape over set A: gradients averaged over A's ranks only.
    if set_a.included():
        w = tf.Variable([0.0])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * float(rank + 1))
        tape = hvd_tf.DistributedGradientTape(tape, process_set=set_a)
        out["tape_a"] = tape.gradient(loss, [w])[0].numpy().tolist()
    fake = hvd_tf.ProcessSet([0])
    fake.process_set_id = 10
    try:
        hvd_tf.allreduce(mine, process_set=fake)
        out["fake"] = "no error"
    except ValueError as e:
        out["fake"] = str(e)
    try:
        hvd_tf.add_process_set([1] if rank == 1 else [0, 1])
        out["disagree"] = "no error"
    except tf.errors.FailedPreconditionError as e:
        out["disagree"] = e.message
    out["removed"] = [hvd_tf.remove_process_set(set_b), hvd_tf.remove_process_set(set_b)]
    try:
        hvd_tf.allreduce(mine, process_set=set_b)
        out["after_remove"] = "no error"
    except ValueError as e:
        out["after_remove"] = str(e)
    set_c = hvd_tf.add_process_set([0, 1])  # a new id, never an old one
    out["id_c"] = set_c.process_set_id
    if set_c.included():
        out["sum_c"] = hvd_tf.allreduce(mine, op=hvd_tf.Sum, process_set=set_c).numpy().tolist()
    out["sum_job"] = hvd_tf.allreduce(mine, op=hvd_tf.Sum).numpy().tolist()
    return out


def scenario_join():
    """At 3 processes, ranks running out of data at different times (hvd.join)."""
    rank = hvd_tf.rank()
    out = {}
    mine = tf.fill([3], float(rank + 1))
    # Eagerly: rank r runs r + 1 collectives, then joins (rank 0 first, which
    # then chooses the others' collectives from their keys).
    ops = [lambda: hvd_tf.allreduce(mine, op=hvd_tf.Sum).numpy().tolist(),
           lambda: hvd_tf.allgather(tf.fill([rank + 1], rank)).numpy().tolist(),
           lambda: [hvd_tf.barrier(),
                    hvd_tf.broadcast(tf.constant([7 * rank]), root_rank=2).numpy().tolist(),
                    hvd_tf.allreduce(mine, op=hvd_tf.Average).numpy().tolist()]]
    out["eager"] = [op() for op in ops[:rank + 1]]
    out["last_eager"] = int(hvd_tf.join())

    @tf.function
    def step():
        return hvd_tf.allreduce(mine, op=hvd_tf.Sum)

    # In a tf.function: rank r takes 3 - r steps (rank 2 joins first).
    out["graph"] = [step().numpy().tolist() for _ in range(3 - rank)]
    out["last_graph"] = int(hvd_tf.join())
    # After a join every rank counts its calls afresh: the ranks' different
    # numbers of steps above do not stop the same function pairing up again.
    out["after"] = [step().numpy().tolist(), hvd_tf.allreduce(mine, op=hvd_tf.Sum).numpy().tolist()]
    # A broadcast from a rank that joined has nothing to send: the job stops,
    # naming it, on every rank.
    try:
        if rank == 0:
            hvd_tf.join()
        else:
            hvd_tf.broadcast(tf.ones([2]), root_rank=0).numpy()
        out["root_joined"] = "no error"
    except tf.errors.OpError as e:
        out["root_joined"] = e.message
    return out


def scenario_join_nodes():
    """Across 2 nodes x 2 ranks (0, 1 on node 0; 2, 3 on node 1), hvd.join with a
    whole node joined first: node 0 (whose leader decides the job's order), then,
    in a tf.function, node 1."""
    rank = hvd_tf.rank()
    out = {}
    mine = tf.fill([3], float(rank + 1))
    big = tf.fill([100_000], float(rank + 1))  # beyond what rides on the agreement

    def big_sum():
        total = hvd_tf.allreduce(big, op=hvd_tf.Sum)
        return [float(tf.reduce_min(total)), float(tf.reduce_max(total))]

    # Eagerly: ranks 0 and 1 run 1 collective, rank 2 two, rank 3 three; so node
    # 0 has wholly joined while node 1 trains, then node 1's leader (rank 2) has
    # joined while rank 3 trains.
    ops = [lambda: hvd_tf.allreduce(mine, op=hvd_tf.Sum).numpy().tolist(),
           lambda: [hvd_tf.allgather(tf.fill([rank + 1], rank)).numpy().tolist(), big_sum()],
           lambda: [hvd_tf.barrier(),
                    hvd_tf.broadcast(tf.constant([7 * rank]), root_rank=3).numpy().tolist(),
                    hvd_tf.allreduce(mine, op=hvd_tf.Average).numpy().tolist(), big_sum()]]
    out["eager"] = [op() for op in ops[:[1, 1, 2, 3][rank]]]
    out["last_eager"] = int(hvd_tf.join())

    @tf.function
    def step():
        return hvd_tf.allreduce(mine, op=hvd_tf.Sum)

    # In a tf.function: rank r takes 4 - r steps (rank 3 joins first, then rank
    # 2: node 1 wholly joined while node 0 trains).
    out["graph"] = [step().numpy().tolist() for _ in range(4 - rank)]
    out["last_graph"] = int(hvd_tf.join())
    out["after"] = [step().numpy().tolist(), big_sum()]
    return out


def scenario_join_pair():
    """Across 2 nodes x 1 rank: each node's one rank joins first in turn."""
    rank = hvd_tf.rank()
    mine = tf.fill([2], float(rank + 1))
    big = tf.fill([100_000], float(rank + 1))
    out = {"eager": [hvd_tf.allreduce(mine, op=hvd_tf.Sum).numpy().tolist()]}
    if rank == 1:  # rank 0 has joined: its node takes part with zeros
        total = hvd_tf.allreduce(big, op=hvd_tf.Sum)
        out["eager"].append([float(tf.reduce_min(total)), float(tf.reduce_max(total)),
                             int(hvd_tf.broadcast(tf.constant(5), root_rank=1))])
    out["last_eager"] = int(hvd_tf.join())
    if rank == 0:  # now rank 1 joins first
        out["alone"] = hvd_tf.allreduce(mine, op=hvd_tf.Sum).numpy().tolist()
    out["last_alone"] = int(hvd_tf.join())
    return out


def scenario_spanning_sets_open():
    """Across 2 nodes x 2: sets spanning the nodes (ranks 0, 2 and 1, 3) sum
    within themselves and stay open: the process exits cleanly with their
    links still up (they stop first, then the job's link finalizes MPI)."""
    rank = hvd_tf.rank()
    sets = [hvd_tf.add_process_set([0, 2]), hvd_tf.add_process_set([1, 3])]
    mine = next(s for s in sets if s.included())
    return {"spanning_open_sum": hvd_tf.allreduce(
        tf.constant([float(rank)]), op=hvd_tf.Sum, process_set=mine).numpy().tolist()}


def scenario_layout():
    """On any layout of nodes: Horovod's placement queries; an all-reduce, an all-gather of rows of
    different counts, a broadcast from every rank; a process set of every
    other rank and one holding different numbers of ranks on its nodes (ranks
    0, 1 and the last), each summing within itself."""
    rank, size = hvd_tf.rank(), hvd_tf.size()
    out = {"placement": [hvd_tf.local_rank(), hvd_tf.local_size(), hvd_tf.cross_rank(),
                         hvd_tf.cross_size(), hvd_tf.is_homogeneous()]}
    out["sum"] = hvd_tf.allreduce(tf.fill([5], float(rank + 1)), op=hvd_tf.Sum).numpy().tolist()
    out["gather"] = hvd_tf.allgather(tf.fill([rank + 1, 2], rank)).numpy()[:, 0].tolist()
    out["broadcast"] = [int(hvd_tf.broadcast(tf.constant([100 + rank]), root_rank=root)[0])
                        for root in range(size)]
    evens = hvd_tf.add_process_set(list(range(0, size, 2)))
    mixed = hvd_tf.add_process_set(sorted({0, 1, size - 1}))
    out["sets"] = [hvd_tf.allreduce(tf.constant([float(rank)]), op=hvd_tf.Sum,
                                    process_set=ps).numpy().tolist()
                   if ps.included() else None for ps in (evens, mixed)]
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("scenario")
    p.add_argument("--result_dir", default=None, help="also write rank<r>.json there")
    a = p.parse_args()
    hvd.init()
    result = {}
    for scenario in a.scenario.split(","):  # several in one run: "disagree,partial"
        if scenario.startswith("fit"):
            result.update(scenario_fit(int(scenario[3:] or 1)))
        else:
            result.update({"tape": scenario_tape, "disagree": scenario_disagree,
                           "partial": scenario_partial,
                           "process_sets": scenario_process_sets,
                           "join": scenario_join,
                           "join_nodes": scenario_join_nodes,
                           "join_pair": scenario_join_pair,
                           "spanning_sets_open": scenario_spanning_sets_open,
                           "layout": scenario_layout}[scenario]())
    result.update(rank=hvd.rank(), size=hvd.size())
    report(result, a.result_dir)


if __name__ == "__main__":
    sys.exit(main())
