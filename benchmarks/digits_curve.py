"""examples/keras_digits.py with rank 0's test accuracy against training time.

Runs the example unchanged (every one of its flags), and on rank 0 adds a callback
that keeps the weights and the seconds since training began at every epoch's end
(and, with `--accuracy_curve_every=N`, after every N-th of rank 0's training
batches). After training, rank 0 evaluates each copy on the test set with a plain
(strategy-free) network, so the evaluations take no training time and need no
other worker, and writes the curve as JSON to `--accuracy_curve`.
benchmarks/async_step.py (time to accuracy) runs it and plots the curves:

    python -m tf_smb.run -np 2 python -m benchmarks.digits_curve --mode=async \\
        --accuracy_curve=/tmp/curve.json --accuracy_curve_every=4

`--slow_ranks=2,3 --slow_ms=30` makes those ranks stragglers: each sleeps that long
after every training batch (benchmarks/straggler.py).

Run from the checkout's root.
"""
from __future__ import annotations

import json
import pathlib
import sys
import time
from typing import List, Sequence

# keras_digits sets TF_ENABLE_ONEDNN_OPTS, which TensorFlow reads on import: first.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import keras_digits  # noqa: E402

from absl import app, flags  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

FLAGS = flags.FLAGS


class AccuracyCurve(keras.callbacks.Callback):
    """Test accuracy against training time: keeps the weights and the seconds
    since training began at every epoch's end (and, with `every` > 0, after
    every `every`-th training batch); `write` then evaluates each copy on the
    test set with a plain (strategy-free) network, so that the evaluations
    take no training time and need no other worker. Taking a copy does take
    training time (rank 0's, counted in its seconds): `write` prints the sum."""

    def __init__(self, every: int = 0) -> None:
        super().__init__()
        self._every = every
        self._epoch = 1
        self._start = 0.0
        self._batches = 0      # training batches since training began
        self._record_s = 0.0   # time spent taking copies
        self._points: list = []  # (the curve's point without its accuracy, weights)

    def _record(self, epoch: int, epoch_end: bool) -> None:
        begin = time.perf_counter()
        point = {"epoch": epoch, "batches": self._batches, "epoch_end": epoch_end,
                 "train_s": begin - self._start}
        self._points.append((point, self.model.get_weights()))
        self._record_s += time.perf_counter() - begin

    def on_train_begin(self, logs=None) -> None:
        self._start = time.perf_counter()

    def on_epoch_begin(self, epoch, logs=None) -> None:
        self._epoch = epoch + 1

    def on_train_batch_end(self, batch, logs=None) -> None:
        self._batches += 1
        if self._every and self._batches % self._every == 0:
            self._record(self._epoch, epoch_end=False)

    def on_epoch_end(self, epoch, logs=None) -> None:
        last = self._points[-1][0] if self._points else None
        if last is not None and last["batches"] == self._batches:
            last["epoch_end"] = True  # the epoch's last batch was just taken
        else:
            self._record(epoch + 1, epoch_end=True)

    def write(self, path: str, data: keras_digits.Digits) -> None:
        """Writes [{"epoch", "batches", "epoch_end", "train_s", "test_accuracy"},
        ...] as JSON to `path` (epoch: the epoch the point was taken in, from
        1; batches: rank 0's training batches so far)."""
        with tf.distribute.get_strategy().scope():  # the default strategy: no workers
            network = keras_digits.build_network()
            network.compile(metrics=["accuracy"],
                            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        curve = []
        for point, weights in self._points:
            network.set_weights(weights)
            result = network.evaluate(data.x_test, data.y_test, verbose=0, return_dict=True)
            curve.append({**point, "test_accuracy": float(result["accuracy"])})
        pathlib.Path(path).write_text(json.dumps(curve))
        print(f"accuracy curve: {len(curve)} points, {self._record_s:.4f} s of training "
              f"time spent taking them")


class Straggler(keras.callbacks.Callback):
    """Sleeps `seconds` after every training batch: a worker slower than the others
    (a slower machine or a busier node), the same at every step."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self._seconds = seconds

    def on_train_batch_end(self, batch, logs=None) -> None:
        time.sleep(self._seconds)


def main(argv: Sequence[str]) -> None:
    curves: List[AccuracyCurve] = []
    slow_ranks = {int(r) for r in FLAGS.slow_ranks}

    def callbacks_for_rank(rank: int) -> List[keras.callbacks.Callback]:
        extra: List[keras.callbacks.Callback] = []
        if rank in slow_ranks and FLAGS.slow_ms > 0:
            extra.append(Straggler(FLAGS.slow_ms / 1e3))
        if rank == 0:
            curves.append(AccuracyCurve(FLAGS.accuracy_curve_every))
            extra.extend(curves)
        return extra

    keras_digits.main(argv, callbacks_for_rank)
    for curve in curves:
        curve.write(FLAGS.accuracy_curve, keras_digits.load_data(FLAGS.seed))


if __name__ == "__main__":
    keras_digits.define_flags()
    flags.DEFINE_string("accuracy_curve", None,
                        "Rank 0 writes here (JSON) the test accuracy of its weights at "
                        "every epoch's end and the training seconds until then.")
    flags.DEFINE_integer("accuracy_curve_every", 0,
                         "Also a point after every this many of rank 0's training "
                         "batches (0: epoch ends only).", lower_bound=0)
    flags.DEFINE_list("slow_ranks", [], "Ranks that sleep --slow_ms after every training "
                      "batch (stragglers).")
    flags.DEFINE_float("slow_ms", 0.0, "The stragglers' sleep after each batch, ms.",
                       lower_bound=0.0)
    flags.mark_flag_as_required("accuracy_curve")
    app.run(main)
