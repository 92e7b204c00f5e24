"""Horovod's Keras API (`horovod.tensorflow.keras`) for Keras 3: not built yet.

tf_smb.horovod (the TensorFlow API: collectives, DistributedGradientTape,
broadcast_variables) works with Keras 3 models in custom loops. The Keras
layer — DistributedOptimizer for Keras 3 optimizers, the callbacks, load_model
— is not written yet; until it is, every name here raises NotImplementedError
saying what to use instead.
"""
from typing import Any

_MESSAGE = ("tf_smb.horovod.keras.{name} is not implemented yet. For model.fit use "
            "tf_smb.SMBStrategy (one line: `with tf_smb.SMBStrategy().scope():`); in a "
            "custom loop use tf_smb.horovod.DistributedGradientTape and "
            "tf_smb.horovod.broadcast_variables")


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise NotImplementedError(_MESSAGE.format(name=name))
