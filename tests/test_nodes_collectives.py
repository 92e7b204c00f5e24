"""The collectives across two simulated nodes (tests/simnodes.py), 2 workers each:
the job-wide order of independent collectives, every dtype (float16/bfloat16
through tf_smb's own MPI sum), broadcasts from a rank on either node, and ranks
on different nodes that disagree. Keras training across nodes: test_nodes.py."""
import os

import pytest

import simnodes
from harness import WORKERS

ORDERING = os.path.join(WORKERS, "ordering_worker.py")
KERAS = os.path.join(WORKERS, "keras_worker.py")
ENV = {"TF_SMB_TIMEOUT": "120", "TEST_TIMEOUT": "120"}


@pytest.fixture(scope="module")
def nodes():
    made = simnodes.open_or_skip()
    yield made
    made.close()


def test_independent_collectives_pair_correctly_across_nodes(nodes, tmp_path):
    # TensorFlow runs these in any order on each rank; node 0's leader decides
    # one order for the job from what every node has waiting. Every value exact.
    results = simnodes.run_workers(nodes, 2, [ORDERING, "stress", "--rounds", "3",
                                              "--runs", "20"], 900, str(tmp_path), ENV)
    for r in results:
        assert r["error"] is None, f"rank {r['rank']}: {r['error']}"
        assert len(r["rounds"]) == 3, f"rank {r['rank']}"
        for i, rnd in enumerate(r["rounds"]):
            assert rnd == {"session_bad": 0, "function_bad": 0}, f"rank {r['rank']} round {i}: {rnd}"


def test_every_dtype_and_initial_broadcast_across_nodes(nodes, tmp_path):
    results = simnodes.run_workers(nodes, 2, [KERAS, "ops"], 600, str(tmp_path), ENV)
    for r in results:
        assert r["size"] == 4
        assert r["bad"] == [], f"rank {r['rank']}: {r['bad']}"
        # Seeded differently, yet every rank starts from rank 0's weights.
        assert r["weights"] == results[0]["weights"], f"rank {r['rank']}"


def test_ranks_on_different_nodes_disagreeing_get_the_same_error(nodes, tmp_path):
    # Ranks 0, 1 (node 0) call float32[3]; ranks 2, 3 (node 1) float32[4].
    results = simnodes.run_workers(nodes, 2, [KERAS, "mismatch_halves"], 600,
                                   str(tmp_path), ENV)
    # The same verdict on every rank (a rank that learns it from another's
    # failure says "job aborted: " before it).
    verdict = ("ranks disagree on a collective: rank 0 (node 0) called allreduce of 1 "
               "tensors: float32[3]; rank 2 (node 1) called allreduce of 1 tensors: float32[4]")
    for r in results:
        assert r["shape_error"] and verdict in r["shape_error"], f"rank {r['rank']}: {r['shape_error']}"
        # The job then stops: a later call fails at once with that error.
        assert r["later_error"] and "float32[3]" in r["later_error"], r
        assert r["later_seconds"] < 5, r
