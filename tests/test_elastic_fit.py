"""Keras `fit` with SMBStrategy(elastic=True) through member changes, unchanged
(tests/workers/elastic_fit_worker.py): 4 workers on two hosts of 2 slots; one is
killed mid-epoch (its host is blacklisted: 4 -> 2, back to the last commit), then
discovery adds a host (2 -> 3, at a commit). The weights equal those of one
process on the same global batches, and fit's history has every epoch.
"""
import json
import os
import platform
import sys

import numpy as np

import harness

WORKER = os.path.join(harness.WORKERS, "elastic_fit_worker.py")
TIMEOUT_S = 300.0


def _weights(path):
    with np.load(path) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


def _elastic_job(tmp_path, np_, slots, add_when, env):
    """Runs WORKER as an elastic job of `np_` workers on this machine's hosts
    localhost and 127.0.0.1 (`slots` each), --min-np 2, --max-np `np_`. Once
    `add_when` (an awk condition on the progress lines "epoch size") holds, the
    discovery script adds a third host, this machine's own name, with a slot, and
    lists it first: its new worker must not be rank 0 (whose state the next
    generation starts from). Returns (the launcher's result, its output, the
    progress lines as (epoch, size), the JSON summary of the last rank 0)."""
    progress = tmp_path / "progress"
    discover = tmp_path / "discover.sh"
    discover.write_text(
        f"#!/bin/sh\nawk '{add_when}' {progress} 2>/dev/null | grep -q . && "
        f"echo {platform.node()}:1\necho localhost:{slots[0]}\necho 127.0.0.1:{slots[1]}\n"
        "exit 0\n")
    discover.chmod(0o700)
    argv = [sys.executable, "-m", "tf_smb.run", "-np", str(np_), "--min-np", "2",
            "--max-np", str(np_), "--host-discovery-script", str(discover),
            *harness.python(), WORKER]
    r = harness.run_command(argv, TIMEOUT_S, harness.base_env(
        {"PROGRESS": str(progress), "TF_SMB_TIMEOUT": "60", **env}))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-8000:]
    ended = [tuple(int(v) for v in line.split()) for line in progress.read_text().splitlines()]
    summary = json.loads([line for line in r.stdout.splitlines() if '"epochs"' in line][-1]
                         .split("]: ", 1)[-1])
    return r, out, ended, summary


def test_fit_through_a_lost_and_an_added_worker_equals_one_process(tmp_path):
    one = harness.run_single([WORKER], TIMEOUT_S, env={"OUT": str(tmp_path / "one.npz")})
    one.check()
    # Worker 3 (127.0.0.1's second slot) dies at epoch 1, batch 6: two batches after
    # the commit at batch 4; a host is added after epoch 2.
    _, out, ended, summary = _elastic_job(tmp_path, 4, (2, 2), "$1 >= 2", {
        "OUT": str(tmp_path / "elastic.npz"), "KILL_WORKER": "3:1:6"})
    assert "worker 3 (127.0.0.1) was killed by signal SIGKILL" in out, out[-8000:]
    assert "generation 1: 2 workers" in out and "generation 2: 3 workers" in out, out[-8000:]
    sizes = [size for _, size in ended]
    assert sizes[0] == 4 and 2 in sizes and sizes[-1] == 3, ended
    # Each epoch ended once: no generation started over from a new worker's state
    # (equal weights alone would not tell: a restart from the seeded start ends alike).
    assert [epoch for epoch, _ in ended] == list(range(6)), ended
    assert summary["epochs"] == list(range(6)) and summary["size"] == 3, summary
    elastic, reference = _weights(tmp_path / "elastic.npz"), _weights(tmp_path / "one.npz")
    for got, want in zip(elastic, reference):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def async_reference(tmp_path):
    """The async worker's summary in one process (no launcher)."""
    one = harness.run_single([WORKER], TIMEOUT_S,
                             env={"OUT": str(tmp_path / "one.npz"), "MODE": "async"})
    one.check()
    return json.loads([line for line in one.stdout.splitlines() if '"epochs"' in line][-1])


def check_async_result(out_path, members, summary, reference):
    """The last generation's `members` all hold the box's last values, and the
    job learned as one process does (asynchronous updates: not equal, close)."""
    assert summary["size"] == members, summary
    weights = [_weights(f"{out_path}.{rank}.npz") for rank in range(members)]
    for other in weights[1:]:
        for got, want in zip(other, weights[0]):
            np.testing.assert_array_equal(got, want)
    assert summary["loss"][-1] < 0.5 * reference["loss"][0], (summary, reference)
    assert summary["loss"][-1] < 2.0 * reference["loss"][-1], (summary, reference)


def test_async_fit_goes_on_through_a_lost_and_an_added_worker_without_a_rollback(tmp_path):
    # SMBStrategy(mode="async", elastic=True): 3 workers, one killed mid-epoch (3 -> 2),
    # then a host added, listed first (2 -> 3). No rollback: the box held the parameters.
    reference = async_reference(tmp_path)
    out_path = tmp_path / "elastic.npz"
    # The host comes once the 2 workers ended an epoch (async workers run apart: rank 0
    # may end epoch 2 before the others reach the kill).
    _, out, ended, summary = _elastic_job(tmp_path, 3, (2, 1), "$2 == 2", {
        "OUT": str(out_path), "MODE": "async",
        # worker 2 (127.0.0.1's slot) dies at its second step of epoch 1
        "KILL_WORKER": "2:1:1",
        # the others within 2 steps of it (not done before it starts), epochs long
        # enough for each change to come before the end
        "STALENESS": "2", "STEP_SLEEP": "0.05"})
    assert "worker 2 (127.0.0.1) was killed by signal SIGKILL" in out, out[-8000:]
    assert "generation 1: 2 workers" in out and "generation 2: 3 workers" in out, out[-8000:]
    epochs = [epoch for epoch, _ in ended]
    # Training went on from where the members were: never back to an earlier epoch.
    assert epochs == sorted(epochs) and set(epochs) == set(range(6)), ended
    assert ended[0][1] == 3 and ended[-1][1] == 3, ended
    check_async_result(out_path, 3, summary, reference)
