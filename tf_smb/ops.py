"""The SMB TensorFlow ops: loading the library and thin Python wrappers.

Every collective is called by all workers in the same order with tensors of
the same dtypes and shapes; a disagreement raises InvalidArgumentError on every
worker. Works eagerly and inside tf.function.
"""
from __future__ import annotations

import glob
import os
from typing import List, Optional, Sequence

import tensorflow as tf

from tf_smb import env as env_lib

_LIB = None
_JOB: Optional[env_lib.JobInfo] = None

# Seconds a collective waits for the other workers before failing.
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_STAGING_BYTES = 1 << 20
DEFAULT_HEAP_BYTES = 4 << 30  # sparse: only what segments use costs memory


def _library():
    global _LIB
    if _LIB is None:
        here = os.path.dirname(os.path.abspath(__file__))
        candidates = sorted(glob.glob(os.path.join(here, "_smb_ops*.so")))
        if not candidates:
            raise ImportError(
                f"tf_smb's op library is not built (no _smb_ops*.so in {here}); "
                "install with `pip install --no-build-isolation .` or run "
                "`python setup.py build_ext --inplace`")
        _LIB = tf.load_op_library(candidates[0])
    return _LIB


def _float_env(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return float(value)
    except ValueError as e:
        raise ValueError(f"{name} must be a number, got {value!r}") from e


def init(job: Optional[env_lib.JobInfo] = None, timeout_s: Optional[float] = None,
         staging_bytes: Optional[int] = None,
         heap_bytes: Optional[int] = None) -> env_lib.JobInfo:
    """Joins this process to its job's box (idempotent).

    Args:
      job: where this process sits; detected from the launcher if None.
      timeout_s: how long any collective waits for the others
        (default: $TF_SMB_TIMEOUT or 600 s).
      staging_bytes: staging buffer per worker, used when this process creates
        the box (default: $TF_SMB_STAGING_BYTES or 1 MiB).
      heap_bytes: room for all-reduce result buffers and parameter segments
        (async mode), used when this process creates the box (default:
        $TF_SMB_HEAP_BYTES or 4 GiB, sparse). Without room, sums are copied out.
    Returns:
      The job this process joined.
    """
    global _JOB
    job = job or env_lib.detect()
    if timeout_s is None:
        timeout_s = _float_env("TF_SMB_TIMEOUT", DEFAULT_TIMEOUT_S)
    if staging_bytes is None:
        staging_bytes = int(_float_env("TF_SMB_STAGING_BYTES", DEFAULT_STAGING_BYTES))
    if heap_bytes is None:
        heap_bytes = int(_float_env("TF_SMB_HEAP_BYTES", DEFAULT_HEAP_BYTES))
    with tf.init_scope():
        _library().smb_init(
            job_id=job.job_id, rank=job.rank, world=job.size,
            timeout_seconds=float(timeout_s),
            create=(job.rank == 0 and not job.box_created and job.size > 1),
            staging_bytes=int(staging_bytes), heap_bytes=int(heap_bytes))
    _JOB = job
    return job


def job() -> env_lib.JobInfo:
    """The job this process joined (joins it first if needed)."""
    return _JOB if _JOB is not None else init()


def rank() -> int:
    """This worker's index."""
    return job().rank


def size() -> int:
    """The number of workers."""
    return job().size


def allreduce(tensors: Sequence[tf.Tensor]) -> List[tf.Tensor]:
    """Sums each tensor over all workers, fused into one collective.

    Large sums (256 KiB or more in all) stay in the box: the returned tensors
    point at memory every worker reads, which TensorFlow treats as read-only
    (ops write their results elsewhere). Do not write into them through
    other frameworks (e.g. DLPack).
    """
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    return list(_library().smb_all_reduce(tensors))


def broadcast(tensors: Sequence[tf.Tensor], root: int = 0) -> List[tf.Tensor]:
    """Every worker gets worker `root`'s tensors (bool is carried as int32)."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    as_int = [t.dtype == tf.bool for t in tensors]
    sent = [tf.cast(t, tf.int32) if b else t for t, b in zip(tensors, as_int)]
    got = _library().smb_broadcast(sent, root=root)
    return [tf.cast(g, tf.bool) if b else g for g, b in zip(got, as_int)]


def barrier() -> None:
    """Returns once every worker has reached it."""
    _library().smb_barrier()


# ---- Asynchronous mode: parameters living in the box ------------------------

def param_create(value: tf.Tensor, name: str, write: bool) -> None:
    """Creates or attaches box segment `name` shaped like `value`; `write` stores it."""
    _library().smb_param_create(value, segment=name, write=write)


def param_read(name: str, dtype: tf.DType, shape: Sequence[int],
               consistent: bool = True) -> tf.Tensor:
    """The segment's current value; `consistent` never returns a half-written one."""
    return _library().smb_param_read(T=dtype, shape=list(shape), segment=name,
                                     consistent=consistent)


def param_push(delta: tf.Tensor, name: str) -> None:
    """segment += delta in the box, atomically per segment."""
    _library().smb_param_push(delta, segment=name)


def param_apply_sgd(grad: tf.Tensor, learning_rate: tf.Tensor, name: str,
                    momentum: float = 0.0) -> None:
    """The box applies an SGD (or momentum) step to the segment."""
    _library().smb_param_apply_sgd(grad, tf.cast(learning_rate, tf.float32),
                                   segment=name, momentum=float(momentum))


def clock_tick(staleness: Optional[int]) -> tf.Tensor:
    """Starts this worker's next step within the staleness bound; returns its lead."""
    return _library().smb_clock_tick(staleness=-1 if staleness is None else int(staleness))


def clock_finish(finished: bool = True) -> None:
    """Marks this worker finished training (or training again)."""
    _library().smb_clock_finish(finished=finished)


def wait_all_finished() -> None:
    """Waits until every live worker has finished training."""
    _library().smb_wait_all_finished()
