"""How tf_smb plugs into Keras 3 beyond the tf.distribute.Strategy API.

Keras calls the strategy for variables, steps and reductions; a few things a
user expects from a drop-in strategy need hooks on Keras itself. They live
here, one module per concern, and each hook acts only for models (optimizers,
callbacks) that belong to a tf_smb strategy; everything else in the process
behaves exactly as without tf_smb.

  fit.py     evaluation phases, and asynchronous fit's end (wait, load the box)
  data.py    arrays shuffled by `fit` in one order on every worker
  callbacks.py  TensorBoard and BackupAndRestore: rank 0 writes, all restore
  optimizer.py  clipping of the summed gradient; loss-scale skips decided together
  saving.py  rank 0 alone writes model files
  weights.py async: weights loaded or set outside training go into the box

tf_smb/keras_registry.py (below this package: tf_smb.horovod reads Keras' privates
through it too) lists every Keras attribute hooked, found by feature detection;
`check_hooks()` raises a clear error when the running Keras lacks one.
`install()` puts the fit, data, saving, weight and callback hooks in place (once per
process); each hook then asks the model's own strategy whether to act.
"""
from tf_smb.keras_support.fit import (building_model, in_eval_phase, install_async_hooks,
                                     install_build_hook)
from tf_smb.keras_support.optimizer import install_optimizer_hooks
from tf_smb.keras_support.saving import saves_on_rank0_only
from tf_smb.keras_support.callbacks import install_callback_hooks
from tf_smb.keras_support.fit import install_fit_hooks
from tf_smb.keras_support.hooks import check_hooks, install, install_strategy_hooks
from tf_smb.keras_registry import KerasHookMissingError
from tf_smb.keras_support.saving import install_saving_hooks
from tf_smb.keras_support._owner import note_async_strategy

__all__ = ["building_model", "install_build_hook", "in_eval_phase", "install_async_hooks", "install_optimizer_hooks",
           "saves_on_rank0_only", "install", "install_strategy_hooks", "install_fit_hooks",
           "install_saving_hooks", "install_callback_hooks", "note_async_strategy",
           "check_hooks", "KerasHookMissingError"]
