"""Horovod's elastic API (`hvd.elastic`) on tf_smb's elastic jobs (docs/elastic.md).

    @hvd.elastic.run
    def train(state):
        ...                      # collectives; state.commit() every few batches

    state = hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0)
    state.register_reset_callbacks([on_reset])
    train(state)

`run` syncs the state from rank 0 and calls the function; when a member of the
job is lost (a collective fails: HorovodInternalError) the state goes back to
its last commit; when the launcher reports a host update at a commit
(HostsUpdatedInterrupt) it is kept. Either way this process then moves to the
next generation of the job (tf_smb.elastic.worker: its ranks and size change,
the process stays), the reset callbacks run, and the function runs again. A
worker the launcher leaves out of the next generation ends (exit status 0).

Between a change and the sync of the state a process works alone: the reset
callbacks, and a new process's code before `run`, see the new size and ranks,
but their collectives run over that process only (Horovod forbids collectives
there: the others may be doing something else, e.g. Horovod's synthetic
benchmark example runs a training step before `run`; in Horovod a worker added
to a running job waits there forever). The sync, from rank 0, then makes every
process's state the same.

Outside an elastic job (no `tf_smb.run --min-np/--max-np/...`), `run` calls the
function once, and a lost member fails the job as it would without `run`.

Commits are kept in this process's memory (copies of the variables), not on
disk: every worker of a synchronous job holds the same commit.

Across nodes (each generation a new `mpirun`, docs/elastic.md) a commit is also
kept in the node's commit box (shared memory; each node's first rank writes it);
at a change the processes end, and those of the next generation, at their first
`run`, take the newest commit their nodes hold before the sync.
"""
from __future__ import annotations

import copy
import functools
import queue
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from tf_smb.elastic.commit_box import newest
from tf_smb.elastic.worker import ElasticWorker, WorkerRemoved

# HostUpdateResult's values in Horovod (bit flags).
NO_UPDATE, REMOVED, ADDED, MIXED = 0, 1, 2, 3
# How long a worker waits for the launcher's next generation.
RESET_TIMEOUT_S = 600.0


class HorovodInternalError(RuntimeError):
    """A collective failed because a member of the job was lost: the state goes
    back to its last commit and the job goes on with the members left."""


class HostsUpdatedInterrupt(RuntimeError):
    """The launcher reported hosts added or removed: the job goes on with the new
    members from the current state (`skip_sync`: only removals, nothing to send)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts were updated" + (" (removed)" if skip_sync else ""))
        self.skip_sync = skip_sync


class State:
    """What a job keeps across membership changes: Horovod's `State`.

    Args:
      bcast_object: sends a picklable object from rank 0 to every rank.
      get_rank: this worker's rank.
    """

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int]) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._host_messages: "queue.Queue[Tuple[int, int]]" = queue.Queue()
        self._last_updated_timestamp = 0
        self._reset_callbacks: List[Callable[[], None]] = []
        self._commits = 0  # commits so far (the same on every rank): a commit's serial

    def register_reset_callbacks(self, callbacks: Sequence[Callable[[], None]]) -> None:
        """Adds functions to call after each membership change (e.g. to scale
        the learning rate with the new size)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Runs the reset callbacks (after this process joined the next generation)."""
        self._host_messages = queue.Queue()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: int, update_res: int) -> None:
        """Records a host update the launcher reported (its serial, and what changed)."""
        self._host_messages.put((timestamp, update_res))

    def commit(self) -> None:
        """Saves the state in memory, then raises HostsUpdatedInterrupt on every
        rank at once if the launcher reported a host update."""
        self.save()
        self._commits += 1
        worker = _worker()
        if worker is not None and worker.keeps_node_commit:
            worker.keep_on_node(self.record())
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raises HostsUpdatedInterrupt (on every rank: rank 0's view is sent to
        all) when a host update came since the last check."""
        last = previous = self._last_updated_timestamp
        update = NO_UPDATE
        while not self._host_messages.empty():
            timestamp, result = self._host_messages.get()
            if timestamp > last:
                last = timestamp
                update |= result
        previous, self._last_updated_timestamp, update = self._bcast_object(
            (previous, last, update))
        if self._last_updated_timestamp > previous:
            raise HostsUpdatedInterrupt(update == REMOVED)

    def save(self) -> None:
        """Keeps the current state as the last commit."""
        raise NotImplementedError

    def restore(self) -> None:
        """Puts back the last commit."""
        raise NotImplementedError

    def sync(self) -> None:
        """Makes every rank's state rank 0's."""
        raise NotImplementedError

    def record(self) -> Dict[str, Any]:
        """The last commit as plain values, with its serial (a node's commit box keeps it)."""
        return {"serial": self._commits}

    def load(self, record: Dict[str, Any]) -> None:
        """Makes `record` (from `record()`) the last commit and the state."""
        self._commits = int(record.get("serial", self._commits))


class ObjectState(State):
    """Plain attributes (keyword arguments) kept, restored and synced: Horovod's
    `ObjectState`."""

    def __init__(self, bcast_object: Optional[Callable[[Any], Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None, **kwargs: Any) -> None:
        from tf_smb import horovod as hvd  # pylint: disable=import-outside-toplevel
        bcast_object = bcast_object or (lambda obj: hvd.broadcast_object(obj, root_rank=0))
        self._saved_state: Dict[str, Any] = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank or hvd.rank)

    def save(self) -> None:
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def record(self) -> Dict[str, Any]:
        # A copy: the node's commit is written while the attributes may change.
        return {**super().record(), "attrs": copy.deepcopy(self._saved_state)}

    def load(self, record: Dict[str, Any]) -> None:
        self._saved_state = dict(record["attrs"])
        self._set_attrs()
        super().load(record)

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, value)


class TensorFlowState(ObjectState):
    """TensorFlow variables and attributes (e.g. epoch, batch): Horovod's
    `TensorFlowState` (eager execution)."""

    def __init__(self, variables: Optional[Sequence[tf.Variable]] = None,
                 session: Any = None, **kwargs: Any) -> None:
        if not tf.executing_eagerly():
            raise NotImplementedError("tf_smb.horovod.elastic.TensorFlowState needs eager "
                                      "execution")
        del session
        self.variables: List[tf.Variable] = list(variables or [])
        self._committed: List[Tuple[tf.Variable, Any]] = []
        self._save_variables()
        super().__init__(**kwargs)

    def _kept_variables(self) -> List[tf.Variable]:
        """The variables kept (their list may grow, e.g. an optimizer's first step)."""
        return self.variables

    def save(self) -> None:
        self._save_variables()
        super().save()

    def restore(self) -> None:
        for variable, value in self._committed:
            variable.assign(value)
        super().restore()

    def sync(self) -> None:
        from tf_smb import horovod as hvd  # pylint: disable=import-outside-toplevel
        tracked = self._kept_variables()
        if tracked:
            hvd.broadcast_variables(tracked, root_rank=0)
        self._save_variables()
        super().sync()

    def _save_variables(self) -> None:
        # Copies in host memory: the commit survives whatever the step does next.
        self._committed = [(v, v.numpy()) for v in self._kept_variables()]

    def record(self) -> Dict[str, Any]:
        return {**super().record(), "values": [value for _, value in self._committed]}

    def load(self, record: Dict[str, Any]) -> None:
        values = record["values"]
        variables = self._variables_for(len(values))
        if len(variables) != len(values) or any(
                tuple(v.shape) != tuple(getattr(x, "shape", ())) for v, x in zip(variables, values)):
            raise ValueError(
                "the commit this job resumes from does not fit this state: expected "
                f"{len(variables)} values of shapes {[tuple(v.shape) for v in variables]}, "
                f"got {len(values)} of shapes {[tuple(getattr(x, 'shape', ())) for x in values]}")
        for variable, value in zip(variables, values):
            variable.assign(value)
        self._save_variables()
        super().load(record)

    def _variables_for(self, count: int) -> List[tf.Variable]:
        """The kept variables, made (e.g. an optimizer's) so that `count` values fit."""
        del count
        return self._kept_variables()


class TensorFlowKerasState(TensorFlowState):
    """A Keras model, its optimizer and attributes: Horovod's `TensorFlowKerasState`.

    The optimizer's variables are tracked once it has built them (its first step).
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None,
                 **kwargs: Any) -> None:
        del backend
        if not getattr(model, "built", True):
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        super().__init__(None, **kwargs)

    def _variables_for(self, count: int) -> List[tf.Variable]:
        tracked = self._kept_variables()
        if (count > len(tracked) and self.optimizer is not None
                and not getattr(self.optimizer, "built", True)):
            # A new process resuming a commit made after the optimizer's first step.
            self.optimizer.build(self.model.trainable_variables)
            tracked = self._kept_variables()
        return tracked

    def _kept_variables(self) -> List[tf.Variable]:
        tracked = list(self.model.variables)
        if self.optimizer is not None and getattr(self.optimizer, "built", True):
            optimizer_variables = self.optimizer.variables
            tracked += list(optimizer_variables() if callable(optimizer_variables)
                            else optimizer_variables)
        return tracked


_WORKER: List[Optional[ElasticWorker]] = []  # this process's, once asked


def _worker() -> Optional[ElasticWorker]:
    """This process's side of its elastic job, or None outside one."""
    if not _WORKER:
        _WORKER.append(ElasticWorker.from_env())
    return _WORKER[0]


def _lost_member(error: tf.errors.OpError) -> bool:
    """Whether `error` is a collective failing because a member left or died
    (tf_smb's core reports those as Aborted, naming the rank)."""
    return isinstance(error, tf.errors.AbortedError)


def _reset(worker: ElasticWorker, state: State) -> None:
    """Moves this process to the next generation of the job: its reset callbacks
    run with the new size and ranks but over this process alone (a process new
    to the job runs its code before `run` so too); then it joins the others."""
    from tf_smb.horovod import basics  # pylint: disable=import-outside-toplevel
    generation = worker.next_generation(RESET_TIMEOUT_S)
    basics.work_alone(worker.job_in(generation))
    state.on_reset()
    _join(worker, generation.number)


def _resume(state: State) -> None:
    """Across nodes, in a later generation: makes the newest commit the job's
    nodes hold this state's, on every rank (before the sync)."""
    from tf_smb import horovod as hvd  # pylint: disable=import-outside-toplevel
    worker = _worker()
    record = worker.node_commit() if worker is not None else None
    serials = hvd.allgather_object(0 if record is None else int(record["serial"]))
    root = newest(serials)
    if serials[root] == 0:
        print(f"tf_smb: generation {worker.generation}: no node holds a commit of this job; "
              "the state starts anew", file=sys.stderr, flush=True)
        return
    state.load(hvd.broadcast_object(record if hvd.rank() == root else None, root_rank=root))


def _join(worker: ElasticWorker, generation: Optional[int] = None) -> None:
    """Joins the generation set aside (the others wait for this process there)."""
    from tf_smb.horovod import basics  # pylint: disable=import-outside-toplevel
    basics.join_pending()
    if generation is not None:
        worker.generation = generation
    worker.mark_joined()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Runs `func(state, ...)` through the job's membership changes (see the module)."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        worker = _worker()
        if worker is None:  # not an elastic job: nothing will change
            state.sync()
            return func(state, *args, **kwargs)
        _join(worker)  # a process new to the job joins it here
        worker.follow_host_updates(id(state), lambda update: state.on_hosts_updated(
            update.serial, (REMOVED if update.removed else 0) | (ADDED if update.added else 0)))
        skip_sync = False
        resume = worker.resumes()
        while True:
            try:
                if resume:
                    resume = False
                    _resume(state)
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError:
                state.restore()
                skip_sync = False
            except tf.errors.OpError as e:
                if not _lost_member(e):
                    raise
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as e:
                skip_sync = e.skip_sync
            if worker.across_nodes:
                worker.end_generation()  # the launcher starts the next one
            try:
                _reset(worker, state)
            except WorkerRemoved:
                sys.exit(0)

    return wrapper


__all__ = ["run", "State", "ObjectState", "TensorFlowState", "TensorFlowKerasState",
           "HorovodInternalError", "HostsUpdatedInterrupt"]
