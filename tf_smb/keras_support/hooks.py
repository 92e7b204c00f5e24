"""One call that puts every Keras hook of tf_smb in place."""
from __future__ import annotations


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
    install_fit_hooks()
    install_saving_hooks()
    install_callback_hooks()
    install_weight_hooks()
    install_timeline_hooks()  # only while TF_SMB_TIMELINE is set
