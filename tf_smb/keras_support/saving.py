"""Rank 0 alone writes the files of models trained by several workers.

Every worker of a multi-worker tf_smb strategy holds the same weights (sync),
or its own recent view of the box's (async), and usually runs the same script:
if all of them wrote `model.save(path)` or a ModelCheckpoint file at once, the
file could be torn. For models created under such a strategy, workers other
than rank 0 skip `model.save`, `keras.saving.save_model`, `model.save_weights`
and `model.export` (and so ModelCheckpoint's and TensorBoard's writes) and say
so once in the log. Loading is untouched: every worker may load.

Every other model, on every rank, saves as Keras does. Saving does not wait
for the other workers: before loading on rank > 0 what rank 0 just wrote,
call `strategy.barrier()` on every worker.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable

from tf_smb.keras_support import _owner
from tf_smb import keras_registry as registry

_HOOKED = False
_told = threading.Event()


def is_skipped_writer(model: Any) -> bool:
    """True when `model` belongs to a multi-worker tf_smb strategy and this
    worker is not rank 0, i.e. its model files are rank 0's to write."""
    strategy = _owner.multi_worker_strategy(model)
    return strategy is not None and strategy.rank != 0


def _tell_once(model: Any, what: str) -> None:
    if _told.is_set():
        return
    _told.set()
    from absl import logging  # pylint: disable=import-outside-toplevel
    strategy = _owner.multi_worker_strategy(model)
    logging.warning(
        "tf_smb: rank %d of %d writes no model files (%s and the like); rank 0 "
        "writes them for all workers", strategy.rank, strategy.size, what)


def _rank0_writes(method: Callable[..., Any], what: str) -> Callable[..., Any]:
    @functools.wraps(method)
    def hook(model, *args, **kwargs):
        if is_skipped_writer(model):
            _tell_once(model, what)
            return None
        return method(model, *args, **kwargs)
    return hook


def install_saving_hooks() -> None:
    """Installs the rank-0-writes hooks (idempotent)."""
    global _HOOKED
    if _HOOKED:
        return
    _HOOKED = True
    import keras  # pylint: disable=import-outside-toplevel

    for hook in (registry.SAVE, registry.SAVE_WEIGHTS, registry.EXPORT):
        found = registry.locate(hook)
        found.replace(_rank0_writes(found.original(), f"model.{found.attribute}"))
    # The function behind model.save and its public names.
    found = registry.locate(registry.SAVE_MODEL)
    original = found.original()
    hooked = _rank0_writes(original, "keras.saving.save_model")
    found.replace(hooked)
    for module in (keras.saving, keras.models):
        if getattr(module, "save_model", None) is original:
            module.save_model = hooked


def saves_on_rank0_only(rank: int) -> None:
    """Kept for callers from before keras_support.install(); `rank` is unused
    (each hook asks the model's own strategy)."""
    del rank
    from tf_smb.keras_support.hooks import install  # pylint: disable=import-outside-toplevel
    install()
