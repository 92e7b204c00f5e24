"""Horovod's Keras callbacks for Keras 3: broadcast the initial state, average
the metrics, warm up and schedule the learning rate, keep the best model."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Union

import keras
import numpy as np
import tensorflow as tf

import tf_smb.horovod as hvd


def _broadcast_model_state(model: keras.Model, root_rank: int,
                           local_variables: Sequence[Any] = ()) -> None:
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and optimizer.built:
        variables += list(optimizer.variables)
    local = {id(v) for v in local_variables}
    variables = [v for v in variables if id(v) not in local]
    if variables:
        hvd.broadcast_variables(variables, root_rank)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Makes every rank start from rank `root_rank`'s model (and optimizer)
    state: at the start of training when the model is built (so the first
    step already agrees), else after the first batch, when Keras has built it.
    `local_variables` keep each rank's own values."""

    def __init__(self, root_rank: int, device: str = "",
                 local_variables: Optional[Sequence[Any]] = None) -> None:
        super().__init__()
        del device
        self.root_rank = int(root_rank)
        self.local_variables = list(local_variables or [])
        self.broadcast_done = False

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.model.built and not self.broadcast_done:
            _broadcast_model_state(self.model, self.root_rank, self.local_variables)
            self.broadcast_done = True

    def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if not self.broadcast_done:
            _broadcast_model_state(self.model, self.root_rank, self.local_variables)
            self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Replaces each epoch's metrics (the `logs` other callbacks and the
    History see) by their average over ranks. Put it before callbacks that
    read the metrics (checkpoints, early stopping, schedules)."""

    def __init__(self, device: str = "") -> None:
        super().__init__()
        del device

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if not logs or hvd.size() == 1:
            return
        names = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        values = tf.constant([float(logs[k]) for k in names], tf.float64)
        averaged = hvd.allreduce(values, op=hvd.Average).numpy()
        for name, value in zip(names, averaged):
            logs[name] = float(value)


def _set_learning_rate(optimizer: Any, value: float) -> None:
    if isinstance(optimizer.learning_rate, keras.optimizers.schedules.LearningRateSchedule):
        raise ValueError("the learning-rate callbacks need a constant learning rate, not a "
                         "LearningRateSchedule")
    optimizer.learning_rate = value


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to `initial_lr * multiplier` from `start_epoch`
    until `end_epoch` (exclusive); `multiplier` is a number or a function of
    the epoch (fractional, per batch, unless `staircase`). Momentum correction
    (Horovod's scaling of SGD momentum when the rate changes) is not applied:
    a Keras 3 optimizer's momentum is a constant of its compiled step."""

    def __init__(self, initial_lr: float, multiplier: Union[float, Callable[[float], float]],
                 start_epoch: int = 0, end_epoch: Optional[int] = None,
                 staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None) -> None:
        super().__init__()
        del momentum_correction
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0

    def _active(self, epoch: float) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _adjust(self, epoch: float) -> None:
        if self._active(epoch):
            _set_learning_rate(self.model.optimizer,
                               self.initial_lr * float(self.multiplier(epoch)))

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self.params.get("steps")
            if not self.steps_per_epoch:
                raise ValueError("LearningRateScheduleCallback(staircase=False) needs "
                                 "steps_per_epoch: fit could not tell it")

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.current_epoch = epoch
        if self.staircase:
            self._adjust(epoch)

    def on_train_batch_begin(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if not self.staircase:
            self._adjust(self.current_epoch + batch / float(self.steps_per_epoch))

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if logs is not None:
            logs["lr"] = float(np.asarray(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Raises the learning rate from `initial_lr / size` to `initial_lr` over
    `warmup_epochs` (per batch), as in Goyal et al.'s large-batch recipe."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None,
                 verbose: int = 0) -> None:
        size = hvd.size()

        def multiplier(epoch: float) -> float:
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and hvd.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{float(np.asarray(self.model.optimizer.learning_rate)):g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """ModelCheckpoint keeping only the best model (by `monitor`), written by
    rank 0 only."""

    def __init__(self, filepath: str, monitor: str = "val_loss", verbose: int = 0,
                 mode: str = "auto", save_freq: Union[str, int] = "epoch") -> None:
        super().__init__(filepath=filepath, monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=False, mode=mode,
                         save_freq=save_freq)

    def _save_model(self, *args: Any, **kwargs: Any) -> None:
        if hvd.rank() == 0:
            super()._save_model(*args, **kwargs)
