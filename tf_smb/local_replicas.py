"""SingleCaffe's mode: many replicas as threads of one process, one copy of
the parameters, combined with the other processes through the box: the
ReplicaThreads layout of the one Extended class (tf_smb/replica_layout.py).

    strategy = tf_smb.SMBStrategy(local_replicas=3)   # 3 replicas per process

Each process runs `local_replicas` replicas, each on its own logical CPU
device (GPUs may come later: `devices` is the list to extend). TensorFlow's
mirrored runner traces one replica per Python thread and the replicas' ops
then run concurrently on the process's executor threads.

  * Variables: one copy per process, on the parameter device; every replica
    reads it. Trainable variables and optimizer state are
    AggregatingVariables (as in TensorFlow's CentralStorageStrategy): an
    assignment made in a replica is combined over all replicas and applied
    once (with no aggregation given, the first replica's assignment: what
    reading a MirroredVariable shows). Metric variables
    (synchronization=ON_READ) keep one small copy per replica, so replicas
    count without meeting; a read outside the replicas sums them, and over
    processes.
  * Gradients: the replicas' gradients are summed inside the process by the
    partitioned reduction (`tf_smb.ops.replica_sum`: part r of the output is
    summed by one thread from every replica's part r), then over processes
    through the box, as with one replica per process.
  * Input: the global batch is split over all replicas of all processes, as
    MultiWorkerMirroredStrategy splits it over its workers' devices.

Asynchronously (mode="async"): replicas do not combine their gradients. As
with one replica per process, each process trains on every N-th global batch
(N processes), split over its replicas, which are its replica group:
`num_replicas_in_sync` is `local_replicas`, so one batch's pushes together carry
the gradient of its mean loss.
With update="sgd" each replica hands its gradient to the process's
parameter-server thread and goes on; the thread applies the replicas' SGD (or
momentum) steps one at a time, in the order they came, so none is lost:
  * one process: to the one parameter copy (`tf_smb.ops.server_push`),
    copy-on-write (a value a replica already read is never changed under it,
    so no read is torn);
  * several processes: to the box (`tf_smb.ops.server_push_segment`), which
    holds the master copy as in the asynchronous mode with one replica per
    process (tf_smb/async_mode.py); each step first reads the box into the
    process's one copy, within the SSP clock's staleness bound.
A step starts only when at most `staleness` steps of this process's updates
are still pending. With update="delta" each replica's own optimizer step (any
Keras optimizer) is applied to the one copy in turn, in the step that computed
it (and its change pushed into the box with several processes).
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Dict, List, Sequence

import tensorflow as tf
from tensorflow.python.distribute import device_util
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import mirrored_run
from tensorflow.python.distribute import numpy_dataset
from tensorflow.python.distribute import ps_values
from tensorflow.python.distribute import values as values_lib
from tensorflow.python.eager import def_function
from tensorflow.python.framework import ops as framework_ops
from tensorflow.python.util import nest

from tf_smb import env as env_lib
from tf_smb import phase
from tf_smb import step_rows
from tf_smb import ops as smb_ops
from tf_smb.async_mode import sgd_step
from tf_smb.replica_layout import ReplicaLayout
from tf_smb.worker_mode import WorkerMode


def logical_cpu_devices(count: int) -> List[str]:
    """The names of `count` logical CPU devices, creating them when needed.

    TensorFlow fixes its devices when its runtime starts (the first op), so
    this must run before that, unless the user configured enough devices.

    Raises:
      ValueError: the runtime started with fewer logical CPU devices.
    """
    physical = tf.config.list_physical_devices("CPU")
    configured = tf.config.get_logical_device_configuration(physical[0])
    if configured is None or len(configured) < count:
        try:
            tf.config.set_logical_device_configuration(
                physical[0], [tf.config.LogicalDeviceConfiguration()] * count)
        except RuntimeError:
            pass  # runtime already started: checked below
    logical = tf.config.list_logical_devices("CPU")
    if len(logical) < count:
        raise ValueError(
            f"local_replicas={count} needs {count} logical CPU devices, but TensorFlow "
            f"started with {len(logical)}: its devices are fixed by the first op that "
            "runs. Create SMBStrategy(local_replicas=...) before any other TensorFlow "
            "work, or configure the devices first with "
            "tf.config.set_logical_device_configuration.")
    return [d.name for d in logical[:count]]


_COUNTING_ROWS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def _counting_rows(fn: Any) -> Any:
    """`fn`, run by each replica thread inside step_rows.replica_step of its own
    batch. A tf.function stays one (made once per function): the mirrored runner
    traces a tf.function's Python function once for all replicas, whereas a plain
    wrapper around it would nest a tf.function per replica (and Keras 3.3's step,
    a tf.function, would then sum its gradients inside it, which TensorFlow refuses)."""
    python_fn = fn.python_function if isinstance(fn, def_function.Function) else fn

    def counting(*args, **kwargs):
        with step_rows.replica_step(args, kwargs):
            return python_fn(*args, **kwargs)

    if not isinstance(fn, def_function.Function):
        return counting
    wrapped = _COUNTING_ROWS.get(fn)
    if wrapped is None:
        wrapped = _COUNTING_ROWS[fn] = def_function.function(
            functools.wraps(python_fn)(counting))
    return wrapped


def _unwrap(variable: Any) -> Any:
    """The variable inside an AggregatingVariable (the one copy), else itself."""
    return variable.get() if isinstance(variable, ps_values.AggregatingVariable) else variable


class ReplicaThreads(ReplicaLayout):
    """SMBStrategy(local_replicas=N): N replicas in this process as threads, one
    per device in `devices`, sharing one parameter copy on the first device.

    Args:
      devices: the replicas' devices (logical_cpu_devices).
      timeout_s: how long a wait for the parameter-server thread lasts.
    """

    def __init__(self, devices: Sequence[str],
                 timeout_s: float = smb_ops.DEFAULT_TIMEOUT_S) -> None:
        self.devices = tuple(device_util.canonicalize(d) for d in devices)
        self._timeout_s = timeout_s

    def variable_kwargs(self, kwargs: Dict[str, Any]) -> Dict[str, Any]:
        if kwargs.get("aggregation", tf.VariableAggregation.NONE) == tf.VariableAggregation.NONE:
            # An assignment inside the replicas with no aggregation (Keras'
            # batch-norm statistics) keeps the first replica's value, which is
            # what reading a MirroredVariable gives: its first copy.
            kwargs["aggregation"] = tf.VariableAggregation.ONLY_FIRST_REPLICA
        return kwargs

    def create_variable(self, strategy: Any, next_creator: Callable[..., Any],
                        kwargs: Dict[str, Any]) -> Any:
        """An AggregatingVariable around the one copy (as TensorFlow's
        CentralStorageStrategy makes): an assignment made in the replicas is
        combined by its aggregation and applied once."""
        aggregation = kwargs.pop("aggregation")

        def aggregating(**creator_kwargs):
            return ps_values.AggregatingVariable(strategy, next_creator(**creator_kwargs),
                                                aggregation)

        colocate_with = kwargs.get("colocate_with")
        if colocate_with is not None:
            if isinstance(colocate_with, numpy_dataset.SingleDevice):
                with framework_ops.device(colocate_with.device):
                    return aggregating(**kwargs)
            with framework_ops.device(None), framework_ops.colocate_with(colocate_with):
                return aggregating(**kwargs)
        with framework_ops.colocate_with(None, ignore_existing=True):
            with framework_ops.device(self.parameter_device):
                return aggregating(**kwargs)

    def replica_copies(self, next_creator: Callable[..., Any],
                       kwargs: Dict[str, Any]) -> List[Any]:
        """One copy per replica (metrics count without meeting)."""
        name = kwargs.get("name")
        copies: List[Any] = []
        for i, device in enumerate(self.devices):
            copy_kwargs = dict(kwargs)
            if i > 0:
                if name is not None:
                    copy_kwargs["name"] = f"{name}/replica_{i}"
                # Every copy starts from the first one's value.
                first = copies[0]
                copy_kwargs["initial_value"] = lambda first=first: tf.identity(first.value())
            with tf.device(device), tf.init_scope():
                copies.append(next_creator(**copy_kwargs))
        return copies

    def unwrap(self, variable: Any) -> Any:
        return _unwrap(variable)

    def run(self, strategy: Any, mode: WorkerMode, job: env_lib.JobInfo,
            fn: Callable[..., Any], args: Sequence[Any], kwargs: Dict[str, Any],
            weigh_rows: bool) -> Any:
        config = mode.config
        starts = []
        if (config is not None and config.staleness is not None
                and not phase.is_evaluating()):
            # Start once at most `staleness` steps of updates are pending.
            inputs = [t for t in tf.nest.flatten((args, kwargs)) if tf.is_tensor(t)]
            with tf.control_dependencies(inputs):
                starts.append(smb_ops.server_wait(config.staleness * self.local_replicas,
                                                  self._timeout_s))
        # Independent processes: the SSP clock, then the box's current values
        # into the one copy.
        with tf.control_dependencies(starts):
            starts = starts + mode.start_step(args, kwargs)
        if not tf.executing_eagerly() and isinstance(fn, def_function.Function):
            # A tf.function step inside the caller's tf.function (Keras 3.3's
            # one_step_on_data) is traced inline by each replica thread: wrapped
            # below, it would be a nested tf.function per replica, whose merge_call
            # (the gradients' sum, an async push) TensorFlow refuses.
            fn = fn.python_function
        if starts and not tf.executing_eagerly():  # (eagerly they already ran)
            inner = fn

            def fn(*a, **k):  # pylint: disable=function-redefined
                with tf.control_dependencies(starts):
                    return inner(*a, **k)
        if weigh_rows:
            fn = _counting_rows(fn)
        return mirrored_run.call_for_each_replica(strategy, fn, args, kwargs)

    def apply_update(self, var: Any, fn: Callable[..., Any], args: Sequence[Any],
                     kwargs: Dict[str, Any], group: bool, local_results: Callable) -> Any:
        var = _unwrap(var)
        with framework_ops.colocate_with(var), distribute_lib.UpdateContext(var.device):
            result = fn(var, *_primary(args), **_primary(kwargs))
            return result if group else nest.map_structure(local_results, result)

    def update_each_replica(self, mode: WorkerMode, var: Any, fn: Callable[..., Any],
                            args: Sequence[Any], kwargs: Dict[str, Any],
                            apply_update: Callable[..., Any]) -> List[Any]:
        """With update="sgd" each replica's gradient goes to the process's
        parameter-server thread (into the box with 2+ processes); otherwise
        each replica's own optimizer step is applied to the one copy in turn."""
        config = mode.config
        base = _unwrap(var)
        engine = mode.engine
        param = engine.segment_of(base) if engine is not None else None
        done: List[Any] = []
        for r in range(self.local_replicas):
            replica_args = distribute_utils.select_replica(r, args)
            replica_kwargs = distribute_utils.select_replica(r, kwargs)
            step = sgd_step(replica_args, config)
            with tf.control_dependencies(done):
                if step is not None:
                    grad, learning_rate = step
                    rule = "momentum" if config.momentum else "sgd"
                    if param is not None:
                        done.append(smb_ops.server_push_segment(
                            grad, param.name, learning_rate, rule=rule,
                            momentum=config.momentum))
                    else:
                        done.append(smb_ops.server_push(
                            base, grad, learning_rate, rule=rule,
                            momentum=config.momentum, consistent=config.consistent))
                else:
                    def apply_locally(a=replica_args, k=replica_kwargs):
                        return apply_update(var, fn, a, k, True)
                    result = mode.update(base, replica_args, apply_locally, True)
                    done.extend(o for o in tf.nest.flatten(result) if o is not None)
        return done

    def sum_local(self, parts: Sequence[Sequence[tf.Tensor]]) -> List[tf.Tensor]:
        """The partitioned reduction: part r of each sum is summed by one thread
        from every replica's part r (`tf_smb.ops.replica_sum`); a value the
        process holds once (one part) is its own sum."""
        if all(len(p) == 1 for p in parts):
            return [p[0] for p in parts]
        return smb_ops.replica_sum(parts)

    def finish(self, mode: WorkerMode) -> None:
        """Asynchronous: returns once the parameter-server thread applied every
        update handed to it."""
        if mode.asynchronous:
            smb_ops.server_wait(0, self._timeout_s)


def _primary(structured: Any) -> Any:
    """`structured` with every mirrored or per-replica value replaced by its
    first replica's (an update of the one copy applies once)."""
    def first(x: Any) -> Any:
        if isinstance(x, (values_lib.Mirrored, values_lib.PerReplica)):
            return x._primary  # pylint: disable=protected-access
        return x
    return nest.map_structure(first, structured)
