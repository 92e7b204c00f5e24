"""What combines tensors across workers: the interface the data-parallel
machinery (tf_smb/data_parallel.py) is written against, and its box-backed
implementation.

    class MyCollectives(Collectives):
        def allreduce(self, tensors): ...           # sum over workers, one fused call
        def broadcast(self, tensors, root): ...     # every worker gets root's tensors
        def barrier(self): ...                      # returns once all have arrived

SMBCollectives (below) goes through the Soft Memory Box; HorovodCollectives
(tf_smb/horovod_strategy.py) through Horovod's TensorFlow ops. Every worker
calls the same collectives in the same order with tensors of the same dtypes
and shapes; inside a graph the backend pairs them up (see tf_smb/ops.py).
"""
from __future__ import annotations

import abc
from typing import List, Sequence

import tensorflow as tf

from tf_smb import ops as smb_ops


class Collectives(abc.ABC):
    """A collectives backend: sum, broadcast and barrier over all workers (and a
    gather built on them, which a backend may replace by its own)."""

    @abc.abstractmethod
    def allreduce(self, tensors: Sequence[tf.Tensor]) -> List[tf.Tensor]:
        """Sums each tensor over all workers (one fused collective for all)."""

    @abc.abstractmethod
    def broadcast(self, tensors: Sequence[tf.Tensor], root: int) -> List[tf.Tensor]:
        """Every worker gets worker `root`'s tensors (bool included)."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Returns once every worker has reached it (eagerly)."""

    def allgather(self, tensor: tf.Tensor, rank: int, size: int) -> tf.Tensor:
        """Every worker's `tensor` concatenated along dimension 0 in rank order
        (the first dimensions may differ; the others must agree).

        Each worker's rows travel once: the lengths are summed in one small
        all-reduce, then worker r's rows reach every worker in a broadcast from
        r, which carries r's rows only (a sum of zero-padded buffers would move
        every worker's whole result: `size` times the bytes).
        """
        shape = tf.shape(tensor, out_type=tf.int64)
        lengths = self.allreduce([tf.one_hot(rank, size, dtype=tf.int64) * shape[0]])[0]
        parts = []
        # No broadcast starts before the lengths are known everywhere: in a graph,
        # one whose input is this worker's own tensor could otherwise start on its
        # own, and be left unmatched when the lengths' collective fails.
        with tf.control_dependencies([lengths]):
            for root in range(size):
                # The others pass a tensor of root's shape, which the broadcast overwrites.
                sent = tensor if root == rank else tf.zeros(
                    tf.concat([lengths[root:root + 1], shape[1:]], 0), tensor.dtype)
                # One name on every worker: Horovod matches a graph's collectives by
                # their input's name (the box by call site).
                sent = tf.identity(sent, name=f"allgather_from_{root}")
                parts.append(self.broadcast([sent], root=root)[0])
        return tf.concat(parts, axis=0)

    def allgather_text(self, text: str, rank: int, size: int,
                       max_bytes: int) -> List[str]:
        """Every worker's `text` (at most `max_bytes` in UTF-8), indexed by rank.

        Eager and built on `allreduce`: each worker writes its bytes into its
        own row of a zero [size, max_bytes] buffer, and the sum of the buffers
        holds every row exactly (x + 0 is exact).
        """
        data = text.encode("utf-8")
        if len(data) > max_bytes:
            raise ValueError(f"allgather_text: {len(data)} bytes do not fit in {max_bytes}")
        row = tf.constant(list(data) + [0] * (max_bytes - len(data)), tf.int32)
        rows = tf.scatter_nd([[rank]], row[tf.newaxis], [size, max_bytes])
        summed = self.allreduce([rows])[0].numpy()
        return [bytes(int(b) for b in r).rstrip(b"\0").decode("utf-8") for r in summed]


class SMBCollectives(Collectives):
    """Collectives through the Soft Memory Box (tf_smb/ops.py)."""

    def allreduce(self, tensors: Sequence[tf.Tensor]) -> List[tf.Tensor]:
        return smb_ops.allreduce(tensors)

    def broadcast(self, tensors: Sequence[tf.Tensor], root: int) -> List[tf.Tensor]:
        return smb_ops.broadcast(tensors, root=root)

    def barrier(self) -> None:
        smb_ops.barrier()
