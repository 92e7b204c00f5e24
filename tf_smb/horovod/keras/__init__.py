"""Horovod's Keras API (`horovod.tensorflow.keras`) for Keras 3 on tf_smb's box."""
