"""SMBStrategy across processes: equivalence with one process on the global
batch, evaluate/predict over all data, uneven shards, errors."""
import json
import os

import numpy as np
import pytest

from harness import WORKERS, max_diff, run_launcher, run_ranks, run_single

KERAS = os.path.join(WORKERS, "keras_worker.py")
B = 8  # per-worker batch




@pytest.fixture(scope="module")
def fit_single():
    return run_single([KERAS, "fit", "--batch", str(2 * B)], timeout=300).check().json()


@pytest.fixture(scope="module")
def fit_two():
    return [r.check().json() for r in run_ranks([KERAS, "fit", "--batch", str(B)], 2, timeout=300)]


def test_fit_two_workers_equal_one_process_on_global_batch(fit_single, fit_two):
    assert fit_single["size"] == 1 and [r["size"] for r in fit_two] == [2, 2]
    for r in fit_two:
        assert max_diff(r["weights"], fit_single["weights"]) < 1e-5, f"rank {r['rank']}"
    assert max_diff(fit_two[0]["weights"], fit_two[1]["weights"]) == 0.0


def test_finished_input_iterators_are_released_off_the_training_thread(fit_single, fit_two):
    # One process iterates plain datasets; two workers' distributed iterators
    # go to the releaser thread (tf_smb/iterator_release.py) once Keras drops them.
    assert fit_single["iterators_released"] == 0
    for r in fit_two:
        assert r["iterators_released"] >= 2, f"rank {r['rank']}: {r['iterators_released']}"
        # One device per worker iterates its dataset directly (a MultiDeviceIterator
        # cost ~45 ms to make, twice per epoch).
        assert r["input_iterator"] == "OwnedIterator", f"rank {r['rank']}: {r['input_iterator']}"


def test_worker_input_pipelines_run_without_tf_data_autotune_thread(fit_single, fit_two):
    # Destroying an autotuning iterator waited up to its optimization period
    # (iterator_release.py); a worker's datasets, from a dataset or a function,
    # have the thread off. One process iterates the user's dataset untouched.
    assert fit_single["input_autotune"] == []
    for r in fit_two:
        assert r["input_autotune"] == [False, False], f"rank {r['rank']}: {r['input_autotune']}"


def test_evaluate_covers_all_data(fit_single, fit_two):
    for r in fit_two:
        for key in ("eval", "eval_numpy"):
            for metric in ("loss", "accuracy"):
                assert r[key][metric] == pytest.approx(fit_single[key][metric], abs=1e-5), (
                    f"rank {r['rank']} {key} {metric}")


def test_predict_returns_every_row_in_order(fit_single, fit_two):
    for r in fit_two:
        for key in ("pred", "pred_numpy"):
            assert np.shape(r[key]) == (53, 3), f"rank {r['rank']} {key}"
            np.testing.assert_allclose(r[key], fit_single[key], atol=1e-5)


def test_custom_loop_two_workers_equal_one_process():
    single = run_single([KERAS, "custom", "--batch", str(2 * B)], timeout=300).check().json()
    two = [r.check().json() for r in run_ranks([KERAS, "custom", "--batch", str(B)], 2, timeout=300)]
    for r in two:
        assert max_diff(r["weights"], single["weights"]) < 1e-5, f"rank {r['rank']}"
        np.testing.assert_allclose(r["loss"], single["loss"], rtol=1e-5)
        # distribute_datasets_from_function + strategy.reduce count the whole test set.
        assert r["total"] == 53 and r["correct"] == single["correct"]


def test_uneven_shards_do_not_hang():
    two = [r.check().json() for r in run_ranks([KERAS, "uneven"], 2, timeout=300)]
    # Every worker runs as many steps as the longest shard (5), then stops.
    assert [r["steps"] for r in two] == [5, 5]
    assert max_diff(two[0]["weights"], two[1]["weights"]) == 0.0
    assert all(np.isfinite(np.asarray(w)).all() for w in two[0]["weights"])


def test_jit_compile_gives_a_clear_error():
    for r in run_ranks([KERAS, "jit"], 2, timeout=300):
        err = r.check().json()["error"]
        assert err and "jit_compile=False" in err, err


def test_disagreeing_ranks_get_invalid_argument_naming_both():
    for r in run_ranks([KERAS, "mismatch"], 2, timeout=300):
        res = r.check().json()
        assert "rank 0" in res["shape_error"] and "float32[3]" in res["shape_error"]
        assert "rank 1" in res["shape_error"] and "float32[4]" in res["shape_error"]
        # After a failed collective the job stops: later calls fail at once
        # with the original error instead of pairing collectives wrongly.
        assert res["later_error"] and "float32[3]" in res["later_error"], res
        assert res["later_seconds"] < 5, res
    for r in run_ranks([KERAS, "mismatch_dtype"], 2, timeout=300):
        err = r.check().json()["dtype_error"]
        assert err and "float32[4]" in err and "float64[4]" in err, f"rank {r.rank}: {err}"


def test_killed_worker_fails_the_others_naming_it():
    results = run_ranks([KERAS, "die"], 2, timeout=300, env={"TEST_TIMEOUT": "120"})
    assert results[1].returncode == -9
    survivor = results[0]
    assert survivor.returncode != 0, "rank 0 should fail when rank 1 dies"
    assert "rank 1" in survivor.stderr and "died" in survivor.stderr, survivor.stderr[-3000:]


def test_launcher_reports_killed_worker():
    p = run_launcher(2, [KERAS, "die"], timeout=300)
    assert p.returncode != 0
    assert "rank 1" in p.stderr and "SIGKILL" in p.stderr, p.stderr[-3000:]


def test_checkpoints_and_save_written_once(tmp_path):
    results = run_ranks([KERAS, "save", "--out_dir", str(tmp_path)], 2, timeout=300)
    for r in results:
        res = r.check().json()
        assert res["saved_equal"] and res["ckpt_exists"]
    # Only rank 0 writes: rank 1's save went nowhere.
    assert sorted(os.listdir(tmp_path)) == ["by_rank0.keras", "ckpt.weights.h5", "model.keras"]


def test_ops_every_dtype_and_initial_broadcast():
    results = [r.check().json() for r in run_ranks([KERAS, "ops"], 2, timeout=300)]
    for r in results:
        assert r["bad"] == [], f"rank {r['rank']}"
    # Seeded differently, yet both start from rank 0's initial weights.
    assert max_diff(results[0]["weights"], results[1]["weights"]) == 0.0


@pytest.mark.parametrize("world,heap", [(2, None), (3, None), (2, 0)])
def test_sums_kept_in_the_box_are_exact_held_and_never_written(world, heap):
    env = None if heap is None else {"TF_SMB_HEAP_BYTES": str(heap)}
    results = [r.check().json()
               for r in run_ranks([KERAS, "shared_sums"], world, timeout=300, env=env)]
    for r in results:
        assert r["bad"] == [], f"rank {r['rank']}"
        if heap == 0:  # no room for result buffers: every sum is copied out
            assert r["in_box"] == [False] * 13, f"rank {r['rank']}"
        else:
            # The first 8 held sums stay in the box's result buffers; then
            # every buffer is held and the sums are copied out instead. The
            # last, large one finds a free buffer again.
            assert r["in_box"] == [True] * 8 + [False] * 4 + [True], f"rank {r['rank']}"
    assert results[0]["first_added"] == results[0]["total"] * 2
    for r in results[1:]:
        assert r["untouched"] is True, f"rank {r['rank']} saw rank 0's write"


def test_single_process_without_launcher():
    # With one worker every collective is local: nothing to disagree with.
    res = run_single([KERAS, "mismatch"], timeout=300).check().json()
    assert res["size"] == 1 and res["shape_error"] is None and res["later_error"] is None
    res = run_single([KERAS, "mismatch_dtype"], timeout=300).check().json()
    assert res["size"] == 1 and res["dtype_error"] is None


def test_mpirun_launch_without_our_launcher(fit_single, tmp_path):
    """Open MPI's mpirun: rank/size/job id from its environment, rank 0 makes the box."""
    import shutil
    import subprocess
    import sys

    from harness import base_env
    mpirun = shutil.which("mpirun")
    assert mpirun, "tools/install.sh --test installs Open MPI (openmpi-bin)"
    env = base_env()
    for key in [k for k in env if k.startswith("TF_SMB_")]:
        del env[key]
    p = subprocess.run(
        [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", "--tag-output",
         sys.executable, KERAS, "fit", "--batch", str(B), "--result_dir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert sorted(r["rank"] for r in results) == [0, 1]
    for r in results:
        assert max_diff(r["weights"], fit_single["weights"]) < 1e-5, f"rank {r['rank']}"
