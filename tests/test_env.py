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
