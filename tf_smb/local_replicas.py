"""SingleCaffe's mode: many replicas as threads of one process, one copy of
the parameters, combined with the other processes through the box.

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

Asynchronously (mode="async"): replicas do not combine their gradients.
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
from typing import Any, List, Optional, Sequence

import tensorflow as tf
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import mirrored_run
from tensorflow.python.distribute import parameter_server_strategy
from tensorflow.python.distribute import values as values_lib
from tensorflow.python.eager import def_function

from tensorflow.python.distribute import ps_values

from tf_smb import env as env_lib
from tf_smb import phase
from tf_smb import step_rows
from tf_smb import ops as smb_ops
from tf_smb.iterator_release import distributed_dataset, distributed_datasets_from_function
from tf_smb.async_mode import AsyncEngine, sgd_step
from tf_smb.collectives import Collectives
from tf_smb import data_parallel
from tf_smb.worker_mode import InStep, WorkerMode


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


class LocalReplicasExtended(data_parallel.WorkerRoles,
                            parameter_server_strategy.ParameterServerStrategyExtended):
    """The workings of SMBStrategy(local_replicas=N): N replicas in this process
    (one per device in `devices`), one parameter copy, many processes."""

    def __init__(self, container_strategy: "data_parallel.DataParallelStrategy",
                 job: env_lib.JobInfo, collectives: Collectives,
                 devices: Sequence[str], mode: Optional[WorkerMode] = None,
                 timeout_s: float = smb_ops.DEFAULT_TIMEOUT_S) -> None:
        super().__init__(container_strategy, compute_devices=list(devices),
                         parameter_device=devices[0])
        self._job = job
        self._collectives = collectives
        self._local = len(devices)
        # Independent: the replicas' updates go to the parameter-server thread
        # (and, with 2+ processes, to the box through the mode's engine).
        self._mode = mode or InStep()
        self._timeout_s = timeout_s
        # As DataParallelExtended: uneven shards end every worker's epoch together.
        self.experimental_enable_get_next_as_optional = True
        self.enable_partial_batch_handling = True

    # -- who we are ---------------------------------------------------------
    @property
    def collectives(self) -> Collectives:
        """What combines tensors across processes."""
        return self._collectives

    @property
    def worker_mode(self) -> WorkerMode:
        """How the replicas and processes train together."""
        return self._mode

    @property
    def async_engine(self) -> Optional[AsyncEngine]:
        """Asynchronous with 2+ processes: the engine of the box-held
        parameters; else None."""
        return self._mode.engine

    @property
    def _box_segments(self):
        """Asynchronous with 2+ processes: the box segment of every box-held
        variable, by `ref()` (what BackupAndRestore saves)."""
        return self._mode.segments

    @property
    def asynchronous(self) -> bool:
        """True when the replicas update the parameters without combining."""
        return self._mode.asynchronous

    def finish(self) -> None:
        """Asynchronous: returns once the parameter-server thread applied
        every update handed to it; with 2+ processes, then also waits for the
        other live processes and loads the box's final values (eagerly)."""
        if self._mode.asynchronous:
            smb_ops.server_wait(0, self._timeout_s)
        self._mode.finish()

    @property
    def local_replicas(self) -> int:
        """Replicas in this process."""
        return self._local

    def _in_multi_worker_mode(self) -> bool:
        # Asynchronous processes never wait for each other's input or logs.
        return self._mode.combines_processes(self._job)

    @property
    def _num_replicas_in_sync(self) -> int:
        return self._local * self._job.size

    def _get_local_replica_id(self, replica_id_in_sync_group: int) -> int:
        return replica_id_in_sync_group - self._job.rank * self._local

    def _get_replica_id_in_sync_group(self, replica_id: int) -> int:
        return self._job.rank * self._local + replica_id

    # -- variables ----------------------------------------------------------
    def _create_variable(self, next_creator, **kwargs):
        synchronization = kwargs.get("synchronization", tf.VariableSynchronization.AUTO)
        aggregation = kwargs.get("aggregation", tf.VariableAggregation.NONE)
        if (synchronization == tf.VariableSynchronization.ON_READ
                and aggregation != tf.VariableAggregation.NONE):
            return self._create_per_replica_variable(next_creator, **kwargs)
        if aggregation == tf.VariableAggregation.NONE:
            # An assignment inside the replicas with no aggregation (Keras'
            # batch-norm statistics) keeps the first replica's value, which is
            # what reading a MirroredVariable gives: its first copy.
            kwargs["aggregation"] = tf.VariableAggregation.ONLY_FIRST_REPLICA
        variable = super()._create_variable(next_creator, **kwargs)
        if self._job.size > 1 and not self._mode.place(_unwrap(variable)):
            data_parallel.broadcast_initial_value(self._collectives, variable)
        return variable

    def _create_per_replica_variable(self, next_creator, **kwargs):
        """A SyncOnReadVariable with one copy per local replica (metrics)."""
        aggregation = kwargs["aggregation"]
        name = kwargs.get("name")
        copies = []
        for i, device in enumerate(self._compute_devices):
            copy_kwargs = dict(kwargs)
            if i > 0:
                if name is not None:
                    copy_kwargs["name"] = f"{name}/replica_{i}"
                # Every copy starts from the first one's value.
                first = copies[0]
                copy_kwargs["initial_value"] = lambda first=first: tf.identity(first.value())
            with tf.device(device), tf.init_scope():
                copies.append(next_creator(**copy_kwargs))
        return values_lib.SyncOnReadVariable(self._container_strategy(), copies, aggregation)

    # -- input --------------------------------------------------------------
    def _make_input_context(self) -> distribute_lib.InputContext:
        return distribute_lib.InputContext(
            num_input_pipelines=self._job.size,
            input_pipeline_id=self._job.rank,
            num_replicas_in_sync=self._num_replicas_in_sync)

    def _experimental_distribute_dataset(self, dataset, options):
        own_share = self._mode.splits_input(self._job)
        return distributed_dataset(
            dataset,
            self._input_workers_with_options(options),
            self._container_strategy(),
            num_replicas_in_sync=self._num_replicas_in_sync,
            input_context=self._make_input_context() if own_share else None,
            options=options)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        return distributed_datasets_from_function(
            dataset_fn,
            self._input_workers_with_options(options),
            [self._make_input_context()],
            self._container_strategy(),
            options=options)

    def _experimental_distribute_values_from_function(self, value_fn):
        values = [value_fn(distribute_lib.ValueContext(
            self._get_replica_id_in_sync_group(r), self._num_replicas_in_sync))
                  for r in range(self._local)]
        return distribute_utils.regroup(values, always_wrap=True)

    # -- running a step -----------------------------------------------------
    def _call_for_each_replica(self, fn, args, kwargs):
        data_parallel.check_not_in_xla()
        config = self._mode.config
        starts = []
        if (config is not None and config.staleness is not None
                and not phase.is_evaluating()):
            # Start once at most `staleness` steps of updates are pending.
            inputs = [t for t in tf.nest.flatten((args, kwargs)) if tf.is_tensor(t)]
            with tf.control_dependencies(inputs):
                starts.append(smb_ops.server_wait(config.staleness * self._local,
                                                  self._timeout_s))
        # Independent processes: the SSP clock, then the box's current values
        # into the one copy.
        with tf.control_dependencies(starts):
            starts = starts + self._mode.start_step(args, kwargs)
        if starts:
            inner = fn

            def fn(*a, **k):  # pylint: disable=function-redefined
                with tf.control_dependencies(starts):
                    return inner(*a, **k)
        if not self._mode.asynchronous:
            fn = _counting_rows(fn)  # gradients weigh each replica's rows (step_rows.py)
        return mirrored_run.call_for_each_replica(self._container_strategy(), fn,
                                                  args, kwargs)

    def _update(self, var, fn, args, kwargs, group):
        base = _unwrap(var)
        per_replica = any(isinstance(a, values_lib.PerReplica)
                          for a in tf.nest.flatten((args, kwargs)))
        config = self._mode.config
        if config is None or not base.trainable:
            return super()._update(var, fn, args, kwargs, group)
        if not per_replica:  # one update for the process (e.g. weight decay)
            return self._mode.update(base, args, lambda: super(
                LocalReplicasExtended, self)._update(var, fn, args, kwargs, group), group)
        # Asynchronous: every replica's own update, none combined.
        engine = self._mode.engine
        param = engine.segment_of(base) if engine is not None else None
        done = []
        for r in range(self._local):
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
                        return super(LocalReplicasExtended, self)._update(var, fn, a, k, True)
                    result = (engine.update(base, replica_args, apply_locally, True)
                              if param is not None else apply_locally())
                    done.extend(o for o in tf.nest.flatten(result) if o is not None)
        result = tf.group(*done)
        return result if group else (result,)

    # -- reductions -----------------------------------------------------------
    def _replica_parts(self, value: Any) -> List[tf.Tensor]:
        """This process's parts of `value`: one per local replica for a
        distributed value, else the value itself (one part for the process)."""
        if isinstance(value, (values_lib.DistributedValues, tf.distribute.DistributedValues)):
            parts = list(value._values)  # pylint: disable=protected-access
        else:
            parts = [value]
        return [tf.convert_to_tensor(p) for p in parts]  # IndexedSlices densified

    def _combine(self, reduce_op: tf.distribute.ReduceOp,
                 values: Sequence[Any]) -> List[tf.Tensor]:
        """Sums (or averages) over local replicas, then over processes."""
        if not values:
            return []
        parts = [self._replica_parts(v) for v in values]
        for p in parts:
            data_parallel.check_reducible(p)
        combines = self._mode.combines_processes(self._job)
        with tf.device(self._variable_device):
            local = smb_ops.replica_sum(parts)
            if combines:
                data_parallel.check_not_in_xla()
                local = self._collectives.allreduce(local)
            if reduce_op == tf.distribute.ReduceOp.MEAN:
                processes = self._job.size if combines else 1
                counts = [len(p) * processes for p in parts]
                local = [s / tf.cast(n, s.dtype) if s.dtype.is_floating else s // n
                         for s, n in zip(local, counts)]
        return local

    def all_reduce(self, reduce_op: tf.distribute.ReduceOp,
                   values: Sequence[Any]) -> List[tf.Tensor]:
        """Sums (or averages) values over all replicas of all processes: in a
        replica, through its replica context; outside, over the values'
        local parts."""
        context = tf.distribute.get_replica_context()
        if context is not None and not isinstance(
                context, distribute_lib._DefaultReplicaContext):  # pylint: disable=protected-access
            return list(context.all_reduce(reduce_op, list(values)))
        return self._combine(reduce_op, values)

    def _mirrored(self, tensor: tf.Tensor) -> values_lib.Mirrored:
        return values_lib.Mirrored(tuple([tensor] * self._local))

    def _reduce_to(self, reduce_op, value, destinations, options):
        del destinations, options
        self._mode.check_combinable(self._job, "strategy.reduce (and extended.reduce_to)",
                                    value)
        flat = tf.nest.flatten(value)
        return tf.nest.pack_sequence_as(value, self._combine(reduce_op, flat))

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        del options
        if self._mode.asynchronous:
            # Asynchronous replicas keep their own gradients (ReplicaContext.all_reduce).
            return [v for v, _ in value_destination_pairs]
        summed = self._combine(reduce_op, [v for v, _ in value_destination_pairs])
        return [self._mirrored(s) for s in summed]

    def _gather_to_implementation(self, value, destinations, axis, options):
        del destinations, options
        self._mode.check_combinable(self._job, "strategy.gather")
        parts = self._replica_parts(value)
        with tf.device(self._variable_device):
            local = parts[0] if len(parts) == 1 else tf.concat(parts, axis=axis)
            if not self._mode.combines_processes(self._job):
                return tf.identity(local)
            return data_parallel.all_gather(self._collectives, local, axis,
                                            self._job.rank, self._job.size)
