"""The SMB TensorFlow ops: loading the library and thin Python wrappers.

Every worker calls the same collectives with tensors of the same dtypes and
shapes; a disagreement raises InvalidArgumentError on every worker. Works
eagerly, inside tf.function and in TF1-style graphs. Inside a graph the
workers match collectives by call site (graph, op, loop iteration), so
collectives that TensorFlow may run in any order (no data dependency between
them) still pair up correctly; eagerly, they pair in program order. After a
failed collective every later one fails at once with the same error.
"""
from __future__ import annotations

import atexit
import os
import re
import sys
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

import tensorflow as tf

from tf_smb import env as env_lib

_LIB = None
_JOB: Optional[env_lib.JobInfo] = None

# The C++ core's defaults (cc/smb/defaults.h): seconds a collective waits for the
# other workers before failing, the staging buffer per worker, and the heap (sparse:
# only what result buffers and segments use costs memory).
from tf_smb._box import (DEFAULT_HEAP_BYTES, DEFAULT_STAGING_BYTES,  # noqa: E402
                         DEFAULT_TIMEOUT_S)


def _library():
    global _LIB
    if _LIB is None:
        # Built for the running TensorFlow at install time, or compiled on first use.
        from tf_smb import op_library
        _LIB = op_library.load()
    return _LIB


def _float_env(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return float(value)
    except ValueError as e:
        raise ValueError(f"{name} must be a number, got {value!r}") from e


def _box_settings(timeout_s: Optional[float], staging_bytes: Optional[int] = None,
                  heap_bytes: Optional[int] = None) -> Dict[str, Any]:
    """smb_init's timeout, staging and heap attributes: the given values, else the
    environment's ($TF_SMB_TIMEOUT, $TF_SMB_STAGING_BYTES, $TF_SMB_HEAP_BYTES),
    else the core's defaults."""
    if timeout_s is None:
        timeout_s = _float_env("TF_SMB_TIMEOUT", DEFAULT_TIMEOUT_S)
    if staging_bytes is None:
        staging_bytes = int(_float_env("TF_SMB_STAGING_BYTES", DEFAULT_STAGING_BYTES))
    if heap_bytes is None:
        heap_bytes = int(_float_env("TF_SMB_HEAP_BYTES", DEFAULT_HEAP_BYTES))
    return dict(timeout_seconds=float(timeout_s), staging_bytes=int(staging_bytes),
                heap_bytes=int(heap_bytes))


def init(job: Optional[env_lib.JobInfo] = None, timeout_s: Optional[float] = None,
         staging_bytes: Optional[int] = None,
         heap_bytes: Optional[int] = None) -> env_lib.JobInfo:
    """Joins this process to its job's box (idempotent).

    Args:
      job: where this process sits; detected from the launcher if None.
      timeout_s: how long any collective waits for the others
        (default: $TF_SMB_TIMEOUT or DEFAULT_TIMEOUT_S).
      staging_bytes: staging buffer per worker, used when this process creates
        the box (default: $TF_SMB_STAGING_BYTES or DEFAULT_STAGING_BYTES).
      heap_bytes: room for all-reduce result buffers and parameter segments
        (async mode), used when this process creates the box (default:
        $TF_SMB_HEAP_BYTES or DEFAULT_HEAP_BYTES, sparse). Without room, sums are
        copied out.
    Returns:
      The job this process joined.
    """
    return _join(job or env_lib.detect(), _box_settings(timeout_s, staging_bytes, heap_bytes))


def rejoin(job: env_lib.JobInfo, timeout_s: Optional[float] = None) -> env_lib.JobInfo:
    """Leaves the job this process joined and joins `job` instead, in this
    process (elastic training: the members changed, so each survivor, and each
    process that comes, joins the next job, whose box its launcher made or its
    rank 0 makes). Collectives of the old job fail from then on.

    Returns:
      The job this process joined.
    """
    return _join(job, _box_settings(timeout_s), leave_first=True)


def _join(job: env_lib.JobInfo, settings: Dict[str, Any],
          leave_first: bool = False) -> env_lib.JobInfo:
    """Joins `job` (leaving the one joined before with `leave_first`); the job."""
    global _JOB

    def join():
        return _library().smb_init(
            job_id=job.job_id, rank=job.rank, world=job.size,
            create=(job.rank == 0 and not job.box_created and job.size > 1),
            across_nodes=job.spans_nodes, rejoin=leave_first, **settings)

    run_now(join)
    if not _ANNOUNCING and job.size > 1:
        _announce_leaving()
    _JOB = job
    return job


_ANNOUNCING = False  # whether this process tells the others when it leaves


def _announce_leaving() -> None:
    """At this program's end, tells the other workers it left the job (and
    whether with an uncaught error), so one still waiting for it in a
    collective fails at once saying so, rather than "exited or died" once the
    process is gone. A killed process says nothing: that stays "exited or died"."""
    global _ANNOUNCING
    _ANNOUNCING = True
    raised = []
    previous_hook = sys.excepthook

    def excepthook(kind, value, traceback):
        raised.append(kind)
        previous_hook(kind, value, traceback)

    def leave() -> None:
        try:
            _library().smb_leave(raised=bool(raised))
        except Exception:  # pylint: disable=broad-except
            pass  # the box may be gone already: nothing left to tell

    sys.excepthook = excepthook
    # Registered now, so it runs after the exit handlers registered later
    # (atexit runs them last-first): theirs may still run collectives.
    atexit.register(leave)


def run_now(make_op: Callable[[], Any]) -> Any:
    """Runs the ops `make_op` makes at once and returns their values, also from
    inside a tf.function or a TF1-style graph (where an op added to the user's
    graph would only run in a session: they run in a session of our own)."""
    with tf.init_scope():
        if tf.executing_eagerly():
            return tf.nest.map_structure(
                lambda t: t.numpy() if hasattr(t, "numpy") else t, make_op())
        with tf.Graph().as_default() as graph:
            ops = make_op()
        with tf.compat.v1.Session(graph=graph) as session:
            return None if ops is None else session.run(ops)


def job() -> env_lib.JobInfo:
    """The job this process joined (joins it first if needed)."""
    return _JOB if _JOB is not None else init()


def rank() -> int:
    """This worker's index."""
    return job().rank


def size() -> int:
    """The number of workers."""
    return job().size


# Collectives created so far in each graph: part of their call-site keys.
_SITES_PER_GRAPH: "weakref.WeakKeyDictionary[tf.Graph, int]" = weakref.WeakKeyDictionary()


def call_site(kind: str) -> str:
    """The key the workers match this collective by ("" when eager).

    In a graph: the enclosing graphs' names (numeric suffixes dropped, since
    TensorFlow draws them from a per-process counter) and the collective's
    index among those created in its graph. Every worker traces the same code,
    so the key is the same on every worker; the kernel adds the node's name
    and its loop iteration (cc/kernels/smb_kernels.cc).
    """
    if tf.executing_eagerly():
        return ""
    graph = tf.compat.v1.get_default_graph()
    index = _SITES_PER_GRAPH.get(graph, 0)
    _SITES_PER_GRAPH[graph] = index + 1
    names = []
    g = graph
    while g is not None:
        names.append(re.sub(r"_\d+$", "", getattr(g, "name", None) or "graph"))
        g = getattr(g, "outer_graph", None)
    return "/".join(reversed(names)) + f"/{kind}{index}"


# The process sets this process opened: set id -> this process's index in it.
_PROCESS_SETS: Dict[int, int] = {}


def open_process_set(set_id: int, ranks: Sequence[int],
                     timeout_s: Optional[float] = None, across_nodes: bool = False) -> None:
    """Opens process set `set_id` (> 0): the job's workers `ranks`, with a box
    of their own (`across_nodes`: the ranks are on several nodes, each with as
    many of them; a box per node, joined over MPI). Every worker in `ranks`
    calls it (the first one of a node makes the box, the others wait for it);
    the collectives given `process_set=set_id` then run among those workers
    only, with ranks and roots counted within the set (the index in `ranks`)."""
    job_info = job()
    ranks = [int(r) for r in ranks]
    if set_id <= 0 or job_info.rank not in ranks:
        raise ValueError(f"open_process_set: expected a positive set id and a set holding "
                         f"this worker (rank {job_info.rank}); got id {set_id}, ranks {ranks}")
    index = ranks.index(job_info.rank)
    settings = _box_settings(timeout_s)
    run_now(lambda: _library().smb_init(
            job_id=f"{job_info.job_id[:80]}-ps{set_id}", rank=index, world=len(ranks),
            create=index == 0, across_nodes=bool(across_nodes), process_set=int(set_id),
            members=ranks if across_nodes else [], **settings))
    _PROCESS_SETS[int(set_id)] = index


def close_process_set(set_id: int) -> None:
    """Leaves process set `set_id`; its collectives fail afterwards."""
    run_now(lambda: _library().smb_close_process_set(process_set=int(set_id)))
    _PROCESS_SETS.pop(int(set_id), None)


def _rank_in(process_set: int) -> int:
    return rank() if process_set == 0 else _PROCESS_SETS.get(process_set, -1)


def allreduce(tensors: Sequence[tf.Tensor], agreement: str = "",
              process_set: int = 0) -> List[tf.Tensor]:
    """Sums each tensor over all workers, fused into one collective.

    Dtypes: float32, float64, float16, bfloat16, int8, uint8, int16, uint16,
    int32, int64. Differentiable: the gradient of a sum over workers is the
    sum of the upstream gradients over workers.

    Large sums (256 KiB or more in all) stay in the box: the returned tensors
    point at memory every worker reads, which TensorFlow treats as read-only
    (ops write their results elsewhere). Do not write into them through
    other frameworks (e.g. DLPack).

    `agreement` ("NAME\nfield=value;..."): what else the workers must agree
    on; with it, workers that disagree all get FailedPreconditionError naming
    the fields that differ, nothing is summed, and the job goes on (without
    it a disagreement stops the job). `process_set`: 0 for every worker, or a
    set opened with `open_process_set`.
    """
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    return list(_library().smb_all_reduce(tensors, key=call_site("allreduce"),
                                          agreement=agreement, process_set=process_set))


def replica_sum(parts: Sequence[Sequence[tf.Tensor]]) -> List[tf.Tensor]:
    """Sums the local replicas' parts of each value inside this process.

    `parts[i]` holds value i's part from every local replica (same dtype and
    shape). All values are summed in one op by SingleCaffe's partitioned
    reduction: one thread per replica sums its slice of every value.
    """
    parts = [[tf.convert_to_tensor(p) for p in value] for value in parts]
    if not parts:
        return []
    replicas = len(parts[0])
    if any(len(value) != replicas for value in parts):
        raise ValueError("replica_sum: every value needs one part per replica; got "
                         f"{[len(value) for value in parts]} parts")
    if replicas == 1:
        return [value[0] for value in parts]
    flat = [p for value in parts for p in value]
    return list(_library().smb_replica_sum(flat, S=[value[0].dtype for value in parts],
                                           replicas=replicas))


def server_push(variable: tf.Variable, update: tf.Tensor, learning_rate: Any = 0.0,
                rule: str = "delta", momentum: float = 0.0, consistent: bool = True) -> Any:
    """Hands an update of `variable` to this process's parameter-server thread
    and returns at once: "delta" (w += update), "sgd" (w -= learning_rate *
    update) or "momentum". The thread applies updates one at a time in the
    order they came; with `consistent` a value already read is never changed."""
    return _library().smb_server_push(
        variable.handle, update, tf.cast(learning_rate, tf.float32), rule=rule,
        momentum=float(momentum), consistent=consistent)


def server_push_segment(update: tf.Tensor, name: str, learning_rate: Any = 0.0,
                        rule: str = "delta", momentum: float = 0.0) -> Any:
    """Hands an update of box segment `name` to this process's parameter-server
    thread and returns at once; the thread applies it in the box after the
    updates that came before it (rules as in `server_push`)."""
    return _library().smb_server_push_segment(
        update, tf.cast(learning_rate, tf.float32), segment=name, rule=rule,
        momentum=float(momentum))


def server_wait(max_pending: Any = 0, timeout_s: float = DEFAULT_TIMEOUT_S) -> tf.Tensor:
    """Waits until the parameter-server thread has at most `max_pending`
    updates left (0: all applied); returns how many it applied so far."""
    return _library().smb_server_wait(tf.cast(max_pending, tf.int64),
                                      timeout_seconds=float(timeout_s))


def broadcast(tensors: Sequence[tf.Tensor], root: int = 0, agreement: str = "",
              process_set: int = 0) -> List[tf.Tensor]:
    """Every worker gets worker `root`'s tensors (bool is carried as int32).

    Differentiable as in Horovod: on `root` the gradient is the sum of the
    upstream gradients over workers, elsewhere zero. `agreement` and
    `process_set` (`root` is then an index in the set): as allreduce's.
    """
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    as_int = [t.dtype == tf.bool for t in tensors]
    sent = [tf.cast(t, tf.int32) if b else t for t, b in zip(tensors, as_int)]
    got = _library().smb_broadcast(sent, root=root, key=call_site("broadcast"),
                                   agreement=agreement, process_set=process_set)
    return [tf.cast(g, tf.bool) if b else g for g, b in zip(got, as_int)]


def barrier(agreement: str = "", process_set: int = 0) -> Optional[tf.Operation]:
    """Returns once every worker (of `process_set`) has reached it (in a graph:
    the op that does). `agreement`, `process_set`: as allreduce's."""
    return _library().smb_barrier(key=call_site("barrier"), agreement=agreement,
                           process_set=process_set)


def join() -> tf.Tensor:
    """Horovod's join, job-wide, on one node: this worker has no more data.
    Until every worker has joined, it takes part in the others' all-reduces
    (adding zeros), broadcasts and barriers; then every worker gets the rank
    that joined last (an int32 scalar)."""
    return _library().smb_join()


def place_rows(tensors: Sequence[tf.Tensor], counts: Any, rank: int) -> List[tf.Tensor]:
    """Each tensor in zeros at rank `rank`'s offset along the first dimension:
    `counts[r, i]` (int64 [ranks, len(tensors)]) is rank r's number of rows of
    tensor i, so placed tensor i has sum(counts[:, i]) rows, and the sum over
    ranks of the placed tensors is every rank's rows in rank order (an
    allgather on `allreduce`). InvalidArgumentError when `counts[rank, i]` is
    not tensor i's first dimension."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    return list(_library().smb_place_rows(tensors, tf.cast(counts, tf.int64), rank=rank))


def take_rows(tensors: Sequence[tf.Tensor], counts: Any, rank: int) -> List[tf.Tensor]:
    """`place_rows`' inverse: rank `rank`'s rows of each tensor, which has
    sum(counts[:, i]) rows."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    return list(_library().smb_take_rows(tensors, tf.cast(counts, tf.int64), rank=rank))


def received_rows(total: tf.Tensor, matrix: Any, rank: int) -> tf.Tensor:
    """The rows rank `rank` receives in an all-to-all whose `matrix[r, j]`
    (int64 [ranks, ranks]) rows go from rank r to rank j, from `total`: every
    rank's sent rows in rank order (the sum over ranks of each rank's rows
    placed with `place_rows` at counts matrix.sum(axis=1))."""
    return _library().smb_received_rows(total, tf.cast(matrix, tf.int64), rank=rank)


def _output_grads(op, grads) -> List[tf.Tensor]:
    """The gradients of `op`'s outputs, zeros (shaped like the output) where none
    flows back."""
    return [tf.zeros_like(y) if g is None else tf.convert_to_tensor(g)
            for y, g in zip(op.outputs, grads)]


@tf.RegisterGradient("SmbAllReduce")
def _allreduce_grad(op, *grads):
    return allreduce(_output_grads(op, grads), process_set=op.get_attr("process_set"))


@tf.RegisterGradient("SmbBroadcast")
def _broadcast_grad(op, *grads):
    process_set = op.get_attr("process_set")
    summed = allreduce(_output_grads(op, grads), process_set=process_set)
    if _rank_in(process_set) == op.get_attr("root"):
        return summed
    return [tf.zeros_like(g) for g in summed]


@tf.RegisterGradient("SmbPlaceRows")
def _place_rows_grad(op, *grads):
    return [*take_rows(_output_grads(op, grads), op.inputs[-1], op.get_attr("rank")), None]


@tf.RegisterGradient("SmbTakeRows")
def _take_rows_grad(op, *grads):
    return [*place_rows(_output_grads(op, grads), op.inputs[-1], op.get_attr("rank")), None]


# ---- Asynchronous mode: parameters living in the box ------------------------

def segment_create(value: tf.Tensor, name: str, write: bool) -> None:
    """Creates or attaches box segment `name` shaped like `value`; `write` stores it."""
    _library().smb_segment_create(value, segment=name, write=write)


def segment_read(name: str, dtype: tf.DType, shape: Sequence[int],
               consistent: bool = True) -> tf.Tensor:
    """The segment's current value; `consistent` never returns a half-written
    stripe (cc/smb/segment/segment_io.h)."""
    return _library().smb_segment_read(T=dtype, shape=list(shape), segment=name,
                                     consistent=consistent)


def segments_push_read(variables: Sequence[tf.Variable], names: Sequence[str],
                       deltas: Sequence[tf.Tensor] = (), read: bool = True,
                       consistent: bool = True) -> Optional[tf.Operation]:
    """A step's box traffic for many variables in one op: segment `names[i]` +=
    `deltas[i]` for the first len(deltas) variables; then, with `read`, every
    variable = its segment's value (a pushed one in the same pass, right after
    its push), straight into the variable's buffer; a value of the variable
    read before keeps what it held. Each variable and delta has its segment's
    dtype and shape. Returns the op in a graph, None when executed eagerly."""
    if len(names) != len(variables) or len(deltas) > len(variables):
        raise ValueError(f"segments_push_read: want one name per variable and at most one "
                         f"delta per variable, got {len(names)} names, {len(variables)} "
                         f"variables and {len(deltas)} deltas")
    if not variables:
        return None
    return _library().smb_segments_push_read([v.handle for v in variables], list(deltas),
                                             segments=list(names), read=read,
                                             consistent=consistent)


def nodes_of_ranks() -> List[int]:
    """The node of each job rank, as the job's link numbers them (ranks that
    share a box share a node; all 0 on one node): the truth under any launcher,
    whatever its variables say. Needs `init` first."""
    return [int(n) for n in run_now(lambda: _library().smb_nodes_of_ranks())]


def segment_home(name: str) -> int:
    """The node whose box holds segment `name`: 0 on one node. Across nodes each
    segment goes, in creation order, to the node holding the fewest segment bytes
    so far (ties: the lowest node); -1 when this process did not create it."""
    return int(_library().smb_segment_home(segment=name))


def segment_push(delta: tf.Tensor, name: str) -> None:
    """segment += delta in the box, atomically per segment."""
    _library().smb_segment_push(delta, segment=name)


def segment_apply_sgd(grad: tf.Tensor, learning_rate: tf.Tensor, name: str,
                    momentum: float = 0.0) -> Optional[tf.Operation]:
    """The box applies an SGD (or momentum) step to the segment. Returns the op
    in a graph, None when executed eagerly."""
    return _library().smb_segment_apply_sgd(grad, tf.cast(learning_rate, tf.float32),
                                   segment=name, momentum=float(momentum))


def clock_tick(staleness: Optional[int]) -> tf.Tensor:
    """Starts this worker's next step within the staleness bound; returns its lead."""
    return _library().smb_clock_tick(staleness=-1 if staleness is None else int(staleness))


def clock_finish(finished: bool = True) -> None:
    """Marks this worker finished training (or training again)."""
    _library().smb_clock_finish(finished=finished)


def wait_all_finished() -> None:
    """Waits until every live worker has finished training."""
    _library().smb_wait_all_finished()
