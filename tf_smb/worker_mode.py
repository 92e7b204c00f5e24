"""How a strategy's workers train together: an object its Extended class owns
and asks, instead of checking flags.

  * `InStep` (mode="sync"; also one process of mode="async", which has no one
    to wait for): every update is combined over the workers, which step
    together.
  * `Independent` (mode="async"): each process, and each replica thread, applies
    its own updates. With 2+ processes the trainable variables live in the box
    (an AsyncEngine) and the processes never wait for each other.

The replica layout is the other axis (replica_layout.py: one replica per
process, or replica threads sharing one parameter copy, local_replicas.py);
the one Extended class (data_parallel.DataParallelExtended) asks both. A mode
answers what depends on sync or async only: whether processes combine, which data a process reads,
how a step starts and runs, where a variable lives and how it is updated.

Depends on TensorFlow, env and phase only (the engine comes in built).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf
from tensorflow.python.distribute import values as values_lib

from tf_smb import env as env_lib
from tf_smb import phase

if TYPE_CHECKING:
    from tf_smb.async_mode import AsyncConfig, AsyncEngine, BoxSegment


ASYNC_REDUCE_HINT = (
    "In SMBStrategy(mode='async') workers are not in step: each runs its own "
    "steps at its own pace, so no other worker holds a matching value to combine "
    "with, and a collective would wait forever or pair unrelated steps. Use this "
    "worker's own value instead (strategy.experimental_local_results(value)[0]; "
    "after strategy.run it is already a plain tensor), or run the reduction under "
    "a synchronous strategy, e.g. evaluate with mode='sync' after training.")


def _own_value(value: Any) -> bool:
    """Whether reducing `value` only reads this process's own state: a metric
    (SyncOnRead: this worker's copies), a per-replica value of one replica
    (Keras' logs and batches when each process is one replica), or any
    per-replica value Keras reduces only to learn its structure (model build)."""
    flat = tf.nest.flatten(value)
    return bool(flat) and all(
        isinstance(v, values_lib.SyncOnReadVariable)
        or (isinstance(v, values_lib.PerReplica)
            and (len(v.values) == 1 or phase.is_building_model()))
        for v in flat)


def shards(dataset: tf.data.Dataset) -> bool:
    """Whether `dataset`'s options let a strategy shard it over workers
    (anything but AutoShardPolicy.OFF)."""
    policy = dataset.options().experimental_distribute.auto_shard_policy
    return policy != tf.data.experimental.AutoShardPolicy.OFF


class WorkerMode:
    """What differs between training in step and independently (see the module)."""

    config: Optional["AsyncConfig"] = None
    engine: Optional["AsyncEngine"] = None

    @property
    def asynchronous(self) -> bool:
        """Whether updates are applied without combining them."""
        return self.config is not None

    @property
    def segments(self) -> Dict[Any, "BoxSegment"]:
        """The box segment of every box-held variable, by `ref()` (none in step)."""
        return self.engine.segments if self.engine is not None else {}

    def require_engine(self, what: str) -> "AsyncEngine":
        """The engine of the box-held variables; AttributeError naming `what` without."""
        if self.engine is None:
            raise AttributeError(f"{what}: only SMBStrategy(mode='async') with 2+ "
                                 "workers counts steps")
        return self.engine

    def combines_processes(self, job: env_lib.JobInfo) -> bool:
        """Whether reductions (gradients, logs, metrics) go over the processes."""
        raise NotImplementedError

    def processes_apart(self, job: env_lib.JobInfo) -> bool:
        """Whether this job's processes never wait for each other: they share no
        step, so values cannot be reduced or gathered over them."""
        return job.size > 1 and not self.combines_processes(job)

    def check_combinable(self, job: env_lib.JobInfo, what: str, value: Any = None) -> None:
        """Raises ValueError when `what` would combine values over processes that
        train apart (async, 2+ processes), with or without replica threads: a
        gather always would; a reduction of `value` would unless it only reads
        this process's own state. The one copy of this rule, for every Extended."""
        if self.processes_apart(job) and (value is None or not _own_value(value)):
            raise ValueError(f"{what} would combine values over workers. {ASYNC_REDUCE_HINT}")

    def whole_batches(self, dataset: tf.data.Dataset,
                      job: env_lib.JobInfo) -> Optional[tf.data.Dataset]:
        """The global batches this process reads whole, or None when every
        process reads a part of each (the dataset is rebatched and sharded)."""
        raise NotImplementedError

    def training_batches(self, num_batches: int, job: env_lib.JobInfo,
                         dataset: Optional[tf.data.Dataset] = None) -> int:
        """How many of a dataset's `num_batches` global batches this process
        trains on in an epoch (`dataset`: the data, when known)."""
        return num_batches

    def keeps_in_box(self, trainable: bool) -> bool:
        """Whether a variable (trainable or not) lives in the box."""
        return self.engine is not None and trainable

    def place(self, variable: tf.Variable) -> bool:
        """Puts the variable's master copy in the box when it lives there; True then."""
        if not self.keeps_in_box(variable.trainable):
            return False
        self.engine.place(variable)
        return True

    def note_variable(self, variable: tf.Variable) -> None:
        """An elastic job's variable, made without a collective (the members
        change): one the box will hold is placed later (`place_noted`)."""

    def start_step(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> List[Any]:
        """The ops a step's own ops must follow (the clock's wait, the box's read)."""
        return []

    def run_step(self, fn: Callable[..., Any], args: Sequence[Any],
                 kwargs: Dict[str, Any]) -> Any:
        """Runs one replica's step of `fn`."""
        return fn(*args, **kwargs)

    def update(self, var: tf.Variable, args: Sequence[Any], apply_locally: Callable[[], Any],
               group: bool) -> Any:
        """Updates `var`: `apply_locally()` runs the update on this process's
        copy, which for a box-held variable also goes into the box."""
        if self.engine is None or self.engine.segment_of(var) is None:
            return apply_locally()
        return self.engine.update(var, args, apply_locally, group)

    def finish(self) -> None:
        """This process is done training (see SMBStrategy.finish_training)."""


class InStep(WorkerMode):
    """mode="sync": every update is combined over the workers, which step together."""

    def combines_processes(self, job: env_lib.JobInfo) -> bool:
        return job.size > 1

    def whole_batches(self, dataset: tf.data.Dataset,
                      job: env_lib.JobInfo) -> Optional[tf.data.Dataset]:
        return None


class Independent(WorkerMode):
    """mode="async": updates are applied as they come, none combined.

    Args:
      config: the asynchronous options, validated (AsyncConfig).
      engine: with 2+ processes, the engine of the box-held variables; None for
        one process (its replica threads then share its one parameter copy).
    """

    def __init__(self, config: "AsyncConfig", engine: Optional["AsyncEngine"] = None,
                 segment_name_of: Optional[Callable[[tf.Variable], str]] = None,
                 noted: Optional[List[Tuple[tf.Variable, str]]] = None) -> None:
        self.config = config
        self.engine = engine
        # Elastic jobs: names a variable's segment as it is made
        # (async_mode.take_segment_name), and the trainable variables in the
        # order made, with those names: each generation's box holds them.
        self.segment_name_of = segment_name_of
        self.noted: List[Tuple[tf.Variable, str]] = [] if noted is None else noted

    def note_variable(self, variable: tf.Variable) -> None:
        if variable.trainable and self.segment_name_of is not None:
            self.noted.append((variable, self.segment_name_of(variable)))

    def place_noted(self) -> int:
        """Places the noted variables this generation's box does not hold yet,
        from rank 0's values (every member calls it at the same point: it runs
        collectives); how many (0 without an engine: one worker)."""
        if self.engine is None:
            return 0
        todo = [(v, name) for v, name in self.noted if self.engine.segment_of(v) is None]
        for variable, name in todo:
            self.engine.place(variable, name)
        return len(todo)

    def combines_processes(self, job: env_lib.JobInfo) -> bool:
        return False

    def whole_batches(self, dataset: tf.data.Dataset,
                      job: env_lib.JobInfo) -> Optional[tf.data.Dataset]:
        # Training: each process takes every size-th batch, unless the data's
        # options turn sharding off (AutoShardPolicy.OFF: every process reads
        # every batch, as TensorFlow's strategies honour it). Evaluation and
        # prediction: every process reads all data (no collectives needed).
        if phase.is_evaluating() or not shards(dataset):
            return dataset
        return dataset.shard(job.size, job.rank)

    def training_batches(self, num_batches: int, job: env_lib.JobInfo,
                         dataset: Optional[tf.data.Dataset] = None) -> int:
        if dataset is not None and not shards(dataset):
            return num_batches
        return len(range(job.rank, num_batches, job.size))  # every size-th (whole_batches)

    def start_step(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> List[Any]:
        return self.engine.start_step(args, kwargs) if self.engine is not None else []

    def run_step(self, fn: Callable[..., Any], args: Sequence[Any],
                 kwargs: Dict[str, Any]) -> Any:
        if self.engine is None:
            return fn(*args, **kwargs)
        return self.engine.run_step(fn, args, kwargs)

    def finish(self) -> None:
        if self.engine is not None:
            self.engine.finish()
