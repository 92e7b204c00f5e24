"""The benchmark suite: SMB against Horovod (MPI, Gloo), MultiWorkerMirroredStrategy and memcpy.

One command measures every strategy side by side, on this machine, in one run:

1. Communication per step, for the float32 trainable-variable shapes of `mlp` (Dense
   784-512-512-10), `resnet50`, `vgg16` and `inception_v3` (`keras.applications`,
   weights=None, shapes only), on each of `--workers` local workers:
     * SMB sync: one fused `tf_smb.allreduce` of all the gradients (under tf_smb.run);
     * SMB async: one `segments_push_read` of a delta for every parameter (push, then read
       back in one pass), what SMBStrategy(mode="async") does per step (benchmarks/roles/async_steps.py,
       under tf_smb.run with a heap sized to the models);
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
   first at the median step time, the slowest worker's: see fit_throughput) of a small
   CNN, the MLP and mlp10m (11.6M parameters; not with --smoke; ResNet-50 on request,
   --fit_models=resnet50, at a smaller --fit_batch) on `--fit_workers`
   workers (each bound to its own CPUs: tf_smb.run's default, mpirun --bind-to core;
   horovodrun --gloo places its own) with SMBStrategy sync and async, HorovodStrategy (under mpirun and under
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

    python -m benchmarks.suite                            # everything (~17 min)
    python -m benchmarks.suite --smoke --out_dir=/tmp/bench     # ~2 min
    python -m benchmarks.suite --models=resnet50 --workers=2 \\
        --fit_strategies=                                   # part 1 only

(from the checkout's root). The layout of the harness: see benchmarks/__init__.py.
"""
from __future__ import annotations

import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Sequence, Tuple

from absl import app, flags

from benchmarks import common
from benchmarks.processes import commands, role_argv, run_processes, subprocess_env
from benchmarks.report import (Cell, Failure, error_excerpt, error_tail, failure_reason, fmt,
                               markdown, overhead_pct, plot_comm, plot_fit, pooled_median_ms,
                               ratio, report_failure, write_csv)
from benchmarks.roles.fit import FIT_MODELS
from benchmarks.roles.memcpy import memcpy_times
from benchmarks.strategies import (COMM_STRATEGIES, FIT_STRATEGIES, LABELS, SINGLE_SERIES,
                                   STRATEGIES, availability)
from benchmarks.targets import compute_targets
from tf_smb import _box

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

FLAGS = flags.FLAGS
FULL_MODELS, SMOKE_MODELS = "mlp,resnet50,vgg16,inception_v3", "tiny_mlp"
# Synthetic samples per epoch of each fit model (global batch --fit_batch).
FIT_SAMPLES = {"cnn": 8192, "mlp": 32768, "mlp10m": 4096, "resnet50": 256, "small": 8192}
SMOKE_FIT_SAMPLES = {"cnn": 256, "mlp": 512, "mlp10m": 256, "resnet50": 64, "small": 256}
SMOKE_FIT_MODELS = "cnn,mlp"
# resnet50 is left out by default: at the default batch its fit takes tens of minutes on
# 2 cores; run it alone at a smaller batch, e.g. --fit_models=resnet50 --fit_batch=64.
DEFAULT_FIT_MODELS = "cnn,mlp,mlp10m"

flags.DEFINE_string("models", None, f"communication models, from {', '.join(common.MODELS)} "
                    f"(default {FULL_MODELS}; with --smoke {SMOKE_MODELS})")
flags.DEFINE_string("workers", None, "communication worker counts (default 2,3; smoke 2)")
flags.DEFINE_string("comm_strategies", ",".join(COMM_STRATEGIES),
                    "communication strategies; empty skips part 1")
flags.DEFINE_integer("iters", None, "timed steps per model (default 20; 3 with --smoke)")
flags.DEFINE_integer("warmup", None, "untimed steps first (default 3; 1 with --smoke)")
flags.DEFINE_string("fit_models", None, f"fit models, from {', '.join(FIT_MODELS)} (default "
                    f"{DEFAULT_FIT_MODELS}; with --smoke {SMOKE_FIT_MODELS})")
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


# =========================================================================== running

def run_comm(strategy: str, world: int, models: List[str], iters: int, warmup: int,
             total_bytes: int, env: Dict[str, str], failures: List[Failure]
             ) -> Dict[str, Cell]:
    """One job of `world` workers of `strategy` times every model; a cell per model."""
    info, names = STRATEGIES[strategy], ",".join(models)
    steps = [f"--iters={iters}", f"--warmup={warmup}"]
    if info.comm_kind is None:  # SMB async: every rank reports
        argv = role_argv("async_steps", f"--comm_modes={info.async_mode}", f"--models={names}",
                         *steps)
        # Room for every model's parameters, at 64-byte offsets, and some.
        heap = max(_box.DEFAULT_HEAP_BYTES, total_bytes + (64 << 20))
        launcher_args, key, per_model = [f"--heap-bytes={heap}"], "model", world
    else:  # rank 0 reports (the steps start together)
        argv = role_argv("allreduce", f"--kind={info.comm_kind}", f"--sets={names}", *steps)
        launcher_args, key, per_model = [], "set", 1
    ok, outputs, reason = run_processes(
        commands(info.launch, world, argv, env, launcher_args), FLAGS.timeout)
    results: Dict[str, List[dict]] = {m: [] for m in models}
    for out in outputs:  # results printed before a failure still count
        for r in common.parse_tagged(out):
            if r.get(key) in results:
                results[r[key]].append(r)
    cells = {}
    for model in models:
        rs = results[model]
        if len(rs) >= per_model:
            cells[model] = Cell(pooled_median_ms(rs), detail={"times_s": [r["times_s"]
                                                                            for r in rs]})
        else:
            cells[model] = Cell(None, failure_reason(reason or "no result line", outputs))
    missing = [m for m in models if cells[m].value is None]
    if missing or not ok:
        report_failure(failures, f"communication: {LABELS[strategy]} at {world} workers "
                       f"({', '.join(missing) or 'exit'})",
                       failure_reason(reason or "no result line", outputs),
                       error_excerpt(outputs))
    return cells


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
    info = STRATEGIES[strategy]
    kind = info.fit_kind
    world = 1 if strategy == "single" else FLAGS.fit_workers
    argv = role_argv("fit", f"--kind={kind}", f"--fit_models={','.join(models)}",
                     f"--fit_epochs={epochs}", f"--fit_batch={batch}",
                     "--samples=" + ",".join(f"{m}:{samples[m]}" for m in models))
    ok, outputs, reason = run_processes(commands(info.launch, world, argv, env), FLAGS.timeout)
    series = list(SINGLE_SERIES) if strategy == "single" else [strategy]
    found: Dict[Tuple[str, str], List[dict]] = {}
    for out in outputs:
        for r in common.parse_tagged(out):
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
        report_failure(failures, f"fit: {LABELS.get(strategy, strategy)}",
                       failure_reason(reason or "no result line", outputs),
                       error_excerpt(outputs))
    return cells


# =========================================================================== reporting

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
    env = subprocess_env({common.SHAPES_ENV: str(shapes_path)})

    # The probe: versions, Horovod, every model's shapes (written once for the workers).
    probe_models = sorted(set(models) | ({"tiny_mlp"} if not models else set()))
    ok, outputs, reason = run_processes(
        [(role_argv("probe", f"--models={','.join(probe_models)}",
                    f"--shapes_out={shapes_path}"), env)], FLAGS.timeout)
    probe = [r["probe"] for r in common.parse_tagged(outputs[0]) if "probe" in r]
    if not ok or not probe:
        print(f"the probe failed ({reason or 'no result'}); TensorFlow does not work here:\n"
              f"{error_tail(outputs)}", file=sys.stderr)
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
            times = memcpy_times(model_bytes[m], max(iters, 20))
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
                                     ("horovod_mpi", "smb_async"), ("smb_sync", "smb_async"),
                                     ("horovod_mpi", "smb_async_push"),
                                     ("smb_sync", "smb_async_push"))
                 if a in shown and b in shown]
        ratio_header = ["model", "workers", *(f"{LABELS[a]} / {LABELS[b]}" for a, b in pairs)]
        ratio_rows = [[m, str(w), *(fmt(ratio(comm[(m, w, a)].value, comm[(m, w, b)].value),
                                        ".2f") for a, b in pairs)]
                      for m in models for w in worlds]
        sections.append(
            "## Communication per step (ms)\n\n" + markdown(header, rows) + "\n\n"
            f"float32 gradients, MB = MiB; medians of {iters} timed steps after {warmup} "
            "warm-up. SMB sync, Horovod and MWMS: one all-reduce of every tensor (fused / "
            "grouped), a barrier before each step, rank 0's times. SMB async: read every "
            "parameter from the box (one op, as a step starts), then push a delta for each "
            "(one op, as it ends); read_at=push: push each delta and read the segment back "
            "in the same pass (one op); steps back to back, every worker's times. memcpy: one np.copyto of the same bytes (the floor).\n\n"
            "### Ratios (time / time: how many times faster the right-hand side is)\n\n"
            + markdown(ratio_header, ratio_rows))
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
                + markdown(header, rows) + "\n\n"
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
                + markdown(["model", "no strategy", "SMBStrategy (1 worker)",
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
        plot_fit(out_dir / "fit.png", fit, fit_models, fit_strategies, FLAGS.fit_workers)

    targets = compute_targets(comm, models if comm_strategies else [], worlds, model_bytes,
                              fit, fit_models if fit_strategies else [], FLAGS.fit_workers,
                              batch)
    if targets:
        sections.append("## Targets\n\n" + markdown(["target", "measured", "goal", "status"],
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

def main(argv: Sequence[str]) -> None:
    del argv
    smoke = FLAGS.smoke
    models = common.split_list(FLAGS.models, SMOKE_MODELS if smoke else FULL_MODELS)
    iters = FLAGS.iters if FLAGS.iters is not None else (3 if smoke else 20)
    warmup = FLAGS.warmup if FLAGS.warmup is not None else (1 if smoke else 3)
    fit_models = common.split_list(FLAGS.fit_models,
                                   SMOKE_FIT_MODELS if smoke else DEFAULT_FIT_MODELS)
    epochs = FLAGS.fit_epochs if FLAGS.fit_epochs is not None else (3 if smoke else 8)
    batch = FLAGS.fit_batch if FLAGS.fit_batch is not None else (64 if smoke else 256)
    samples = {m: FLAGS.fit_samples or (SMOKE_FIT_SAMPLES if smoke else FIT_SAMPLES)[m]
               for m in FIT_MODELS}
    bad = ([m for m in models if m not in common.MODELS] +
           [m for m in fit_models if m not in FIT_MODELS])
    if bad:
        raise app.UsageError(f"unknown models: {bad}")
    if iters < 1 or warmup < 0 or epochs < 1 or batch < 1:
        raise app.UsageError("need --iters >= 1, --warmup >= 0, --fit_epochs >= 1, "
                             "--fit_batch >= 1")
    try:
        worlds = [int(w) for w in common.split_list(FLAGS.workers, "2" if smoke else "2,3")]
    except ValueError as e:
        raise app.UsageError(f"--workers must be a comma list of integers: {e}") from e
    comm_strategies = common.split_list(FLAGS.comm_strategies, "")
    fit_strategies = common.split_list(FLAGS.fit_strategies, "")
    bad = ([s for s in comm_strategies if s not in COMM_STRATEGIES] +
           [s for s in fit_strategies if s not in FIT_STRATEGIES])
    if bad or min(worlds, default=2) < 2 or FLAGS.fit_workers < 2:
        raise app.UsageError(f"unknown strategies {bad}, or fewer than 2 workers")
    if min(samples[m] for m in fit_models or FIT_MODELS) < batch:
        raise app.UsageError("--fit_samples must be at least --fit_batch")
    sys.exit(run_driver(models, worlds, comm_strategies, fit_models, fit_strategies,
                        iters, warmup, epochs, batch, samples))


if __name__ == "__main__":
    app.run(main)
