"""The layers point one way: core and engines never reach the Keras glue.

Read from the source (every import statement, at module level or inside a
function), so an import only some code path makes counts too. The top layer,
which may import anything, is the package's entry (`tf_smb/__init__.py`, whose
names load lazily), the strategies users create (`strategy.py`,
`horovod_strategy.py`) and the Keras glue itself (`keras_support/`).

The C++ core too (read from its #include lines): the link between nodes
(`cc/smb/link/`) knows transports only through `transport/transport.h`, no
transport knows what is built on it, `mpi.h` is MPI's transport's alone, only
the communicator picks a transport, and the core knows nothing of TensorFlow.
"""
import ast
import os
import re
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


# ---- the C++ core -------------------------------------------------------------

CORE_DIR = os.path.join(os.path.dirname(PACKAGE_DIR), "cc", "smb")
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)


def _includes(path: str) -> Set[str]:
    with open(path) as f:
        return set(INCLUDE.findall(f.read()))


def _core_files() -> Dict[str, Set[str]]:
    """cc/smb's files, as "cc/smb/..." -> what each includes."""
    found = {}
    for folder, _, files in os.walk(CORE_DIR):
        for name in files:
            if name.endswith((".h", ".cc")):
                path = os.path.join(folder, name)
                found[os.path.relpath(path, os.path.dirname(os.path.dirname(CORE_DIR)))] = \
                    _includes(path)
    return found


def _breaches(files: Dict[str, Set[str]]) -> list:
    """Each include that crosses the core's layers the wrong way."""
    wrong = []
    for name, included in sorted(files.items()):
        folder = os.path.dirname(name)
        for inc in sorted(included):
            why = None
            if folder == "cc/smb/link" and inc.startswith("cc/smb/transport/") and \
                    inc != "cc/smb/transport/transport.h":
                why = "the link knows transports through transport.h only"
            elif folder == "cc/smb/transport" and inc.startswith("cc/smb/") and \
                    os.path.dirname(inc) not in ("cc/smb", "cc/smb/transport"):
                why = "a transport knows nothing built on it"
            elif folder == "cc/smb/transport" and inc in ("cc/smb/group.h", "cc/smb/communicator.h",
                                                          "cc/smb/node_link.h"):
                why = "a transport knows nothing built on it"
            elif inc == "mpi.h" and name != "cc/smb/transport/mpi_transport.cc":
                why = "MPI is the MPI transport's alone"
            elif inc == "cc/smb/transport/mpi_transport.h" and name not in (
                    "cc/smb/communicator.cc", "cc/smb/transport/mpi_transport.cc"):
                why = "only the communicator picks a transport"
            elif inc.startswith(("tensorflow/", "cc/ops/", "cc/kernels/", "cc/python/")):
                why = "the core knows nothing of TensorFlow or Python"
            if why:
                wrong.append(f"{name} includes {inc}: {why}")
    return wrong


def test_the_cpp_core_has_the_layers_this_test_knows():
    files = _core_files()
    assert {"cc/smb/link/transport_link.cc", "cc/smb/transport/transport.h",
            "cc/smb/transport/mpi_transport.cc", "cc/smb/transport/thread_transport.cc",
            "cc/smb/communicator.cc"} <= set(files)
    assert "cc/smb/transport/transport.h" in files["cc/smb/link/transport_link.h"]


def test_the_cpp_core_includes_point_one_way():
    assert not _breaches(_core_files())


def test_the_include_check_can_fail():
    files = _core_files()
    files["cc/smb/link/transport_link.cc"] = files["cc/smb/link/transport_link.cc"] | {
        "cc/smb/transport/mpi_transport.h", "mpi.h"}
    files["cc/smb/transport/mpi_transport.cc"] = {"cc/smb/link/decider.h"}
    assert len(_breaches(files)) == 3, _breaches(files)
