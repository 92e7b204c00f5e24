"""Horovod's Keras elastic state, without elastic training (see
tf_smb.horovod.elastic): `KerasState` snapshots a model, its optimizer and
plain attributes, restores them, and synchronises them from rank 0."""
from __future__ import annotations

from typing import Any, Optional

import keras

from tf_smb.horovod.elastic import TensorFlowState, run  # noqa: F401


class KerasState(TensorFlowState):
    """The model's and the optimizer's variables, and attributes (e.g. epoch)."""

    def __init__(self, model: keras.Model, optimizer: Optional[Any] = None,
                 backup: bool = True, **kwargs: Any) -> None:
        del backup
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        variables = list(model.variables)
        if self.optimizer is not None and self.optimizer.built:
            variables += list(self.optimizer.variables)
        super().__init__(variables, **kwargs)


def __getattr__(name: str) -> Any:
    from tf_smb.horovod import elastic  # pylint: disable=import-outside-toplevel
    return getattr(elastic, name)
