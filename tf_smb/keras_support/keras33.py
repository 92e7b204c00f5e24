"""What Keras 3.3 (TensorFlow 2.16's Keras) lacks for a drop-in strategy, filled in.

Keras 3.4+ builds a model, its metrics and its optimizer from the first batch
before training (`_maybe_symbolic_build`) and makes metric variables sum over
replicas when read; Keras 3.3 builds them while tracing the first step and makes
metric variables that every worker reads alone. For models of tf_smb strategies
on such a Keras (found by feature detection, tf_smb/keras_registry.py),
these hooks build before the first step and make metric variables sync on read.
Its train step's loss is each replica's mean, not divided by the replica count
as in Keras 3.4+, so its gradients average over workers (`in_unscaled_train_step`;
the sum Keras 3.3 asks for inside its merge call is made in optimizer.py), and
a replica's empty part of a batch gets loss 0 rather than Keras 3.3's NaN. An
epoch with no batch for this worker (an asynchronous worker's share, or an
elastic worker's share of the rest of the epoch it resumes in, is empty) takes
no step and ends with empty logs, as in Keras 3.4+; Keras 3.3 would call its
train step on the empty data and fail at the epoch's end.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Iterator

import tensorflow as tf

from tf_smb import phase
from tf_smb import step_rows
from tf_smb import keras_registry as registry


_AGGREGATIONS = {"sum": tf.VariableAggregation.SUM, "mean": tf.VariableAggregation.MEAN,
                 "only_first_replica": tf.VariableAggregation.ONLY_FIRST_REPLICA}


@contextlib.contextmanager
def _sync_on_read(aggregation: str) -> Iterator[None]:
    """Within it, variables are made sync on read with Keras' `aggregation`:
    combined over workers when read outside a step, as Keras 3.4+ makes a
    metric's variables."""
    def creator(next_creator, **kwargs):
        kwargs["synchronization"] = tf.VariableSynchronization.ON_READ
        kwargs["aggregation"] = _AGGREGATIONS.get(aggregation, tf.VariableAggregation.SUM)
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        yield


_ACTIVE = False
# Train steps being traced, in any thread: replica threads trace them while the
# merge call that sums their gradients runs in the thread that started them.
_TRAIN_STEPS = [0]
_TRAIN_STEPS_LOCK = threading.Lock()
_adding = threading.local()  # the metric variable being added in this thread


def active() -> bool:
    """Whether the running Keras needed this module's hooks (Keras 3.3)."""
    return _ACTIVE


def in_unscaled_train_step() -> bool:
    """Whether a thread traces Keras 3.3's train step, whose loss is each
    replica's mean (not divided by the replica count, as Keras 3.4+ does), so
    its gradients average, rather than sum, into the global batch's."""
    return _TRAIN_STEPS[0] > 0


def _install_compute_loss_mark() -> None:
    """A custom train_step that calls Keras 3.3's compute_loss has its undivided
    loss too: the replica step is marked (step_rows), so its gradients average."""
    found = registry.locate(registry.COMPUTE_LOSS)
    compute_loss = found.original()

    @functools.wraps(compute_loss)
    def hook(self, *args, **kwargs):
        step_rows.note_undivided_mean_loss()
        return compute_loss(self, *args, **kwargs)

    found.replace(hook)


def _install_train_step_mark() -> None:
    found = registry.locate(registry.TRAIN_STEP)
    train_step = found.original()

    @functools.wraps(train_step)
    def hook(self, *args, **kwargs):
        with _TRAIN_STEPS_LOCK:
            _TRAIN_STEPS[0] += 1
        try:
            return train_step(self, *args, **kwargs)
        finally:
            with _TRAIN_STEPS_LOCK:
                _TRAIN_STEPS[0] -= 1

    found.replace(hook)


def _install_empty_batch_loss() -> None:
    from tf_smb.data_parallel import DataParallelStrategy  # pylint: disable=import-outside-toplevel
    found = registry.locate(registry.LOSS_REDUCE)
    reduce_values = found.original()

    @functools.wraps(reduce_values)
    def hook(values, reduction="sum_over_batch_size"):
        if (reduction != "sum_over_batch_size" or values.shape.rank == 0
                or not isinstance(tf.distribute.get_strategy(), DataParallelStrategy)):
            return reduce_values(values, reduction)
        total = tf.reduce_sum(values)
        return tf.math.divide_no_nan(total, tf.cast(tf.size(values), total.dtype))

    found.replace(hook)


def _install_epoch_without_step() -> None:
    steps_at = registry.locate(registry.EPOCH_STEPS)
    logs_at = registry.locate(registry.EPOCH_LOGS)
    enumerate_epoch, metrics_or_logs = steps_at.original(), logs_at.original()

    @functools.wraps(enumerate_epoch)
    def steps_hook(self):
        # 0, not None (unknown length): tf_smb counted this worker's batches.
        if not self.steps_per_epoch and self.num_batches == 0:
            self.data_adapter.on_epoch_end()
            return iter(())
        return enumerate_epoch(self)

    @functools.wraps(metrics_or_logs)
    def logs_hook(self, logs):
        # Keras 3.3's fit starts with logs None, which an epoch without a step keeps.
        return metrics_or_logs(self, {} if logs is None else logs)

    steps_at.replace(steps_hook)
    logs_at.replace(logs_hook)


def _install_metric_variables_sync_on_read() -> None:
    from tf_smb.data_parallel import DataParallelStrategy  # pylint: disable=import-outside-toplevel
    add_at = registry.locate(registry.METRIC_ADD_VARIABLE)
    init_at = registry.locate(registry.VARIABLE_INITIALIZE)
    add_variable, initialize = add_at.original(), init_at.original()

    @functools.wraps(add_variable)
    def add_hook(self, shape, initializer, dtype=None, aggregation="sum", name=None):
        strategy = tf.distribute.get_strategy()
        if not isinstance(strategy, DataParallelStrategy):
            return add_variable(self, shape, initializer, dtype, aggregation, name)
        _adding.metric = (strategy, aggregation)
        try:
            variable = add_variable(self, shape, initializer, dtype, aggregation, name)
        finally:
            _adding.metric = None
        # For when Keras makes its tf.Variable later (made in a stateless scope).
        variable._tf_smb_metric = (strategy, aggregation)  # pylint: disable=protected-access
        return variable

    @functools.wraps(initialize)
    def initialize_hook(self, value):
        metric = getattr(_adding, "metric", None) or getattr(self, "_tf_smb_metric", None)
        if metric is None:
            return initialize(self, value)
        strategy, aggregation = metric
        with strategy.scope(), _sync_on_read(aggregation):
            return initialize(self, value)

    add_at.replace(add_hook)
    init_at.replace(initialize_hook)


def install_build_before_first_step(state: threading.local) -> None:
    """For a Keras that builds models, metrics and optimizers only while tracing
    the first step (3.3): models of tf_smb strategies are built before their
    step functions are made, from the structure of the data of the epoch
    iterator made just before (as Keras 3.4+ does), so their variables are
    made eagerly, rank 0's initial values broadcast as for any other. Metric
    variables made meanwhile sum over workers when read (sync on read), as
    Keras 3.4+ makes them. `state`: a thread-local to pass the iterator in."""
    global _ACTIVE
    _ACTIVE = True
    from tf_smb.data_parallel import DataParallelStrategy  # pylint: disable=import-outside-toplevel
    symbolic_build = registry.locate(registry.SYMBOLIC_BUILD).original()
    epoch_iterator_at = registry.locate(registry.EPOCH_ITERATOR)
    init = epoch_iterator_at.original()

    @functools.wraps(init)
    def init_hook(self, *args, **kwargs):
        init(self, *args, **kwargs)
        state.last_epoch_iterator = self

    def builds_first(make):
        @functools.wraps(make)
        def hook(self, *args, **kwargs):
            epoch_iterator = getattr(state, "last_epoch_iterator", None)
            state.last_epoch_iterator = None
            strategy = registry.read(self, registry.MODEL_STRATEGY, None)
            if epoch_iterator is not None and isinstance(strategy, DataParallelStrategy):
                spec = epoch_iterator.data_adapter.get_tf_dataset().element_spec
                with strategy.scope(), phase.building_model():
                    symbolic_build(self, data_batch=spec)
            return make(self, *args, **kwargs)
        return hook

    _install_metric_variables_sync_on_read()
    _install_train_step_mark()
    _install_compute_loss_mark()
    _install_empty_batch_loss()
    _install_epoch_without_step()
    epoch_iterator_at.replace(init_hook)
    # As Keras 3.4+, fit and evaluate build first; predict builds in its trace.
    for hook in (registry.MAKE_TRAIN_FUNCTION, registry.MAKE_TEST_FUNCTION):
        found = registry.locate(hook)
        found.replace(builds_first(found.original()))
