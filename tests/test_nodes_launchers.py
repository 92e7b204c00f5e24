"""Launchers other than mpirun across the two simulated nodes of tests/simnodes.py.

horovodrun (Horovod's own launcher, MPI mode) starts 2 nodes x 2 SMBStrategy
workers with no tf_smb-specific flags, as a user would on two hosts:

    horovodrun --mpi -np 4 -H hostA:2,hostB:2 python train.py

What stands in for the hosts' ssh: a file named `ssh` first on PATH
(tests/simnodes_ssh.sh), used both by horovodrun's `ssh HOST true` check and by
Open MPI's default remote-start agent. Horovod's NIC discovery is skipped by
naming the network (--network-interfaces, which becomes btl_tcp_if_include:
the two veth ends have different names, and Horovod's discovery wants one
interface name common to all hosts); Open MPI's out-of-band channel gets the
same network through --mpi-args, with mpi_yield_when_idle as simnodes.py's
mpirun has (4 ranks share this machine's cores).
"""
import json
import os
import re
import stat
import sys


from harness import (REPO, WORKERS, base_env, env_lib, max_diff, require_horovod,
                     run_single)
from simnodes import describe_failure
from test_nodes import KERAS, TF_ENV, B, _check_fit

HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
SSH = os.path.join(REPO, "tests", "simnodes_ssh.sh")
WORKER = os.path.join(WORKERS, "launcher_worker.py")
TIMEOUT = 600  # per launch; a hang fails long before through TF_SMB_TIMEOUT




def _ssh_on_path(nodes, folder):
    """A folder holding `ssh`, the simulated nodes' stand-in (simnodes_ssh.sh),
    which also logs its arguments to folder/ssh.log."""
    os.makedirs(folder)
    path = os.path.join(folder, "ssh")
    with open(path, "w") as f:
        f.write(f'#!/bin/sh\necho "$*" >> {folder}/ssh.log\n'
                f'exec {SSH} {nodes.agent_map} "$@"\n')
    os.chmod(path, stat.S_IRWXU)
    return folder


def _horovodrun(nodes, tmp_path, flags, worker_args):
    """Runs `horovodrun FLAGS -np 4 -H node0:2,node1:2 python launcher_worker.py
    WORKER_ARGS` inside node 0; each rank's result, by rank, once all 4 wrote one
    and horovodrun exited with 0."""
    result_dir = str(tmp_path / "results")
    os.makedirs(result_dir)
    bin_dir = _ssh_on_path(nodes, str(tmp_path / "bin"))
    # As for mpirun (SimulatedNodes.start_mpirun): no launcher or TF_SMB_
    # variables from this process; horovodrun forwards its whole environment.
    env = {k: v for k, v in base_env(TF_ENV).items()
           if not k.startswith("TF_SMB_") and k not in env_lib.LAUNCHER_VARS}
    env.update(TF_ENV)
    python = nodes.python()  # the nodes' fork servers: TensorFlow imported once a node
    env.update(nodes.preload_env(python))
    env["PATH"] = bin_dir + os.pathsep + env["PATH"]
    argv = [HOROVODRUN, *flags, "--disable-cache", "-np", "4",
            "-H", ",".join(f"{a}:2" for a in nodes.addresses),
            # Else Horovod looks for an interface name common to both nodes
            # (it fails here: the veth ends are named differently).
            "--network-interfaces", nodes.cidr,
            f"--mpi-args=--mca oob_tcp_if_include {nodes.cidr} --mca mpi_yield_when_idle 1",
            *python, WORKER, *worker_args, "--result_dir", result_dir]
    launch = nodes.start(0, argv, env=env, owns_nodes=True).wait(TIMEOUT)
    results = _results(result_dir, 4)
    missing = sorted(set(range(4)) - set(results))
    assert launch.returncode == 0 and not missing, describe_failure(launch, missing or range(4))
    with open(os.path.join(bin_dir, "ssh.log")) as f:
        ssh_calls = f.read().splitlines()
    # Both horovodrun's check and Open MPI's daemon start went to node 1
    # through the stand-in (the real ssh reaches no simulated node).
    remote = nodes.addresses[1]
    assert any(re.search(rf"(^|\s){re.escape(remote)}\s.*\strue$", c) for c in ssh_calls), ssh_calls
    assert any(re.search(rf"(^|\s){re.escape(remote)}\s.*\sorted\s", c) for c in ssh_calls), (
        ssh_calls)
    results = [results[r] for r in range(4)]
    _check_placement(nodes, results)
    return results


def _check_placement(nodes, results):
    """The job spans the nodes: ranks 0, 1 on node 0 and 2, 3 on node 1 (-H
    fills the hosts in order), tf_smb saw Open MPI's ranks and spans_nodes, and
    each node's ranks share that node's box (named <job>-node<i>)."""
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert {r["size"] for r in results} == {4}
    assert [r["host"] for r in results] == [nodes.hostnames[0]] * 2 + [
        nodes.hostnames[1]] * 2, [(r["host"], r["place"]) for r in results]
    for r in results:
        assert r["launcher"] == "ompi" and r["spans_nodes"] is True, r["place"]
        node = r["rank"] // 2
        assert len(r["boxes"]) == 1 and r["boxes"][0].endswith(f"-node{node}"), (
            r["rank"], r["boxes"])
    assert results[0]["boxes"] == results[1]["boxes"] != results[2]["boxes"] == results[3][
        "boxes"]


def _results(result_dir, np_):
    found = {}
    for rank in range(np_):
        path = os.path.join(result_dir, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                found[rank] = json.load(f)
    return found


def test_horovodrun_without_mode_flag_2x2_exact_collectives_and_fit_equal_one_process(
        nodes, tmp_path):
    """`horovodrun -np 4 -H ...` with neither --mpi nor --gloo picks MPI (Horovod
    is built with it; --mpi starts the same mpirun): all-reduces of every dtype
    across the nodes give exact sums, a broadcast reaches every rank, and so do
    their gradients; then, in the same job, fit/evaluate/predict equal one
    process on the global batch."""
    require_horovod()
    results = _horovodrun(nodes, tmp_path, [], ["ops,fit", "--batch", str(B)])
    for r in results:
        assert r["ops"]["bad"] == [], f"rank {r['rank']}: {r['ops']['bad']}"
        # Variables created in the scope are broadcast from rank 0 although
        # every rank seeded differently.
        assert max_diff(r["ops"]["weights"], results[0]["ops"]["weights"]) == 0.0, (
            f"rank {r['rank']}")
    reference = run_single([KERAS, "fit", "--batch", str(4 * B)], timeout=TIMEOUT).check().json()
    _check_fit([dict(r["fit"], rank=r["rank"]) for r in results], reference)
