"""One call that puts every Keras hook of tf_smb in place."""
from __future__ import annotations

from typing import Any

from tf_smb import keras_registry as registry


def check_hooks() -> None:
    """Raises registry.KerasHookMissingError, naming the Keras version, each
    missing hook and what it provides, when the running Keras lacks any hook
    in the registry (call it before a strategy starts its job)."""
    registry.check()


def install_strategy_hooks(job: Any, elastic: bool = False) -> None:
    """What every tf_smb strategy of `job` (an env.JobInfo) needs of Keras before
    it runs: clipping after the sum and loss-scale skips decided together
    (optimizer.py), the model-build marker (fit.py), and, with 2+ workers or
    in an elastic job (whose size may grow; its fit goes through the fit hook
    also at one worker), the hooks of `install` (idempotent)."""
    # pylint: disable=import-outside-toplevel
    from tf_smb.keras_support.fit import install_build_hook
    from tf_smb.keras_support.optimizer import install_optimizer_hooks
    from tf_smb.keras_support.saving import saves_on_rank0_only
    registry.check()
    install_optimizer_hooks()
    install_build_hook()
    if job.size > 1 or elastic:
        saves_on_rank0_only(job.rank)


def install() -> None:
    """Installs the hooks for models of multi-worker tf_smb strategies:
    agreed shuffling in `fit`, async fit/evaluate/predict, rank 0 writing
    model files, async weights loaded or set outside training, TensorBoard
    and BackupAndRestore (idempotent; each hook then asks the model's own
    strategy whether to act)."""
    # pylint: disable=import-outside-toplevel
    from tf_smb.keras_support.callbacks import install_callback_hooks
    from tf_smb.keras_support.fit import install_fit_hooks
    from tf_smb.keras_support.saving import install_saving_hooks
    from tf_smb.keras_support.timeline import install_timeline_hooks
    from tf_smb.keras_support.weights import install_weight_hooks
    registry.check()
    install_fit_hooks()
    install_saving_hooks()
    install_callback_hooks()
    install_weight_hooks()
    install_timeline_hooks()  # only while TF_SMB_TIMELINE is set
