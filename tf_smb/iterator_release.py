"""Finished input iterators die quickly, and off the training thread.

Why: destroying a tf.data iterator whose pipeline autotunes (tf.data's default)
stops its autotuning thread, and TensorFlow's cancellation can miss that
thread's timed sleep: the cancellation callback wakes the thread before the
cancellation manager reports itself cancelled, so the thread sleeps out the
rest of its optimization period, which doubles up to 60 s as the iterator
ages. The destructor waits for it. Keras drops the previous epoch's iterator
on its training thread when the next epoch's first step begins, so every
epoch after the first started late: mlp10m 2.26 s and cnn 0.41 s an epoch
(2 workers, benchmarks/epoch_time.py; a stack dump of the waiting thread
shows RootDataset::Iterator::~Iterator joining a thread in Model::OptimizeLoop).

Three measures:

- `without_autotune_thread`: the datasets tf_smb's strategies distribute get
  ``options.autotune.enabled = False`` unless the user's options set it. No
  autotuning thread, nothing to wait for; tf.data then runs AUTOTUNE'd stages
  at its defaults (parallelism: the cores; prefetch buffers: still adapted by
  the prefetch autotuner). A user who sets ``autotune.enabled`` keeps it.
- `tend_iterators`: a MultiDeviceIterator (local replicas, or input options
  from the user) feeds each device from a small pipeline TensorFlow makes with
  default options; while one of tf_smb's distributed datasets makes its
  iterator, those pipelines get the same treatment (TensorFlow's
  `_create_device_dataset` is wrapped; outside tf_smb it behaves as before).
- The releaser, for what still autotunes (pipelines the user autotunes):
  iterators of tf_smb's distributed datasets are also held by one releaser
  thread, which polls them and drops its own reference to each once it is the
  only one left, so that a blocking destructor runs on that thread (it waits
  without the GIL: training goes on). Only the last reference changes hands:
  an iterator anyone still refers to is never touched, and past `MAX_HELD`
  the oldest is let go at once, as if tf_smb had never held it. Nothing of
  this runs in a `tf.function`, where iterators belong to the graph.
  ``TF_SMB_ITERATOR_RELEASE=owner`` turns the releaser off (iterators die
  wherever their last owner drops them, as in TensorFlow's own strategies);
  the default is ``thread``.

Strategies get both through `distributed_dataset` and
`distributed_datasets_from_function`, which wrap TensorFlow's
`input_util` functions of the same names.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Any, Dict, List, Optional, Tuple, Type

from tensorflow.python.data.ops import dataset_ops
from tensorflow.python.data.ops import multi_device_iterator_ops
from tensorflow.python.data.ops import options as options_lib
from tensorflow.python.distribute import input_lib
from tensorflow.python.distribute import input_util
from tensorflow.python.framework import ops as framework_ops

MAX_HELD = 16
POLL_S = 0.1
SHUTDOWN_TIMEOUT_S = 120.0
RELEASE_ENV = "TF_SMB_ITERATOR_RELEASE"
_RELEASE_CHOICES = ("thread", "owner")


class IteratorReleaser:
    """Holds objects and drops each, on its own thread, once nothing else
    refers to it (CPython reference counts)."""

    def __init__(self, max_held: int = MAX_HELD, poll_s: float = POLL_S) -> None:
        self._max_held = max_held
        self._poll_s = poll_s
        self._held: List[Any] = []
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._released = 0
        self._stopping = False

    @property
    def thread_name(self) -> str:
        """The name of the thread that drops the objects."""
        return "tf_smb-iterator-release"

    def hold(self, obj: Any) -> None:
        """Keeps `obj` until it is the releaser's alone, then drops it."""
        with self._cond:
            self._held.append(obj)
            # Beyond the cap the oldest is let go here: its owner (if any)
            # decides where it dies, as without the releaser.
            overflow = self._held[:-self._max_held] if len(self._held) > self._max_held else []
            del self._held[:len(overflow)]
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name=self.thread_name, daemon=True)
                self._thread.start()
                # A daemon thread still inside a C++ destructor when the
                # interpreter finalizes aborts the process: stop it first.
                atexit.register(self.shutdown)
            self._cond.notify()
        del overflow

    @property
    def released(self) -> int:
        """How many objects the releaser thread has dropped so far."""
        with self._cond:
            return self._released

    @property
    def running(self) -> bool:
        """Whether the releaser thread is running."""
        with self._cond:
            return self._thread is not None and self._thread.is_alive()

    def holds(self, obj: Any) -> bool:
        """Whether `obj` is held now."""
        with self._cond:
            return any(held is obj for held in self._held)

    def _unreferenced(self) -> List[Any]:
        # Two references: the list's and getrefcount's argument.
        free = [i for i in range(len(self._held)) if sys.getrefcount(self._held[i]) <= 2]
        taken = [self._held[i] for i in free]
        for i in reversed(free):
            del self._held[i]
        return taken

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Stops the thread (waiting for a destructor it is in) and lets go of
        everything held, here. At exit, and for tests."""
        with self._cond:
            self._stopping = True
            thread = self._thread
            self._cond.notify()
        if thread is not None:
            thread.join(timeout_s)
        with self._cond:
            held, self._held = self._held, []
            self._thread = None
            self._stopping = False
        del held

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._held and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                taken = self._unreferenced()
                self._released += len(taken)
            # The destructors run here, outside the lock.
            del taken
            with self._cond:
                self._cond.wait(self._poll_s)


RELEASER = IteratorReleaser()

_TEARDOWN_CLASSES: Dict[Tuple[type, bool], type] = {}
_IN_OUR_ITER = threading.local()


def _create_quiet_device_dataset(*args: Any, **kwargs: Any) -> Any:
    """TensorFlow's `_create_device_dataset`, without the autotuning thread
    while one of tf_smb's distributed datasets makes its iterator."""
    dataset = _create_device_dataset(*args, **kwargs)
    if getattr(_IN_OUR_ITER, "active", False):
        dataset = without_autotune_thread(dataset)
    return dataset


# A MultiDeviceIterator feeds each device from a small pipeline of its own,
# made by this module function when the iterator is made; its options are
# TensorFlow's, so without this each device's pipeline autotunes.
_create_device_dataset = multi_device_iterator_ops._create_device_dataset  # pylint: disable=protected-access
multi_device_iterator_ops._create_device_dataset = _create_quiet_device_dataset  # pylint: disable=protected-access


def _teardown_class(cls: Type[Any], hold: bool) -> Type[Any]:
    """`cls` with an `__iter__` whose per-device pipelines do not autotune and,
    if `hold`, whose iterators the releaser holds."""
    if (cls, hold) not in _TEARDOWN_CLASSES:
        def __iter__(self):  # pylint: disable=invalid-name
            _IN_OUR_ITER.active = True
            try:
                iterator = super(tended, self).__iter__()
            finally:
                _IN_OUR_ITER.active = False
            if hold and not framework_ops.inside_function():
                RELEASER.hold(iterator)
            return iterator

        tended = type(cls.__name__, (cls,), {
            "__iter__": __iter__, "__module__": cls.__module__,
            "__doc__": cls.__doc__})
        _TEARDOWN_CLASSES[(cls, hold)] = tended
    return _TEARDOWN_CLASSES[(cls, hold)]


def without_autotune_thread(dataset: Any) -> Any:
    """`dataset` with tf.data's autotuning thread off, unless its options
    already say whether to autotune (then `dataset` itself). Anything that is
    not a tf.data dataset is returned unchanged."""
    if not isinstance(dataset, dataset_ops.DatasetV2):
        return dataset
    if dataset.options().autotune.enabled is not None:
        return dataset
    options = options_lib.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def tend_iterators(dataset: Any) -> Any:
    """Makes the iterators of TensorFlow's distributed `dataset` quick to
    destroy (a MultiDeviceIterator's per-device pipelines without the
    autotuning thread) and, unless $TF_SMB_ITERATOR_RELEASE is ``owner``,
    destroyed on the releaser thread; returns the same object. Anything else
    (a plain tf.data dataset, TF1's distributed datasets) is returned
    unchanged."""
    choice = os.environ.get(RELEASE_ENV, "thread")
    if choice not in _RELEASE_CHOICES:
        raise ValueError(f"{RELEASE_ENV} must be one of {', '.join(_RELEASE_CHOICES)}; "
                         f"got {choice!r}")
    distributed = (input_lib.DistributedDataset, input_lib.DistributedDatasetsFromFunction)
    if type(dataset) in distributed:
        # A subclass that adds no state: only iteration is ours.
        dataset.__class__ = _teardown_class(type(dataset), hold=choice == "thread")
    return dataset


def distributed_dataset(dataset: Any, *args: Any, **kwargs: Any) -> Any:
    """`input_util.get_distributed_dataset(dataset, *args, **kwargs)` with
    `dataset`'s autotuning thread off (`without_autotune_thread`) and its
    iterators tended (`tend_iterators`)."""
    return tend_iterators(input_util.get_distributed_dataset(
        without_autotune_thread(dataset), *args, **kwargs))


def distributed_datasets_from_function(dataset_fn: Any, *args: Any, **kwargs: Any) -> Any:
    """`input_util.get_distributed_datasets_from_function(dataset_fn, *args,
    **kwargs)` with the datasets `dataset_fn` makes without the autotuning
    thread and the iterators tended, as `distributed_dataset`."""
    return tend_iterators(input_util.get_distributed_datasets_from_function(
        lambda context: without_autotune_thread(dataset_fn(context)), *args, **kwargs))
