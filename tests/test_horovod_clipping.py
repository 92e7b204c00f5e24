"""HorovodStrategy(gradient_clipping="per_worker") clips as MirroredStrategy
does, like SMBStrategy with that option (the default, "after_sum", is tested
in test_keras_optimizer.py)."""
import os

from harness import WORKERS, max_diff, require_horovod, run_mpirun, run_single

WORKER = os.path.join(WORKERS, "keras_optimizer_worker.py")
VARIANTS = "clipnorm,global_clipnorm"
DATA = ["--global_batch", "16", "--workers", "2", "--bad_rank", "1", "--bad_step", "1"]
ENV = {"TEST_TIMEOUT": "60"}




def test_horovod_per_worker_clipping_equals_mirrored_strategy(tmp_path):
    require_horovod()
    mirrored = run_single([WORKER, "clip", "--strategy", "mirrored", "--devices", "2",
                           "--variants", VARIANTS, *DATA], timeout=300, env=ENV).check().json()
    single = run_single([WORKER, "clip", "--strategy", "plain", "--variants", VARIANTS, *DATA],
                        timeout=300, env=ENV).check().json()
    results = run_mpirun(2, [WORKER, "clip", "--strategy", "horovod",
                             "--gradient_clipping", "per_worker", "--variants", VARIANTS, *DATA],
                         timeout=300, result_dir=str(tmp_path), env=ENV)
    for rank, r in enumerate(results):
        assert r["size"] == 2
        for variant in VARIANTS.split(","):
            assert max_diff(r[variant], mirrored[variant]) < 1e-5, (variant, f"rank {rank}")
            # The option took effect: summed-then-clipped would match one process.
            assert max_diff(r[variant], single[variant]) > 1e-3, (variant, f"rank {rank}")
