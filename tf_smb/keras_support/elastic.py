"""Keras `fit` through the member changes of an elastic job, for
SMBStrategy(elastic=True) under tf_smb's elastic launcher (docs/elastic.md).

    strategy = tf_smb.SMBStrategy(elastic=True)
    with strategy.scope():
        model = ...; model.compile(...)
    model.fit(dataset, epochs=10)     # unchanged

    $ python -m tf_smb.run -np 4 --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh \\
          python train.py

`fit` runs Keras' own fit in a loop. Each try starts with every member holding
rank 0's variables (model and optimizer), epoch and batch; a callback commits
them in memory every `commit_steps` batches and at each epoch's end, and there
asks rank 0 whether the launcher announced a host update. When a member is
lost (a collective fails: tf.errors.AbortedError), the others go back to the
last commit; when hosts were updated, they stop at that commit. Either way each
process joins the next generation of the job (its rank and size change, the
process stays), Keras traces its step again for the new size, and the next try
resumes at the committed epoch, skipping the batches of that epoch done before
the commit. A process that joins a running job does the same from its first
`fit`. The global batch is the one the data has: each generation splits it over
its members, so the job trains on the same sequence of global batches as one
process would.

In async mode (SMBStrategy(mode="async", elastic=True)) the box keeps the
parameters through a change: a commit is the position only, a worker learns of a
change at its commits without asking the others (one node: the launcher's
generation file; across nodes: the host update its rank wrapper passed on), ends
its part of the generation (waits for the live members, reads the box) and, in
the next, the members resume at the position of the one furthest behind, rank 0's
variables going to all and into the new generation's box. No rollback on one
node; across nodes a host update is none either (every node keeps the box's last
values), a lost rank goes back to the nodes' last commits.

Across nodes (each generation a new `mpirun`, docs/elastic.md) each node's first
rank also keeps every commit in the node's commit box (shared memory); at a
change the processes end instead of joining the next generation, and the next
generation's processes start their first try from the newest commit their
nodes hold.
"""
from __future__ import annotations

import dataclasses
import inspect
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from tf_smb.keras_support import _owner

DEFAULT_COMMIT_STEPS = 10
RESET_TIMEOUT_S = 600.0  # how long a worker waits for the launcher's next generation


def elastic_worker(elastic: bool, mode: str, local_replicas: int,
                   commit_steps: int = DEFAULT_COMMIT_STEPS) -> Optional[Any]:
    """This process's side of its elastic job for SMBStrategy(elastic=...)
    (a tf_smb.elastic.worker.ElasticWorker), or None: not asked for, or not
    started by an elastic launcher (the members cannot change).

    Raises:
      ValueError: elastic with what it does not support (replica threads), or
        commit_steps < 1.
    """
    if not elastic:
        return None
    if local_replicas != 1:
        raise ValueError(f"SMBStrategy(elastic=True) needs local_replicas=1, got "
                         f"{local_replicas}")
    if not isinstance(commit_steps, int) or commit_steps < 1:
        raise ValueError(f"commit_steps must be an integer >= 1, got {commit_steps!r}")
    from tf_smb.elastic.worker import ElasticWorker  # pylint: disable=import-outside-toplevel
    return ElasticWorker.from_env()


class _GenerationMovedOn(Exception):
    """Async: the launcher published the next generation (members lost or
    hosts updated); this worker leaves the current one at this commit."""


class _HostsUpdated(Exception):
    """Rank 0 saw a host update at a commit: every member stops there."""

    def __init__(self, removed_only: bool) -> None:
        super().__init__("the launcher announced a host update")
        self.removed_only = removed_only


@dataclasses.dataclass
class _Commit:
    """The last commit: where training is, and the values of the variables."""

    epoch: int
    batch: int  # batches of `epoch` done
    values: Optional[List[Any]] = None

    @property
    def position(self) -> int:
        """Epoch and batch in one integer that grows as training goes on."""
        return (self.epoch << 32) + self.batch

    @classmethod
    def at(cls, position: int) -> "_Commit":
        """The commit at `position` (without values)."""
        return cls(position >> 32, position & 0xFFFFFFFF)


def _keep_on_node(worker: Any, commit: _Commit) -> None:
    """Across nodes: the node's commit box keeps `commit` (with its values); its
    serial orders the commits (0: none)."""
    worker.keep_on_node({"serial": commit.position + 1, "epoch": commit.epoch,
                         "batch": commit.batch, "values": commit.values})


class ElasticFit:
    """One strategy's elastic `fit` (see the module)."""

    def __init__(self, strategy: Any, worker: Any, commit_steps: int) -> None:
        self.strategy = strategy
        self.worker = worker  # tf_smb.elastic.worker.ElasticWorker
        self.commit_steps = commit_steps
        self._update_lock = threading.Lock()
        self._latest_update = (0, 0)  # (serial, flags) of the launcher's last host update
        self._handled_update = 0
        self._following = False
        self._root = 0  # whose variables, epoch and batch a try starts from
        self._resumed: Optional[Dict[str, Any]] = None  # the commit resumed, on its holder
        # Async mode: the parameters live in the box, which outlives a lost member,
        # so a change costs no rollback; each worker learns of it from the launcher.
        self.asynchronous = getattr(strategy, "mode", "sync") == "async"
        self._trained = False  # whether this process trained in a try (holds a position)
        # What elastic training cost this process (benchmarks/elastic.py reads them):
        # each commit's seconds (copies and the host-update check), and for each change
        # of the members its cause, when it was caught (time.time()) and the seconds
        # from then to the first step done in the next generation (across nodes, a
        # process of a later generation records "resumed": from its resume on).
        self.commit_seconds: List[float] = []
        self.changes: List[Dict[str, Any]] = []

    # -- collectives (eager; every member calls them in the same order) --------
    def _from_rank0(self, values: List[int]) -> List[int]:
        return _owner.broadcast_ints(self.strategy, values)

    def _from_root(self, values: List[int]) -> List[int]:
        return _owner.broadcast_ints(self.strategy, values, root=self._root)

    def _resume_point(self) -> Optional[_Commit]:
        """Across nodes, in a later generation: the newest commit the job's nodes
        hold (its epoch and batch; its holder, `_root`, keeps its values for
        `sync_variables`), or None when no node holds one."""
        record = self.worker.node_commit()
        serials = _owner.gather_int(self.strategy, 0 if record is None else int(record["serial"]))
        from tf_smb.elastic.commit_box import newest  # pylint: disable=import-outside-toplevel
        self._root = newest(serials)
        if serials[self._root] == 0:
            print(f"tf_smb: generation {self.worker.generation}: no node holds a commit of "
                  "this job; training starts anew", file=sys.stderr, flush=True)
            return None
        self._resumed = record if self.strategy.rank == self._root else None
        epoch, batch = self._from_root([0, 0] if record is None else
                                       [int(record["epoch"]), int(record["batch"])])
        return _Commit(epoch, batch)

    def _agreed_position(self, commit: _Commit) -> _Commit:
        """Async: where the members resume, the position of the member furthest
        behind (members that trained before say theirs, new processes nothing):
        no global batch is skipped; those a faster member did past it are trained
        again (fewer than size x staleness)."""
        said = _owner.gather_int(self.strategy, commit.position + 1 if self._trained else 0)
        held = [position - 1 for position in said if position]  # 0: nothing held
        return _Commit.at(min(held)) if held else commit

    def generation_moved_on(self) -> bool:
        """Async: whether the members are changing, asking no one: on one node
        the launcher published the next generation; across nodes it announced a
        host update (a lost rank ends every process: mpirun stops them)."""
        if not self.worker.across_nodes:
            return self.worker.generation_moved_on()
        with self._update_lock:
            serial, _ = self._latest_update
        return serial > self._handled_update

    def keep_last_on_node(self, model: Any, commit: _Commit) -> None:
        """Async across nodes, at a change, after `finish_generation`: every node
        keeps the box's last values at the members' agreed position (the same
        record on every node), which the next generation resumes from. A member
        already done (its last epoch ended) cannot agree: this worker's own
        position then."""
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        try:
            position = self._agreed_position(commit)
        except tf.errors.OpError as e:
            print(f"tf_smb: generation {self.worker.generation}: the members could not agree "
                  f"where to resume ({type(e).__name__}); this node keeps this worker's "
                  "position", file=sys.stderr, flush=True)
            position = commit
        if self.worker.keeps_node_commit:
            _keep_on_node(self.worker, dataclasses.replace(
                position, values=[v.numpy() for v in self.tracked(model)]))

    def finish_generation(self) -> None:
        """Async: this worker's part of the generation ends: its clock stops, it
        waits for the other live members, then reads the box's last values (those
        the next generation starts from). A failure here leaves this worker's own
        copies, read from the box at its last step, and says so."""
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        try:
            self.strategy.finish_training()
        except tf.errors.OpError as e:
            print(f"tf_smb: generation {self.worker.generation}: could not read the box's "
                  f"last values ({type(e).__name__}: {e.message}); this worker keeps those "
                  "it read at its last step", file=sys.stderr, flush=True)

    def tracked(self, model: Any) -> List[Any]:
        """The variables a commit holds: the model's weights (trainable or not)
        and its optimizer's (metrics start again with each epoch)."""
        optimizer = getattr(model, "optimizer", None)
        variables = list(model.weights)
        if optimizer is not None:
            if not optimizer.built:
                with self.strategy.scope():
                    optimizer.build(model.trainable_variables)
            variables += list(optimizer.variables)
        return variables

    def sync_variables(self, model: Any) -> None:
        """Every member's variables become rank 0's (the resumed commit's holder's)."""
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        variables = self.tracked(model)
        if self._resumed is not None:
            values, self._resumed = self._resumed["values"], None
            if len(values) != len(variables) or any(
                    tuple(v.shape) != tuple(x.shape) for v, x in zip(variables, values)):
                raise ValueError(
                    "the commit this job resumes from does not fit the model: expected "
                    f"{len(variables)} values of shapes {[tuple(v.shape) for v in variables]},"
                    f" got {len(values)} of shapes {[tuple(x.shape) for x in values]}")
            for variable, value in zip(variables, values):
                variable.assign(value)
        if self.strategy.size > 1 and variables:
            values = self.strategy.extended.collectives.broadcast(
                [tf.convert_to_tensor(v) for v in variables], root=self._root)
            for variable, value in zip(variables, values):
                variable.assign(value)
        self._root = 0

    def check_host_updates(self) -> None:
        """Raises _HostsUpdated on every member at once when rank 0 heard of a
        host update it had not handled (its view is sent to all)."""
        with self._update_lock:
            serial, flags = self._latest_update
        handled, serial, flags = self._from_rank0([self._handled_update, serial, flags])
        self._handled_update = serial
        if serial > handled:
            raise _HostsUpdated(removed_only=flags == 1)

    def _on_host_update(self, update: Any) -> None:
        with self._update_lock:
            self._latest_update = (update.serial, int(update.removed) | 2 * int(update.added))

    # -- the loop ----------------------------------------------------------------
    def fit(self, fit: Callable[..., Any], model: Any, args: Any, kwargs: Any,
            run: Callable[[Any, Any, Any], Any]) -> Any:
        """Keras' `fit(model, *args, **kwargs)` through member changes; `run`
        runs one try (model, args, kwargs) as tf_smb's fit hook does."""
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        from tf_smb.elastic.worker import WorkerRemoved  # pylint: disable=import-outside-toplevel
        from tf_smb.keras_support.fit import with_callback  # pylint: disable=import-outside-toplevel
        bound = inspect.signature(fit).bind(model, *args, **kwargs)
        steps_per_epoch = bound.arguments.get("steps_per_epoch")
        first_epoch = int(bound.arguments.get("initial_epoch") or 0)
        self.worker.mark_joined()
        if not self._following:
            self._following = True
            self.worker.follow_host_updates(id(self), self._on_host_update)
        commit = _Commit(first_epoch, 0)
        records: Dict[int, Dict[str, Any]] = {}
        sync = True
        resume = self.worker.resumes()
        while True:
            try:
                if resume:
                    resume = False
                    self.changes.append({"cause": "resumed", "caught_at": time.time()})
                    commit = self._resume_point() or commit
                elif self.asynchronous:
                    commit = self._agreed_position(commit)
                elif sync:
                    commit.epoch, commit.batch = self._from_rank0([commit.epoch, commit.batch])
                self._trained = True
                skip = commit.batch
                if steps_per_epoch:  # one iterator for every epoch: skip the epochs too
                    skip += (commit.epoch - first_epoch) * int(steps_per_epoch)
                self.strategy.extended.skip_batches(skip)
                callback = _CommitCallback(self, commit, records, sync)
                bound.arguments["initial_epoch"] = commit.epoch
                with with_callback(fit, model, bound.args[1:], bound.kwargs, callback) as (a, k):
                    history = run(model, a, k)
                return _whole_history(history, records)
            except _HostsUpdated as e:
                sync = not e.removed_only  # only removed: every member holds the state
                self.changes.append({"cause": "hosts updated", "caught_at": time.time()})
            except _GenerationMovedOn:
                self.changes.append({"cause": "members changed", "caught_at": time.time()})
                self.finish_generation()  # no rollback: the box held the parameters
                if self.worker.across_nodes:  # the next mpirun's processes start from it
                    self.keep_last_on_node(model, commit)
            except tf.errors.AbortedError:  # a member was lost: back to the last commit
                # (async: its own copies; rank 0's go to all when the next try starts)
                self.changes.append({"cause": "member lost", "caught_at": time.time()})
                if commit.values is not None:
                    for variable, value in zip(self.tracked(model), commit.values):
                        variable.assign(value)
                for epoch in [e for e in records if e >= commit.epoch]:
                    del records[epoch]
                sync = True
            finally:
                self.strategy.extended.skip_batches(0)
            if self.worker.across_nodes:
                self.worker.end_generation()  # the launcher starts the next one
            try:
                job = self.worker.rejoin(RESET_TIMEOUT_S)
            except WorkerRemoved:
                sys.exit(0)  # left out of the job: done, as Horovod's workers are
            self.strategy.rejoined(job)
            for make in ("make_train_function", "make_test_function", "make_predict_function"):
                getattr(model, make)(force=True)  # Keras traces them again, for the new size


def _whole_history(history: Any, records: Dict[int, Dict[str, Any]]) -> Any:
    """`history` (the last try's) with every epoch of this process's tries."""
    if history is None or not records:
        return history
    epochs = sorted(records)
    history.epoch = epochs
    names = sorted({name for logs in records.values() for name in logs})
    history.history = {name: [records[e].get(name) for e in epochs] for name in names}
    return history


def _commit_callback_class() -> Any:
    import keras  # pylint: disable=import-outside-toplevel

    class CommitCallback(keras.callbacks.Callback):
        """Commits (in memory) and hears of host updates (see the module)."""

        def __init__(self, elastic: ElasticFit, commit: _Commit,
                     records: Dict[int, Dict[str, Any]], sync: bool) -> None:
            super().__init__()
            self._elastic = elastic
            self._commit = commit
            self._records = records
            self._sync = sync
            self._epoch_now = commit.epoch
            self._skipped = commit.batch
            self._since_commit = 0
            self._change: Optional[Exception] = None  # a change heard at an epoch's end

        def on_train_begin(self, logs=None):
            if self._sync or self._elastic.asynchronous:
                self._elastic.sync_variables(self.model)
            if self._elastic.asynchronous:  # before fit traces its step
                self._elastic.strategy.place_box_variables()
            self._keep(self._commit.epoch, self._commit.batch)

        def on_epoch_begin(self, epoch, logs=None):
            if self._change is not None:  # heard at the last epoch's end
                raise self._change
            if epoch != self._epoch_now:
                self._skipped = 0
            self._epoch_now = epoch

        def on_train_batch_end(self, batch, logs=None):
            changes = self._elastic.changes
            if changes and "resumed_s" not in changes[-1]:  # the first step since a change
                changes[-1]["stepped_at"] = time.time()
                changes[-1]["resumed_s"] = changes[-1]["stepped_at"] - changes[-1]["caught_at"]
            self._since_commit += 1
            done = self._skipped + batch + 1
            if self._elastic.asynchronous:  # this worker reads every size-th global batch
                last = batch + 1 == self.params.get("steps")
                done = self._skipped + (batch + 1) * self._elastic.strategy.size
            else:
                last = done == self.params.get("steps")
            # The epoch's last batch commits at the epoch's end (after validation).
            if self._since_commit >= self._elastic.commit_steps and not last:
                self._commit_and_check(self._epoch_now, done)

        def on_epoch_end(self, epoch, logs=None):
            self._elastic.strategy.extended.stop_skipping()
            self._records[epoch] = dict(logs or {})
            try:
                self._commit_and_check(epoch + 1, 0)
            except (_HostsUpdated, _GenerationMovedOn) as change:
                # Stop when the next epoch begins: the other callbacks end this one
                # first (a checkpoint, a log). After the last epoch, training is done.
                self._change = change

        def _commit_and_check(self, epoch: int, batch: int) -> None:
            start = time.perf_counter()
            self._keep(epoch, batch)
            if self._elastic.asynchronous:
                moved_on = self._elastic.generation_moved_on()  # asks no one
            else:
                self._elastic.check_host_updates()  # raises _HostsUpdated on every member
            self._elastic.commit_seconds.append(time.perf_counter() - start)
            if self._elastic.asynchronous and moved_on:
                raise _GenerationMovedOn()

        def _keep(self, epoch: int, batch: int) -> None:
            self._since_commit = 0
            self._commit.epoch, self._commit.batch = epoch, batch
            worker = self._elastic.worker
            if self._elastic.asynchronous and not worker.keeps_node_commit:
                return  # the box keeps the parameters: a commit is the position only
            # Copies in host memory: the commit survives whatever the next step does
            # (async across nodes: this worker's copies, read from the box at its step).
            self._commit.values = [v.numpy() for v in self._elastic.tracked(self.model)]
            if worker.keeps_node_commit:  # across nodes: the node's box outlives us
                _keep_on_node(worker, self._commit)

    return CommitCallback


def _CommitCallback(*args: Any) -> Any:  # pylint: disable=invalid-name
    """A Keras callback (Keras imported only when fit runs)."""
    return _commit_callback_class()(*args)
