"""One worker of a TensorFlow/Keras scenario; prints one JSON result line.

Run with TF_SMB_RANK/TF_SMB_SIZE set (or under tf_smb.run) for N workers, or
with no launcher variables for the single-process reference.
"""
import argparse
import ctypes
import os
import sys
import time

import numpy as np
import tensorflow as tf
import keras

import tf_smb
from tf_smb import iterator_release
from common import build, data, report






def scenario_fit(strategy, a):
    x, y = data(n=a.rows)
    world = strategy.num_replicas_in_sync
    model = build(strategy)
    ds = (tf.data.Dataset.from_tensor_slices((x, y))
          .shuffle(len(x), seed=7, reshuffle_each_iteration=True)
          .batch(a.batch * world))
    hist = model.fit(ds, epochs=3, verbose=0)
    xe, ye = data(n=53, seed=1)  # 53 rows: uneven batches and shards
    ev = model.evaluate(tf.data.Dataset.from_tensor_slices((xe, ye)).batch(10),
                        verbose=0, return_dict=True)
    ev_np = model.evaluate(xe, ye, batch_size=10, verbose=0, return_dict=True)
    pred = model.predict(tf.data.Dataset.from_tensor_slices(xe).batch(8), verbose=0)
    pred_np = model.predict(xe, batch_size=8, verbose=0)
    # What this worker iterates (one device: the dataset's own iterator, not a
    # MultiDeviceIterator; see DataParallelExtended._distributed).
    workers_iterators = getattr(iter(strategy.experimental_distribute_dataset(ds)),
                                "_iterators", None)
    input_iterator = type(workers_iterators[0]._iterator).__name__ if workers_iterators else None
    # Whether tf.data autotunes what this worker iterates (tf_smb turns the
    # autotuning thread off unless the user's options say; iterator_release.py).
    from_function = getattr(iter(strategy.distribute_datasets_from_function(lambda _: ds)),
                            "_iterators", None)
    input_autotune = [its[0]._dataset.options().autotune.enabled
                      for its in (workers_iterators, from_function) if its]
    # Keras drops each epoch's input iterator: tf_smb destroys it off this thread.
    deadline = time.monotonic() + 10
    while iterator_release.RELEASER.released < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"weights": [w.tolist() for w in model.get_weights()],
            "loss": hist.history["loss"], "eval": ev, "eval_numpy": ev_np,
            "pred": pred.tolist(), "pred_numpy": pred_np.tolist(),
            "iterators_released": iterator_release.RELEASER.released,
            "input_iterator": input_iterator, "input_autotune": input_autotune}


def scenario_custom(strategy, a):
    x, y = data()
    world = strategy.num_replicas_in_sync
    global_batch = a.batch * world
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(3)])
        opt = keras.optimizers.SGD(0.1, momentum=0.9)
        opt.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="none")
    ds = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch))

    @tf.function
    def step(batch):
        def replica_fn(xb, yb):
            with tf.GradientTape() as tape:
                per_example = loss_fn(yb, model(xb, training=True))
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            # Keras 3 optimizers sum gradients over replicas themselves.
            opt.apply(grads, model.trainable_variables)
            return loss
        per_replica = strategy.run(replica_fn, args=batch)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    losses = []
    for _ in range(3):
        total = 0.0
        for batch in ds:
            total += float(step(batch))
        losses.append(total)

    def test_fn(ctx):
        xe, ye = data(n=53, seed=1)
        return (tf.data.Dataset.from_tensor_slices((xe, ye))
                .shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(5))

    @tf.function
    def count(batch):
        def replica_fn(xb, yb):
            correct = tf.reduce_sum(tf.cast(
                tf.equal(tf.argmax(model(xb), 1, output_type=tf.int32), yb), tf.int64))
            return correct, tf.cast(tf.shape(yb)[0], tf.int64)
        c, n = strategy.run(replica_fn, args=batch)
        return (strategy.reduce("SUM", c, axis=None), strategy.reduce("SUM", n, axis=None))

    correct = total = 0
    for batch in strategy.distribute_datasets_from_function(test_fn):
        c, n = count(batch)
        correct, total = correct + int(c), total + int(n)
    return {"weights": [w.tolist() for w in model.get_weights()], "loss": losses,
            "correct": correct, "total": total}


def scenario_uneven(strategy, a):
    """Shards of unequal length: fit and a custom loop must end together."""
    x, y = data(n=9)
    model = build(strategy)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(4), epochs=2, verbose=0)
    rank = tf_smb.rank()

    def dataset_fn(ctx):
        n = 5 if ctx.input_pipeline_id == 0 else 3  # batches per worker differ
        return tf.data.Dataset.from_tensor_slices(x[:n * 2]).batch(2)

    @tf.function
    def step(batch):
        return strategy.reduce("SUM", strategy.run(lambda b: tf.reduce_sum(b), args=(batch,)),
                               axis=None)

    steps = 0
    for batch in strategy.distribute_datasets_from_function(dataset_fn):
        step(batch)
        steps += 1
    return {"weights": [w.tolist() for w in model.get_weights()], "steps": steps,
            "rank": rank}


def scenario_jit(strategy, a):
    x, y = data()
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", jit_compile=True)
    try:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        return {"error": None}
    except Exception as e:  # noqa: BLE001 - the message is the result
        return {"error": f"{type(e).__name__}: {e}"}


def mismatched_allreduce(n):
    """An all-reduce of float32[n] (ranks disagree on n), then a later one: the
    errors each raised and how long the later one took."""
    out = {}
    try:
        tf_smb.allreduce([tf.ones([n])])
        out["shape_error"] = None
    except tf.errors.InvalidArgumentError as e:
        out["shape_error"] = e.message
    start = time.monotonic()
    try:
        tf_smb.allreduce([tf.ones([2])])
        out["later_error"] = None
    except tf.errors.InvalidArgumentError as e:
        out["later_error"] = e.message
    out["later_seconds"] = time.monotonic() - start
    return out


def scenario_mismatch(strategy, a):
    """Ranks disagree on a shape; then every later collective fails at once
    with that same error (the job never pairs later collectives wrongly)."""
    return mismatched_allreduce(3 + tf_smb.rank())


def _recoverable_allreduce(n):
    """An all-reduce of float32[n] whose disagreement is recoverable (Horovod's
    semantics, the `agreement` of tf_smb.ops.allreduce): its error or its sum."""
    from tf_smb import ops  # pylint: disable=import-outside-toplevel
    try:
        return ops.allreduce([tf.ones([n])], agreement=f"hvd.allreduce\nshape=[{n}]")[0].numpy().tolist()
    except tf.errors.FailedPreconditionError as e:
        return e.message


def _process_sets_per_node():
    """tf_smb.horovod's process sets across 2 nodes x 2: one per node sums its
    ranks' values; two spanning the nodes (ranks 0, 2 and 1, 3: one a node)
    run their collectives among their ranks, interleaved with the job's and
    the node sets'; one with 2 ranks on node 0 and 1 on node 1 is refused on
    every rank alike, and the job goes on."""
    import tf_smb.horovod as hvd  # pylint: disable=import-outside-toplevel
    hvd.init()
    rank = hvd.rank()
    sets = [hvd.add_process_set([0, 1]), hvd.add_process_set([2, 3])]
    mine = next(s for s in sets if s.included())
    out = {"node_set_sum": hvd.allreduce(tf.constant([float(rank + 1)]), op=hvd.Sum,
                                         process_set=mine).numpy().tolist()}
    spanning = [hvd.add_process_set([0, 2]), hvd.add_process_set([1, 3])]
    across = next(s for s in spanning if s.included())
    value = tf.constant([float(rank + 1), 10.0 * (rank + 1)])
    out["spanning_sum"] = hvd.allreduce(value, op=hvd.Sum, process_set=across).numpy().tolist()
    out["job_sum"] = hvd.allreduce(value, op=hvd.Sum).numpy().tolist()
    out["spanning_gather"] = hvd.allgather(tf.fill([rank + 1], rank),
                                           process_set=across).numpy().tolist()
    out["spanning_broadcast"] = int(hvd.broadcast(tf.constant(rank * 10),
                                                  root_rank=across.ranks[1],
                                                  process_set=across))
    out["spanning_grouped"] = [t.numpy().tolist() for t in hvd.grouped_allreduce(
        [tf.ones([3]) * rank, tf.ones([2], tf.float64) * rank], op=hvd.Average,
        process_set=across)]
    hvd.barrier(process_set=across)
    out["node_set_after"] = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum,
                                          process_set=mine).numpy().tolist()
    # A set with 2 of its ranks on node 0 and 1 on node 1.
    uneven = hvd.add_process_set([0, 1, 2])
    out["uneven_set"] = (hvd.allreduce(tf.constant([float(rank)]), op=hvd.Sum,
                                       process_set=uneven).numpy().tolist()
                         if uneven.included() else None)
    # Ranks 1 and 3 leave [1, 3] open: its link stops at exit, before the job's.
    out["removed"] = hvd.remove_process_set(spanning[0])
    return out


def scenario_mismatch_halves(strategy, a):
    """Recoverable disagreements first: the halves of the ranks (node 0 and node
    1 of two) call shapes [3] and [4]; then only the last rank calls [4]; then
    all agree. Then the plain all-reduce: the first half calls float32[3], the
    other half float32[4], which stops the job."""
    half = 2 * tf_smb.rank() // tf_smb.size()
    out = {"across_nodes": _recoverable_allreduce(3 + half),
           "on_one_node": _recoverable_allreduce(3 + (tf_smb.rank() == tf_smb.size() - 1)),
           "agreed": _recoverable_allreduce(3)}
    out.update(_process_sets_per_node())
    out.update(mismatched_allreduce(3 + half))
    return out


def scenario_mismatch_dtype(strategy, a):
    """Ranks disagree on a dtype inside a tf.function."""
    dtype = tf.float32 if tf_smb.rank() == 0 else tf.float64
    try:
        tf.function(lambda: tf_smb.allreduce([tf.ones([4], dtype)]))()
        return {"dtype_error": None}
    except tf.errors.InvalidArgumentError as e:
        return {"dtype_error": e.message}


def scenario_die(strategy, a):
    """The last rank SIGKILLs itself at its 3rd training batch."""
    x, y = data(n=4000)
    model = build(strategy)

    class Die(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 3 and tf_smb.rank() == tf_smb.size() - 1:
                os.kill(os.getpid(), 9)

    model.fit(x, y, batch_size=8, epochs=50, verbose=0, callbacks=[Die()])
    return {"finished": True}


def scenario_ops(strategy, a):
    """The TF ops for every dtype (eager and in tf.function), and variables
    broadcast from rank 0 although every worker seeds differently."""
    rank = tf_smb.rank()
    bad = []
    for dtype in (tf.float32, tf.float64, tf.float16, tf.bfloat16, tf.int8, tf.uint8,
                  tf.int16, tf.uint16, tf.int32, tf.int64):
        for n in (0, 1, 7, 4097):
            x = tf.cast(tf.range(n) % 7 + rank, dtype)
            want = sum(tf.cast(tf.range(n) % 7 + r, tf.float64) for r in range(tf_smb.size()))
            for fn in (tf_smb.allreduce, tf.function(tf_smb.allreduce)):
                got = fn([x])[0]
                if got.dtype != dtype or not np.array_equal(
                        tf.cast(got, tf.float64).numpy(), want.numpy()):
                    bad.append(f"{dtype.name}[{n}]")
        got = tf_smb.broadcast([tf.cast(tf.fill([5], rank + 1), dtype)], root=1)[0]
        if not np.array_equal(tf.cast(got, tf.float64).numpy(), np.full(5, 2.0)):
            bad.append(f"broadcast {dtype.name}")
    # Gradients, as Horovod defines them: d/dx of a sum over workers is the
    # sum of the upstream gradients; a broadcast's reaches the root only.
    size = tf_smb.size()
    v = tf.Variable([1.0, 2.0, 3.0])
    for fn in (lambda f: f(), lambda f: tf.function(f)()):
        def grads():
            with tf.GradientTape(persistent=True) as tape:
                s1 = tf.reduce_sum(tf_smb.allreduce([v * (rank + 1)])[0])
                s2 = tf.reduce_sum(tf_smb.broadcast([v * (rank + 1)], root=1)[0])
            return tape.gradient(s1, v), tape.gradient(s2, v)
        g1, g2 = fn(grads)
        if not np.allclose(g1.numpy(), size * (rank + 1)):
            bad.append(f"allreduce gradient {g1.numpy()}")
        want2 = size * (rank + 1) if rank == 1 else 0.0
        if not np.allclose(g2.numpy(), want2):
            bad.append(f"broadcast gradient {g2.numpy()}")
    keras.utils.set_random_seed(100 + rank)
    model = build(strategy)
    return {"bad": bad, "weights": [w.tolist() for w in model.get_weights()]}


def _in_box(t):
    """Whether tensor t's memory lies in this job's box (read from /proc/self/maps)."""
    # numpy() copies a tensor whose memory TensorFlow does not own; DLPack
    # hands out the tensor's own pointer (DLManagedTensor starts with it).
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    capsule = tf.experimental.dlpack.to_dlpack(t)
    address = ctypes.c_void_p.from_address(get_pointer(capsule, b"dltensor")).value
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "/tf_smb_" in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= address < hi:
                    return True
    return False


def scenario_shared_sums(strategy, a):
    """Large all-reduces whose sums stay in the box: exact for every dtype,
    read in place (the output lies in the box), kept intact while held (more
    held results than the box has result buffers fall back to copies), and
    never written in place by a later op on any rank."""
    rank, world = tf_smb.rank(), tf_smb.size()
    dtypes = (tf.float32, tf.float64, tf.float16, tf.bfloat16, tf.int32, tf.int64)
    sizes = (0, 1, 7, 70_001)  # 70,001 elements x 6 dtypes: ~1.9 MB, one fused call

    def inputs(step):
        return [tf.cast((tf.range(n) * (step + 3) + rank) % 13, d)
                for d in dtypes for n in sizes]

    def want(step):
        return [sum(((np.arange(n) * (step + 3) + r) % 13).astype(np.float64)
                    for r in range(world)) for d in dtypes for n in sizes]

    def wrong(got, expected):
        return [f"{t.dtype.name}[{t.shape[0]}]" for t, w in zip(got, expected)
                if not np.array_equal(tf.cast(t, tf.float64).numpy(), w)]

    bad, in_box = [], []
    traced = tf.function(tf_smb.allreduce)
    held = []
    for step in range(12):  # more than the box's 8 result buffers, all held
        fn = traced if step % 2 else tf_smb.allreduce
        got = fn(inputs(step))
        in_box.append(_in_box(got[-1]))
        bad += [f"step {step}: {w}" for w in wrong(got, want(step))]
        held.append(got)
    for step, got in enumerate(held):  # still intact after the later steps
        bad += [f"held {step}: {w}" for w in wrong(got, want(step))]
    del held

    # A sum of 8 MiB or more is written with streaming stores (cc/smb/copy.h).
    n = 2_500_001
    large = traced([tf.cast((tf.range(n) * 5 + rank) % 13, tf.float32)])
    in_box.append(_in_box(large[0]))
    expected = sum(((np.arange(n) * 5 + r) % 13).astype(np.float64) for r in range(world))
    if not np.array_equal(large[0].numpy().astype(np.float64), expected):
        bad.append(f"float32[{n}]")
    del large

    # Rank 0 doubles its sum in a graph where the sum has no other user: there
    # TensorFlow writes an element-wise op's output into its input's buffer
    # when it may (measured: Mul, Add and Neg do). The other ranks hold the
    # same sum meanwhile and must not see the change.
    big = [tf.fill([100_000], float(rank + 1))]
    total = world * (world + 1) / 2

    # Every rank calls the collective from the same call site (a graph's
    # collectives are matched by it); only rank 0 doubles the sum in the graph.
    @tf.function
    def sum_then_maybe_double(xs, double):
        total_sum = tf_smb.allreduce(xs)[0]
        return total_sum * 2.0 if double else total_sum

    if rank == 0:
        first_added = float(sum_then_maybe_double(big, True)[0])
        mine = None
    else:
        mine = sum_then_maybe_double(big, False)
        first_added = None
    tf_smb.barrier()
    untouched = None if mine is None else bool(np.all(mine.numpy() == total))
    tf_smb.barrier()
    return {"bad": bad, "in_box": in_box, "first_added": first_added,
            "untouched": untouched, "total": total}


def scenario_async_bad_push(strategy, a):
    """Pushing the wrong shape or dtype to a box segment fails cleanly."""
    from tf_smb import ops as smb_ops
    if tf_smb.rank() == 0:
        smb_ops.segment_create(tf.constant([[1.0, 2.0], [3.0, 4.0]]), "bad-push-test", True)
    tf_smb.barrier()
    if tf_smb.rank() != 0:
        smb_ops.segment_create(tf.zeros([2, 2]), "bad-push-test", False)
    errors = []
    for bad in (tf.ones([4]), tf.ones([2, 2], tf.float64), tf.ones([2, 3])):
        try:
            smb_ops.segment_push(bad, "bad-push-test")
            errors.append(None)
        except tf.errors.InvalidArgumentError as e:
            errors.append(e.message)
    try:
        smb_ops.segment_create(tf.zeros([3]), "bad-push-test", False)
        errors.append(None)
    except tf.errors.InvalidArgumentError as e:
        errors.append(e.message)
    tf_smb.barrier()
    value = smb_ops.segment_read("bad-push-test", tf.float32, [2, 2]).numpy().tolist()
    # Reading straight into a variable: a value read before keeps its contents;
    # a variable of another shape or dtype is refused and keeps its own.
    into = tf.Variable(tf.zeros([2, 2]))
    held = into.read_value()
    smb_ops.segments_push_read([into], ["bad-push-test"])
    read_into = {"value": into.numpy().tolist(), "held": held.numpy().tolist()}
    smb_ops.segments_push_read([into], ["bad-push-test"])  # nothing holds it now
    read_into["again"] = into.numpy().tolist()
    read_into["errors"] = []
    for bad in (tf.Variable(tf.zeros([4])), tf.Variable(tf.zeros([2, 2], tf.float64))):
        try:
            smb_ops.segments_push_read([bad], ["bad-push-test"])
            read_into["errors"].append(None)
        except tf.errors.InvalidArgumentError as e:
            read_into["errors"].append(e.message)
        read_into.setdefault("bad_values", []).append(bad.numpy().tolist())
    # A push and read in one op: rank 0 adds ones and gets the sum back; a
    # delta of another shape than its variable is refused and pushes nothing.
    push_read = {}
    tf_smb.barrier()
    if tf_smb.rank() == 0:
        try:
            smb_ops.segments_push_read([into], ["bad-push-test"], [tf.ones([4])])
            push_read["error"] = None
        except tf.errors.InvalidArgumentError as e:
            push_read["error"] = e.message
        held = into.read_value()
        smb_ops.segments_push_read([into], ["bad-push-test"], [tf.ones([2, 2])])
        push_read["value"] = into.numpy().tolist()
        push_read["held"] = held.numpy().tolist()
    tf_smb.barrier()
    push_read["box"] = smb_ops.segment_read("bad-push-test", tf.float32, [2, 2]).numpy().tolist()
    return {"errors": errors, "value": value, "read_into": read_into, "push_read": push_read}


def scenario_save(strategy, a):
    x, y = data()
    model = build(strategy)
    ckpt = os.path.join(a.out_dir, "ckpt.weights.h5")
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[
        keras.callbacks.ModelCheckpoint(ckpt, save_weights_only=True)])
    path = os.path.join(a.out_dir, "model.keras")
    model.save(path)
    model.save(os.path.join(a.out_dir, f"by_rank{tf_smb.rank()}.keras"))
    tf_smb.barrier()
    loaded = keras.models.load_model(path)
    same = all(np.array_equal(w1, w2) for w1, w2 in zip(loaded.get_weights(),
                                                        model.get_weights()))
    return {"saved_equal": same, "ckpt_exists": os.path.exists(ckpt)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("scenario")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rows", type=int, default=96,
                   help="fit's training rows (a multiple of the global batch keeps every "
                        "batch split evenly)")
    p.add_argument("--out_dir", default="/tmp")
    p.add_argument("--result_dir", default=None,
                   help="also write the result to RESULT_DIR/rank<r>.json")
    a = p.parse_args()
    keras.utils.set_random_seed(1234)
    if os.environ.get("TEST_STRATEGY") == "horovod":
        strategy = tf_smb.HorovodStrategy()
    else:
        strategy = tf_smb.SMBStrategy(
            timeout_s=float(os.environ.get("TEST_TIMEOUT", "60")),
            local_replicas=int(os.environ.get("TEST_LOCAL_REPLICAS", "1")))
    result = globals()["scenario_" + a.scenario](strategy, a)
    result["rank"] = strategy.rank
    result["size"] = strategy.size
    result["replicas"] = strategy.num_replicas_in_sync
    report(result, a.result_dir)


if __name__ == "__main__":
    sys.exit(main())
