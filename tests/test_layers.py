"""The layers point one way: core and engines never reach the Keras glue.

Read from the source (every import statement, at module level or inside a
function), so an import only some code path makes counts too. The top layer,
which may import anything, is the package's entry (`tf_smb/__init__.py`, whose
names load lazily), the strategies users create (`strategy.py`,
`horovod_strategy.py`) and the Keras glue itself (`keras_support/`).
"""
import ast
import os
from typing import Dict, Iterator, Set

import pytest

PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "tf_smb")
GLUE = "tf_smb.keras_support"
TOP = {"tf_smb", "tf_smb.strategy", "tf_smb.horovod_strategy"}


def _modules() -> Dict[str, str]:
    """Every module of the package: dotted name -> file."""
    found = {}
    for folder, _, files in os.walk(PACKAGE_DIR):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            parts = os.path.relpath(path, os.path.dirname(PACKAGE_DIR))[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str:
    """The package module `name` (or the longest module prefix of it) is in."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _imports(module: str) -> Iterator[str]:
    """The package modules `module` imports, anywhere in its code."""
    with open(MODULES[module]) as f:
        tree = ast.parse(f.read(), MODULES[module])
    package = module if MODULES[module].endswith("__init__.py") else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                parent = parent[:len(parent) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            # `from tf_smb import ops` imports the module tf_smb.ops.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                     for a in node.names]
        else:
            continue
        for name in names:
            if name == "tf_smb" or name.startswith("tf_smb."):
                yield _resolve(name)


def _reach(module: str) -> Set[str]:
    seen: Set[str] = set()
    todo = [module]
    while todo:
        for imported in _imports(todo.pop()):
            if imported not in seen and imported != "tf_smb":  # the entry loads lazily
                seen.add(imported)
                todo.append(imported)
    return seen


def _is_glue(module: str) -> bool:
    return module == GLUE or module.startswith(GLUE + ".")


LOWER = sorted(m for m in MODULES if m not in TOP and not _is_glue(m))


def test_the_package_has_the_layers_this_test_knows():
    assert {"tf_smb.data_parallel", "tf_smb.async_mode", "tf_smb.local_replicas",
            "tf_smb.phase", "tf_smb.ops"} <= set(LOWER)
    assert any(_is_glue(m) for m in MODULES) and TOP <= set(MODULES)


@pytest.mark.parametrize("module", LOWER)
def test_below_the_top_nothing_reaches_the_keras_glue(module):
    reached = sorted(m for m in _reach(module) if _is_glue(m) or m in TOP - {"tf_smb"})
    assert not reached, f"{module} imports {reached} (at some depth): the top layer's"


def test_phase_flags_depend_on_nothing():
    assert not _reach("tf_smb.phase")


def test_the_check_sees_an_import_inside_a_function(tmp_path, monkeypatch):
    # The check itself can fail: a nested import of the glue is found.
    path = tmp_path / "engine.py"
    path.write_text("def f():\n    from tf_smb import keras_support\n    return keras_support\n")
    monkeypatch.setitem(MODULES, "tf_smb.fake_engine", str(path))
    assert GLUE in _reach("tf_smb.fake_engine")
