"""Elastic jobs across the simulated nodes (tests/simnodes.py): each generation one
mpirun, resuming from the nodes' commit boxes (docs/elastic.md, "Across nodes").

Keras `fit` with SMBStrategy(elastic=True), unchanged (tests/workers/
elastic_fit_worker.py), under `tf_smb.run` in node 0: 4 workers on nodes 0 and 1
(2 each); a worker on node 1 is SIGKILLed mid-epoch (node 1 is blacklisted:
4 -> 2, the next mpirun resumes from the commit before), then discovery adds
node 2 (2 -> 3, at a commit). The weights equal one process's on the same
global batches.
"""
import json
import os
import sys

import numpy as np

import harness
import simnodes
from test_elastic_fit import WORKER, _weights

TIMEOUT_S = 420.0


def _mpi_args(nodes):
    """What mpirun needs inside the simulated nodes (as SimulatedNodes.mpirun_argv)."""
    return (f"--bind-to none --mca plm_rsh_agent '{simnodes.AGENT} {nodes.agent_map}' "
            f"--mca btl tcp,self,vader --mca btl_tcp_if_include {nodes.cidr} "
            f"--mca oob_tcp_if_include {nodes.cidr} --mca mpi_yield_when_idle 1")


def test_fit_across_nodes_through_a_lost_node_and_an_added_one_equals_one_process(tmp_path):
    one = harness.run_single([WORKER], TIMEOUT_S, env={"OUT": str(tmp_path / "one.npz")})
    one.check()
    nodes = simnodes.open_or_skip(nodes=3, workers=1)
    try:
        progress = tmp_path / "progress"
        discover = tmp_path / "discover.sh"
        first, second, third = nodes.hostnames
        # After epoch 2 node 2 has a slot.
        discover.write_text(
            f"#!/bin/sh\necho {first}:2\necho {second}:2\n"
            f"awk '$1 >= 2' {progress} 2>/dev/null | grep -q . && echo {third}:1\n"
            "exit 0\n")
        discover.chmod(0o700)
        argv = [sys.executable, "-m", "tf_smb.run", "-np", "4", "--min-np", "2",
                "--max-np", "4", "--host-discovery-script", str(discover),
                "--mpi-args", _mpi_args(nodes), sys.executable, WORKER]
        env = {k: v for k, v in harness.base_env().items()
               if not k.startswith("TF_SMB_") and k not in harness.env_lib.LAUNCHER_VARS}
        env.update({"OUT": str(tmp_path / "elastic.npz"), "PROGRESS": str(progress),
                    # rank 3 (node 1's second) dies at epoch 1, batch 6: two batches
                    # after the commit at batch 4.
                    "KILL_WORKER": "3:1:6", "TF_SMB_TIMEOUT": "60"})
        launch = nodes.start(0, argv, env, owns_nodes=True, drain=True).wait(TIMEOUT_S)
    finally:
        nodes.close()
    out = launch.stdout + launch.stderr
    assert launch.returncode == 0, out[-10000:]
    assert f"worker rank 3 on host {second} failed (SIGKILL)" in out, out[-10000:]
    assert (f"generation 1: 2 workers ({first}, {first})" in out
            and f"generation 2: 3 workers ({first}, {first}, {third})" in out), out[-10000:]
    sizes = [int(line.split()[1]) for line in progress.read_text().splitlines()]
    assert sizes[0] == 4 and 2 in sizes and sizes[-1] == 3, sizes
    summary = json.loads([line for line in launch.stdout.splitlines() if '"epochs"' in line][-1]
                         .split("]: ", 1)[-1])
    # The last generation's processes started at a later epoch: their history ends the job's.
    assert summary["epochs"][-1] == 5 and summary["size"] == 3, summary
    elastic, reference = _weights(tmp_path / "elastic.npz"), _weights(tmp_path / "one.npz")
    for got, want in zip(elastic, reference):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
