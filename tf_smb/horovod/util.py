"""Horovod's `horovod.tensorflow.util` helpers that scripts and tests use."""
import tensorflow as tf


def _executing_eagerly() -> bool:
    """Whether TensorFlow runs eagerly here (Horovod's helper)."""
    return tf.executing_eagerly()
