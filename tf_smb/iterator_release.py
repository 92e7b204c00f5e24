"""Finished input iterators are destroyed on a thread of their own, not the
training thread.

Why: destroying the iterator of a distributed dataset (TensorFlow's
MultiDeviceIterator, which a multi-worker strategy's input goes through unless
told otherwise) blocks until one of its tf.data background threads wakes from
a timed sleep that grows with the iterator's age. Keras drops the previous
epoch's iterator on its training thread when the next epoch's first step
begins, so every epoch after the first started 1.7-6.7 s late (2 workers, an
11.6M-parameter MLP whose epochs take 3.5 s; benchmarks/epoch_time.py; the
waiting thread's stack dump shows RootDataset::Iterator::~Iterator). The wait
costs no CPU, so it can happen elsewhere.

How: the iterators of distributed datasets made by tf_smb's strategies are
also held by one releaser thread, which polls them and drops its own reference
to each once it is the only one left, so that the blocking destructor runs on
that thread. Only the last reference changes hands: an iterator anyone still
refers to is never touched, and past `MAX_HELD` the oldest is let go at once,
as if tf_smb had never held it (so a reference cycle through an iterator costs
nothing extra). Nothing of this runs in a `tf.function`, where iterators
belong to the graph. ``TF_SMB_ITERATOR_RELEASE=owner`` turns it off (iterators
die wherever their last owner drops them, as in TensorFlow's own strategies);
the default is ``thread``.

    dataset = release_iterators_off_thread(input_util.get_distributed_dataset(...))
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Any, Dict, List, Optional, Type

from tensorflow.python.distribute import input_lib
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

_RELEASING_CLASSES: Dict[type, type] = {}


def _releasing_class(cls: Type[Any]) -> Type[Any]:
    """`cls` with an `__iter__` whose iterators the releaser holds."""
    if cls not in _RELEASING_CLASSES:
        def __iter__(self):  # pylint: disable=invalid-name
            iterator = super(releasing, self).__iter__()
            if not framework_ops.inside_function():
                RELEASER.hold(iterator)
            return iterator

        releasing = type(cls.__name__, (cls,), {
            "__iter__": __iter__, "__module__": cls.__module__,
            "__doc__": cls.__doc__})
        _RELEASING_CLASSES[cls] = releasing
    return _RELEASING_CLASSES[cls]


def release_iterators_off_thread(dataset: Any) -> Any:
    """Makes the iterators of TensorFlow's distributed `dataset` be destroyed
    on the releaser thread; returns the same object. Anything else (a plain
    tf.data dataset, TF1's distributed datasets) is returned unchanged, and so
    is everything when $TF_SMB_ITERATOR_RELEASE is ``owner``."""
    choice = os.environ.get(RELEASE_ENV, "thread")
    if choice not in _RELEASE_CHOICES:
        raise ValueError(f"{RELEASE_ENV} must be one of {', '.join(_RELEASE_CHOICES)}; "
                         f"got {choice!r}")
    distributed = (input_lib.DistributedDataset, input_lib.DistributedDatasetsFromFunction)
    if choice == "thread" and type(dataset) in distributed:
        # A subclass that adds no state: only iteration is ours.
        dataset.__class__ = _releasing_class(type(dataset))
    return dataset
