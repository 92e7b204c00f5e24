"""The benchmark suite: SMB against Horovod (MPI, Gloo), MultiWorkerMirroredStrategy and memcpy.

One command measures every strategy side by side, on this machine, in one run:

1. Communication per step, for the float32 trainable-variable shapes of `mlp` (Dense
   784-512-512-10), `resnet50`, `vgg16` and `inception_v3` (`keras.applications`,
   weights=None, shapes only), on each of `--workers` local workers:
     * SMB sync: one fused `tf_smb.allreduce` of all the gradients (under tf_smb.run);
     * SMB async: `param_read` of every parameter, then `param_push` of a delta for each,
       what SMBStrategy(mode="async") does per step (examples/benchmark_async.py's worker,
       on a box sized to the models);
     * Horovod-MPI: `hvd.grouped_allreduce(op=hvd.Sum)` under `mpirun`;
     * Horovod-Gloo: the same under `horovodrun --gloo`;
     * MWMS-RING: MultiWorkerMirroredStrategy (RING, 127.0.0.1) `all_reduce("sum")`;
     * memcpy: one `np.copyto` of the same bytes in the driver, the physical floor.
   The collectives pass a barrier before each timed step (an all-reduce of one scalar for
   MWMS and Horovod); the async steps run back to back without one (they never wait for
   each other). A step is one tf.function call plus the fetch of one element of its
   result; every all-reduce is checked once against the expected sum. Medians over
   `--iters` timed steps after `--warmup` (async: over every worker's steps). One job per
   strategy and worker count times every model in turn.
2. End to end: `model.fit` throughput (samples/s of synthetic data; epochs after the
   first at the median step time, the slowest worker's: see fit_throughput) of a small CNN and the MLP on `--fit_workers`
   workers with SMBStrategy sync and async, HorovodStrategy (under mpirun and under
   horovodrun --gloo) and MultiWorkerMirroredStrategy; and on one worker, SMBStrategy
   against no strategy at all (the two models trained in one process, epochs alternated,
   so both see the same machine load), as the SMB overhead in percent.

Everything goes to `--out_dir` (default bench_out/): `benchmark.md` (the tables, ratios to
SMB, the targets, failures), `comm.csv`, `fit.csv`, `targets.csv`, every timing in
`benchmark.json`, and the plots `comm.png` (ms per step against workers, one subplot per
model, one line per strategy) and `fit.png` (fit throughput). The markdown is printed too.

A strategy the machine lacks (Horovod not installed, no mpirun) reads n/a with the reason
and never stops the run. Every subprocess is killed with its process group and children
when it passes `--timeout`; a failed cell reads n/a and its last output lines go to the
markdown's error section.

    PYTHONPATH=. python examples/benchmark.py                        # everything (~17 min)
    PYTHONPATH=. python examples/benchmark.py --smoke --out_dir=/tmp/bench      # ~2 min
    PYTHONPATH=. python examples/benchmark.py --models=resnet50 --workers=2 \\
        --fit_strategies=                                             # part 1 only
"""
from __future__ import annotations

import csv
import dataclasses
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

from absl import app, flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402  (shared helpers: shapes, processes, the timed loop)
from bench_common import Failure, fmt, ratio  # noqa: E402

FLAGS = flags.FLAGS
SCRIPT = pathlib.Path(__file__).resolve()
ASYNC_SCRIPT = SCRIPT.parent / "benchmark_async.py"
RESULT_TAG = "SUITE_RESULT "
FULL_MODELS, SMOKE_MODELS = "mlp,resnet50,vgg16,inception_v3", "tiny_mlp"
COMM_STRATEGIES = ("smb_sync", "smb_async", "horovod_mpi", "horovod_gloo", "mwms")
FIT_STRATEGIES = ("smb_sync", "smb_async", "horovod_mpi", "horovod_gloo", "mwms", "single")
FIT_MODELS = ("cnn", "mlp")
LABELS = {"smb_sync": "SMB sync", "smb_async": "SMB async", "horovod_mpi": "Horovod-MPI",
          "horovod_gloo": "Horovod-Gloo", "mwms": "MWMS-RING", "memcpy": "memcpy",
          "none_1": "no strategy (1 worker)", "onedevice_1": "OneDeviceStrategy (1 worker)",
          "smb_1": "SMB sync (1 worker)"}
SINGLE_SERIES = ("none_1", "onedevice_1", "smb_1")
COLORS = {"smb_sync": "tab:red", "smb_async": "tab:orange", "horovod_mpi": "tab:blue",
          "horovod_gloo": "tab:cyan", "mwms": "tab:green", "memcpy": "0.4",
          "none_1": "0.6", "onedevice_1": "tab:purple", "smb_1": "tab:red"}
# Synthetic samples per epoch of each fit model (global batch --fit_batch).
FIT_SAMPLES = {"cnn": 8192, "mlp": 32768}
SMOKE_FIT_SAMPLES = {"cnn": 256, "mlp": 512}
# The target model of the communication targets (else the largest measured).
TARGET_MODEL = "resnet50"

flags.DEFINE_enum("role", "driver", ["driver", "probe", "comm", "fit"],
                  "driver, or a subprocess of it")
flags.DEFINE_string("kind", None, "comm worker: smb, mwms or horovod; fit worker: smb_sync, "
                    "smb_async, horovod, mwms or single")
flags.DEFINE_string("models", None, f"communication models, from {', '.join(bc.MODELS)} "
                    f"(default {FULL_MODELS}; with --smoke {SMOKE_MODELS})")
flags.DEFINE_string("workers", None, "communication worker counts (default 2,3; smoke 2)")
flags.DEFINE_string("comm_strategies", ",".join(COMM_STRATEGIES),
                    "communication strategies; empty skips part 1")
flags.DEFINE_integer("iters", None, "timed steps per model (default 20; 3 with --smoke)")
flags.DEFINE_integer("warmup", None, "untimed steps first (default 3; 1 with --smoke)")
flags.DEFINE_string("fit_models", ",".join(FIT_MODELS), "fit models (cnn, mlp)")
flags.DEFINE_string("fit_strategies", ",".join(FIT_STRATEGIES),
                    "fit strategies (single: 1 worker, SMB against none); empty skips part 2")
flags.DEFINE_integer("fit_workers", 2, "workers of the multi-worker fit runs")
flags.DEFINE_integer("fit_epochs", None, "fit epochs; the first is not timed "
                     "(default 8; 3 with --smoke)")
flags.DEFINE_integer("fit_batch", None, "global batch of the fit runs (default 256; 64 smoke)")
flags.DEFINE_integer("fit_samples", None, "synthetic samples per epoch (default: cnn "
                     f"{FIT_SAMPLES['cnn']}, mlp {FIT_SAMPLES['mlp']}; smoke "
                     f"{SMOKE_FIT_SAMPLES['cnn']}, {SMOKE_FIT_SAMPLES['mlp']})")
flags.DEFINE_bool("smoke", False, "tiny shapes, 2 workers, few steps, tiny fit runs (for CI)")
flags.DEFINE_float("timeout", 900.0, "seconds each subprocess may run before it is killed")
flags.DEFINE_string("out_dir", "bench_out", "where the results go")
flags.DEFINE_string("shapes_out", None, "probe: where to write the models' shapes")


# =========================================================================== workers

def run_probe(models: Sequence[str], shapes_out: str) -> None:
    """Versions, whether Horovod imports (and with which controllers), the models' shapes."""
    import tensorflow as tf
    import keras
    info: Dict[str, object] = {"python": sys.version.split()[0], "tensorflow": tf.__version__,
                               "keras": keras.__version__, "cpus": os.cpu_count()}
    try:
        import horovod
        import horovod.tensorflow as hvd
        info.update(horovod=horovod.__version__, horovod_mpi=bool(hvd.mpi_built()),
                    horovod_gloo=bool(hvd.gloo_built()))
    except Exception as e:  # pylint: disable=broad-except  (any failure: unavailable)
        info["horovod_error"] = f"{type(e).__name__}: {e}"
    shapes = bc.write_shapes_file(models, pathlib.Path(shapes_out))
    info["models"] = {m: {"bytes": bc.set_bytes(s), "params": bc.num_params(s),
                          "tensors": len(s)} for m, s in shapes.items()}
    print(RESULT_TAG + json.dumps({"probe": info}), flush=True)


def run_comm_worker(kind: str, models: Sequence[str], iters: int, warmup: int) -> None:
    """Times the all-reduce of each model's shapes in turn; rank 0 prints the results."""
    rank, world, reduce_fn, barrier = bc.collective(kind)  # before Keras touches TF
    for model in models:
        result = bc.time_collective(kind, model, bc.model_shapes(model), iters, warmup,
                                    rank, world, reduce_fn, barrier)
        if rank == 0:
            print(RESULT_TAG + json.dumps(dict(result, model=model)), flush=True)


def fit_data(model: str, samples: int):
    import numpy as np
    rng = np.random.default_rng(0)
    shape = (28, 28, 1) if model == "cnn" else (784,)
    x = rng.random((samples, *shape), dtype=np.float32)
    y = rng.integers(0, 10, samples).astype(np.int32)
    return x, y


def build_fit_model(model: str):
    """The small CNN or the MLP, compiled (SGD with momentum, loss only, no XLA)."""
    import keras
    keras.utils.set_random_seed(0)  # the same initial weights on every worker and run
    if model == "cnn":
        layers = [keras.Input((28, 28, 1)),
                  keras.layers.Conv2D(16, 3, activation="relu"), keras.layers.MaxPooling2D(),
                  keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(),
                  keras.layers.Flatten(), keras.layers.Dense(64, activation="relu"),
                  keras.layers.Dense(10)]
    else:
        layers = [keras.Input((784,)), keras.layers.Dense(512, activation="relu"),
                  keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)]
    net = keras.Sequential(layers, name=f"bench_{model}")
    net.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                jit_compile=False)
    return net


def run_fit_worker(kind: str, models: Sequence[str], epochs: int, batch: int,
                   samples: Dict[str, int]) -> None:
    """Fits each model with the strategy `kind`; every rank prints each model's epoch times."""
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
        elif kind in ("smb_sync", "smb_async"):
            strategies = {kind: tf_smb.SMBStrategy(mode=kind[4:])}
        else:
            raise ValueError(f"unknown fit strategy {kind!r}")
        rank = getattr(next(iter(strategies.values())), "rank", 0)
    import keras

    class EpochTimer(keras.callbacks.Callback):
        """Each epoch's wall time and the time of each of its training steps."""

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

    for model in models:
        x, y = fit_data(model, samples[model])
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)
        nets, timers = {}, {}
        for name, strategy in strategies.items():
            with strategy.scope():
                nets[name] = build_fit_model(model)
            timers[name] = EpochTimer()
        if len(nets) == 1:
            (name, net), = nets.items()
            net.fit(dataset, epochs=epochs, shuffle=False, verbose=0, callbacks=[timers[name]])
        else:  # one epoch each in turn, the order rotating: all see the same load
            for epoch in range(epochs):
                order = list(nets)[epoch % len(nets):] + list(nets)[:epoch % len(nets)]
                for name in order:
                    nets[name].fit(dataset, epochs=1, shuffle=False, verbose=0,
                                   callbacks=[timers[name]])
        for name, timer in timers.items():
            print(RESULT_TAG + json.dumps({
                "kind": name, "model": model, "rank": rank,
                "samples_per_epoch": (samples[model] // batch) * batch,
                "epoch_s": timer.times, **step_summary(timer.steps)}), flush=True)
        del nets
        keras.backend.clear_session()


# =========================================================================== driver: running

@dataclasses.dataclass
class Cell:
    """One measured number (ms per step, or samples/s), or why there is none."""
    value: Optional[float] = None
    reason: str = ""
    detail: Dict[str, object] = dataclasses.field(default_factory=dict)


def mpirun_prefix(world: int) -> List[str]:
    root = ["--allow-run-as-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    # No binding: the other strategies' processes are not bound either.
    return ["mpirun", *root, "--oversubscribe", "--bind-to", "none", "-np", str(world)]


def horovodrun_path() -> Optional[str]:
    return (shutil.which("horovodrun", path=os.path.dirname(sys.executable))
            or shutil.which("horovodrun"))


def availability(info: dict) -> Dict[str, str]:
    """Why each strategy cannot run here ("" when it can)."""
    reasons = {s: "" for s in (*COMM_STRATEGIES, *FIT_STRATEGIES)}
    hint = "install it with `bash tools/install_horovod.sh`"
    if "horovod_error" in info:
        for s in ("horovod_mpi", "horovod_gloo"):
            reasons[s] = f"Horovod not available ({info['horovod_error']}); {hint}"
        return reasons
    if not info.get("horovod_mpi"):
        reasons["horovod_mpi"] = f"Horovod built without MPI; {hint}"
    elif not shutil.which("mpirun"):
        reasons["horovod_mpi"] = "mpirun not found on PATH (Open MPI not installed)"
    if not info.get("horovod_gloo"):
        reasons["horovod_gloo"] = f"Horovod built without Gloo; {hint}"
    elif not horovodrun_path():
        reasons["horovod_gloo"] = "horovodrun not found beside python or on PATH"
    return reasons


def launch(strategy: str, world: int, argv: List[str], env: Dict[str, str]
           ) -> List[Tuple[List[str], Dict[str, str]]]:
    """The commands that run `argv` as `world` workers of `strategy` (SMB async excepted)."""
    if strategy in ("smb_sync", "smb_async"):
        return [([sys.executable, "-m", "tf_smb.run", "-np", str(world), *argv], env)]
    if strategy == "horovod_mpi":
        return [([*mpirun_prefix(world), *argv], env)]
    if strategy == "horovod_gloo":
        return [([horovodrun_path() or "horovodrun", "-np", str(world), "--gloo", *argv], env)]
    if strategy == "mwms":
        hosts = [f"127.0.0.1:{p}" for p in bc.free_ports(world)]
        return [(argv, dict(env, TF_CONFIG=json.dumps(
            {"cluster": {"worker": hosts}, "task": {"type": "worker", "index": i}})))
            for i in range(world)]
    if strategy == "single":
        return [(argv, env)]
    raise ValueError(strategy)


def failure_reason(reason: str, outputs: Sequence[str]) -> str:
    """The process failure plus the error it printed, e.g. `exit codes 1, 1: ValueError: …`."""
    error = bc.error_line(outputs)
    return f"{reason}: {error}" if error else reason


def run_comm(strategy: str, world: int, models: List[str], iters: int, warmup: int,
             total_bytes: int, env: Dict[str, str], failures: List[Failure]
             ) -> Dict[str, Cell]:
    """One job of `world` workers of `strategy` times every model; a cell per model."""
    common = [f"--models={','.join(models)}", f"--iters={iters}", f"--warmup={warmup}"]
    if strategy == "smb_async":
        argv = [sys.executable, str(ASYNC_SCRIPT), "--role=worker", "--comm_modes=push",
                *common]
        try:  # room for every model's parameters, at 64-byte offsets, and some
            ok, outputs, reason = bc.run_box_job(argv, world, total_bytes + (64 << 20),
                                                 FLAGS.timeout, env)
        except (RuntimeError, ValueError, OSError) as e:
            ok, outputs, reason = False, [], f"cannot create the box: {e}"
        tag, per_model = bc.ASYNC_RESULT_TAG, world  # every rank reports
    else:
        kind = {"smb_sync": "smb", "mwms": "mwms"}.get(strategy, "horovod")
        argv = [sys.executable, str(SCRIPT), "--role=comm", f"--kind={kind}", *common]
        ok, outputs, reason = bc.run_processes(launch(strategy, world, argv, env), FLAGS.timeout)
        tag, per_model = RESULT_TAG, 1  # rank 0 reports (the steps start together)
    results: Dict[str, List[dict]] = {m: [] for m in models}
    for out in outputs:  # results printed before a failure still count
        for r in bc.parse_tagged(out, tag):
            if r.get("model") in results:
                results[r["model"]].append(r)
    cells = {}
    for model in models:
        rs = results[model]
        if len(rs) >= per_model:
            cells[model] = Cell(bc.pooled_median_ms(rs), detail={"times_s": [r["times_s"]
                                                                            for r in rs]})
        else:
            cells[model] = Cell(None, failure_reason(reason or "no result line", outputs))
    missing = [m for m in models if cells[m].value is None]
    if missing or not ok:
        bc.report_failure(failures, f"communication: {LABELS[strategy]} at {world} workers "
                          f"({', '.join(missing) or 'exit'})",
                          failure_reason(reason or "no result line", outputs),
                          bc.error_excerpt(outputs))
    return cells


def step_summary(steps: Sequence[Sequence[float]]) -> dict:
    """A rank's steps in brief (result lines stay short: mpirun may interleave long
    ones): steps per epoch, and the median step time over the epochs after the
    first (it traces the step function) that trained any step, else over all."""
    timed = [t for epoch in steps[1:] for t in epoch] or [t for epoch in steps for t in epoch]
    return {"steps_per_epoch": [len(epoch) for epoch in steps],
            "median_step_s": statistics.median(timed) if timed else None}


def fit_throughput(results: Sequence[dict]) -> Tuple[float, float, int]:
    """(samples/s, epoch s at the median step time, epochs timed), the slowest rank's.

    A rank's epoch takes its steps per epoch (the median over the epochs after the
    first that trained any step) times its median step time: a process on this shared
    machine now and then stalls for seconds (seen for SMB and Horovod alike), and with
    a few epochs those stalls, not the strategy, would decide a median epoch.
    """
    estimates, timed = [], []
    for r in results:
        counts = [n for n in r["steps_per_epoch"][1:] if n] or \
            [n for n in r["steps_per_epoch"] if n]
        estimates.append(statistics.median(counts) * r["median_step_s"])
        timed.append(len(counts))
    epoch_s = max(estimates)
    return results[0]["samples_per_epoch"] / epoch_s, epoch_s, min(timed)


def run_fit(strategy: str, models: List[str], epochs: int, batch: int,
            samples: Dict[str, int], env: Dict[str, str], failures: List[Failure]
            ) -> Dict[Tuple[str, str], Cell]:
    """One fit job of `strategy`; a cell per (model, series), series = strategy, or
    SINGLE_SERIES for the one-worker job."""
    kind = {"horovod_mpi": "horovod", "horovod_gloo": "horovod"}.get(strategy, strategy)
    world = 1 if strategy == "single" else FLAGS.fit_workers
    argv = [sys.executable, str(SCRIPT), "--role=fit", f"--kind={kind}",
            f"--fit_models={','.join(models)}", f"--fit_epochs={epochs}",
            f"--fit_batch={batch}", *(f"--fit_samples_{m}={samples[m]}" for m in models)]
    ok, outputs, reason = bc.run_processes(launch(strategy, world, argv, env), FLAGS.timeout)
    series = list(SINGLE_SERIES) if strategy == "single" else [strategy]
    found: Dict[Tuple[str, str], List[dict]] = {}
    for out in outputs:
        for r in bc.parse_tagged(out, RESULT_TAG):
            name = strategy if r["kind"] == kind and strategy != "single" else r["kind"]
            found.setdefault((r["model"], name), []).append(r)
    cells = {}
    for model in models:
        for name in series:
            rs = found.get((model, name), [])
            if len(rs) == world and all(r.get("median_step_s") for r in rs):
                sps, epoch_s, timed = fit_throughput(rs)
                cells[(model, name)] = Cell(sps, detail={"epoch_s": epoch_s, "epochs_timed": timed,
                                                         "ranks": [r["epoch_s"] for r in rs],
                                                         "median_step_s": [r["median_step_s"]
                                                                           for r in rs]})
            else:
                cells[(model, name)] = Cell(None, failure_reason(reason or "no result line",
                                                                 outputs))
    if not ok or any(c.value is None for c in cells.values()):
        bc.report_failure(failures, f"fit: {LABELS.get(strategy, strategy)}",
                          failure_reason(reason or "no result line", outputs),
                          bc.error_excerpt(outputs))
    return cells


# =========================================================================== driver: reporting

def target_row(what: str, measured: str, goal: str, ok: Optional[bool]) -> List[str]:
    return [what, measured, goal, "n/a" if ok is None else ("met" if ok else "missed")]


def compute_targets(comm: Dict[Tuple[str, int, str], Cell], comm_models: List[str],
                    worlds: List[int], model_bytes: Dict[str, int],
                    fit: Dict[Tuple[str, str], Cell], fit_models: List[str]) -> List[List[str]]:
    rows: List[List[str]] = []
    if comm_models:
        model = (TARGET_MODEL if TARGET_MODEL in comm_models
                 else max(comm_models, key=lambda m: model_bytes[m]))
        for world in worlds:
            def get(s: str) -> Cell:
                return comm.get((model, world, s), Cell(None, "not measured"))
            smb, async_, mpi, copy = (get("smb_sync"), get("smb_async"), get("horovod_mpi"),
                                      get("memcpy"))
            where = f"{model}, {world} workers"

            def four_times_mpi(target: str, label: str, cell: Cell) -> List[str]:
                r = ratio(mpi.value, cell.value)
                return target_row(
                    f"{target} ({where})",
                    f"{fmt(r, '.2f')}x faster ({label} {fmt(cell.value)} ms, Horovod-MPI "
                    f"{fmt(mpi.value)} ms)" if r else f"n/a ({mpi.reason or cell.reason})",
                    ">= 4x faster", None if r is None else r >= 4)

            rows.append(four_times_mpi("SMB sync all-reduce vs Horovod-MPI", "SMB", smb))
            r = ratio(smb.value, copy.value)
            rows.append(target_row(
                f"SMB sync all-reduce vs memcpy ({where})",
                f"{fmt(r, '.2f')}x memcpy (SMB {fmt(smb.value)} ms, memcpy "
                f"{fmt(copy.value)} ms)" if r else f"n/a ({smb.reason})",
                "within 3x", None if r is None else r <= 3))
            rows.append(four_times_mpi("SMB async step vs Horovod-MPI all-reduce",
                                       "SMB async", async_))
    if "mlp" in fit_models:
        smb, mwms = fit.get(("mlp", "smb_sync"), Cell()), fit.get(("mlp", "mwms"), Cell())
        hvd_name = "horovod_mpi" if fit.get(("mlp", "horovod_mpi"), Cell()).value else \
            "horovod_gloo"
        hvd = fit.get(("mlp", hvd_name), Cell(None, "not measured"))
        label = LABELS[hvd_name]
        ok = None if smb.value is None or hvd.value is None else smb.value >= hvd.value
        rows.append(target_row(
            f"fit samples/s, mlp, {FLAGS.fit_workers} workers: SMB sync >= {label}",
            f"SMB {fmt(smb.value, '.0f')}, {label} {fmt(hvd.value, '.0f')}"
            + (f" ({hvd.reason or smb.reason})" if ok is None else ""), "SMB >= Horovod", ok))
        ok = None if hvd.value is None or mwms.value is None else hvd.value >= mwms.value
        rows.append(target_row(
            f"fit samples/s, mlp, {FLAGS.fit_workers} workers: {label} >= MWMS",
            f"{label} {fmt(hvd.value, '.0f')}, MWMS {fmt(mwms.value, '.0f')}"
            + (f" ({mwms.reason or hvd.reason})" if ok is None else ""), "Horovod >= MWMS", ok))
    for model in fit_models:
        none, smb = fit.get((model, "none_1")), fit.get((model, "smb_1"))
        if none is None or smb is None:
            continue
        over = overhead_pct(none.value, smb.value)
        rows.append(target_row(
            f"1-worker SMBStrategy overhead vs no strategy, fit {model}",
            f"{fmt(over, '.1f')}% (none {fmt(none.value, '.0f')}, SMB {fmt(smb.value, '.0f')} "
            f"samples/s)" if over is not None else f"n/a ({none.reason or smb.reason})",
            "<= 5%", None if over is None else over <= 5))
    return rows


def overhead_pct(none: Optional[float], smb: Optional[float]) -> Optional[float]:
    """How much slower (in throughput) the 1-worker SMBStrategy is than no strategy, in %."""
    return 100.0 * (none - smb) / none if none and smb else None


def plot_comm(path: pathlib.Path, comm: Dict[Tuple[str, int, str], Cell], models: List[str],
              worlds: List[int], strategies: List[str], model_bytes: Dict[str, int]) -> None:
    """ms per step against workers, one subplot per model, one line per strategy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    fig, axes = plt.subplots(1, len(models), figsize=(4.0 * len(models) + 1.0, 4.6),
                             squeeze=False)
    for ax, model in zip(axes[0], models):
        for s in [*strategies, "memcpy"]:
            points = [(w, comm[(model, w, s)].value) for w in worlds
                      if comm.get((model, w, s)) is not None
                      and comm[(model, w, s)].value is not None]
            if not points:
                continue
            xs, ys = zip(*points)
            floor = s == "memcpy"
            ax.plot(xs, ys, marker="x" if floor else "o", markersize=7,
                    linestyle="--" if floor else "-", color=COLORS[s], linewidth=2,
                    label="memcpy (floor)" if floor else LABELS[s])
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xticks(worlds)
        if len(worlds) == 1:
            ax.set_xlim(worlds[0] - 0.5, worlds[0] + 0.5)
        ax.set_title(f"{model} ({model_bytes[model] / 2**20:.3g} MB)")
        ax.set_xlabel("workers")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("communication time per step (ms, log scale)")
    handles: Dict[str, object] = {}
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    ncol = min(len(handles), 3 if len(models) == 1 else 6)
    rows = -(-len(handles) // max(ncol, 1))
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=ncol,
               frameon=False)
    fig.suptitle("Gradient exchange per step (lower is better)")
    fig.tight_layout(rect=(0, 0.06 * rows + 0.02, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_fit(path: pathlib.Path, fit: Dict[Tuple[str, str], Cell], models: List[str],
             strategies: List[str]) -> None:
    """Bars of fit samples/s: the multi-worker strategies, and the one-worker comparison."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    multi = [s for s in strategies if s != "single"]
    panels = [(f"{FLAGS.fit_workers} workers", multi)] if multi else []
    if "single" in strategies:
        panels.append(("1 worker: SMBStrategy vs no strategy", list(SINGLE_SERIES)))
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), squeeze=False,
                             figsize=(1.6 + sum(1.2 + 0.9 * len(p[1]) for p in panels), 5.0),
                             gridspec_kw={"width_ratios": [len(p[1]) + 1 for p in panels]})
    for ax, (title, series) in zip(axes[0], panels):
        width = 0.8 / len(series)
        values = [fit[(m, s)].value for m in models for s in series
                  if fit.get((m, s)) is not None and fit[(m, s)].value]
        peak = max(values or [1.0])
        for i, s in enumerate(series):
            for j, model in enumerate(models):
                cell = fit.get((model, s), Cell(None, "not run"))
                x = j + (i - (len(series) - 1) / 2) * width
                value = cell.value or 0.0
                ax.bar(x, value, width, color=COLORS[s], label=LABELS[s] if j == 0 else None,
                       hatch="//" if s == "smb_1" else None, edgecolor="white")
                ax.text(x, value + peak * 0.01, f"{value:.0f}" if cell.value else "n/a",
                        ha="center", va="bottom", fontsize=8, rotation=90,
                        color="black" if cell.value else COLORS[s])
        if title.startswith("1 worker"):
            for j, model in enumerate(models):
                over = overhead_pct(fit.get((model, "none_1"), Cell()).value,
                                    fit.get((model, "smb_1"), Cell()).value)
                if over is not None:
                    ax.text(j, peak * 1.17, f"SMB overhead {over:.1f}%", ha="center",
                            fontsize=9)
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels(models)
        ax.set_ylim(0, peak * 1.28)
        ax.set_title(title)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08),
                  ncol=2 if len(series) <= 4 else 3, frameon=False)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].set_ylabel("model.fit samples/s (higher is better)")
    fig.suptitle("End to end: Keras model.fit throughput, synthetic data")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_csv(path: pathlib.Path, header: Sequence[str], rows: Sequence[Sequence[object]]
              ) -> None:
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([list(header), *map(list, rows)])


def run_driver(models: List[str], worlds: List[int], comm_strategies: List[str],
               fit_models: List[str], fit_strategies: List[str], iters: int, warmup: int,
               epochs: int, batch: int, samples: Dict[str, int]) -> int:
    out_dir = pathlib.Path(FLAGS.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    failures: List[Failure] = []
    tmp = tempfile.TemporaryDirectory(prefix="tf_smb_bench_")
    shapes_path = pathlib.Path(tmp.name) / "shapes.json"
    env = bc.subprocess_env({bc.SHAPES_ENV: str(shapes_path)})

    # The probe: versions, Horovod, every model's shapes (written once for the workers).
    probe_models = sorted(set(models) | ({"tiny_mlp"} if not models else set()))
    ok, outputs, reason = bc.run_processes([([sys.executable, str(SCRIPT), "--role=probe",
                                              f"--models={','.join(probe_models)}",
                                              f"--shapes_out={shapes_path}"], env)],
                                           FLAGS.timeout)
    probe = [r["probe"] for r in bc.parse_tagged(outputs[0], RESULT_TAG) if "probe" in r]
    if not ok or not probe:
        print(f"the probe failed ({reason or 'no result'}); TensorFlow does not work here:\n"
              f"{bc.error_tail(outputs)}", file=sys.stderr)
        return 1
    info = probe[0]
    model_bytes = {m: info["models"][m]["bytes"] for m in models}
    unavailable = availability(info)
    for s in sorted(set(comm_strategies) | set(fit_strategies)):
        if unavailable.get(s):
            print(f"{LABELS.get(s, s)}: n/a, {unavailable[s]}", file=sys.stderr, flush=True)

    # Part 1: communication. One job per strategy and worker count, all models in turn.
    comm: Dict[Tuple[str, int, str], Cell] = {}
    total_bytes = sum(model_bytes.values())
    for world in worlds if comm_strategies else []:
        for s in comm_strategies:
            t0 = time.perf_counter()
            if unavailable.get(s):
                cells = {m: Cell(None, "unavailable: " + unavailable[s]) for m in models}
            else:
                cells = run_comm(s, world, models, iters, warmup, total_bytes, env, failures)
            for m, c in cells.items():
                comm[(m, world, s)] = c
            print(f"[{time.time() - started:6.0f} s] communication, {world} workers, "
                  f"{LABELS[s]}: " + ", ".join(f"{m} {fmt(c.value)} ms" for m, c in cells.items())
                  + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    if comm_strategies:
        for m in models:
            times = bc.memcpy_times(model_bytes[m], max(iters, 20))
            cell = Cell(1e3 * statistics.median(times), detail={"times_s": [times]})
            for world in worlds:
                comm[(m, world, "memcpy")] = cell

    # Part 2: fit.
    fit: Dict[Tuple[str, str], Cell] = {}
    for s in fit_strategies:
        t0 = time.perf_counter()
        series = list(SINGLE_SERIES) if s == "single" else [s]
        if unavailable.get(s):
            cells = {(m, n): Cell(None, "unavailable: " + unavailable[s])
                     for m in fit_models for n in series}
        else:
            cells = run_fit(s, fit_models, epochs, batch, samples, env, failures)
        fit.update(cells)
        print(f"[{time.time() - started:6.0f} s] fit, {LABELS.get(s, 'one worker')}: "
              + ", ".join(f"{m} {LABELS[n] if s == 'single' else ''} {fmt(c.value, '.0f')}"
                          .replace("  ", " ") for (m, n), c in cells.items())
              + f" samples/s  ({time.perf_counter() - t0:.0f} s)", flush=True)

    # Tables, CSV, plots.
    sections = [f"# tf_smb benchmark suite\n\n{environment_note(info, load, started)}"]
    comm_rows_csv: List[List[object]] = []
    if comm_strategies:
        shown = [*comm_strategies, "memcpy"]
        header = ["model", "workers", "params (M)", "MB", *(f"{LABELS[s]} ms" for s in shown)]
        rows = []
        for m in models:
            for w in worlds:
                rows.append([m, str(w), f"{info['models'][m]['params'] / 1e6:.3g}",
                             f"{model_bytes[m] / 2**20:.4g}",
                             *(fmt(comm[(m, w, s)].value) for s in shown)])
                for s in shown:
                    c = comm[(m, w, s)]
                    comm_rows_csv.append([m, w, LABELS[s], f"{model_bytes[m] / 2**20:.6g}",
                                          info["models"][m]["tensors"], fmt(c.value, ".6g"),
                                          "ok" if c.value is not None else "n/a", c.reason])
        pairs = [(a, b) for a, b in (("horovod_mpi", "smb_sync"), ("horovod_gloo", "smb_sync"),
                                     ("mwms", "smb_sync"), ("smb_sync", "memcpy"),
                                     ("horovod_mpi", "smb_async"), ("smb_sync", "smb_async"))
                 if a in shown and b in shown]
        ratio_header = ["model", "workers", *(f"{LABELS[a]} / {LABELS[b]}" for a, b in pairs)]
        ratio_rows = [[m, str(w), *(fmt(ratio(comm[(m, w, a)].value, comm[(m, w, b)].value),
                                        ".2f") for a, b in pairs)]
                      for m in models for w in worlds]
        sections.append(
            "## Communication per step (ms)\n\n" + bc.markdown(header, rows) + "\n\n"
            f"float32 gradients, MB = MiB; medians of {iters} timed steps after {warmup} "
            "warm-up. SMB sync, Horovod and MWMS: one all-reduce of every tensor (fused / "
            "grouped), a barrier before each step, rank 0's times. SMB async: read every "
            "parameter from the box and push a delta for each, steps back to back, every "
            "worker's times. memcpy: one np.copyto of the same bytes (the floor).\n\n"
            "### Ratios (time / time: how many times faster the right-hand side is)\n\n"
            + bc.markdown(ratio_header, ratio_rows))
        write_csv(out_dir / "comm.csv", ["model", "workers", "strategy", "MB", "tensors", "ms",
                                         "status", "reason"], comm_rows_csv)
        plot_comm(out_dir / "comm.png", comm, models, worlds, comm_strategies, model_bytes)
    fit_rows_csv: List[List[object]] = []
    if fit_strategies:
        multi = [s for s in fit_strategies if s != "single"]
        if multi:
            pairs = [("smb_sync", s) for s in multi if s != "smb_sync" and "smb_sync" in multi]
            header = ["model", *(LABELS[s] for s in multi),
                      *(f"{LABELS[a]} / {LABELS[b]}" for a, b in pairs)]
            rows = [[m, *(fmt(fit[(m, s)].value, ".0f") for s in multi),
                     *(fmt(ratio(fit[(m, a)].value, fit[(m, b)].value), ".2f")
                       for a, b in pairs)] for m in fit_models]
            sections.append(
                f"## model.fit throughput, {FLAGS.fit_workers} workers (samples/s)\n\n"
                + bc.markdown(header, rows) + "\n\n"
                f"Synthetic data, global batch {batch}, {epochs} epochs of "
                + ", ".join(f"{m} {samples[m]}" for m in fit_models) + " samples; the "
                "epochs after the first, at the median step time (steps per epoch x median "
                "step), the slowest worker's; the median step keeps a process's rare "
                "multi-second stalls on this shared machine out of the result. "
                "SGD with momentum 0.9, no metrics, jit_compile=False. SMB async: update="
                "\"delta\", each worker trains every other global batch. Ratios: samples/s "
                "over samples/s (above 1: SMB sync is faster).")
        if "single" in fit_strategies:
            rows = []
            for m in fit_models:
                none, one, smb = (fit[(m, s)] for s in SINGLE_SERIES)
                rows.append([m, fmt(none.value, ".0f"), fmt(smb.value, ".0f"),
                             fmt(overhead_pct(none.value, smb.value), ".1f"),
                             fmt(one.value, ".0f"), fmt(overhead_pct(none.value, one.value), ".1f")])
            sections.append(
                "## One worker: SMBStrategy against no strategy (samples/s)\n\n"
                + bc.markdown(["model", "no strategy", "SMBStrategy (1 worker)",
                               "SMB overhead %", "OneDeviceStrategy",
                               "OneDeviceStrategy overhead %"], rows) + "\n\n"
                "The three models in one process, one epoch each in turn (the order "
                "rotating), so all see the same machine load; overhead = (none - X) / none. "
                "TensorFlow's own OneDeviceStrategy, on which SMBStrategy builds, is shown "
                "for reference: it is the cost of running under any tf.distribute strategy.")
        for (m, s), c in fit.items():
            fit_rows_csv.append([m, 1 if s in SINGLE_SERIES else FLAGS.fit_workers,
                                 LABELS[s], fmt(c.value, ".6g"),
                                 fmt(c.detail.get("epoch_s"), ".6g") if c.value else "n/a",
                                 c.detail.get("epochs_timed", "n/a") if c.value else "n/a",
                                 "ok" if c.value is not None else "n/a", c.reason])
        write_csv(out_dir / "fit.csv", ["model", "workers", "strategy", "samples_per_s",
                                        "epoch_s", "epochs_timed", "status", "reason"],
                  fit_rows_csv)
        plot_fit(out_dir / "fit.png", fit, fit_models, fit_strategies)

    targets = compute_targets(comm, models if comm_strategies else [], worlds, model_bytes,
                              fit, fit_models if fit_strategies else [])
    if targets:
        sections.append("## Targets\n\n" + bc.markdown(["target", "measured", "goal", "status"],
                                                       targets))
        write_csv(out_dir / "targets.csv", ["target", "measured", "goal", "status"], targets)
    missing = {s: r for s, r in unavailable.items()
               if r and (s in comm_strategies or s in fit_strategies)}
    if missing:
        sections.append("## Unavailable strategies\n\n" + "\n".join(
            f"* {LABELS[s]}: {r}" for s, r in sorted(missing.items())))
    if failures:
        sections.append("## Errors (last output lines)\n\n" + "\n\n".join(
            f"### {f.what}\n\n{f.reason}\n\n```\n{f.tail}\n```" for f in failures))
    sections.append(f"Total time {time.time() - started:.0f} s.")
    text = "\n\n".join(sections) + "\n"
    (out_dir / "benchmark.md").write_text(text)
    (out_dir / "benchmark.json").write_text(json.dumps({
        "environment": info, "load_average": load,
        "comm": [{"model": m, "workers": w, "strategy": s, "ms": c.value, "reason": c.reason,
                  **c.detail} for (m, w, s), c in comm.items()],
        "fit": [{"model": m, "strategy": s, "samples_per_s": c.value, "reason": c.reason,
                 **c.detail} for (m, s), c in fit.items()],
        "targets": targets, "failures": [f._asdict() for f in failures]}, indent=1))
    print(text, flush=True)
    tmp.cleanup()
    return 0


def environment_note(info: dict, load: Sequence[float], started: float) -> str:
    hvd = info.get("horovod") or f"not available ({info.get('horovod_error', '?')})"
    return (f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(started))}; "
            f"{info['cpus']} CPUs, load average at start {load[0]:.2f}; Python "
            f"{info['python']}, TensorFlow {info['tensorflow']}, Keras {info['keras']}, "
            f"Horovod {hvd}; command: `{' '.join(['python', *sys.argv])}`")


# =========================================================================== main

def split_list(value: Optional[str], default: str) -> List[str]:
    return [s for s in (default if value is None else value).split(",") if s]


def main(argv: Sequence[str]) -> None:
    del argv
    smoke = FLAGS.smoke
    models = split_list(FLAGS.models, SMOKE_MODELS if smoke else FULL_MODELS)
    iters = FLAGS.iters if FLAGS.iters is not None else (3 if smoke else 20)
    warmup = FLAGS.warmup if FLAGS.warmup is not None else (1 if smoke else 3)
    fit_models = split_list(FLAGS.fit_models, "")
    epochs = FLAGS.fit_epochs if FLAGS.fit_epochs is not None else (3 if smoke else 8)
    batch = FLAGS.fit_batch if FLAGS.fit_batch is not None else (64 if smoke else 256)
    samples = {m: getattr(FLAGS, f"fit_samples_{m}", None) or FLAGS.fit_samples
               or (SMOKE_FIT_SAMPLES if smoke else FIT_SAMPLES)[m] for m in FIT_MODELS}
    bad = ([m for m in models if m not in bc.MODELS] +
           [m for m in fit_models if m not in FIT_MODELS])
    if bad:
        raise app.UsageError(f"unknown models: {bad}")
    if iters < 1 or warmup < 0 or epochs < 1 or batch < 1:
        raise app.UsageError("need --iters >= 1, --warmup >= 0, --fit_epochs >= 1, "
                             "--fit_batch >= 1")
    if FLAGS.role == "probe":
        run_probe(models, FLAGS.shapes_out)
        return
    if FLAGS.role == "comm":
        run_comm_worker(FLAGS.kind, models, iters, warmup)
        return
    if FLAGS.role == "fit":
        run_fit_worker(FLAGS.kind, fit_models, epochs, batch, samples)
        return
    try:
        worlds = [int(w) for w in split_list(FLAGS.workers, "2" if smoke else "2,3")]
    except ValueError as e:
        raise app.UsageError(f"--workers must be a comma list of integers: {e}") from e
    comm_strategies = split_list(FLAGS.comm_strategies, "")
    fit_strategies = split_list(FLAGS.fit_strategies, "")
    bad = ([s for s in comm_strategies if s not in COMM_STRATEGIES] +
           [s for s in fit_strategies if s not in FIT_STRATEGIES])
    if bad or min(worlds, default=2) < 2 or FLAGS.fit_workers < 2:
        raise app.UsageError(f"unknown strategies {bad}, or fewer than 2 workers")
    if min(samples[m] for m in fit_models or FIT_MODELS) < batch:
        raise app.UsageError("--fit_samples must be at least --fit_batch")
    sys.exit(run_driver(models, worlds, comm_strategies, fit_models, fit_strategies,
                        iters, warmup, epochs, batch, samples))


for _model in FIT_MODELS:  # set by the driver for its fit workers
    flags.DEFINE_integer(f"fit_samples_{_model}", None, f"fit samples of {_model} "
                         "(overrides --fit_samples)")

if __name__ == "__main__":
    app.run(main)
