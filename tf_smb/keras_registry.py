"""Every Keras attribute tf_smb hooks, in one place, found by feature detection.

Keras 3 offers no extension point for a few things a drop-in strategy must do
(see the modules beside this one), so tf_smb wraps a small set of Keras
functions and methods. Each is a `Hook` here: where it may live (the first place
that exists wins, so a Keras that renamed a class still works), the instance
attributes the wrapper relies on, and what the hook gives the user. `check()`
finds them all before a strategy runs and raises `KerasHookMissingError` naming
the Keras version, the hook and what it provides, so an unsupported Keras stops
with the reason before it trains, instead of training with different math.
tests/test_keras_hooks.py walks the same list on every tested Keras.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
from typing import Any, Dict, List, Optional, Tuple

# What the README states as tested (tools/keras_venv.sh builds each pair).
TESTED = ("TensorFlow 2.16.2 + Keras 3.3.3, TensorFlow 2.19 + Keras 3.10, TensorFlow 2.21 + "
          "Keras 3.15 and TensorFlow 2.21 + keras-nightly 3.16.0.dev2026102704")


class KerasHookMissingError(RuntimeError):
    """The running Keras lacks something tf_smb must hook; the message says what."""


@dataclasses.dataclass(frozen=True)
class Hook:
    """One Keras attribute tf_smb replaces by a wrapper.

    Attributes:
      name: short name, as the error and the tests say it.
      places: where it may live, "module:Owner.attribute" (a class's) or
        "module:attribute" (a module's); the first that exists is hooked.
      provides: what the user gets from it (said when it is missing).
      reads: instance attributes the wrapper reads or sets on the owner's
        objects; found in the source of the owner's classes.
      called_only: tf_smb calls it (from a hook) but does not replace it.
      instead: where none of `places` exists, these hooks together give the
        same result (a fallback for older Keras); `locate` then returns None.
    """
    name: str
    places: Tuple[str, ...]
    provides: str
    reads: Tuple[str, ...] = ()
    called_only: bool = False
    instead: Tuple["Hook", ...] = ()


@dataclasses.dataclass(frozen=True)
class Found:
    """Where a hook lives in the running Keras."""
    hook: Hook
    owner: Any
    attribute: str
    place: str

    def original(self) -> Any:
        """The attribute as Keras (or an earlier hook) left it."""
        return getattr(self.owner, self.attribute)

    def replace(self, value: Any) -> None:
        """Puts `value` in the attribute's place."""
        setattr(self.owner, self.attribute, value)


_TRAINER = "keras.src.backend.tensorflow.trainer"
_TF_OPTIMIZER = "keras.src.backend.tensorflow.optimizer:TFOptimizer"

# Keras 3.3 builds models, metrics and optimizers inside the first step's trace;
# tf_smb then builds them itself before that step, from the data's structure.
_BUILT_BEFORE = ("models, metrics and optimizers built from the data's structure before "
                 "the first step, outside any tf.function, as Keras 3.4+ does")
SYMBOLIC_BUILD = Hook("symbolic build", ("keras.src.trainers.trainer:Trainer._symbolic_build",),
                      _BUILT_BEFORE, called_only=True)
MAKE_TRAIN_FUNCTION = Hook(
    "make_train_function", (f"{_TRAINER}:TensorFlowTrainer.make_train_function",), _BUILT_BEFORE)
MAKE_TEST_FUNCTION = Hook(
    "make_test_function", (f"{_TRAINER}:TensorFlowTrainer.make_test_function",), _BUILT_BEFORE)
TRAIN_STEP = Hook(
    "train step", (f"{_TRAINER}:TensorFlowTrainer.train_step",),
    "gradients of Keras 3.3's undivided loss averaged, not summed, over workers")
METRIC_ADD_VARIABLE = Hook(
    "metric variables", ("keras.src.metrics.metric:Metric.add_variable",),
    "metrics summed over workers when read (Keras 3.3 makes them per worker)")
VARIABLE_INITIALIZE = Hook(
    "variable initialize", ("keras.src.backend.tensorflow.core:Variable._initialize",),
    "metrics summed over workers when read (Keras 3.3 makes them per worker)")
COMPUTE_LOSS = Hook(
    "compute loss", ("keras.src.trainers.trainer:Trainer.compute_loss",),
    "gradients of Keras 3.3's undivided loss averaged, not summed, over workers, also in "
    "a custom train_step that calls compute_loss")
LOSS_REDUCE = Hook(
    "loss reduction", ("keras.src.losses.loss:reduce_values",),
    "a replica's empty part of a batch has loss 0, not NaN (Keras 3.3 divides by 0 rows)")
EPOCH_STEPS = Hook(
    "epoch steps", (f"{_TRAINER}:TFEpochIterator.enumerate_epoch",),
    "an epoch of no batch for this worker (an asynchronous worker's share of the data, or "
    "of a resumed epoch's rest, is empty) takes no step, as in Keras 3.4+ (Keras 3.3 "
    "would call its train step on the empty data)",
    reads=("steps_per_epoch", "num_batches", "data_adapter"))
EPOCH_LOGS = Hook(
    "epoch logs", ("keras.src.trainers.trainer:Trainer._get_metrics_result_or_logs",),
    "fit ends an epoch without a step with empty logs, as Keras 3.4+ (Keras 3.3 fails)")
LOSS_DISTRIBUTION_SCALE = Hook(
    "loss scaling over replicas", ("keras.src.losses.loss:scale_loss_for_distribution",),
    "gradients of a global batch that splits unevenly over replicas weighted by each "
    "replica's rows, as one process on the global batch (Keras 3.4+; Keras 3.3 does "
    "not divide the loss: its train step is hooked instead)",
    instead=(TRAIN_STEP, COMPUTE_LOSS))
BUILD_MARKER = Hook(
    "build marker",
    (f"{_TRAINER}:TensorFlowTrainer._maybe_symbolic_build",  # Keras 3.4-3.15
     f"{_TRAINER}:Trainer._maybe_symbolic_build"),  # keras-nightly 3.16
    "models, metrics and optimizers built from the first batch before training "
    "starts, taking that batch's structure without combining it over replicas",
    instead=(SYMBOLIC_BUILD, MAKE_TRAIN_FUNCTION, MAKE_TEST_FUNCTION,
             METRIC_ADD_VARIABLE, VARIABLE_INITIALIZE, TRAIN_STEP, COMPUTE_LOSS, LOSS_REDUCE,
             EPOCH_STEPS, EPOCH_LOGS))
EPOCH_ITERATOR = Hook(
    "epoch length", (f"{_TRAINER}:TFEpochIterator.__init__",),
    "asynchronous fit counts each worker's own batches and validates on all the data",
    reads=("data_adapter", "_num_batches", "steps_per_epoch"))
FIT = Hook("fit", ("keras:Model.fit",),
           "one shuffle order for all workers; asynchronous fit's start and end")
EVALUATE = Hook("evaluate", ("keras:Model.evaluate",),
                "asynchronous evaluate reads the box and takes no step")
PREDICT = Hook("predict", ("keras:Model.predict",),
               "asynchronous predict reads the box and takes no step")
ARRAY_SHUFFLE = Hook(
    "array shuffle",
    ("keras.src.trainers.data_adapters.array_data_adapter:ArrayDataAdapter.get_tf_dataset",),
    "arrays shuffled by fit in one order on every worker (each row once per epoch)",
    reads=("_shuffle", "_batch_size", "_num_samples", "_partial_batch_size", "_inputs"))
ARRAY_SLICING = Hook(
    "array slicing",
    ("keras.src.trainers.data_adapters.array_slicing:convert_to_sliceable",),
    "arrays shuffled by fit in one order on every worker (their batches)",
    called_only=True)
OPTIMIZER_APPLY = Hook(
    "optimizer apply", ("keras.src.optimizers.base_optimizer:BaseOptimizer.apply",),
    "gradient clipping of the gradient summed over workers (Keras 3.3 clips here)")
APPLY_GRADIENTS = Hook(
    "optimizer backend apply", (f"{_TF_OPTIMIZER}._backend_apply_gradients",),
    "gradient clipping of the gradient summed over workers (gradient_clipping='after_sum')")
CLIP_GRADIENTS = Hook(
    "optimizer clipping", (f"{_TF_OPTIMIZER}._clip_gradients",),
    "gradient clipping of the gradient summed over workers (gradient_clipping='after_sum')")
SUM_GRADIENTS = Hook(
    "optimizer sum", (f"{_TF_OPTIMIZER}._all_reduce_sum_gradients",),
    "gradients summed exactly once when clipping after the sum")
LOSS_SCALE_CHECK = Hook(
    "loss-scale skip",
    ("keras.src.optimizers.loss_scale_optimizer:LossScaleOptimizer.check_finite",),
    "LossScaleOptimizer skips a step on every worker when any worker's gradients "
    "are not finite")
SAVE = Hook("save", ("keras:Model.save",), "rank 0 alone writes model files")
SAVE_WEIGHTS = Hook("save_weights", ("keras:Model.save_weights",),
                    "rank 0 alone writes weight files")
EXPORT = Hook("export", ("keras:Model.export",), "rank 0 alone exports the model")
SAVE_MODEL = Hook("save_model", ("keras.src.saving.saving_api:save_model",),
                  "rank 0 alone writes keras.saving.save_model's files")
LOAD_WEIGHTS = Hook("load_weights", ("keras:Model.load_weights",),
                    "asynchronous mode: loaded weights become the box's master copies")
SET_WEIGHTS = Hook("set_weights", ("keras:Layer.set_weights",),
                   "asynchronous mode: weights set outside training go into the box")
LOAD_MODEL = Hook("load_model", ("keras.src.saving.saving_api:load_model",),
                  "asynchronous mode: a loaded model's weights go into the box")
TENSORBOARD = Hook(
    "TensorBoard", ("keras.callbacks:TensorBoard.set_model",),
    "TensorBoard writes from rank 0 only",
    reads=("log_dir", "_writers"))
TENSORBOARD_EVENTS = Hook(
    "TensorBoard events", ("keras.callbacks:TensorBoard.on_epoch_end",),
    "TensorBoard writes from rank 0 only (its on_* methods do nothing elsewhere)")
BACKUP_RESTORE = Hook(
    "BackupAndRestore restore",
    ("keras.callbacks:BackupAndRestore._load_model",  # Keras 3.4+
     "keras.callbacks:BackupAndRestore.on_train_begin"),  # Keras 3.3 loads there
    "BackupAndRestore: every worker restores rank 0's backup",
    reads=("backup_dir", "_weights_path", "_training_metadata_path"), called_only=True)
BACKUP_SAVE = Hook(
    "BackupAndRestore save", ("keras.callbacks:BackupAndRestore._save_model",),
    "BackupAndRestore: rank 0 writes the backup atomically",
    reads=("_current_epoch", "_last_batch_seen", "delete_checkpoint"))
BACKUP_BEGIN = Hook("BackupAndRestore begin", ("keras.callbacks:BackupAndRestore.on_train_begin",),
                    "BackupAndRestore: every worker restores rank 0's backup")
BACKUP_END = Hook("BackupAndRestore end", ("keras.callbacks:BackupAndRestore.on_train_end",),
                  "BackupAndRestore: rank 0 deletes the backup once every worker is done")

@dataclasses.dataclass(frozen=True)
class Private:
    """A private attribute (or method) of Keras' objects that tf_smb reads, writes
    or overrides, because Keras offers no public way. Code outside this module
    reaches it only through `read`, `write` and `name_of`, so every private name
    tf_smb depends on is listed here (tests/test_keras_hooks.py checks that) and
    checked on the running Keras like a Hook.

    Attributes:
      name: the attribute, e.g. "_distribute_strategy".
      owners: "module:Class" places whose source defines it; the first that exists
        is checked (its source must mention the name, or the class have it).
      provides: what the user gets from it (said when it is missing).
    """
    name: str
    owners: Tuple[str, ...]
    provides: str


_ADAPTERS = "keras.src.trainers.data_adapters"
MODEL_STRATEGY = Private(
    "_distribute_strategy", (f"{_TRAINER}:TensorFlowTrainer",  # Keras 3.3-3.15
                             f"{_TRAINER}:Trainer"),  # keras-nightly 3.16
    "the strategy a model was made under (`model.distribute_strategy` answers with the "
    "strategy in scope at the call instead)")
OPTIMIZER_STRATEGY = Private(
    "_distribution_strategy", (_TF_OPTIMIZER,),
    "the strategy an optimizer was made under, whose hooks then act")
OPTIMIZER_UPDATE_STEP = Private(
    "_distributed_tf_update_step", (_TF_OPTIMIZER,),
    "Keras 3.3's gradient sum inside the optimizer's merge call, told from 3.4+'s")
OPTIMIZER_VARIABLES = Private(
    "_trainable_variables", ("keras.src.optimizers.base_optimizer:BaseOptimizer",),
    "tf_smb.horovod's DistributedOptimizer.apply without explicit variables")
EPOCH_BATCHES = Private(
    "_num_batches", ("keras.src.trainers.epoch_iterator:EpochIterator",),
    "an asynchronous worker's epoch counts its own batches")
ADAPTER_DATASET = Private(
    "_dataset", (f"{_ADAPTERS}.tf_dataset_adapter:TFDatasetAdapter",),
    "an asynchronous fit honours the dataset's AutoShardPolicy.OFF")
_ARRAY_ADAPTER = (f"{_ADAPTERS}.array_data_adapter:ArrayDataAdapter",)
ARRAY_SHUFFLE_MODE, ARRAY_BATCH_SIZE, ARRAY_SAMPLES, ARRAY_PARTIAL_BATCH, ARRAY_INPUTS = (
    Private(name, _ARRAY_ADAPTER, "arrays shuffled by fit in one order on every worker")
    for name in ("_shuffle", "_batch_size", "_num_samples", "_partial_batch_size",
                 "_inputs"))
_BACKUP = ("keras.callbacks:BackupAndRestore",)
BACKUP_WEIGHTS_PATH, BACKUP_METADATA_PATH, BACKUP_EPOCH, BACKUP_BATCH = (
    Private(name, _BACKUP, "BackupAndRestore: rank 0 writes each backup atomically, "
            "every worker restores it")
    for name in ("_weights_path", "_training_metadata_path", "_current_epoch",
                 "_last_batch_seen"))
MODEL_INITIAL_EPOCH = Private(
    "_initial_epoch", ("keras.callbacks:BackupAndRestore",),
    "BackupAndRestore: every worker restored the same epoch (checked)")
VARIABLE_VALUE = Private(
    "_value", ("keras.src.backend.tensorflow.core:Variable",  # Keras 3.3-3.15
               "keras.src.backend.tensorflow.ops.core:Variable"),  # keras-nightly 3.16
    "asynchronous mode: weights set outside training go into the box")
BATCH_NORM_MOMENTS = Private(
    "_moments", ("keras.src.layers.normalization.batch_normalization:BatchNormalization",),
    "tf_smb.horovod's SyncBatchNormalization: moments over all workers")
BATCH_NORM_AXES = Private(
    "_reduction_axes",
    ("keras.src.layers.normalization.batch_normalization:BatchNormalization",),
    "tf_smb.horovod's SyncBatchNormalization: moments over all workers")

_TENSORBOARD = ("keras.callbacks:TensorBoard",)
TENSORBOARD_MODEL, TENSORBOARD_LOG_WRITE_DIR, TENSORBOARD_TRAIN_DIR, TENSORBOARD_VAL_DIR, \
    TENSORBOARD_WRITERS, TENSORBOARD_TRAIN_GRAPH = (
        Private(name, _TENSORBOARD, "TensorBoard writes from rank 0 only (a silent callback "
                "elsewhere, whose writers write nothing)")
        for name in ("_model", "_log_write_dir", "_train_dir", "_val_dir", "_writers",
                     "_should_write_train_graph"))
CHECKPOINT_SAVE = Private(
    "_save_model", ("keras.callbacks:ModelCheckpoint",),
    "tf_smb.horovod's BestModelCheckpoint: rank 0 alone saves")

PRIVATES: Tuple[Private, ...] = (
    MODEL_STRATEGY, OPTIMIZER_STRATEGY, OPTIMIZER_UPDATE_STEP, OPTIMIZER_VARIABLES,
    EPOCH_BATCHES, ADAPTER_DATASET, ARRAY_SHUFFLE_MODE, ARRAY_BATCH_SIZE, ARRAY_SAMPLES,
    ARRAY_PARTIAL_BATCH, ARRAY_INPUTS, BACKUP_WEIGHTS_PATH, BACKUP_METADATA_PATH,
    BACKUP_EPOCH, BACKUP_BATCH, MODEL_INITIAL_EPOCH, VARIABLE_VALUE, BATCH_NORM_MOMENTS,
    BATCH_NORM_AXES, TENSORBOARD_MODEL, TENSORBOARD_LOG_WRITE_DIR, TENSORBOARD_TRAIN_DIR,
    TENSORBOARD_VAL_DIR, TENSORBOARD_WRITERS, TENSORBOARD_TRAIN_GRAPH, CHECKPOINT_SAVE)

_MISSING = object()


def read(obj: Any, private: Private, default: Any = _MISSING) -> Any:
    """`obj`'s Keras-private attribute `private` (`default` when it has none;
    AttributeError without a default)."""
    if default is _MISSING:
        return getattr(obj, private.name)
    return getattr(obj, private.name, default)


def write(obj: Any, private: Private, value: Any) -> None:
    """Sets `obj`'s Keras-private attribute `private` to `value`."""
    setattr(obj, private.name, value)


def name_of(private: Private) -> str:
    """The attribute's name, for code that must spell it (an override, a
    `super()` call)."""
    return private.name


def problem_of_private(private: Private) -> Optional[str]:
    """Why the running Keras lacks `private`, or None."""
    for place in private.owners:
        found = _at(place)  # (module, "Class")
        if found is None:
            continue
        owner = getattr(*found)
        # A method or class attribute; or an instance attribute its source sets.
        if hasattr(owner, private.name) or f".{private.name}" in _source_of(owner):
            return None
        return f"{place} is there but no longer has {private.name}"
    return f"it has no {' or '.join(private.owners)}"


def sums_in_merge_call(tf_optimizer: Any) -> bool:
    """Whether this Keras asks for the gradients' sum inside the optimizer's merge
    call (3.3), in cross-replica context, rather than before it (3.4+): its
    `_distributed_tf_update_step` calls `_all_reduce_sum_gradients`."""
    update = read(tf_optimizer, OPTIMIZER_UPDATE_STEP, None)
    try:
        return update is not None and "_all_reduce_sum_gradients" in inspect.getsource(update)
    except (OSError, TypeError):
        return False


HOOKS: Tuple[Hook, ...] = (
    BUILD_MARKER, EPOCH_ITERATOR, FIT, EVALUATE, PREDICT, ARRAY_SHUFFLE, ARRAY_SLICING,
    OPTIMIZER_APPLY, APPLY_GRADIENTS, CLIP_GRADIENTS, SUM_GRADIENTS, LOSS_SCALE_CHECK,
    LOSS_DISTRIBUTION_SCALE, SAVE, SAVE_WEIGHTS,
    EXPORT, SAVE_MODEL, LOAD_WEIGHTS, SET_WEIGHTS, LOAD_MODEL, TENSORBOARD, TENSORBOARD_EVENTS,
    BACKUP_RESTORE,
    BACKUP_SAVE, BACKUP_BEGIN, BACKUP_END)


def keras_version() -> str:
    """The running Keras' version ("none" when Keras does not import)."""
    try:
        import keras  # pylint: disable=import-outside-toplevel
    except ImportError:
        return "none"
    return str(getattr(keras, "__version__", "unknown"))


def _at(place: str) -> Optional[Tuple[Any, str]]:
    """(owner, attribute) for "module:Owner.attribute" or "module:attribute",
    or None when the module, the owner or the attribute is not there."""
    module_name, path = place.split(":")
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError:
        return None
    *owners, attribute = path.split(".")
    for name in owners:
        owner = getattr(owner, name, None)
        if owner is None:
            return None
    return (owner, attribute) if hasattr(owner, attribute) else None


@functools.lru_cache(maxsize=None)
def _class_sources(path: str) -> Dict[str, str]:
    """Each class's source text in the file at `path`, by qualified name. One
    parse per file: `inspect.getsource` parses the whole module again for each
    class (seconds per worker process over the hooks' classes)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        tree = ast.parse(text, path)
    except (OSError, SyntaxError, UnicodeDecodeError):
        return {}
    lines = text.splitlines(keepends=True)
    sources: Dict[str, str] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = prefix + child.name
                sources.setdefault(name, "".join(lines[child.lineno - 1:child.end_lineno]))
                visit(child, name + ".")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{prefix}{child.name}.<locals>.")
    visit(tree, "")
    return sources


def _source_of(owner: Any) -> str:
    """The source of a class and its base classes ('' where unreadable)."""
    texts = []
    for cls in inspect.getmro(owner) if inspect.isclass(owner) else ():
        try:
            path = inspect.getsourcefile(cls)
        except TypeError:  # a built-in class
            continue
        text = _class_sources(path).get(cls.__qualname__) if path else None
        if text:
            texts.append(text)
    return "\n".join(texts)


def problem(hook: Hook) -> Optional[str]:
    """Why `hook` cannot be installed on the running Keras, or None."""
    for place in hook.places:
        found = _at(place)
        if found is None:
            continue
        source = _source_of(found[0]) if hook.reads else ""
        lacking = [a for a in hook.reads
                   if source and f".{a}" not in source and not hasattr(found[0], a)]
        if lacking:
            return f"{place} is there but no longer has {', '.join(lacking)}"
        return None
    if hook.instead and not [h for h in hook.instead if problem(h) is not None]:
        return None  # the fallback serves
    return f"it has no {' or '.join(hook.places)}"


def locate(hook: Hook) -> Optional[Found]:
    """Where `hook` lives in the running Keras; None where it is missing but
    its `instead` hooks serve.

    Raises:
      KerasHookMissingError: it is needed and missing.
    """
    why = problem(hook)
    if why is not None:
        raise KerasHookMissingError(_message([(hook, why)]))
    for place in hook.places:
        found = _at(place)
        if found is not None:
            return Found(hook, found[0], found[1], place)
    return None  # problem() found the fallback whole


def defined_methods(hook: Hook, names: Tuple[str, ...]) -> List[Found]:
    """`hook`'s owner's methods among `names` that the owner itself defines
    (not inherited), e.g. the callback events a Keras callback implements."""
    found = locate(hook)
    assert found is not None, hook.name
    owner = found.owner
    return [Found(hook, owner, name, f"{found.place.split(':')[0]}:{owner.__name__}.{name}")
            for name in names if name in vars(owner)]


def in_use(hooks: Tuple[Hook, ...] = HOOKS) -> List[Hook]:
    """The hooks tf_smb installs on the running Keras: each found, or where
    missing, the hooks that serve instead."""
    out: List[Hook] = []
    for hook in hooks:
        out.extend([hook] if locate(hook) is not None else in_use(hook.instead))
    return out


def missing(hooks: Tuple[Hook, ...] = HOOKS,
            privates: Tuple[Private, ...] = PRIVATES) -> List[Tuple[Any, str]]:
    """The hooks and private attributes the running Keras lacks, each with the
    reason."""
    out: List[Tuple[Any, str]] = []
    for hook in hooks:
        why = problem(hook)
        if why is not None:
            out.append((hook, why))
    for private in privates:
        why = problem_of_private(private)
        if why is not None:
            out.append((private, why))
    return out


_CHECKED: Dict[str, bool] = {}


def check() -> None:
    """Raises KerasHookMissingError naming every hook the running Keras lacks
    (no Keras at all: nothing to hook, fine for custom loops). Checked once per
    Keras version and process when it passes."""
    version = keras_version()
    if version == "none" or _CHECKED.get(version):
        return
    lacking = missing()
    if lacking:
        raise KerasHookMissingError(_message(lacking))
    _CHECKED[version] = True


def _message(lacking: List[Tuple[Any, str]]) -> str:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    lines = [f"tf_smb does not support Keras {keras_version()} (with TensorFlow "
             f"{tf.__version__}): it lacks what tf_smb must hook for a drop-in strategy, "
             "and training without it would not equal one process:"]
    lines += [f"  - {hook.name}: {why}; it provides: {hook.provides}"
              for hook, why in lacking]
    lines.append(f"Tested: {TESTED}. Install one of those (e.g. "
                 "`pip install 'keras==3.15.*'`), or report this Keras version to tf_smb.")
    return "\n".join(lines)
