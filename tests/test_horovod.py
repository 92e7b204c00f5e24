"""HorovodStrategy, the reference: same equivalence as SMB sync under
horovodrun and mpirun; without Horovod, a clear hint and SMB unaffected."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from harness import (REPO, WORKERS, base_env, max_diff, python, require_horovod, run_mpirun,
                     run_python, run_single)

KERAS = os.path.join(WORKERS, "keras_worker.py")
B = 8




def _env():
    env = base_env({"TEST_STRATEGY": "horovod"})
    # (The tests' own variables stay: the preload fork server's socket.)
    for key in [k for k in env if k.startswith("TF_SMB_") and not k.startswith("TF_SMB_TEST_")]:
        del env[key]
    return env




@pytest.fixture(scope="module")
def single():
    return run_single([KERAS, "fit", "--batch", str(2 * B)], timeout=300).check().json()


def _check_equivalent(results, single):
    for r in results:
        assert r["size"] == 2
        assert max_diff(r["weights"], single["weights"]) < 1e-5, f"rank {r['rank']}"
        for metric in ("loss", "accuracy"):
            assert r["eval"][metric] == pytest.approx(single["eval"][metric], abs=1e-5)
        np.testing.assert_allclose(r["pred"], single["pred"], atol=1e-5)


def test_horovodrun_gloo_equals_one_process_on_global_batch(tmp_path, single):
    require_horovod()
    horovodrun = shutil.which("horovodrun", path=os.path.dirname(sys.executable))
    assert horovodrun, "horovodrun is installed with Horovod"
    p = subprocess.run([horovodrun, "-np", "2", "--gloo", *python(), KERAS, "fit",
                        "--batch", str(B), "--result_dir", str(tmp_path)],
                       env=_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert p.returncode == 0, p.stderr[-4000:] + p.stdout[-2000:]
    _check_equivalent([json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)],
                      single)


def test_mpirun_equals_one_process_on_global_batch(tmp_path, single):
    require_horovod()
    results = run_mpirun(2, [KERAS, "fit", "--batch", str(B)], timeout=600,
                         result_dir=str(tmp_path), env={"TEST_STRATEGY": "horovod"})
    _check_equivalent(results, single)


def test_without_horovod_smb_works_and_horovod_says_how_to_install():
    # Hide Horovod even if installed: importing it fails as on a machine without it.
    code = (
        "import sys; sys.modules['horovod'] = None\n"
        "import tensorflow as tf, tf_smb\n"
        "s = tf_smb.SMBStrategy()\n"
        "print('smb ok', s.num_replicas_in_sync)\n"
        "try:\n"
        "    tf_smb.HorovodStrategy()\n"
        "except ImportError as e:\n"
        "    print('hint:', e)\n")
    stdout = run_python(code)
    assert "smb ok 1" in stdout
    assert "hint:" in stdout and "tools/install_horovod.sh" in stdout
