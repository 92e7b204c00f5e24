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
LOSS_REDUCE = Hook(
    "loss reduction", ("keras.src.losses.loss:reduce_values",),
    "a replica's empty part of a batch has loss 0, not NaN (Keras 3.3 divides by 0 rows)")
LOSS_DISTRIBUTION_SCALE = Hook(
    "loss scaling over replicas", ("keras.src.losses.loss:scale_loss_for_distribution",),
    "gradients of a global batch that splits unevenly over replicas weighted by each "
    "replica's rows, as one process on the global batch (Keras 3.4+; Keras 3.3 does "
    "not divide the loss: its train step is hooked instead)",
    instead=(TRAIN_STEP,))
BUILD_MARKER = Hook(
    "build marker",
    (f"{_TRAINER}:TensorFlowTrainer._maybe_symbolic_build",  # Keras 3.4-3.15
     f"{_TRAINER}:Trainer._maybe_symbolic_build"),  # keras-nightly 3.16
    "models, metrics and optimizers built from the first batch before training "
    "starts, taking that batch's structure without combining it over replicas",
    instead=(SYMBOLIC_BUILD, MAKE_TRAIN_FUNCTION, MAKE_TEST_FUNCTION,
             METRIC_ADD_VARIABLE, VARIABLE_INITIALIZE, TRAIN_STEP, LOSS_REDUCE))
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


def missing(hooks: Tuple[Hook, ...] = HOOKS) -> List[Tuple[Hook, str]]:
    """The hooks the running Keras cannot take, each with the reason."""
    out = []
    for hook in hooks:
        why = problem(hook)
        if why is not None:
            out.append((hook, why))
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


def _message(lacking: List[Tuple[Hook, str]]) -> str:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    lines = [f"tf_smb does not support Keras {keras_version()} (with TensorFlow "
             f"{tf.__version__}): it lacks what tf_smb must hook for a drop-in strategy, "
             "and training without it would not equal one process:"]
    lines += [f"  - {hook.name}: {why}; it provides: {hook.provides}"
              for hook, why in lacking]
    lines.append(f"Tested: {TESTED}. Install one of those (e.g. "
                 "`pip install 'keras==3.15.*'`), or report this Keras version to tf_smb.")
    return "\n".join(lines)
