"""One worker of a Keras data/callback scenario; prints one JSON result line.

Run with TF_SMB_RANK/TF_SMB_SIZE set for N workers, or with no launcher
variables for the single-process reference. Scenarios:
  shuffle      fit(numpy, shuffle=True): the row ids every step trained on
  tensorboard  fit with TensorBoard into --out_dir/tb
  save         model.save / save_weights / ModelCheckpoint, loaded on every rank
  resume       fit with BackupAndRestore(--out_dir/backup), optionally killed
"""
import argparse
import json
import os
import signal
import sys

import numpy as np
import tensorflow as tf
import keras

import tf_smb
from common import build, data






def weights_of(model):
    return [w.tolist() for w in model.get_weights()]


def scenario_shuffle(strategy, a):
    """Column 0 of x is the row id; a py_function in train_step records it."""
    n = 50  # not a multiple of the global batch: a partial last batch
    seen = []

    def record(ids):
        seen[-1].extend(int(i) for i in ids.numpy())

    class Recorder(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x[:, 1:])

        def train_step(self, batch):
            x, _ = batch
            tf.py_function(record, [x[:, 0]], [])
            return super().train_step(batch)

    class NewEpoch(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            seen.append([])

    x = np.concatenate([np.arange(n, dtype=np.float32)[:, None],
                        np.random.default_rng(0).normal(size=(n, 3)).astype(np.float32)], 1)
    y = np.zeros((n, 1), np.float32)
    with strategy.scope():
        model = Recorder()
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    model.fit(x, y, batch_size=4 * strategy.num_replicas_in_sync, epochs=3,
              verbose=0, callbacks=[NewEpoch()])  # shuffle=True: Keras' default
    return {"seen": seen}


def scenario_tensorboard(strategy, a):
    x, y = data(96)
    xv, yv = data(40, seed=1)
    model = build(strategy)
    log_dir = os.path.join(a.out_dir, "tb")
    hist = model.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False,
                     validation_data=(xv, yv),
                     callbacks=[keras.callbacks.TensorBoard(log_dir, update_freq="epoch")])
    out = {"loss": hist.history["loss"]}
    if strategy.rank == 1:
        # A model of another strategy (one made outside every scope is refused
        # while ours runs), on a rank that writes nothing for ours: Keras as usual.
        with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
            plain = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
            plain.compile(optimizer="sgd",
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        plain.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[
            keras.callbacks.TensorBoard(os.path.join(a.out_dir, "plain_rank1"))])
    return out


def scenario_save(strategy, a):
    x, y = data(96)
    model = build(strategy)
    ckpt = os.path.join(a.out_dir, "ckpt.keras")
    model.fit(x, y, batch_size=16, epochs=2, verbose=0,
              callbacks=[keras.callbacks.ModelCheckpoint(ckpt)])
    model.save(os.path.join(a.out_dir, "model.keras"))
    model.save_weights(os.path.join(a.out_dir, "model.weights.h5"))
    keras.saving.save_model(model, os.path.join(a.out_dir, f"fn_rank{strategy.rank}.keras"))
    # Built outside any strategy: saved by whichever rank asks.
    plain = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
    plain.save(os.path.join(a.out_dir, f"plain_rank{strategy.rank}.keras"))
    strategy.barrier()  # rank 0 has written everything
    want = model.predict(x, verbose=0)
    loaded = keras.models.load_model(os.path.join(a.out_dir, "model.keras"))
    from_ckpt = keras.models.load_model(ckpt)
    rebuilt = build(strategy)
    rebuilt.load_weights(os.path.join(a.out_dir, "model.weights.h5"))
    return {
        "pred_diff_model": float(np.max(np.abs(loaded.predict(x, verbose=0) - want))),
        "pred_diff_ckpt": float(np.max(np.abs(from_ckpt.predict(x, verbose=0) - want))),
        "pred_diff_weights": float(np.max(np.abs(rebuilt.predict(x, verbose=0) - want))),
        "plain_exists": os.path.exists(os.path.join(a.out_dir, f"plain_rank{strategy.rank}.keras")),
    }


def _box_equals_local(strategy):
    """Async: whether the box's master copy of every box-held variable equals
    this worker's local value (which on_train_begin has just restored)."""
    from tf_smb import ops as smb_ops
    params = strategy.extended._box_segments  # pylint: disable=protected-access
    return bool(params) and all(
        np.array_equal(smb_ops.segment_read(p.name, p.dtype, p.shape).numpy(),
                       ref.deref().numpy())
        for ref, p in params.items())


def scenario_resume(strategy, a):
    """fit(epochs) with BackupAndRestore. --die mid_epoch:K: every rank
    SIGKILLs itself at epoch K's second batch. --die in_backup:K: rank 0 dies
    while writing the backup of epoch K (leaving a torn file), the others at
    epoch K's end."""
    x, y = data(96)
    model = build(strategy)
    backup = os.path.join(a.out_dir, "backup")
    kind, _, k = (a.die or "none:").partition(":")
    k = int(k or -1)
    rank = strategy.rank
    out = {"epochs_run": []}

    class Watch(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            out["initial_weights"] = weights_of(self.model)
            if strategy.mode == "async":
                out["box_equals_restored"] = _box_equals_local(strategy)

        def on_epoch_begin(self, epoch, logs=None):
            out["epochs_run"].append(epoch)

        def on_epoch_end(self, epoch, logs=None):
            # After the epoch's last collective (its metrics): rank 0 still
            # reaches its backup write, where it dies.
            if kind == "in_backup" and rank != 0 and epoch == k:
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_begin(self, batch, logs=None):
            if kind == "mid_epoch" and out["epochs_run"][-1] == k and batch == 1:
                os.kill(os.getpid(), signal.SIGKILL)

    if kind == "in_backup" and rank == 0:
        save_weights = keras.Model.save_weights
        saves = []

        def torn_save_weights(self, filepath, *args, **kwargs):
            result = save_weights(self, filepath, *args, **kwargs)
            if str(filepath).startswith(backup):
                saves.append(filepath)
                if len(saves) == k + 1:  # the backup of epoch k
                    with open(filepath, "r+b") as f:
                        f.truncate(os.path.getsize(filepath) // 2)
                    os.kill(os.getpid(), signal.SIGKILL)
            return result

        keras.Model.save_weights = torn_save_weights

    hist = model.fit(x, y, batch_size=16, epochs=a.epochs, verbose=0, callbacks=[
        keras.callbacks.BackupAndRestore(backup), Watch()])
    out.update(weights=weights_of(model), loss=hist.history["loss"],
               backup_left=os.path.exists(backup))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("scenario")
    p.add_argument("--out_dir", default="/tmp")
    p.add_argument("--seed", default="same", choices=["same", "per_rank", "none"],
                   help="keras.utils.set_random_seed: 1234 on every rank, 100+rank, or none")
    p.add_argument("--mode", default="sync", choices=["sync", "async"])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--die", default=None)
    a = p.parse_args()
    rank_guess = int(os.environ.get("TF_SMB_RANK", "0"))
    if a.seed == "same":
        keras.utils.set_random_seed(1234)
    elif a.seed == "per_rank":
        keras.utils.set_random_seed(100 + rank_guess)
    strategy = tf_smb.SMBStrategy(mode=a.mode,
                                  timeout_s=float(os.environ.get("TEST_TIMEOUT", "60")))
    result = globals()["scenario_" + a.scenario](strategy, a)
    result["rank"] = strategy.rank
    result["size"] = strategy.size
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
