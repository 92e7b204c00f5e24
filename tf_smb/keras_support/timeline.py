"""Training steps in the job's timeline (tf_smb/timeline.py): while
TF_SMB_TIMELINE is set, `fit` of a model of a multi-worker tf_smb strategy
runs a callback that records each training step (on_train_batch_begin to
on_train_batch_end) and each epoch on the rank's "steps" row. With the
timeline off nothing is hooked.
"""
from __future__ import annotations

import functools
import itertools
import time
from typing import Any, Dict, Optional

from tf_smb import timeline as timeline_lib
from tf_smb.keras_support import _owner
from tf_smb import keras_registry as registry

_HOOKED = False
# Training steps this process started, over all its `fit` calls: the steps'
# numbers in the timeline.
_steps = itertools.count()


@functools.lru_cache(maxsize=None)
def _callback_class():
    import keras  # pylint: disable=import-outside-toplevel

    class TimelineCallback(keras.callbacks.Callback):
        """Records training steps and epochs into this worker's timeline."""

        # Keras may run on_train_batch_end on a thread of its own; the step's
        # end is then taken there (a little late; steps are clamped so that
        # none ends after the next begins).
        async_safe = True

        def __init__(self) -> None:
            super().__init__()
            self._begins: Dict[int, tuple] = {}
            self._epoch_begin: Optional[int] = None

        def on_epoch_begin(self, epoch, logs=None):
            self._epoch_begin = time.monotonic_ns()

        def on_epoch_end(self, epoch, logs=None):
            if self._epoch_begin is not None:
                timeline_lib.record("epoch", self._epoch_begin, time.monotonic_ns(),
                                    category="epoch", arg_name="epoch", arg=epoch)
                self._epoch_begin = None
            timeline_lib.push()  # between epochs rather than at a step

        def on_train_batch_begin(self, batch, logs=None):
            self._begins[batch] = (time.monotonic_ns(), next(_steps))

        def on_train_batch_end(self, batch, logs=None):
            begun = self._begins.pop(batch, None)
            if begun is not None:
                timeline_lib.record("step", begun[0], time.monotonic_ns(),
                                    category="step", arg_name="step", arg=begun[1])

        def on_train_end(self, logs=None):
            timeline_lib.push()

    return TimelineCallback


def timeline_callback() -> Any:
    """A new callback that records steps and epochs into the timeline."""
    return _callback_class()()


def install_timeline_hooks() -> None:
    """While the timeline is on (TF_SMB_TIMELINE set when this runs): makes
    `fit` of models of multi-worker tf_smb strategies record their steps
    (idempotent). Off: installs nothing."""
    global _HOOKED
    if _HOOKED or not timeline_lib.enabled():
        return
    _HOOKED = True
    from tf_smb.keras_support.fit import with_callback  # pylint: disable=import-outside-toplevel

    found = registry.locate(registry.FIT)
    fit = found.original()

    @functools.wraps(fit)
    def fit_with_timeline(self, *args, **kwargs):
        if _owner.multi_worker_strategy(self) is None:
            return fit(self, *args, **kwargs)
        with with_callback(fit, self, args, kwargs, timeline_callback()) as (a, k):
            return fit(self, *a, **k)

    found.replace(fit_with_timeline)
