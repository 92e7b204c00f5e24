"""Trains a small CNN on scikit-learn's 8x8 digits with Keras `model.fit`.

The data is `sklearn.datasets.load_digits()` (1797 real handwritten digits that
ship with scikit-learn, so nothing is downloaded). Every worker loads the same
data, seeds the same way and builds the same model inside `strategy.scope()`;
the strategy splits each global batch among the workers and combines their
gradients.

Launch (two workers, one replica each):

    python -m tf_smb.run -np 2 python examples/keras_digits.py
    mpirun -np 2 python examples/keras_digits.py
    srun --ntasks=2 python examples/keras_digits.py

One process, three replicas as its threads sharing one copy of the parameters
(SingleCaffe's design; combine with -np for several such processes):

    python examples/keras_digits.py --local_replicas=3
    python examples/keras_digits.py --local_replicas=3 --mode=async --update=sgd

Single process, without tf_smb:

    python examples/keras_digits.py --strategy=default
    python examples/keras_digits.py --strategy=mirrored

`--batch_size` is the GLOBAL batch size (summed over all workers).
`--save_path=/tmp/digits.keras` saves the trained model, from rank 0 only.
"""
from __future__ import annotations

import os
import pathlib
import sys
from typing import Callable, List, NamedTuple, Optional, Sequence

# oneDNN's CPU Conv2D mishandles an empty batch, which a worker gets whenever a
# final partial batch has fewer examples than there are workers (e.g. -np 3).
# Must be set before TensorFlow loads; export TF_ENABLE_ONEDNN_OPTS=1 to override.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
# No TensorFlow C++ INFO banners (CPU features) on every worker; warnings stay.
# `python -m tf_smb.run` sets the same default for its workers.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402
from sklearn import datasets, model_selection  # noqa: E402

FLAGS = flags.FLAGS

STRATEGIES = ("smb", "horovod", "mirrored", "default")
NUM_CLASSES = 10
IMAGE_SHAPE = (8, 8, 1)


def define_common_flags() -> None:
    """Flags shared with examples/custom_loop.py (defined by the entry script)."""
    flags.DEFINE_enum("strategy", "smb", list(STRATEGIES),
                      "Distribution strategy: tf_smb.SMBStrategy, "
                      "tf.distribute.MirroredStrategy, or none (default).")
    flags.DEFINE_integer("local_replicas", 1,
                         "--strategy=smb: replicas per process, as threads sharing one "
                         "copy of the parameters.")
    flags.DEFINE_integer("epochs", 15, "Training epochs.")
    flags.DEFINE_integer("batch_size", 64, "GLOBAL batch size (all workers together).")
    flags.DEFINE_float("learning_rate", 0.003, "Adam learning rate.")
    flags.DEFINE_integer("seed", 0, "Seed for the split, the weights and the shuffle.")
    flags.DEFINE_enum("mode", "sync", ["sync", "async"],
                      "SMB only: gradients summed every step (sync), or parameters "
                      "in the box updated without waiting (async).")
    flags.DEFINE_integer("staleness", None,
                         "SMB async only: at most this many steps ahead of the "
                         "slowest worker (default: no bound).")
    flags.DEFINE_enum("update", "delta", ["delta", "sgd"],
                      "SMB async only: delta = the worker's Adam turns gradients "
                      "into deltas; sgd = the box applies momentum SGD itself.")
    flags.DEFINE_float("box_learning_rate", 0.05,
                       "SMB async sgd only: the box's SGD learning rate.")
    flags.DEFINE_float("momentum", None,
                       "SMB async sgd only: the box's momentum (default 0.9 with up to 2 "
                       "worker processes, else 0.5: asynchrony itself acts like momentum, "
                       "so more asynchronous processes need less of it; replica threads "
                       "of one process do not count, their reads are barely stale).")


class Digits(NamedTuple):
    x_train: np.ndarray  # (n, 8, 8, 1) float32 in [0, 1]
    y_train: np.ndarray  # (n,) int32 labels 0..9
    x_test: np.ndarray
    y_test: np.ndarray


def load_data(seed: int = 0) -> Digits:
    """Loads the digits and splits them 75/25, stratified; the same on every worker."""
    digits = datasets.load_digits()
    x = (digits.images.reshape((-1,) + IMAGE_SHAPE) / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = model_selection.train_test_split(
        x, y, test_size=0.25, random_state=seed, stratify=y)
    return Digits(x_train, y_train, x_test, y_test)


def build_network() -> keras.Model:
    """The uncompiled CNN; outputs logits. Call inside `strategy.scope()`."""
    return keras.Sequential([
        keras.Input(shape=IMAGE_SHAPE),
        keras.layers.Conv2D(32, 3, activation="relu", padding="same"),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(NUM_CLASSES),
    ], name="digits_cnn")


def build_model(learning_rate: float, optimizer: str = "adam") -> keras.Model:
    """The CNN compiled with Adam (or SGD) and sparse cross-entropy. Call inside
    `strategy.scope()`."""
    model = build_network()
    model.compile(
        optimizer=(keras.optimizers.Adam(learning_rate) if optimizer == "adam"
                   else keras.optimizers.SGD(learning_rate)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])
    return model


def _import_tf_smb():
    """Imports tf_smb; falls back to the source checkout above examples/."""
    try:
        import tf_smb
    except ImportError:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
        import tf_smb
    return tf_smb


def make_strategy(name: str) -> tf.distribute.Strategy:
    """Builds the strategy named by --strategy; tf_smb is imported only for
    "smb" and "horovod" (the reference: the same strategy with Horovod's
    collectives)."""
    if name == "smb":
        if FLAGS.mode == "async":
            # With update=sgd the box runs momentum SGD from the pushed gradient.
            return _import_tf_smb().SMBStrategy(
                mode="async", staleness=FLAGS.staleness, update=FLAGS.update,
                momentum=box_momentum() if FLAGS.update == "sgd" else 0.0,
                local_replicas=FLAGS.local_replicas)
        return _import_tf_smb().SMBStrategy(local_replicas=FLAGS.local_replicas)
    if name == "horovod":
        return _import_tf_smb().HorovodStrategy()
    if name == "mirrored":
        return tf.distribute.MirroredStrategy()
    if name == "default":
        return tf.distribute.get_strategy()
    raise ValueError(f"unknown strategy {name!r}; expected one of {STRATEGIES}")


def box_momentum() -> float:
    """--momentum, or its default for this job's number of worker processes
    (replica threads measured better at 0.9: 3 threads at 0.5 ended 0.79-0.86)."""
    if FLAGS.momentum is not None:
        return FLAGS.momentum
    from tf_smb import env  # pylint: disable=import-outside-toplevel
    return 0.9 if env.detect().size <= 2 else 0.5


def worker_rank(strategy: tf.distribute.Strategy) -> int:
    """This worker's index (0 for strategies without one: a single process)."""
    return getattr(strategy, "rank", 0)


def main(argv: Sequence[str],
         callbacks_for_rank: Optional[Callable[[int], List[keras.callbacks.Callback]]] = None
         ) -> None:
    """Trains, evaluates and (with --save_path) saves. `callbacks_for_rank(rank)`, if
    given, returns extra callbacks for this worker's `fit` (benchmarks/digits_curve.py
    adds one)."""
    del argv  # Unused.
    # Same seed everywhere before any weights exist: identical initial models.
    keras.utils.set_random_seed(FLAGS.seed)
    strategy = make_strategy(FLAGS.strategy)
    rank = worker_rank(strategy)
    data = load_data(FLAGS.seed)

    with strategy.scope():
        sgd_in_box = FLAGS.strategy == "smb" and FLAGS.mode == "async" and FLAGS.update == "sgd"
        model = build_model(FLAGS.box_learning_rate if sgd_in_box else FLAGS.learning_rate,
                            "sgd" if sgd_in_box else "adam")

    # The seeded shuffle gives every worker the same order of global batches;
    # the strategy hands each worker its part of every batch.
    train_ds = (tf.data.Dataset.from_tensor_slices((data.x_train, data.y_train))
                .shuffle(len(data.x_train), seed=FLAGS.seed, reshuffle_each_iteration=True)
                .batch(FLAGS.batch_size))
    test_ds = (tf.data.Dataset.from_tensor_slices((data.x_test, data.y_test))
               .batch(FLAGS.batch_size))

    # shuffle=False: the dataset shuffles itself (Keras would ignore, and warn).
    callbacks = callbacks_for_rank(rank) if callbacks_for_rank else None
    model.fit(train_ds, epochs=FLAGS.epochs, shuffle=False, verbose=2 if rank == 0 else 0,
              callbacks=callbacks or None)
    results = model.evaluate(test_ds, verbose=0, return_dict=True)
    print(f"test loss: {results['loss']:.4f}")
    print(f"test accuracy: {results['accuracy']:.4f}")

    if FLAGS.save_path and rank == 0:
        model.save(FLAGS.save_path)  # Keras 3 wants a .keras (or .h5) file name.
        print(f"saved model to {FLAGS.save_path}")


def define_flags() -> None:
    """This script's flags: the common ones and --save_path."""
    define_common_flags()
    flags.DEFINE_string("save_path", None,
                        "If set, rank 0 saves the trained model here (e.g. /tmp/digits.keras).")


if __name__ == "__main__":
    define_flags()
    app.run(main)
