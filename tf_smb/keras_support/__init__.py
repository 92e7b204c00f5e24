"""How tf_smb plugs into Keras 3 beyond the tf.distribute.Strategy API.

Keras calls the strategy for variables, steps and reductions; a few things a
user expects from a drop-in strategy need hooks on Keras itself. They live
here, one module per concern, and each hook acts only for models (optimizers,
callbacks) that belong to a tf_smb strategy; everything else in the process
behaves exactly as without tf_smb.

  fit.py     evaluation phases, and asynchronous fit's end (wait, load the box)
  saving.py  rank 0 alone writes model files
"""
from tf_smb.keras_support.fit import in_eval_phase, install_async_hooks
from tf_smb.keras_support.saving import saves_on_rank0_only

__all__ = ["in_eval_phase", "install_async_hooks", "saves_on_rank0_only"]
