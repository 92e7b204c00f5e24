"""One rank of Horovod's own tests run against tf_smb.horovod.

    python tests/horovod_peer_worker.py PEER_DIR TEST_FILE OUT_DIR [pytest args...]

Runs PEER_DIR/test/parallel/TEST_FILE (Horovod 0.28.1's tests, unmodified) with
pytest, writing OUT_DIR/rank<R>.xml (JUnit). Adaptations, made at run time
because the files may not be edited:
  * `horovod.tensorflow` (and its `keras`, `util`, `mpi_ops` modules) is
    tf_smb.horovod: the one-line swap a Horovod user makes;
  * `horovod` itself is an empty package and `horovod.runner.util.threads`
    holds the one helper (`in_thread`) that test/utils/common.py imports, so
    nothing of Horovod is imported;
  * `mock` is unittest.mock and `cloudpickle` falls back to pickle when the
    packages are absent (common.py imports them; the tests run here use neither).
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
    _module("horovod.runner", __path__=[])
    _module("horovod.runner.util", __path__=[])
    _module("horovod.runner.util.threads", in_thread=_in_thread)
    try:
        import mock  # noqa: F401
    except ImportError:
        sys.modules["mock"] = unittest.mock
    try:
        import cloudpickle  # noqa: F401
    except ImportError:
        import pickle
        sys.modules["cloudpickle"] = pickle


def main(argv):
    peer_dir, test_file, out_dir = argv[1:4]
    rank = os.environ.get("TF_SMB_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or "0"
    alias_horovod()
    sys.path[:0] = [os.path.join(peer_dir, "test", "parallel"),
                    os.path.join(peer_dir, "test", "utils")]
    import pytest
    code = pytest.main([os.path.join(peer_dir, "test", "parallel", test_file),
                        "-p", "no:cacheprovider", "-q", "-rN", "--no-header",
                        f"--junitxml={os.path.join(out_dir, f'rank{rank}.xml')}",
                        *argv[4:]])
    # Failed tests are the caller's to count; only a run that could not start fails.
    return 0 if code in (0, 1) else int(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
