"""Horovod's SyncBatchNormalization for Keras 3: batch statistics over the
global batch (every rank's local batch of the same size)."""
from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from tf_smb.horovod import basics
from tf_smb.horovod import collectives
from tf_smb import keras_registry as registry


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """BatchNormalization whose training-time mean and variance are those of
    the global batch: each rank's mean and mean of squares are averaged over
    ranks (ranks use local batches of the same size). Masks are not supported.
    It overrides Keras' `_moments` (registry.BATCH_NORM_MOMENTS)."""

    def _moments(self, inputs: Any, mask: Any) -> Any:
        if mask is not None:
            raise NotImplementedError("SyncBatchNormalization does not support masks")
        if basics.size() == 1 and not basics.size_may_change():
            return super()._moments(inputs, mask)
        x = tf.cast(inputs, tf.float32)
        axes = registry.read(self, registry.BATCH_NORM_AXES)
        mean = tf.reduce_mean(x, axis=axes)
        mean_square = tf.reduce_mean(tf.square(x), axis=axes)
        mean, mean_square = collectives.grouped_allreduce_dense(
            [mean, mean_square], collectives.Average)
        variance = tf.maximum(mean_square - tf.square(mean), 0.0)
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)
