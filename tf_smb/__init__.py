"""tf_smb: the Soft Memory Box as a TensorFlow distribution strategy.

    import tf_smb
    strategy = tf_smb.SMBStrategy()

Launch N workers with ``python -m tf_smb.run -np N python train.py`` (or
mpirun, horovodrun, srun). See README.md.

TensorFlow is imported on first use of a name that needs it, so the launcher
(`tf_smb.run`) and the core module (`tf_smb._box`) start fast.
"""
import importlib
from typing import Any, List

__version__ = "0.1.0"

_LAZY = {
    "SMBStrategy": "tf_smb.strategy",
    "HorovodStrategy": "tf_smb.horovod_strategy",
    "allreduce": "tf_smb.ops",
    "barrier": "tf_smb.ops",
    "broadcast": "tf_smb.ops",
    "init": "tf_smb.ops",
    "rank": "tf_smb.ops",
    "size": "tf_smb.ops",
    "JobInfo": "tf_smb.env",
    "detect": "tf_smb.env",
    "evaluating": "tf_smb.phase",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        try:
            module = importlib.import_module(_LAZY[name])
        except ModuleNotFoundError as e:
            if e.name != "tensorflow":
                raise
            raise ImportError(
                f"tf_smb.{name} needs TensorFlow, which is not installed. tf_smb "
                "works with the TensorFlow you choose and installs none itself: "
                "pip install tensorflow (or tensorflow-cpu).") from e
        return getattr(module, name)
    raise AttributeError(f"module 'tf_smb' has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted(list(globals()) + list(_LAZY))
