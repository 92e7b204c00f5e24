"""Rank 0 alone writes model files."""
from __future__ import annotations


def saves_on_rank0_only(rank: int) -> None:
    """Keeps workers other than rank 0 from writing model files.

    Every worker holds the same weights; if all wrote `model.save(path)` or a
    ModelCheckpoint file at once, the file could be torn. Ranks > 0 skip the
    write and return as if saved.
    """
    if rank == 0:
        return
    import keras  # pylint: disable=import-outside-toplevel

    def skip(*args, **kwargs):
        del args, kwargs

    keras.Model.save = skip
    keras.Model.save_weights = skip
    keras.callbacks.ModelCheckpoint._save_model = skip  # pylint: disable=protected-access
