"""fit: model.fit throughput of a small CNN, an MLP or ResNet-50 with one strategy.

Models: cnn (56,714 parameters), mlp (784-512-512-10), mlp10m (784-2048-2048-2048-784-10,
11.6M parameters: 46 MB of gradients a step, communication-heavy) and resnet50
(`keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)` on
logits: its 23.6M parameters and 161 gradient tensors, on small images so that a step
takes seconds, not minutes, on 2 cores).

    python -m tf_smb.run -np 2 python -m benchmarks.roles.fit --kind=smb_sync \
        --fit_models=cnn,mlp --fit_epochs=8 --fit_batch=256 --samples=cnn:8192,mlp:32768

Kinds: smb_sync, smb_async, smb_async_push (SMBStrategy; the last with read_at="push"),
smb_elastic (SMBStrategy(elastic=True, commit_steps=--fit_commit_steps), under tf_smb.run's
elastic launcher; its ranks also print each commit's seconds and each change of the members;
--fit_kill=W:E:B makes elastic worker W kill itself at epoch E, batch B, printing when),
smb_async_elastic (the same with mode="async"),
horovod (tf_smb.HorovodStrategy, under mpirun or horovodrun), hvd_api (no strategy:
Horovod's API on the box, tf_smb.horovod.keras.DistributedOptimizer, each rank fitting
its shard at batch/size, as a Horovod script does), mwms (MultiWorkerMirroredStrategy, RING, from TF_CONFIG) and single (one
process: no strategy, OneDeviceStrategy and a 1-worker SMBStrategy, one epoch each in
turn). Synthetic data, SGD with momentum, no metrics, no XLA. Every rank prints, per
model and strategy, its epoch times and its median step time (see `step_summary`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Dict, List, Optional, Sequence

from benchmarks import common

KINDS = ("smb_sync", "smb_async", "smb_async_push", "smb_elastic", "smb_async_elastic",
         "horovod", "hvd_api", "mwms", "single")
FIT_MODELS = ("cnn", "mlp", "mlp10m", "resnet50", "small")
IMAGE_SHAPES = {"cnn": (28, 28, 1), "resnet50": (32, 32, 3), "small": (1024,)}


def fit_data(model: str, samples: int):
    import numpy as np
    rng = np.random.default_rng(0)
    shape = IMAGE_SHAPES.get(model, (784,))
    x = rng.random((samples, *shape), dtype=np.float32)
    y = rng.integers(0, 10, samples).astype(np.int32)
    return x, y


def _layers(model: str) -> list:
    """The layers of the CNN or an MLP."""
    import keras
    if model == "cnn":
        return [keras.Input(IMAGE_SHAPES[model]),
                keras.layers.Conv2D(16, 3, activation="relu"), keras.layers.MaxPooling2D(),
                keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(),
                keras.layers.Flatten(), keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(10)]
    if model == "mlp":
        return [keras.Input((784,)), keras.layers.Dense(512, activation="relu"),
                keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)]
    if model == "small":  # short steps: 0.4M parameters (1.6 MB of gradients)
        return [keras.Input(IMAGE_SHAPES[model]),
                *(keras.layers.Dense(256, activation="relu") for _ in range(3)),
                keras.layers.Dense(10)]
    # mlp10m: communication-heavy, 11.6M parameters (46 MB of gradients)
    return [keras.Input((784,)), *(keras.layers.Dense(2048, activation="relu")
                                   for _ in range(3)),
            keras.layers.Dense(784, activation="relu"), keras.layers.Dense(10)]


def build_fit_model(model: str, distributed_optimizer: bool = False):
    """The small CNN, an MLP or ResNet-50, compiled (SGD with momentum, loss only, no
    XLA); `distributed_optimizer`: wrapped in tf_smb.horovod.keras.DistributedOptimizer."""
    import keras
    keras.utils.set_random_seed(0)  # the same initial weights on every worker and run
    if model == "resnet50":
        net = keras.applications.ResNet50(weights=None, input_shape=IMAGE_SHAPES[model],
                                          classes=10, classifier_activation=None)
    else:
        net = keras.Sequential(_layers(model), name=f"bench_{model}")
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    if distributed_optimizer:
        import tf_smb.horovod.keras as hvd
        optimizer = hvd.DistributedOptimizer(optimizer)
    net.compile(optimizer=optimizer,
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                jit_compile=False)
    return net


def epoch_timer():
    """A Keras callback that keeps each epoch's wall time (`times`) and the
    time of each of its training steps (`steps`, one list per epoch)."""
    import keras

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self._supports_tf_logs = True  # no conversion of the logs per step
            self.times: List[float] = []
            self.steps: List[List[float]] = []
            self._start = self._step_start = 0.0

        def on_epoch_begin(self, epoch, logs=None) -> None:
            self.steps.append([])
            self._start = time.perf_counter()

        def on_train_batch_begin(self, batch, logs=None) -> None:
            self._step_start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None) -> None:
            self.steps[-1].append(time.perf_counter() - self._step_start)

        def on_epoch_end(self, epoch, logs=None) -> None:
            self.times.append(time.perf_counter() - self._start)

    return EpochTimer()


def killer(plan: str):
    """A Keras callback by which elastic worker W (TF_SMB_WORKER_ID; across nodes a
    rank) of the first generation kills itself (SIGKILL) at epoch E, batch B (`plan`
    "W:E:B"), first printing the time."""
    import keras
    import signal
    worker, epoch, batch = (int(v) for v in plan.split(":"))

    class Killer(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.epoch = 0

        def on_epoch_begin(self, epoch_now, logs=None) -> None:
            self.epoch = epoch_now

        def on_train_batch_begin(self, batch_now, logs=None) -> None:
            if (int(os.environ.get("TF_SMB_WORKER_ID", -1)), self.epoch, batch_now) == (
                    worker, epoch, batch) and os.environ.get(
                        "TF_SMB_ELASTIC_GENERATION", "0") == "0":
                common.print_result({"kind": "killed", "at": time.time()})
                os.kill(os.getpid(), signal.SIGKILL)

    return Killer()


def run(kind: str, models: Sequence[str], epochs: int, batch: int,
        samples: Dict[str, int], autotune: Optional[bool] = None, commit_steps: int = 10,
        kill: str = "") -> None:
    """Fits each model with the strategy `kind`; every rank prints each model's epoch times.
    `autotune` True/False sets the dataset's `options.autotune.enabled` (a user's
    explicit choice); None leaves it unset."""
    import tensorflow as tf

    if kind == "mwms":  # before anything initializes TensorFlow's context
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING)
        strategies = {"mwms": tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=options)}
        rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    else:
        import tf_smb
        if kind == "single":
            strategies = {"none_1": tf.distribute.get_strategy(),
                          "onedevice_1": tf.distribute.OneDeviceStrategy("/cpu:0"),
                          "smb_1": tf_smb.SMBStrategy()}
        elif kind == "horovod":
            strategies = {kind: tf_smb.HorovodStrategy()}
        elif kind == "hvd_api":
            import tf_smb.horovod.keras as hvd
            hvd.init()
            strategies = {kind: tf.distribute.get_strategy()}
        elif kind in ("smb_sync", "smb_async"):
            strategies = {kind: tf_smb.SMBStrategy(mode=kind[4:])}
        elif kind == "smb_async_push":
            strategies = {kind: tf_smb.SMBStrategy(mode="async", read_at="push")}
        elif kind in ("smb_elastic", "smb_async_elastic"):
            strategies = {kind: tf_smb.SMBStrategy(
                mode="async" if kind == "smb_async_elastic" else "sync", elastic=True,
                commit_steps=commit_steps)}
        else:
            raise ValueError(f"unknown fit strategy {kind!r}")
        rank = hvd.rank() if kind == "hvd_api" else getattr(
            next(iter(strategies.values())), "rank", 0)
    import keras

    for model in models:
        x, y = fit_data(model, samples[model])
        dataset = tf.data.Dataset.from_tensor_slices((x, y))
        if kind == "hvd_api":  # a Horovod script shards its data itself
            dataset = dataset.shard(hvd.size(), hvd.rank()).batch(batch // hvd.size(),
                                                                  drop_remainder=True)
        else:
            dataset = dataset.batch(batch, drop_remainder=True)
        if autotune is not None:
            options = tf.data.Options()
            options.autotune.enabled = autotune
            dataset = dataset.with_options(options)
        nets, timers = {}, {}
        for name, strategy in strategies.items():
            with strategy.scope():
                nets[name] = build_fit_model(model, distributed_optimizer=kind == "hvd_api")
            timers[name] = epoch_timer()
        if len(nets) == 1:
            (name, net), = nets.items()
            net.fit(dataset, epochs=epochs, shuffle=False, verbose=0,
                    callbacks=[timers[name], *([killer(kill)] if kill else [])])
        else:  # one epoch each in turn, the order rotating: all see the same load
            for epoch in range(epochs):
                order = list(nets)[epoch % len(nets):] + list(nets)[:epoch % len(nets)]
                for name in order:
                    nets[name].fit(dataset, epochs=1, shuffle=False, verbose=0,
                                   callbacks=[timers[name]])
        for name, timer in timers.items():
            elastic = getattr(strategies[name], "elastic_fit", None)
            extra = {} if elastic is None else {
                "rank": strategies[name].rank, "changes": elastic.changes,
                "median_commit_s": (statistics.median(elastic.commit_seconds)
                                    if elastic.commit_seconds else None)}
            common.print_result({
                "kind": name, "model": model, "rank": rank,
                "samples_per_epoch": (samples[model] // batch) * batch,
                "epoch_s": timer.times, **step_summary(timer.steps), **extra})
        del nets
        keras.backend.clear_session()


def step_summary(steps: Sequence[Sequence[float]]) -> dict:
    """A rank's steps in brief (result lines stay short: mpirun may interleave long
    ones): steps per epoch, and the median step time over the epochs after the
    first (it traces the step function) that trained any step, else over all."""
    timed = [t for epoch in steps[1:] for t in epoch] or [t for epoch in steps for t in epoch]
    return {"steps_per_epoch": [len(epoch) for epoch in steps],
            "median_step_s": statistics.median(timed) if timed else None}


def parse_samples(text: str) -> Dict[str, int]:
    """'cnn:256,mlp:512' -> {'cnn': 256, 'mlp': 512}."""
    samples = {}
    for item in common.split_list(text, ""):
        model, _, count = item.partition(":")
        samples[model] = int(count)
    return samples


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.roles.fit")
    parser.add_argument("--kind", required=True, choices=KINDS)
    parser.add_argument("--fit_models", required=True, help=f"comma list of {FIT_MODELS}")
    parser.add_argument("--fit_epochs", type=int, required=True)
    parser.add_argument("--fit_batch", type=int, required=True, help="global batch")
    parser.add_argument("--samples", required=True, help="samples per epoch, model:N,...")
    parser.add_argument("--fit_autotune", choices=("unset", "on", "off"), default="unset",
                        help="the dataset's options.autotune.enabled")
    parser.add_argument("--fit_commit_steps", type=int, default=10,
                        help="smb_elastic, smb_async_elastic: batches between commits")
    parser.add_argument("--fit_kill", default="", help="smb_*elastic: W:E:B, a worker's death")
    args = parser.parse_args(argv)
    models = common.split_list(args.fit_models, "")
    samples = parse_samples(args.samples)
    if any(m not in FIT_MODELS or m not in samples for m in models):
        parser.error(f"want models of {FIT_MODELS}, each with --samples; got {models}, "
                     f"{samples}")
    run(args.kind, models, args.fit_epochs, args.fit_batch, samples,
        {"unset": None, "on": True, "off": False}[args.fit_autotune], args.fit_commit_steps,
        args.fit_kill)


if __name__ == "__main__":
    main()
