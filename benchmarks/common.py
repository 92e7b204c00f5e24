"""What the benchmarks share: model shapes, subprocesses, the timed collective, tables.

Used by examples/benchmark.py (the suite), examples/benchmark_allreduce.py and
examples/benchmark_async.py. Nothing here defines flags or imports TensorFlow at import
time, so a driver that does not need TensorFlow stays light.

Model shapes: `model_shapes(name)` builds the Keras model once and returns the shapes of
its trainable variables. A driver that starts many workers can compute them once and
write them to a JSON file named by $TF_SMB_BENCH_SHAPES (`write_shapes_file`); workers
then read the shapes from it instead of building the model again.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
SHAPES_ENV = "TF_SMB_BENCH_SHAPES"
# What benchmark_async.py's part-1 worker prints before each result (benchmark.py reads it).
ASYNC_RESULT_TAG = "ASYNC_BENCH_RESULT "
# tiny_mlp: Dense 32-64-64-10; mlp: Dense 784-512-512-10; the others are
# keras.applications models with weights=None (shapes only, nothing downloaded).
MODELS = ("tiny_mlp", "mlp", "resnet50", "vgg16", "inception_v3")
# Launcher variables a benchmark subprocess must not inherit from its driver (the driver
# may itself run under a launcher): they would make a single process think it is a rank.
_LAUNCHER_VARS = ("TF_SMB_RANK", "TF_SMB_SIZE", "TF_SMB_JOB_ID", "TF_SMB_BOX_CREATED",
                  "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                  "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK",
                  "SLURM_PROCID", "SLURM_NTASKS")

Shapes = List[Tuple[int, ...]]


# --------------------------------------------------------------------------- models

def build_model_shapes(name: str) -> Shapes:
    """Builds model `name` and returns the shapes of its trainable variables."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    import keras  # only here: the drivers need no TensorFlow
    if name == "tiny_mlp":
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(10)])
    elif name == "mlp":
        model = keras.Sequential([keras.Input((784,)),
                                  keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(10)])
    else:
        model = {"resnet50": keras.applications.ResNet50, "vgg16": keras.applications.VGG16,
                 "inception_v3": keras.applications.InceptionV3}[name](weights=None)
    shapes = [tuple(int(d) for d in v.shape) for v in model.trainable_variables]
    del model
    keras.backend.clear_session()
    return shapes


def model_shapes(name: str) -> Shapes:
    """Model `name`'s trainable-variable shapes: from $TF_SMB_BENCH_SHAPES if it has them."""
    path = os.environ.get(SHAPES_ENV)
    if path:
        try:
            cached = json.loads(pathlib.Path(path).read_text())
        except (OSError, ValueError):
            cached = {}
        if name in cached:
            return [tuple(s) for s in cached[name]]
    return build_model_shapes(name)


def write_shapes_file(names: Sequence[str], path: pathlib.Path) -> Dict[str, Shapes]:
    """Builds each model once and writes {name: shapes} to `path` (for $TF_SMB_BENCH_SHAPES)."""
    shapes = {n: build_model_shapes(n) for n in names}
    path.write_text(json.dumps(shapes))
    return shapes


def set_bytes(shapes: Sequence[Tuple[int, ...]]) -> int:
    """Bytes of float32 tensors of these shapes."""
    return sum(4 * math.prod(s) for s in shapes)


def num_params(shapes: Sequence[Tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes)


# --------------------------------------------------------------------------- the timed collective

def collective(kind: str) -> Tuple[int, int, Callable, Callable[[], None]]:
    """(rank, world, reduce_fn, barrier) of a summing all-reduce of a list of tensors.

    kind: "smb" (tf_smb.allreduce, one fused op), "mwms" (MultiWorkerMirroredStrategy,
    RING, from TF_CONFIG) or "horovod" (hvd.grouped_allreduce; under horovodrun or
    mpirun). Call it before anything else initializes TensorFlow's context (MWMS needs
    that). The barrier of MWMS and Horovod is an all-reduce of one scalar.
    """
    import tensorflow as tf

    if kind == "smb":
        import tf_smb
        tf_smb.init()

        @tf.function
        def reduce_fn(xs: List[tf.Tensor]) -> List[tf.Tensor]:
            return tf_smb.allreduce(xs)

        return tf_smb.rank(), tf_smb.size(), reduce_fn, tf_smb.barrier
    if kind == "mwms":
        cluster = json.loads(os.environ["TF_CONFIG"])
        rank, world = cluster["task"]["index"], len(cluster["cluster"]["worker"])
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING)
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)

        def replica_fn(xs: List[tf.Tensor]) -> List[tf.Tensor]:
            # The function's inputs have no device, and all_reduce sends each result to
            # its input's device; tf.identity (no copy) places them on the replica's.
            xs = [tf.identity(x) for x in xs]
            return tf.distribute.get_replica_context().all_reduce("sum", xs)

        @tf.function
        def reduce_fn(xs: List[tf.Tensor]) -> List[tf.Tensor]:
            return strategy.experimental_local_results(strategy.run(replica_fn, args=(xs,)))[0]
    elif kind == "horovod":
        import horovod.tensorflow as hvd
        hvd.init()
        rank, world = hvd.rank(), hvd.size()

        @tf.function
        def reduce_fn(xs: List[tf.Tensor]) -> List[tf.Tensor]:
            return list(hvd.grouped_allreduce(xs, op=hvd.Sum))
    else:
        raise ValueError(f"unknown collective {kind!r}")

    one = tf.ones([])

    def barrier() -> None:
        reduce_fn([one])[0].numpy()

    return rank, world, reduce_fn, barrier


def time_collective(kind: str, label: str, shapes: Sequence[Tuple[int, ...]], iters: int,
                    warmup: int, rank: int, world: int, reduce_fn: Callable,
                    barrier: Callable[[], None]) -> dict:
    """Checks the all-reduce of `shapes` once, then times `warmup + iters` of them.

    Every worker passes a barrier before each step, so all start it together; a step is
    the call plus the fetch of one element of the last result. Returns the result
    (the timed steps' seconds and what was reduced).
    """
    import numpy as np
    import tensorflow as tf

    inputs = [tf.fill(s, float(rank + 1)) for s in shapes]
    outputs = reduce_fn(inputs)
    expected = world * (world + 1) / 2
    for i, (o, s) in enumerate(zip(outputs, shapes)):
        got = o.numpy()
        if got.shape != tuple(s) or not np.all(got == expected):
            raise AssertionError(f"{kind} on {label}: tensor {i} {s}: all-reduce gave shape "
                                 f"{got.shape}, values {np.unique(got)[:5]}, want all {expected}")
    del outputs, got
    times: List[float] = []
    for it in range(warmup + iters):
        barrier()
        start = time.perf_counter()
        outputs = reduce_fn(inputs)
        # Forces the result by fetching one element: numpy() of the whole tensor
        # would copy a sum that stays in SMB's box (a tensor TF does not own).
        tf.reshape(outputs[-1], [-1])[:1].numpy()
        elapsed = time.perf_counter() - start
        del outputs
        if it >= warmup:
            times.append(elapsed)
    barrier()
    return {"role": kind, "set": label, "world": world, "bytes": set_bytes(shapes),
            "tensors": len(shapes), "times_s": times}


# --------------------------------------------------------------------------- subprocesses

def subprocess_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The driver's environment for a benchmark subprocess: the checkout on PYTHONPATH,
    quiet TensorFlow, oneDNN off, unbuffered output, no launcher variables."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                        os.environ.get("PYTHONPATH")])))
    env.update(extra or {})
    return env


def free_ports(n: int) -> List[int]:
    """`n` distinct free TCP ports on 127.0.0.1 (bound to port 0, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _descendants(pids: Sequence[int]) -> List[int]:
    """The live (not zombie) descendants of `pids`, from /proc (none without /proc)."""
    children: Dict[int, List[int]] = {}
    for entry in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
        except (OSError, ValueError, IndexError):
            continue
        if state != "Z":
            children.setdefault(int(ppid), []).append(int(entry.name))
    found, todo = [], list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found


def _signal(pids: Sequence[int], groups: Sequence[int], sig: int) -> None:
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def run_processes(cmds: Sequence[Tuple[List[str], Dict[str, str]]], timeout: float,
                  cwd: pathlib.Path = REPO_ROOT) -> Tuple[bool, List[str], str]:
    """Runs the commands together; stops them all when one fails or `timeout` passes.

    Each command starts in a session of its own; stopping sends SIGTERM to its process
    group and to every process it started (launchers such as tf_smb.run and mpirun put
    their workers elsewhere), then SIGKILL to whatever is left. Returns (all succeeded,
    each one's output, a reason when they did not).
    """
    files = [tempfile.TemporaryFile(mode="w+") for _ in cmds]
    procs = []
    try:
        for (cmd, env), f in zip(cmds, files):
            procs.append(subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                          stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    except OSError as e:
        reason = f"cannot start {cmds[len(procs)][0][0]!r}: {e}"
    else:
        reason = ""
    deadline = time.monotonic() + timeout
    while not reason and any(p.poll() is None for p in procs):
        failed = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
        if failed:
            reason = f"process {failed[0]} exited with code {procs[failed[0]].returncode}"
            break
        if time.monotonic() > deadline:
            reason = f"timed out after {timeout:.0f} s"
            break
        time.sleep(0.1)
    groups = [p.pid for p in procs]
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        # SIGTERM first lets tf_smb.run, mpirun and horovodrun stop their own workers.
        live = [p.pid for p in procs if p.poll() is None]
        _signal(_descendants(groups) + live, groups, sig)
        end = time.monotonic() + grace
        while time.monotonic() < end and (any(p.poll() is None for p in procs)
                                          or _descendants(groups)):
            time.sleep(0.1)
    outputs = []
    for f in files:
        f.seek(0)
        outputs.append(f.read())
        f.close()
    if not reason and any(p.returncode != 0 for p in procs):
        reason = "exit codes " + ", ".join(str(p.returncode) for p in procs)
    return not reason, outputs, reason


def run_box_job(argv: List[str], world: int, heap_bytes: int, timeout: float,
                env: Optional[Dict[str, str]] = None) -> Tuple[bool, List[str], str]:
    """Runs `world` workers of `argv` on a new box with `heap_bytes` for segments.

    Does the launcher's job itself (tf_smb.run gives its box a fixed heap): creates the
    box sized for the caller, then starts the workers with TF_SMB_RANK, TF_SMB_SIZE,
    TF_SMB_JOB_ID and TF_SMB_BOX_CREATED=1, as tf_smb.run does.
    """
    from tf_smb import _box  # the core module: no TensorFlow in the driver

    job_id = f"bench-{os.getpid()}-{secrets.token_hex(4)}"
    box = _box.create_box(job_id, world, heap_bytes=heap_bytes)
    try:
        base = env if env is not None else subprocess_env()
        cmds = [(argv, dict(base, TF_SMB_RANK=str(r), TF_SMB_SIZE=str(world),
                            TF_SMB_JOB_ID=job_id, TF_SMB_BOX_CREATED="1"))
                for r in range(world)]
        return run_processes(cmds, timeout)
    finally:
        try:
            box.unlink()
        finally:
            box.close()


def parse_tagged(output: str, tag: str) -> List[dict]:
    """Every JSON object printed after `tag` (launchers may prefix the lines).

    mpirun can put two ranks' lines on one line; each object is decoded from its
    own tag on, and one cut by another rank's output is left out.
    """
    decoder, found = json.JSONDecoder(), []
    for match in re.finditer(re.escape(tag), output):
        try:
            value, _ = decoder.raw_decode(output, match.end())
        except ValueError:
            continue
        if isinstance(value, dict):
            found.append(value)
    return found


def error_tail(outputs: Sequence[str], lines: int = 12) -> str:
    tail = "\n".join("\n".join(o.splitlines()[-lines:]) for o in outputs if o.strip())
    return tail or "(no output)"


_ERROR_RE = re.compile(r"\b([A-Za-z_][\w.]*(?:Error|Exception|Exit)): (.*)$")


def _last_error(lines: Sequence[str]) -> Optional[Tuple[int, str]]:
    """(index, `SomeError: message`) of the last error line; a message cut at an opening
    bracket (a tensor printed on the next lines) is completed from its closing line."""
    for i in range(len(lines) - 1, -1, -1):
        m = _ERROR_RE.search(lines[i])
        if m:
            message = f"{m.group(1)}: {m.group(2).strip()}"
            if message[-1:] in "{[(":
                closing = next((line.strip() for line in lines[i + 1:]
                                if line.strip() and line.strip()[0] in "}])"), "")
                message += f" ... {closing}" if closing else " ..."
            return i, message
    return None


def error_line(outputs: Sequence[str], limit: int = 300) -> str:
    """The last `SomeError: message` line of the outputs (shortened to `limit`)."""
    found = ""
    for out in outputs:
        last = _last_error(out.splitlines())
        if last:
            found = last[1]
    return found if len(found) <= limit else found[:limit - 3] + "..."


def error_excerpt(outputs: Sequence[str], lines: int = 12) -> str:
    """Per output: the end of its last traceback up to the error (completed as in
    `error_line`), else its last `lines` lines."""
    parts = []
    for out in outputs:
        text = out.splitlines()
        if not out.strip():
            continue
        last = _last_error(text)
        if last is None:
            parts.append("\n".join(text[-lines:]))
            continue
        i, message = last
        start = max((j for j in range(i + 1) if "Traceback (most recent call last)" in text[j]),
                    default=max(0, i - lines))
        parts.append("\n".join([*text[max(start, i - lines):i], message]))
    unique = [p for k, p in enumerate(parts) if p not in parts[:k]]  # ranks often agree
    return "\n".join(unique) or "(no output)"


class Failure(NamedTuple):
    what: str
    reason: str
    tail: str


def report_failure(failures: List[Failure], what: str, reason: str, tail: str) -> None:
    print(f"--- {what} failed: {reason}\n{tail}\n---", file=sys.stderr, flush=True)
    failures.append(Failure(what, reason, tail))


# --------------------------------------------------------------------------- numbers, tables

def memcpy_times(nbytes: int, repeats: int) -> List[float]:
    """Seconds of `np.copyto` of `nbytes` between two touched buffers, after one warm-up."""
    import numpy as np
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return times


def median_ms(result: Optional[dict]) -> Optional[float]:
    return 1e3 * statistics.median(result["times_s"]) if result else None


def pooled_median_ms(results: Sequence[dict]) -> Optional[float]:
    """The median over every result's timed steps (e.g. every worker's), in ms."""
    times = [t for r in results for t in r["times_s"]]
    return 1e3 * statistics.median(times) if times else None


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def fmt(x: Optional[float], spec: str = ".4g") -> str:
    return "n/a" if x is None else format(x, spec)


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = [list(header), ["---"] * len(header), *map(list, rows)]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)
