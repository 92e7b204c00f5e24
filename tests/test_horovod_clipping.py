"""HorovodStrategy(gradient_clipping="per_worker") clips as MirroredStrategy
does, like SMBStrategy with that option (the default, "after_sum", is tested
in test_keras_optimizer.py)."""
import json
import os
import subprocess
import sys

import numpy as np

from harness import REPO, WORKERS, base_env, run_single

WORKER = os.path.join(WORKERS, "horovod_clip_worker.py")
VARIANTS = "clipnorm,global_clipnorm"
DATA = ["--global_batch", "16", "--workers", "2", "--bad_rank", "1", "--bad_step", "1"]
ENV = {"TEST_TIMEOUT": "60"}


def _max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))


def test_horovod_per_worker_clipping_equals_mirrored_strategy(tmp_path):
    p = subprocess.run([sys.executable, "-c", "import horovod.tensorflow"],
                       capture_output=True, timeout=300)
    assert p.returncode == 0, "tools/test.sh installs Horovod (tools/install_horovod.sh)"
    mirrored = run_single([WORKER, "clip", "--strategy", "mirrored", "--devices", "2",
                           "--variants", VARIANTS, *DATA], timeout=300, env=ENV).check().json()
    single = run_single([WORKER, "clip", "--strategy", "plain", "--variants", VARIANTS, *DATA],
                        timeout=300, env=ENV).check().json()
    env = base_env(ENV)
    for key in [k for k in env if k.startswith("TF_SMB_")]:
        del env[key]
    p = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2",
                        sys.executable, WORKER, "clip", "--strategy", "horovod",
                        "--gradient_clipping", "per_worker", "--variants", VARIANTS,
                        "--result_dir", str(tmp_path), *DATA],
                       env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-4000:] + p.stdout[-2000:]
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["size"] == 2
        for variant in VARIANTS.split(","):
            assert _max_diff(r[variant], mirrored[variant]) < 1e-5, (variant, f"rank {rank}")
            # The option took effect: summed-then-clipped would match one process.
            assert _max_diff(r[variant], single[variant]) > 1e-3, (variant, f"rank {rank}")
