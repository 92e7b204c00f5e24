"""HorovodStrategy: the reference. The same strategy machinery as SMBStrategy
(tf_smb/data_parallel.py) with one thing swapped: gradients are combined by
Horovod's TensorFlow ops (grouped all-reduce, broadcast) under Horovod's MPI or
Gloo controller instead of through the box. Comparisons between the two
therefore measure the collectives and nothing else.

    strategy = tf_smb.HorovodStrategy()
    $ horovodrun -np 2 --gloo python train.py      # or: mpirun -np 2 python train.py

Horovod is optional and reference-only: install it with
`bash tools/install_horovod.sh` (it builds Horovod 0.28.1 for TF 2.21).
"""
from __future__ import annotations

from typing import Any, List, Sequence

import tensorflow as tf

from tf_smb import env as env_lib
from tf_smb import keras_support
from tf_smb.collectives import Collectives
from tf_smb.options import StrategyOptions
from tf_smb.data_parallel import (DataParallelExtended, DataParallelStrategy,
                                  GradientClipping)

INSTALL_HINT = (
    "HorovodStrategy needs Horovod, an optional reference-only dependency. "
    "Install it with `bash tools/install_horovod.sh` (builds Horovod 0.28.1 "
    "against the installed TensorFlow with Gloo and Open MPI, 3-4 minutes on "
    "2 cores, cached in ~/.cache/tf_smb). SMBStrategy does not need it.")


def _import_horovod() -> Any:
    try:
        import horovod.tensorflow as hvd  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return hvd


class HorovodCollectives(Collectives):
    """Collectives through Horovod's TensorFlow ops (`hvd`: horovod.tensorflow,
    initialised)."""

    def __init__(self, hvd: Any) -> None:
        self._hvd = hvd

    def allreduce(self, tensors: Sequence[tf.Tensor]) -> List[tf.Tensor]:
        return list(self._hvd.grouped_allreduce(list(tensors), op=self._hvd.Sum))

    def broadcast(self, tensors: Sequence[tf.Tensor], root: int) -> List[tf.Tensor]:
        out = []
        for t in tensors:
            as_int = t.dtype == tf.bool
            got = self._hvd.broadcast(tf.cast(t, tf.int32) if as_int else t, root_rank=root)
            out.append(tf.cast(got, tf.bool) if as_int else got)
        return out

    def allgather(self, tensor: tf.Tensor, rank: int, size: int) -> tf.Tensor:
        # Horovod's own all-gather (first dimensions may differ), as a Horovod user's.
        del rank, size
        as_int = tensor.dtype == tf.bool
        got = self._hvd.allgather(tf.cast(tensor, tf.int32) if as_int else tensor)
        return tf.cast(got, tf.bool) if as_int else got

    def barrier(self) -> None:
        self._hvd.allreduce(tf.constant(0, tf.int32), op=self._hvd.Sum)


class HorovodStrategy(DataParallelStrategy):
    """Synchronous data parallelism with Horovod's collectives (the reference).

    Behaves like SMBStrategy(mode="sync") in every other respect: one replica
    per process, variables broadcast from rank 0, one fused all-reduce per
    step, sharded input, evaluate/predict over all workers, rank 0 saves.
    Launch with `horovodrun` (Gloo or MPI) or `mpirun`.

    Args:
      gradient_clipping: where Keras optimizers created in this scope clip
        (`clipnorm`, `clipvalue`, `global_clipnorm`), as for SMBStrategy:
        "after_sum" (default) clips the gradient summed over workers, like one
        process on the global batch; "per_worker" clips each worker's part
        before the sum, as Keras does under tf.distribute.MirroredStrategy.
    """

    def __init__(self, gradient_clipping: GradientClipping = "after_sum") -> None:
        StrategyOptions(gradient_clipping=gradient_clipping)  # checked before anything runs
        keras_support.check_hooks()  # a Keras without a hook target stops here, saying why
        hvd = _import_horovod()
        hvd.init()
        job = env_lib.JobInfo(rank=hvd.rank(), size=hvd.size(), job_id="horovod",
                              box_created=False, launcher="horovod")
        keras_support.install_strategy_hooks(job)
        self._setup(job, DataParallelExtended(self, job, HorovodCollectives(hvd)),
                    gradient_clipping)
