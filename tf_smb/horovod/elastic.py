"""Horovod's elastic state objects, without the elastic driver.

`TensorFlowState` (and its `sync`, `commit`, `restore`, `save`) works as in
Horovod: a snapshot of variables and attributes, synchronised from rank 0.
What tf_smb does not provide is elastic *training* (`hvd.elastic.run`,
hosts joining or leaving a running job): a tf_smb job is fail-stop, so it is
restarted and resumes from a checkpoint — `keras.callbacks.BackupAndRestore`
for `fit`, tf.train.CheckpointManager in a custom loop. Using `run` (or any
other elastic name) raises NotImplementedError saying so.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import tensorflow as tf

_MESSAGE = ("tf_smb.horovod has no elastic training (hvd.elastic.{name}): a tf_smb job is "
            "fail-stop. Restart the job and resume with keras.callbacks.BackupAndRestore "
            "(or tf.train.CheckpointManager in a custom loop)")


class TensorFlowState:
    """Variables and plain attributes (e.g. epoch, batch) that can be saved,
    restored and synchronised from rank 0 (eager execution)."""

    def __init__(self, variables: Optional[Sequence[tf.Variable]] = None,
                 session: Any = None, **kwargs: Any) -> None:
        if not tf.executing_eagerly():
            raise NotImplementedError("tf_smb.horovod.elastic.TensorFlowState needs eager "
                                      "execution")
        del session
        self.variables: List[tf.Variable] = list(variables or [])
        self._attributes = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        self._saved_values: List[Any] = []
        self._saved_attributes: Dict[str, Any] = {}
        self.save()

    def save(self) -> None:
        """Snapshots the variables and attributes."""
        self._saved_values = [v.numpy() for v in self.variables]
        self._saved_attributes = {name: getattr(self, name) for name in self._attributes}

    def restore(self) -> None:
        """Puts back the last snapshot."""
        for v, value in zip(self.variables, self._saved_values):
            v.assign(value)
        for name, value in self._saved_attributes.items():
            setattr(self, name, value)

    def commit(self) -> None:
        """Snapshots the state (Horovod also checks for host changes: there are none)."""
        self.save()

    def check_host_updates(self) -> None:
        """Hosts never change in a tf_smb job: nothing to check."""

    def sync(self) -> None:
        """Makes every rank's variables and attributes rank 0's, then snapshots."""
        import tf_smb.horovod as hvd  # pylint: disable=import-outside-toplevel
        if self.variables:
            hvd.broadcast_variables(self.variables, root_rank=0)
        values = hvd.broadcast_object(
            {name: getattr(self, name) for name in self._attributes}, root_rank=0)
        for name, value in values.items():
            setattr(self, name, value)
        self.save()


def run(func: Any) -> Any:
    """Not available: raises NotImplementedError (see the module's docstring)."""
    raise NotImplementedError(_MESSAGE.format(name="run"))


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise NotImplementedError(_MESSAGE.format(name=name))
