"""Horovod's gradient wrappers: DistributedGradientTape,
PartialDistributedGradientTape and DistributedOptimizer (Keras 3 optimizers;
TF1 tf.compat.v1.train.Optimizer in graphs)."""
from __future__ import annotations

from typing import Any, Iterable, List, Optional, Sequence

import tensorflow as tf

import tf_smb.horovod as hvd
from tf_smb.horovod import basics


class GradientReducer:
    """How Horovod combines gradients: op (Average or Sum), compression,
    sparse_as_dense, gradient_predivide_factor (divide before the sum, multiply
    after: Average only)."""

    def __init__(self, compression: Any = None, sparse_as_dense: bool = False,
                 op: int = hvd.Average, gradient_predivide_factor: float = 1.0,
                 process_set: basics.ProcessSet = basics.global_process_set) -> None:
        if gradient_predivide_factor != 1.0 and op != hvd.Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if op == hvd.Adasum:
            raise NotImplementedError("tf_smb.horovod does not implement the Adasum "
                                      "reduction; use hvd.Average")
        basics.check_process_set(process_set)
        self.process_set = process_set
        self.compression = compression or hvd.Compression.none
        self.sparse_as_dense = sparse_as_dense
        self.op = op
        self.predivide = float(gradient_predivide_factor)

    def reduce(self, grads: Sequence[Any]) -> List[Any]:
        """Every gradient reduced over ranks, in one collective (None stays None)."""
        grads = list(grads)
        if self.process_set.size() == 1 and not basics.size_may_change():
            return grads
        present = [i for i, g in enumerate(grads) if g is not None]
        values = []
        for i in present:
            g = grads[i]
            if self.sparse_as_dense and isinstance(g, tf.IndexedSlices):
                g = tf.convert_to_tensor(g)
            values.append(g)
        reduced = hvd.grouped_allreduce(
            values, compression=self.compression, op=self.op,
            prescale_factor=1.0 / self.predivide, postscale_factor=self.predivide,
            process_set=self.process_set)
        out = list(grads)
        for i, r in zip(present, reduced):
            out[i] = r
        return out


class _DistributedGradientTape(tf.GradientTape):
    """A GradientTape whose gradients are reduced over ranks."""

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE) -> Any:
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        local = [self._is_local(s) for s in flat_sources]
        shared = self._reducer.reduce([g for g, l in zip(flat_grads, local) if not l])
        out, it = [], iter(shared)
        for g, l in zip(flat_grads, local):
            if not l:
                out.append(next(it))
            elif g is not None and self._scale_local and self._reducer.process_set.size() > 1:
                out.append(_divided(g, self._reducer.process_set.size()))
            else:
                out.append(g)
        return tf.nest.pack_sequence_as(grads, out)

    def _is_local(self, source: Any) -> bool:
        return _key(source) in self._local_sources

    def register_local_source(self, source: Any) -> None:
        """Marks `source` worker-local: its gradient is not reduced (and is
        divided by size when scale_local_gradients)."""
        self._local_sources.add(_key(source))

    def get_local_and_global_gradients(self, target: Any, sources: Sequence[Any],
                                       output_gradients: Any = None) -> Any:
        """(local (var, grad) pairs, global (var, grad) pairs)."""
        grads = self.gradient(target, sources, output_gradients)
        local = [(s, g) for s, g in zip(sources, grads) if self._is_local(s)]
        shared = [(s, g) for s, g in zip(sources, grads) if not self._is_local(s)]
        return local, shared


def _key(source: Any) -> Any:
    """A hashable identity for a variable: tf.Variable.ref(), or the object's id
    for Keras 3 variables (they have no ref())."""
    return source.ref() if hasattr(source, "ref") else id(source)


def _divided(g: Any, n: int) -> Any:
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values / n, g.indices, g.dense_shape)
    return g / tf.cast(n, g.dtype)


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",  # noqa: N802
                            device_sparse: str = "", compression: Any = None,
                            sparse_as_dense: bool = False, op: int = hvd.Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                            groups: Any = None,
                            process_set: basics.ProcessSet = basics.global_process_set,
                            scale_local_gradients: bool = True) -> tf.GradientTape:
    """`gradtape`, with its `gradient()` reducing the gradients over ranks."""
    del device_dense, device_sparse, num_groups, groups  # one fused collective always
    cls = type(type(gradtape).__name__, (_DistributedGradientTape, type(gradtape)), {})
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    tape._reducer = GradientReducer(compression, sparse_as_dense, op,  # pylint: disable=protected-access
                                    gradient_predivide_factor, process_set)
    tape._local_sources = set()  # pylint: disable=protected-access
    tape._scale_local = scale_local_gradients  # pylint: disable=protected-access
    return tape


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",  # noqa: N802
                                   device_sparse: str = "", compression: Any = None,
                                   sparse_as_dense: bool = False, op: int = hvd.Average,
                                   gradient_predivide_factor: float = 1.0,
                                   num_groups: int = 0, groups: Any = None,
                                   process_set: basics.ProcessSet = basics.global_process_set,
                                   local_layers: Optional[Iterable[Any]] = None,
                                   scale_local_gradients: bool = True) -> tf.GradientTape:
    """DistributedGradientTape whose `local_layers`' variables keep their local
    gradients (model parallelism)."""
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor,
                                   num_groups, groups, process_set, scale_local_gradients)
    if local_layers is None:
        local_layers = []
    elif not isinstance(local_layers, (list, tuple)):
        local_layers = [local_layers]
    for layer in local_layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape


def DistributedOptimizer(optimizer: Any, name: Optional[str] = None,  # noqa: N802
                         use_locking: bool = False, device_dense: str = "",
                         device_sparse: str = "", compression: Any = None,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1,
                         op: int = hvd.Average, gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None,
                         process_set: basics.ProcessSet = basics.global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """`optimizer` whose gradients are reduced over ranks before it applies
    them: a Keras 3 optimizer as tf_smb.horovod.keras.DistributedOptimizer; a
    TF1 optimizer (tf.compat.v1.train.Optimizer) reduces in compute_gradients."""
    import keras  # pylint: disable=import-outside-toplevel
    if isinstance(optimizer, keras.optimizers.Optimizer):
        from tf_smb.horovod import keras as hvd_keras  # pylint: disable=import-outside-toplevel
        return hvd_keras.DistributedOptimizer(
            optimizer, compression=compression, sparse_as_dense=sparse_as_dense,
            backward_passes_per_step=backward_passes_per_step, op=op,
            gradient_predivide_factor=gradient_predivide_factor,
            average_aggregated_gradients=average_aggregated_gradients,
            process_set=process_set)
    if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise ValueError(f"hvd.DistributedOptimizer: expected a Keras optimizer or a "
                         f"tf.compat.v1.train.Optimizer, got {type(optimizer).__name__}")
    if backward_passes_per_step != 1:
        raise NotImplementedError(
            "tf_smb.horovod: backward_passes_per_step > 1 is supported for Keras "
            "optimizers only, not for TF1 optimizers")
    reducer = GradientReducer(compression, sparse_as_dense, op, gradient_predivide_factor,
                              process_set)
    base = type(optimizer)

    class _Distributed(base):  # type: ignore[valid-type,misc]
        def compute_gradients(self, *args: Any, **kwargs: Any) -> Any:
            pairs = base.compute_gradients(self, *args, **kwargs)
            grads = reducer.reduce([g for g, _ in pairs])
            return list(zip(grads, [v for _, v in pairs]))

    _Distributed.__name__ = f"Distributed{base.__name__}"
    optimizer.__class__ = _Distributed
    return optimizer
