"""tf_smb.horovod used as a Horovod user uses it: N processes with
DistributedOptimizer (or DistributedGradientTape) on local batch B equal one
process on the global batch N*B, from differently seeded weights that
BroadcastGlobalVariablesCallback(0) / broadcast_variables make equal; and a
disagreement fails on every rank without ending the job."""
from __future__ import annotations

import json
import os
import re
import sys

import pytest

import harness

WORKER = "tests/workers/horovod_api_worker.py"


def _ranks(scenario: str, np_: int = 2) -> list:
    r = harness.run_launcher(np_, [WORKER, scenario], timeout=300)
    assert r.returncode == 0, f"tf_smb.run exited with {r.returncode}:\n{r.stdout[-4000:]}"
    results = []
    for rank in range(np_):
        lines = [l for l in harness.rank_lines(r.stdout, rank) if l.startswith("{")]
        assert lines, f"rank {rank} printed no result:\n{r.stdout[-3000:]}"
        results.append(__import__("json").loads(lines[-1]))
    return results


def _horovodrun_ranks(scenario: str) -> list:
    """The same worker under Horovod's own launcher (Gloo mode: no MPI), as a
    Horovod user launches a script; Horovod's runner places the processes,
    nothing of Horovod runs in them."""
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    assert os.path.exists(horovodrun), "tools/test.sh installs Horovod (tools/install_horovod.sh)"
    argv = [horovodrun, "-np", "2", "--gloo", *harness.python(),
            os.path.join(harness.REPO, WORKER), scenario]
    env = {k: v for k, v in harness.base_env().items() if k not in harness.env_lib.LAUNCHER_VARS}
    r = harness.run_command(argv, 600, env, cwd=harness.REPO)
    assert r.returncode == 0, f"horovodrun exited with {r.returncode}:\n{r.stdout[-4000:]}"
    results = {}
    for line in r.stdout.splitlines():
        m = re.match(r"^\[(\d+)\]<stdout>:(\{.*)$", line)
        if m:
            results[int(m.group(1))] = json.loads(m.group(2))
    assert sorted(results) == [0, 1], f"ranks with a result: {sorted(results)}:\n{r.stdout[-3000:]}"
    return [results[0], results[1]]


def _single(scenario: str) -> dict:
    return harness.run_single([WORKER, scenario], timeout=300).check().json()


@pytest.mark.parametrize("scenario", ["fit1", "fit2", "tape", "fit1 under horovodrun",
                                      "fit1 at 3", "tape at 3"])
def test_n_processes_equal_one_process_on_the_global_batch(scenario):
    if scenario.endswith("under horovodrun"):
        scenario = scenario.split()[0]
        ranks = _horovodrun_ranks(scenario)
    elif scenario.endswith(" at 3"):
        scenario = scenario.split()[0]
        ranks = _ranks(scenario, 3)
    else:
        ranks = _ranks(scenario)
    alone = _single(scenario)
    for r in ranks:
        assert harness.max_diff(r["weights"], ranks[0]["weights"]) == 0.0, (
            f"rank {r['rank']}'s weights differ from rank 0's")
        assert harness.max_diff(r["weights"], alone["weights"]) < 1e-5, (
            f"rank {r['rank']} differs from one process on the global batch by "
            f"{harness.max_diff(r['weights'], alone['weights'])}")
    if scenario.startswith("fit"):
        # MetricAverageCallback: every rank reports the same (averaged) loss.
        assert all(r["loss"] == ranks[0]["loss"] for r in ranks)
    if scenario == "fit2":
        # 96 rows, 24 a global batch: 4 batches an epoch; every 2nd one updates.
        assert [r["counter"] for r in ranks] == [0, 0]


@pytest.fixture(scope="module")
def small_scenarios() -> list:
    """The short 2-process scenarios, in one run."""
    return _ranks("disagree,partial")


def test_a_disagreeing_collective_fails_on_every_rank_and_the_next_works(small_scenarios):
    """Eagerly and in a tf.function (whose agreed collectives skip the check later)."""
    ranks = small_scenarios
    for r in ranks:
        assert "disagree on the shape" in r["caught"], r
        assert "rank 0: [3]" in r["caught"] and "rank 1: [4]" in r["caught"], r["caught"]
        assert r["after"] == [2.0, 2.0, 2.0]
        assert "disagree on the shape" in r["caught_in_graph"], r
        assert r["after_in_graph"] == [[2.0, 2.0]] * 3


def test_partial_distributed_optimizer_keeps_local_gradients_local(small_scenarios):
    """Gradients 1 and 2 (rank + 1): the shared kernel steps by their average on
    both ranks; each local kernel by its own gradient / size (SGD, rate 1)."""
    for r in small_scenarios:
        assert r["partial_shared"] == -1.5, r
        assert r["partial_local"] == -(r["rank"] + 1) / 2, r



@pytest.fixture(scope="module")
def three_process_scenarios() -> list:
    """The 3-process scenarios, in one run (join last: it ends by stopping the job)."""
    return _ranks("process_sets,join", 3)


def test_process_sets_run_among_their_ranks_and_fail_clearly_outside(three_process_scenarios):
    """3 processes: set A = [0, 2] given to init, B = [1, 2] added (rank 2 in
    both). Each set's collectives and gradients run among its ranks only (roots
    and gathers by job rank); a rank outside a set gets InvalidArgumentError, a
    set never added ValueError, a disagreeing add FailedPreconditionError on
    every rank; a removed set is gone and the job's collectives still work."""
    ranks = three_process_scenarios
    members = {"a": (0, 2), "b": (1, 2)}
    for r in ranks:
        rank = r["rank"]
        assert r["ids"] == [1, 2] and r["sizes"] == [2, 2], r
        assert r["included"] == [int(rank in members["a"]), int(rank in members["b"])], r
        for name, (low, high) in members.items():
            if rank not in (low, high):
                assert f"rank {rank} is not in process set" in r[f"outside_{name}"], r
                continue
            values = [low + 1.0, high + 1.0]  # each rank sends rank + 1
            assert r[f"sum_{name}"] == [sum(values)] * 2, r
            assert r[f"grad_{name}"] == [2.0, 2.0], r  # the set's size, not the job's
            assert r[f"average_{name}"] == [sum(values) / 2] * 2, r
            assert r[f"gather_{name}"] == [low] * (low + 1) + [high] * (high + 1), r
            assert r[f"broadcast_{name}"] == high * 10, r  # root: job rank `high`
            assert r[f"objects_{name}"] == [{"r": low}, {"r": high}], r
        if rank in members["a"]:
            assert r["tape_a"] == [2.0], r  # gradients 1 and 3 averaged over A
        assert "was not added" in r["fake"], r
        assert ("hvd.add_process_set: the ranks disagree on the ranks (rank 0: [0, 1], "
                "rank 1: [1], rank 2: [0, 1])") in r["disagree"], r
        assert r["removed"] == [True, False], r
        assert "was not added" in r["after_remove"], r
        assert r["id_c"] == 3, r
        if rank in (0, 1):
            assert r["sum_c"] == [3.0, 3.0], r
        assert r["sum_job"] == [6.0, 6.0], r


def test_join_lets_ranks_that_ran_out_of_data_add_nothing(three_process_scenarios):
    """hvd.join at 3 processes: rank r runs r + 1 collectives eagerly and joins
    (rank 0 first), then 3 - r steps of a tf.function (rank 2 first). Joined
    ranks add zeros to sums (an Average still divides by 3, as Horovod's),
    no rows to gathers, and pass barriers and receive broadcasts; every rank
    learns the rank that joined last; afterwards the same function pairs up
    again; a broadcast whose root joined stops the job naming it."""
    eager = [[6.0] * 3,                        # 1 + 2 + 3
             [1, 1, 2, 2, 2],                  # ranks 1 and 2 gather; rank 0 adds no rows
             [None, [14], [1.0] * 3]]          # barrier, broadcast from 2, (0 + 0 + 3) / 3
    graph = [[6.0] * 3, [3.0] * 3, [1.0] * 3]  # ranks 0-2, 0-1, then rank 0 alone
    for r in three_process_scenarios:
        rank = r["rank"]
        assert r["eager"] == eager[:rank + 1], r
        assert r["last_eager"] == 2 and r["last_graph"] == 0, r
        assert r["graph"] == graph[:3 - rank], r
        assert r["after"] == [[6.0] * 3] * 2, r
        assert ("rank 0 has joined (hvd.join), so it has nothing to broadcast as the root of "
                "broadcast from rank 0") in r["root_joined"], r


def test_rows_ops_gather_scatter_and_exchange_exactly_and_reject_bad_counts():
    # The local halves of allgather, reducescatter and alltoall on the box's sum
    # (tf_smb.ops.place_rows, take_rows, received_rows), in one process: rank r's
    # placed tensors summed over ranks are every rank's rows in rank order,
    # take_rows gives a rank's rows back, the gradients are each other, each rank
    # receives its blocks of an all-to-all, and counts that do not fit fail clearly.
    code = r'''
import json
import numpy as np
import tensorflow as tf
from tf_smb import ops

counts = np.array([[2, 0], [3, 1], [1, 2]], np.int64)  # [ranks, tensors]
parts = [[np.arange(r * 100, r * 100 + counts[r, 0] * 4, dtype=np.float32).reshape(-1, 2, 2),
          (np.arange(counts[r, 1] * 3) % 2 == r % 2).reshape(-1, 3)] for r in range(3)]
placed = [ops.place_rows([tf.constant(a), tf.constant(b)], counts, r)
          for r, (a, b) in enumerate(parts)]
gathered = [np.concatenate([parts[r][i] for r in range(3)]) for i in range(2)]
out = {"shapes": [list(p.shape) for p in placed[1]],
       "float_exact": bool((sum(p[0].numpy() for p in placed) == gathered[0]).all()),
       "bool_exact": bool((np.logical_or.reduce([p[1].numpy() for p in placed])
                           == gathered[1]).all()),
       "zeros_elsewhere": bool((placed[1][0].numpy()[:2] == 0).all()
                               and (placed[1][0].numpy()[5:] == 0).all()),
       "take_inverts": all(bool((ops.take_rows([g], counts[:, :1], r)[0].numpy()
                                 == parts[r][0]).all()) for r, g in
                           enumerate([gathered[0]] * 3))}
x = tf.constant(parts[1][0])
with tf.GradientTape() as tape:
    tape.watch(x)
    y = ops.place_rows([x], counts[:, :1], 1)[0]
    loss = tf.reduce_sum(y * tf.range(1.0, 7.0)[:, None, None])
out["grad_rows"] = tape.gradient(loss, x).numpy()[:, 0, 0].tolist()

@tf.function
def traced(t):
    return ops.place_rows([t], counts[:, :1], 2)[0]
out["traced_shape"] = traced.get_concrete_function(
    tf.TensorSpec([None, 2, 2], tf.float32)).structured_outputs.shape.as_list()
# An all-to-all of 3 ranks: matrix[r, j] rows from rank r to rank j; rank r's
# rows are r*10 + j for its rows to rank j.
matrix = np.array([[1, 0, 2], [2, 1, 0], [0, 3, 1]], np.int64)
total = np.concatenate([np.repeat([r * 10 + j for j in range(3)], matrix[r])
                        for r in range(3)]).astype(np.int32)[:, None]
out["received"] = [ops.received_rows(total, matrix, j).numpy()[:, 0].tolist()
                   for j in range(3)]
errors = {}
for name, make in {
        "rows": lambda: ops.place_rows([tf.zeros([4, 2])], counts[:, :1], 0),
        "negative": lambda: ops.place_rows([tf.zeros([2])], [[2], [-1]], 0),
        "rank": lambda: ops.place_rows([tf.zeros([2])], counts[:, :1], 3),
        "width": lambda: ops.take_rows([tf.zeros([6])], counts, 0),
        "total": lambda: ops.take_rows([tf.zeros([5])], counts[:, :1], 0),
        "square": lambda: ops.received_rows(total, matrix[:2], 0),
        "sent": lambda: ops.received_rows(total[:8], matrix, 0),
        "string": lambda: ops.place_rows([tf.constant(["a", "b"])], counts[:, :1], 0)}.items():
    try:
        make()
        errors[name] = "no error"
    except tf.errors.InvalidArgumentError as e:
        errors[name] = e.message
out["errors"] = errors
print(json.dumps(out))
'''
    out = json.loads(harness.run_python(code).strip().splitlines()[-1])
    assert out["shapes"] == [[6, 2, 2], [3, 3]]
    assert out["float_exact"] and out["bool_exact"] and out["zeros_elsewhere"]
    assert out["take_inverts"]
    # Rank 1's rows are rows 2..4 of the placed tensor, weighted 3, 4 and 5.
    assert out["grad_rows"] == [3.0, 4.0, 5.0]
    assert out["traced_shape"] == [None, 2, 2]
    assert out["received"] == [[0, 10, 10], [11, 21, 21, 21], [2, 2, 22]]
    errors = out["errors"]
    assert "counted with 2 rows on rank 0, got 4" in errors["rows"], errors["rows"]
    assert "non-negative row counts, got -1 for rank 1" in errors["negative"], errors["negative"]
    assert "expected counts of shape [ranks > 3, 1]" in errors["rank"], errors["rank"]
    assert "expected counts of shape [ranks > 0, 1]" in errors["width"], errors["width"]
    assert "counted with 6 rows over all ranks, got 5" in errors["total"], errors["total"]
    assert "expected a square matrix" in errors["square"], errors["square"]
    assert "summing to the 8 rows sent" in errors["sent"], errors["sent"]
    assert "numeric or bool dtype" in errors["string"], errors["string"]
