"""Horovod 0.28.1's three TensorFlow 2 examples (../shared/peer/, unmodified)
on tf_smb.horovod, with only the changes tools/run_horovod_example.py prints
(the import line; Keras 3's rejected compile flag; `opt.variables`; local
digits for MNIST, which cannot be downloaded) and, for time, its --short
lengths: at 2 processes under tf_smb.run, and across the two simulated nodes
under mpirun (one process per node). Full-length runs, and the same copies
failing under Horovod 0.28.1 itself: docs/horovod.md.
"""
from __future__ import annotations

import os
import re
import sys
import pytest

import harness

sys.path.insert(0, os.path.join(harness.REPO, "tools"))
import run_horovod_example as examples  # noqa: E402  pylint: disable=wrong-import-position

needs_peer = pytest.mark.skipif(
    not os.path.isdir(examples.EXAMPLES),
    reason=f"Horovod's examples are not here ({examples.EXAMPLES}): they come from "
    "../shared/peer, present in CI")

# The synthetic benchmark's own flags, small for a 2-core machine (a Keras
# application 10x smaller than its default ResNet50; docs/horovod.md runs that).
SYNTHETIC_ARGS = ["--model", "MobileNetV3Small", "--batch-size", "4",
                  "--num-warmup-batches", "1", "--num-batches-per-iter", "2", "--num-iters", "2"]
EXAMPLE_ARGS = {"tensorflow2_keras_mnist.py": [], "tensorflow2_mnist.py": [],
                "tensorflow2_synthetic_benchmark.py": SYNTHETIC_ARGS}
TIMEOUT = 600  # per run; a hang fails long before through TF_SMB_TIMEOUT
ENV = {"TF_SMB_TIMEOUT": "120", "TF_CPP_MIN_LOG_LEVEL": "3"}


def _check_output(example: str, text: str) -> None:
    """What the job printed (the examples print on rank 0 only) shows the
    example trained, or benchmarked."""
    if example == "tensorflow2_keras_mnist.py":
        accuracies = [float(a) for a in re.findall(r"accuracy: ([0-9.]+)", text)]
        assert accuracies and accuracies[-1] > 0.8, f"accuracy {accuracies}:\n{text[-2000:]}"
    elif example == "tensorflow2_mnist.py":
        losses = [float(x) for x in re.findall(r"Step #\d+\tLoss: ([0-9.]+)", text)]
        assert len(losses) >= 5 and losses[-1] < losses[0] / 2, f"losses {losses}"
    else:
        assert re.search(r"Total img/sec on 2 GPU\(s\): [0-9.]+", text), text[-2000:]


@needs_peer
@pytest.mark.parametrize("example", sorted(EXAMPLE_ARGS))
def test_horovod_example_at_2_processes(example, tmp_path):
    copy = examples.prepare(example, str(tmp_path), short=True)
    argv = [*harness.python(), "-m", "tf_smb.run", "-np", "2", *harness.python(), copy,
            *EXAMPLE_ARGS[example]]
    r = harness.run_command(argv, TIMEOUT, harness.base_env(ENV), cwd=str(tmp_path))
    assert r.returncode == 0, f"{example} exited with {r.returncode}:\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
    _check_output(example, r.stdout + r.stderr)


@needs_peer
@pytest.mark.parametrize("example", sorted(EXAMPLE_ARGS))
def test_horovod_example_across_nodes(example, nodes, tmp_path):
    import simnodes  # pylint: disable=import-outside-toplevel
    copy = examples.prepare(example, str(tmp_path), short=True)
    python = nodes.python()
    launch = nodes.mpirun(2, 1, [*python, copy, *EXAMPLE_ARGS[example]], TIMEOUT,
                          {**nodes.preload_env(python), **ENV}, cwd=str(tmp_path))
    assert launch.returncode == 0, simnodes.describe_failure(launch, [0, 1])
    _check_output(example, launch.stdout + launch.stderr)
