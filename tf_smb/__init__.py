"""tf_smb: the Soft Memory Box as a TensorFlow distribution strategy.

    import tf_smb
    strategy = tf_smb.SMBStrategy()

Launch N workers with ``python -m tf_smb.run -np N python train.py`` (or
mpirun, horovodrun, srun). See README.md.
"""
from tf_smb.env import JobInfo, detect
from tf_smb.ops import allreduce, barrier, broadcast, init, rank, size
from tf_smb.strategy import SMBStrategy

__all__ = [
    "JobInfo", "SMBStrategy", "allreduce", "barrier", "broadcast", "detect",
    "init", "rank", "size",
]
__version__ = "0.1.0"
