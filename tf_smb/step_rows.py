"""How many rows of the global batch each replica trains on in this step, so
that gradients of a per-replica mean loss combine as one process's mean over
the global batch.

Keras divides each replica's loss by the rows that replica got (its mean) and
by the number of replicas. When a global batch does not split evenly (a global
batch of 33 on 2 workers; an epoch's last, partial batch) the replicas' means
weigh their rows unequally, and the sum of their gradients is not the
gradient of the global batch's mean. The engines (data_parallel,
local_replicas) open `replica_step` around each synchronous replica step; a
Keras hook (keras_support/optimizer.py) marks the steps whose loss is such a
mean (`note_mean_loss`), and the gradient sum then weighs each replica's
gradient by its rows: sum_i(g_i * rows_i) * replicas / sum_i(rows_i), with
the row counts summed in the same collective as the gradients. With equal rows
that is the plain sum.

No dependencies beyond TensorFlow: every layer may import this module.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Optional

import tensorflow as tf

_state = threading.local()


class ReplicaRows:
    """The rows of this replica's batch in the step being traced.

    Attributes:
      count: the rows, a float32 scalar tensor.
      mean_loss: whether the step's loss is Keras' mean over the replica's rows
        divided by the replica count (so its gradients need weighing).
      undivided: whether the step's loss is Keras 3.3's mean over the replica's
        rows, not divided by the replica count (so its gradients average).
    """

    __slots__ = ("count", "mean_loss", "undivided")

    def __init__(self, count: tf.Tensor) -> None:
        self.count = count
        self.mean_loss = False
        self.undivided = False


def _rows_of(structure: Any) -> Optional[tf.Tensor]:
    """The leading dimension of the first batched tensor in `structure`."""
    for value in tf.nest.flatten(structure):
        if isinstance(value, tf.Tensor) and value.shape.rank is not None and value.shape.rank > 0:
            return tf.cast(tf.shape(value)[0], tf.float32)
    return None


@contextlib.contextmanager
def replica_step(args: Any, kwargs: Any) -> Iterator[None]:
    """Within it (this thread), a replica step on the batch in `args`/`kwargs`
    is traced; `current()` tells its rows (None when it has no batched tensor)."""
    count = _rows_of((args, kwargs))
    previous = getattr(_state, "rows", None)
    _state.rows = ReplicaRows(count) if count is not None else None
    try:
        yield
    finally:
        _state.rows = previous


def current() -> Optional[ReplicaRows]:
    """The rows of the replica step this thread traces, or None outside one."""
    return getattr(_state, "rows", None)


def note_undivided_mean_loss() -> None:
    """Marks the replica step being traced (if any) as one whose loss is Keras
    3.3's mean over its rows, not divided by the replica count."""
    rows = current()
    if rows is not None:
        rows.undivided = True


def note_mean_loss() -> None:
    """Marks the replica step being traced (if any) as one whose loss is a
    mean over its rows divided by the replica count (Keras' loss reduction)."""
    rows = current()
    if rows is not None:
        rows.mean_loss = True
