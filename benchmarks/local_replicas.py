"""Benchmarks SMBStrategy(local_replicas=N): N replicas as threads of one process with
one parameter copy, against the other ways to run N replicas on one machine.

For each N of `--replicas` and each model of `--models`, side by side, these
configurations train the same model on the same synthetic data with the same global
batch (SGD with momentum, loss only, no XLA):

  single           one plain process, no strategy (N-independent: run once, shown in
                   every N's table);
  smb_local        one process, `tf_smb.SMBStrategy(local_replicas=N)`;
  smb_procs        N processes of `tf_smb.SMBStrategy()` under
                   `python -m tf_smb.run -np N` (one core each while there are cores
                   enough, else unbound: the launcher's default binding);
  mirrored         one process, `tf.distribute.MirroredStrategy` over N logical CPU
                   devices;
  central_storage  one process, `tf.distribute.experimental.CentralStorageStrategy`
                   (compute devices: N logical CPU devices, parameters on /cpu:0).

Models: `cnn`, `mlp`, `mlp10m` and `resnet50` of benchmarks/roles/fit.py (`resnet50`:
`keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10,
classifier_activation=None)`, trained on logits like the others).

Every dataset is batched with the GLOBAL batch (on every process of smb_procs too: the
strategy splits it). Measured, in each process:
  * samples/s: global samples per epoch / epoch seconds, the median over the epochs
    after the first (a warm-up: it traces the step); with many processes, each epoch
    lasts as long as its slowest process;
  * RSS before fit: VmRSS of /proc/self/status once the model is built and compiled
    (data, dataset and model in memory; the optimizer's slots come with the first step);
  * peak RSS: VmHWM of /proc/self/status after fit.
smb_procs reports both per process and their total (RSS counts the box's shared pages
in every process that touched them, so the total counts them more than once; the JSON
also has each process's PSS after fit, which shares them out).

Each (configuration, model) runs in its own subprocess (for smb_procs: one launcher and
N workers) with a `--timeout`; every subprocess is stopped on the way out. A failed run
is named with the last lines it printed (stderr) and its table cells hold its error.
The process exits 1 when any run failed (the tables and `--out` are still written).

    python -m benchmarks.local_replicas                      # cnn, mlp, resnet50; N=2,4
    python -m benchmarks.local_replicas --models=mlp --replicas=2 --epochs=6
    python -m benchmarks.local_replicas --smoke --out=/tmp/local_replicas.json

`--smoke`: mlp only, N=2, 1024 samples in batches of 64, 2 epochs, every configuration
(under a minute on 2 idle cores). The workers are this module too (`--worker=CONFIG`, internal).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from benchmarks import common
from benchmarks import processes
from benchmarks.processes import commands, run_processes, subprocess_env
from benchmarks.report import Failure, error_line, error_tail, fmt, markdown, report_failure
from benchmarks.roles.fit import build_fit_model, epoch_timer, fit_data

CONFIGS = ("single", "smb_local", "smb_procs", "mirrored", "central_storage")
MODELS = ("cnn", "mlp", "mlp10m", "resnet50")
FULL_MODELS, SMOKE_MODELS = "cnn,mlp,resnet50", "mlp"
FULL_REPLICAS, SMOKE_REPLICAS = "2,4", "2"
# Global batch (divisible by 4, so by every N of the default --replicas), samples and
# epochs of each model: cnn and mlp run 32 and 64 steps an epoch, a few seconds on 2
# cores. ResNet-50 runs few steps: on 2 cores a step of 16 takes ~0.5 s in one process
# and several times that over 4 logical devices, and tracing it takes tens of seconds
# (~1.5 min a run at N=4 for mirrored and smb_procs).
BATCH = {"cnn": 256, "mlp": 256, "mlp10m": 256, "resnet50": 16}
SAMPLES = {"cnn": 8192, "mlp": 16384, "mlp10m": 4096, "resnet50": 64}
EPOCHS = {"cnn": 5, "mlp": 5, "mlp10m": 5, "resnet50": 3}  # the first a warm-up
SMOKE_SAMPLES, SMOKE_BATCH, SMOKE_EPOCHS = 1024, 64, 2
MIB = 1 << 20
ERROR_TAG = "BENCH_ERROR "  # a worker's exception, as JSON (results: common.RESULT_TAG)


# --------------------------------------------------------------------------- worker

def proc_status_mib(key: str) -> float:
    """A `kB` line of /proc/self/status (VmRSS, VmHWM) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024 / MIB
    raise KeyError(f"{key} not in /proc/self/status")


def pss_mib() -> Optional[float]:
    """This process's proportional set size (shared pages shared out), if the kernel
    tells (/proc/self/smaps_rollup)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024 / MIB
    except OSError:
        pass
    return None


def logical_cpus(count: int) -> List[str]:
    """`count` logical CPU devices (before TensorFlow's first op fixes its devices)."""
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)])
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    if len(devices) != count:
        raise RuntimeError(f"wanted {count} logical CPU devices, got {devices}")
    return devices


def make_strategy(config: str, replicas: int):
    """The configuration's strategy (None: no strategy), made before any other op."""
    import tensorflow as tf
    if config == "single":
        return None
    if config in ("smb_local", "smb_procs"):
        import tf_smb
        return tf_smb.SMBStrategy(local_replicas=replicas if config == "smb_local" else 1)
    devices = logical_cpus(replicas)
    if config == "mirrored":
        return tf.distribute.MirroredStrategy(devices=devices)
    if config == "central_storage":
        return tf.distribute.experimental.CentralStorageStrategy(
            compute_devices=devices, parameter_device="/cpu:0")
    raise ValueError(f"unknown configuration {config!r}; known: {', '.join(CONFIGS)}")


def run_worker(config: str, replicas: int, model: str, epochs: int, batch: int,
               samples: int) -> None:
    """Fits `model` under `config` and prints one result line (every process); an
    exception is printed as an ERROR_TAG line (its whole message, on one line, for the
    table) and raised again."""
    try:
        fit_worker(config, replicas, model, epochs, batch, samples)
    except Exception as e:
        message = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # Keras' bold
        print(ERROR_TAG + json.dumps({"config": config, "model": model,
                                      "error": f"{type(e).__name__}: {message}"}), flush=True)
        raise


def fit_worker(config: str, replicas: int, model: str, epochs: int, batch: int,
               samples: int) -> None:
    start = time.perf_counter()
    strategy = make_strategy(config, replicas)  # first: it may configure the devices
    import tensorflow as tf

    x, y = fit_data(model, samples)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)
    if strategy is None:
        net = build_fit_model(model)
    else:
        with strategy.scope():
            net = build_fit_model(model)
    rss_before_fit = proc_status_mib("VmRSS")
    timer = epoch_timer()
    fit_start = time.perf_counter()
    net.fit(dataset, epochs=epochs, shuffle=False, verbose=0, callbacks=[timer])
    fit_s = time.perf_counter() - fit_start
    common.print_result({
        "config": config, "model": model, "replicas": replicas,
        "rank": int(getattr(strategy, "rank", 0) or 0),
        "num_replicas_in_sync": strategy.num_replicas_in_sync if strategy else 1,
        "batch": batch, "samples": samples, "params": int(net.count_params()),
        "epoch_s": timer.times, "steps": [len(epoch) for epoch in timer.steps], "fit_s": fit_s,
        "process_s": time.perf_counter() - start,
        "rss_before_fit_mib": rss_before_fit, "peak_rss_mib": proc_status_mib("VmHWM"),
        "rss_after_fit_mib": proc_status_mib("VmRSS"), "pss_after_fit_mib": pss_mib()})


# --------------------------------------------------------------------------- driver

def worker_argv(config: str, replicas: int, model: str, epochs: int, batch: int,
                samples: int) -> List[str]:
    return [*processes.python(), "-m", "benchmarks.local_replicas", f"--worker={config}",
            f"--replicas={replicas}", f"--models={model}", f"--epochs={epochs}",
            f"--batch={batch}", f"--samples={samples}"]


def summarize(results: List[dict], batch: int) -> dict:
    """One configuration's numbers from its processes' result lines: global samples/s
    (median over the timed epochs of the slowest process's epoch time) and memory,
    per process and in total."""
    results = sorted(results, key=lambda r: r["rank"])
    steps = results[0]["steps"]
    epoch_s = [max(r["epoch_s"][e] for r in results) for e in range(len(steps))]
    timed = range(1, len(steps)) if len(steps) > 1 else range(len(steps))
    samples_per_s = statistics.median(steps[e] * batch / epoch_s[e] for e in timed)
    per_process = [{k: r[k] for k in ("rank", "rss_before_fit_mib", "peak_rss_mib",
                                      "rss_after_fit_mib", "pss_after_fit_mib",
                                      "epoch_s", "steps", "fit_s", "process_s")}
                   for r in results]
    return {"samples_per_s": samples_per_s, "epoch_s": epoch_s, "steps": steps,
            "processes": len(results),
            "num_replicas_in_sync": results[0]["num_replicas_in_sync"],
            "params": results[0]["params"],
            "rss_before_fit_mib": sum(r["rss_before_fit_mib"] for r in results),
            "peak_rss_mib": sum(r["peak_rss_mib"] for r in results),
            "per_process": per_process}


def bench(config: str, replicas: int, model: str, epochs: int, batch: int, samples: int,
          timeout: float, failures: List[Failure]) -> dict:
    """Runs one configuration on one model; its numbers, or its error."""
    world = replicas if config == "smb_procs" else 1
    launch = "tf_smb.run" if config == "smb_procs" else "single"
    what = f"{config} (N={replicas}) {model}"
    argv = worker_argv(config, replicas, model, epochs, batch, samples)
    start = time.perf_counter()
    ok, outputs, reason = run_processes(commands(launch, world, argv, subprocess_env()),
                                        timeout)
    wall = time.perf_counter() - start
    results = [r for out in outputs for r in common.parse_tagged(out)
               if r.get("config") == config and r.get("model") == model]
    entry = {"config": config, "replicas": replicas, "model": model, "batch": batch,
             "samples": samples, "epochs": epochs, "wall_s": wall}
    expected = [samples // batch] * epochs
    problem = None
    if not ok:
        problem = reason or "failed"
    elif sorted(r["rank"] for r in results) != list(range(world)):
        problem = f"{len(results)} result line(s) from {world} process(es)"
    elif any(r["steps"] != expected for r in results):
        problem = (f"steps per epoch {[r['steps'] for r in results]}, expected "
                   f"{samples // batch} in each of {epochs} epochs")
    if problem is not None:
        errors = [r["error"] for out in outputs for r in common.parse_tagged(out, ERROR_TAG)]
        error = " ".join(errors[0].split()) if errors else error_line(outputs)
        entry.update(ok=False, error=f"{problem}: {error}" if error else problem)
        report_failure(failures, what, cell_text(entry["error"], 400),
                       error_tail(outputs, lines=20))
        return entry
    entry.update(ok=True, **summarize(results, batch))
    print(f"{what}: {entry['samples_per_s']:.1f} samples/s, RSS before fit "
          f"{entry['rss_before_fit_mib']:.0f} MiB, peak {entry['peak_rss_mib']:.0f} MiB "
          f"({wall:.0f} s)", flush=True)
    return entry


def ratio(entry: Optional[dict], base: Optional[dict]) -> Optional[float]:
    if entry and base and entry.get("ok") and base.get("ok") and base["samples_per_s"]:
        return entry["samples_per_s"] / base["samples_per_s"]
    return None


def cell_text(text: str, limit: int = 160) -> str:
    """Text fit for a markdown cell: one line, no pipes, at most `limit` characters."""
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def memory_cell(entry: dict, key: str) -> str:
    """Total MiB; with many processes also each one's: `1520 (758+762)`."""
    total = f"{entry[key]:.0f}"
    if entry["processes"] == 1:
        return total
    return f"{total} ({'+'.join(f'{p[key]:.0f}' for p in entry['per_process'])})"


def table(replicas: int, models: Sequence[str], entries: Dict[Tuple[str, str], dict]) -> str:
    """Markdown: a row per configuration, per model samples/s, the ratios and memory."""
    header = ["config"]
    for m in models:
        header += [f"{m} samples/s", f"{m} vs single", f"{m} vs smb_procs",
                   f"{m} RSS before fit MiB", f"{m} peak RSS MiB"]
    rows = []
    for config in CONFIGS:
        label = {"single": "single (1 device)", "smb_local": f"smb_local ({replicas} threads)",
                 "smb_procs": f"smb_procs ({replicas} processes)",
                 "mirrored": f"mirrored ({replicas} devices)",
                 "central_storage": f"central_storage ({replicas} devices)"}[config]
        row = [label]
        for m in models:
            e = entries.get((config, m))
            if e is None:
                row += ["not run"] + [""] * 4
            elif not e["ok"]:
                row += [f"failed: {cell_text(e['error'], 240)}"] + [""] * 4
            else:
                row += [f"{e['samples_per_s']:.1f}",
                        fmt(ratio(e, entries.get(("single", m))), ".2f"),
                        fmt(ratio(e, entries.get(("smb_procs", m))), ".2f"),
                        memory_cell(e, "rss_before_fit_mib"), memory_cell(e, "peak_rss_mib")]
        rows.append(row)
    return markdown(header, rows)


def parse_per_model(text: Optional[str], defaults: Dict[str, int], models: Sequence[str],
                    flag: str) -> Dict[str, int]:
    """`--samples`/`--batch`: one number for every model, or `model:N,...` (the rest keep
    their defaults)."""
    values = {m: defaults[m] for m in models}
    if not text:
        return values
    if ":" not in text:
        return {m: int(text) for m in models}
    for item in common.split_list(text, ""):
        model, _, count = item.partition(":")
        if model not in MODELS:
            raise ValueError(f"{flag}: unknown model {model!r}")
        values[model] = int(count)
    return values


def run_driver(args: argparse.Namespace, models: List[str], replicas: List[int],
               epochs: Dict[str, int], batch: Dict[str, int], samples: Dict[str, int]) -> int:
    failures: List[Failure] = []
    all_entries: List[dict] = []
    single: Dict[str, dict] = {}
    sections = []
    started = time.perf_counter()
    for n in replicas:
        entries: Dict[Tuple[str, str], dict] = {}
        for model in models:
            for config in CONFIGS:
                if config == "single" and model in single:  # N-independent: run once
                    entries[(config, model)] = single[model]
                    continue
                e = bench(config, n if config != "single" else 1, model, epochs[model],
                          batch[model], samples[model], args.timeout, failures)
                entries[(config, model)] = e
                all_entries.append(e)
                if config == "single":
                    single[model] = e
        for model in models:
            for config in CONFIGS:
                e = entries[(config, model)]
                if e.get("ok") and config != "single":
                    e["vs_single"] = ratio(e, entries.get(("single", model)))
                    e["vs_smb_procs"] = ratio(e, entries.get(("smb_procs", model)))
        sections.append(f"## N = {n} replicas\n\n{table(n, models, entries)}")
    note = ("samples/s: global samples per epoch / epoch seconds, median over the "
            "epochs after a warm-up epoch (many processes: the slowest's "
            "epoch); vs single / vs smb_procs: samples/s over that row's; RSS before fit: "
            "VmRSS after building and compiling the model; peak RSS: VmHWM after fit; "
            "smb_procs: the processes' total (each one's in brackets; the box's shared "
            "pages count in each). Global batch and samples per epoch: "
            + ", ".join(f"{m} {batch[m]} x {samples[m] // batch[m]} steps, {epochs[m]} epochs"
                        for m in models)
            + f"; the single row is one run, shown for every N. "
            f"{os.cpu_count()} CPUs; {time.perf_counter() - started:.0f} s in all.")
    sections.append(note)
    if failures:
        sections.append("## Failures\n\n" + "\n\n".join(
            f"{f.what}: {f.reason}\n\n```\n{f.tail}\n```" for f in failures))
    text = "\n\n".join(sections) + "\n"
    print(text, flush=True)
    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "settings": {"models": models, "replicas": replicas, "epochs": epochs,
                         "batch": batch, "samples": samples, "cpus": os.cpu_count(),
                         "smoke": args.smoke},
            "results": all_entries, "failures": [f._asdict() for f in failures],
            "markdown": text}, indent=1))
    return 1 if failures else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.local_replicas",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None, help=f"comma list of {', '.join(MODELS)} "
                        f"(default {FULL_MODELS}; --smoke: {SMOKE_MODELS})")
    parser.add_argument("--replicas", default=None, help="comma list of N (default "
                        f"{FULL_REPLICAS}; --smoke: {SMOKE_REPLICAS})")
    parser.add_argument("--epochs", default=None, help="epochs per run, the first a "
                        "warm-up: N for every model or model:N,... (default "
                        f"{EPOCHS}; --smoke: {SMOKE_EPOCHS})")
    parser.add_argument("--samples", default=None, help="samples per epoch: N for every "
                        f"model or model:N,... (default {SAMPLES}; --smoke: {SMOKE_SAMPLES})")
    parser.add_argument("--batch", default=None, help="global batch: B or model:B,... "
                        f"(default {BATCH}; --smoke: {SMOKE_BATCH})")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny: mlp, N=2, few samples, 2 epochs, every configuration")
    parser.add_argument("--timeout", type=float, default=None, help="seconds each run "
                        "may take before it is killed (default 600; --smoke: 300)")
    parser.add_argument("--out", default=None, help="also write every number to this JSON")
    parser.add_argument("--worker", choices=CONFIGS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    smoke = args.smoke
    models = common.split_list(args.models, SMOKE_MODELS if smoke else FULL_MODELS)
    bad = [m for m in models if m not in MODELS]
    if bad or not models:
        parser.error(f"--models: want some of {MODELS}, got {models}")
    try:
        replicas = [int(n) for n in common.split_list(
            args.replicas, SMOKE_REPLICAS if smoke else FULL_REPLICAS)]
        batch = parse_per_model(args.batch if args.batch or not smoke else str(SMOKE_BATCH),
                                BATCH, models, "--batch")
        epochs = parse_per_model(
            args.epochs if args.epochs or not smoke else str(SMOKE_EPOCHS),
            EPOCHS, models, "--epochs")
        samples = parse_per_model(
            args.samples if args.samples or not smoke else str(SMOKE_SAMPLES),
            SAMPLES, models, "--samples")
    except ValueError as e:
        parser.error(str(e))
    if not replicas or min(replicas) < 1:
        parser.error(f"--replicas: want integers >= 1, got {replicas}")
    for m in models:
        if epochs[m] < (1 if args.worker else 2):
            parser.error(f"{m}: want at least 2 epochs (the first is a warm-up)")
        if batch[m] < 1 or samples[m] < batch[m]:
            parser.error(f"{m}: want 1 <= batch <= samples, got {batch[m]}, {samples[m]}")
        uneven = [n for n in replicas if batch[m] % n]
        if uneven:
            parser.error(f"{m}: global batch {batch[m]} does not split over N={uneven}")

    if args.worker is not None:
        if len(models) != 1 or len(replicas) != 1:
            parser.error("--worker runs one model and one N")
        m = models[0]
        run_worker(args.worker, replicas[0], m, epochs[m], batch[m], samples[m])
        return 0
    timeout = args.timeout if args.timeout is not None else (300.0 if smoke else 600.0)
    args.timeout = timeout
    return run_driver(args, models, replicas, epochs, batch, samples)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    sys.exit(main())
