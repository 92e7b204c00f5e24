"""N workers train like one process on the global batch, or say why not: the
cases a new user met where tf_smb differed silently (issue "Never silently
different"): global batches that split unevenly over the replicas, Keras'
default shuffle under a user's seed, a model built outside the scope,
reductions of asynchronous workers, AutoShardPolicy.OFF in async mode, and a
rank that leaves the job while the others still wait for it."""
import os

import pytest

from harness import WORKERS, max_diff, run_ranks, run_single

WORKER = os.path.join(WORKERS, "same_as_one_worker.py")
UNEVEN = ("odd_global", "partial_last")
# Equal to one process on every tested Keras (Keras 3.3 included).
EVERY_KERAS = ("default_shuffle", "custom_step_sgd")
EQUAL = UNEVEN + EVERY_KERAS


def _run(processes, replicas=1, scenarios=EQUAL, mode="sync"):
    args = [WORKER, "--mode", mode, "--scenarios", ",".join(scenarios)]
    env = {"TEST_LOCAL_REPLICAS": str(replicas)}
    if processes == 1:
        return [run_single(args, timeout=300, env=env).check().json()]
    return [r.check().json() for r in run_ranks(args, processes, timeout=300, env=env)]


@pytest.fixture(scope="module")
def one_process():
    return _run(1)[0]


@pytest.fixture(scope="module")
def two_workers():
    return _run(2, scenarios=EQUAL + ("outside_scope",))


@pytest.mark.parametrize("processes,replicas", [(2, 1), (3, 1), (2, 2), (1, 3)])
def test_uneven_batches_and_default_shuffle_equal_one_process(
        one_process, two_workers, processes, replicas):
    # odd_global: a global batch of 33 (17 + 16 rows, or 11 each of 3); partial_last:
    # 249 rows in batches of 32 (the last, 25 rows, splits unevenly); default_shuffle:
    # fit(x, y) shuffles with the seed every worker set, as one process does;
    # custom_step_sgd: a subclassed model's own train_step.
    results = two_workers if (processes, replicas) == (2, 1) else _run(processes, replicas)
    assert len(results) == processes
    for r in results:
        assert r["replicas"] == processes * replicas
        for scenario in EQUAL:
            diff = max_diff(r[scenario], one_process[scenario])
            assert diff < 1e-5, (f"rank {r['rank']} of {processes} x {replicas} replicas, "
                                 f"{scenario}: {diff} off one process")


def test_custom_train_step_and_default_shuffle_equal_one_process(one_process, two_workers):
    # On every tested Keras pair (KERAS_FACING): a subclassed model's own train_step
    # (compute_loss, apply_gradients; SGD, which a gradient twice too large would show)
    # and fit(x, y)'s shuffle under the seed. (Uneven splits: Keras 3.3 does not divide
    # the loss per replica, so there the workers' means average: the README says so.)
    for r in two_workers:
        for scenario in EVERY_KERAS:
            diff = max_diff(r[scenario], one_process[scenario])
            assert diff < 1e-5, f"rank {r['rank']}, {scenario}: {diff} off one process"


def test_a_model_built_outside_the_scope_is_refused(two_workers):
    for r in two_workers:
        error = r["outside_scope"].get("error")
        assert error is not None, f"rank {r['rank']} trained a model built outside the scope"
        assert "built outside `strategy.scope()`" in error and "with strategy.scope():" in error
        assert f"worker {r['rank']} of a SMBStrategy of 2 workers" in error


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("processes,replicas", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_reduce_and_gather_combine_replicas_or_refuse_in_async_mode(mode, processes,
                                                                     replicas):
    # Each replica adds its index + 1. Combining over processes that train apart
    # (async, 2+ processes) raises ValueError, with or without replica threads;
    # everything else combines every replica in sync (one process's replica
    # threads, async too, step together). An async process trains on every
    # N-th whole batch, split over its own replicas, which are its replica group.
    scenarios = ("reduce", "shard_off", "shard") if mode == "async" else ("reduce",)
    total = processes * replicas
    for r in _run(processes, replicas, scenarios, mode):
        where = f"rank {r['rank']}, {mode}, {processes} processes x {replicas} replicas"
        reduced, gathered = r["reduce"]["reduce"], r["reduce"]["gather"]
        in_sync = replicas if mode == "async" else total
        assert r["reduce"]["in_sync"] == in_sync, (where, r["reduce"])
        if mode == "async" and processes > 1:
            for said in (reduced, gathered):
                assert "workers are not in step" in said.get("error", ""), (where, said)
        else:
            assert reduced == {"value": total * (total + 1) / 2}, (where, reduced)
            assert gathered == {"value": [float(i + 1) for i in range(total)]}, (where, gathered)
        if mode == "async":
            # 10 batches under AutoShardPolicy.OFF: every worker trains on each;
            # sharded, every N-th.
            assert r["shard_off"] == 10, (where, r["shard_off"])
            assert r["shard"] == 10 // processes, (where, r["shard"])


@pytest.mark.parametrize("how", ["leave_early", "raise_early"])
def test_a_rank_that_leaves_early_is_named_with_how_it_left(how):
    # Rank 0 ends after one epoch of three (a callback stops only its fit, or
    # raises); rank 1, waiting for it in the next collective, fails at once
    # saying rank 0 left the job and how, not that it "exited or died".
    first, second = run_ranks([WORKER, "--scenarios", how], 2, timeout=120)
    if how == "leave_early":
        first.check()
        said = "left the job: its program ended normally"
    else:
        assert first.returncode != 0 and "rank 0 gives up" in first.stderr
        said = "left the job: its program ended with an error"
    assert second.returncode != 0, "rank 1 finished without rank 0"
    lines = [l for l in second.stderr.splitlines() if said in l]
    assert lines, f"rank 1 did not say {said!r}:\n{second.stderr[-3000:]}"
    assert "rank 0 (pid" in lines[-1] and "rank 1 was waiting for it" in lines[-1], lines[-1]
