"""Builds and runs cc/tests/*.cc under ThreadSanitizer or AddressSanitizer (+UB).

The core's sources are compiled once per sanitizer per pytest session, one
object file each, on every CPU at once; each test then only compiles its own
test file and links (the core under a sanitizer took ~40 s per test before).
"""
import atexit
import concurrent.futures
import os
import shutil
import subprocess
import tempfile
import threading
from typing import Dict, List, Sequence

import pytest

from harness import REPO

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

_objects: Dict[str, List[str]] = {}
_lock = threading.Lock()
_build_dir = tempfile.mkdtemp(prefix="tf_smb_sanitized_")
atexit.register(shutil.rmtree, _build_dir, ignore_errors=True)


def _compiler() -> str:
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.fail("g++ is needed to build the C++ tests (tools/install.sh installs it)")
    return cxx


def _compile(cxx: str, flags: Sequence[str], source: str, obj: str) -> None:
    build = subprocess.run([cxx, "-std=c++17", "-O1", "-g", *flags, "-I", REPO, "-c",
                            source, "-o", obj], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, f"compiling {source}:\n{build.stderr[-5000:]}"


def core_objects(sanitizer: str) -> List[str]:
    """The core's object files built with `sanitizer` (built on first use)."""
    with _lock:
        if sanitizer not in _objects:
            cxx = _compiler()
            flags = SANITIZERS[sanitizer][0]
            out = os.path.join(_build_dir, sanitizer)
            os.makedirs(out, exist_ok=True)
            objects = [os.path.join(out, os.path.relpath(s, REPO).replace(os.sep, "_") + ".o")
                       for s in CORE_SOURCES]
            with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
                for job in [pool.submit(_compile, cxx, flags, s, o)
                            for s, o in zip(CORE_SOURCES, objects)]:
                    job.result()
            _objects[sanitizer] = objects
        return _objects[sanitizer]


def build_and_run(test: str, sanitizer: str, out_dir: str,
                  args: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """Builds cc/tests/`test`.cc with the core under `sanitizer`, runs it with
    `args` and fails on a non-zero exit, any sanitizer report, or a run that
    does not end with "all checks passed"."""
    flags, env = SANITIZERS[sanitizer]
    objects = core_objects(sanitizer)
    binary = os.path.join(out_dir, f"{test}_{sanitizer}")
    build = subprocess.run(
        [_compiler(), "-std=c++17", "-O1", "-g", *flags, "-I", REPO,
         os.path.join(REPO, "cc", "tests", f"{test}.cc"), *objects,
         "-lpthread", "-lrt", "-o", binary],
        capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, f"building {test} with {sanitizer}:\n{build.stderr[-5000:]}"
    run = subprocess.run([binary, *args], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env})
    output = run.stdout + run.stderr
    assert run.returncode == 0 and not any(r in output for r in REPORTS), (
        f"{test} under {sanitizer} sanitizer (exit {run.returncode}):\n{output[-8000:]}")
    assert "all checks passed" in run.stdout, output[-3000:]
    return run
