"""The data-parallel machinery SMBStrategy and the reference HorovodStrategy
share: one replica per process, variables that start equal on every worker
(broadcast from rank 0), gradients summed over workers by a collectives
backend (tf_smb/collectives.py), sharded input, and reductions and gathers
over workers. The two strategies differ only in their backend, and in
SMBStrategy's asynchronous mode (tf_smb/async_mode.py), which plugs in here as a
worker mode (tf_smb/worker_mode.py: what sync and async answer differently).

    class MyStrategy(DataParallelStrategy):
        def __init__(self):
            job = ...                       # env_lib.JobInfo: rank and size
            keras_support.install_strategy_hooks(job)   # the top layer's part
            self._setup(job, DataParallelExtended(self, job, MyCollectives()))

How it plugs into TensorFlow and Keras 3 (what TF 2.21 / Keras 3.15 call is
listed in tests/test_tf_internals.py, which fails, saying what to change, when
a TensorFlow or Keras version moves it):
  * the extended class builds on TF's OneDeviceExtended (one local device) and
    adds what a multi-worker strategy needs: world-sized `num_replicas_in_sync`,
    sharded input pipelines, cross-worker reductions and gathers;
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

import contextlib
import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Literal, Optional, Sequence

import tensorflow as tf
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import one_device_strategy
from tensorflow.python.distribute import values as values_lib
from tensorflow.python.framework import ops as framework_ops
from tensorflow.python.ops import control_flow_util

from tf_smb import env as env_lib
from tf_smb import phase
from tf_smb import step_rows
from tf_smb.collectives import Collectives
from tf_smb.options import GradientClipping, check_gradient_clipping  # noqa: F401
from tf_smb.iterator_release import distributed_dataset, distributed_datasets_from_function
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


class DataParallelExtended(WorkerRoles, one_device_strategy.OneDeviceExtended):
    """The workings of a DataParallelStrategy: one local device, many workers.

    Args:
      container_strategy: the strategy this belongs to.
      job: this worker's rank and the number of workers.
      collectives: what combines tensors across workers.
      device: the local device.
      mode: how the workers train together (tf_smb/worker_mode.py); InStep
        when None. SMBStrategy(mode="async") with 2+ workers gives an
        Independent one whose engine holds the trainable variables in the box.
    """

    def __init__(self, container_strategy: "DataParallelStrategy", job: env_lib.JobInfo,
                 collectives: Collectives, device: str = "/cpu:0",
                 mode: Optional[WorkerMode] = None) -> None:
        super().__init__(container_strategy, device)
        self._job = job
        self._collectives = collectives
        self._mode = mode or InStep()
        # Distributed iterators agree across workers on whether any worker
        # still has data, so uneven shards end every worker's epoch together.
        self.experimental_enable_get_next_as_optional = True
        self.enable_partial_batch_handling = True

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

    def _in_multi_worker_mode(self) -> bool:
        # Asynchronous workers never wait for each other's input or logs.
        return self._mode.combines_processes(self._job)

    @property
    def _num_replicas_in_sync(self) -> int:
        # Asynchronously each worker is a replica group of its own: Keras then
        # does not divide the loss, and a push carries the full gradient.
        return self._job.size if self._mode.combines_processes(self._job) else 1

    def _get_local_replica_id(self, replica_id_in_sync_group: int) -> int:
        return replica_id_in_sync_group - self._job.rank

    # -- variables ----------------------------------------------------------
    def _create_variable(self, next_creator, **kwargs):
        if kwargs.get("synchronization",
                      tf.VariableSynchronization.AUTO) == tf.VariableSynchronization.AUTO:
            # As under MirroredStrategy: every worker writes its copy in step.
            kwargs["synchronization"] = tf.VariableSynchronization.ON_WRITE
        synchronization = kwargs["synchronization"]
        aggregation = kwargs.get("aggregation", tf.VariableAggregation.NONE)
        if (synchronization == tf.VariableSynchronization.ON_READ
                and aggregation != tf.VariableAggregation.NONE):
            # Worker-local state (metrics) that sums/averages over workers
            # when read outside a replica.
            local = super()._create_variable(next_creator, **kwargs)
            return values_lib.SyncOnReadVariable(
                self._container_strategy(), [local], aggregation)
        traced = self._job.size > 1 and _is_symbolic(kwargs.get("initial_value"))
        if traced and not self._mode.keeps_in_box(kwargs.get("trainable", True)):
            # Made while a tf.function traces (Keras 3.3 builds optimizers and
            # unbuilt models in the first step): the value exists only when the
            # function first runs, so rank 0's is broadcast in its initializer.
            kwargs["initial_value"] = self._collectives.broadcast(
                [kwargs["initial_value"]], root=0)[0]
        variable = super()._create_variable(next_creator, **kwargs)
        if self._job.size > 1 and not self._mode.place(variable) and not traced:
            broadcast_initial_value(self._collectives, variable)
        return variable

    def _local_results(self, value):
        if isinstance(value, (values_lib.DistributedValues, tf.distribute.DistributedValues)):
            return value._values  # pylint: disable=protected-access
        return (value,)

    # -- input --------------------------------------------------------------
    def _make_input_context(self) -> distribute_lib.InputContext:
        return distribute_lib.InputContext(
            num_input_pipelines=self._job.size,
            input_pipeline_id=self._job.rank,
            num_replicas_in_sync=self._job.size)

    def _experimental_distribute_dataset(self, dataset, options):
        if self._job.size == 1:
            # One worker: nothing to shard. The plain dataset, as the default
            # strategy gives it, spares tf.distribute's iterator wrappers
            # (measured: ~20% of an MLP's fit throughput).
            return dataset
        whole = self._mode.whole_batches(dataset, self._job)
        if whole is not None:  # async: the batches this worker reads whole
            return self._distributed(whole, options)
        # Rebatch the global batch to global/size and shard it by worker, as
        # MultiWorkerMirroredStrategy does; the iterator then ends every
        # worker's epoch together even when shards have unequal length.
        return self._end_together_without_asking(self._distributed(
            dataset, options, num_replicas_in_sync=self._job.size,
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
        if not tf.executing_eagerly() or cardinality is None or not getattr(
                distributed, "_enable_get_next_as_optional", False):
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
        """How many of a dataset's `num_batches` global batches this worker
        trains on in an epoch: every one (each worker takes its part of each),
        or in async mode every size-th (`_experimental_distribute_dataset`)."""
        return self._mode.training_batches(num_batches, self._job, dataset)

    def _distributed(self, dataset, options, **kwargs):
        """TensorFlow's distributed dataset of `dataset` for this worker's one device.

        Without options from the user (Keras passes none) the worker iterates
        the dataset itself rather than through a MultiDeviceIterator, which one
        device does not need: making one took ~45 ms, and Keras makes two per
        epoch, against ~1 ms (2 workers, benchmarks/epoch_time.py). The
        dataset's autotuning thread is off unless the user's options say
        otherwise (tf_smb/iterator_release.py: it made every epoch start late).
        """
        if options is None:
            options = tf.distribute.InputOptions(
                experimental_fetch_to_device=False,
                experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA)
        return distributed_dataset(
            dataset, self._input_workers_with_options(options),
            self._container_strategy(), options=options, **kwargs)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        if self._job.size == 1:
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
        return value_fn(distribute_lib.ValueContext(self._job.rank, self._job.size))

    # -- running a step -----------------------------------------------------
    def _call_for_each_replica(self, fn, args, kwargs):
        if self._job.size > 1:
            check_not_in_xla()
        strategy = self._container_strategy()
        # Multi-worker input arrives as PerReplica values of one local replica.
        args = distribute_utils.select_replica(0, args)
        kwargs = distribute_utils.select_replica(0, kwargs)
        with contextlib.ExitStack() as stack:
            stack.enter_context(framework_ops.device(self._device))
            stack.enter_context(_WorkerReplicaContext(strategy, self._job.rank))
            if self._mode.combines_processes(self._job):
                # Gradients weigh this worker's rows (tf_smb/step_rows.py).
                stack.enter_context(step_rows.replica_step(args, kwargs))
            return self._mode.run_step(fn, args, kwargs)

    def _update(self, var, fn, args, kwargs, group):
        return self._mode.update(var, args, lambda: super(DataParallelExtended, self)._update(
            var, fn, args, kwargs, group), group)

    # -- reductions -----------------------------------------------------------
    def _local_tensor(self, value: Any) -> tf.Tensor:
        if isinstance(value, (values_lib.DistributedValues, tf.distribute.DistributedValues)):
            value = value._values[0]  # pylint: disable=protected-access
        if isinstance(value, tf.IndexedSlices):
            value = tf.convert_to_tensor(value)
        return tf.convert_to_tensor(value)

    def all_reduce(self, reduce_op: tf.distribute.ReduceOp,
                   values: Sequence[Any]) -> List[tf.Tensor]:
        """Sums (or averages) local values over all workers, in one collective.

        Local only (an identity) for one worker and in async mode.
        """
        tensors = [self._local_tensor(v) for v in values]
        if not tensors or not self._mode.combines_processes(self._job):
            # One worker, or asynchronous workers: nothing to combine.
            return [tf.identity(t) for t in tensors]
        check_not_in_xla()
        check_reducible(tensors)
        summed = self._collectives.allreduce(tensors)
        if reduce_op == tf.distribute.ReduceOp.MEAN:
            summed = [s / tf.cast(self._job.size, s.dtype) if s.dtype.is_floating
                      else s // self._job.size for s in summed]
        return summed

    def _reduce_to(self, reduce_op, value, destinations, options):
        del destinations, options
        self._mode.check_combinable(self._job, "strategy.reduce (and extended.reduce_to)",
                                    value)
        # Keras passes whole structures here (e.g. an (x, y) batch).
        flat = tf.nest.flatten(value)
        return tf.nest.pack_sequence_as(value, self.all_reduce(reduce_op, flat))

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        del options
        return self.all_reduce(reduce_op, [v for v, _ in value_destination_pairs])

    def _gather_to_implementation(self, value, destinations, axis, options):
        del destinations, options
        # (Keras gathers only for synchronous multi-worker predict.)
        self._mode.check_combinable(self._job, "strategy.gather")
        local = self._local_tensor(value)
        if self._job.size == 1:
            return tf.identity(local)
        return all_gather(self._collectives, local, axis, self._job.rank, self._job.size)

# The strategies of 2+ workers made in this process (weakly): a Keras model
# built outside every scope is then most likely one meant to be inside one.
_MULTI_WORKER: "weakref.WeakSet[DataParallelStrategy]" = weakref.WeakSet()


def multi_worker_strategies() -> List["DataParallelStrategy"]:
    """The live tf_smb strategies of 2+ workers in this process."""
    return list(_MULTI_WORKER)


class _WorkerReplicaContext(distribute_lib.ReplicaContext):
    """The replica context of this worker: replica `rank` of `size`."""

    def __init__(self, strategy: "DataParallelStrategy", rank: int) -> None:
        distribute_lib.ReplicaContext.__init__(
            self, strategy, replica_id_in_sync_group=rank)

    @property
    def devices(self):
        return self._strategy.extended.worker_devices


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
        if job.size > 1:
            _MULTI_WORKER.add(self)
        # Skip MultiWorkerMirroredStrategy.__init__ (it would set up TF's own
        # collectives and cluster): tf.distribute.Strategy's is all we need.
        tf.distribute.Strategy.__init__(self, extended)  # pylint: disable=non-parent-init-called

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
        one_replica = getattr(self.extended, "local_replicas", 1) == 1
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
