"""Horovod's Keras API (`horovod.tensorflow.keras`) for Keras 3 on tf_smb's box.

    import tf_smb.horovod.keras as hvd     # was: import horovod.tensorflow.keras as hvd
    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(...)), ...)
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])

Each process trains on its own data (shard it yourself, as with Horovod); the
DistributedOptimizer averages the gradients over processes before the update.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import keras
import tensorflow as tf

import tf_smb.horovod as _hvd
from tf_smb.horovod import Adasum, Average, Compression, Sum  # noqa: F401
from tf_smb.horovod.basics import (  # noqa: F401  (the public API)
    ProcessSet, add_process_set, ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
    global_process_set, gloo_built, gloo_enabled, init, is_homogeneous, is_initialized,
    local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank,
    remove_process_set, rocm_built, shutdown, size, start_timeline, stop_timeline)
from tf_smb.horovod.gradients import GradientReducer, _divided
from tf_smb.horovod.sync_batch_norm import SyncBatchNormalization  # noqa: F401
from tf_smb import keras_registry as registry


class _DistributedOptimizer:
    """Mixed into a Keras 3 optimizer's class: `apply` reduces the gradients
    over ranks first (every `backward_passes_per_step` calls, the local sum of
    the gradients since the last update)."""

    _hvd_reducer: GradientReducer
    _hvd_passes = 1
    _hvd_average_passes = False

    _hvd_local_ids: frozenset = frozenset()  # PartialDistributedOptimizer's local variables

    def _hvd_reduce(self, grads: List[Any], variables: List[Any]) -> List[Any]:
        """Reduced gradients; local variables' gradients stay local (divided by
        size, as Horovod's scale_local_gradients)."""
        if not self._hvd_local_ids:
            return self._hvd_reducer.reduce(grads)
        local = [id(v) in self._hvd_local_ids for v in variables]
        shared = iter(self._hvd_reducer.reduce([g for g, l in zip(grads, local) if not l]))
        every = self._hvd_reducer.process_set.size()
        return [next(shared) if not l else (None if g is None else _divided(g, every))
                for g, l in zip(grads, local)]

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:  # noqa: D102
        grads = list(grads)
        base = super()
        variables = (list(trainable_variables) if trainable_variables is not None
                     else list(registry.read(self, registry.OPTIMIZER_VARIABLES, [])))
        if self._hvd_passes == 1:
            return base.apply(self._hvd_reduce(grads, variables), trainable_variables)
        with tf.init_scope():
            if not self.built:
                self.build(variables)
            if getattr(self, "_hvd_sums", None) is None:
                self._hvd_counter = tf.Variable(0, dtype=tf.int64, trainable=False,
                                                name="hvd_aggregation_counter")
                self._hvd_sums = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False)
                                  for v in variables]
        for total, g in zip(self._hvd_sums, grads):
            if g is not None:
                total.assign_add(tf.convert_to_tensor(g))
        count = self._hvd_counter.assign_add(1)

        def update() -> tf.Tensor:
            summed = [s.read_value() for s in self._hvd_sums]
            if self._hvd_average_passes:
                summed = [s / tf.cast(self._hvd_passes, s.dtype) for s in summed]
            base.apply(self._hvd_reduce(summed, variables), variables)
            for s in self._hvd_sums:
                s.assign(tf.zeros_like(s))
            self._hvd_counter.assign(0)
            return tf.constant(True)

        if tf.executing_eagerly():
            return update() if int(count) >= self._hvd_passes else None
        return tf.cond(count >= self._hvd_passes, update, lambda: tf.constant(False))

    @property
    def aggregation_counter(self) -> Optional[tf.Variable]:
        """Local gradient sums taken since the last update (None before the first)."""
        return getattr(self, "_hvd_counter", None)


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer,  # noqa: N802
                         name: Optional[str] = None, device_dense: str = "",
                         device_sparse: str = "", compression: Any = Compression.none,
                         sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: int = Average,
                         backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> keras.optimizers.Optimizer:
    """`optimizer` (a Keras 3 optimizer, changed in place and returned) whose
    updates use the gradients averaged (op=Average) or summed (op=Sum) over
    ranks. `backward_passes_per_step` > 1 sums that many local gradients
    before one reduction and update (divided by their number with
    `average_aggregated_gradients`). `sparse_as_dense` reduces
    tf.IndexedSlices as dense tensors; `compression=Compression.fp16` sends
    float16."""
    del name, device_dense, device_sparse, num_groups, groups, scale_local_gradients
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(f"DistributedOptimizer: expected a Keras 3 optimizer, got "
                         f"{type(optimizer).__name__}")
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got "
                         f"{backward_passes_per_step}")
    base = type(optimizer)
    if issubclass(base, _DistributedOptimizer):
        raise ValueError("DistributedOptimizer: this optimizer is already distributed")
    # The class keeps the base's module and name: a saved model records a plain
    # Keras optimizer, which load_model (below) wraps again.
    cls = type(base.__name__, (_DistributedOptimizer, base), {
        "__module__": base.__module__, "__qualname__": base.__qualname__,
        "_hvd_reducer": GradientReducer(compression, sparse_as_dense, op,
                                        gradient_predivide_factor, process_set),
        "_hvd_passes": int(backward_passes_per_step),
        "_hvd_average_passes": bool(average_aggregated_gradients)})
    optimizer.__class__ = cls
    return optimizer


def PartialDistributedOptimizer(optimizer: keras.optimizers.Optimizer,  # noqa: N802
                                local_layers: Optional[Any] = None,
                                **kwargs: Any) -> keras.optimizers.Optimizer:
    """DistributedOptimizer whose `local_layers`' variables keep their local
    gradients (divided by size), for model parallelism."""
    optimizer = DistributedOptimizer(optimizer, **kwargs)
    layers = [] if local_layers is None else (
        list(local_layers) if isinstance(local_layers, (list, tuple)) else [local_layers])
    type(optimizer)._hvd_local_ids = frozenset(  # pylint: disable=protected-access
        id(v) for layer in layers for v in layer.trainable_weights)
    return optimizer


def broadcast_global_variables(root_rank: int) -> Any:
    """Graph mode only (TF1), as Horovod; eagerly use BroadcastGlobalVariablesCallback
    or tf_smb.horovod.broadcast_variables."""
    return _hvd.broadcast_global_variables(root_rank)


def allreduce(value: Any, name: Optional[str] = None, average: Optional[bool] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              op: Optional[int] = None, compression: Any = Compression.none) -> tf.Tensor:
    """`value` (a tensor or array) reduced over ranks (default: averaged)."""
    return _hvd.allreduce(tf.constant(value), average=average, op=op,
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                          compression=compression)


def allgather(value: Any, name: Optional[str] = None) -> tf.Tensor:
    """`value` concatenated over ranks along its first dimension."""
    return _hvd.allgather(tf.constant(value))


def broadcast(value: Any, root_rank: int, name: Optional[str] = None) -> tf.Tensor:
    """Rank `root_rank`'s `value`, on every rank."""
    return _hvd.broadcast(tf.constant(value), root_rank)


def reducescatter(value: Any, name: Optional[str] = None, op: int = Average) -> tf.Tensor:
    """`value` reduced over ranks; this rank's share of the first dimension."""
    return _hvd.reducescatter(tf.constant(value), op=op)


def load_model(filepath: str, custom_optimizers: Optional[List[type]] = None,
               custom_objects: Optional[Dict[str, Any]] = None,
               compression: Any = Compression.none) -> keras.Model:
    """keras.models.load_model, with the restored optimizer made a
    DistributedOptimizer (as when the model was trained)."""
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects[cls.__name__] = cls
    model = keras.models.load_model(filepath, custom_objects=objects)
    if getattr(model, "optimizer", None) is not None and not isinstance(
            model.optimizer, _DistributedOptimizer):
        DistributedOptimizer(model.optimizer, compression=compression)
    return model


from tf_smb.horovod.keras import callbacks  # noqa: E402,F401
from tf_smb.horovod.keras import elastic  # noqa: E402,F401
