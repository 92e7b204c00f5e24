"""SMBStrategy(mode="async") with Keras: accuracy, staleness, worker loss, errors."""
import os

import pytest

from harness import REPO, WORKERS, rank_lines, run_launcher, run_python, run_ranks

DIGITS = os.path.join(WORKERS, "digits_async.py")
PARAMS = os.path.join(WORKERS, "async_params_worker.py")


@pytest.mark.parametrize("update", ["delta", "sgd"])
def test_keras_digits_async_reaches_090(update):
    p = run_launcher(2, [os.path.join(REPO, "examples", "keras_digits.py"), "--mode=async",
                         f"--update={update}"], timeout=600)
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]
    for rank in range(2):
        accs = [float(l.split(":")[1]) for l in rank_lines(p.stdout, rank)
                if l.startswith("test accuracy:")]
        assert accs and accs[-1] >= 0.90, (rank, accs, p.stdout[-2000:])


def test_workers_end_with_the_boxs_final_values():
    results = [r.check().json() for r in run_ranks([DIGITS, "--epochs", "3"], 2, timeout=600)]
    # Both loaded the same final values from the box after fit ...
    assert results[0]["weights_sum"] == results[1]["weights_sum"]
    # ... which trained (an untrained model scores ~0.1 on the 10 digits; 3 epochs of 2
    # asynchronous workers measured 0.95-0.97), and score alike on all the test data.
    for r in results:
        assert r["steps"] > 0 and r["accuracy"] >= 0.9, r
    assert results[0]["accuracy"] == results[1]["accuracy"], results


def test_fit_counts_each_workers_own_batches_and_validates_on_all_data():
    # 3 workers: every 3rd batch each, unevenly (22 batches: 8, 7, 7).
    results = [r.check().json() for r in run_ranks(
        [DIGITS, "--epochs", "2", "--validate"], 3, timeout=600)]
    for rank, res in enumerate(results):
        train_total, test_total = res["dataset_batches"]
        own = len(range(rank, train_total, 3))
        assert res["announced_steps"] == [own, own], (rank, res)
        assert res["trained_batches"] == [own, own], (rank, res)
        # fit's validation, like evaluate, runs on all the test data.
        assert res["validated_batches"] == [test_total, test_total], (rank, res)
        assert not [w for w in res["warnings"] if "ran out of data" in w], (rank, res)
    assert sorted(r["trained_batches"][0] for r in results) == [7, 7, 8], results


def test_a_worker_without_a_batch_finishes_fit():
    # 16 rows, batch 32: one batch, rank 0's; rank 1 has none to train on (Keras
    # takes a model's structure from the first batch: it builds from the data's
    # spec instead). Both finish fit, evaluate and predict with the box's values
    # (Keras 3.3 too: its epochs without a step are hooked, keras33.py).
    results = [r.check().json() for r in run_ranks(
        [PARAMS, "no_batch"], 2, timeout=300, env={"TEST_TIMEOUT": "120"})]
    for kind, steps_so_far in (("arrays", 2), ("dataset", 4)):
        trained, idle = (r[kind] for r in results)
        assert trained["epochs"] == 2 and trained["steps"] == steps_so_far, results
        for res in (trained, idle):
            assert res["kernel"] == res["box_kernel"], (kind, res)
            assert res["predicted_rows"] == 16, (kind, res)
        assert idle["kernel"] == trained["kernel"], (kind, results)


@pytest.mark.parametrize("staleness", [0, 2])
def test_staleness_bound_with_a_slow_worker(staleness):
    results = [r.check().json() for r in run_ranks(
        [DIGITS, "--epochs", "2", "--staleness", str(staleness), "--slow_rank", "1",
         "--delay", "0.05"], 2, timeout=600)]
    for res in results:
        assert res["max_gap"] <= staleness, res


def test_without_staleness_bound_the_fast_worker_does_more_steps():
    # Each worker trains 4 epochs of its half (~44 steps); rank 1 sleeps 0.1 s
    # a step. Unbounded, the fast one runs far ahead and finishes first, ahead by
    # about the slow one's sleeps (a ratio of times would depend on the machine's
    # speed: on a slow one the steps' computation dwarfs the sleeps).
    delay = 0.1
    results = [r.check().json() for r in run_ranks(
        [DIGITS, "--epochs", "4", "--slow_rank", "1", "--delay", str(delay)], 2, timeout=600)]
    fast, slow = results
    assert slow["seconds"] - fast["seconds"] > 0.5 * delay * slow["steps"], results
    # At some step the fast worker had completed 10+ steps more than the slow one.
    assert fast["max_gap"] >= 10, results


def test_killed_worker_does_not_stop_the_others():
    results = run_ranks([DIGITS, "--epochs", "15", "--kill_rank", "2", "--kill_epoch", "1"],
                        3, timeout=900)
    assert results[2].returncode == -9
    for r in results[:2]:
        res = r.check().json()
        assert res["accuracy"] >= 0.90, res


def test_pushing_or_reading_into_wrong_shape_or_dtype_is_refused_and_changes_nothing():
    keras_worker = os.path.join(WORKERS, "keras_worker.py")
    for r in run_ranks([keras_worker, "async_bad_push"], 2, timeout=300):
        res = r.check().json()
        assert all(e and "float32[2,2]" in e for e in res["errors"]), res
        assert "float32[4]" in res["errors"][0] and "float64[2,2]" in res["errors"][1]
        assert res["value"] == [[1.0, 2.0], [3.0, 4.0]]
        into = res["read_into"]
        assert into["value"] == into["again"] == [[1.0, 2.0], [3.0, 4.0]], into
        assert into["held"] == [[0.0, 0.0], [0.0, 0.0]], into  # copy-on-write
        assert "float32[2,2], got float32[4]" in into["errors"][0], into
        assert "float32[2,2], got float64[2,2]" in into["errors"][1], into
        assert into["bad_values"] == [[0.0] * 4, [[0.0, 0.0], [0.0, 0.0]]], into
        pushed = res["push_read"]
        assert pushed["box"] == [[2.0, 3.0], [4.0, 5.0]], pushed  # one push of ones
        if r.rank == 0:
            assert "dtype and shape: expected float[2,2], got float[4]" in pushed["error"]
            assert pushed["value"] == [[2.0, 3.0], [4.0, 5.0]], pushed  # read back
            assert pushed["held"] == [[1.0, 2.0], [3.0, 4.0]], pushed  # copy-on-write


def test_async_options_are_checked():
    code = ("import tf_smb\n"
            "for kw in [dict(mode='bogus'), dict(mode='async', update='adam'),\n"
            "           dict(mode='async', staleness=-1), dict(mode='sync', staleness=2),\n"
            "           dict(mode='async', consistency='loose'),\n"
            "           dict(mode='async', read_at='end'), dict(mode='sync', read_at='push'),\n"
            "           dict(mode='async', read_at='push', staleness=1),\n"
            "           dict(mode='async', momentum=0.9)]:\n"
            "    try:\n"
            "        tf_smb.SMBStrategy(**kw); print('accepted', kw)\n"
            "    except ValueError as e:\n"
            "        print('refused:', e)\n")
    lines = run_python(code).splitlines()
    assert len(lines) == 9 and all(l.startswith("refused:") for l in lines), lines
    assert "read_at must be 'start' or 'push', got 'end'" in lines[5], lines
    assert "apply to mode='async' only" in lines[6], lines
    assert "read_at='push' needs staleness=None" in lines[7], lines
    # The box's momentum with the worker's own optimizer step: refused, not ignored.
    assert "applies to update='sgd' only, got update='delta'" in lines[8], lines
