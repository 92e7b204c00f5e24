"""Elastic training's core: a process leaves the job it joined and joins
another, in the same process (tf_smb.ops.rejoin), when the job's members change:
survivors go on smaller, a new process joins them, and the collectives a
tf.function traced before keep working in the new job."""
import os

import pytest

from harness import WORKERS, run_ranks

REJOIN = os.path.join(WORKERS, "rejoin_worker.py")


def test_survivors_rejoin_a_smaller_job_then_a_new_process_joins_them():
    # Ranks 0-2 sum (1+2+3); rank 2 leaves; 0 and 1 fail their next collective,
    # rejoin as a 2-worker job (1+2), then with a new process (rank 3 of the
    # launch, ROLE=joiner) as a 3-worker job (1+2+3).
    per_rank = [{"TF_SMB_SIZE": "3"}] * 3 + [{"ROLE": "joiner"}]
    results = [r.check().json() for r in run_ranks([REJOIN], 4, timeout=300,
                                                   env={"TF_SMB_TIMEOUT": "90"},
                                                   per_rank_env=per_rank)]
    by_start = {r["start_rank"]: r for r in results}
    for rank in (0, 1):
        r = by_start[rank]
        assert r["g0"] == 6.0 and r["g1"] == 3.0 and r["g2"] == 6.0, (rank, r)
        assert "left the job" in r["after_leave"], (rank, r["after_leave"])
        assert (r["rank"], r["size"]) == (rank, 3), r
    assert "left the job for its next generation" in by_start[1]["after_rejoin"], by_start[1]
    assert by_start[2] == {"start_rank": 2, "g0": 6.0}
    assert by_start[3]["g2"] == 6.0 and by_start[3]["rank"] == 2, by_start[3]


def test_hosts_parse_as_discovery_scripts_print_them():
    from tf_smb.elastic import driver
    assert driver.parse_hosts(["localhost:2", "127.0.0.1:2", ""]) == {
        "localhost": 2, "127.0.0.1": 2}
    assert driver.parse_hosts(["a:1,b", "a:2"]) == {"a": 3, "b": 1}
    for bad in ("a:0", ":2", "a:x"):
        with pytest.raises(ValueError, match="expected host:slots"):
            driver.parse_hosts([bad])
    assert driver.is_this_machine("localhost") and driver.is_this_machine("127.0.0.1")
    assert not driver.is_this_machine("node-that-is-not-here.example")


def test_a_new_generation_keeps_rank_0_on_a_host_that_trained(monkeypatch):
    # A discovery script that lists an added host first must not give the new
    # worker rank 0: the next generation starts from rank 0's state.
    import shutil
    from tf_smb.elastic import driver as driver_lib
    from tf_smb.elastic.nodes_driver import NodesDriver
    assert driver_lib.assignment_order([], ["b", "a"]) == ["b", "a"]
    assert driver_lib.assignment_order(["a", "b"], ["c", "b", "a"]) == ["a", "b", "c"]
    assert driver_lib.assignment_order(["a", "b"], ["c", "b"]) == ["b", "c"]  # a left

    class _Fake:  # a started worker's processes: never ending
        def returncode(self, _index):
            return None

        def close(self):
            pass

    options = driver_lib.Options(command=["train"], np=2, min_np=1, max_np=4, hosts="x",
                                 staging_bytes=1 << 16)
    driver = driver_lib.Driver(options, log=lambda _: None, interrupted=lambda: None)
    monkeypatch.setattr(driver, "_start_worker", lambda wid, host, slot, rank, size, job: (
        driver_lib._Worker(wid, host, slot, rank, _Fake())))  # pylint: disable=protected-access
    try:
        driver._publish([], {"localhost": 2})  # pylint: disable=protected-access
        first = driver._members  # pylint: disable=protected-access
        # localhost's slot 0 left (its worker removed); a host is added, listed first.
        driver._publish([first[1]], {"127.0.0.1": 1, "localhost": 2})
        members = driver._members  # pylint: disable=protected-access
        assert [(w.host, w.slot, w.id) for w in members] == [
            ("localhost", 1, first[1].id), ("localhost", 0, 2), ("127.0.0.1", 0, 3)]
    finally:
        driver._stop_all()  # pylint: disable=protected-access
    nodes = NodesDriver(driver_lib.Options(command=["train"], np=2, min_np=1, max_np=3,
                                           hosts="a:1"), log=lambda _: None,
                        interrupted=lambda: None)
    try:
        assert nodes._place({"a": 2}) == ["a", "a"]  # pylint: disable=protected-access
        assert nodes._place({"c": 1, "a": 2}) == ["a", "a", "c"]
        assert nodes._place({"c": 2, "b": 1}) == ["c", "c", "b"]  # a gone: discovery order
    finally:
        shutil.rmtree(nodes._dir, ignore_errors=True)  # pylint: disable=protected-access


def test_members_failing_one_after_another_end_the_job_at_once(tmp_path):
    # Worker 1 fails at once, the others 3 s later: while the launcher waits for
    # --min-np slots without worker 1's host, the rest fail too and no host is left.
    # The job ends saying so, not after --elastic-timeout (300 s; harness: 120 s).
    import sys
    import harness
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\necho localhost:2\necho 127.0.0.1:1\n")
    discover.chmod(0o700)
    argv = [sys.executable, "-m", "tf_smb.run", "-np", "3", "--min-np", "2", "--max-np", "3",
            "--elastic-timeout", "300", "--host-discovery-script", str(discover), "sh", "-c",
            'if [ "$TF_SMB_WORKER_ID" = 1 ]; then exit 1; fi; sleep 3; exit 1']
    r = harness.run_command(argv, 120, harness.base_env())
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "no host is left to go on with" in out, out
    for worker in ("worker 1 (localhost)", "worker 2 (127.0.0.1)"):
        assert f"{worker} exited with code 1" in out, out


def test_a_blacklisted_host_comes_back_after_a_cooldown_that_doubles():
    from tf_smb.elastic import driver
    now = [0.0]
    forever = driver.Blacklist(None, clock=lambda: now[0])
    forever.add("a")
    now[0] = 1e9
    assert not forever.allows("a") and forever.allows("b")
    cooled = driver.Blacklist((1.0, 10.0), clock=lambda: now[0])
    now[0] = 0.0
    cooled.add("a")
    now[0] = 0.9
    assert not cooled.allows("a")
    now[0] = 1.3  # 1 s, drawn up to 1.25x
    assert cooled.allows("a")
    cooled.add("a")  # second failure: 2 s
    now[0] = 1.3 + 1.9
    assert not cooled.allows("a")
    now[0] = 1.3 + 2.6
    assert cooled.allows("a")


def test_generations_and_host_updates_round_trip_in_a_private_directory(tmp_path):
    from tf_smb.elastic import protocol
    from tf_smb.elastic.worker import ElasticWorker, WorkerRemoved
    directory = protocol.make_private_dir(str(tmp_path / "elastic"))
    assert os.stat(directory).st_mode & 0o777 == 0o700
    protocol.write_generation(directory, protocol.Generation(1, "job-g1", [5, 3]))
    assert os.stat(os.path.join(directory, protocol.GENERATION_FILE)).st_mode & 0o777 == 0o600
    worker = ElasticWorker(directory, worker_id=3, generation=0)
    generation = worker.next_generation(timeout_s=1)
    job = worker.job_in(generation)
    assert (job.rank, job.size, job.job_id, job.box_created) == (1, 2, "job-g1", True)
    with pytest.raises(WorkerRemoved):
        ElasticWorker(directory, worker_id=4, generation=0).next_generation(timeout_s=1)
    with pytest.raises(TimeoutError, match="no generation after 1"):
        ElasticWorker(directory, worker_id=3, generation=1).next_generation(timeout_s=0.2)
    protocol.write_host_update(directory, protocol.HostUpdate(2, added=True, removed=False))
    assert worker.latest_host_update() == protocol.HostUpdate(2, True, False)
    protocol.mark_joined(directory, 1, 3)
    protocol.mark_joined(directory, 1, 5)
    protocol.mark_joined(directory, 2, 3)
    assert protocol.joined(directory, 1) == {3, 5}


def test_elastic_keras_fit_refuses_what_it_does_not_support(monkeypatch, tmp_path):
    from tf_smb.elastic import protocol
    from tf_smb.keras_support.elastic import elastic_worker
    assert elastic_worker(False, "async", 4) is None  # not asked: nothing checked
    for name, value in ((protocol.DIR_VAR, str(tmp_path)), (protocol.WORKER_ID_VAR, "0"),
                        (protocol.ACROSS_NODES_VAR, "job")):
        monkeypatch.setenv(name, value)
    assert elastic_worker(True, "async", 1).across_nodes == "job"  # every mode, anywhere
    for name in (protocol.DIR_VAR, protocol.WORKER_ID_VAR, protocol.ACROSS_NODES_VAR):
        monkeypatch.delenv(name)
    with pytest.raises(ValueError, match="needs local_replicas=1, got 2"):
        elastic_worker(True, "sync", 2)
    with pytest.raises(ValueError, match="commit_steps must be an integer >= 1, got 0"):
        elastic_worker(True, "sync", 1, commit_steps=0)
    assert elastic_worker(True, "sync", 1) is None  # no elastic launcher: members are fixed
