"""Horovod 0.28.1's three elastic examples (examples/elastic/tensorflow2/, from
../shared/peer, unmodified) on tf_smb.horovod under tf_smb's elastic launcher,
with only the changes tools/run_horovod_example.py prints (the import line, and
what Keras 3 rejects: `experimental_run_tf_function`, a `.h5` ModelCheckpoint
path, `set_value(optimizer.lr, ...)`, `opt.lr`; local digits for MNIST), at 2
processes on one machine: once training runs, the rank-0 worker is killed
(SIGKILL), the survivor goes on alone, then a third host is discovered and its
new worker joins; the job ends well, having trained.

The same across three simulated nodes (tests/simnodes.py), one slot each, each
generation one mpirun (docs/elastic.md, "Across nodes"): node 0's worker (rank 0)
is killed, node 1's goes on alone from its node's commit, then node 2 is
discovered and joins.
"""
from __future__ import annotations

import os
import platform
import re
import signal
import subprocess
import sys
import time

import pytest

import harness
import simnodes
from test_elastic_nodes import _mpi_args

sys.path.insert(0, os.path.join(harness.REPO, "tools"))
import run_horovod_example as examples  # noqa: E402  pylint: disable=wrong-import-position

if not os.path.isdir(examples.ELASTIC_EXAMPLES):
    pytest.skip(f"Horovod's elastic examples are not at {examples.ELASTIC_EXAMPLES}: they "
                "come from ../shared/peer (TF_SMB_PEER_DIR)", allow_module_level=True)

TIMEOUT_S = 420.0  # one job; a stuck one fails, printing its output
# The synthetic benchmark's flags, small for a 2-core machine (MobileNetV3Small, not
# ResNet50), long enough to be killed mid-run and joined.
SYNTHETIC_ARGS = ["--model", "MobileNetV3Small", "--batch-size", "4",
                  "--num-warmup-batches", "2", "--num-batches-per-iter", "5",
                  "--num-iters", "12"]
# Each example: its flags, and a line rank 0 prints once training (not start-up)
# runs: the rank-0 worker is killed then.
EXAMPLES = {
    "tensorflow2_keras_mnist_elastic.py": ([], r"Epoch 1/\d+\n.*\d+/\d+"),
    "tensorflow2_mnist_elastic.py": ([], r"Step #10\t"),
    "tensorflow2_synthetic_benchmark_elastic.py": (SYNTHETIC_ARGS, r"Iter #1:"),
}


def _wait_for(pattern: str, output: str, job: subprocess.Popen, deadline: float) -> str:
    """The job's output once `pattern` is in it (fails at the deadline or job end)."""
    while True:
        with open(output, errors="replace") as f:
            text = f.read()
        if re.search(pattern, text):
            return text
        if job.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no {pattern!r} in the job's output (exit status "
                                 f"{job.poll()}):\n{text[-6000:]}")
        time.sleep(0.2)


def _worker_pid(launcher_pid: int, worker_id: int) -> int:
    """The pid of the launcher's worker `worker_id` (TF_SMB_WORKER_ID in its environment)."""
    with open(f"/proc/{launcher_pid}/task/{launcher_pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    pid = harness.pid_with_env(children, "TF_SMB_WORKER_ID", str(worker_id))
    if pid is None:
        raise AssertionError(f"worker {worker_id} is not among the launcher's children "
                             f"{children}")
    return pid


def _check_trained(example: str, text: str, after_join: str) -> None:
    """What the job's rank 0 printed shows the example trained (or benchmarked),
    also at 2 workers after the join (`after_join`)."""
    if example == "tensorflow2_keras_mnist_elastic.py":
        accuracies = [float(a) for a in re.findall(r"accuracy: ([0-9.]+)", after_join)]
        assert accuracies and accuracies[-1] > 0.5, f"accuracy {accuracies}:\n{text[-3000:]}"
    elif example == "tensorflow2_mnist_elastic.py":
        losses = [float(x) for x in re.findall(r"Step #\d+\tLoss: ([0-9.]+)", text)]
        assert len(losses) >= 5 and losses[-1] < losses[0] / 2, f"losses {losses}"
        assert re.search(r"Step #\d+\tLoss", after_join), after_join[-3000:]
    else:
        assert re.search(r"Total img/sec on 2 GPU\(s\): [0-9.]+", after_join), text[-3000:]


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_elastic_example_survives_a_killed_worker_and_grows_with_an_added_host(
        example, tmp_path):
    args, training = EXAMPLES[example]
    copy = examples.prepare(example, str(tmp_path), short=True)
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o700)
    output = str(tmp_path / "output.txt")
    # Plain interpreters (not the tests' preload server): SIGKILL reaches the worker.
    argv = [sys.executable, "-m", "tf_smb.run", "-np", "2", "--min-np", "1", "--max-np", "2",
            "--host-discovery-script", str(discover), sys.executable, copy, *args]
    env = harness.base_env({"TF_SMB_TIMEOUT": "120", "TF_CPP_MIN_LOG_LEVEL": "3"})
    deadline = time.monotonic() + TIMEOUT_S
    with open(output, "w") as out:
        job = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                               cwd=str(tmp_path), start_new_session=True)
    try:
        _wait_for(training, output, job, deadline)
        os.kill(_worker_pid(job.pid, 0), signal.SIGKILL)  # rank 0 of generation 0
        _wait_for(r"generation 1: 1 workers \(1@127\.0\.0\.1\)", output, job, deadline)
        with open(hosts, "a") as f:
            f.write(f"{platform.node()}:1\n")
        _wait_for(r"generation 2: 2 workers", output, job, deadline)
        job.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    with open(output, errors="replace") as f:
        text = f.read()
    assert job.returncode == 0, f"{example}: exit status {job.returncode}:\n{text[-8000:]}"
    assert "worker 0 (localhost) was killed by signal SIGKILL" in text, text[-8000:]
    _check_trained(example, text, text[text.index("generation 2: 2 workers"):])


def _wait_for_output(pattern: str, running: "simnodes.Running", deadline: float) -> str:
    """A job's output in the nodes once `pattern` is in it (fails at the deadline or its end)."""
    while True:
        text = running.output()
        if re.search(pattern, text):
            return text
        if running.proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no {pattern!r} in the job's output (exit status "
                                 f"{running.proc.poll()}):\n{text[-6000:]}")
        time.sleep(0.2)


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_elastic_example_across_nodes_survives_a_killed_worker_and_grows(example, tmp_path):
    args, training = EXAMPLES[example]
    if example == "tensorflow2_keras_mnist_elastic.py":
        # Under mpirun Keras' progress bar (carriage returns) comes out by whole
        # epochs: kill once the second starts.
        training = r"Epoch 2/\d+"
    copy = examples.prepare(example, str(tmp_path), short=True)
    nodes = simnodes.open_or_skip(nodes=3, workers=1)
    try:
        first, second, third = nodes.hostnames
        hosts = tmp_path / "hosts.txt"
        hosts.write_text(f"{first}:1\n{second}:1\n")
        discover = tmp_path / "discover.sh"
        discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
        discover.chmod(0o700)
        argv = [sys.executable, "-m", "tf_smb.run", "-np", "2", "--min-np", "1",
                "--max-np", "2", "--host-discovery-script", str(discover),
                "--mpi-args", _mpi_args(nodes), sys.executable, copy, *args]
        env = {k: v for k, v in harness.base_env().items()
               if not k.startswith("TF_SMB_") and k not in harness.env_lib.LAUNCHER_VARS}
        env.update({"TF_SMB_TIMEOUT": "120", "TF_CPP_MIN_LOG_LEVEL": "3"})
        deadline = time.monotonic() + TIMEOUT_S
        # One stream: the launcher's lines (stderr) between the workers' (stdout).
        job = nodes.start(0, ["sh", "-c", 'exec "$@" 2>&1', "sh", *argv], env,
                          cwd=str(tmp_path), owns_nodes=True, drain=True)
        try:
            _wait_for_output(training, job, deadline)
            # Rank 0 of generation 0: the process its wrapper started as worker 0.
            pid = harness.pid_with_env([p for p, _ in nodes.processes()],
                                       "TF_SMB_WORKER_ID", "0")
            assert pid is not None, "no worker 0 in the nodes"
            os.kill(pid, signal.SIGKILL)
            _wait_for_output(rf"generation 1: 1 workers \({second}\)", job, deadline)
            with open(hosts, "a") as f:
                f.write(f"{third}:1\n")
            _wait_for_output(rf"generation 2: 2 workers \({second}, {third}\)", job, deadline)
            launch = job.wait(max(1.0, deadline - time.monotonic()))
        finally:
            if job.proc.poll() is None:
                job.kill()
    finally:
        nodes.close()
    text = launch.stdout + launch.stderr
    assert launch.returncode == 0, f"{example}: exit status {launch.returncode}:\n{text[-8000:]}"
    assert f"worker rank 0 on host {first} failed (SIGKILL)" in text, text[-8000:]
    _check_trained(example, text, text[text.index("generation 2: 2 workers"):])
