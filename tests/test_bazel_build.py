"""BUILD/WORKSPACE build the core test and the op library with Debian's
offline Bazel, and the Bazel-built op library loads into TensorFlow."""
import os
import shutil
import subprocess
import sys

import pytest

from harness import REPO, base_env, python


@pytest.fixture(scope="module")
def bazel_build():
    assert shutil.which("bazel"), "tools/install.sh --test installs bazel-bootstrap"
    env = dict(os.environ, PYTHON_BIN_PATH=sys.executable)
    try:
        p = subprocess.run(
            ["bash", "tools/bazel.sh", "build", "//:smb_core_test", "//:_smb_ops.so"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
        assert p.returncode == 0, p.stderr[-4000:]
        yield os.path.join(REPO, "bazel-bin")
    finally:
        subprocess.run(["bazel", "shutdown"], cwd=REPO, capture_output=True, timeout=120)


def test_core_test_binary_passes(bazel_build):
    p = subprocess.run([os.path.join(bazel_build, "smb_core_test")], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "all checks passed" in p.stdout


def test_bazel_op_library_loads(bazel_build):
    code = ("import tensorflow as tf; lib = tf.load_op_library(%r); "
            "lib.smb_init(job_id='bazel', rank=0, world=1, timeout_seconds=60.0, create=False, "
            "staging_bytes=1 << 20, heap_bytes=0, across_nodes=False); "
            "print(lib.smb_all_reduce([tf.constant([1.0, 2.0])])[0].numpy().tolist())"
            % os.path.join(bazel_build, "_smb_ops.so"))
    p = subprocess.run([*python(), "-c", code], capture_output=True, text=True,
                       timeout=300, env=base_env())
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().endswith("[1.0, 2.0]")
