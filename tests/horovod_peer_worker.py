"""One rank of Horovod's own tests run against tf_smb.horovod.

    python tests/horovod_peer_worker.py [--horovod] [--only=NAME,...] PEER_DIR TEST_FILE OUT_DIR
                                        [pytest args...]

Runs PEER_DIR/test/parallel/TEST_FILE (Horovod 0.28.1's tests, unmodified) with
pytest, writing OUT_DIR/rank<R>.xml (JUnit). Adaptations, made at run time
because the files may not be edited:
  * `horovod.tensorflow` (and its `keras`, `util`, `mpi_ops` modules) is
    tf_smb.horovod: the one-line swap a Horovod user makes;
  * `horovod` itself is an empty package; `horovod.runner.util.threads` and
    `horovod.common.util` hold the one helper each that the tests import
    (`in_thread`, `is_version_greater_equal_than`), so nothing of Horovod is
    imported; `horovod.keras` is tf_smb.horovod.keras too;
  * `mock` is unittest.mock and `cloudpickle` falls back to pickle when the
    packages are absent (common.py imports them; the tests run here use neither).
With --horovod the tests run on the installed Horovod itself (only the last
adaptation is made): the same tests, side by side. --only runs the tests of
exactly these names (pytest's -k matches parts of names).
"""
import os
import sys
import threading
import types
import unittest.mock


def _module(name, **attrs):
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def _in_thread(target, args=(), name=None, daemon=True, silent=False):
    thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)
    thread.start()
    return thread


def _version_at_least(ver, min_ver):
    from packaging import version
    return version.parse(ver) >= version.parse(min_ver)


def alias_horovod():
    """Maps Horovod's TensorFlow modules to tf_smb.horovod."""
    import tf_smb.horovod as hvd
    import tf_smb.horovod.keras as hvd_keras
    package = _module("horovod", __path__=[])
    package.tensorflow = hvd
    sys.modules["horovod.tensorflow"] = hvd
    sys.modules["horovod.tensorflow.keras"] = hvd_keras
    sys.modules["horovod.tensorflow.util"] = hvd.util
    sys.modules["horovod.tensorflow.mpi_ops"] = hvd
    sys.modules["horovod.keras"] = hvd_keras  # Horovod's standalone Keras API: the same surface
    _module("horovod.common", __path__=[])
    _module("horovod.common.util", is_version_greater_equal_than=_version_at_least)
    _module("horovod.runner", __path__=[])
    _module("horovod.runner.util", __path__=[])
    _module("horovod.runner.util.threads", in_thread=_in_thread)


def shim_test_helpers():
    """`mock` and `cloudpickle`, which Horovod's test helpers import."""
    try:
        import mock  # noqa: F401
    except ImportError:
        # The `mock` backport is unittest.mock; parameterized reads its version.
        _module("mock", **vars(unittest.mock)).version_info = (5, 0, 0)
    try:
        import cloudpickle  # noqa: F401
    except ImportError:
        import pickle
        sys.modules["cloudpickle"] = pickle


class OnlyTheseTests:
    """A pytest plugin that keeps the tests of exactly these names."""

    def __init__(self, names):
        self.names = set(names)

    def pytest_collection_modifyitems(self, config, items):
        kept = [item for item in items if item.originalname in self.names]
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept


def main(argv):
    real_horovod = argv[1:2] == ["--horovod"]
    if real_horovod:
        argv = argv[:1] + argv[2:]
    plugins = []
    if argv[1].startswith("--only="):
        plugins.append(OnlyTheseTests(argv[1][len("--only="):].split(",")))
        argv = argv[:1] + argv[2:]
    peer_dir, test_file, out_dir = argv[1:4]
    rank = os.environ.get("TF_SMB_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or "0"
    shim_test_helpers()
    if not real_horovod:
        alias_horovod()
    sys.path[:0] = [os.path.join(peer_dir, "test", "parallel"),
                    os.path.join(peer_dir, "test", "utils")]
    import pytest
    code = pytest.main([os.path.join(peer_dir, "test", "parallel", test_file),
                        "-p", "no:cacheprovider", "-q", "-rN", "--no-header",
                        f"--junitxml={os.path.join(out_dir, f'rank{rank}.xml')}",
                        *argv[4:]], plugins=plugins)
    # Failed tests are the caller's to count; only a run that could not start fails.
    return 0 if code in (0, 1) else int(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
