"""`hvd.elastic` is not provided by tf_smb.horovod.

tf_smb's jobs are fail-stop: a lost worker fails the job, which restarts from
its last checkpoint. Keras' `keras.callbacks.BackupAndRestore` resumes `fit`
where it stopped; see the README ("Horovod's API").
"""
from typing import Any

_MESSAGE = ("tf_smb.horovod has no elastic mode (hvd.elastic.{name}): a tf_smb job is "
            "fail-stop. Restart the job and resume with keras.callbacks.BackupAndRestore "
            "(or tf.train.CheckpointManager in a custom loop)")


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise NotImplementedError(_MESSAGE.format(name=name))
