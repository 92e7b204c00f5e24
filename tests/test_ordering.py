"""Collectives that TensorFlow may run in a different order on different
workers still pair up correctly (matched by call site, not by arrival), and
Keras features that put several collectives in one step train like one process."""
import os

import pytest

from harness import WORKERS, max_diff, run_ranks, run_single

ORDERING = os.path.join(WORKERS, "ordering_worker.py")
B = 8  # per-worker batch


@pytest.mark.parametrize("world", [2, 3])
def test_independent_collectives_pair_correctly_20_rounds(world):
    # Each round: 30 session.run calls with 16 independent collectives and 30
    # tf.function steps with 9 independent collectives and a 5-iteration while
    # loop holding 2 more; every value is checked exactly.
    results = [r.check().json() for r in
               run_ranks([ORDERING, "stress", "--rounds", "20", "--runs", "30"], world,
                         timeout=600)]
    for r in results:
        assert r["error"] is None, f"rank {r['rank']}: {r['error']}"
        assert len(r["rounds"]) == 20, f"rank {r['rank']}"
        for i, rnd in enumerate(r["rounds"]):
            assert rnd == {"session_bad": 0, "function_bad": 0}, f"rank {r['rank']} round {i}: {rnd}"


def test_stress_catches_pairing_by_arrival():
    # The checks above are sensitive: pairing collectives by arrival order (as
    # tf_smb did before) mixes them up or makes ranks disagree within a round.
    results = [r.json() for r in
               run_ranks([ORDERING, "stress", "--rounds", "1", "--runs", "30"], 2,
                         timeout=300, env={"TF_SMB_TEST_MATCH_BY_ARRIVAL": "1"})]
    assert any(r["error"] or any(sum(rnd.values()) for rnd in r["rounds"])
               for r in results), results




@pytest.mark.parametrize("world", [2, 3])
def test_steps_per_execution_and_gradient_accumulation_equal_one_process(world):
    single = run_single([ORDERING, "keras", "--batch", str(world * B)], timeout=300).check().json()
    workers = [r.check().json() for r in
               run_ranks([ORDERING, "keras", "--batch", str(B)], world, timeout=400)]
    assert single["size"] == 1
    for r in workers:
        assert r["size"] == world
        assert set(r["weights"]) == {"spe1", "spe4", "spe7", "accum2"}
        for name, weights in r["weights"].items():
            diff = max_diff(weights, single["weights"][name])
            assert diff < 1e-5, f"rank {r['rank']} {name}: max |dw| {diff}"
