"""Keras data and callbacks with several workers: fit's shuffle partitions the
rows every epoch; TensorBoard, saving and BackupAndRestore write from rank 0
only; a job killed mid-training resumes where its last backup left it."""
import glob
import json
import os
import signal

import numpy as np
import pytest

from harness import WORKERS, max_diff, run_ranks, run_single

WORKER = os.path.join(WORKERS, "keras_callbacks_worker.py")
TIMEOUT = 300


def _ok(results):
    return [r.check().json() for r in results]




def _tf_smb_lines(result, text):
    return [l for l in result.stderr.splitlines() if "tf_smb:" in l and text in l]


# ---- fit(shuffle=True) on arrays -------------------------------------------

@pytest.mark.parametrize("world,seed", [(2, "per_rank"), (3, "none")])
def test_shuffled_arrays_partition_rows_every_epoch(world, seed):
    # per_rank: every worker seeds differently (Keras alone then trains rows
    # twice or never); none: no user seed at all.
    results = _ok(run_ranks([WORKER, "shuffle", "--seed", seed], world, timeout=TIMEOUT))
    epochs = [[ids for r in results for ids in r["seen"][e]] for e in range(3)]
    for r in results:
        assert len(r["seen"]) == 3, f"rank {r['rank']} ran {len(r['seen'])} epochs"
    for e, ids in enumerate(epochs):
        counts = np.bincount(ids, minlength=50)
        assert (counts == 1).all(), (
            f"epoch {e}: rows seen twice {np.flatnonzero(counts > 1).tolist()}, "
            f"never {np.flatnonzero(counts == 0).tolist()}")
    orders = [tuple(ids) for ids in epochs]
    assert len(set(orders)) == 3, "the order must change from epoch to epoch"


# ---- TensorBoard -------------------------------------------------------------

def _event_files(root):
    return sorted(p for p in glob.glob(os.path.join(root, "**", "*"), recursive=True)
                  if os.path.isfile(p))


def _scalars(event_file):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    out = {}
    for event in tf.compat.v1.train.summary_iterator(event_file):
        for value in event.summary.value:
            if value.tag.startswith(("epoch_", "evaluation_")):
                out[(value.tag, event.step)] = float(tf.make_ndarray(value.tensor))
    return out


def test_tensorboard_rank0_writes_what_one_process_writes(tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    two.mkdir()
    one.mkdir()
    results = run_ranks([WORKER, "tensorboard", "--out_dir", str(two)], 2, timeout=TIMEOUT)
    _ok(results)
    _ok([run_single([WORKER, "tensorboard", "--out_dir", str(one)], timeout=TIMEOUT)])

    files = _event_files(two / "tb")
    # One writer per subdirectory: rank 0's. Rank 1 would have added a second.
    assert [os.path.relpath(os.path.dirname(f), two / "tb") for f in files] == [
        "train", "validation"], files
    reference = _event_files(one / "tb")
    for mine, theirs in zip(files, reference):
        got, want = _scalars(mine), _scalars(theirs)
        assert got.keys() == want.keys() and ("epoch_loss", 2) in got, (mine, sorted(got))
        for key, value in want.items():
            assert got[key] == pytest.approx(value, abs=1e-5), key
    assert len(_tf_smb_lines(results[1], "TensorBoard writes from rank 0 only")) == 1
    assert not _tf_smb_lines(results[0], "TensorBoard")
    # A model of no strategy on rank 1 logs as Keras does.
    assert _event_files(two / "plain_rank1"), "rank 1's plain model wrote no events"


# ---- saving --------------------------------------------------------------------

def test_rank0_saves_every_rank_loads(tmp_path):
    results = run_ranks([WORKER, "save", "--out_dir", str(tmp_path)], 2, timeout=TIMEOUT)
    for r, res in zip(results, _ok(results)):
        for key in ("pred_diff_model", "pred_diff_ckpt", "pred_diff_weights"):
            assert res[key] < 1e-6, f"rank {r.rank} {key}: {res[key]}"
        assert res["plain_exists"], f"rank {r.rank}: a model of no strategy was not saved"
    # Rank 1 wrote only the file of the model built outside any strategy.
    assert sorted(os.listdir(tmp_path)) == [
        "ckpt.keras", "fn_rank0.keras", "model.keras", "model.weights.h5",
        "plain_rank0.keras", "plain_rank1.keras"]
    # Said once (rank 1 skipped five writes), and only where it skips.
    assert len(_tf_smb_lines(results[1], "rank 0 writes them")) == 1, results[1].stderr[-3000:]
    assert not _tf_smb_lines(results[0], "writes no model files")


# ---- BackupAndRestore ------------------------------------------------------------

def _killed(results):
    for r in results:
        assert r.returncode == -signal.SIGKILL, (
            f"rank {r.rank} should have been killed, exited {r.returncode}; "
            f"stderr:\n{r.stderr[-3000:]}")


def _metadata(out_dir):
    with open(os.path.join(out_dir, "backup", "training_metadata.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def uninterrupted_sync(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    results = _ok(run_ranks([WORKER, "resume", "--out_dir", str(out)], 2, timeout=TIMEOUT))
    for r in results:
        assert r["epochs_run"] == [0, 1, 2, 3] and not r["backup_left"], f"rank {r['rank']}"
    return results


@pytest.mark.parametrize("die,resumed_at", [
    ("mid_epoch:2", 2),  # every worker SIGKILLed in epoch 2: epochs 0-1 kept
    ("in_backup:1", 1),  # rank 0 killed while writing epoch 1's backup (torn file)
])
def test_sync_job_killed_and_relaunched_ends_as_uninterrupted(
        tmp_path, uninterrupted_sync, die, resumed_at):
    command = [WORKER, "resume", "--out_dir", str(tmp_path)]
    _killed(run_ranks(command + ["--die", die], 2, timeout=TIMEOUT))
    assert _metadata(tmp_path)["epoch"] == resumed_at
    if die.startswith("in_backup"):
        assert len(glob.glob(str(tmp_path / "backup" / "*.weights.h5"))) == 2  # torn one too
    resumed = _ok(run_ranks(command, 2, timeout=TIMEOUT))  # the same command, a new job
    for r, ref in zip(resumed, uninterrupted_sync):
        assert r["epochs_run"] == list(range(resumed_at, 4)), f"rank {r['rank']}"
        assert max_diff(r["weights"], ref["weights"]) < 1e-5, f"rank {r['rank']}"
        np.testing.assert_allclose(r["loss"], ref["loss"][resumed_at:], atol=1e-5)
        assert not r["backup_left"], f"rank {r['rank']}: backup not deleted at the end"
    assert not os.path.exists(tmp_path / "backup")


def test_async_job_killed_and_relaunched_resumes_from_backup_in_the_box(tmp_path):
    command = [WORKER, "resume", "--mode", "async", "--out_dir", str(tmp_path)]
    _killed(run_ranks(command + ["--die", "mid_epoch:2"], 2, timeout=TIMEOUT))
    assert _metadata(tmp_path)["epoch"] == 2
    resumed = _ok(run_ranks(command, 2, timeout=TIMEOUT))
    for r in resumed:
        assert r["epochs_run"] == [2, 3], f"rank {r['rank']}"
        # The restored values are the box's master copies before any step.
        assert r["box_equals_restored"], f"rank {r['rank']}"
        assert np.isfinite(r["loss"]).all() and not r["backup_left"], f"rank {r['rank']}"
    assert max_diff(resumed[0]["initial_weights"], resumed[1]["initial_weights"]) == 0.0
    assert not os.path.exists(tmp_path / "backup")
