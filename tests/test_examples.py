"""The examples train to the accuracy bar on real data under the launcher."""
import os
import re

import pytest

from harness import REPO, rank_lines, run_launcher, run_single


def _accuracies(output, world):
    accs = []
    for rank in range(world):
        found = [float(m.group(1)) for line in rank_lines(output, rank)
                 for m in [re.match(r"test accuracy: ([0-9.]+)", line)] if m]
        assert found, f"rank {rank} printed no test accuracy:\n{output[-3000:]}"
        accs.append(found[-1])
    return accs


def test_keras_digits_two_workers_reach_090():
    p = run_launcher(2, [os.path.join(REPO, "examples", "keras_digits.py")], timeout=600)
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]
    accs = _accuracies(p.stdout, 2)
    assert min(accs) >= 0.90, accs
    assert accs[0] == accs[1]  # evaluated over the whole test set on both


def test_custom_loop_two_workers_reach_090():
    p = run_launcher(2, [os.path.join(REPO, "examples", "custom_loop.py")], timeout=600)
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]
    accs = _accuracies(p.stdout, 2)
    assert min(accs) >= 0.90, accs
    assert accs[0] == accs[1]


def test_keras_digits_two_workers_of_two_replica_threads_reach_090():
    p = run_launcher(2, [os.path.join(REPO, "examples", "keras_digits.py"),
                         "--local_replicas=2", "--epochs=5"], timeout=600)
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]
    accs = _accuracies(p.stdout, 2)
    assert min(accs) >= 0.90, accs
    assert accs[0] == accs[1]


# Momentum SGD in the box at the example's rate (0.05) is noisy for three
# pushers, and the final accuracy is wherever training stopped: for 8 epochs
# on a busy CPU it ended at 0.80-0.87 in 3 of 15 runs here (and once in CI at
# 0.76, though the last epoch's training accuracy was 0.99). At 0.03 for 10
# epochs, 22 of 22 runs (12 with a busy CPU) ended at 0.964-0.978.
@pytest.mark.parametrize("update,extra", [
    ("delta", ["--epochs=8"]),
    ("sgd", ["--box_learning_rate=0.03", "--epochs=10"]),
])
def test_keras_digits_async_three_replica_threads_reach_090(update, extra):
    p = run_single([os.path.join(REPO, "examples", "keras_digits.py"), "--mode=async",
                    "--local_replicas=3", f"--update={update}", *extra], timeout=600)
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]
    found = [float(m.group(1)) for line in p.stdout.splitlines()
             for m in [re.match(r"test accuracy: ([0-9.]+)", line)] if m]
    assert found and found[-1] >= 0.90, p.stdout[-3000:]


def test_keras_digits_async_two_workers_of_two_replica_threads_reach_090():
    # Four asynchronous pushers with the box's momentum SGD at its default rate
    # (0.05) for 8 epochs ended below 0.90 in 4 of 46 runs here (0.81-0.87: a
    # loss spike in the last epochs) and once in CI (0.88). At 0.03 for 10
    # epochs, 12 of 12 runs ended at 0.957-0.973.
    p = run_launcher(2, [os.path.join(REPO, "examples", "keras_digits.py"), "--mode=async",
                         "--local_replicas=2", "--update=sgd", "--box_learning_rate=0.03",
                         "--epochs=10"], timeout=600)
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]
    accs = _accuracies(p.stdout, 2)
    assert min(accs) >= 0.90, accs
    assert accs[0] == accs[1]  # both end with the box's final values
