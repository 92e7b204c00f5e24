"""SMBStrategy(mode="async"): box parameters named by variable path and checked
across workers; which updates update="sgd" applies in the box (2 workers)."""
import functools
import os

import pytest

from harness import WORKERS, run_ranks

WORKER = os.path.join(WORKERS, "async_params_worker.py")
ENV = {"TEST_TIMEOUT": "60"}


@functools.lru_cache(maxsize=None)
def _results():
    """Both workers, all scenarios in one process start each."""
    return [r.check().json() for r in run_ranks(
        [WORKER, "order,sgd_args,names,loads,evaluating"], 2, timeout=300, env=ENV)]


def test_workers_creating_variables_in_different_order_all_fail_naming_both():
    # Rank 0 creates 'a' then 'b', rank 1 'b' then 'a' (same dtype and shape):
    # before the check, rank 1's 'b' silently took rank 0's 'a' (1.0, not 2.0).
    for r in _results():
        error = r["order_error"]
        assert error, f"rank {r['rank']} created {r['order_values']} without an error"
        assert "rank 0: 'a' float32[2,2]" in error, error
        assert "rank 1: 'b' float32[2,2]" in error, error
        assert "same order" in error, error
        assert r["order_values"] == {}, r


def test_sgd_update_with_a_gradient_but_no_learning_rate_raises():
    for r in _results():
        error = r["one_tensor_error"]
        assert error and "update='sgd'" in error and "learning_rate" in error, error
        assert "update='delta'" in error, error
        assert r["after_error"] == [1.0] * 3, r  # nothing was pushed


def test_sgd_mode_applies_gradient_steps_in_the_box_and_other_updates_as_deltas():
    for r in _results():
        assert r["after_no_args"] == pytest.approx([0.0] * 3), r          # weight decay
        assert r["after_sgd"] == pytest.approx([-0.2] * 3), r             # w -= lr * g
        assert r["after_variable_arg"] == pytest.approx([4.8] * 3), r     # EMA overwrite
        # Inside tf.function: an in-place update's delta, and a step's read of
        # the box at its start.
        assert r["after_function_update"] == pytest.approx([3.3] * 3), r
        assert r["read_in_step"] == pytest.approx([3.3] * 3), r


def test_read_at_push_reads_the_box_at_a_steps_end_after_its_own_reads():
    for r in run_ranks([WORKER, "sgd_args", "--read_at", "push"], 2, timeout=300, env=ENV):
        r = r.check().json()
        assert r["after_function_update"] == pytest.approx([3.3] * 3), r
        assert r["read_in_step"] == pytest.approx([0.0] * 3), r  # the worker's own copy
        assert r["after_step"] == pytest.approx([3.3] * 3), r    # the box's, for the next


def test_segments_are_named_by_variable_path_alike_on_every_worker():
    results = _results()
    assert results[0]["keras"] == results[1]["keras"]
    r = results[0]
    for path, segment in r["keras"]:
        assert segment == path, r["keras"]
    paths = [p for p, _ in r["keras"]]
    assert len(set(paths)) == 8 and "seq/hidden/kernel" in paths, paths  # 2 models x 2 layers
    assert r["dup"] == ["dup", "dup#2"], r
    long = r["long"]
    assert len(long.encode()) <= 100 and long.endswith("layer_layer_kernel"), long
    assert "~" in long, long


def _check_loads(results):
    for r in results:
        assert r["loads_initial"] != [1.5, 1.5], r
        assert r["after_set_weights"] == [1.5, 1.5], r
        assert r["after_layer_set_weights"] == [4.5, 4.5], r
        assert r["after_load_weights"] == [2.5, 2.5], r
        assert r["after_load_model"] == [3.5, 3.5], r
        assert r["after_fit"] == [2.5, 2.5], r


def test_weights_loaded_or_set_outside_training_reach_the_box():
    # Before the hooks the box kept the initial values and the next step read
    # them over what was loaded: a fit at learning rate 0 ended at the initial
    # weights.
    _check_loads(_results())


def test_weights_loaded_or_set_with_local_replicas_reach_the_box_once():
    # With local replicas an assignment pushed every worker's change: before,
    # the box held initial + 2 * (loaded - initial).
    _check_loads([r.check().json() for r in run_ranks(
        [WORKER, "loads", "--local_replicas", "2"], 2, timeout=300, env=ENV)])


def test_a_custom_loop_marks_evaluation_with_tf_smb_evaluating():
    for r in _results():
        assert (r["eval_batches"], r["eval_steps"]) == (4, 0), r      # all data, no step
        assert (r["train_batches"], r["train_steps"]) == (2, 1), r    # every 2nd batch
