"""A Keras `fit` script with SMBStrategy(elastic=True), for elastic jobs whose
members change (tests/test_elastic_fit.py, tests/test_elastic_nodes.py): a seeded
MLP, Adam, arrays in a fixed order with a global batch of 24; `fit` itself is
unchanged.

What the test adds around it (a callback): the job's rank 0 writes each epoch it
finished to $PROGRESS (the test's discovery script reads it), and the worker
named by $KILL_WORKER ("worker_id:epoch:batch"; across nodes a worker id is a
rank) kills itself (SIGKILL) at that batch; from epoch 3 on, 2 workers go slowly
until the added host's worker joins, and every step sleeps $STEP_SLEEP seconds
when set. At the end the weights go to $OUT (.npz) from the job's rank 0, with a
JSON line of what fit returned. Without a launcher it is the one-process
reference. With MODE=async the strategy trains asynchronously (within
$STALENESS steps of the slowest worker when set), and every member writes its
weights to $OUT.<rank>.npz.
"""
import json
import os
import signal
import sys
import time

import keras
import numpy as np

import tf_smb

EPOCHS = int(os.environ.get("EPOCHS", "6"))
JOIN_EPOCH = 3  # the test's discovery adds a host once epoch 2 is done


class Schedule(keras.callbacks.Callback):
    """The test's schedule: progress for discovery, and the planned kill."""

    def __init__(self, strategy):
        super().__init__()
        self.strategy = strategy
        self.epoch = 0
        kill = os.environ.get("KILL_WORKER")
        self.kill = tuple(int(v) for v in kill.split(":")) if kill else None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        # Only a process of the first generation (across nodes a later one's ranks
        # are new processes, which may meet that worker id, epoch and batch again).
        if self.kill and os.environ.get("TF_SMB_ELASTIC_GENERATION", "0") == "0" and (
                self.kill == (int(os.environ.get("TF_SMB_WORKER_ID", -1)), self.epoch, batch)):
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, batch, logs=None):
        # Slower once the host is added, until its worker joins (so that it joins
        # before the job ends; the result does not depend on when).
        if self.epoch >= JOIN_EPOCH and self.strategy.size == 2 and os.environ.get("PROGRESS"):
            time.sleep(0.2)
        # Every step this long ($STEP_SLEEP s): room for a test to act from outside.
        time.sleep(float(os.environ.get("STEP_SLEEP", "0")))

    def on_epoch_end(self, epoch, logs=None):
        if self.strategy.rank == 0 and os.environ.get("PROGRESS"):
            with open(os.environ["PROGRESS"], "a") as f:
                f.write(f"{epoch} {self.strategy.size}\n")


def main() -> int:
    mode = os.environ.get("MODE", "sync")
    bound = {"staleness": int(os.environ["STALENESS"])} if os.environ.get("STALENESS") else {}
    strategy = tf_smb.SMBStrategy(mode=mode, elastic=True, commit_steps=4, **bound)
    keras.utils.set_random_seed(7)
    rng = np.random.default_rng(0)
    # 10 global batches of 24 an epoch: even over 4, 2 and 3 workers (Keras 3.3 weighs an
    # uneven split otherwise than one process: README, tested pairs).
    x = rng.normal(size=(240, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 3)) + 0.1 * rng.normal(size=(240, 3))).astype("float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    history = model.fit(x, y, batch_size=24, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=[Schedule(strategy)])
    if mode == "async":
        np.savez(f"{os.environ['OUT']}.{strategy.rank}.npz", *model.get_weights())
    if strategy.rank == 0:
        np.savez(os.environ["OUT"], *model.get_weights())
        print(json.dumps({"epochs": history.epoch, "loss": history.history["loss"],
                          "size": strategy.size}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
