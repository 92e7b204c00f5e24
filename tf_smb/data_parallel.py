"""The data-parallel machinery SMBStrategy and the reference HorovodStrategy
share: variables that start equal on every worker (broadcast from rank 0),
gradients summed over workers by a collectives backend (tf_smb/collectives.py),
sharded input, and reductions and gathers over workers. The two strategies
differ only in their backend, and in what SMBStrategy adds as the two policy
objects of the one Extended class: a replica layout (tf_smb/replica_layout.py:
one replica per process, or replica threads, tf_smb/local_replicas.py) and a
worker mode (tf_smb/worker_mode.py: what sync and async answer differently;
async's engine in tf_smb/async_mode.py).

    class MyStrategy(DataParallelStrategy):
        def __init__(self):
            job = ...                       # env_lib.JobInfo: rank and size
            keras_support.install_strategy_hooks(job)   # the top layer's part
            self._setup(job, DataParallelExtended(self, job, MyCollectives()))

How it plugs into TensorFlow and Keras 3 (what TF 2.21 / Keras 3.15 call is
listed in tests/test_tf_internals.py, which fails, saying what to change, when
a TensorFlow or Keras version moves it):
  * the extended class implements TF's StrategyExtendedV1 for this process's
    replicas (the layout's devices) and adds what a multi-worker strategy
    needs: world-sized `num_replicas_in_sync`, sharded input pipelines,
    cross-worker reductions and gathers;
  * metric variables (synchronization=ON_READ) are SyncOnReadVariables, so a
    read outside a replica (Keras' final `evaluate` results) sums them over
    all workers;
  * Keras optimizers created in the scope clip the gradient summed over
    workers (tf_smb/keras_support/optimizer.py; Keras itself clips each
    replica's part), and LossScaleOptimizer skips a step on every worker when
    any worker's gradients are not finite;
  * DataParallelStrategy subclasses tf.distribute.MultiWorkerMirroredStrategy
    only so that Keras 3 takes its multi-worker path for `predict` (gather
    rows from all workers) and per-step logs; it skips that class's
    `__init__` and uses none of its machinery.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import input_lib
from tensorflow.python.distribute import ps_values
from tensorflow.python.distribute import values as values_lib
from tensorflow.python.framework import ops as framework_ops
from tensorflow.python.ops import control_flow_util

from tf_smb import env as env_lib
from tf_smb import phase
from tf_smb.collectives import Collectives
from tf_smb.options import GradientClipping, check_gradient_clipping  # noqa: F401
from tf_smb.iterator_release import distributed_dataset, distributed_datasets_from_function
from tf_smb.replica_layout import OneReplica, ReplicaLayout
from tf_smb.worker_mode import InStep, WorkerMode

if TYPE_CHECKING:
    from tf_smb.async_mode import AsyncEngine, BoxSegment

SUPPORTED_DTYPES = (tf.float32, tf.float64, tf.float16, tf.bfloat16, tf.int32, tf.int64)

# Batch counts up to this are agreed exactly in int64 (size * count^2 fits).
_MAX_AGREED_BATCHES = 1 << 26


def check_not_in_xla() -> None:
    """Raises ValueError inside an XLA-compiled function (no XLA kernels)."""
    graph = framework_ops.get_default_graph()
    if control_flow_util.GraphOrParentsInXlaContext(graph):
        raise ValueError(
            "tf_smb's collectives have no XLA kernel, so they cannot run "
            "inside jit_compile=True. Set jit_compile=False: "
            "model.compile(..., jit_compile=False), or "
            "tf.function(..., jit_compile=False) for a custom loop.")


def _is_symbolic(value: Any) -> bool:
    """Whether `value` is a graph tensor (an initial value inside a trace)."""
    return isinstance(value, tf.Tensor) and not hasattr(value, "numpy")


def broadcast_initial_value(collectives: Collectives, variable: tf.Variable) -> None:
    """Makes rank 0's initial value of `variable` every worker's."""
    with tf.init_scope():
        if not tf.executing_eagerly():
            return  # TF1-style graph: initialisers run later, not here
        value = variable.read_value()
        if value.dtype not in SUPPORTED_DTYPES and value.dtype != tf.bool:
            return  # e.g. string or resource state: not model parameters
        variable.assign(collectives.broadcast([value], root=0)[0])


def all_gather(collectives: Collectives, local: tf.Tensor, axis: int, rank: int,
               size: int) -> tf.Tensor:
    """Concatenates every worker's tensor along `axis` (lengths may differ),
    each worker's part moved once (Collectives.allgather)."""
    moved = tf.experimental.numpy.moveaxis(local, axis, 0) if axis else local
    gathered = collectives.allgather(moved, rank, size)
    return tf.experimental.numpy.moveaxis(gathered, 0, axis) if axis else gathered


def check_reducible(tensors: Sequence[tf.Tensor]) -> None:
    """Raises InvalidArgumentError unless every tensor's dtype is one tf_smb sums."""
    for t in tensors:
        if t.dtype not in SUPPORTED_DTYPES:
            raise tf.errors.InvalidArgumentError(
                None, None,
                "tf_smb reduces float32, float64, float16, bfloat16, "
                f"int32 and int64 tensors; got {t.dtype.name}")


class WorkerRoles:
    """The worker roles of a tf_smb strategy's extended class (which has `_job`):
    rank 0 writes checkpoints and summaries; every worker initializes."""

    _job: env_lib.JobInfo

    @property
    def should_checkpoint(self) -> bool:
        return self._job.rank == 0

    @property
    def should_save_summary(self) -> bool:
        return self._job.rank == 0

    @property
    def experimental_should_init(self) -> bool:
        return True


class DataParallelExtended(WorkerRoles, distribute_lib.StrategyExtendedV1):
    """The workings of a DataParallelStrategy: the one Extended class of every
    tf_smb strategy, varied by two policy objects it asks instead of checking
    flags: where the process's replicas sit (a ReplicaLayout: one replica, or
    replica threads; tf_smb/replica_layout.py) and how the workers train
    together (a WorkerMode: in step, or independently; tf_smb/worker_mode.py).
    Every other rule (input sharding, variables starting equal, reductions,
    gathers, what async workers may combine) has one copy, here.

    Args:
      container_strategy: the strategy this belongs to.
      job: this worker's rank and the number of workers.
      collectives: what combines tensors across workers.
      layout: where this process's replicas sit; OneReplica("/cpu:0") when None.
      mode: how the workers train together; InStep when None.
        SMBStrategy(mode="async") gives an Independent one, whose engine holds
        the trainable variables in the box with 2+ workers.
    """

    def __init__(self, container_strategy: "DataParallelStrategy", job: env_lib.JobInfo,
                 collectives: Collectives, layout: Optional[ReplicaLayout] = None,
                 mode: Optional[WorkerMode] = None) -> None:
        super().__init__(container_strategy)
        self._job = job
        self._collectives = collectives
        self._replicas = layout or OneReplica()
        self._mode = mode or InStep()
        # Distributed iterators agree across workers on whether any worker
        # still has data, so uneven shards end every worker's epoch together.
        self.experimental_enable_get_next_as_optional = True
        self.enable_partial_batch_handling = True
        # Elastic jobs (tf_smb/keras_support/elastic.py): variables are made
        # equal when training starts, not at creation (a process that joins a
        # running job creates its variables while the others do not); and after
        # a change of the members, the first epoch's first batches done before
        # the last commit are skipped.
        self._equal_at_creation = True
        self._skip_batches = 0
        self._skipping: Optional["_SkipFirstBatches"] = None

    # -- who we are ---------------------------------------------------------
    @property
    def collectives(self) -> Collectives:
        """What combines tensors across workers."""
        return self._collectives

    @property
    def worker_mode(self) -> WorkerMode:
        """How the workers train together: in step or independently."""
        return self._mode

    @property
    def replica_layout(self) -> ReplicaLayout:
        """Where this process's replicas sit: one, or replica threads."""
        return self._replicas

    @property
    def local_replicas(self) -> int:
        """Replicas in this process."""
        return self._replicas.local_replicas

    @property
    def async_engine(self) -> Optional["AsyncEngine"]:
        """The asynchronous engine, or None when workers train in step."""
        return self._mode.engine

    @property
    def _box_segments(self) -> Dict[Any, "BoxSegment"]:
        """Async: the box parameter of every box-held variable, by `ref()`."""
        return self._mode.segments

    @property
    def steps(self) -> tf.Variable:
        """Async: the training steps this worker started."""
        return self._mode.require_engine("steps").steps

    @property
    def max_clock_gap(self) -> tf.Variable:
        """Async: the largest lead over the slowest worker this worker had
        when a step started."""
        return self._mode.require_engine("max_clock_gap").max_clock_gap

    def finish(self) -> None:
        """This process is done training: in async mode, after what the layout
        waits for (the parameter-server thread's updates), wait for the other
        live processes and load the box's final values (eagerly)."""
        self._replicas.finish(self._mode)
        self._mode.finish()

    def _in_multi_worker_mode(self) -> bool:
        # Asynchronous workers never wait for each other's input or logs.
        return self._mode.combines_processes(self._job)

    @property
    def _replicas_in_job(self) -> int:
        """Every replica of every process."""
        return self._replicas.local_replicas * self._job.size

    @property
    def _num_replicas_in_sync(self) -> int:
        # The replicas whose gradients are combined. Asynchronously a process
        # is a replica group of its own: Keras then divides the loss by its own
        # replicas only, and one batch's pushes carry the batch's full gradient.
        processes = self._job.size if self._mode.combines_processes(self._job) else 1
        return self._replicas.local_replicas * processes

    def _get_local_replica_id(self, replica_id_in_sync_group: int) -> int:
        return replica_id_in_sync_group - self._job.rank * self._replicas.local_replicas

    def _get_replica_id_in_sync_group(self, replica_id: int) -> int:
        return self._job.rank * self._replicas.local_replicas + replica_id

    @property
    def worker_devices(self) -> Tuple[str, ...]:
        return self._replicas.devices

    @property
    def worker_devices_by_replica(self) -> List[List[str]]:
        return [[d] for d in self._replicas.devices]

    @property
    def parameter_devices(self) -> Tuple[str, ...]:
        return (self._replicas.parameter_device,)

    def non_slot_devices(self, var_list):
        del var_list
        return (self._replicas.parameter_device,)

    @property
    def experimental_between_graph(self) -> bool:
        return False

    @property
    def _global_batch_size(self) -> bool:
        return True

    # -- variables ----------------------------------------------------------
    def _create_variable(self, next_creator, **kwargs):
        strategy = self._container_strategy()
        synchronization = kwargs.get("synchronization", tf.VariableSynchronization.AUTO)
        aggregation = kwargs.get("aggregation", tf.VariableAggregation.NONE)
        if (synchronization == tf.VariableSynchronization.ON_READ
                and aggregation != tf.VariableAggregation.NONE):
            # Replica-local state (metrics): one copy per local replica, which
            # sums/averages over replicas and workers when read outside a replica.
            return values_lib.SyncOnReadVariable(
                strategy, self._replicas.replica_copies(next_creator, kwargs), aggregation)
        kwargs = self._replicas.variable_kwargs(kwargs)
        traced = (self._job.size > 1 and self._equal_at_creation
                  and _is_symbolic(kwargs.get("initial_value")))
        if traced and not self._mode.keeps_in_box(kwargs.get("trainable", True)):
            # Made while a tf.function traces (Keras 3.3 builds optimizers and
            # unbuilt models in the first step): the value exists only when the
            # function first runs, so rank 0's is broadcast in its initializer.
            kwargs["initial_value"] = self._collectives.broadcast(
                [kwargs["initial_value"]], root=0)[0]
        variable = self._replicas.create_variable(strategy, next_creator, kwargs)
        if not self._equal_at_creation:  # elastic: made alone, equal once fit syncs them
            self._mode.note_variable(self._replicas.unwrap(variable))
        elif (self._job.size > 1 and not self._mode.place(self._replicas.unwrap(variable))
              and not traced):
            broadcast_initial_value(self._collectives, variable)
        return variable

    def _validate_colocate_with_variable(self, colocate_with_variable):
        distribute_utils.validate_colocate(colocate_with_variable, self)

    def _local_results(self, value):
        if isinstance(value, (values_lib.DistributedValues, tf.distribute.DistributedValues)):
            return value._values  # pylint: disable=protected-access
        return (value,)

    def value_container(self, value):
        # A replica thread's variable is the one copy inside an AggregatingVariable.
        container = getattr(value, "_aggregating_container", None)
        if container is not None and not isinstance(value, ps_values.AggregatingVariable):
            wrapper = container()
            if wrapper is not None:
                return wrapper
        return value

    def read_var(self, replica_local_var):
        return tf.identity(replica_local_var)

    def _broadcast_to(self, tensor, destinations):
        del destinations
        if isinstance(tensor, (float, int)) or self._replicas.local_replicas == 1:
            return tensor
        return _mirrored([tensor] * self._replicas.local_replicas)

    # -- input --------------------------------------------------------------
    def _input_workers_with_options(self, options=None):
        host = self._replicas.host_device
        if not options or options.experimental_fetch_to_device:
            return input_lib.InputWorkers([(host, self._replicas.devices)])
        return input_lib.InputWorkers([(host, (host,) * self._replicas.local_replicas)])

    @property
    def _input_workers(self):
        return self._input_workers_with_options()

    def _make_input_context(self) -> distribute_lib.InputContext:
        return distribute_lib.InputContext(
            num_input_pipelines=self._job.size,
            input_pipeline_id=self._job.rank,
            num_replicas_in_sync=self._replicas_in_job)

    def _experimental_distribute_dataset(self, dataset, options):
        if self._skip_batches:  # the training data of an elastic fit that resumes
            count, self._skip_batches = self._skip_batches, 0
            self._skipping = _SkipFirstBatches(count, dataset, lambda d: (
                self._distribute_global_batches(d, options)))
            return self._skipping
        return self._distribute_global_batches(dataset, options)

    def skip_batches(self, count: int) -> None:
        """Elastic fit: the next dataset distributed (fit's training data) skips
        its first `count` global batches until `stop_skipping`."""
        self._skip_batches = count
        self.stop_skipping()

    def stop_skipping(self) -> None:
        """The dataset `skip_batches` made gives every batch from its next
        iteration on (call it at the end of the first epoch)."""
        if self._skipping is not None:
            self._skipping.stop()
            self._skipping = None

    @property
    def resuming(self) -> bool:
        """Whether the next dataset distributed skips batches (`skip_batches`)."""
        return self._skip_batches > 0

    @property
    def skipping_dataset(self) -> Optional["_SkipFirstBatches"]:
        """The dataset `skip_batches` made, while it skips."""
        return self._skipping

    def _distribute_global_batches(self, dataset, options):
        if self._replicas_in_job == 1:
            # One replica in all: nothing to split. The plain dataset, as the
            # default strategy gives it, spares tf.distribute's iterator
            # wrappers (measured: ~20% of an MLP's fit throughput).
            return dataset
        whole = self._mode.whole_batches(dataset, self._job)
        if whole is not None:  # async: the batches this process reads whole
            return self._distributed(whole, options,
                                     num_replicas_in_sync=self._replicas.local_replicas)
        # Rebatch the global batch over every replica and shard it by worker,
        # as MultiWorkerMirroredStrategy does; the iterator then ends every
        # worker's epoch together even when shards have unequal length.
        return self._end_together_without_asking(self._distributed(
            dataset, options, num_replicas_in_sync=self._replicas_in_job,
            input_context=self._make_input_context()))

    def _end_together_without_asking(self, distributed: Any) -> Any:
        """`distributed`, whose iterators skip the per-step question "has any
        worker still data?" when every worker's part has the same known number
        of batches (a rebatched dataset of known length: its last batches may
        be empty on some workers, but they are batches), so epochs end together
        anyway. That question is a collective each step: across nodes it cost
        ~3 ms of a small model's step. Asked once here, eagerly, of all workers
        alike; otherwise (lengths unknown or uneven) the iterators ask as before.
        """
        cardinality = getattr(distributed, "_cardinality", None)
        if (self._job.size == 1 or not tf.executing_eagerly() or cardinality is None
                or not getattr(distributed, "_enable_get_next_as_optional", False)):
            return distributed
        batches = int(cardinality)
        # Equal on every worker iff size * sum(c^2) == sum(c)^2; a count that
        # is unknown, infinite or too large for exact squares sums in `odd`.
        odd = int(batches < 0 or batches > _MAX_AGREED_BATCHES)
        known = 0 if odd else batches
        odd_sum, total, squares = (int(v) for v in self._collectives.allreduce(
            [tf.constant([odd, known, known * known], tf.int64)])[0].numpy())
        if odd_sum == 0 and self._job.size * squares == total * total:
            distributed._enable_get_next_as_optional = False  # pylint: disable=protected-access
        return distributed

    def training_batches(self, num_batches: int,
                         dataset: Optional[tf.data.Dataset] = None) -> int:
        """How many of a dataset's `num_batches` global batches this process
        trains on in an epoch: every one (each process takes its part of each),
        or in async mode every size-th (`_experimental_distribute_dataset`)."""
        return self._mode.training_batches(num_batches, self._job, dataset)

    def _distributed(self, dataset, options, **kwargs):
        """TensorFlow's distributed dataset of `dataset` for this process's devices,
        with the layout's input options unless the user gave some (Keras gives
        none). The dataset's autotuning thread is off unless the user's options
        say otherwise (tf_smb/iterator_release.py: it made every epoch start late).
        """
        if options is None:
            options = self._replicas.default_input_options()
        return distributed_dataset(
            dataset, self._input_workers_with_options(options),
            self._container_strategy(), options=options, **kwargs)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        if self._replicas_in_job == 1:
            return dataset_fn(self._make_input_context())
        distributed = distributed_datasets_from_function(
            dataset_fn,
            self._input_workers_with_options(options),
            [self._make_input_context()],
            self._container_strategy(),
            options=options)
        if self._mode.processes_apart(self._job):  # async workers ask nothing of each other
            return distributed
        return self._end_together_without_asking(distributed)

    def _experimental_distribute_values_from_function(self, value_fn):
        values = [value_fn(distribute_lib.ValueContext(
            self._get_replica_id_in_sync_group(r), self._replicas_in_job))
                  for r in range(self._replicas.local_replicas)]
        if len(values) == 1:
            return values[0]
        return distribute_utils.regroup(values, always_wrap=True)

    # -- running a step -----------------------------------------------------
    def _call_for_each_replica(self, fn, args, kwargs):
        if self._replicas_in_job > 1:
            check_not_in_xla()
        # Combined gradients weigh each replica's rows (tf_smb/step_rows.py).
        weigh_rows = not self._mode.asynchronous and self._num_replicas_in_sync > 1
        return self._replicas.run(self._container_strategy(), self._mode, self._job,
                                fn, args, kwargs, weigh_rows)

    def _apply_update(self, var, fn, args, kwargs, group):
        return self._replicas.apply_update(var, fn, args, kwargs, group, self._local_results)

    def _update(self, var, fn, args, kwargs, group):
        if self._mode.asynchronous and any(
                isinstance(a, values_lib.PerReplica) for a in tf.nest.flatten((args, kwargs))):
            # Asynchronous: every replica's own update, none combined.
            result = tf.group(*self._replicas.update_each_replica(
                self._mode, var, fn, args, kwargs, self._apply_update))
            return result if group else (result,)
        return self._mode.update(self._replicas.unwrap(var), args, lambda: self._apply_update(
            var, fn, args, kwargs, group), group)

    def _update_non_slot(self, colocate_with, fn, args, kwargs, group):
        del colocate_with
        device = self._replicas.parameter_device
        with framework_ops.device(device), distribute_lib.UpdateContext(device):
            result = fn(*args, **kwargs)
            return result if group else tf.nest.map_structure(self._local_results, result)

    # -- reductions -----------------------------------------------------------
    def _local_parts(self, value: Any) -> List[tf.Tensor]:
        """This process's parts of `value`: one per local replica for a
        distributed value, else the value itself (IndexedSlices densified)."""
        if isinstance(value, (values_lib.DistributedValues, tf.distribute.DistributedValues)):
            parts = list(value._values)  # pylint: disable=protected-access
        else:
            parts = [value]
        return [tf.convert_to_tensor(p) for p in parts]

    def _combine_values(self, reduce_op: tf.distribute.ReduceOp,
                        values: Sequence[Any]) -> List[tf.Tensor]:
        """Sums (or averages) values over this process's replicas, then over
        the processes when they combine (sync mode, 2+ workers), in one collective."""
        if not values:
            return []
        parts = [self._local_parts(v) for v in values]
        for p in parts:
            check_reducible(p)
        combines = self._mode.combines_processes(self._job)
        with framework_ops.device(self._replicas.parameter_device):
            local = self._replicas.sum_local(parts)
            if combines:
                check_not_in_xla()
                local = self._collectives.allreduce(local)
            else:
                local = [tf.identity(t) for t in local]
            if reduce_op == tf.distribute.ReduceOp.MEAN:
                processes = self._job.size if combines else 1
                counts = [len(p) * processes for p in parts]
                local = [s if n == 1 else s / tf.cast(n, s.dtype) if s.dtype.is_floating
                         else s // n for s, n in zip(local, counts)]
        return local

    def all_reduce(self, reduce_op: tf.distribute.ReduceOp,
                   values: Sequence[Any]) -> List[tf.Tensor]:
        """Sums (or averages) values over every replica of every process that
        combines: in a replica thread, through its replica context (all threads
        meet); otherwise over the values' local parts, in one collective."""
        context = tf.distribute.get_replica_context()
        if self._replicas.local_replicas > 1 and context is not None and not isinstance(
                context, distribute_lib._DefaultReplicaContext):  # pylint: disable=protected-access
            return list(context.all_reduce(reduce_op, list(values)))
        return self._combine_values(reduce_op, values)

    def _reduce_to(self, reduce_op, value, destinations, options):
        del destinations, options
        self._mode.check_combinable(self._job, "strategy.reduce (and extended.reduce_to)",
                                    value)
        # Keras passes whole structures here (e.g. an (x, y) batch).
        flat = tf.nest.flatten(value)
        return tf.nest.pack_sequence_as(value, self._combine_values(reduce_op, flat))

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        del options
        values = [v for v, _ in value_destination_pairs]
        if self._mode.asynchronous:
            # Asynchronous replicas keep their own gradients (ReplicaContext.all_reduce).
            return [v if isinstance(v, values_lib.DistributedValues) else tf.convert_to_tensor(v)
                    for v in values]
        summed = self._combine_values(reduce_op, values)
        if self._replicas.local_replicas == 1:
            return summed
        return [_mirrored([s] * self._replicas.local_replicas) for s in summed]

    def _gather_to_implementation(self, value, destinations, axis, options):
        del destinations, options
        # (Keras gathers only for synchronous multi-worker predict.)
        self._mode.check_combinable(self._job, "strategy.gather")
        parts = self._local_parts(value)
        with framework_ops.device(self._replicas.parameter_device):
            local = parts[0] if len(parts) == 1 else tf.concat(parts, axis=axis)
            if not self._mode.combines_processes(self._job):
                return tf.identity(local)
            return all_gather(self._collectives, local, axis, self._job.rank, self._job.size)


class _SkipFirstBatches:
    """A distributed dataset whose iterations skip the first `count` global
    batches while `active` (an elastic job resuming mid-epoch from its last
    commit: Keras iterates once to build, then for the first epoch); later
    ones, and everything else, are `distribute(dataset)`'s."""

    def __init__(self, count: int, dataset: tf.data.Dataset,
                 distribute: Callable[[tf.data.Dataset], Any]) -> None:
        self.count = count
        self.active = True
        self.on_stop: Callable[[], None] = lambda: None
        self._skipped = distribute(dataset.skip(count))
        self._whole = distribute(dataset)

    def stop(self) -> None:
        """Every batch from the next iteration on."""
        self.active = False
        self.on_stop()

    def __iter__(self):
        return iter(self._skipped if self.active else self._whole)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._whole, name)


def _mirrored(tensors: Sequence[tf.Tensor]) -> values_lib.Mirrored:
    """One value for every local replica."""
    return values_lib.Mirrored(tuple(tensors))


# The strategies of 2+ workers made in this process (weakly): a Keras model
# built outside every scope is then most likely one meant to be inside one.
_MULTI_WORKER: "weakref.WeakSet[DataParallelStrategy]" = weakref.WeakSet()


def multi_worker_strategies() -> List["DataParallelStrategy"]:
    """The live tf_smb strategies of 2+ workers in this process."""
    return list(_MULTI_WORKER)


class DataParallelStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """What SMBStrategy and the reference HorovodStrategy share: one replica
    per process, variables broadcast from rank 0, gradients combined by the
    extended's collectives backend (see DataParallelExtended).

    Subclasses build a DataParallelExtended and call `_setup` from their
    `__init__` (MultiWorkerMirroredStrategy's own `__init__` is not run).
    """

    def _setup(self, job: env_lib.JobInfo, extended: DataParallelExtended,
               gradient_clipping: GradientClipping = "after_sum") -> None:
        """Makes this strategy run `extended` for `job` (`gradient_clipping`
        checked by the subclass: tf_smb/options.py)."""
        self._job = job
        self._gradient_clipping = gradient_clipping
        self._elastic: Optional[Any] = None
        self._elastic_fit: Optional[Any] = None
        if job.size > 1:
            _MULTI_WORKER.add(self)
        # Skip MultiWorkerMirroredStrategy.__init__ (it would set up TF's own
        # collectives and cluster): tf.distribute.Strategy's is all we need.
        tf.distribute.Strategy.__init__(self, extended)  # pylint: disable=non-parent-init-called

    def _make_elastic(self, worker: Any, elastic_fit: Any) -> None:
        """Makes this strategy follow the generations of the elastic job of
        `worker` (a tf_smb.elastic.worker.ElasticWorker), Keras `fit` going on
        through them by `elastic_fit` (the Keras layer's): see `rejoined`."""
        self._elastic = worker
        self._elastic_fit = elastic_fit
        self.extended._equal_at_creation = False  # pylint: disable=protected-access
        _MULTI_WORKER.add(self)

    @property
    def elastic_worker(self) -> Optional[Any]:
        """This process's side of its elastic job (the members may change), or
        None: the job's members are fixed."""
        return self._elastic

    @property
    def elastic_fit(self) -> Any:
        """How Keras `fit` goes on through member changes (elastic strategies)."""
        return self._elastic_fit

    def rejoined(self, job: env_lib.JobInfo) -> None:
        """Makes this strategy work in `job`, the next generation of its elastic
        job, which this process joined (tf_smb.ops.rejoin): its rank and size,
        input sharding and reductions are the new job's from then on. Functions
        traced before keep the old size: trace them again (Keras fit does so)."""
        if self._elastic is None:
            raise ValueError("rejoined: this strategy is not elastic (SMBStrategy(elastic="
                             "True) under tf_smb.run --min-np/--max-np/...)")
        self._job = job
        self.extended._job = job  # pylint: disable=protected-access

    @property
    def rank(self) -> int:
        """This worker's index."""
        return self._job.rank

    @property
    def size(self) -> int:
        """The number of workers."""
        return self._job.size

    @property
    def gradient_clipping(self) -> GradientClipping:
        """Where Keras optimizers created in this strategy's scope clip
        (`clipnorm`, `clipvalue`, `global_clipnorm`): "after_sum" clips the
        gradient summed over workers, as one process on the global batch does;
        "per_worker" clips each worker's part before the sum, as Keras does
        under tf.distribute.MirroredStrategy."""
        return self._gradient_clipping

    def reduce(self, reduce_op, value, axis):
        """Reduces `value` over workers (and along `axis` when it has one).

        Keras 3 reduces every step's scalar logs with axis=0; a scalar has no
        axis 0, so it is reduced over workers only. Input batches (PerReplica
        values from a distributed dataset) differ in shape between workers and
        cannot be combined: Keras reduces one only to learn its structure, so
        this worker's batch is returned.

        Raises:
          ValueError: in SMBStrategy(mode="async"), whose workers are not in
            step (reading a metric still gives this worker's value).
        """
        one_replica = self.extended.local_replicas == 1
        if (any(isinstance(v, values_lib.PerReplica) for v in tf.nest.flatten(value))
                and (one_replica or phase.is_building_model())):
            return tf.nest.map_structure(
                lambda v: v.values[0] if isinstance(v, values_lib.PerReplica) else v,
                value)
        parts = [p for v in tf.nest.flatten(value)
                 for p in (v.values if isinstance(v, values_lib.PerReplica) else (v,))]
        if axis is not None and all(
                getattr(p, "shape", None) is not None and p.shape.rank == 0 for p in parts):
            axis = None
        return super().reduce(reduce_op, value, axis)

    def barrier(self) -> None:
        """Returns once every worker has reached it (call it eagerly, on every worker)."""
        if self._job.size > 1:
            self.extended.collectives.barrier()

    @property
    def cluster_resolver(self) -> None:
        """None: no cluster resolver; the launcher tells each process its rank
        and the number of workers (tf_smb.env)."""
        return None

    def __deepcopy__(self, memo: Dict[int, Any]) -> "DataParallelStrategy":
        # Strategies are shared, not copied (Keras deep-copies configs).
        memo[id(self)] = self
        return self
