"""Keras callbacks that write files, for models of multi-worker tf_smb strategies.

TensorBoard: rank 0 writes the event files into the user's log dir; the
callback does nothing on the other workers (their logs are the same numbers:
epoch metrics are summed over all workers before any callback sees them).

BackupAndRestore: rank 0 writes the backup, every worker restores from it,
rank 0 alone deletes it when training ends, and barriers keep any worker from
reading while another writes or deletes. A backup is replaced atomically: the
weights go to a new file, then `training_metadata.json` (epoch, batch and the
name of that file) is replaced with os.replace, so a worker killed at any
moment leaves the previous complete backup in force. In async mode the
restored values become the box's master copies before any worker steps.
Give every worker the callback (it waits for the others at the start and end
of `fit`) and one backup dir that all of them read; its files are local paths.

Callbacks of any other model run Keras' own code.
"""
from __future__ import annotations

import functools
import glob
import json
import os
import threading
import uuid
from typing import Any, Callable, Dict, Optional

from tf_smb.keras_support import _owner
from tf_smb import keras_registry as registry
from tf_smb.keras_support import saving
from tf_smb.keras_support import weights

_HOOKED = False
_told_tensorboard = threading.Event()

# Files this module writes into a backup dir (the dir is the callback's own:
# Keras forbids sharing it, so stale files of ours may be removed).
_METADATA = "training_metadata.json"
_WEIGHTS_GLOB = "backup-*.weights.h5"
_TMP_GLOB = _METADATA + ".tmp-*"


# ---- TensorBoard ------------------------------------------------------------

_TENSORBOARD_EVENTS = (
    "on_train_begin", "on_train_end", "on_test_begin", "on_test_end",
    "on_predict_begin", "on_predict_end", "on_epoch_begin", "on_epoch_end",
    "on_train_batch_begin", "on_train_batch_end", "on_test_batch_begin",
    "on_test_batch_end", "on_predict_batch_begin", "on_predict_batch_end")


def _hook_tensorboard() -> None:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    found = registry.locate(registry.TENSORBOARD)
    original_set_model = found.original()

    @functools.wraps(original_set_model)
    def set_model(self, model):
        self._tf_smb_silent = saving.is_skipped_writer(model)  # pylint: disable=protected-access
        if not self._tf_smb_silent:  # pylint: disable=protected-access
            return original_set_model(self, model)
        registry.write(self, registry.TENSORBOARD_MODEL, model)
        registry.write(self, registry.TENSORBOARD_LOG_WRITE_DIR, self.log_dir)
        registry.write(self, registry.TENSORBOARD_TRAIN_DIR, os.path.join(self.log_dir, "train"))
        registry.write(self, registry.TENSORBOARD_VAL_DIR,
                       os.path.join(self.log_dir, "validation"))
        # Subclass code that writes through these writers writes nothing.
        noop = tf.summary.create_noop_writer()
        registry.write(self, registry.TENSORBOARD_WRITERS, {"train": noop, "val": noop})
        registry.write(self, registry.TENSORBOARD_TRAIN_GRAPH, False)
        if not _told_tensorboard.is_set():
            _told_tensorboard.set()
            from absl import logging  # pylint: disable=import-outside-toplevel
            strategy = _owner.multi_worker_strategy(model)
            logging.warning("tf_smb: TensorBoard writes from rank 0 only; rank %d of %d "
                            "writes nothing to %s", strategy.rank, strategy.size,
                            self.log_dir)
        return None

    found.replace(set_model)
    for event in registry.defined_methods(registry.TENSORBOARD_EVENTS, _TENSORBOARD_EVENTS):
        event.replace(_silent_unless_writer(event.original()))


def _silent_unless_writer(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def hook(self, *args, **kwargs):
        if getattr(self, "_tf_smb_silent", False):
            return None
        return method(self, *args, **kwargs)
    return hook


# ---- BackupAndRestore -------------------------------------------------------

def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_atomically(path: str, content: Dict[str, Any]) -> None:
    """Replaces `path` by `content` so that a reader (or a kill) sees the old
    file or the new one, never part of one."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(content, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def _read_json(path: str) -> Optional[Dict[str, Any]]:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _metadata_path(cb: Any) -> str:
    return os.path.join(cb.backup_dir, _METADATA)


def _keeps_previous(cb: Any) -> bool:
    """BackupAndRestore(double_checkpoint=True): the previous backup is kept too
    (Keras 3.3 has no such argument)."""
    return bool(getattr(cb, "double_checkpoint", False))


def _restore(cb: Any, original_load: Callable[[Any], None]) -> None:
    """Every worker: loads the backup that training_metadata.json names (a
    backup written by Keras itself names none: its latest.weights.h5), or with
    double_checkpoint the previous one when that fails to load."""
    meta_path = _metadata_path(cb)
    tries = [meta_path]
    if _keeps_previous(cb) and os.path.exists(meta_path + ".bkp"):
        tries.append(meta_path + ".bkp")
    keras_paths = (registry.read(cb, registry.BACKUP_WEIGHTS_PATH),
                   registry.read(cb, registry.BACKUP_METADATA_PATH))
    try:
        for i, path in enumerate(tries):
            meta = _read_json(path) or {}
            weights = os.path.join(cb.backup_dir, meta.get("weights", "latest.weights.h5"))
            if "weights" in meta and not os.path.exists(weights):
                # Keras would resume at the epoch with untrained weights.
                raise FileNotFoundError(
                    f"the backup in {cb.backup_dir} names {meta['weights']}, which is "
                    "missing; remove the directory to start over")
            # Keras' own loader (checks, optimizer build, epoch) on these files.
            registry.write(cb, registry.BACKUP_WEIGHTS_PATH, weights)
            registry.write(cb, registry.BACKUP_METADATA_PATH, path)
            try:
                original_load(cb)
                return
            except OSError:  # a damaged file: try the previous backup, if kept
                if i == len(tries) - 1:
                    raise
    finally:
        registry.write(cb, registry.BACKUP_WEIGHTS_PATH, keras_paths[0])
        registry.write(cb, registry.BACKUP_METADATA_PATH, keras_paths[1])


def _check_same_epoch(cb: Any, strategy: Any) -> None:
    """Fails on a worker that restored another epoch than rank 0 (a backup
    dir that not every worker can read, e.g. on a node-local disk)."""
    mine = int(registry.read(cb.model, registry.MODEL_INITIAL_EPOCH, None) or 0)
    rank0 = _owner.broadcast_int(strategy, mine)
    if mine != rank0:
        raise RuntimeError(
            f"tf_smb: BackupAndRestore on rank {strategy.rank} found epoch {mine} in "
            f"{cb.backup_dir}, rank 0 found epoch {rank0}: the backup dir must be "
            "one directory that every worker reads (a shared filesystem across nodes)")


def _is_async(strategy: Any) -> bool:
    return getattr(strategy, "mode", "sync") == "async"


def _save_backup(cb: Any) -> None:
    """Rank 0: writes the weights to a new file, then points the metadata at
    it (atomically), then removes what no metadata points to any more."""
    directory = cb.backup_dir
    os.makedirs(directory, exist_ok=True)
    meta_path = _metadata_path(cb)
    previous = _read_json(meta_path)
    epoch, batch = (registry.read(cb, registry.BACKUP_EPOCH),
                    registry.read(cb, registry.BACKUP_BATCH))
    name = f"backup-e{epoch}-b{batch}-{uuid.uuid4().hex[:8]}.weights.h5"
    path = os.path.join(directory, name)
    cb.model.save_weights(path, overwrite=True)
    _fsync_file(path)
    if _keeps_previous(cb) and previous is not None:
        _write_json_atomically(meta_path + ".bkp", previous)
    _write_json_atomically(meta_path, {
        "epoch": epoch,
        "batch": batch,
        "weights": name})
    keep = {name}
    if _keeps_previous(cb) and previous is not None and "weights" in previous:
        keep.add(previous["weights"])
    for stale in glob.glob(os.path.join(directory, _WEIGHTS_GLOB)) + glob.glob(
            os.path.join(directory, _TMP_GLOB)):
        if os.path.basename(stale) not in keep:
            os.remove(stale)


def _delete_backup(cb: Any) -> None:
    """Rank 0: the metadata goes first, so a kill during the removal leaves
    nothing that a relaunch would restore from."""
    directory = cb.backup_dir
    for meta in (_metadata_path(cb), _metadata_path(cb) + ".bkp"):
        if os.path.exists(meta):
            os.remove(meta)
    if os.path.exists(directory):
        import shutil  # pylint: disable=import-outside-toplevel
        shutil.rmtree(directory)


def _hook_backup_and_restore() -> None:
    # Keras 3.3 restores in on_train_begin itself: that is then the loader.
    begin, load, save, end = (registry.locate(h) for h in (
        registry.BACKUP_BEGIN, registry.BACKUP_RESTORE, registry.BACKUP_SAVE,
        registry.BACKUP_END))
    original_begin, original_load = begin.original(), load.original()
    original_save, original_end = save.original(), end.original()

    @functools.wraps(original_begin)
    def on_train_begin(self, logs=None):
        strategy = _owner.multi_worker_strategy(self.model)
        if strategy is None:
            return original_begin(self, logs)
        # No worker writes or deletes here: the previous fit ended with a
        # barrier after rank 0's deletion, and rank 0 writes only after the
        # barrier below, once every worker has read.
        with weights.publishing_deferred(strategy):  # published below, after the epoch check
            _restore(self, original_load)
        _check_same_epoch(self, strategy)
        if _is_async(strategy):
            weights.publish(strategy, self.model)  # the box holds what was read
        else:
            strategy.barrier()  # every worker read
        return None

    @functools.wraps(original_save)
    def _save_model(self, *args, **kwargs):
        strategy = _owner.multi_worker_strategy(self.model)
        if strategy is None:
            return original_save(self, *args, **kwargs)
        if strategy.rank == 0:
            _save_backup(self)
        return None

    @functools.wraps(original_end)
    def on_train_end(self, logs=None):
        strategy = _owner.multi_worker_strategy(self.model)
        if strategy is None:
            return original_end(self, logs)
        if strategy.rank == 0 and self.delete_checkpoint:
            _delete_backup(self)
        strategy.barrier()  # no worker's next fit reads a half-deleted backup
        return None

    begin.replace(on_train_begin)
    save.replace(_save_model)
    end.replace(on_train_end)


def install_callback_hooks() -> None:
    """Installs the TensorBoard and BackupAndRestore hooks (idempotent)."""
    global _HOOKED
    if _HOOKED:
        return
    _HOOKED = True
    _hook_tensorboard()
    _hook_backup_and_restore()
