"""Keras `fit` with SMBStrategy(elastic=True) through member changes, unchanged
(tests/workers/elastic_fit_worker.py): 4 workers on two hosts of 2 slots; one is
killed mid-epoch (its host is blacklisted: 4 -> 2, back to the last commit), then
discovery adds a host (2 -> 3, at a commit). The weights equal those of one
process on the same global batches, and fit's history has every epoch.
"""
import json
import os
import platform
import sys

import numpy as np

import harness

WORKER = os.path.join(harness.WORKERS, "elastic_fit_worker.py")
TIMEOUT_S = 300.0


def _weights(path):
    with np.load(path) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


def test_fit_through_a_lost_and_an_added_worker_equals_one_process(tmp_path):
    one = harness.run_single([WORKER], TIMEOUT_S, env={"OUT": str(tmp_path / "one.npz")})
    one.check()
    progress = tmp_path / "progress"
    discover = tmp_path / "discover.sh"
    # After epoch 2 a third host, this machine's own name, has a slot.
    discover.write_text(
        "#!/bin/sh\necho localhost:2\necho 127.0.0.1:2\n"
        f"awk '$1 >= 2' {progress} 2>/dev/null | grep -q . && echo {platform.node()}:1\n"
        "exit 0\n")
    discover.chmod(0o700)
    argv = [sys.executable, "-m", "tf_smb.run", "-np", "4", "--min-np", "2", "--max-np", "4",
            "--host-discovery-script", str(discover), *harness.python(), WORKER]
    env = harness.base_env({"OUT": str(tmp_path / "elastic.npz"), "PROGRESS": str(progress),
                            # worker 3 (127.0.0.1's second slot) dies at epoch 1, batch 6:
                            # two batches after the commit at batch 4.
                            "KILL_WORKER": "3:1:6", "TF_SMB_TIMEOUT": "60"})
    r = harness.run_command(argv, TIMEOUT_S, env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-8000:]
    assert "worker 3 (127.0.0.1) was killed by signal SIGKILL" in out, out[-8000:]
    assert "generation 1: 2 workers" in out and "generation 2: 3 workers" in out, out[-8000:]
    sizes = [int(line.split()[1]) for line in progress.read_text().splitlines()]
    assert sizes[0] == 4 and 2 in sizes and sizes[-1] == 3, sizes
    summary = json.loads([line for line in r.stdout.splitlines() if '"epochs"' in line][-1]
                         .split("]: ", 1)[-1])
    assert summary["epochs"] == list(range(6)) and summary["size"] == 3, summary
    elastic, reference = _weights(tmp_path / "elastic.npz"), _weights(tmp_path / "one.npz")
    for got, want in zip(elastic, reference):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
