"""Where a process's replicas sit: the policy object the one Extended class
(data_parallel.DataParallelExtended) asks for what depends on that alone, as
it asks its WorkerMode (worker_mode.py) for what depends on sync or async.

  * `OneReplica` (this module): the process is one replica, on one device;
    variables are plain, a step runs in this thread.
  * `ReplicaThreads` (local_replicas.py, SingleCaffe's mode): the process runs
    N replicas as threads on N devices sharing one parameter copy
    (AggregatingVariables), its steps through TensorFlow's mirrored runner.

A layout answers: its devices, how a variable is made and placed (and a
metric's per-replica copies), how a step runs under the worker mode, how an
update is applied, and what the process waits for when it is done. Every rule
that holds for both (sharding, reductions, gathers, broadcasting initial
values, the async combine rule) lives once, in the Extended class.

Depends on TensorFlow, env, step_rows and worker_mode only.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf
from tensorflow.python.distribute import device_util
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import numpy_dataset
from tensorflow.python.framework import ops as framework_ops
from tensorflow.python.util import nest

from tf_smb import env as env_lib
from tf_smb import step_rows
from tf_smb.worker_mode import WorkerMode


class ReplicaLayout:
    """How a process's replicas sit (see the module). Subclasses set `devices`."""

    devices: Tuple[str, ...]

    @property
    def local_replicas(self) -> int:
        """Replicas in this process."""
        return len(self.devices)

    @property
    def parameter_device(self) -> str:
        """Where this process's one copy of the parameters lives."""
        return self.devices[0]

    @property
    def host_device(self) -> str:
        """The CPU device input pipelines run on."""
        return device_util.get_host_for_device(self.devices[0])

    def default_input_options(self) -> Optional[tf.distribute.InputOptions]:
        """The input options when the user gives none (None: TensorFlow's)."""
        return None

    def variable_kwargs(self, kwargs: Dict[str, Any]) -> Dict[str, Any]:
        """A variable's creation arguments, completed for this layout."""
        return kwargs

    def create_variable(self, strategy: Any, next_creator: Callable[..., Any],
                        kwargs: Dict[str, Any]) -> Any:
        """A variable placed (and wrapped) for this layout."""
        raise NotImplementedError

    def replica_copies(self, next_creator: Callable[..., Any],
                       kwargs: Dict[str, Any]) -> List[Any]:
        """The per-replica copies of a metric variable (synchronization=ON_READ)."""
        raise NotImplementedError

    def unwrap(self, variable: Any) -> Any:
        """The one copy inside a variable this layout made."""
        return variable

    def run(self, strategy: Any, mode: WorkerMode, job: env_lib.JobInfo,
            fn: Callable[..., Any], args: Sequence[Any], kwargs: Dict[str, Any],
            weigh_rows: bool) -> Any:
        """Runs `fn` once per local replica under `mode`; with `weigh_rows`
        each replica's gradients weigh its rows (tf_smb/step_rows.py)."""
        raise NotImplementedError

    def apply_update(self, var: Any, fn: Callable[..., Any], args: Sequence[Any],
                     kwargs: Dict[str, Any], group: bool, local_results: Callable) -> Any:
        """Applies `fn(var, *args, **kwargs)` to this process's copy of `var`."""
        raise NotImplementedError

    def update_each_replica(self, mode: WorkerMode, var: Any, fn: Callable[..., Any],
                            args: Sequence[Any], kwargs: Dict[str, Any],
                            apply_update: Callable[..., Any]) -> List[Any]:
        """Asynchronous: every local replica's own update of `var` (args are
        per-replica values), none combined; the ops that apply them."""
        raise NotImplementedError

    def sum_local(self, parts: Sequence[Sequence[tf.Tensor]]) -> List[tf.Tensor]:
        """Each value's sum over this process's replicas (`parts[i]`: value i's
        part from every local replica)."""
        if any(len(p) != 1 for p in parts):
            raise ValueError("a process that is one replica has one part of each value")
        return [p[0] for p in parts]

    def finish(self, mode: WorkerMode) -> None:
        """What this process waits for of its own before the mode finishes."""


class _WorkerReplicaContext(distribute_lib.ReplicaContext):
    """The replica context of a process that is one replica: replica `rank` of `size`."""

    def __init__(self, strategy: Any, rank: int) -> None:
        distribute_lib.ReplicaContext.__init__(
            self, strategy, replica_id_in_sync_group=rank)

    @property
    def devices(self):
        return self._strategy.extended.worker_devices


class OneReplica(ReplicaLayout):
    """The process is one replica, on `device`."""

    def __init__(self, device: str = "/cpu:0") -> None:
        self.devices = (device_util.resolve(device),)

    def default_input_options(self) -> Optional[tf.distribute.InputOptions]:
        # The worker iterates the dataset itself rather than through a
        # MultiDeviceIterator, which one device does not need: making one took
        # ~45 ms, and Keras makes two per epoch, against ~1 ms (2 workers,
        # benchmarks/epoch_time.py).
        return tf.distribute.InputOptions(
            experimental_fetch_to_device=False,
            experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA)

    def variable_kwargs(self, kwargs: Dict[str, Any]) -> Dict[str, Any]:
        if kwargs.get("synchronization",
                      tf.VariableSynchronization.AUTO) == tf.VariableSynchronization.AUTO:
            # As under MirroredStrategy: every worker writes its copy in step.
            kwargs["synchronization"] = tf.VariableSynchronization.ON_WRITE
        return kwargs

    def create_variable(self, strategy: Any, next_creator: Callable[..., Any],
                        kwargs: Dict[str, Any]) -> Any:
        colocate_with = kwargs.pop("colocate_with", None)
        if colocate_with is None:
            with framework_ops.device(self.devices[0]):
                return next_creator(**kwargs)
        if isinstance(colocate_with, numpy_dataset.SingleDevice):
            with framework_ops.device(colocate_with.device):
                return next_creator(**kwargs)
        with framework_ops.colocate_with(colocate_with):
            return next_creator(**kwargs)

    def replica_copies(self, next_creator: Callable[..., Any],
                       kwargs: Dict[str, Any]) -> List[Any]:
        return [self.create_variable(None, next_creator, kwargs)]

    def run(self, strategy: Any, mode: WorkerMode, job: env_lib.JobInfo,
            fn: Callable[..., Any], args: Sequence[Any], kwargs: Dict[str, Any],
            weigh_rows: bool) -> Any:
        # Multi-worker input arrives as PerReplica values of one local replica.
        args = distribute_utils.select_replica(0, args)
        kwargs = distribute_utils.select_replica(0, kwargs)
        with contextlib.ExitStack() as stack:
            stack.enter_context(framework_ops.device(self.devices[0]))
            stack.enter_context(_WorkerReplicaContext(strategy, job.rank))
            if weigh_rows:
                stack.enter_context(step_rows.replica_step(args, kwargs))
            return mode.run_step(fn, args, kwargs)

    def apply_update(self, var: Any, fn: Callable[..., Any], args: Sequence[Any],
                     kwargs: Dict[str, Any], group: bool, local_results: Callable) -> Any:
        device = self.devices[0]
        with framework_ops.device(device), distribute_lib.UpdateContext(device):
            result = fn(var, *args, **kwargs)
            return result if group else nest.map_structure(local_results, result)

    def update_each_replica(self, mode: WorkerMode, var: Any, fn: Callable[..., Any],
                            args: Sequence[Any], kwargs: Dict[str, Any],
                            apply_update: Callable[..., Any]) -> List[Any]:
        args = distribute_utils.select_replica(0, args)
        kwargs = distribute_utils.select_replica(0, kwargs)
        result = mode.update(var, args, lambda: apply_update(var, fn, args, kwargs, True), True)
        return [o for o in tf.nest.flatten(result) if o is not None]
