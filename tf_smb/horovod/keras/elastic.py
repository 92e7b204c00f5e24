"""Horovod's Keras elastic API (`hvd.elastic` of horovod.tensorflow.keras):
`KerasState` and the callbacks that keep it current in `model.fit`; `run` and
the rest are tf_smb.horovod.elastic's."""
from __future__ import annotations

from typing import Any, Optional

import keras

from tf_smb.horovod.elastic import (HorovodInternalError, HostsUpdatedInterrupt,  # noqa: F401
                                    ObjectState, State, TensorFlowKerasState, run)


class KerasState(TensorFlowKerasState):
    """The model, its optimizer and attributes (e.g. epoch, batch)."""

    def __init__(self, model: keras.Model, optimizer: Optional[Any] = None,
                 backup: bool = True, **kwargs: Any) -> None:
        del backup  # Horovod's choice of copy; the commit is a copy here anyway
        super().__init__(model, optimizer, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commits `state` every `batches_per_commit` batches and at each epoch's end."""

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        # Again after every reset: all ranks count from here alike.
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps `state.batch` at the batch fit is in (0 at an epoch's end); after a
    reset the epoch runs only its remaining batches."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch: Optional[int] = None

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params.get("steps")
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps `state.epoch` at the number of epochs done, counted across resets."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = self.state.epoch

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        # + 1: a reset right after the batch count went back to 0 must not
        # repeat the epoch just done.
        self.state.epoch = self.initial_epoch + epoch + 1


def __getattr__(name: str) -> Any:
    from tf_smb.horovod import elastic  # pylint: disable=import-outside-toplevel
    return getattr(elastic, name)
