"""Slurm for real: Debian's slurmctld and slurmd (with munge) on simulated nodes
(tests/slurm_cluster.py on tests/simnodes.py), and tf_smb jobs started by
`srun --mpi=pmix` and by docs/slurm.md's batch script (`mpirun` in an `sbatch`
allocation): training equals one process (sync) and ends with the box's values
on every rank (async), and what tf_smb derives from the launchers' variables
(rank, size, job id, spanning nodes, Horovod's local and cross ranks) is checked
against the variables the real daemons set.

Skips where Slurm is not installed (`bash tools/test.sh --full` installs it),
but fails under CI=true, where the install step should have provided it.
"""
import json
import os
import re
import sys

import pytest

import simnodes
import slurm_cluster
from harness import REPO, WORKERS, base_env, env_lib, run_single
from test_nodes import B, KERAS, _check_fit

DIGITS = os.path.join(WORKERS, "digits_async.py")
STEP_TIMEOUT = 300  # per srun or batch job; a hang fails long before through TF_SMB_TIMEOUT
PER_NODE = 2
WORLD = 2 * PER_NODE
# Every rank writes what it sees and what tf_smb derives from it. "env": tf_smb.env
# alone (no TensorFlow: quick); "hvd": the job joined through tf_smb.horovod, one
# all-reduce of the ranks across the nodes.
PROBE = r'''
import importlib.util, json, os, socket, sys
result_dir, tag, mode = sys.argv[1:4]
if mode == "hvd":
    import tensorflow as tf
    import tf_smb.horovod as hvd
    from tf_smb import env as env_lib
    hvd.init()
    total = hvd.allreduce(tf.constant([float(hvd.rank())]), op=hvd.Sum)
    out = {"local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
           "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
           "rank_sum": float(total.numpy()[0])}
else:
    spec = importlib.util.spec_from_file_location("tf_smb_env", os.path.join(
        os.environ["TF_SMB_REPO"], "tf_smb", "env.py"))
    env_lib = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = env_lib  # dataclasses look their module up
    spec.loader.exec_module(env_lib)
    out = {}
job = env_lib.detect()
out.update(rank=job.rank, size=job.size, job_id=job.job_id, launcher=job.launcher,
           spans_nodes=job.spans_nodes, host=socket.gethostname(),
           env={k: v for k, v in os.environ.items()
                if k.startswith(("SLURM_", "OMPI_COMM_WORLD_", "PMIX_RANK", "PMIX_NAMESPACE"))})
with open(os.path.join(result_dir, "%s-rank%d.json" % (tag, job.rank)), "w") as f:
    json.dump(out, f)
'''


@pytest.fixture(scope="module")
def cluster():
    """Slurm on 2 simulated nodes with 4 CPUs each, shared by this file's tests."""
    missing = slurm_cluster.missing_tools()
    if missing:
        why = f"Slurm is not installed here ({', '.join(missing)})"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but {why}: tools/test.sh --full installs it")
        pytest.skip(f"{why}: `bash tools/test.sh --full` installs it")
    sim = simnodes.open_or_skip(nodes=2, private_tmp=True)
    try:
        with slurm_cluster.SlurmCluster(sim) as c:
            with open(os.path.join(c.dir, "probe.py"), "w") as f:
                f.write(PROBE)
            yield c
    finally:
        sim.close()


@pytest.fixture(scope="module")
def one_process():
    """The fit scenario in one process on the global batch of 2 nodes x 2."""
    return run_single([KERAS, "fit", "--batch", str(WORLD * B)],
                      timeout=STEP_TIMEOUT).check().json()


def job_env():
    """What srun and sbatch get (and pass on to every task): this checkout on
    PYTHONPATH, no launcher variables of this process, short tf_smb timeouts, and
    what Open MPI needs here (root; more ranks than cores)."""
    env = {k: v for k, v in base_env().items() if k not in env_lib.LAUNCHER_VARS}
    env.update({"TF_SMB_TIMEOUT": "60", "TEST_TIMEOUT": "60", "TF_SMB_REPO": REPO,
                "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_mpi_yield_when_idle": "1"})
    return env


def folder(cluster, name):
    """A new folder in the cluster's shared results folder (seen by every node)."""
    path = os.path.join(cluster.results, name)
    os.makedirs(path)
    return path


def srun(cluster, per_node, argv):
    """`srun --mpi=pmix` of `python argv...` on both nodes, `per_node` tasks each;
    -K1: a failed task ends the step rather than leaving the others waiting."""
    launch = cluster.client(
        ["srun", "-N2", f"--ntasks-per-node={per_node}", "--mpi=pmix", "-K1",
         "--time=5", sys.executable, *argv], timeout=STEP_TIMEOUT, env=job_env())
    assert launch.returncode == 0, (
        f"srun exited with {launch.returncode} after {launch.seconds:.0f}s\n"
        f"stdout:\n{launch.stdout[-3000:]}\nstderr:\n{launch.stderr[-3000:]}\n{cluster.logs()}")
    return launch


def results(path, tag, count):
    """rank0..rank<count-1>'s result files `<tag>-rank<r>.json` (or `rank<r>.json`)."""
    found = []
    for rank in range(count):
        name = os.path.join(path, f"{tag}-rank{rank}.json" if tag else f"rank{rank}.json")
        assert os.path.exists(name), f"rank {rank} wrote no {name}: {sorted(os.listdir(path))}"
        with open(name) as f:
            found.append(json.load(f))
    return found


def check_placement(cluster, probed, counts):
    """What tf_smb derived on each rank of a job with counts[i] ranks on node i,
    filled node by node (srun's block distribution; mpirun's by slot)."""
    assert [r["rank"] for r in probed] == list(range(sum(counts)))
    nodes = [node for node, count in enumerate(counts) for _ in range(count)]
    for r, node in zip(probed, nodes):
        first = sum(counts[:node])  # the node's lowest rank
        assert r["host"] == cluster.nodes.hostnames[node], r
        assert (r["size"], r["spans_nodes"]) == (sum(counts), True), r
        if "local_rank" in r:
            # Horovod's cross rank and size: among the ranks with this local rank.
            local_rank = r["rank"] - first
            peers = [n for n, count in enumerate(counts) if count > local_rank]
            assert (r["local_rank"], r["local_size"], r["cross_rank"], r["cross_size"]) == (
                local_rank, counts[node], peers.index(node), len(peers)), r
            assert r["rank_sum"] == sum(range(sum(counts))), r


def test_srun_tasks_see_their_step_and_tf_smb_reads_it(cluster):
    out = folder(cluster, "srun-probe")
    srun(cluster, PER_NODE, [os.path.join(cluster.dir, "probe.py"), out, "first", "hvd"])
    srun(cluster, PER_NODE, [os.path.join(cluster.dir, "probe.py"), out, "second", "env"])
    first, second = results(out, "first", WORLD), results(out, "second", WORLD)
    check_placement(cluster, first, [PER_NODE] * 2)
    for r in first:
        seen = r["env"]
        # What srun --mpi=pmix sets (DESIGN.md §8), and what tf_smb took from it.
        assert not [k for k in seen if k.startswith("OMPI_COMM_WORLD_")], seen
        assert r["launcher"] == "slurm"
        assert int(seen["SLURM_PROCID"]) == int(seen["PMIX_RANK"]) == r["rank"]
        assert int(seen["SLURM_NTASKS"]) == r["size"]
        assert int(seen["SLURM_LOCALID"]) == r["local_rank"]
        assert int(seen["SLURM_NODEID"]) == r["cross_rank"]
        assert int(seen["SLURM_STEP_NUM_NODES"]) == r["cross_size"]
        assert seen["SLURM_STEP_TASKS_PER_NODE"] == f"{PER_NODE}(x2)"
        assert r["job_id"] == f"slurm-{seen['SLURM_JOB_ID']}-{seen['SLURM_STEP_ID']}"
    # One job id for every rank of a step (its box's name); another for the next step.
    assert len({r["job_id"] for r in first}) == 1
    assert len({r["job_id"] for r in second}) == 1
    assert first[0]["job_id"] != second[0]["job_id"]


def test_srun_uneven_step_2_plus_1_reads_each_nodes_count(cluster):
    # -N2 -n3: srun gives node 0 two tasks and node 1 one (SLURM_STEP_TASKS_PER_NODE
    # "2,1"); each rank's local size is its own node's count.
    out = folder(cluster, "srun-uneven")
    argv = [os.path.join(cluster.dir, "probe.py"), out, "uneven", "hvd"]
    launch = cluster.client(["srun", "-N2", "-n3", "--mpi=pmix", "-K1", "--time=5",
                             sys.executable, *argv], timeout=STEP_TIMEOUT, env=job_env())
    assert launch.returncode == 0, f"{launch.stdout[-3000:]}\n{launch.stderr[-3000:]}"
    probed = results(out, "uneven", 3)
    assert {r["env"]["SLURM_STEP_TASKS_PER_NODE"] for r in probed} == {"2,1"}, probed
    check_placement(cluster, probed, [2, 1])


def test_srun_fit_2x2_equals_one_process_on_global_batch(cluster, one_process):
    out = folder(cluster, "srun-fit")
    srun(cluster, PER_NODE, [KERAS, "fit", "--batch", str(B), "--result_dir", out])
    trained = results(out, "", WORLD)
    assert [(r["rank"], r["size"]) for r in trained] == [(rank, WORLD) for rank in range(WORLD)]
    _check_fit(trained, one_process)


def test_srun_async_2x1_ends_with_the_boxs_values_on_both_nodes(cluster):
    # Rank 1 (node 1) sleeps 0.02 s a step; with staleness 0 neither may run a step
    # ahead of the other. Every rank loads the box's final values after fit.
    out = folder(cluster, "srun-async")
    srun(cluster, 1, [DIGITS, "--epochs", "2", "--staleness", "0", "--slow_rank", "1",
                      "--delay", "0.02", "--result_dir", out])
    trained = results(out, "", 2)
    for r in trained:
        assert r["steps"] > 0 and r["max_gap"] <= 0, trained
        assert r["weights_sum"] == trained[0]["weights_sum"], trained
        # Two epochs of the digits (1437 training images) at 2 workers; the
        # example reaches 0.96 after 15 (test_nodes_async.py asks 0.90 there):
        # well above chance (0.10) shows the pushes from both nodes trained it.
        assert r["accuracy"] > 0.5, trained


def docs_script():
    """docs/slurm.md's batch script, as a user copies it."""
    with open(os.path.join(REPO, "docs", "slurm.md")) as f:
        blocks = re.findall(r"```bash\n(#!/bin/bash\n.*?)```", f.read(), re.S)
    assert len(blocks) == 1, "docs/slurm.md should hold one batch script"
    return blocks[0]


def test_sbatch_of_the_docs_script_trains_with_mpirun_in_the_allocation(cluster, one_process):
    # The script as documented, with two changes: this checkout's Python instead of
    # the user's environment, and two quick jobs (probes) before the training, to
    # check what the ranks of mpirun in an allocation see, and that two mpiruns of
    # one script are two jobs. Options on sbatch's command line override #SBATCH's.
    out = folder(cluster, "sbatch")
    probe = os.path.join(cluster.dir, "probe.py")
    script = docs_script()
    activate = re.search(r"^source .*/activate\"?\n", script, re.M)
    train = re.search(r"^mpirun (.*)python train\.py \"\$@\"$", script, re.M)
    assert activate and train, script
    mpirun = f"mpirun {train.group(1)}{sys.executable}"
    script = (script[:activate.start()] + script[activate.end():train.start()]
              + f"{mpirun} {probe} {out} first hvd\n{mpirun} {probe} {out} second env\n"
              + f"{mpirun} \"$@\"\n")
    path = os.path.join(cluster.dir, "train.sbatch")
    with open(path, "w") as f:
        f.write(script)
    submitted = cluster.client(
        ["sbatch", "--parsable", "-N2", f"--ntasks-per-node={PER_NODE}", "--cpus-per-task=1",
         "--time=5", f"--output={out}/job-%j.out", path,
         KERAS, "fit", "--batch", str(B), "--result_dir", out], env=job_env())
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    state = cluster.wait_job(job, STEP_TIMEOUT)
    with open(os.path.join(out, f"job-{job}.out"), errors="replace") as f:
        output = f.read()
    assert state == "COMPLETED", f"job {job}: {state}\n{output[-5000:]}\n{cluster.logs()}"
    first, second = results(out, "first", WORLD), results(out, "second", WORLD)
    check_placement(cluster, first, [PER_NODE] * 2)
    check_placement(cluster, second, [PER_NODE] * 2)
    for r in first + second:
        seen = r["env"]
        assert r["launcher"] == "ompi"
        assert int(seen["OMPI_COMM_WORLD_RANK"]) == r["rank"]
        assert int(seen["OMPI_COMM_WORLD_SIZE"]) == r["size"]
        assert r["job_id"] == f"mpi-{seen['PMIX_NAMESPACE']}"
        # Slurm's variables are not this rank's (why tf_smb does not read them here):
        # the batch step's on node 0, the one-task helper step's on node 1.
        assert seen["SLURM_PROCID"] == "0", seen
        if r["rank"] >= PER_NODE:
            assert seen["SLURM_NTASKS"] == "1", seen
    for probed in (first, second):
        assert len({r["job_id"] for r in probed}) == 1, probed
    assert first[0]["job_id"] != second[0]["job_id"]
    trained = results(out, "", WORLD)
    _check_fit(trained, one_process)
