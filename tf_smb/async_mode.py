"""The asynchronous mode of SMBStrategy: parameters that live in the box.

    engine = AsyncEngine(job, AsyncConfig(staleness=2), SMBCollectives())
    engine.place(variable)           # at creation: the box holds the master copy
    engine.run_step(fn, args, kwargs)   # every step: wait (SSP clock), read, run, push
    engine.update(var, args, apply_locally, group)   # a change to push, or an SGD step
    engine.finish()                  # at the end: wait for the others, load the box

DataParallelExtended (tf_smb/data_parallel.py) calls these when it has an
engine; SMBStrategy(mode="async") gives it one when there are 2+ workers.

Each trainable variable has a box segment named after the variable's path
(see `segment_name`). Every worker creates the same variables in the same
order; at each creation the workers compare (segment, dtype, shape) and all of
them raise the same error when any differs, rather than let one worker train
another's variable.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import sys
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import tensorflow as tf

from tf_smb import env as env_lib
from tf_smb import phase
from tf_smb import ops as smb_ops
from tf_smb.collectives import Collectives
from tf_smb.options import AsyncConfig  # noqa: F401  (importable from here too)

# Box segment names have at most 127 bytes (cc/smb/box.h, kSegmentNameBytes);
# the momentum updater names its velocity segment "<name>/velocity".
MAX_SEGMENT_NAME_BYTES = 100
_HASH_CHARS = 8
# Room for one worker's "'<segment>' <dtype>[<shape>]" in the agreement check.
_DESCRIPTION_BYTES = 1024


@dataclasses.dataclass(frozen=True)
class BoxSegment:
    """A variable's master copy in the box: segment name, dtype and shape."""

    name: str
    dtype: tf.DType
    shape: Tuple[int, ...]

    def describe(self) -> str:
        """E.g. "'sequential/dense/kernel' float32[4,3]"."""
        return f"'{self.name}' {self.dtype.name}[{','.join(str(d) for d in self.shape)}]"


def segment_name(path: str, occurrence: int = 1) -> str:
    """The box segment name of the `occurrence`-th variable with `path`.

    The path itself when it fits in MAX_SEGMENT_NAME_BYTES ("dense/kernel";
    the second "dense/kernel" of a process is "dense/kernel#2"); a longer one
    keeps its readable end behind a hash of the whole: "1a2b3c4d~...dense/kernel".
    """
    name = path if occurrence == 1 else f"{path}#{occurrence}"
    if 0 < len(name.encode("utf-8")) <= MAX_SEGMENT_NAME_BYTES:
        return name
    digest = hashlib.sha256(name.encode("utf-8")).hexdigest()[:_HASH_CHARS]
    room = MAX_SEGMENT_NAME_BYTES - _HASH_CHARS - 1
    tail = name
    while len(tail.encode("utf-8")) > room:
        tail = tail[1:]
    return f"{digest}~{tail}"


def variable_path(variable: tf.Variable) -> str:
    """Where the variable sits: the `path` of the Keras variable it belongs to
    while Keras creates it (e.g. "sequential/dense/kernel"), else its
    TensorFlow name without the ":0" (e.g. "outer/w")."""
    return _creating_keras_variable_path() or variable.name.rsplit(":", 1)[0]


# How far up the stack a Keras variable creating a tf.Variable may sit.
_KERAS_FRAMES = 40


def _creating_keras_variable_path() -> str:
    """The path of the Keras variable creating a tf.Variable now, else "".

    Keras 3's TensorFlow backend creates the tf.Variable in a method of the
    keras.Variable (`_initialize`), also when it initialises a variable
    later than it made it (a subclassed model built in a stateless scope),
    when Keras' name scope no longer gives the path.
    """
    keras = sys.modules.get("keras")
    keras_variable = getattr(keras, "Variable", None)
    if keras_variable is None:
        return ""  # Keras 3 is not loaded, so it is not creating this variable
    frame = sys._getframe(1)  # pylint: disable=protected-access
    for _ in range(_KERAS_FRAMES):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras_variable):
            return str(owner.path)
        frame = frame.f_back
    return ""


def _is_variable(value: Any) -> bool:
    return isinstance(value, tf.Variable) or (hasattr(value, "assign") and hasattr(value, "value"))


def sgd_step(args: Sequence[Any], config: AsyncConfig) -> Optional[Tuple[tf.Tensor, Any]]:
    """With update="sgd": the (dense gradient, learning_rate) of an update the
    box applies as an SGD step (`sgd_step_arguments`), else None: the worker
    applies the update itself and pushes its change. The one copy of this rule
    for one replica a process and for replica threads (local_replicas.py)."""
    step = sgd_step_arguments(args) if config.update == "sgd" else None
    if step is None:
        return None
    grad, learning_rate = step
    if isinstance(grad, tf.IndexedSlices):
        grad = tf.convert_to_tensor(grad)
    return grad, learning_rate


def sgd_step_arguments(args: Sequence[Any]) -> Optional[Tuple[Any, Any]]:
    """With update="sgd": the (gradient, learning_rate) of an update the box
    applies as an SGD step, or None for an update the worker applies itself
    and pushes as a change (delta).

    Keras 3 optimizers update a variable from (gradient, learning_rate).
    Their other updates of trainable variables are not gradient steps and go
    through as deltas: weight decay (no arguments) and the overwrite with the
    moving average (`use_ema=True`: one argument, a variable).

    Raises:
      ValueError: for a gradient without a learning rate (tf_keras/Keras 2 and
        TF1 optimizers, or `extended.update(var, fn, args=(grad,))`): the box
        cannot apply an SGD step without one.
    """
    if len(args) >= 2:
        return args[0], args[1]
    if len(args) == 1 and not _is_variable(args[0]):
        raise ValueError(
            "SMBStrategy(mode='async', update='sgd') has the box apply each "
            "gradient step from (gradient, learning_rate), but this variable "
            "update passed a gradient alone (1 argument), as tf_keras/Keras 2 "
            "and TF1 optimizers do. Use a Keras 3 optimizer (keras.optimizers.SGD), "
            "or update='delta', which works with any optimizer.")
    return None


# Segment names taken in this process (one box per process), so that two
# strategies, or two variables with one path, never share a segment.
_TAKEN: Dict[str, int] = {}
_TAKEN_LOCK = threading.Lock()


def take_segment_name(variable: tf.Variable) -> str:
    """A segment name of this process for `variable` (see `segment_name`),
    from where it sits (`variable_path`: call it while the variable is made)."""
    return _take_segment_name(variable_path(variable))


def _take_segment_name(path: str) -> str:
    with _TAKEN_LOCK:
        occurrence = 1
        while segment_name(path, occurrence) in _TAKEN:
            occurrence += 1
        name = segment_name(path, occurrence)
        _TAKEN[name] = 1
        return name


def disagreement_message(index: int, descriptions: Sequence[str]) -> Optional[str]:
    """The error when the workers' descriptions of their `index`-th box
    parameter differ (one per rank), else None."""
    if len(set(descriptions)) <= 1:
        return None
    lines = "\n".join(f"  rank {r}: {d}" for r, d in enumerate(descriptions))
    return (
        "SMBStrategy(mode='async'): the workers created different trainable "
        f"variables as box parameter #{index} (segment, dtype, shape):\n{lines}\n"
        "Every worker must create the same trainable variables, with the same "
        "names, in the same order (build the model the same way on every "
        "worker); otherwise a worker would train another worker's variable. "
        "Keras numbers unnamed layers per process (dense, dense_1, ...), so a "
        "model built on some workers only shifts the names of later ones: "
        "name the layers, or build the same models on every worker.")


def _ordered_after(ops: Sequence[Any]) -> Any:
    """A context whose ops run after `ops`: explicit control dependencies
    outside a tf.function. Inside one, TensorFlow's automatic control
    dependencies already run the ops on each variable in program order, and
    explicit ones on every op of a step made the first step's graph slower to
    build and optimize (measured: ~30 ms of keras_digits' first step)."""
    if tf.inside_function():
        return contextlib.nullcontext()
    return tf.control_dependencies(ops)


@dataclasses.dataclass
class _StepUpdates:
    """A training step's updates of box-held variables, for its end."""

    pushes: Dict[Any, tf.Tensor] = dataclasses.field(default_factory=dict)  # ref -> delta
    box_steps: List[Any] = dataclasses.field(default_factory=list)  # SGD ops in the box


class AsyncEngine:
    """Trainable variables held in the box: placing, reading, pushing, clock.

    Args:
      job: this worker's rank and the number of workers (2 or more).
      config: how updates are applied (AsyncConfig).
      collectives: what compares the workers' variables and broadcasts rank
        0's initial values (the box's collectives).
    """

    def __init__(self, job: env_lib.JobInfo, config: AsyncConfig,
                 collectives: Collectives) -> None:
        self._job = job
        self._config = config
        self._collectives = collectives
        self._segments: Dict[Any, BoxSegment] = {}
        # `step`: the _StepUpdates of the step run_step runs in this thread.
        self._local = threading.local()
        with tf.init_scope():
            # For monitoring: the largest lead over the slowest worker this
            # worker had when a step started, and the steps it started.
            self.max_clock_gap = tf.Variable(0, dtype=tf.int64, trainable=False)
            self.steps = tf.Variable(0, dtype=tf.int64, trainable=False)

    @property
    def config(self) -> AsyncConfig:
        """The options this engine runs with."""
        return self._config

    @property
    def segments(self) -> Dict[Any, BoxSegment]:
        """The box segment of every placed variable, keyed by `variable.ref()`."""
        return self._segments

    def segment_of(self, variable: tf.Variable) -> Optional[BoxSegment]:
        """The variable's box segment, or None when the box does not hold it."""
        return self._segments.get(variable.ref())

    def place(self, variable: tf.Variable, name: Optional[str] = None) -> None:
        """Makes the box hold the variable's master copy, from rank 0's value,
        after checking that every worker creates the same variable here. Its
        segment is `name` when given (an elastic job places its variables again
        in each generation's box, under the names they took at creation).

        Raises:
          ValueError: outside eager execution, or (on every worker) when the
            workers' variables differ in segment name, dtype or shape.
        """
        with tf.init_scope():
            if not tf.executing_eagerly():
                raise ValueError("SMBStrategy(mode='async') creates variables eagerly; "
                                 "create them outside tf.function")
            param = BoxSegment(name or take_segment_name(variable), variable.dtype,
                               tuple(variable.shape.as_list()))
            self._check_same_everywhere(param)
            value = variable.read_value()
            if self._job.rank == 0:  # before the broadcast, which orders it first
                smb_ops.segment_create(value, param.name, write=True)
            variable.assign(self._collectives.broadcast([value], root=0)[0])
            if self._job.rank != 0:
                smb_ops.segment_create(variable.read_value(), param.name, write=False)
            self._segments[variable.ref()] = param

    def _check_same_everywhere(self, param: BoxSegment) -> None:
        descriptions = self._collectives.allgather_text(
            param.describe(), self._job.rank, self._job.size, _DESCRIPTION_BYTES)
        message = disagreement_message(len(self._segments), descriptions)
        if message is not None:
            raise ValueError(message)

    @property
    def reads_at_step_end(self) -> bool:
        """Whether a training step reads the box at its end, for the next step,
        in the same pass as its pushes (read_at="push"), rather than at its
        start (after the clock's wait)."""
        return self._config.read_at == "push"

    def _push_read(self, pushes: Dict[Any, tf.Tensor], read: bool) -> Optional[tf.Operation]:
        """One op: each variable of `pushes` (ref -> delta) pushes its delta;
        with `read`, then every box-held variable gets the box's value."""
        refs = list(pushes) + ([r for r in self._segments if r not in pushes] if read else [])
        return smb_ops.segments_push_read(
            [r.deref() for r in refs], [self._segments[r].name for r in refs],
            [pushes[r] for r in pushes], read=read, consistent=self._config.consistent)

    def refresh(self) -> None:
        """Sets every box-held variable to the box's current value."""
        self._push_read({}, read=True)

    def run_step(self, fn: Callable[..., Any], args: Sequence[Any],
                 kwargs: Dict[str, Any]) -> Any:
        """Runs a step of `fn`. A training step waits within the staleness bound
        first and pushes its updates in one op at its end (`update`). The box's
        current parameters go into the local variables at the step's start,
        or with read_at="push" in that same op at the end of the previous
        training step (`reads_at_step_end`)."""
        if not tf.executing_eagerly():
            # A tf.function step (Keras 3.3's one_step_on_data) traced inline:
            # its updates' changes are pushed from this graph, which must hold them.
            fn = getattr(fn, "python_function", fn)
        training = not phase.is_evaluating()
        read_at_end = training and self.reads_at_step_end
        starts = self.start_step(args, kwargs, read=not read_at_end)
        updates = _StepUpdates()
        self._local.step = updates
        try:
            with _ordered_after(starts):
                result = fn(*args, **kwargs)
        finally:
            self._local.step = None
        if updates.pushes or read_at_end:
            done = [r for r in tf.nest.flatten(result) if isinstance(r, (tf.Tensor, tf.Operation))]
            # The box's own SGD steps share no variable with the read: explicit order.
            with _ordered_after(done), tf.control_dependencies(updates.box_steps):
                self._push_read(updates.pushes, read=read_at_end)
        return result

    def start_step(self, args: Sequence[Any], kwargs: Dict[str, Any],
                   read: bool = True) -> List[Any]:
        """The ops that start a step: the wait within the staleness bound
        (training only), then, with `read`, the box's current parameters read
        into the local variables. The step's own ops must depend on them."""
        deps: List[Any] = []
        if not phase.is_evaluating():
            # After the input arrived: the end of an epoch is not a step.
            inputs = [t for t in tf.nest.flatten((args, kwargs)) if tf.is_tensor(t)]
            with tf.control_dependencies(inputs):
                gap = smb_ops.clock_tick(self._config.staleness)
            deps = [self.max_clock_gap.assign(tf.maximum(self.max_clock_gap, gap)),
                    self.steps.assign_add(1)]
        if read:
            with tf.control_dependencies(deps):
                deps.append(self._push_read({}, read=True))
        return [op for op in deps if op is not None]

    def update(self, var: tf.Variable, args: Sequence[Any],
               apply_locally: Callable[[], Any], group: bool) -> Any:
        """Updates box-held `var`: the box applies an SGD step (update="sgd"
        and a gradient step, see `sgd_step_arguments`), or `apply_locally()`
        runs the worker's own update and its change goes into the box: at the
        end of the step `run_step` runs (with the others' in one op), or at
        once outside one; within `local_assignments` only locally. Returns
        what `extended.update` returns."""
        if getattr(self._local, "assigning_locally", 0):
            return apply_locally()
        param = self._segments[var.ref()]
        step = sgd_step(args, self._config)
        if step is not None:
            grad, learning_rate = step
            applied = smb_ops.segment_apply_sgd(grad, learning_rate, param.name,
                                                self._config.momentum)
            step_updates = getattr(self._local, "step", None)
            if step_updates is not None and applied is not None:
                step_updates.box_steps.append(applied)
            return tf.no_op() if group else (tf.no_op(),)
        before = var.read_value()
        with _ordered_after([before]):
            result = apply_locally()
        with _ordered_after([r for r in tf.nest.flatten(result) if r is not None]):
            delta = var.read_value() - before
        step_updates = getattr(self._local, "step", None)
        if step_updates is None:
            smb_ops.segment_push(delta, param.name)
        else:  # a second update of var in one step (e.g. weight decay) adds up
            pushes = step_updates.pushes
            pushes[var.ref()] = pushes[var.ref()] + delta if var.ref() in pushes else delta
        return result

    @contextlib.contextmanager
    def local_assignments(self) -> Iterator[None]:
        """Within it, this thread's updates of box-held variables change the
        worker's copies only, not the box: for weights set from outside
        training (a file loaded), which the caller then writes into the box."""
        self._local.assigning_locally = getattr(self._local, "assigning_locally", 0) + 1
        try:
            yield
        finally:
            self._local.assigning_locally -= 1

    def finish(self) -> None:
        """This worker is done training: waits for the other live workers,
        then loads the box's final values."""
        smb_ops.clock_finish(True)
        smb_ops.wait_all_finished()
        # Across nodes no barrier follows: the others may still read segments
        # homed on this node, and its link serves them until every rank exits,
        # also when a node was lost (a barrier would fail then).
        self.refresh()
