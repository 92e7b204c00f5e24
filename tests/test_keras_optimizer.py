"""Keras optimizers under tf_smb strategies: gradient clipping, mixed precision
(loss scaling) with a non-finite gradient on one rank, variable
synchronization, and async mode's reduce/gather."""
import functools
import os

import numpy as np
import pytest

from harness import WORKERS, max_diff, require_horovod, run_mpirun, run_python, run_ranks, run_single

WORKER = os.path.join(WORKERS, "keras_optimizer_worker.py")
B = 8  # per-worker batch
CLIP_VARIANTS = ("clipnorm", "clipvalue", "global_clipnorm", "accumulate_clipnorm")
# MirroredStrategy cannot run gradient accumulation (merge_call inside Keras'
# accumulation cond), so the per-worker option is compared without it.
MIRRORED_VARIANTS = ("clipnorm", "clipvalue", "global_clipnorm")
ENV = {"TEST_TIMEOUT": "60"}  # a rank waiting on a collective fails within a minute




def _data_args(world):
    # Global batch world*B; the non-finite row sits in the last rank's shard.
    return ["--global_batch", str(world * B), "--workers", str(world),
            "--bad_rank", str(world - 1), "--bad_step", "1"]


@functools.lru_cache(maxsize=None)
def _one_process(world):
    """Plain Keras, no strategy, on the global batch (both scenarios in one start)."""
    return run_single([WORKER, "clip,mixed", "--strategy", "plain", *_data_args(world)],
                      timeout=300, env=ENV).check().json()


@functools.lru_cache(maxsize=None)
def _smb_default(world):
    """`world` SMB workers with the default options (gradient_clipping="after_sum")."""
    return [r.check().json() for r in run_ranks(
        [WORKER, "clip,mixed", *_data_args(world)], world, timeout=300, env=ENV)]


@pytest.mark.parametrize("world", [2, 3])
def test_clipping_after_sum_equals_one_process_on_global_batch(world):
    single, workers = _one_process(world), _smb_default(world)
    assert [r["size"] for r in workers] == [world] * world
    for variant in CLIP_VARIANTS:
        for r in workers:
            # Gradient accumulation too: summed exactly once per update.
            assert max_diff(r[variant], single[variant]) < 1e-5, (variant, f"rank {r['rank']}")
            assert max_diff(r[variant], workers[0][variant]) == 0.0, (variant, f"rank {r['rank']}")


@pytest.mark.parametrize("world", [2, 3])
def test_per_worker_clipping_equals_mirrored_strategy(world):
    variants = ",".join(MIRRORED_VARIANTS)
    mirrored = run_single([WORKER, "clip", "--strategy", "mirrored", "--devices", str(world),
                           "--variants", variants, *_data_args(world)],
                          timeout=300, env=ENV).check().json()
    assert mirrored["size"] == world
    workers = [r.check().json() for r in run_ranks(
        [WORKER, "clip", "--gradient_clipping", "per_worker", "--variants", variants,
         *_data_args(world)], world, timeout=300, env=ENV)]
    single = _one_process(world)
    for variant in MIRRORED_VARIANTS:
        for r in workers:
            assert max_diff(r[variant], mirrored[variant]) < 1e-5, (variant, f"rank {r['rank']}")
        # The two options really differ here: clipping changed the updates.
        assert max_diff(mirrored[variant], single[variant]) > 1e-3, variant


def test_variables_in_scope_are_on_write_as_under_mirrored_strategy():
    for r in _smb_default(2):
        assert r["synchronization"] == {
            "tf.Variable": "ON_WRITE", "keras_weights": ["ON_WRITE"],
            "optimizer": ["ON_WRITE"], "on_read": "ON_READ"}, f"rank {r['rank']}"


@pytest.mark.parametrize("world", [2, 3])
def test_loss_scaling_skips_the_same_step_on_every_rank(world):
    single, workers = _one_process(world), _smb_default(world)
    # The premise: only the last rank's shard of step 1 is non-finite.
    assert [r["nonfinite_local_steps"] for r in workers] == [[]] * (world - 1) + [[1]]
    for policy, tolerance in (("float32", 1e-5), ("mixed_float16", 1e-3)):
        for r in workers:
            got, want = r[policy], single[policy]
            where = (policy, f"rank {r['rank']}")
            # Step 1 skipped everywhere: the scale halves, the update count stalls.
            assert got["scales"] == want["scales"], where
            assert got["iterations"] == want["iterations"] == [1, 1, 2, 3], where
            assert got["finite"], where
            assert max_diff(got["weights"], workers[0][policy]["weights"]) == 0.0, where
            # float16 arithmetic rounds differently on a batch of B than of world*B.
            assert max_diff(got["weights"], want["weights"]) < tolerance, where


def test_horovod_strategy_clips_the_summed_gradient(tmp_path):
    require_horovod()
    variants = "clipnorm,global_clipnorm"
    results = run_mpirun(2, [WORKER, "clip", "--strategy", "horovod", "--variants", variants,
                             *_data_args(2)], timeout=300, result_dir=str(tmp_path), env=ENV)
    single = _one_process(2)
    for rank, r in enumerate(results):
        assert r["size"] == 2
        for variant in variants.split(","):
            assert max_diff(r[variant], single[variant]) < 1e-5, (variant, f"rank {rank}")


def test_async_reduce_and_gather_raise_while_keras_still_works():
    results = [r.check().json() for r in run_ranks(
        [WORKER, "async_api", "--mode", "async"], 2, timeout=300, env=ENV)]
    for r in results:
        assert set(r["errors"]) == {"reduce", "reduce_axis", "gather", "reduce_in_function"}
        for name, error in r["errors"].items():
            where = (name, f"rank {r['rank']}")
            assert error and "mode='async'" in error and "not in step" in error, where
            assert "experimental_local_results" in error, where
        # fit, evaluate (metrics read through the strategy) and predict still run.
        assert len(r["loss"]) == 2 and all(np.isfinite(r["loss"])), r
        assert 0.0 <= r["eval"]["accuracy"] <= 1.0 and np.isfinite(r["eval"]["loss"]), r
        assert r["pred_shape"] == [64, 3], r


def test_gradient_clipping_option_is_checked():
    code = ("import tf_smb\n"
            "for value in ['after_sum', 'per_worker', 'before_sum', None]:\n"
            "    try:\n"
            "        s = tf_smb.SMBStrategy(gradient_clipping=value)\n"
            "        print('accepted', s.gradient_clipping)\n"
            "    except ValueError as e:\n"
            "        print('refused:', e)\n"
            "print('default', tf_smb.SMBStrategy().gradient_clipping)\n")
    stdout = run_python(code)
    assert stdout.splitlines() == [
        "accepted after_sum", "accepted per_worker",
        "refused: gradient_clipping must be 'after_sum' or 'per_worker', got 'before_sum'",
        "refused: gradient_clipping must be 'after_sum' or 'per_worker', got None",
        "default after_sum"], stdout
