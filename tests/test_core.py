"""The box core on its own (no TensorFlow): collectives, segments, lifecycle."""
import os
import signal
import stat
import subprocess
import sys

import pytest

from harness import WORKERS, base_env, run_ranks

CORE = os.path.join(WORKERS, "core_worker.py")


@pytest.mark.parametrize("world", [2, 3])
def test_allreduce_exact_every_dtype_and_size(world):
    # 64 KiB staging: the 1,000,003-element tensors go through in many chunks.
    results = run_ranks([CORE, "allreduce", "--staging", str(64 << 10)], world, timeout=120)
    for r in results:
        assert r.check().json()["bad"] == [], f"rank {r.rank}"


def test_allreduce_staging_cap_smaller_than_tensor_and_odd():
    # A 100-byte cap is not a multiple of 8-byte elements and far below 1 M elements.
    results = run_ranks([CORE, "allreduce", "--staging", "100"], 2, timeout=300)
    for r in results:
        assert r.check().json()["bad"] == [], f"rank {r.rank}"


@pytest.mark.parametrize("world", [2, 3])
def test_broadcast_from_every_root(world):
    for r in run_ranks([CORE, "broadcast", "--staging", str(64 << 10)], world, timeout=120):
        assert r.check().json()["bad"] == [], f"rank {r.rank}"


def test_barrier_waits_for_the_slowest():
    results = [r.check().json() for r in run_ranks([CORE, "barrier"], 3, timeout=60)]
    # Rank 0 arrives ~0.6 s before rank 2 and must wait for it.
    assert results[0]["waited"] > 0.4
    left = [r["left_at"] for r in results]
    assert max(left) - min(left) < 0.3


def test_mismatched_shapes_and_dtypes_fail_on_every_rank_naming_both():
    results = [r.check().json() for r in run_ranks([CORE, "mismatch"], 3, timeout=60)]
    for res in results:
        err = res["error"]
        assert err is not None, f"rank {res['rank']} got no error"
        assert "rank 0" in err and "float32[10]" in err, err
        assert "rank 1" in err and "float32[11]" in err, err
        assert res["after"] == [3.0] * 4


def test_dead_worker_fails_the_others_naming_it():
    results = run_ranks([CORE, "die", "--timeout", "60"], 3, timeout=90)
    assert results[2].returncode == -signal.SIGKILL
    for r in results[:2]:
        res = r.check().json()
        assert res["error"] is not None and "rank 2" in res["error"], res
        assert "died" in res["error"]
        # Found by the liveness check, long before the 60 s timeout.
        assert res["seconds"] < 10, res


def test_timeout_names_missing_rank():
    # Rank 1 never joins: rank 0's barrier must time out naming it.
    env = base_env({"TF_SMB_RANK": "0", "TF_SMB_SIZE": "2",
                    "TF_SMB_JOB_ID": f"lonely-{os.getpid()}"})
    p = subprocess.run([sys.executable, CORE, "barrier", "--timeout", "2"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "timed out" in p.stderr and "rank(s) 1" in p.stderr, p.stderr[-2000:]


def test_segment_table_create_attach_and_mismatch():
    results = [r.check().json() for r in run_ranks([CORE, "segments"], 2, timeout=60)]
    for res in results:
        assert res["values"] == list(range(12))
        assert all(e and "float32[3,4]" in e for e in res["attach_errors"]), res
        assert res["recreate_error"] and "exists as float32[3,4]" in res["recreate_error"]


def _shm_path(name):
    return "/dev/shm/" + name.lstrip("/")


def test_box_is_private_bounded_and_removed_after_clean_end():
    from tf_smb import _box
    job = f"private-{os.getpid()}"
    # 8 workers, 1 MiB staging, 1 MiB heap: the box is ~2*8*1 MiB + 2 MiB
    # whatever the size of the tensors later reduced through it.
    box = _box.create_box(job, 8, staging_bytes=1 << 20, heap_bytes=1 << 20)
    path = _shm_path(box.name)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.stat(path).st_size <= (2 * 8 + 1) * (1 << 20) + (4 << 20)
    box.close()
    assert not os.path.exists(path)


def test_two_jobs_at_once_do_not_interfere():
    procs = []
    for job in ("jobA", "jobB"):
        for rank in range(2):
            env = base_env({"TF_SMB_RANK": str(rank), "TF_SMB_SIZE": "2",
                            "TF_SMB_JOB_ID": f"{job}-{os.getpid()}"})
            procs.append(subprocess.Popen(
                [sys.executable, CORE, "allreduce", "--staging", str(32 << 10)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        for i, p in enumerate(procs):
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, f"process {i}: {err[-2000:]}"
            assert '"bad": []' in out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_sigkilled_job_leaves_nothing_that_breaks_the_next():
    from tf_smb import _box
    job = f"killed-{os.getpid()}"
    procs = []
    for rank in range(2):
        env = base_env({"TF_SMB_RANK": str(rank), "TF_SMB_SIZE": "2", "TF_SMB_JOB_ID": job})
        procs.append(subprocess.Popen([sys.executable, CORE, "hold"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    try:
        shm = procs[0].stdout.readline()
        assert '"shm"' in shm, procs[0].stderr.read()
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
    path = _shm_path(_box.shm_name(job))
    assert os.path.exists(path), "the killed job should have left its box behind"
    # The same job id works again: the next job reclaims the dead one's box.
    for r in run_ranks([CORE, "barrier"], 2, timeout=60,
                       env={"TF_SMB_JOB_ID": job}):
        r.check()
    assert not os.path.exists(path)
    # And reclaim_stale finds nothing of ours left over.
    assert _box.reclaim_stale() == 0


# ---- Asynchronous mode: parameters in the box -------------------------------

def test_concurrent_pushes_are_never_lost():
    results = [r.check().json() for r in run_ranks([CORE, "push"], 3, timeout=300)]
    for res in results:
        assert res["values"] == {"float32": [6000.0], "float64": [6000.0],
                                 "int32": [6000], "int64": [6000]}, res
        assert res["axpy"] == [3000.0]
        assert res["big"] == [180.0]  # 3 ranks x 40 pushes x (1 + 0.5), over 34 stripes
        assert "float32[257]" in res["errors"][0] and "float32[256]" in res["errors"][0]
        assert "float64[257]" in res["errors"][1]


def test_consistent_reads_are_never_torn():
    results = [r.check().json() for r in run_ranks([CORE, "torn"], 3, timeout=300)]
    assert results[0]["writes"] > 100
    for res in results[1:]:
        assert res["torn"] == 0
        assert res["seen_1"] + res["seen_2"] == 10_000 * 3  # stripes of every read
        assert res["seen_1"] > 0 and res["seen_2"] > 0  # both patterns were read


@pytest.mark.parametrize("staleness", [0, 2])
def test_staleness_bound_holds(staleness):
    results = [r.check().json() for r in run_ranks(
        [CORE, "staleness"], 2, timeout=120, env={"STALENESS": str(staleness)})]
    for res in results:
        assert res["max_gap"] <= staleness, res
    # The fast rank is held back to the slow one's pace.
    assert results[0]["steps"] <= results[1]["steps"] + staleness + 1


def test_no_staleness_bound_lets_the_fast_worker_run_ahead():
    results = [r.check().json() for r in run_ranks(
        [CORE, "staleness"], 2, timeout=120, env={"STALENESS": "-1"})]
    assert results[0]["steps"] > 3 * results[1]["steps"], results
