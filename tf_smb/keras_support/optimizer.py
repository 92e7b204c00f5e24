"""Hooks on Keras 3 optimizers for tf_smb strategies: clipping and loss scaling.

Keras 3's TensorFlow optimizer clips gradients (`clipnorm`, `clipvalue`,
`global_clipnorm`) in `apply()` before `_backend_update_step` sums them over
replicas, so every replica clips its own partial gradient. With
`gradient_clipping="after_sum"` (the tf_smb default) the sum moves in front of
the clipping instead: the optimizer clips the summed gradient, as one process
on the global batch does, and the sum Keras would do later is skipped, so the
gradients are summed exactly once per update. With gradient accumulation the
sum happens only in Keras' update branch, on the accumulated gradient.

`LossScaleOptimizer` (mixed precision) skips a step whose gradients are not
finite. It decides from the local, unsummed gradients, so one worker could skip
while the others apply (and their collectives then pair wrongly); the hook
makes every worker decide from one flag summed over all workers.

Every hook acts only for optimizers whose `_distribution_strategy` (the
strategy in scope when the optimizer was created) is a tf_smb strategy; any
other optimizer runs Keras' own code unchanged.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Dict, List, Optional

import tensorflow as tf

from tf_smb import step_rows
from tf_smb import keras_registry as registry

_HOOKED = False
_local = threading.local()


class _ApplyState:
    """One `_backend_apply_gradients` call of one optimizer, while it traces:
    how many gradient lists were summed before clipping and still wait for
    the all-reduce Keras does afterwards (which must then be skipped)."""

    __slots__ = ("summed",)

    def __init__(self) -> None:
        self.summed = 0


def _states() -> Dict[int, _ApplyState]:
    if not hasattr(_local, "states"):
        _local.states = {}
    return _local.states


def _tf_smb_strategy(optimizer: Any) -> Optional[Any]:
    """The optimizer's tf_smb strategy, or None for any other optimizer."""
    from tf_smb.data_parallel import DataParallelStrategy  # pylint: disable=import-outside-toplevel
    strategy = registry.read(optimizer, registry.OPTIMIZER_STRATEGY, None)
    return strategy if isinstance(strategy, DataParallelStrategy) else None


def _clips_after_sum(optimizer: Any) -> bool:
    strategy = _tf_smb_strategy(optimizer)
    # Async workers sum nothing: each clips and applies its own gradient.
    return (strategy is not None and strategy.gradient_clipping == "after_sum"
            and getattr(strategy, "mode", "sync") == "sync")


def _reduced_keeping_nones(
        grads: List[Optional[tf.Tensor]],
        reduce: Callable[[List[tf.Tensor]], List[tf.Tensor]]) -> List[Optional[tf.Tensor]]:
    """The gradients combined by one `reduce` call on those present; the Nones
    (variables without a gradient) stay in place."""
    present = [g for g in grads if g is not None]
    combined = iter(reduce(present) if present else [])
    return [None if g is None else next(combined) for g in grads]


def _sum_over_workers(grads: List[Optional[tf.Tensor]]) -> List[Optional[tf.Tensor]]:
    """All-reduces (SUM) the gradients as Keras' `_all_reduce_sum_gradients`
    does: one `ReplicaContext.all_reduce` for all of them, Nones kept; in a
    step whose loss is Keras' mean over this replica's rows, weighted by the
    replicas' rows (`_rows_weighted_sum`)."""
    return _reduced_keeping_nones(list(grads), _rows_weighted_sum)


def _scaled(gradient: Any, factor: tf.Tensor) -> Any:
    """`gradient` (a tensor or IndexedSlices) times the scalar `factor`."""
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * tf.cast(factor, gradient.values.dtype),
                                gradient.indices, gradient.dense_shape)
    return gradient * tf.cast(factor, gradient.dtype)


def _rows_weighted_sum(grads: List[Any]) -> List[tf.Tensor]:
    """The replicas' gradients combined as one process on the global batch.

    Keras' loss in a replica is the mean over the replica's rows divided by
    the replica count N, so summing the gradients gives the global batch's
    mean only when every replica got as many rows. When the step's loss is
    that mean (step_rows), each gradient is multiplied by its replica's rows
    r_i, the r_i are summed in the same collective, and the sum is multiplied
    by N / sum(r_i): sum_i g_i r_i N / R, the gradient of the mean over all R
    rows (with equal rows, the plain sum). Otherwise the plain sum.
    """
    context = tf.distribute.get_replica_context()
    reduce_op = _gradient_reduce_op()
    rows = step_rows.current()
    if rows is None or not rows.mean_loss:
        return context.all_reduce(reduce_op, grads)
    weighted = [_scaled(g, rows.count) for g in grads]
    combined = context.all_reduce(reduce_op, weighted + [tf.reshape(rows.count, [1])])
    # The mean rows per replica: the summed rows / N (SUM), or as averaged (MEAN).
    mean_rows = combined[-1][0]
    if reduce_op == tf.distribute.ReduceOp.SUM:
        mean_rows = mean_rows / float(context.num_replicas_in_sync)
    return [_scaled(g, 1.0 / mean_rows) for g in combined[:-1]]


def _gradient_reduce_op() -> tf.distribute.ReduceOp:
    """How replicas' gradients combine into the global batch's: SUM, as
    tf.distribute expects (Keras 3.4+ divides each replica's loss by the replica
    count); MEAN in Keras 3.3's own train step, whose loss is not divided, and in
    a step whose loss came from Keras 3.3's compute_loss (a custom train_step)."""
    from tf_smb.keras_support import keras33  # pylint: disable=import-outside-toplevel
    rows = step_rows.current()
    if keras33.in_unscaled_train_step() or (rows is not None and rows.undivided):
        return tf.distribute.ReduceOp.MEAN
    return tf.distribute.ReduceOp.SUM


def install_optimizer_hooks() -> None:
    """Makes Keras optimizers of tf_smb strategies clip the summed gradient
    (unless the strategy says gradient_clipping="per_worker") and decide loss
    scaling's skips together. Idempotent; other optimizers are unaffected."""
    global _HOOKED
    if _HOOKED:
        return
    if registry.keras_version() == "none":
        return  # no Keras: nothing to hook (custom loops with their own optimizers)
    # Missing targets raise (registry.KerasHookMissingError): without them clipping
    # would act on each worker's part and results would not equal one process.
    places = [registry.locate(h) for h in (
        registry.OPTIMIZER_APPLY, registry.APPLY_GRADIENTS, registry.CLIP_GRADIENTS,
        registry.SUM_GRADIENTS, registry.LOSS_SCALE_CHECK)]
    _HOOKED = True
    apply, backend_apply_gradients, clip_gradients, all_reduce_sum_gradients, check_finite = (
        found.original() for found in places)
    sums_in_merge_call = registry.sums_in_merge_call(places[1].owner)

    def with_apply_state(method):
        # The state lives for the outermost of these calls: a sum made by the
        # clipping hook pairs with the one all-reduce Keras makes later in the
        # same call (Keras 3.4+ clips in _backend_apply_gradients, in the update
        # branch of the accumulation cond if any; Keras 3.3 in apply, before it).
        @functools.wraps(method)
        def hook(self, *args, **kwargs):
            states = _states()
            if not _clips_after_sum(self) or id(self) in states:
                return method(self, *args, **kwargs)
            states[id(self)] = _ApplyState()
            try:
                return method(self, *args, **kwargs)
            finally:
                del states[id(self)]
        return hook

    apply_hook = with_apply_state(apply)
    backend_apply_gradients_hook = with_apply_state(backend_apply_gradients)

    @functools.wraps(clip_gradients)
    def clip_gradients_hook(self, grads):
        state = _states().get(id(self))
        if state is not None and tf.distribute.get_replica_context() is not None:
            grads = _sum_over_workers(list(grads))
            state.summed += 1
        return clip_gradients(self, grads)

    @functools.wraps(all_reduce_sum_gradients)
    def all_reduce_sum_gradients_hook(self, grads_and_vars):
        state = _states().get(id(self))
        if state is not None and state.summed:
            state.summed -= 1
            return list(grads_and_vars)  # summed before clipping already
        strategy = _tf_smb_strategy(self)
        if (sums_in_merge_call and strategy is not None
                and tf.distribute.get_replica_context() is None):
            # Keras 3.3 asks for the sum inside the merge call, where its own code
            # sums nothing (it needs a replica context): the strategy sums.
            grads_and_vars = list(grads_and_vars)
            pairs = [(g, v) for g, v in grads_and_vars if g is not None]
            summed = _reduced_keeping_nones(
                [g for g, _ in grads_and_vars],
                lambda _: strategy.extended.batch_reduce_to(_gradient_reduce_op(), pairs))
            return list(zip(summed, [v for _, v in grads_and_vars]))
        rows = step_rows.current()
        if (strategy is not None and rows is not None and rows.mean_loss
                and tf.distribute.get_replica_context() is not None):
            grads_and_vars = list(grads_and_vars)
            summed = _sum_over_workers([g for g, _ in grads_and_vars])
            return list(zip(summed, [v for _, v in grads_and_vars]))
        return all_reduce_sum_gradients(self, grads_and_vars)

    @functools.wraps(check_finite)
    def check_finite_hook(self, grads):
        finite = check_finite(self, grads)
        strategy = _tf_smb_strategy(self)
        if strategy is None:
            return finite
        # Skip on every worker if any worker's gradients are not finite.
        # extended.all_reduce is local for one worker and in async mode.
        not_finite = tf.cast(tf.logical_not(finite), tf.int32)
        total = strategy.extended.all_reduce(tf.distribute.ReduceOp.SUM, [not_finite])[0]
        return tf.equal(total, 0)

    _install_mean_loss_marker()
    for found, hook in zip(places, (apply_hook, backend_apply_gradients_hook, clip_gradients_hook,
                                    all_reduce_sum_gradients_hook, check_finite_hook)):
        found.replace(hook)


def _install_mean_loss_marker() -> None:
    """Marks the replica steps whose loss Keras divides by the replica count
    (its mean reductions and added losses: `scale_loss_for_distribution`), so
    their gradients are weighted by the replicas' rows when summed. Keras 3.3
    divides nothing (its train step is hooked in keras33.py); its sums stay plain."""
    found = registry.locate(registry.LOSS_DISTRIBUTION_SCALE)
    if found is None:
        return
    scale = found.original()

    @functools.wraps(scale)
    def scale_hook(value):
        step_rows.note_mean_loss()
        return scale(value)

    found.replace(scale_hook)
