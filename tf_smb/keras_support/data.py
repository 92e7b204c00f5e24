"""One shuffle order for all workers when `fit` shuffles arrays.

`model.fit(x_array, y, shuffle=True)` (Keras' default) permutes the rows every
epoch with each process's own random state, and the strategy then hands each
worker its part of that order: with orders that differ between workers, rows
are trained on twice or never in an epoch. When every worker set the same
TensorFlow seed (`keras.utils.set_random_seed(s)`), Keras' own permutation is
already the same on every worker, and the one a single process draws with that
seed: it is kept, so the job trains as that process would. Otherwise, for
models of a multi-worker tf_smb strategy the permutation is a function of
(seed, epoch), the seed drawn
at the start of every `fit` and taken from rank 0, so the workers' parts
partition the data every epoch. Indexing by epoch, not by how many epochs this
process has run, also makes a job resumed by BackupAndRestore shuffle its
remaining epochs exactly as an uninterrupted job would.

Anything else (other models, `shuffle=False`, tf.data datasets, generators)
is left to Keras. A tf.data dataset the user shuffles needs a seed that every
worker shares (`dataset.shuffle(n, seed=...)` or `keras.utils.set_random_seed`).
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Iterator, Optional

from tf_smb import keras_registry as registry

_state = threading.local()
_HOOKED = False


class ShuffleOrder:
    """The seed all workers of a strategy share in one `fit`, and the epoch
    being trained.

    The seed is agreed when a shuffled array dataset first needs it (a
    broadcast from rank 0, on every worker alike: Keras builds the dataset at
    the same point of `fit` everywhere), so a `fit` on a tf.data dataset costs
    no collective. `epoch` is set by `callback()` before each epoch's iterator
    is made, which is when the dataset reads it.
    """

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy
        self._seed: Optional[int] = None
        self._keras_order: Optional[bool] = None
        self.epoch = 0

    @property
    def keras_order(self) -> bool:
        """Whether every worker set the same TensorFlow seed (e.g. with
        `keras.utils.set_random_seed`): Keras' own shuffle then draws one
        order on every worker, the order one process draws with that seed.
        Asked once, of all workers alike (two eager collectives)."""
        if self._keras_order is None:
            from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel
            from tf_smb.keras_support import _owner  # pylint: disable=import-outside-toplevel
            mine = context.global_seed()
            mine = -1 if mine is None else int(mine) % (2**62)
            first = _owner.broadcast_int(self._strategy, mine)
            differing = _owner.sum_int(self._strategy, int(mine != first))
            self._keras_order = first >= 0 and differing == 0
        return self._keras_order

    @property
    def seed(self) -> int:
        """Rank 0's draw, the same on every worker."""
        if self._seed is None:
            import tensorflow as tf  # pylint: disable=import-outside-toplevel
            from tf_smb.keras_support import _owner  # pylint: disable=import-outside-toplevel
            # Drawn by every worker (each consumes the same TF random state,
            # and a user seed makes runs repeatable); rank 0's value is used.
            drawn = int(tf.random.uniform([], 0, 2**31 - 1, dtype=tf.int64))
            self._seed = _owner.broadcast_int(self._strategy, drawn)
        return self._seed

    def callback(self) -> Any:
        """A Keras callback that tells this order which epoch starts."""
        import keras  # pylint: disable=import-outside-toplevel
        order = self

        class _EpochOfShuffle(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                order.epoch = int(epoch)

        return _EpochOfShuffle()


@contextlib.contextmanager
def agreed_shuffle(strategy: Optional[Any]) -> Iterator[Optional[ShuffleOrder]]:
    """Within it, arrays shuffled by `fit` in this thread follow one order on
    every worker of `strategy` (None: Keras' own shuffling, e.g. for a model
    of no tf_smb strategy fitted inside another's callback)."""
    order = ShuffleOrder(strategy) if strategy is not None else None
    previous = getattr(_state, "order", None)
    _state.order = order
    try:
        yield order
    finally:
        _state.order = previous


def install_data_hooks() -> None:
    """Routes Keras' array adapter through `_agreed_dataset` inside
    `agreed_shuffle` (idempotent)."""
    global _HOOKED
    if _HOOKED:
        return
    _HOOKED = True
    registry.locate(registry.ARRAY_SLICING)
    found = registry.locate(registry.ARRAY_SHUFFLE)
    original = found.original()

    @functools.wraps(original)
    def get_tf_dataset(self):
        order = getattr(_state, "order", None)
        if (order is None or not registry.read(self, registry.ARRAY_SHUFFLE_MODE)
                or order.keras_order):
            return original(self)
        return _agreed_dataset(self, order)

    found.replace(get_tf_dataset)


def _agreed_dataset(adapter: Any, order: ShuffleOrder) -> Any:
    """Keras' ArrayDataAdapter.get_tf_dataset (Keras 3.15) with the random
    permutation replaced by one seeded with (order.seed, epoch)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from keras.src import tree  # pylint: disable=import-outside-toplevel
    from keras.src.trainers.data_adapters import array_slicing  # pylint: disable=import-outside-toplevel

    try:
        shuffle, batch_size, num_samples, partial, inputs = (
            registry.read(adapter, private) for private in (
                registry.ARRAY_SHUFFLE_MODE, registry.ARRAY_BATCH_SIZE,
                registry.ARRAY_SAMPLES, registry.ARRAY_PARTIAL_BATCH, registry.ARRAY_INPUTS))
    except AttributeError as e:
        raise RuntimeError(
            "tf_smb cannot agree on a shuffle order across workers with this "
            f"Keras version ({e}); pass shuffle=False, or a tf.data dataset "
            "shuffled with a seed all workers share") from e
    full = num_samples // batch_size
    seed = tf.constant(order.seed, tf.int64)

    def epoch_now():
        # Read when the epoch's iterator computes its permutation, after the
        # epoch callback ran (Keras makes the iterator at the epoch's first step).
        return tf.reshape(tf.py_function(lambda: order.epoch, [], tf.int64), [])

    def permutation(_):
        indices = tf.range(num_samples, dtype=tf.int64)
        if shuffle != "batch":
            indices = tf.random.experimental.stateless_shuffle(
                indices, seed=tf.stack([seed, epoch_now()]))
        return indices

    def batches_of(indices):
        head = tf.reshape(indices[:full * batch_size], [full, batch_size])
        out = tf.data.Dataset.from_tensor_slices(head)
        if partial:
            out = out.concatenate(tf.data.Dataset.from_tensors(indices[full * batch_size:]))
        return out

    indices_ds = tf.data.Dataset.range(1).map(permutation).prefetch(1).flat_map(batches_of)
    if shuffle == "batch":
        # Rows are shuffled within each batch only; seeded by (epoch, batch).
        def within_batch(i, batch):
            salt = epoch_now() * (full + 1) + i
            return tf.random.experimental.stateless_shuffle(
                batch, seed=tf.stack([seed, salt + 1]))
        indices_ds = indices_ds.enumerate().map(within_batch)

    sliceable = tree.lists_to_tuples(
        array_slicing.convert_to_sliceable(inputs, target_backend="tensorflow"))

    def grab_batch(i, data):
        def grab_one(x):
            if isinstance(x, array_slicing.TensorflowSparseWrapper):
                return array_slicing.slice_tensorflow_sparse_wrapper(x, i)
            if isinstance(x, (list, tuple, dict)):
                return None
            if tf.is_tensor(x):
                return tf.gather(x, i, axis=0)
            return x
        return tree.traverse(grab_one, data)

    dataset = tf.data.Dataset.zip(
        (indices_ds, tf.data.Dataset.from_tensors(sliceable).repeat()))
    dataset = dataset.map(grab_batch, num_parallel_calls=tf.data.AUTOTUNE)
    options = tf.data.Options()
    options.experimental_optimization.apply_default_optimizations = False
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA)
    # The py_function holds no state a checkpoint of the iterator would need.
    options.experimental_external_state_policy = (
        tf.data.experimental.ExternalStatePolicy.IGNORE)
    return dataset.with_options(options).prefetch(tf.data.AUTOTUNE)
