"""Horovod's process queries on tf_smb's job: init, ranks, sizes, capabilities,
process sets.

The job is tf_smb's (tf_smb.env): the same launchers (tf_smb.run, mpirun,
horovodrun, srun) place a process. Local and cross ranks come from the
launcher's variables (tf_smb.env.placement); tf_smb.run starts every worker on
one node.
"""
from __future__ import annotations

import collections
import os
from typing import Dict, List, Mapping, Optional, Sequence, Union

import tensorflow as tf

from tf_smb import env as env_lib
from tf_smb import ops as smb_ops
from tf_smb import timeline as timeline_lib
from tf_smb.elastic import protocol as elastic_protocol

# HOROVOD_* variables that change nothing here (tuning of Horovod's own engine);
# any other HOROVOD_* setting that asks for behaviour is refused at init.
_TUNING_VARS = frozenset({
    "HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", "HOROVOD_CACHE_CAPACITY",
    "HOROVOD_HIERARCHICAL_ALLREDUCE", "HOROVOD_HIERARCHICAL_ALLGATHER",
    "HOROVOD_AUTOTUNE", "HOROVOD_AUTOTUNE_LOG", "HOROVOD_LOG_LEVEL",
    "HOROVOD_LOG_HIDE_TIME", "HOROVOD_STALL_CHECK_DISABLE",
    "HOROVOD_STALL_CHECK_TIME_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
    "HOROVOD_NUM_STREAMS", "HOROVOD_BATCH_D2D_MEMCOPIES", "HOROVOD_THREAD_AFFINITY",
    "HOROVOD_MPI_THREADS_DISABLE", "HOROVOD_DISABLE_GROUP_FUSION",
    "HOROVOD_ENABLE_ASYNC_COMPLETION", "HOROVOD_CPU_OPERATIONS",
    "HOROVOD_CONTROLLER", "HOROVOD_GLOO_IFACE", "HOROVOD_GLOO_TIMEOUT_SECONDS",
    "HOROVOD_GPU_OPERATIONS", "HOROVOD_MIXED_INSTALL", "HOROVOD_DYNAMIC_PROCESS_SETS",
})
# Set by Horovod's launcher itself (placement, rendezvous): read or ignored.
_LAUNCHER_PREFIXES = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_", "HOROVOD_CROSS_",
                      "HOROVOD_HOSTNAME", "HOROVOD_GLOO_", "HOROVOD_ELASTIC",
                      "HOROVOD_TIMELINE", "HOROVOD_SECRET_KEY", "HOROVOD_IFACE")


class _State:
    job: Optional[env_lib.JobInfo] = None
    local_rank = 0
    local_size = 1
    cross_rank = 0
    cross_size = 1
    process_sets: Dict[int, "ProcessSet"] = {}  # the added sets by id (not the global one)
    next_set_id = 1
    nodes: Optional[List[int]] = None  # each rank's node, across nodes (asked once)
    world: Optional[tf.Variable] = None  # elastic jobs: the size, read by graphs at run time
    # Elastic jobs: the generation this process joins once its state is synced
    # (until then its collectives run over itself alone: see `work_alone`).
    pending: Optional[env_lib.JobInfo] = None


def check_horovod_variables(env: Mapping[str, str]) -> None:
    """Refuses HOROVOD_* settings tf_smb does not honour, naming each."""
    refused = sorted(
        name for name in env
        if name.startswith("HOROVOD_") and name not in _TUNING_VARS
        and not name.startswith(_LAUNCHER_PREFIXES))
    if refused:
        raise ValueError(
            f"tf_smb.horovod does not honour {', '.join(refused)}: unset them. It reads "
            "HOROVOD_TIMELINE and the launcher's placement variables, and ignores the "
            "tuning variables of Horovod's own engine (fusion, cycle time, cache, "
            "autotune, stall check, controller choice)")


class ProcessSet:
    """A group of ranks a collective can be limited to (Horovod's ProcessSet).

    Give the sets to `init(process_sets=...)` or add them with `add_process_set`
    on every rank; then the collectives given `process_set=` run among its ranks
    only (only they call them), with roots named by their job rank. tf_smb
    gives each set a box of its own on each of its nodes; a set spanning nodes
    joins its boxes over MPI with a link of its own, and needs as many of its
    ranks on each of its nodes (else NotImplementedError, on every rank).
    """

    def __init__(self, ranks_or_comm: Optional[Sequence[int]] = None) -> None:
        if ranks_or_comm is not None and not isinstance(ranks_or_comm, (list, tuple, range)):
            raise NotImplementedError(
                "tf_smb.horovod.ProcessSet takes a list of ranks; MPI communicators "
                "are not supported")
        self.ranks: Optional[List[int]] = (
            None if ranks_or_comm is None else sorted(int(r) for r in ranks_or_comm))
        self.process_set_id: Optional[int] = None

    def _members(self) -> List[int]:
        return list(range(size())) if self.ranks is None else self.ranks

    def size(self) -> int:
        """The number of ranks in the set."""
        return len(self._members())

    def rank(self) -> int:
        """This process's rank within the set (-1 when not included)."""
        members = self._members()
        return members.index(rank()) if rank() in members else -1

    def included(self) -> bool:
        """Whether this process belongs to the set."""
        return self.rank() >= 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessSet) and self._members() == other._members()

    def __hash__(self) -> int:  # equal sets (the global one and all ranks) hash alike
        return hash(tuple(self._members()) if is_initialized() else tuple(self.ranks or ()))

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet()
global_process_set.process_set_id = 0


def _is_global(process_set: ProcessSet) -> bool:
    return process_set is global_process_set or process_set.process_set_id == 0


def registered(process_set: ProcessSet) -> ProcessSet:
    """`process_set` as added on this rank; ValueError for a set never added
    (or removed, or with another set's id)."""
    if _is_global(process_set):
        return global_process_set
    added = _State.process_sets.get(process_set.process_set_id)  # type: ignore[arg-type]
    if added is None or added.ranks != process_set.ranks:
        raise ValueError(
            f"{process_set!r} was not added: pass it to hvd.init(process_sets=...) or "
            "hvd.add_process_set() on every rank first")
    return added


def check_process_set(process_set: ProcessSet) -> None:
    """Raises ValueError unless `process_set` is the global set or an added one."""
    registered(process_set)


def init(comm: Optional[Sequence[int]] = None,
         process_sets: Optional[Sequence[ProcessSet]] = None) -> None:
    """Joins this process to its job's box (idempotent), as `hvd.init()`.

    Args:
      comm: Horovod's MPI communicator or list of ranks: only None or all ranks.
      process_sets: process sets to add (see `add_process_set`), or "dynamic".
    """
    if comm is not None and list(comm) != list(range(env_lib.detect().size)):
        raise NotImplementedError(
            "tf_smb.horovod.init(comm=...): only the whole job (comm=None) is supported")
    if _State.job is None:
        env = os.environ
        check_horovod_variables(env)
        if env.get("HOROVOD_TIMELINE") and not timeline_lib.enabled():
            timeline_lib.enable(env["HOROVOD_TIMELINE"])
        elastic = bool(env.get(elastic_protocol.DIR_VAR))
        # (Across nodes every generation is a new mpirun: all its processes are new.)
        joining = (elastic and int(env.get(elastic_protocol.GENERATION_VAR, "0") or 0) > 0
                   and not env.get(elastic_protocol.ACROSS_NODES_VAR))
        job = env_lib.detect()
        # A process that joins a running elastic job is on its own until its
        # state is synced with the others' (`join_pending`, at hvd.elastic.run).
        smb_ops.init(_alone_in(job) if joining else job)
        _State.job = job
        _State.pending = job if joining else None
        if elastic:  # made here, eagerly: graphs only read it
            with tf.init_scope():
                _State.world = tf.Variable(1 if joining else job.size, trainable=False,
                                           dtype=tf.int32, name="tf_smb_elastic_world")
        where = env_lib.placement(job, env)
        _State.local_rank, _State.local_size = where.local_rank, where.local_size
        _State.cross_rank, _State.cross_size = where.cross_rank, where.cross_size
        if job.spans_nodes:
            # The link knows each rank's node whatever the launcher set (nodes
            # may run different numbers of ranks).
            _State.nodes = smb_ops.nodes_of_ranks()
            _State.local_rank, _State.local_size, _State.cross_rank, _State.cross_size = (
                _placement_on(_State.nodes, job.rank))
    if isinstance(process_sets, str):  # Horovod's "dynamic": sets may be added later
        return
    for process_set in process_sets or ():
        add_process_set(process_set)


def elastic_world() -> Optional[tf.Variable]:
    """In an elastic job (started by tf_smb.run --min-np/--max-np/...): a variable
    holding the job's current size, which graphs read when they run, so that a
    tf.function traced before the members changed averages over those after;
    None in other jobs (the size is fixed: graphs take it as a constant)."""
    return _State.world


def size_may_change() -> bool:
    """Whether the job's size may change while graphs built now still run (an
    elastic job): then no collective may be left out of a graph because the job
    has one rank now."""
    return _State.world is not None


def _alone_in(job: env_lib.JobInfo) -> env_lib.JobInfo:
    """A job of this process alone (no box), while it belongs to `job`."""
    return env_lib.JobInfo(rank=0, size=1, job_id=f"{job.job_id}-alone-{os.getpid()}",
                           box_created=True, launcher=job.launcher)


def work_alone(job: env_lib.JobInfo) -> None:
    """Elastic jobs: this process belongs to `job`, the next generation (its
    size and ranks are `job`'s), but its collectives run over itself alone
    until `join_pending`: what a process does between a change of the members
    and the sync of the state (Horovod's reset callbacks; a new process's code
    before hvd.elastic.run) then needs no other process to do the same."""
    smb_ops.rejoin(_alone_in(job))
    rejoined(job)
    _State.pending = job
    if _State.world is not None:
        _State.world.assign(1)


def join_pending() -> None:
    """Elastic jobs: joins the generation `work_alone` (or `init`, in a process
    that joined a running job) set aside; its collectives are the job's again."""
    job, _State.pending = _State.pending, None
    if job is None:
        return
    smb_ops.rejoin(job)
    if _State.world is not None:
        _State.world.assign(job.size)


def rejoined(job: env_lib.JobInfo) -> None:
    """Horovod's state once this process joined `job`, the next generation of an
    elastic job (tf_smb.horovod.elastic): size, ranks and placement are the new
    job's; the process sets added before are gone with the old job."""
    _State.job = job
    where = env_lib.placement(job, {})
    _State.local_rank, _State.local_size = where.local_rank, where.local_size
    _State.cross_rank, _State.cross_size = where.cross_rank, where.cross_size
    for process_set in _State.process_sets.values():
        process_set.process_set_id = None
    _State.process_sets = {}
    if _State.world is not None:
        _State.world.assign(job.size)


def shutdown() -> None:
    """Horovod's shutdown: tf_smb keeps the job's box for the process's life (a
    later `init` is a no-op); this leaves the added process sets."""
    for set_id, process_set in list(_State.process_sets.items()):
        if process_set.included():
            smb_ops.close_process_set(set_id)
        process_set.process_set_id = None
    _State.process_sets = {}


def is_initialized() -> bool:
    """Whether `init` has run in this process."""
    return _State.job is not None


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Records tf_smb's timeline (tf_smb.timeline) to `file_path`, as Horovod's
    start_timeline. tf_smb's recorder starts when the process joins its job, so
    call it before `init` (or set HOROVOD_TIMELINE); after `init` only the path
    already being recorded is accepted. `mark_cycles` has no meaning here."""
    del mark_cycles
    wanted = os.path.abspath(file_path)
    if timeline_lib.enabled():
        if timeline_lib.path() != wanted:
            raise ValueError(f"a timeline is already being recorded to {timeline_lib.path()}; "
                             f"cannot switch to {wanted}")
        return
    if _State.job is not None:
        raise ValueError("tf_smb records a timeline from the moment the process joins its "
                         "job: call start_timeline before hvd.init(), or set "
                         "HOROVOD_TIMELINE (or TF_SMB_TIMELINE) for every worker")
    timeline_lib.enable(wanted)


def stop_timeline() -> None:
    """Writes this worker's timeline so far (recording goes on until exit)."""
    timeline_lib.flush()


def _job() -> env_lib.JobInfo:
    if _State.job is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _State.job


def size() -> int:
    """The number of processes in the job."""
    return _job().size


def rank() -> int:
    """This process's rank, 0 <= rank < size."""
    return _job().rank


def local_size() -> int:
    """The number of processes on this node."""
    _job()
    return _State.local_size


def local_rank() -> int:
    """This process's rank among the processes on its node."""
    _job()
    return _State.local_rank


def cross_size() -> int:
    """The number of nodes (Horovod: processes with this local rank)."""
    _job()
    return _State.cross_size


def cross_rank() -> int:
    """This process's node index (Horovod: its rank among equal local ranks)."""
    _job()
    return _State.cross_rank


def is_homogeneous() -> bool:
    """Whether every node runs the same number of processes."""
    nodes = _nodes_of_ranks()
    return nodes is None or len(set(collections.Counter(nodes).values())) == 1


def _placement_on(nodes: Sequence[int], rank: int) -> "tuple[int, int, int, int]":
    """(local rank, local size, cross rank, cross size) of `rank`, given each
    rank's node, as Horovod defines them: the local rank orders a node's ranks
    by rank; the cross rank orders the ranks with this local rank by node."""
    mine = nodes[rank]
    local = [r for r, n in enumerate(nodes) if n == mine]
    local_rank = local.index(rank)
    firsts: Dict[int, List[int]] = {}
    for r, n in enumerate(nodes):
        firsts.setdefault(n, []).append(r)
    peers = sorted((n, ranks[local_rank]) for n, ranks in firsts.items() if len(ranks) > local_rank)
    return local_rank, len(local), [r for _, r in peers].index(rank), len(peers)


def _nodes_of_ranks() -> Optional[List[int]]:
    """Each rank's node when the job spans nodes (from the link, at init)."""
    if not _job().spans_nodes:
        return None
    return _State.nodes


def add_process_set(process_set: Union[Sequence[int], ProcessSet]) -> ProcessSet:
    """Adds a process set; every rank of the job calls it with the same ranks,
    and the set's ranks open its box. Returns the set, its id assigned.
    The whole job's ranks give the global set (id 0)."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    world = size()
    ranks = process_set.ranks
    # Every rank must add the same set at the same point: a disagreement fails
    # on every rank alike (and the job goes on); the checks below then give
    # every rank the same verdict.
    smb_ops.run_now(lambda: smb_ops.barrier(agreement=f"hvd.add_process_set\nranks={ranks}"))
    if ranks is None or ranks == list(range(world)):
        process_set.process_set_id = 0
        return process_set
    if not ranks or len(set(ranks)) != len(ranks) or ranks[0] < 0 or ranks[-1] >= world:
        raise ValueError(f"hvd.add_process_set: expected distinct ranks in [0, {world}), "
                         f"got {ranks}")
    for existing in _State.process_sets.values():
        if existing.ranks == ranks:
            raise ValueError(f"hvd.add_process_set: a process set with ranks {ranks} "
                             f"already exists (id {existing.process_set_id})")
    nodes = _nodes_of_ranks()
    per_node = collections.Counter(nodes[r] for r in ranks) if nodes is not None else {}
    spans = len(per_node) > 1  # (its nodes may hold different numbers of its ranks)
    set_id = _State.next_set_id
    _State.next_set_id += 1
    if rank() in ranks:
        smb_ops.open_process_set(set_id, ranks, across_nodes=spans)
        # Every member has its box open before any of its collectives.
        smb_ops.run_now(lambda: smb_ops.barrier(
            agreement="hvd.add_process_set\ncollective=opened", process_set=set_id))
    process_set.process_set_id = set_id
    _State.process_sets[set_id] = process_set
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Removes an added process set (every rank calls it); False for the global
    set or one not added."""
    if _is_global(process_set) or _State.process_sets.get(
            process_set.process_set_id) is not process_set:  # type: ignore[arg-type]
        return False
    set_id = process_set.process_set_id
    smb_ops.run_now(lambda: smb_ops.barrier(
        agreement=f"hvd.remove_process_set\nranks={process_set.ranks}"))
    if process_set.included():
        smb_ops.close_process_set(set_id)  # type: ignore[arg-type]
    del _State.process_sets[set_id]  # type: ignore[arg-type]
    process_set.process_set_id = None
    return True


# Capabilities, answered for what tf_smb is: CPU collectives through the box,
# across nodes over Open MPI; no NCCL, Gloo, oneCCL, DDL or ROCm.
def mpi_threads_supported() -> bool:
    """Horovod's query; tf_smb's cross-node link runs MPI from its own thread."""
    return True


def mpi_enabled() -> bool:
    """True when this job joins nodes over MPI."""
    return bool(_State.job is not None and _State.job.spans_nodes)


def mpi_built() -> bool:
    """tf_smb's cross-node link is built on Open MPI."""
    return True


def gloo_enabled() -> bool:
    """tf_smb does not use Gloo."""
    return False


def gloo_built() -> bool:
    """tf_smb does not use Gloo."""
    return False


def nccl_built() -> int:
    """tf_smb has no NCCL operations."""
    return 0


def ddl_built() -> bool:
    """tf_smb has no DDL operations."""
    return False


def ccl_built() -> bool:
    """tf_smb has no oneCCL operations."""
    return False


def cuda_built() -> bool:
    """tf_smb's collectives run on the CPU."""
    return False


def rocm_built() -> bool:
    """tf_smb's collectives run on the CPU."""
    return False


def _constant_op(value_fn, name: Optional[str]) -> tf.Tensor:
    return tf.constant(value_fn(), dtype=tf.int32, name=name)


def _set_of_id(process_set_id: int) -> ProcessSet:
    if process_set_id == 0:
        return global_process_set
    if process_set_id not in _State.process_sets:
        raise ValueError(f"no process set has id {process_set_id}: add it with "
                         "hvd.add_process_set() first")
    return _State.process_sets[process_set_id]


def size_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """The size of process set `process_set_id` (0: the job) as an int32 tensor."""
    return _constant_op(_set_of_id(process_set_id).size, name)


def local_size_op(name: Optional[str] = None) -> tf.Tensor:
    """`local_size()` as an int32 tensor."""
    return _constant_op(local_size, name)


def rank_op(name: Optional[str] = None) -> tf.Tensor:
    """`rank()` as an int32 tensor."""
    return _constant_op(rank, name)


def local_rank_op(name: Optional[str] = None) -> tf.Tensor:
    """`local_rank()` as an int32 tensor."""
    return _constant_op(local_rank, name)


def process_set_included_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """1 when this process is in process set `process_set_id`, else 0."""
    process_set = _set_of_id(process_set_id)
    return _constant_op(lambda: int(process_set.included()), name)
