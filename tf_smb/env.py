"""Where this process sits in a job: rank, size and job id from the launcher.

Recognised launchers, first match wins:
  * ``python -m tf_smb.run``: TF_SMB_RANK, TF_SMB_SIZE, TF_SMB_JOB_ID;
  * ``horovodrun``: HOROVOD_RANK, HOROVOD_SIZE;
  * Open MPI's ``mpirun``: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE;
  * Slurm's ``srun``: SLURM_PROCID, SLURM_NTASKS.
With none of these the process is a single worker (rank 0 of 1).

A job spans nodes when the launcher says a node holds fewer workers than the job
(OMPI_COMM_WORLD_LOCAL_SIZE, HOROVOD_LOCAL_SIZE) or that the job step has several
nodes (SLURM_STEP_NUM_NODES, SLURM_NNODES); TF_SMB_ACROSS_NODES=1/0 overrides it.
Across nodes, MPI (not these variables) decides which ranks share a node.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Mapping, Optional

# Launcher variables: (rank, size) pairs, in order of preference.
_RANK_SIZE_VARS = (
    ("TF_SMB_RANK", "TF_SMB_SIZE"),
    ("HOROVOD_RANK", "HOROVOD_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMIX_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS"),
)
# Every variable that places a process in a job: the pairs above, tf_smb.run's job id
# and box flag, and Horovod's local rank. A process started without these is a single
# worker (tf_smb.supervisor.worker_env drops them from what a worker inherits).
# Launcher variables: (local size, how to read it), in order of preference.
_LOCAL_SIZE_VARS = ("HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")
_NODE_COUNT_VARS = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES")
ACROSS_NODES_VAR = "TF_SMB_ACROSS_NODES"
LAUNCHER_VARS = tuple(dict.fromkeys(
    [var for pair in _RANK_SIZE_VARS for var in pair]
    + ["TF_SMB_JOB_ID", "TF_SMB_BOX_CREATED", "HOROVOD_LOCAL_RANK",
       "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", ACROSS_NODES_VAR]
    + list(_LOCAL_SIZE_VARS) + list(_NODE_COUNT_VARS)))


@dataclasses.dataclass(frozen=True)
class JobInfo:
    """This process's place in a job.

    Attributes:
      rank: index of this worker, 0 <= rank < size.
      size: number of workers.
      job_id: name shared by all workers of the job on this node; it names the box.
      box_created: True when the launcher already made the box (else rank 0 makes it).
      launcher: which environment the values came from.
      spans_nodes: the workers run on several nodes: each node gets its own box,
        and the boxes are joined over MPI (the job must be started by mpirun,
        srun or horovodrun in MPI mode).
    """

    rank: int
    size: int
    job_id: str
    box_created: bool
    launcher: str
    spans_nodes: bool = False


def _job_id_from(env: Mapping[str, str], launcher: str) -> str:
    """A job id all workers of one job derive alike, different across jobs."""
    if env.get("TF_SMB_JOB_ID"):
        return env["TF_SMB_JOB_ID"]
    for key in ("SLURM_JOB_ID",):
        if env.get(key):
            return f"slurm-{env[key]}-{env.get('SLURM_STEP_ID', '0')}"
    for key in ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid"):
        if env.get(key):
            return f"mpi-{env[key]}"
    if env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"):
        return "hvd-{}-{}".format(env["HOROVOD_GLOO_RENDEZVOUS_ADDR"],
                                  env.get("HOROVOD_GLOO_RENDEZVOUS_PORT", "0"))
    # Workers started by one local launcher process share their parent.
    return f"{launcher}-ppid{os.getppid()}"


def _sanitize(job_id: str) -> str:
    clean = re.sub(r"[^A-Za-z0-9_.-]", "_", job_id)
    return clean[:100]


def _int_var(env: Mapping[str, str], name: str) -> Optional[int]:
    try:
        return int(env[name]) if env.get(name) else None
    except ValueError as e:
        raise ValueError(f"{name}={env[name]!r} must be an integer") from e


def _spans_nodes(env: Mapping[str, str], size: int, launcher: str) -> bool:
    """Whether the launcher placed the job's `size` workers on several nodes."""
    forced = env.get(ACROSS_NODES_VAR, "").strip().lower()
    if forced in ("1", "true", "yes"):
        return True
    if forced in ("0", "false", "no"):
        return False
    if forced:
        raise ValueError(f"{ACROSS_NODES_VAR} must be 1 or 0, got {env[ACROSS_NODES_VAR]!r}")
    if launcher == "tf":  # tf_smb.run starts every worker on this node
        return False
    for name in _LOCAL_SIZE_VARS:
        local = _int_var(env, name)
        if local is not None:
            return local < size
    for name in _NODE_COUNT_VARS:
        nodes = _int_var(env, name)
        if nodes is not None:
            return nodes > 1
    return False


def detect(env: Optional[Mapping[str, str]] = None) -> JobInfo:
    """Reads rank, size and job id from the launcher's environment.

    Raises:
      ValueError: a launcher variable is not an integer, or rank is out of range.
    """
    env = os.environ if env is None else env
    for rank_var, size_var in _RANK_SIZE_VARS:
        if rank_var in env and size_var in env:
            try:
                rank, size = int(env[rank_var]), int(env[size_var])
            except ValueError as e:
                raise ValueError(
                    f"{rank_var}={env[rank_var]!r} and {size_var}={env[size_var]!r} "
                    "must be integers") from e
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"expected 0 <= {rank_var} < {size_var}, got "
                                 f"{rank_var}={rank}, {size_var}={size}")
            launcher = rank_var.split("_")[0].lower()
            return JobInfo(rank=rank, size=size,
                           job_id=_sanitize(_job_id_from(env, launcher)),
                           box_created=env.get("TF_SMB_BOX_CREATED") == "1",
                           launcher=launcher,
                           spans_nodes=size > 1 and _spans_nodes(env, size, launcher))
    return JobInfo(rank=0, size=1, job_id=f"single-{os.getpid()}",
                   box_created=False, launcher="none")
