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
Across nodes, MPI (not these variables) decides which ranks share a node;
`placement` reads the launcher's view of it for Horovod's local and cross ranks.

Under Slurm, the SLURM_* variables describe the process only when `srun` started
it: `mpirun` inside an `sbatch`/`salloc` allocation starts its ranks itself (node
0's as its children, the others through a one-task helper step), so they inherit
the batch step's or the helper step's SLURM_* values (SLURM_PROCID=0,
SLURM_NTASKS=1 on the other nodes; measured with Slurm 22.05). There, only the
OMPI_* variables (and PMIx's) are the job's.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import List, Mapping, Optional

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
# srun's layout of its step: this task's node index and the step's tasks per node.
_SLURM_NODE_VARS = ("SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE")
ACROSS_NODES_VAR = "TF_SMB_ACROSS_NODES"
LAUNCHER_VARS = tuple(dict.fromkeys(
    [var for pair in _RANK_SIZE_VARS for var in pair]
    + ["TF_SMB_JOB_ID", "TF_SMB_BOX_CREATED", "HOROVOD_LOCAL_RANK",
       "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", ACROSS_NODES_VAR]
    + list(_LOCAL_SIZE_VARS) + list(_NODE_COUNT_VARS) + list(_SLURM_NODE_VARS)))
# Job ids of an MPI launch (Open MPI's mpirun, or PMIx under srun): one per launch.
_MPI_JOB_ID_VARS = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid")


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
    # Slurm's job and step name an srun launch. Under mpirun in an allocation they
    # do not: every mpirun of one batch script gives node 0's ranks the batch
    # step's ids (two jobs, one box name), so there mpirun's own job id comes first.
    if launcher == "slurm" and env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}-{env.get('SLURM_STEP_ID', '0')}"
    for key in _MPI_JOB_ID_VARS:
        if env.get(key):
            return f"mpi-{env[key]}"
    if env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}-{env.get('SLURM_STEP_ID', '0')}"
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


def slurm_tasks_per_node(value: str) -> List[int]:
    """Slurm's compressed tasks-per-node list (SLURM_STEP_TASKS_PER_NODE, e.g.
    "2(x3),1") expanded to one count per node ([2, 2, 2, 1]).

    Raises:
      ValueError: `value` is not such a list.
    """
    counts: List[int] = []
    for part in value.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m or int(m.group(1)) < 1 or (m.group(2) and int(m.group(2)) < 1):
            raise ValueError(f"SLURM_STEP_TASKS_PER_NODE={value!r}: expected counts like "
                             "'2(x3),1'")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a worker sits among the job's nodes, as Horovod reports it.

    Attributes:
      local_rank: index among the workers of its node.
      local_size: workers on its node.
      cross_rank: index among the workers with its local rank, one per node (its
        node's index when every node runs as many workers).
      cross_size: number of workers with its local rank (of nodes, when every
        node runs as many).
    """

    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def _first_int(env: Mapping[str, str], names: "tuple[str, ...]") -> Optional[int]:
    for name in names:
        value = _int_var(env, name)
        if value is not None:
            return value
    return None


def placement(job: JobInfo, env: Optional[Mapping[str, str]] = None) -> Placement:
    """The launcher's view of `job`'s nodes for this worker (Horovod's local and
    cross ranks and sizes).

    horovodrun's and mpirun's variables (HOROVOD_LOCAL_*, HOROVOD_CROSS_*,
    OMPI_COMM_WORLD_LOCAL_*) come first; under srun (launcher "slurm"), which sets
    none of them, the step's layout: SLURM_LOCALID, SLURM_NODEID, SLURM_STEP_NUM_NODES
    and SLURM_STEP_TASKS_PER_NODE. SLURM_* values are not read for other launchers:
    under mpirun in an allocation they are the batch or helper step's. A job on
    one node (or started by tf_smb.run) is one node of `job.size` workers.

    Raises:
      ValueError: a variable is malformed or contradicts the job's size.
    """
    env = os.environ if env is None else env
    if job.launcher == "tf" or not job.spans_nodes:
        return Placement(job.rank, job.size, 0, 1)
    local_size = _first_int(env, ("HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"))
    local_rank = _first_int(env, ("HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"))
    cross_rank = _first_int(env, ("HOROVOD_CROSS_RANK",))
    cross_size = _first_int(env, ("HOROVOD_CROSS_SIZE",))
    if job.launcher == "slurm" and env.get("SLURM_STEP_TASKS_PER_NODE"):
        per_node = slurm_tasks_per_node(env["SLURM_STEP_TASKS_PER_NODE"])
        node = _int_var(env, "SLURM_NODEID")
        if sum(per_node) != job.size or node is None or not 0 <= node < len(per_node):
            raise ValueError(
                f"SLURM_STEP_TASKS_PER_NODE={env['SLURM_STEP_TASKS_PER_NODE']!r} and "
                f"SLURM_NODEID={env.get('SLURM_NODEID')!r} do not describe a step of "
                f"{job.size} tasks (SLURM_NTASKS)")
        local_size = per_node[node] if local_size is None else local_size
        if local_rank is None:
            local_rank = _int_var(env, "SLURM_LOCALID")
        # Horovod's cross rank and size: among the ranks with this local rank,
        # one per node that has that many tasks (the node index on even layouts).
        mine = 0 if local_rank is None else local_rank
        cross_rank = (sum(1 for n in per_node[:node] if n > mine)
                      if cross_rank is None else cross_rank)
        cross_size = sum(1 for n in per_node if n > mine) if cross_size is None else cross_size
    if job.launcher == "slurm" and local_rank is None:
        local_rank = _int_var(env, "SLURM_LOCALID")
    local_size = job.size if local_size is None else local_size
    local_rank = job.rank if local_rank is None else local_rank
    # Without the launcher's word: nodes filled in rank order, equally.
    cross_rank = job.rank // max(1, local_size) if cross_rank is None else cross_rank
    cross_size = max(1, job.size // max(1, local_size)) if cross_size is None else cross_size
    return Placement(local_rank, local_size, cross_rank, cross_size)
