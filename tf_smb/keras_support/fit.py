"""Hooks on keras.Model.fit/evaluate/predict for tf_smb strategies."""
from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from typing import Any, Callable, Optional

from tf_smb import phase
from tf_smb.keras_support import _owner
from tf_smb.keras_support import data as data_lib
from tf_smb import keras_registry as registry

# The async fit running in this thread (evaluation and model building are
# marked in tf_smb.phase, which the engines read).
_phase = threading.local()


def in_async_fit() -> bool:
    """Whether this thread is inside `fit` of a model of an async multi-worker
    strategy (its callbacks run there)."""
    return getattr(_phase, "async_fit", None) is not None


def in_eval_phase() -> bool:
    """True inside model.evaluate or model.predict of an async SMB model (or a
    custom loop's `tf_smb.evaluating()`)."""
    return phase.is_evaluating()


_HOOKED = False
_BUILD_HOOKED = False


def building_model() -> bool:
    """True while Keras builds a model from its first data batch (it reduces
    that batch over replicas only to learn its structure)."""
    return phase.is_building_model()


def install_build_hook() -> None:
    """Marks Keras' build from a data batch (see `building_model`); idempotent."""
    global _BUILD_HOOKED
    if _BUILD_HOOKED:
        return
    found = registry.locate(registry.BUILD_MARKER)
    _BUILD_HOOKED = True
    if found is None:  # Keras 3.3
        from tf_smb.keras_support import keras33  # pylint: disable=import-outside-toplevel
        keras33.install_build_before_first_step(_phase)
        return
    build = found.original()

    @functools.wraps(build)
    def build_hook(self, *args, **kwargs):
        with phase.building_model():
            try:
                return build(self, *args, **kwargs)
            except StopIteration:
                # Keras takes the structure from the first batch; an async worker
                # whose share of the data has none builds from the data's spec.
                spec = _data_spec(self, kwargs.get("iterator", args[0] if args else None))
                if spec is None:
                    raise
                return build(self, data_batch=spec)

    found.replace(build_hook)


def _data_spec(model: Any, epoch_iterator: Any) -> Optional[Any]:
    """The structure (tf.TensorSpecs) of `epoch_iterator`'s batches, for a model
    of an async tf_smb strategy; None otherwise."""
    if _owner.async_fit_strategy(model)[0] is None or epoch_iterator is None:
        return None
    adapter = getattr(epoch_iterator, "data_adapter", None)
    if adapter is None:
        return None
    return adapter.get_tf_dataset().element_spec


@contextlib.contextmanager
def with_callback(fit, model, args, kwargs, callback):
    """fit's (args, kwargs) with `callback` run first among the callbacks; a
    CallbackList the caller passed gets it back out afterwards."""
    import keras  # pylint: disable=import-outside-toplevel
    bound = inspect.signature(fit).bind(model, *args, **kwargs)
    given = bound.arguments.get("callbacks")
    if isinstance(given, keras.callbacks.CallbackList):
        given.callbacks.insert(0, callback)
        callback.set_model(model)
    else:
        bound.arguments["callbacks"] = [callback, *(given or [])]
    try:
        yield bound.args[1:], bound.kwargs
    finally:
        if isinstance(given, keras.callbacks.CallbackList):
            given.callbacks.remove(callback)


def install_fit_hooks() -> None:
    """Hooks keras.Model.fit/evaluate/predict for models of multi-worker
    tf_smb strategies (idempotent); any other model runs Keras' own code.

    `fit` shuffles arrays in one order on every worker (data.py). In async
    mode, `fit` also starts this worker's clock and, on return, waits for the
    others and loads the box's final values; `evaluate` and `predict` (also
    when `fit` validates) run without training steps and on all the data.
    """
    global _HOOKED
    if _HOOKED:
        return
    _HOOKED = True
    from tf_smb import ops as smb_ops  # pylint: disable=import-outside-toplevel

    data_lib.install_data_hooks()
    fit_at, evaluate_at, predict_at = (registry.locate(h) for h in (
        registry.FIT, registry.EVALUATE, registry.PREDICT))
    fit, evaluate, predict = fit_at.original(), evaluate_at.original(), predict_at.original()

    @functools.wraps(fit)
    def fit_hook(self, *args, **kwargs):
        strategy = _owner.multi_worker_strategy(self)
        if strategy is None:
            _owner.check_built_in_scope(self)
        elif strategy.elastic_worker is not None:
            return strategy.elastic_fit.fit(fit, self, args, kwargs, fit_once)
        return fit_once(self, args, kwargs)

    def fit_once(self, args, kwargs):
        strategy = _owner.multi_worker_strategy(self)
        # Entered for every model: one of another strategy (or none) fitted
        # inside our fit's callbacks must shuffle as Keras does.
        async_strategy, local_only = _owner.async_fit_strategy(self)
        if local_only:
            history = fit(self, *args, **kwargs)
            async_strategy.finish_training()  # the parameter server applied every update
            return history
        with contextlib.ExitStack() as stack:
            order = stack.enter_context(data_lib.agreed_shuffle(strategy))
            if order is not None:
                args, kwargs = stack.enter_context(
                    with_callback(fit, self, args, kwargs, order.callback()))
            if async_strategy is None:
                return fit(self, *args, **kwargs)
            smb_ops.clock_finish(False)
            fitting = getattr(_phase, "async_fit", None)
            _phase.async_fit = _AsyncFit(async_strategy)
            try:
                history = fit(self, *args, **kwargs)
            finally:
                _phase.async_fit = fitting
                smb_ops.clock_finish(True)  # never hold the others back, even on error
            async_strategy.finish_training()
            return history

    def eval_hook(method):
        @functools.wraps(method)
        def hook(self, *args, **kwargs):
            if _owner.async_fit_strategy(self)[0] is None:
                return method(self, *args, **kwargs)
            with phase.evaluating():
                return method(self, *args, **kwargs)
        return hook

    fit_at.replace(fit_hook)
    evaluate_at.replace(eval_hook(evaluate))
    predict_at.replace(eval_hook(predict))
    _install_epoch_length_hook()


class _AsyncFit:
    """An asynchronous `fit` running in this thread: its strategy, and whether
    Keras made its training epoch iterator yet."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.training_iterator_made = False


def _install_epoch_length_hook() -> None:
    """Hooks the epoch iterators an asynchronous `fit` makes.

    The first is the training data's: an asynchronous worker trains on every
    N-th batch, so Keras, which takes an epoch's length from the data it was
    given, would count N times too many steps and warn at every epoch's end
    that the input "ran out of data"; it gets this worker's count instead.
    Any later one is `fit`'s validation data, which Keras prepares outside
    `evaluate`: it is made as `evaluate` would make it (all the data).
    """
    found = registry.locate(registry.EPOCH_ITERATOR)
    init = found.original()

    @functools.wraps(init)
    def init_hook(self, distribute_strategy=None, *args, **kwargs):
        fitting = getattr(_phase, "async_fit", None)
        if getattr(getattr(distribute_strategy, "extended", None), "resuming", False):
            if fitting is not None and fitting.strategy is distribute_strategy:
                fitting.training_iterator_made = True  # later ones are validation data's
            init(self, distribute_strategy, *args, **kwargs)
            _count_resumed_epoch(self, distribute_strategy.extended)
        elif (fitting is None or fitting.strategy is not distribute_strategy
                or in_eval_phase()):
            init(self, distribute_strategy, *args, **kwargs)
        elif fitting.training_iterator_made:
            with phase.evaluating():
                init(self, distribute_strategy, *args, **kwargs)
        else:
            fitting.training_iterator_made = True
            init(self, distribute_strategy, *args, **kwargs)
            # Local replicas take a part of every batch: their count is Keras'.
            training_batches = getattr(distribute_strategy.extended, "training_batches", None)
            if training_batches is not None and not self.steps_per_epoch:
                _count_own_batches(self, training_batches)

    found.replace(init_hook)


def _count_own_batches(epoch_iterator: Any, training_batches: Any) -> None:
    """Makes `epoch_iterator` count this worker's batches, also after the
    `reset()` with which Keras (3.4+) starts every epoch (it recounts the
    data's); Keras 3.3 has no `reset()` and counts once."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    # pylint: disable=protected-access
    def count() -> None:
        data_batches = epoch_iterator.data_adapter.num_batches
        if data_batches:  # None while the data's length is unknown
            # A tf.data dataset's options may turn sharding off.
            dataset = registry.read(epoch_iterator.data_adapter, registry.ADAPTER_DATASET, None)
            registry.write(epoch_iterator, registry.EPOCH_BATCHES, training_batches(
                data_batches, dataset if isinstance(dataset, tf.data.Dataset) else None))
            if registry.read(epoch_iterator, registry.EPOCH_BATCHES) == 0:
                _tell_no_batch(data_batches)

    _count_now_and_after_reset(epoch_iterator, count)


def _count_now_and_after_reset(epoch_iterator: Any, count: Callable[[], None]) -> None:
    """Runs `count` now and after each `reset()` of `epoch_iterator` (Keras 3.4+
    recounts the data's batches there); Keras 3.3 has no `reset()`."""
    reset = getattr(epoch_iterator, "reset", None)
    if reset is not None:
        def reset_hook() -> None:
            reset()
            count()

        epoch_iterator.reset = reset_hook
    count()


def _count_resumed_epoch(epoch_iterator: Any, extended: Any) -> None:
    """An elastic fit resuming mid-epoch (its data skips the batches done
    before the last commit, DataParallelExtended.skip_batches): `epoch_iterator`
    counts the batches left in that epoch (else Keras would ask for a step past
    the data's end, which the distributed iterator answers with an empty one),
    and the whole epoch's again once the skipping stops."""
    skipping = extended.skipping_dataset
    if skipping is None or epoch_iterator.steps_per_epoch:
        return  # one iterator runs through every epoch: its length is steps_per_epoch

    # This worker's part of them (async mode: every size-th, `training_batches`).
    def count() -> None:
        batches = epoch_iterator.data_adapter.num_batches
        if batches and skipping.active:
            registry.write(epoch_iterator, registry.EPOCH_BATCHES,
                           extended.training_batches(max(0, batches - skipping.count)))

    def whole() -> None:
        batches = epoch_iterator.data_adapter.num_batches
        registry.write(epoch_iterator, registry.EPOCH_BATCHES,
                       extended.training_batches(batches) if batches else batches)

    skipping.on_stop = whole
    _count_now_and_after_reset(epoch_iterator, count)


def _tell_no_batch(data_batches: int) -> None:
    """Says (once per process) why this worker takes no step in fit's epochs."""
    why = (f"tf_smb: this asynchronous worker has no batch of the training data to train "
           f"on ({data_batches} batch(es) in all, each worker takes every N-th)")
    if getattr(_tell_no_batch, "told", False):
        return
    _tell_no_batch.told = True  # type: ignore[attr-defined]
    from absl import logging  # pylint: disable=import-outside-toplevel
    logging.warning("%s: it takes no step and waits for the others; give fit more data or "
                    "a smaller batch_size", why)


def install_async_hooks() -> None:
    """Kept for callers from before install(): installs the fit hooks."""
    install_fit_hooks()
