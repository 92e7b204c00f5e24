"""Rank, size and job id come from every supported launcher's environment."""
import pytest

from tf_smb import env


@pytest.mark.parametrize("variables, launcher", [
    ({"TF_SMB_RANK": "1", "TF_SMB_SIZE": "3", "TF_SMB_JOB_ID": "j"}, "tf"),
    ({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "3"}, "horovod"),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3"}, "ompi"),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "3", "SLURM_JOB_ID": "77"}, "slurm"),
])
def test_launchers(variables, launcher):
    job = env.detect(variables)
    assert (job.rank, job.size, job.launcher) == (1, 3, launcher)


def test_job_ids_shared_by_one_job_and_distinct_across_jobs():
    a = env.detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "5",
                    "SLURM_STEP_ID": "1"})
    b = env.detect({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "5",
                    "SLURM_STEP_ID": "1"})
    c = env.detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "6"})
    assert a.job_id == b.job_id != c.job_id
    m = env.detect({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
                    "PMIX_NAMESPACE": "prterun-host-123@1"})
    assert m.job_id == "mpi-prterun-host-123_1"  # sanitised for a shm name


def test_no_launcher_is_a_single_worker():
    job = env.detect({})
    assert (job.rank, job.size, job.launcher) == (0, 1, "none")


@pytest.mark.parametrize("variables", [
    {"TF_SMB_RANK": "2", "TF_SMB_SIZE": "2"},
    {"TF_SMB_RANK": "x", "TF_SMB_SIZE": "2"},
    {"SLURM_PROCID": "0", "SLURM_NTASKS": "0"},
])
def test_bad_values_raise(variables):
    with pytest.raises(ValueError):
        env.detect(variables)


def test_launcher_box_flag():
    job = env.detect({"TF_SMB_RANK": "0", "TF_SMB_SIZE": "2", "TF_SMB_JOB_ID": "j",
                      "TF_SMB_BOX_CREATED": "1"})
    assert job.box_created


@pytest.mark.parametrize("variables", [
    {"TF_SMB_RANK": "1", "TF_SMB_SIZE": "3", "TF_SMB_JOB_ID": "j", "TF_SMB_BOX_CREATED": "1"},
    {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "3", "HOROVOD_LOCAL_RANK": "1"},
    {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3"},
    {"PMIX_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3"},
    {"SLURM_PROCID": "1", "SLURM_NTASKS": "3", "SLURM_JOB_ID": "77"},
])
def test_without_launcher_vars_a_process_is_a_single_worker(variables):
    # What tf_smb.supervisor.worker_env drops from a worker's inherited environment.
    assert env.detect(variables).size == 3
    rest = {k: v for k, v in variables.items() if k not in env.LAUNCHER_VARS}
    assert env.detect(rest).launcher == "none"


@pytest.mark.parametrize("variables, spans", [
    # mpirun: fewer workers on this node than in the job.
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, True),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, False),
    # horovodrun (its local size wins over MPI's).
    ({"HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_SIZE": "2",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, True),
    # srun: the step's node count.
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_NODES": "2"}, True),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_NNODES": "1"}, False),
    # tf_smb.run starts every worker on this node.
    ({"TF_SMB_RANK": "1", "TF_SMB_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, False),
    # The override, both ways; a launcher without local sizes is one node.
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
      "TF_SMB_ACROSS_NODES": "1"}, True),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "TF_SMB_ACROSS_NODES": "0"}, False),
    ({"PMIX_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, False),
])
def test_spans_nodes_from_the_launcher(variables, spans):
    assert env.detect(variables).spans_nodes is spans


def test_bad_across_nodes_values_raise():
    with pytest.raises(ValueError, match="TF_SMB_ACROSS_NODES must be 1 or 0, got 'maybe'"):
        env.detect({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
                    "TF_SMB_ACROSS_NODES": "maybe"})
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_LOCAL_SIZE='two' must be an integer"):
        env.detect({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
                    "OMPI_COMM_WORLD_LOCAL_SIZE": "two"})


# --- under Slurm (the variables measured with Slurm 22.05 and Open MPI 4.1) ---------

@pytest.mark.parametrize("value, counts", [
    ("2", [2]), ("2(x2)", [2, 2]), ("2,1", [2, 1]), ("2(x2),1", [2, 2, 1]),
    ("1,3(x2),2", [1, 3, 3, 2]),
])
def test_slurm_tasks_per_node_expands_slurms_list(value, counts):
    assert env.slurm_tasks_per_node(value) == counts


@pytest.mark.parametrize("value", ["", "2,", "x2", "2(x)", "0", "2(x0)"])
def test_slurm_tasks_per_node_refuses_what_is_not_a_list(value):
    with pytest.raises(ValueError, match="SLURM_STEP_TASKS_PER_NODE"):
        env.slurm_tasks_per_node(value)


def _srun(procid, localid, nodeid, per_node, ntasks, nodes, step="0"):
    """What srun --mpi=pmix gives a task (no OMPI_COMM_WORLD_* variables)."""
    return {"SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid),
            "SLURM_NODEID": str(nodeid), "SLURM_NTASKS": str(ntasks),
            "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_STEP_TASKS_PER_NODE": per_node,
            "SLURM_JOB_ID": "7", "SLURM_STEP_ID": step, "PMIX_RANK": str(procid),
            "PMIX_NAMESPACE": f"slurm.pmix.7.{step}"}


@pytest.mark.parametrize("variables, where", [
    # -N2 -n4: 2(x2); the task on node 1 with local id 1.
    (_srun(3, 1, 1, "2(x2)", 4, 2), (1, 2, 1, 2)),
    # -N2 -n3: 2,1 (the uneven layout); -N3 -n5: 2(x2),1. Cross rank and size
    # as Horovod's: among the ranks with this local rank (rank 1 of 2,1 has none
    # on node 1).
    (_srun(1, 1, 0, "2,1", 3, 2), (1, 2, 0, 1)),
    (_srun(2, 0, 1, "2,1", 3, 2), (0, 1, 1, 2)),
    (_srun(4, 0, 2, "2(x2),1", 5, 3), (0, 1, 2, 3)),
    (_srun(3, 1, 1, "2(x2),1", 5, 3), (1, 2, 1, 2)),
])
def test_placement_under_srun_comes_from_the_steps_layout(variables, where):
    job = env.detect(variables)
    assert (job.launcher, job.spans_nodes) == ("slurm", True)
    p = env.placement(job, variables)
    assert (p.local_rank, p.local_size, p.cross_rank, p.cross_size) == where


def test_placement_refuses_a_layout_that_is_not_the_steps():
    variables = _srun(1, 1, 0, "2,1", 4, 2)  # 3 tasks listed, SLURM_NTASKS=4
    with pytest.raises(ValueError, match="do not describe a step of 4 tasks"):
        env.placement(env.detect(variables), variables)


def _mpirun_in_allocation(rank, local_rank, jobid, step=None):
    """What mpirun (Open MPI 4.1) in an sbatch script gives rank `rank` of 4 on 2
    nodes x 2: right OMPI_* variables, and the SLURM_* of the batch step (node 0)
    or of the one-task step that started the node's orted (node 1)."""
    variables = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "4",
                 "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank),
                 "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": jobid,
                 "PMIX_NAMESPACE": jobid, "PMIX_RANK": str(rank), "SLURM_JOB_ID": "2",
                 "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
    if step is None:
        variables.update(SLURM_NTASKS="4", SLURM_NNODES="2")
    else:
        variables.update(SLURM_NTASKS="1", SLURM_STEP_ID=step, SLURM_STEP_NUM_NODES="1",
                         SLURM_STEP_TASKS_PER_NODE="1")
    return variables


def test_mpirun_in_an_allocation_reads_open_mpis_variables_not_slurms():
    # Two mpirun jobs one after the other in one batch script: the helper
    # step on node 1 is step 0, then step 1; node 0 sees the batch step's ids both times.
    first = [_mpirun_in_allocation(0, 0, "2778136577"), _mpirun_in_allocation(1, 1, "2778136577"),
             _mpirun_in_allocation(2, 0, "2778136577", step="0"),
             _mpirun_in_allocation(3, 1, "2778136577", step="0")]
    second = [_mpirun_in_allocation(0, 0, "2761490433"),
              _mpirun_in_allocation(2, 0, "2761490433", step="1")]
    jobs = [env.detect(v) for v in first]
    assert [(j.rank, j.size, j.launcher, j.spans_nodes) for j in jobs] == [
        (r, 4, "ompi", True) for r in range(4)]
    assert {j.job_id for j in jobs} == {"mpi-2778136577"}  # one box name per node
    assert {env.detect(v).job_id for v in second} == {"mpi-2761490433"}
    where = [env.placement(j, v) for j, v in zip(jobs, first)]
    assert [(p.local_rank, p.local_size, p.cross_rank, p.cross_size) for p in where] == [
        (0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)]


def test_placement_on_one_node_is_the_whole_job():
    variables = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                 "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    p = env.placement(env.detect(variables), variables)
    assert (p.local_rank, p.local_size, p.cross_rank, p.cross_size) == (1, 2, 0, 1)
