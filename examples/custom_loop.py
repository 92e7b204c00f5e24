"""Trains the digits CNN of keras_digits.py with a custom tf.distribute loop.

Shows the pieces a strategy must support beyond `model.fit`:
  * `strategy.experimental_distribute_dataset` for the training batches;
  * `strategy.run` of a replica step inside a `tf.function`, the loss scaled by
    `tf.nn.compute_average_loss(..., global_batch_size=GLOBAL)` and the
    gradients applied with a Keras optimizer (the strategy all-reduces them);
  * `strategy.reduce(SUM, ...)` for the epoch loss;
  * `strategy.distribute_datasets_from_function` for the test set: each input
    pipeline reads its own shard, and the per-replica correct/total counts are
    summed so the accuracy covers the whole test set.

Launch (two workers, one replica each):

    python -m tf_smb.run -np 2 python examples/custom_loop.py
    mpirun -np 2 python examples/custom_loop.py
    srun --ntasks=2 python examples/custom_loop.py

Single process, without tf_smb:

    python examples/custom_loop.py --strategy=default
    python examples/custom_loop.py --strategy=mirrored

`--batch_size` is the GLOBAL batch size (summed over all workers); it must
divide evenly among the replicas.
"""
from __future__ import annotations

import pathlib
import sys
from typing import Sequence

# keras_digits.py sits next to this file; import it as a plain module, before
# TensorFlow (it sets TF_ENABLE_ONEDNN_OPTS, which TensorFlow reads on import).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import keras_digits  # noqa: E402

from absl import app, flags  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

FLAGS = flags.FLAGS


def make_train_dataset(data: keras_digits.Digits, global_batch: int, seed: int) -> tf.data.Dataset:
    """Global batches in the same seeded order on every worker.

    drop_remainder keeps every step a full global batch, so each replica gets a
    non-empty share and all workers run the same number of steps.
    """
    return (tf.data.Dataset.from_tensor_slices((data.x_train, data.y_train))
            .shuffle(len(data.x_train), seed=seed, reshuffle_each_iteration=True)
            .batch(global_batch, drop_remainder=True))


def make_test_dataset_fn(data: keras_digits.Digits, global_batch: int):
    """A dataset_fn for `distribute_datasets_from_function`: one shard per input pipeline."""

    def dataset_fn(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        per_replica_batch = input_context.get_per_replica_batch_size(global_batch)
        ds = tf.data.Dataset.from_tensor_slices((data.x_test, data.y_test))
        ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return ds.batch(per_replica_batch)

    return dataset_fn


def main(argv: Sequence[str]) -> None:
    del argv  # Unused.
    keras.utils.set_random_seed(FLAGS.seed)  # Identical initial weights on every worker.
    strategy = keras_digits.make_strategy(FLAGS.strategy)
    rank = keras_digits.worker_rank(strategy)
    global_batch = FLAGS.batch_size
    if global_batch % strategy.num_replicas_in_sync:
        raise app.UsageError(f"--batch_size={global_batch} must be divisible by the "
                             f"{strategy.num_replicas_in_sync} replicas")
    data = keras_digits.load_data(FLAGS.seed)

    # All variables (weights and optimizer slots) are created inside the scope.
    with strategy.scope():
        model = keras_digits.build_network()
        model(tf.zeros((1,) + keras_digits.IMAGE_SHAPE))  # Builds the weights.
        optimizer = keras.optimizers.Adam(FLAGS.learning_rate)
        optimizer.build(model.trainable_variables)

    def train_replica_step(batch) -> tf.Tensor:
        images, labels = batch
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            per_example_loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=labels, logits=logits)
            # Scaled by the GLOBAL batch: summing over replicas gives the batch mean.
            loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))  # All-reduced (SUM).
        return loss

    @tf.function
    def train_step(batch) -> tf.Tensor:
        per_replica_loss = strategy.run(train_replica_step, args=(batch,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_loss, axis=None)

    def eval_replica_step(batch, counts: tf.Tensor) -> tf.Tensor:
        images, labels = batch

        def batch_counts() -> tf.Tensor:
            predictions = tf.argmax(model(images, training=False), axis=-1, output_type=tf.int32)
            correct = tf.reduce_sum(tf.cast(tf.equal(predictions, labels), tf.int64))
            return tf.stack([correct, tf.cast(tf.size(labels), tf.int64)])

        # A replica's share of the last batch can be empty; skip the model then
        # (see TF_ENABLE_ONEDNN_OPTS in keras_digits.py).
        return counts + tf.cond(tf.size(labels) > 0, batch_counts,
                                lambda: tf.zeros([2], tf.int64))

    @tf.function
    def zero_counts():
        return strategy.run(lambda: tf.zeros([2], tf.int64))  # Per-replica accumulators.

    @tf.function
    def eval_step(batch, counts):
        return strategy.run(eval_replica_step, args=(batch, counts))

    train_ds = strategy.experimental_distribute_dataset(
        make_train_dataset(data, global_batch, FLAGS.seed))
    for epoch in range(FLAGS.epochs):
        total_loss, steps = 0.0, 0
        for batch in train_ds:
            total_loss += float(train_step(batch))
            steps += 1
        if rank == 0:
            print(f"epoch {epoch + 1}/{FLAGS.epochs}: loss {total_loss / max(steps, 1):.4f}")

    # Shards may hold different numbers of batches, so each replica only sums
    # its own [correct, total] locally; a single cross-replica reduce follows.
    test_ds = strategy.distribute_datasets_from_function(
        make_test_dataset_fn(data, global_batch))
    counts = zero_counts()
    for batch in test_ds:
        counts = eval_step(batch, counts)
    correct, total = strategy.reduce(tf.distribute.ReduceOp.SUM, counts, axis=None).numpy()
    print(f"test accuracy: {correct / total:.4f}")


if __name__ == "__main__":
    keras_digits.define_common_flags()
    app.run(main)
