"""Builds and runs cc/tests/*.cc under ThreadSanitizer or AddressSanitizer (+UB).

Each sanitized test binary is kept in ``$TF_SMB_CACHE/sanitized`` (default
``~/.cache/tf_smb``) under a key that hashes the compiler's version, the flags and
every C++ source and header it is built from, so a run whose C++ is unchanged only
runs it (building the core under a sanitizer takes a minute on two cores). When it
is built, the core's objects come from tf_smb's object cache
(`op_library.compile_objects`: only the sources changed since are compiled, on every
CPU at once), shared by the pytest-xdist workers that run test_sanitizers.py and
test_timeline.py (a file lock makes one wait for the other's build); each test then
compiles its own file and links.
"""
import functools
import hashlib
import os
import shutil
import subprocess
import threading
from typing import Dict, List, Sequence

import pytest

from harness import REPO
from tf_smb import op_library  # where tf_smb keeps what it compiles (no TensorFlow)

CORE_SOURCES = sorted(
    os.path.join(root, f) for root, _, files in os.walk(os.path.join(REPO, "cc", "smb"))
    for f in files if f.endswith(".cc"))
SANITIZERS = {
    "thread": (["-fsanitize=thread", "-Wno-tsan"], {"TSAN_OPTIONS": "halt_on_error=1"}),
    "address": (["-fsanitize=address,undefined", "-fno-omit-frame-pointer",
                 "-fno-sanitize-recover=undefined"],
                {"ASAN_OPTIONS": "detect_leaks=1", "UBSAN_OPTIONS": "print_stacktrace=1"}),
}
REPORTS = ("WARNING: ThreadSanitizer", "ERROR: AddressSanitizer", "ERROR: LeakSanitizer",
           "runtime error:")
COMMON_FLAGS = ["-std=c++17", "-O1", "-g"]

_objects: Dict[str, List[str]] = {}
_lock = threading.Lock()


def _compiler() -> List[str]:
    """op_library's compiler (the one that builds the core's objects)."""
    cxx = op_library.compiler()
    if shutil.which(cxx[0]) is None:
        pytest.fail(f"{cxx[0]} is needed to build the C++ tests (tools/install.sh installs g++)")
    return cxx


def _cache() -> str:
    cache = os.path.join(op_library.cache_root(), "sanitized")
    os.makedirs(cache, exist_ok=True)
    return cache


@functools.lru_cache(maxsize=None)
def _compiler_version() -> str:
    """What the compiler says of its version (asked once per test process)."""
    return subprocess.run([*_compiler(), "--version"], capture_output=True, text=True,
                          timeout=60).stdout


def _key(name: str, sanitizer: str, folders: Sequence[str]) -> str:
    """Hashes what `name` is built from: compiler version, flags, the C++ files
    under cc/`folders`."""
    digest = hashlib.sha256()
    digest.update("\0".join([_compiler_version(), name, *COMMON_FLAGS,
                              *SANITIZERS[sanitizer][0]]).encode())
    for folder in folders:
        for root, dirs, files in os.walk(os.path.join(REPO, "cc", folder)):
            dirs.sort()
            for file in sorted(files):
                path = os.path.join(root, file)
                digest.update(os.path.relpath(path, REPO).encode() + b"\0")
                with open(path, "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()[:20]


def core_objects(sanitizer: str) -> List[str]:
    """The core's object files built with `sanitizer`, through op_library's object
    cache: only the sources whose object it lacks are compiled, on every CPU, by
    one process at a time (the other pytest-xdist worker waits on the lock)."""
    with _lock:
        if sanitizer not in _objects:
            flags = [*COMMON_FLAGS, *SANITIZERS[sanitizer][0]]
            with op_library.locked(os.path.join(_cache(), f"core_{sanitizer}.lock")):
                _objects[sanitizer] = op_library.compile_objects(
                    REPO, [(os.path.relpath(s, REPO), flags) for s in CORE_SOURCES],
                    _cache())  # (where they go if the object cache is not writable)
        return _objects[sanitizer]


def sanitized_binary(test: str, sanitizer: str) -> str:
    """cc/tests/`test`.cc linked with the core under `sanitizer`: from the cache
    when its C++ is unchanged, else built and put there (atomically)."""
    binary = os.path.join(_cache(),
                          f"{test}_{sanitizer}-{_key(test, sanitizer, ['smb', 'tests'])}")
    if os.path.isfile(binary):
        return binary
    partial = f"{binary}.{os.getpid()}.{threading.get_ident()}.partial"
    build = subprocess.run(
        [*_compiler(), *COMMON_FLAGS, *SANITIZERS[sanitizer][0], "-I", REPO,
         os.path.join(REPO, "cc", "tests", f"{test}.cc"), *core_objects(sanitizer),
         "-lpthread", "-lrt", "-o", partial],
        capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, f"building {test} with {sanitizer}:\n{build.stderr[-5000:]}"
    os.replace(partial, binary)
    return binary


def build_and_run(test: str, sanitizer: str, args: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """Runs cc/tests/`test`.cc built with the core under `sanitizer` (see
    `sanitized_binary`) with `args`; fails on a non-zero exit, any sanitizer report,
    or a run that does not end with "all checks passed"."""
    binary = sanitized_binary(test, sanitizer)
    run = subprocess.run([binary, *args], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **SANITIZERS[sanitizer][1]})
    output = run.stdout + run.stderr
    assert run.returncode == 0 and not any(r in output for r in REPORTS), (
        f"{test} under {sanitizer} sanitizer (exit {run.returncode}):\n{output[-8000:]}")
    assert "all checks passed" in run.stdout, output[-3000:]
    return run
