"""Horovod's TensorFlow API (`horovod.tensorflow`) on tf_smb's box.

A Horovod script moves by changing its import line:

    import tf_smb.horovod as hvd          # was: import horovod.tensorflow as hvd
    hvd.init()
    ...

and runs under `python -m tf_smb.run -np N`, `mpirun` or `horovodrun`. Nothing
of Horovod is needed. What differs from Horovod 0.28.1 is listed in the README
("Horovod's API"): no Adasum; `hvd.elastic` on one node only (docs/elastic.md).
"""
from __future__ import annotations

import functools
import inspect
import pickle
from typing import Any, Callable, List, Optional, Sequence

import tensorflow as tf

from tf_smb.horovod import collectives as _coll
from tf_smb.horovod.basics import (  # noqa: F401  (the public API)
    ProcessSet, add_process_set, ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
    global_process_set, gloo_built, gloo_enabled, init, is_homogeneous, is_initialized,
    local_rank, local_rank_op, local_size, local_size_op, mpi_built, mpi_enabled,
    mpi_threads_supported, nccl_built, process_set_included_op, rank, rank_op,
    remove_process_set, rocm_built, shutdown, size, size_op, start_timeline, stop_timeline)
from tf_smb.horovod.collectives import Adasum, Average, Max, Min, Product, Sum  # noqa: F401
from tf_smb.horovod.compression import Compression  # noqa: F401
from tf_smb.horovod import util as util  # noqa: F401  (hvd.util._executing_eagerly)
from tf_smb.horovod.util import _executing_eagerly  # noqa: F401

ReduceOp = int


def _in_process_set(function: Callable[..., Any]) -> Callable[..., Any]:
    """Runs `function` with its collectives in its `process_set` argument's set
    (ValueError for a set not added; InvalidArgumentError on a rank not in it)."""
    signature = inspect.signature(function)

    @functools.wraps(function)
    def in_set(*args: Any, **kwargs: Any) -> Any:
        process_set = signature.bind(*args, **kwargs).arguments.get(
            "process_set", global_process_set)
        with _coll.within(_coll.scope_of(process_set)):
            return function(*args, **kwargs)
    return in_set


def _reduce_op(op: Optional[int], average: Optional[bool]) -> int:
    if op is not None and average is not None:
        raise ValueError("hvd: give either op= or the deprecated average=, not both")
    if average is not None:
        return Average if average else Sum
    return Average if op is None else int(op)


def allreduce(tensor: Any, average: Optional[bool] = None, device_dense: str = "",
              device_sparse: str = "", compression: Any = Compression.none,
              op: Optional[int] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set,
              ignore_name_scope: bool = False) -> Any:
    """Reduces a tensor (or tf.IndexedSlices) over all ranks (default: Average)."""
    return grouped_allreduce([tensor], average, device_dense, device_sparse, compression, op,
                             prescale_factor, postscale_factor, process_set)[0]


@_in_process_set
def grouped_allreduce(tensors: Sequence[Any], average: Optional[bool] = None,
                      device_dense: str = "", device_sparse: str = "",
                      compression: Any = Compression.none, op: Optional[int] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      ignore_name_scope: bool = False, name: Optional[str] = None) -> List[Any]:
    """Reduces every tensor over all ranks; the dense ones in one fused collective.
    tf.IndexedSlices are gathered (values and indices), as Horovod does."""
    del device_dense, device_sparse, ignore_name_scope, name
    op = _reduce_op(op, average)
    tensors = list(tensors)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    if sparse:
        if op == Adasum:
            raise NotImplementedError(
                "The Adasum reduction does not support sparse tensors (and tf_smb.horovod "
                "has no Adasum); pass sparse_as_dense=True or use hvd.Average")
        if op not in (Sum, Average):
            raise NotImplementedError("Only Sum and Average ops are supported with "
                                      "tf.IndexedSlices")
        if prescale_factor != 1.0 or postscale_factor != 1.0:
            raise NotImplementedError("Pre/postscale_factor are not supported with "
                                      "tf.IndexedSlices")
    dense_index = [i for i in range(len(tensors)) if i not in sparse]
    out: List[Any] = [None] * len(tensors)
    if sparse:
        pieces = []
        for i in sparse:
            pieces += [tensors[i].values, tensors[i].indices]
        gathered = _coll.grouped_allgather(pieces)
        for k, i in enumerate(sparse):
            values, indices = gathered[2 * k], gathered[2 * k + 1]
            if op == Average:
                values = values / tf.cast(_coll.world(), values.dtype)
            out[i] = tf.IndexedSlices(values, indices, dense_shape=tensors[i].dense_shape)
    if dense_index:
        compressed, contexts = [], []
        for i in dense_index:
            c, ctx = compression.compress(tf.convert_to_tensor(tensors[i]))
            compressed.append(c)
            contexts.append(ctx)
        reduced = _coll.grouped_allreduce_dense(compressed, op, prescale_factor,
                                                postscale_factor)
        for i, r, ctx in zip(dense_index, reduced, contexts):
            out[i] = compression.decompress(r, ctx)
    return out


@_in_process_set
def allgather(tensor: Any, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """`tensor` concatenated over all ranks along dimension 0 (sizes may differ)."""
    return _coll.grouped_allgather([tensor])[0]


@_in_process_set
def grouped_allgather(tensors: Sequence[Any], name: Optional[str] = None,
                      ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> List[tf.Tensor]:
    """`allgather` of every tensor, in one collective."""
    return _coll.grouped_allgather(list(tensors))


@_in_process_set
def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None,
              ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Rank `root_rank`'s value of `tensor`, on every rank."""
    return _coll.broadcast(tensor, root_rank)


@_in_process_set
def broadcast_(variables: Sequence[tf.Variable], root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> List[tf.Tensor]:
    """Assigns rank `root_rank`'s values to `variables` on every rank, in place;
    returns the new values."""
    values = _coll.grouped_broadcast([v.read_value() if hasattr(v, "read_value") else v
                                      for v in variables], root_rank)
    assigns = [v.assign(x) for v, x in zip(variables, values)]
    if tf.executing_eagerly():
        return list(values)
    with tf.control_dependencies(assigns):  # the values come with the assignments
        return [tf.identity(x) for x in values]


@_in_process_set
def broadcast_variables(variables: Sequence[tf.Variable], root_rank: int,
                        process_set: ProcessSet = global_process_set,
                        inplace: bool = False) -> Any:
    """Assigns rank `root_rank`'s values to `variables` on every rank, all in
    one collective; returns the assign op in a graph."""
    variables = list(variables)
    if not variables:
        return tf.no_op() if not tf.executing_eagerly() else None
    values = _coll.grouped_broadcast([tf.convert_to_tensor(v) for v in variables], root_rank)
    assigns = [v.assign(x) for v, x in zip(variables, values)]
    return None if tf.executing_eagerly() else tf.group(*assigns)


def broadcast_global_variables(root_rank: int) -> Any:
    """Horovod's TF1 helper: broadcasts tf.compat.v1.global_variables() (graph mode
    only; eagerly, use broadcast_variables)."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution. Please "
            "use `hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def _object_bytes(obj: Any) -> tf.Tensor:
    return tf.constant(list(pickle.dumps(obj)), dtype=tf.uint8, shape=None)


def _to_numpy(t: Any, session: Any) -> Any:
    """`t`'s value: eagerly at once, in a graph through `session` (or the default
    session, or a new one on the default graph)."""
    if tf.executing_eagerly():
        return t.numpy()
    session = session or tf.compat.v1.get_default_session()
    if session is not None:
        return session.run(t)
    with tf.compat.v1.Session() as temporary:
        return temporary.run(t)


@_in_process_set
def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None,
                     name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Rank `root_rank`'s picklable `obj`, on every rank."""
    del name
    data = (_object_bytes(obj) if rank() == root_rank
            else tf.zeros([0], tf.uint8))
    length = _to_numpy(broadcast(tf.shape(data, out_type=tf.int64), root_rank,
                                process_set=process_set), session)
    if rank() != root_rank:
        data = tf.zeros(length, tf.uint8)
    data = _to_numpy(broadcast(data, root_rank, process_set=process_set), session)
    return obj if rank() == root_rank else pickle.loads(bytes(data))


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: Optional[str] = None,
                        process_set: ProcessSet = global_process_set) -> Callable[[Any], Any]:
    """A function broadcasting an object from `root_rank` (Horovod's TF1 form)."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


@_in_process_set
def allgather_object(obj: Any, session: Any = None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> List[Any]:
    """Every rank's picklable `obj`, as a list in rank order."""
    del name
    data = _object_bytes(obj)
    lengths = _to_numpy(allgather(tf.shape(data, out_type=tf.int64), process_set=process_set),
                        session)
    gathered = bytes(_to_numpy(allgather(data, process_set=process_set), session))
    out, start = [], 0
    for n in lengths:
        out.append(pickle.loads(gathered[start:start + int(n)]))
        start += int(n)
    return out


@_in_process_set
def alltoall(tensor: Any, splits: Any = None, name: Optional[str] = None,
             ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> Any:
    """Sends splits[j] rows of `tensor` (along dimension 0) to rank j. Returns
    the rows received in rank order, and, when `splits` is given, how many came
    from each rank."""
    out, received = _coll.alltoall(tensor, splits)
    return (out, received) if splits is not None else out


def reducescatter(tensor: Any, device_dense: str = "", compression: Any = Compression.none,
                  op: int = Average, name: Optional[str] = None,
                  process_set: ProcessSet = global_process_set,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduces `tensor` over ranks and keeps this rank's share of dimension 0
    (the first size % ranks ranks get one row more)."""
    return grouped_reducescatter([tensor], device_dense, compression, op,
                                 process_set=process_set, prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor)[0]


@_in_process_set
def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "",
                          compression: Any = Compression.none, op: int = Average,
                          name: Optional[str] = None,
                          process_set: ProcessSet = global_process_set,
                          ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[tf.Tensor]:
    """`reducescatter` of every tensor, in one collective."""
    compressed, contexts = zip(*[compression.compress(tf.convert_to_tensor(t))
                                 for t in tensors]) if tensors else ((), ())
    reduced = _coll.grouped_reducescatter(list(compressed), op, prescale_factor,
                                          postscale_factor)
    return [compression.decompress(r, ctx) for r, ctx in zip(reduced, contexts)]


def join() -> tf.Tensor:
    """This rank has run out of data: it takes part in the others' collectives
    with nothing to add until every rank has joined, then returns the rank that
    joined last (see collectives.join)."""
    return _coll.join()


@_in_process_set
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Returns once every rank has reached it."""
    _coll.barrier()


from tf_smb.horovod.gradients import (  # noqa: E402,F401  (uses the names above)
    DistributedGradientTape, DistributedOptimizer, PartialDistributedGradientTape)
from tf_smb.horovod.sync_batch_norm import SyncBatchNormalization  # noqa: E402,F401
from tf_smb.horovod import elastic  # noqa: E402,F401
