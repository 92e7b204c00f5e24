"""Horovod's collectives on the box: allreduce (Sum, Average, Min, Max,
Product, pre/postscale), allgather, broadcast, alltoall, reducescatter, their
grouped forms, barrier and join, with Horovod's gradients.

Recoverable disagreement: every collective of a Horovod op carries a
description (kind, reduce op, root, number of tensors, dtypes and shapes:
`agreement`) that the box compares in the agreement round it holds anyway.
When the ranks disagree, every rank raises FailedPreconditionError naming
what differs and each rank's value, before any data moves, and the next
collective works (the box's collectives without a description stop the job
on a mismatch, tf_smb/ops.py).

Process sets: the collectives built inside `within(scope_of(process_set))` run
among that set's ranks only (ranks and sizes are the set's; roots are job ranks,
mapped to the set's); their ops carry the set's id (tf_smb.ops' `process_set`).

How they move data: Sum and Average are the box's all-reduce (reduced in the
box). Allgather, alltoall, Min, Max and Product are built on it too: each rank
places its rows into a zero buffer at its own offset and the box sums the
buffers, so every rank reads all rows (this moves size x the bytes of a
dedicated gather; exact, since x + 0 == x).
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import zlib
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_smb import ops as smb_ops
from tf_smb.horovod import basics

# Horovod's reduce op values (horovod/tensorflow/mpi_ops.py).
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max",
             Product: "Product", -1: "none"}
_SUMMABLE = (tf.float32, tf.float64, tf.float16, tf.bfloat16, tf.int8, tf.uint8, tf.int16,
             tf.uint16, tf.int32, tf.int64)
# The other tensors of a grouped collective are named in full up to this long,
# then by a digest (the box compares 2 KiB of description per rank).
_MAX_REST_TEXT = 400


@dataclasses.dataclass(frozen=True)
class SetScope:
    """The process set the collectives built now run in: its id (0: the job),
    this rank's index in it, its size, and its job ranks in order."""
    set_id: int
    rank: int
    size: int
    members: Tuple[int, ...]


_CURRENT = threading.local()


def _job_scope() -> SetScope:
    world = basics.size()
    return SetScope(0, basics.rank(), world, tuple(range(world)))


def scope() -> SetScope:
    """The process set of the collectives being built (the job outside `within`)."""
    current = getattr(_CURRENT, "scope", None)
    return current if current is not None else _job_scope()


def scope_of(process_set: basics.ProcessSet) -> SetScope:
    """`process_set` as a scope; ValueError when it was not added, and
    InvalidArgumentError on a rank that is not in it (only members call its
    collectives)."""
    added = basics.registered(process_set)
    if added is basics.global_process_set:
        return _job_scope()
    members = tuple(added.ranks or ())
    if basics.rank() not in members:
        raise tf.errors.InvalidArgumentError(
            None, None, f"rank {basics.rank()} is not in process set "
            f"{added.process_set_id} (ranks {list(members)}): only its ranks run its "
            "collectives")
    return SetScope(int(added.process_set_id or 0), members.index(basics.rank()),
                    len(members), members)


@contextlib.contextmanager
def within(set_scope: SetScope) -> Iterator[None]:
    """Builds the collectives inside in `set_scope`'s process set (gradients
    built later re-enter the scope their forward pass had)."""
    previous = getattr(_CURRENT, "scope", None)
    _CURRENT.scope = set_scope
    try:
        yield
    finally:
        _CURRENT.scope = previous


def _this_rank() -> int:
    return scope().rank


def _world() -> int:
    return scope().size


def world() -> int:
    """The size of the process set being built in."""
    return _world()


def _allreduce(tensors: Sequence[tf.Tensor], agreed: str = "") -> List[tf.Tensor]:
    return smb_ops.allreduce(tensors, agreed, process_set=scope().set_id)


def _broadcast(tensors: Sequence[tf.Tensor], root: int, agreed: str) -> List[tf.Tensor]:
    return smb_ops.broadcast(tensors, root, agreed, process_set=scope().set_id)


# ---- Agreement --------------------------------------------------------------

def _dims_text(t: tf.Tensor, first_free: bool) -> str:
    dims = t.shape.as_list()
    return "[" + ", ".join("*" if first_free and i == 0 else "?" if d is None else str(d)
                           for i, d in enumerate(dims)) + "]"


def agreement(kind: str, tensors: Sequence[tf.Tensor], op: int = -1, root: int = -1,
              first_free: bool = False) -> str:
    """What every rank must agree on for this collective, as the box compares it
    (tf_smb.ops.allreduce's `agreement`): the collective, reduce op, root rank,
    number of tensors, and dtype and shape of each tensor (`first_free`: the
    first dimension may differ per rank). Every collective of a Horovod op
    carries it, so a disagreement fails on every rank with FailedPreconditionError
    naming the fields that differ and each rank's value, before any data moves,
    and the job goes on. It rides on the box's own agreement round: no extra
    round trip, no extra graph node. Dimensions unknown when traced ("?") are
    compared when the collective runs, through the shapes the box describes."""
    for t in tensors:
        if t.shape.rank is None:
            raise ValueError(f"hvd.{kind}: tensors need a known number of dimensions")
    fields = [("collective", kind), ("reduce op", _OP_NAMES.get(op, str(op))),
              ("root rank", str(root)), ("number of tensors", str(len(tensors)))]
    if tensors:
        fields += [("dtype", tensors[0].dtype.name),
                   ("shape", _dims_text(tensors[0], first_free))]
    if len(tensors) > 1:
        rest = ",".join(t.dtype.name + _dims_text(t, first_free) for t in tensors[1:])
        if len(rest) > _MAX_REST_TEXT:
            rest = f"digest {zlib.crc32(rest.encode()):08x}"
        fields.append(("dtypes and shapes of the other tensors", rest))
    return f"hvd.{kind}\n" + ";".join(f"{name}={value}" for name, value in fields)


def exchange(values: tf.Tensor, agreed: str = "") -> tf.Tensor:
    """Every rank's int64 vector `values` (agreed length), as [size, len]: each
    rank places its row in a zero matrix and the box sums them."""
    values = tf.cast(values, tf.int64)
    width, me, world = values.shape[0], _this_rank(), _world()
    static = tf.get_static_value(values)
    if static is not None:  # one constant node, not a scatter
        placed = np.zeros([world, width], np.int64)
        placed[me] = static
        return _allreduce([tf.constant(placed)], agreed)[0]
    placed = tf.scatter_nd(tf.constant([[me]], tf.int64), tf.reshape(values, [1, width]),
                           tf.constant([world, width], tf.int64))
    return _allreduce([placed], agreed)[0]


# ---- Dtype handling ---------------------------------------------------------

def _summable(kind: str, t: tf.Tensor) -> Tuple[tf.Tensor, Optional[tf.DType]]:
    """`t` in a dtype the box sums (bool as uint8), and the dtype to cast back to."""
    if t.dtype == tf.bool:
        return tf.cast(t, tf.uint8), tf.bool
    if t.dtype not in _SUMMABLE:
        raise TypeError(f"hvd.{kind}: dtype {t.dtype.name} is not supported; expected one of "
                        f"{', '.join(d.name for d in _SUMMABLE)} or bool")
    return t, None


def _restore(t: tf.Tensor, dtype: Optional[tf.DType]) -> tf.Tensor:
    return t if dtype is None else tf.cast(t, dtype)


def _average_divisor() -> Any:
    """What an average divides by: the size of the set being built in; in an
    elastic job's whole-job collectives, its size when the graph runs."""
    world = basics.elastic_world() if scope().set_id == 0 else None
    return world if world is not None else _world()


def _scale(t: tf.Tensor, factor: float = 1.0, divisor: Any = 1) -> tf.Tensor:
    """t * factor / divisor as Horovod scales on CPU: integers in float64, float16
    in float32, other floats in their own dtype. Dividing (not multiplying by
    1/divisor) keeps an average of equal values exact. `divisor`: an int, or a
    variable read when the graph runs (basics.elastic_world)."""
    at_run_time = isinstance(divisor, tf.Variable)
    if factor == 1.0 and not at_run_time and divisor == 1:
        return t
    wide = (tf.float64 if t.dtype.is_integer else
            tf.float32 if t.dtype in (tf.float16, tf.bfloat16) else t.dtype)
    x = tf.cast(t, wide)
    if factor != 1.0:
        x = x * tf.constant(factor, wide)  # not tf.cast(factor): that rounds via float32
    if at_run_time:
        x = x / tf.cast(divisor, wide)
    elif divisor != 1:
        x = x / tf.constant(divisor, wide)
    return tf.cast(x, t.dtype)


def _factor(value: Any) -> float:
    if isinstance(value, (tf.Tensor, tf.Variable)):
        return float(tf.get_static_value(value))
    return float(value)


# ---- Gathering on the sum ---------------------------------------------------

def _gather_on_sum(tensors: Sequence[tf.Tensor], counts: tf.Tensor,
                   agreed: str = "") -> List[tf.Tensor]:
    """Concatenates each tensor over ranks along dimension 0; `counts[r, i]` is
    rank r's first dimension of tensor i. Each rank places its rows in zeros
    at its own offset (one SmbPlaceRows node for all tensors: graph-mode runs
    pay for every node) and the box sums the placed tensors."""
    summable = [_summable("allgather", t) for t in tensors]
    placed = smb_ops.place_rows([t for t, _ in summable], counts, _this_rank())
    return [_restore(s, dtype) for s, (_, dtype) in zip(_allreduce(placed, agreed), summable)]


def _first_dims(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    dims = [t.shape[0] for t in tensors]
    if all(d is not None for d in dims):
        return tf.constant(dims, tf.int64)
    return tf.stack([tf.shape(t, out_type=tf.int64)[0] for t in tensors])


def _check_gatherable(kind: str, tensors: Sequence[tf.Tensor]) -> None:
    for t in tensors:
        if t.shape.rank == 0:
            raise tf.errors.InvalidArgumentError(
                None, None, f"hvd.{kind}: expected tensors of at least one dimension "
                "(concatenated along the first), got a scalar")


def grouped_allgather(tensors: Sequence[Any]) -> List[tf.Tensor]:
    """Each tensor concatenated over all ranks along dimension 0 (first
    dimensions may differ per rank). Gradient as Horovod's: this rank's rows of
    the average over ranks of the upstream gradient."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    _check_gatherable("allgather", tensors)
    agreed = agreement("allgather", tensors, first_free=True)
    counts = exchange(_first_dims(tensors), agreed)

    forward_scope = scope()

    @tf.custom_gradient
    def gathered(*xs):
        out = _gather_on_sum(xs, counts, agreed)

        def grad(*dys):
            with within(forward_scope):
                averaged = _average_sum([tf.cast(dy, x.dtype) for dy, x in zip(dys, xs)])
                return smb_ops.take_rows(averaged, counts, _this_rank())
        return out, grad
    out = gathered(*tensors)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _average_sum(tensors: Sequence[tf.Tensor]) -> List[tf.Tensor]:
    return [_scale(s, divisor=_average_divisor()) for s in _allreduce(list(tensors))]


def _reduce_by_gather(tensors: Sequence[tf.Tensor], op: int, agreed: str) -> List[tf.Tensor]:
    """Min, Max or Product: every rank's tensor stacked (each placed as one row),
    reduced here."""
    summable = [_summable("allreduce", t) for t in tensors]
    one_row_each = np.ones([_world(), len(tensors)], np.int64)
    placed = smb_ops.place_rows([tf.expand_dims(t, 0) for t, _ in summable], one_row_each,
                                _this_rank())
    reduce = {Min: tf.reduce_min, Max: tf.reduce_max, Product: tf.reduce_prod}[op]
    return [_restore(reduce(s, axis=0), dtype)
            for s, (_, dtype) in zip(_allreduce(placed, agreed), summable)]


# ---- Allreduce --------------------------------------------------------------

def grouped_allreduce_dense(tensors: Sequence[tf.Tensor], op: int, prescale: Any = 1.0,
                            postscale: Any = 1.0) -> List[tf.Tensor]:
    """Reduces dense tensors over all ranks, fused into one collective."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    if op == Adasum:
        raise NotImplementedError(
            "tf_smb.horovod does not implement the Adasum reduction; use hvd.Average "
            "(or hvd.Sum)")
    if op not in (Sum, Average, Min, Max, Product):
        raise ValueError(f"hvd.allreduce: unknown reduce op {op!r}; expected hvd.Sum, "
                         "hvd.Average, hvd.Min, hvd.Max or hvd.Product")
    prescale, postscale = _factor(prescale), _factor(postscale)
    for t in tensors:
        if t.dtype == tf.bool or t.dtype not in _SUMMABLE:
            raise TypeError(f"hvd.allreduce: dtype {t.dtype.name} is not supported; "
                            f"expected one of {', '.join(d.name for d in _SUMMABLE)}")
    agreed = agreement("allreduce", tensors, op=op)
    if op in (Min, Max, Product):
        return [_scale(r, postscale) for r in
                _reduce_by_gather([_scale(t, prescale) for t in tensors], op, agreed)]
    divisor = _average_divisor() if op == Average else 1
    sums = _allreduce([_scale(t, prescale) for t in tensors], agreed)
    return [_scale(s, postscale, divisor) for s in sums]


# ---- Broadcast --------------------------------------------------------------

def _root_index(kind: str, root: int) -> int:
    """The root's index in the process set (roots are named by job rank)."""
    members = scope().members
    if root not in members:
        expected = (f"0 <= root_rank < {len(members)}" if scope().set_id == 0
                    else f"root_rank in the process set's ranks {list(members)}")
        raise tf.errors.InvalidArgumentError(
            None, None, f"hvd.{kind}: expected {expected}, got {root}")
    return members.index(root)


def broadcast(tensor: Any, root_rank: int) -> tf.Tensor:
    """Rank `root_rank`'s value of `tensor` on every rank. Gradient as
    Horovod's: on the root the average over ranks, elsewhere zero."""
    tensor = tf.convert_to_tensor(tensor)
    root_rank = int(root_rank)
    root = _root_index("broadcast", root_rank)
    agreed = agreement("broadcast", [tensor], root=root_rank)
    forward_scope = scope()

    @tf.custom_gradient
    def broadcast_value(x):
        def grad(dy):
            with within(forward_scope):
                averaged = _average_sum([tf.cast(dy, x.dtype)])[0]
                # `* 0`, not zeros_like: Grappler folds zeros_like of a known shape
                # into a constant and would prune this rank's all-reduce.
                return averaged if _this_rank() == root else averaged * 0
        return _broadcast([x], root, agreed)[0], grad

    if tensor.dtype.is_floating:
        return broadcast_value(tensor)
    return _broadcast([tensor], root, agreed)[0]


# ---- Alltoall ---------------------------------------------------------------

def _alltoall_on_sum(x: tf.Tensor, matrix: tf.Tensor, agreed: str = "") -> tf.Tensor:
    """What this rank receives: matrix[r, j] rows go from rank r to rank j.
    Every rank places its rows at its offset among all sent rows, the box sums
    them, and each rank takes the blocks sent to it."""
    x, dtype = _summable("alltoall", x)
    sent = tf.reduce_sum(matrix, axis=1, keepdims=True)
    total = _allreduce(smb_ops.place_rows([x], sent, _this_rank()), agreed)[0]
    return _restore(smb_ops.received_rows(total, matrix, _this_rank()), dtype)


def alltoall(tensor: Any, splits: Any = None) -> Tuple[tf.Tensor, tf.Tensor]:
    """Sends splits[j] rows of `tensor` to rank j; returns what this rank
    received (in rank order) and how many rows came from each rank."""
    tensor = tf.convert_to_tensor(tensor)
    world = _world()
    _check_gatherable("alltoall", [tensor])
    if splits is None:
        static_rows = tensor.shape[0]
        if static_rows is not None and static_rows % world:
            raise tf.errors.InvalidArgumentError(
                None, None, f"hvd.alltoall: without splits the first dimension must divide "
                f"by the number of ranks ({world}); got {static_rows}")
        splits = (np.full([world], static_rows // world, np.int64) if static_rows is not None
                  else tf.fill([world], tf.shape(tensor, out_type=tf.int64)[0] // world))
    splits = tf.cast(tf.convert_to_tensor(splits), tf.int64)
    static_splits = tf.get_static_value(splits)
    if splits.shape.rank != 1 or (splits.shape[0] is not None and splits.shape[0] != world):
        raise tf.errors.InvalidArgumentError(
            None, None, f"hvd.alltoall: expected splits of shape [{world}] (one count per "
            f"rank), got shape {splits.shape}")
    if static_splits is not None and tensor.shape[0] is not None and (
            (static_splits < 0).any() or static_splits.sum() != tensor.shape[0]):
        raise tf.errors.InvalidArgumentError(
            None, None, f"hvd.alltoall: expected non-negative splits summing to the first "
            f"dimension ({tensor.shape[0]}), got {static_splits.tolist()}")
    agreed = agreement("alltoall", [tensor], first_free=True)
    matrix = exchange(splits, agreed)
    received_splits = matrix[:, _this_rank()]

    forward_scope = scope()

    @tf.custom_gradient
    def exchanged(x):
        def grad(dy):
            with within(forward_scope):
                return _alltoall_on_sum(tf.convert_to_tensor(dy), tf.transpose(matrix))
        return _alltoall_on_sum(x, matrix, agreed), grad

    out = (exchanged(tensor) if tensor.dtype.is_floating
           else _alltoall_on_sum(tensor, matrix, agreed))
    return out, tf.cast(received_splits, tf.int32)


# ---- Reducescatter ----------------------------------------------------------

def _shares(tensors: Sequence[tf.Tensor]) -> Any:
    """Horovod's split of each tensor's rows over ranks, as place_rows' counts
    ([ranks, tensors]): the first (rows % size) ranks get one row more."""
    world = _world()
    dims = [t.shape[0] for t in tensors]
    if all(d is not None for d in dims):  # static shapes: numpy, so one constant node
        rows, ranks = np.array(dims, np.int64), np.arange(world, dtype=np.int64)
    else:
        rows, ranks = _first_dims(tensors), tf.range(world, dtype=tf.int64)
    # rows // world, plus one for the first (rows % world) ranks, in integers only.
    return (rows[np.newaxis] + (world - 1) - ranks[:, np.newaxis]) // world


def grouped_reducescatter(tensors: Sequence[Any], op: int = Average, prescale: Any = 1.0,
                          postscale: Any = 1.0) -> List[tf.Tensor]:
    """Reduces each tensor over ranks (Sum or Average) and keeps this rank's
    share of the first dimension. Gradient as Horovod's: the allgather of the
    upstream gradient (times size for Sum, and the scale factors)."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if op not in (Sum, Average):
        raise NotImplementedError(f"hvd.reducescatter supports hvd.Sum and hvd.Average, got "
                                  f"{_OP_NAMES.get(op, op)}")
    if not tensors:
        return []
    for t in tensors:
        if t.shape.rank == 0:
            raise tf.errors.InvalidArgumentError(
                None, None, "hvd.reducescatter: expected tensors of at least one dimension "
                "(scattered along the first), got a scalar")
    prescale, postscale = _factor(prescale), _factor(postscale)
    agreed = agreement("reducescatter", tensors, op=op)
    world = _world()
    grad_factor = (world if op == Sum else 1.0) * prescale * postscale
    divisor = world if op == Average else 1

    def forward(xs: Sequence[tf.Tensor]) -> List[tf.Tensor]:
        sums = _allreduce([_scale(x, prescale) for x in xs], agreed)
        return [_scale(mine, postscale, divisor)
                for mine in smb_ops.take_rows(sums, _shares(xs), _this_rank())]

    forward_scope = scope()

    @tf.custom_gradient
    def scattered(*xs):
        def grad(*dys):
            with within(forward_scope):
                dys = [_scale(tf.cast(dy, x.dtype), grad_factor) for dy, x in zip(dys, xs)]
                counts = exchange(_first_dims(dys))
                return _gather_on_sum(dys, counts)
        return forward(xs), grad

    if all(t.dtype.is_floating for t in tensors):
        out = scattered(*tensors)
        return list(out) if isinstance(out, (list, tuple)) else [out]
    return forward(tensors)


# ---- Barrier and join -------------------------------------------------------

def barrier() -> None:
    """Returns once every rank has reached it."""
    smb_ops.barrier(agreement("barrier", []), process_set=scope().set_id)


def join() -> tf.Tensor:
    """Horovod's join: this rank has run out of data. Until every rank has
    joined, it takes part in the others' collectives as a rank with nothing to
    add: zeros to their allreduces (a Sum is the others' sum; an Average still
    divides by the job's size, as Horovod's does), no rows to their allgathers,
    and it passes their barriers and receives their broadcasts. Then every rank
    gets the rank that joined last (an int32 scalar tensor).

    Job-wide (the global process set), on one node and across nodes (a node
    whose every rank has joined learns the others' collectives from another
    node); a broadcast whose root has joined stops the job with an error
    naming it."""
    if scope().set_id != 0:
        raise ValueError("hvd.join() is job-wide: call it outside a process set's collectives")
    return smb_ops.join()


def grouped_broadcast(tensors: Sequence[Any], root_rank: int) -> List[tf.Tensor]:
    """Rank `root_rank`'s values of every tensor, in one collective (no gradient)."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    root_rank = int(root_rank)
    root = _root_index("broadcast", root_rank)
    if not tensors:
        return []
    return _broadcast(tensors, root, agreement("broadcast", tensors, root=root_rank))
