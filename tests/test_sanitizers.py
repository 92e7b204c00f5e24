"""The core's C++ tests built with ThreadSanitizer and AddressSanitizer (+UB).

cc/tests/collectives_test.cc runs the collectives with ranks as threads of one
process (ThreadGroup), so the sanitizers see every rank; cc/tests/core_test.cc
checks kernels, the box and its segments. Any sanitizer report fails the test.
"""
import glob
import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE_SOURCES = sorted(glob.glob(os.path.join(REPO, "cc", "smb", "**", "*.cc"), recursive=True))
SANITIZERS = {
    "thread": (["-fsanitize=thread", "-Wno-tsan"], {"TSAN_OPTIONS": "halt_on_error=1"}),
    "address": (["-fsanitize=address,undefined", "-fno-omit-frame-pointer",
                 "-fno-sanitize-recover=undefined"],
                {"ASAN_OPTIONS": "detect_leaks=1", "UBSAN_OPTIONS": "print_stacktrace=1"}),
}
REPORTS = ("WARNING: ThreadSanitizer", "ERROR: AddressSanitizer", "ERROR: LeakSanitizer",
           "runtime error:")


def _build_and_run(test, sanitizer, out_dir):
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.fail("g++ is needed to build the C++ tests (tools/install.sh installs it)")
    flags, env = SANITIZERS[sanitizer]
    binary = os.path.join(out_dir, f"{test}_{sanitizer}")
    build = subprocess.run(
        [cxx, "-std=c++17", "-O1", "-g", *flags, "-I", REPO,
         os.path.join(REPO, "cc", "tests", f"{test}.cc"), *CORE_SOURCES,
         "-lpthread", "-lrt", "-o", binary],
        capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, f"building {test} with {sanitizer}:\n{build.stderr[-5000:]}"
    run = subprocess.run([binary], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env})
    output = run.stdout + run.stderr
    assert run.returncode == 0 and not any(r in output for r in REPORTS), (
        f"{test} under {sanitizer} sanitizer (exit {run.returncode}):\n{output[-8000:]}")
    assert "all checks passed" in run.stdout, output[-3000:]


@pytest.mark.parametrize("sanitizer", sorted(SANITIZERS))
def test_collectives_with_ranks_as_threads(sanitizer, tmp_path):
    _build_and_run("collectives_test", sanitizer, str(tmp_path))


def test_core_checks_under_address_sanitizer(tmp_path):
    _build_and_run("core_test", "address", str(tmp_path))
