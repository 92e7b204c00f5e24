"""Async SMB: weights set outside training become the box's master copies.

In SMBStrategy(mode="async") the box holds every trainable variable's master
copy and each training step reads it into the worker's variables, so a value
assigned to a local variable alone would be overwritten at the next step.
`Model.load_weights`, `Layer.set_weights` (a model's or a layer's) and
`keras.saving.load_model` (of a model made under the strategy's scope) end
with rank 0's values written into the box between two barriers (`publish`):
every worker calls them, as every worker builds the model, and none steps
before the box holds the new values. (With local replicas an assignment
outside a step would push each worker's change at once: within these calls
it does not.) BackupAndRestore publishes after its own checks (callbacks.py).
Calls made during an async `fit` (by callbacks, e.g. EarlyStopping's
restore_best_weights) change the worker's copies only: async workers reach
them at their own times, and not necessarily all of them (a callback may act
on one worker's numbers), so a barrier there could wait for nothing.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import threading
from typing import Any, Callable, Iterator, Optional

from tf_smb.keras_support import _owner
from tf_smb.keras_support import fit as fit_lib
from tf_smb import keras_registry as registry

_HOOKED = False
_state = threading.local()  # depth: weight-setting calls this thread is inside


def _write_into_box(strategy: Any, model: Any) -> None:
    """Makes this worker's values of `model`'s box-held trainable variables
    the box's master copies (no barrier: see `publish`).

    Raises:
      RuntimeError: the model has trainable variables but the box holds none
        of them (the model was not made under the strategy's scope).
    """
    from tf_smb import ops as smb_ops  # pylint: disable=import-outside-toplevel
    box_params = strategy.extended._box_segments  # pylint: disable=protected-access
    variables = [_placed_variable(v) for v in model.trainable_variables]
    placed = [v for v in variables if v.ref() in box_params]
    if variables and not placed:
        raise RuntimeError(
            "tf_smb: none of the model's trainable variables has a master copy in "
            "the box, so the new values cannot be placed there; make the model "
            "under strategy.scope()")
    for variable in placed:
        smb_ops.segment_create(variable.read_value(), box_params[variable.ref()].name,
                               write=True)


def _placed_variable(variable: Any) -> Any:
    """The tf.Variable the strategy created (and placed) for a Keras variable;
    with local replicas the one copy inside its AggregatingVariable."""
    variable = registry.read(variable, registry.VARIABLE_VALUE, variable)
    get = getattr(variable, "get", None)  # distributed values (local replicas)
    return get() if callable(get) else variable


@contextlib.contextmanager
def publishing_deferred(strategy: Optional[Any] = None) -> Iterator[None]:
    """Within it, the hooks below leave the box alone (the caller publishes:
    an outer hook, or BackupAndRestore after its epoch check); with an async
    `strategy`, assignments change the workers' copies only (with local
    replicas they would push each worker's change)."""
    engine = getattr(getattr(strategy, "extended", None), "async_engine", None)
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        with engine.local_assignments() if engine is not None else contextlib.nullcontext():
            yield
    finally:
        _state.depth -= 1


def _async_strategy(model: Any) -> Optional[Any]:
    """The async strategy whose box holds `model`'s master copies, or None."""
    return _owner.async_box_strategy(
        model, (_placed_variable(v) for v in model.trainable_variables))


def publish(strategy: Any, model: Any) -> None:
    """Every worker of async `strategy`: rank 0's values of `model`'s
    trainable variables become the box's, once every worker got here and
    before any goes on."""
    strategy.barrier()
    if strategy.rank == 0:
        _write_into_box(strategy, model)
    strategy.barrier()  # no worker steps before the box holds the new values


def _publishes_after(method: Callable[..., Any]) -> Callable[..., Any]:
    """`model.method(...)`, then (outermost call, async strategy) publish."""
    @functools.wraps(method)
    def hook(model, *args, **kwargs):
        if getattr(_state, "depth", 0):
            return method(model, *args, **kwargs)
        strategy = _async_strategy(model)
        if strategy is None:
            return method(model, *args, **kwargs)
        with publishing_deferred(strategy):
            result = method(model, *args, **kwargs)
        if not fit_lib.in_async_fit():
            publish(strategy, model)
        return result
    return hook


def _publishes_loaded(load: Callable[..., Any]) -> Callable[..., Any]:
    """`load(...)` returns a model; made under an async strategy: publish."""
    @functools.wraps(load)
    def hook(*args, **kwargs):
        if getattr(_state, "depth", 0):
            return load(*args, **kwargs)
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        with publishing_deferred(tf.distribute.get_strategy()):  # the scope's
            model = load(*args, **kwargs)
        strategy = _async_strategy(model)
        if strategy is not None and not fit_lib.in_async_fit():
            publish(strategy, model)
        return model
    return hook


def install_weight_hooks() -> None:
    """Installs the hooks (idempotent; each asks the model's own strategy)."""
    global _HOOKED
    if _HOOKED:
        return
    _HOOKED = True
    for hook in (registry.LOAD_WEIGHTS, registry.SET_WEIGHTS):  # set_weights: models' too
        found = registry.locate(hook)
        found.replace(_publishes_after(found.original()))
    # The function behind keras.saving.load_model and its public names.
    found = registry.locate(registry.LOAD_MODEL)
    original = found.original()
    hooked = _publishes_loaded(original)
    found.replace(hooked)
    for module in list(sys.modules.values()):  # keras.saving, keras.models, tf.keras.models
        if (getattr(module, "__name__", "").startswith("keras")
                and getattr(module, "load_model", None) is original):
            module.load_model = hooked
