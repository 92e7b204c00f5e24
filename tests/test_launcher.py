"""Tests of the job launcher ``python -m tf_smb.run`` with tiny Python workers."""
from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import time
from typing import List

import pytest

from tf_smb import _box, run, supervisor

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def launch(args: List[str], timeout: float = 30.0) -> subprocess.CompletedProcess:
    """Runs the launcher with ``args`` from the repository root."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "tf_smb.run", *args], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def worker(code: str) -> List[str]:
    """A worker command running the Python ``code``."""
    return [sys.executable, "-c", textwrap.dedent(code)]


def _zombie(pid: int) -> bool:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].startswith("Z")


def wait_gone(pid: int, grace_s: float = 2.0) -> None:
    """Asserts the process ``pid`` no longer exists, allowing a short grace."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        if _zombie(pid):  # an orphan that the container's init may never reap
            return
        if time.monotonic() > deadline:
            pytest.fail(f"process {pid} outlived the launcher")
        time.sleep(0.05)


def test_workers_get_rank_size_and_job_id() -> None:
    result = launch(["-np", "2", "--", *worker("""
        import os
        print("rank", os.environ["TF_SMB_RANK"], "size", os.environ["TF_SMB_SIZE"],
              "job", os.environ["TF_SMB_JOB_ID"], "created", os.environ["TF_SMB_BOX_CREATED"])
    """)])
    assert result.returncode == 0, result.stderr
    found = re.findall(r"^\[(\d)\]: rank (\d) size (\d) job (\S+) created 1$",
                       result.stdout, re.MULTILINE)
    assert sorted((prefix, rank, size) for prefix, rank, size, _ in found) == [
        ("0", "0", "2"), ("1", "1", "2")]
    job_ids = {job for *_, job in found}
    assert len(job_ids) == 1 and job_ids.pop().startswith("run-")


def test_timeout_is_passed_to_workers() -> None:
    result = launch(["-np", "1", "--timeout", "7.5", *worker("""
        import os
        print("timeout", os.environ["TF_SMB_TIMEOUT"])
    """)])
    assert result.returncode == 0, result.stderr
    assert "[0]: timeout 7.5" in result.stdout


def test_box_exists_while_workers_run_and_is_removed_after() -> None:
    result = launch(["-np", "2", *worker("""
        import os
        from tf_smb import _box
        path = "/dev/shm/" + _box.shm_name(os.environ["TF_SMB_JOB_ID"])[1:]
        print("box", path, oct(os.stat(path).st_mode & 0o777))
    """)])
    assert result.returncode == 0, result.stdout + result.stderr
    found = re.findall(r"^\[\d\]: box (\S+) (0o\d+)$", result.stdout, re.MULTILINE)
    assert len(found) == 2
    assert {mode for _, mode in found} == {"0o600"}
    (path,) = {p for p, _ in found}
    assert not os.path.exists(path)


def test_failing_worker_stops_the_others(tmp_path: pathlib.Path) -> None:
    pid_file = tmp_path / "rank0.pid"
    start = time.monotonic()
    result = launch(["-np", "2", *worker(f"""
        import os, sys, time
        if os.environ["TF_SMB_RANK"] == "1":
            while not os.path.exists({str(pid_file)!r}):
                time.sleep(0.02)
            print("boom-message", file=sys.stderr)
            sys.exit(3)
        with open({str(pid_file) + ".tmp"!r}, "w") as f:
            f.write(str(os.getpid()))
        os.rename({str(pid_file) + ".tmp"!r}, {str(pid_file)!r})
        time.sleep(60)
    """)], timeout=30)
    assert time.monotonic() - start < 15
    assert result.returncode == 3
    assert "rank 1 exited with code 3" in result.stderr
    assert "boom-message" in result.stderr
    assert "rank 0 " not in result.stderr  # only the cause is named
    wait_gone(int(pid_file.read_text()))


def test_worker_killed_by_signal_is_reported() -> None:
    result = launch(["-np", "2", *worker("""
        import os, time
        if os.environ["TF_SMB_RANK"] == "0":
            print("about to die", flush=True)
            os.kill(os.getpid(), 9)
        time.sleep(60)
    """)], timeout=30)
    assert result.returncode != 0
    assert "rank 0 was killed by signal SIGKILL" in result.stderr
    assert "about to die" in result.stderr


def test_keep_going_lets_the_others_finish() -> None:
    result = launch(["--keep-going", "-np", "3", *worker("""
        import os, sys, time
        rank = os.environ["TF_SMB_RANK"]
        if rank == "2":
            os.kill(os.getpid(), 9)
        time.sleep(1.0)
        print("finished", rank, flush=True)
    """)], timeout=30)
    assert result.returncode == 1
    assert "rank 2 was killed by signal SIGKILL" in result.stderr
    assert "[0]: finished 0" in result.stdout and "[1]: finished 1" in result.stdout


def test_sigterm_to_launcher_stops_workers(tmp_path: pathlib.Path) -> None:
    pid_file = tmp_path / "pids"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tf_smb.run", "-np", "2", *worker(f"""
            import os, time
            with open({str(pid_file)!r}, "a") as f:
                f.write(str(os.getpid()) + "\\n")
            time.sleep(60)
        """)], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while not (pid_file.exists() and len(pid_file.read_text().split()) == 2):
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.05)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=15) == 128 + signal.SIGTERM
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=5)
        launcher.stdout.close()
        launcher.stderr.close()
    for pid in pid_file.read_text().split():
        wait_gone(int(pid))


@pytest.mark.parametrize("args, message", [
    (["-np", "0", "true"], "-np must be at least 1"),
    (["-np", "2"], "missing COMMAND"),
    (["-np", "2", "--"], "missing COMMAND"),
])
def test_bad_usage(args: List[str], message: str) -> None:
    result = launch(args)
    assert result.returncode != 0
    assert message in result.stderr


def test_missing_executable() -> None:
    result = launch(["-np", "1", "/nonexistent/tf_smb_no_such_program"])
    assert result.returncode != 0
    assert "cannot start" in result.stderr


def test_defaults_are_the_cores() -> None:
    args = run._parse_args(["-np", "1", "true"])
    assert (args.staging_bytes, args.heap_bytes, args.timeout) == (
        _box.DEFAULT_STAGING_BYTES, _box.DEFAULT_HEAP_BYTES, None)
    help_text = launch(["--help"]).stdout
    assert f"{_box.DEFAULT_TIMEOUT_S:g} s" in help_text
    assert run._size(_box.DEFAULT_STAGING_BYTES) in help_text
    assert run._size(_box.DEFAULT_HEAP_BYTES) in help_text
    assert run._size(1 << 20) == "1 MiB" and run._size(4 << 30) == "4 GiB"


def test_workers_do_not_inherit_other_launchers_variables() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMPI_COMM_WORLD_RANK="5",
               OMPI_COMM_WORLD_SIZE="9", HOROVOD_RANK="5", HOROVOD_SIZE="9")
    result = subprocess.run([sys.executable, "-m", "tf_smb.run", "-np", "2", *worker("""
        import os
        from tf_smb import env
        job = env.detect()
        print("job", job.launcher, job.rank, job.size,
              [k for k in os.environ if k.startswith(("OMPI_COMM", "HOROVOD_"))])
    """)], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "[0]: job tf 0 2 []" in result.stdout and "[1]: job tf 1 2 []" in result.stdout


def test_processes_a_worker_leaves_are_stopped(tmp_path: pathlib.Path) -> None:
    # Rank 0 starts a helper in a session of its own; rank 1 fails: the launcher stops
    # rank 0 and what it started (launchers such as mpirun do this to their workers).
    pid_file = tmp_path / "helper.pid"
    result = launch(["-np", "2", *worker(f"""
        import os, subprocess, sys, time
        if os.environ["TF_SMB_RANK"] == "1":
            while not os.path.exists({str(pid_file)!r}):
                time.sleep(0.02)
            sys.exit(3)
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                  start_new_session=True)
        with open({str(pid_file) + ".tmp"!r}, "w") as f:
            f.write(str(helper.pid))
        os.rename({str(pid_file) + ".tmp"!r}, {str(pid_file)!r})
        time.sleep(60)
    """)], timeout=30)
    assert result.returncode == 3, result.stderr
    wait_gone(int(pid_file.read_text()))


def test_a_finished_workers_process_group_is_stopped(tmp_path: pathlib.Path) -> None:
    pid_file = tmp_path / "helper.pid"
    result = launch(["-np", "1", *worker(f"""
        import subprocess, sys
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        with open({str(pid_file)!r}, "w") as f:
            f.write(str(helper.pid))
    """)], timeout=30)
    assert result.returncode == 0, result.stderr
    wait_gone(int(pid_file.read_text()))


def test_supervisor_timeout_and_output() -> None:
    env = supervisor.worker_env(rank=0, size=1, job_id="j")
    commands = [(worker("""
        import os, sys, time
        print("out", os.environ["TF_SMB_RANK"], os.environ["TF_CPP_MIN_LOG_LEVEL"])
        print("err", file=sys.stderr, flush=True)
        time.sleep(60)
    """), env)]
    start = time.monotonic()
    with supervisor.Workers(commands, output="split", grace_s=1.0) as workers:
        outcome = workers.wait(timeout_s=3.0)
    assert time.monotonic() - start < 15
    assert not outcome.ok and outcome.running == [0] and outcome.returncodes[0] == -15
    assert outcome.reason == "timed out after 3 s"
    assert workers.output(0) == "out 0 2\n" and workers.stderr(0) == "err\n"


AFFINITY_WORKER = """
    import os, threading
    seen = []
    thread = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))
    thread.start(); thread.join()
    print("cpus", os.environ["TF_SMB_RANK"], sorted(os.sched_getaffinity(0)), seen[0])
"""


def _worker_cpus(stdout: str) -> dict:
    """rank -> (the worker's CPUs, a thread's CPUs), from AFFINITY_WORKER's lines."""
    found = re.findall(r"^\[\d+\]: cpus (\d+) (\[[\d, ]*\]) (\[[\d, ]*\])$", stdout, re.MULTILINE)
    return {int(rank): (json.loads(main), json.loads(thread)) for rank, main, thread in found}


def test_workers_are_bound_to_their_own_cpus_by_default() -> None:
    available = sorted(os.sched_getaffinity(0))
    world = min(2, len(available))
    result = launch(["-np", str(world), *worker(AFFINITY_WORKER)])
    assert result.returncode == 0, result.stderr
    cpus = _worker_cpus(result.stdout)
    assert sorted(cpus) == list(range(world)), result.stdout
    blocks = [cpus[r][0] for r in range(world)]
    for rank, (main, thread) in cpus.items():
        assert main and main == thread, (rank, main, thread)  # threads inherit it
    # Disjoint blocks that together cover every CPU the launcher may use.
    assert sorted(c for block in blocks for c in block) == available, blocks
    assert supervisor.split_cpus(world) == [set(b) for b in blocks]


def test_bind_to_none_and_more_workers_than_cpus_leave_every_cpu() -> None:
    available = sorted(os.sched_getaffinity(0))
    for args in (["--bind-to", "none", "-np", "2"], ["-np", str(len(available) + 1)]):
        result = launch([*args, *worker(AFFINITY_WORKER)], timeout=60.0)
        assert result.returncode == 0, result.stderr
        cpus = _worker_cpus(result.stdout)
        assert cpus and all(main == thread == available for main, thread in cpus.values()), (
            args, result.stdout)


def test_split_cpus_gives_even_contiguous_blocks() -> None:
    assert supervisor.split_cpus(2, [0, 1, 2, 3, 4]) == [{0, 1, 2}, {3, 4}]
    assert supervisor.split_cpus(3, [4, 6, 8]) == [{4}, {6}, {8}]
    assert supervisor.split_cpus(1, [0, 1]) == [{0, 1}]
    assert supervisor.split_cpus(3, [0, 1]) == [None, None, None]
