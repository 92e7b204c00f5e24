"""What this thread's steps are for: training, evaluating, or building a model.

The engines (data_parallel, async_mode, local_replicas) read these flags; the
Keras glue (tf_smb/keras_support) sets them around `evaluate`, `predict` and
Keras' model build, and a custom loop sets them itself:

    with tf_smb.evaluating():          # async mode: these steps push nothing
        for x, y in test_data:         # and read every batch, not every N-th
            strategy.run(eval_step, (x, y))

No dependencies: every layer may import this module.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

_state = threading.local()


@contextlib.contextmanager
def evaluating() -> Iterator[None]:
    """Steps in this block (this thread) evaluate: an async strategy pushes no
    updates from them and its datasets give every worker all the data."""
    _state.eval_depth = getattr(_state, "eval_depth", 0) + 1
    try:
        yield
    finally:
        _state.eval_depth -= 1


def is_evaluating() -> bool:
    """Whether this thread is inside `evaluating()`."""
    return getattr(_state, "eval_depth", 0) > 0


@contextlib.contextmanager
def building_model() -> Iterator[None]:
    """Marks a model being built from a data batch: a reduction of that batch
    over replicas only tells its structure, so every worker may take its own."""
    _state.build_depth = getattr(_state, "build_depth", 0) + 1
    try:
        yield
    finally:
        _state.build_depth -= 1


def is_building_model() -> bool:
    """Whether this thread is inside `building_model()`."""
    return getattr(_state, "build_depth", 0) > 0
