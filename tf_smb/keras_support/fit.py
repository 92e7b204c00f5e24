"""Hooks on keras.Model.fit/evaluate/predict for tf_smb strategies."""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Optional

# Keras phases: model.evaluate / predict run without training steps.
_phase = threading.local()


def in_eval_phase() -> bool:
    """True inside model.evaluate or model.predict of an async SMB model."""
    return getattr(_phase, "eval_depth", 0) > 0


@contextlib.contextmanager
def _eval_phase():
    _phase.eval_depth = getattr(_phase, "eval_depth", 0) + 1
    try:
        yield
    finally:
        _phase.eval_depth -= 1


_ASYNC_HOOKED = False


def _async_strategy(model) -> Optional[Any]:
    """The model's SMBStrategy when it trains asynchronously, else None."""
    from tf_smb.strategy import SMBStrategy  # pylint: disable=import-outside-toplevel
    strategy = getattr(model, "_distribute_strategy", None)
    if isinstance(strategy, SMBStrategy) and strategy.mode == "async":
        return strategy
    return None


def install_async_hooks() -> None:
    """Marks Keras' evaluation phases and finishes asynchronous training.

    `fit` starts this worker's clock and, on return, waits for the others and
    loads the box's final values; `evaluate` and `predict` (also when `fit`
    validates) run without training steps and on all the data.
    """
    global _ASYNC_HOOKED
    if _ASYNC_HOOKED:
        return
    _ASYNC_HOOKED = True
    import keras  # pylint: disable=import-outside-toplevel

    from tf_smb import ops as smb_ops  # pylint: disable=import-outside-toplevel

    fit, evaluate, predict = keras.Model.fit, keras.Model.evaluate, keras.Model.predict

    @functools.wraps(fit)
    def fit_hook(self, *args, **kwargs):
        strategy = _async_strategy(self)
        if strategy is None:
            return fit(self, *args, **kwargs)
        smb_ops.clock_finish(False)
        try:
            history = fit(self, *args, **kwargs)
        finally:
            smb_ops.clock_finish(True)  # never hold the others back, even on error
        strategy.finish_training()
        return history

    def eval_hook(method):
        @functools.wraps(method)
        def hook(self, *args, **kwargs):
            if _async_strategy(self) is None:
                return method(self, *args, **kwargs)
            with _eval_phase():
                return method(self, *args, **kwargs)
        return hook

    keras.Model.fit = fit_hook
    keras.Model.evaluate = eval_hook(evaluate)
    keras.Model.predict = eval_hook(predict)
