"""The contract with Keras: every attribute tf_smb hooks (the registry in
tf_smb/keras_registry.py) is found on the running Keras, is hooked where
the registry found it, and a Keras without one stops a strategy with an error that
names the Keras version, the hook and what it provides. Runs on every tested
TensorFlow + Keras pair (`bash tools/test.sh --keras PAIR`)."""
import ast
import glob
import os
import re

import pytest

from harness import REPO, run_python

pytest.importorskip("keras")

from tf_smb import keras_registry as registry  # noqa: E402


def test_every_registered_hook_is_found_on_this_keras():
    lacking = registry.missing()
    assert not lacking, "\n".join(f"{h.name}: {why}" for h, why in lacking)
    for hook in registry.in_use():
        assert registry.locate(hook).place in hook.places, hook.name


def test_strategy_hooks_every_registered_place():
    # A 2-worker job's hooks, installed as a strategy installs them (no job runs).
    out = run_python(
        "from tf_smb import keras_support\n"
        "from tf_smb import keras_registry as registry\n"
        "from tf_smb.env import JobInfo\n"
        "keras_support.install_strategy_hooks(JobInfo(rank=0, size=2, job_id='hooks',\n"
        "    box_created=False, launcher='test'))\n"
        "keras_support.install_fit_hooks()\n"
        "for hook in registry.in_use():\n"
        "    found = registry.locate(hook)\n"
        "    if hook.called_only:\n"
        "        continue\n"
        "    wrapped = getattr(found.original(), '__wrapped__', None) is not None\n"
        "    print(hook.name, '|', found.place, '|', wrapped)\n")
    rows = [line.split(" | ") for line in out.strip().splitlines()]
    assert rows, out
    unhooked = [r for r in rows if r[2] != "True"]
    assert not unhooked, f"registered but not hooked: {unhooked}"


def test_a_keras_without_a_hook_target_stops_the_strategy_naming_it():
    # Remove what gradient clipping after the sum hooks, as a Keras that moved it would.
    out = run_python(
        "import keras\n"
        "from keras.src.backend.tensorflow.optimizer import TFOptimizer\n"
        "for cls in TFOptimizer.__mro__:\n"
        "    if '_clip_gradients' in vars(cls):\n"
        "        delattr(cls, '_clip_gradients')\n"
        "import tf_smb\n"
        "try:\n"
        "    tf_smb.SMBStrategy()\n"
        "    print('no error')\n"
        "except tf_smb.keras_support.KerasHookMissingError as e:\n"
        "    print('KerasHookMissingError', keras.__version__)\n"
        "    print(e)\n")
    lines = out.splitlines()
    assert lines[0].startswith("KerasHookMissingError"), out
    version = lines[0].split()[1]
    assert f"does not support Keras {version}" in out, out
    assert "optimizer clipping" in out and "TFOptimizer._clip_gradients" in out, out
    assert "gradient clipping of the gradient summed over workers" in out, out


class _AdapterThatRenamedShuffle:
    """An ArrayDataAdapter of a Keras that renamed what the shuffle hook reads."""

    def __init__(self):
        self.shuffle_mode = True

    def get_tf_dataset(self):
        return None


def test_a_moved_instance_attribute_is_named_too():
    from keras.src.trainers.data_adapters import array_data_adapter
    original = array_data_adapter.ArrayDataAdapter
    array_data_adapter.ArrayDataAdapter = _AdapterThatRenamedShuffle
    try:
        why = registry.problem(registry.ARRAY_SHUFFLE)
    finally:
        array_data_adapter.ArrayDataAdapter = original
    assert why is not None and "_shuffle" in why, why


def test_keras_glue_patches_keras_only_through_the_registry():
    # No assignment to a Keras class's or module's attribute, and no setattr,
    # outside registry.Found.replace: every hook is in the registry.
    keras_names = {"keras", "TFOptimizer", "LossScaleOptimizer", "TensorFlowTrainer",
                   "Trainer", "TFEpochIterator", "ArrayDataAdapter", "saving_api",
                   "BackupAndRestore", "TensorBoard", "tensorboard_cls", "cls"}
    offenders = []
    for path in glob.glob(os.path.join(REPO, "tf_smb", "keras_support", "*.py")):
        if path.endswith("registry.py"):
            continue
        tree = ast.parse(open(path).read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr":
                offenders.append(f"{path}:{node.lineno} setattr")
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                base = target
                while isinstance(base, ast.Attribute):
                    base = base.value
                if (isinstance(target, ast.Attribute) and isinstance(base, ast.Name)
                        and base.id in keras_names):
                    offenders.append(f"{path}:{node.lineno} {ast.unparse(target)}")
    assert not offenders, offenders


# Names tf_smb's (or TensorFlow's) own objects use that Keras happens to define too.
_NOT_KERAS = {
    "_config": "AsyncEngine's options (async_mode.py)",
    "_cond": "the iterator releaser's condition (iterator_release.py)",
    "_lock": "the supervisor's lock (supervisor.py)",
    "_values": "TensorFlow's DistributedValues (data_parallel.py)",
}


def _keras_private_names():
    """Every private attribute or method name Keras' own source defines."""
    import keras  # pylint: disable=import-outside-toplevel
    source = os.path.join(os.path.dirname(keras.__file__), "src")
    defined = re.compile(r"(?:self|cls)\.(_[A-Za-z]\w*)\s*(?::[^=\n]+)?=(?!=)|def (_[A-Za-z]\w*)\(")
    names = set()
    for path in glob.glob(os.path.join(source, "**", "*.py"), recursive=True):
        with open(path, encoding="utf-8") as f:
            for match in defined.finditer(f.read()):
                names.add(match.group(1) or match.group(2))
    return names


def test_keras_private_names_are_reached_only_through_the_registry():
    # A Keras private attribute read or written anywhere in tf_smb (attribute access,
    # getattr/setattr by name, tuple assignments alike) must go through
    # registry.read/write, where it is listed with its feature detection; a method
    # tf_smb overrides (a def, and its super() call) must be listed there too.
    registered = {p.name for p in registry.PRIVATES}
    keras_names = _keras_private_names() - set(_NOT_KERAS)
    assert "_distribute_strategy" in keras_names and "_num_batches" in keras_names
    offenders = []
    for path in glob.glob(os.path.join(REPO, "tf_smb", "**", "*.py"), recursive=True):
        if path.endswith(os.path.join("tf_smb", "keras_registry.py")):
            continue
        where = os.path.relpath(path, REPO)
        tree = ast.parse(open(path).read(), path)
        methods = {id(m) for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
                   for m in c.body if isinstance(m, ast.FunctionDef)}
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and id(node) in methods:
                if node.name in keras_names and node.name not in registered:
                    offenders.append(f"{where}:{node.lineno} overrides {node.name}")
            elif isinstance(node, ast.Attribute) and node.attr in keras_names:
                on_super = (isinstance(node.value, ast.Call)
                            and getattr(node.value.func, "id", "") == "super")
                if not (on_super and node.attr in registered):
                    offenders.append(f"{where}:{node.lineno} {ast.unparse(node)}")
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and node.value in keras_names):
                offenders.append(f"{where}:{node.lineno} {node.value!r}")
    assert not offenders, ("Keras private names outside tf_smb/keras_registry.py "
                           f"(add a registry.Private and use registry.read/write): {offenders}")


def test_every_registered_private_is_found_and_a_missing_one_is_named():
    for private in registry.PRIVATES:
        assert registry.problem_of_private(private) is None, private.name
    gone = registry.Private("_no_such_attribute", ("keras.callbacks:BackupAndRestore",), "x")
    why = registry.problem_of_private(gone)
    assert why is not None and "_no_such_attribute" in why, why
    lacking = registry.missing(hooks=(), privates=(gone,))
    assert [p for p, _ in lacking] == [gone]
