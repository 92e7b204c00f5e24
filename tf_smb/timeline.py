"""A timeline of a tf_smb job, as Horovod's HOROVOD_TIMELINE: one JSON file in
the Chrome trace / Perfetto format ("traceEvents") that shows, for every rank,
its training steps, each collective with its phases, and the asynchronous
mode's segment reads, pushes and clock waits. Open it at https://ui.perfetto.dev
or chrome://tracing, or draw it with `python -m tf_smb.timeline render`.

Turn it on for a job by setting ``TF_SMB_TIMELINE=/path/trace.json`` for every
worker (``python -m tf_smb.run --timeline /path/trace.json ...`` sets it), or
call `enable` before the process joins its job (before ``tf_smb.init()`` or
creating a strategy). Off, it costs one check of a cached flag per hook.

What a trace holds (pid = rank, one row per track):

* ``steps``: Keras training steps (category "step", from on_train_batch_begin
  to on_train_batch_end, with the step number) inside epochs (category
  "epoch"); recorded by a callback that tf_smb adds to `fit` of models of
  multi-worker tf_smb strategies while the timeline is on.
* ``collectives``: every collective (category "collective"), named by its op
  and call site, e.g. ``allreduce train_function/.../allreduce0|...``, with
  args.call counting its calls; inside it the phases (category "phase"):
  ``negotiate`` (waiting for its turn: all ranks submitted it and rank 0 chose
  it), ``agree`` (every rank describes the same collective; holds a ``wait``),
  then per chunk ``stage`` (copy into this rank's staging buffer), ``wait``
  (barrier), ``reduce`` (sum this rank's slice), ``wait``, ``copy out``.
* ``clock``: ``clock tick wait`` (the staleness bound; args.lead) and
  ``wait all finished`` (asynchronous mode).
* ``segments``: ``segment read``, ``push`` and ``apply_sgd`` of each parameter
  segment (asynchronous mode), spread over lanes where they overlap.

Files. Every worker records in memory (at most ``TF_SMB_TIMELINE_MAX_EVENTS``
events, default 1,000,000, about 40 MB; later ones are dropped and counted)
and writes its part at exit, ``PATH.parts/<job>.rank<r>.json``. With one worker
that is PATH itself. The worker of rank 0, at its exit, waits for the other
parts (until each is there, its worker has exited, or
``TF_SMB_TIMELINE_WAIT_S`` seconds, default 60, have passed), merges them into
PATH and removes them. When a part is missing it writes PATH without it and
keeps the parts; ``python -m tf_smb.timeline merge PATH`` merges again later.
Across nodes no filesystem need be shared: the workers of other nodes send their
final parts to rank 0's worker through the job's link (MPI).
Times are CLOCK_MONOTONIC microseconds, shared by the processes of a host; a
merge moves the events of other hosts by the difference of the hosts'
CLOCK_REALTIME leads (each part records its host's boot id and lead), so their
rows line up as well as the hosts' real-time clocks agree (NTP: ~1 ms).

Command line::

    python -m tf_smb.timeline merge PATH [--job JOB] [--keep-parts]
    python -m tf_smb.timeline render TRACE.json OUT.png [--steps N]
"""
from __future__ import annotations

import argparse
import atexit
import collections
import json
import os
import re
import sys
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

ENV = "TF_SMB_TIMELINE"
_PART = re.compile(r"^(?P<job>.+)\.rank(?P<rank>\d+)\.json$")
# Python events waiting to go to the C++ recorder: (track, category, arg name)
# -> [(name, start_ns, end_ns, arg)]. Sent in bulk (one op per group).
_PENDING: Dict[Tuple[str, str, str], List[Tuple[str, int, int, int]]] = (
    collections.defaultdict(list))
_PENDING_LIMIT = 10000
_LOCK = threading.Lock()
_ATEXIT = False


def path() -> Optional[str]:
    """The job's timeline file ($TF_SMB_TIMELINE), or None when off."""
    return os.environ.get(ENV) or None


def enabled() -> bool:
    """Whether this process records a timeline ($TF_SMB_TIMELINE is set)."""
    return bool(os.environ.get(ENV))


def enable(trace_path: str) -> str:
    """Turns the timeline on for this process: call it before the process joins
    its job (``tf_smb.init()`` or creating a strategy), on every worker, with
    the same path. Returns the absolute path.

    Raises:
      RuntimeError: the process joined its job already (the recorder starts
        when it joins).
    """
    ops = sys.modules.get("tf_smb.ops")
    if getattr(ops, "_JOB", None) is not None:
        raise RuntimeError("tf_smb.timeline.enable() must come before the process joins "
                           "its job (tf_smb.init() or creating a strategy); or set "
                           f"{ENV} in the workers' environment")
    trace_path = os.path.abspath(trace_path)
    os.environ[ENV] = trace_path
    return trace_path


def record(name: str, start_ns: int, end_ns: int, track: str = "steps",
           category: str = "step", arg_name: str = "", arg: int = 0) -> None:
    """Adds an event measured in Python (times from time.monotonic_ns()) to this
    worker's timeline, on row `track`. Buffered: sent to the recorder by
    `flush`, at the end of `fit` and at exit. Does nothing while off."""
    if not enabled():
        return
    global _ATEXIT
    with _LOCK:
        events = _PENDING[(track, category, arg_name)]
        events.append((name, int(start_ns), int(end_ns), int(arg)))
        full = sum(len(v) for v in _PENDING.values()) >= _PENDING_LIMIT
        if not _ATEXIT:
            _ATEXIT = True
            atexit.register(_push_quietly)  # runs before the C++ recorder writes
    if full:
        push()


def _clamped(events: List[Tuple[str, int, int, int]]) -> List[Tuple[str, int, int, int]]:
    """Steps sorted by start, each ending no later than the next begins (Keras
    may run on_train_batch_end on a thread of its own, a little late)."""
    events = sorted(events, key=lambda e: e[1])
    out = []
    for i, (name, start, end, arg) in enumerate(events):
        if i + 1 < len(events):
            end = min(end, events[i + 1][1])
        out.append((name, start, max(start, end), arg))
    return out


def _loaded_library():
    """The op library if this process loaded it (it joined a tf_smb job), else
    None: then there is no recorder to send events to (e.g. HorovodStrategy),
    and no reason to load, let alone compile, the library."""
    from tf_smb import op_library  # pylint: disable=import-outside-toplevel
    return getattr(op_library, "_LIB", None)


def push() -> None:
    """Sends the buffered Python events to this process's recorder."""
    with _LOCK:
        groups = list(_PENDING.items())
        _PENDING.clear()
    lib = _loaded_library()
    if not groups or lib is None:
        return
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    for (track, category, arg_name), events in groups:
        if category == "step":
            events = _clamped(events)
        names, starts, ends, args = zip(*events)
        with tf.init_scope():
            lib.smb_timeline_record(
                names=tf.constant(names, tf.string), starts_ns=tf.constant(starts, tf.int64),
                ends_ns=tf.constant(ends, tf.int64), args=tf.constant(args, tf.int64),
                track=track, category=category, arg_name=arg_name)


def _push_quietly() -> None:
    try:
        push()
    except Exception as e:  # noqa: BLE001 - at exit: say so, do not fail the exit
        print(f"tf_smb timeline: could not record the last Python events: {e}",
              file=sys.stderr)


def flush() -> str:
    """Writes this worker's timeline so far (its part; with one worker the
    timeline itself) and returns the file's path ("" while off). Recording
    goes on; the part is written again at exit."""
    if not enabled():
        return ""
    push()
    lib = _loaded_library()
    if lib is None:
        return ""  # not joined to a tf_smb job: nothing recorded
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    with tf.init_scope():
        written = lib.smb_timeline_flush()
    return written.numpy().decode()


# ---- Files ------------------------------------------------------------------

def parts(trace_path: str) -> Dict[str, Dict[int, str]]:
    """The parts left in ``trace_path + ".parts"``: job -> rank -> file."""
    directory = trace_path + ".parts"
    found: Dict[str, Dict[int, str]] = collections.defaultdict(dict)
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            m = _PART.match(name)
            if m:
                found[m.group("job")][int(m.group("rank"))] = os.path.join(directory, name)
    return dict(found)


def load(trace_path: str) -> Dict[str, Any]:
    """A trace (or part) file as a dict with "traceEvents"."""
    with open(trace_path, encoding="utf-8") as f:
        return json.load(f)


def clock_shift_ns(part: Dict[str, Any], reference: Dict[str, Any]) -> int:
    """Nanoseconds that put the times of a part (its otherData) on the clock of
    the reference part: 0 for parts of one host (one boot, one CLOCK_MONOTONIC);
    across hosts, the difference of their CLOCK_REALTIME leads, so hosts whose
    real-time clocks agree (NTP) line up. As the C++ merge does."""
    keys = ("boot_id", "realtime_ahead_ns")
    if any(k not in part or k not in reference for k in keys):
        return 0
    if part["boot_id"] == reference["boot_id"]:
        return 0
    return int(part["realtime_ahead_ns"]) - int(reference["realtime_ahead_ns"])


def merge(trace_path: str, job: Optional[str] = None, keep_parts: bool = False) -> Dict[str, Any]:
    """Merges the parts of one job in ``trace_path + ".parts"`` into trace_path.

    Args:
      trace_path: the job's timeline file (TF_SMB_TIMELINE).
      job: the job whose parts to merge; default: the job of the newest part.
      keep_parts: keep the parts (they are removed when all ranks are there).
    Returns:
      {"path", "job", "world", "ranks", "missing_ranks", "partial_ranks" (parts
      written by `flush`, not at the worker's exit), "events"}.
    Raises:
      FileNotFoundError: no parts (of `job`) are there.
    """
    found = parts(trace_path)
    if job is None and found:
        job = max(found, key=lambda j: max(os.path.getmtime(p) for p in found[j].values()))
    if job is None or job not in found:
        raise FileNotFoundError(f"no timeline parts{'' if job is None else ' of job ' + job} "
                                f"in {trace_path}.parts")
    events: List[Dict[str, Any]] = []
    world = 0
    partial = []
    reference: Optional[Dict[str, Any]] = None  # the first part's clock (rank 0's)
    for rank in sorted(found[job]):
        part = load(found[job][rank])
        other = part.get("otherData", {})
        reference = other if reference is None else reference
        shift_us = clock_shift_ns(other, reference) / 1000
        for event in part.get("traceEvents", []):
            if shift_us and "ts" in event:
                event["ts"] += shift_us
            events.append(event)
        world = max(world, int(other.get("world", 0)), rank + 1)
        if not other.get("final", True):
            partial.append(rank)  # written by flush(): the worker did not reach its exit
    missing = [r for r in range(world) if r not in found[job]]
    doc = {"traceEvents": events, "displayTimeUnit": "ms",
           "otherData": {"tf_smb_job": job, "world": world, "missing_ranks": missing,
                         "partial_ranks": partial}}
    tmp = f"{trace_path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    os.replace(tmp, trace_path)
    if not keep_parts and not missing and not partial:
        for part_path in found[job].values():
            os.remove(part_path)
        try:
            os.rmdir(trace_path + ".parts")
        except OSError:
            pass  # other jobs' parts
    return {"path": trace_path, "job": job, "world": world, "ranks": sorted(found[job]),
            "missing_ranks": missing, "partial_ranks": partial, "events": len(events)}


# ---- Drawing ----------------------------------------------------------------

PHASE_COLORS = {
    "negotiate": "#bdbdbd", "agree": "#ff9f1c", "wait": "#e63946", "stage": "#457b9d",
    "reduce": "#2a9d8f", "copy out": "#8e5bd0",
    "clock tick wait": "#9c6644", "wait all finished": "#6d4c41",
    "segment read": "#00a6a6", "push": "#7cb518", "apply_sgd": "#e56b9f",
}
_STEP_COLORS = ("#cfe3f7", "#a9cbed")


def _color_key(event: Dict[str, Any]) -> Optional[str]:
    """The PHASE_COLORS key of an event ("push" for "push dense/kernel"), or None."""
    name = event.get("name", "")
    if name in PHASE_COLORS:
        return name
    for key in PHASE_COLORS:
        if name.startswith(key + " "):
            return key
    return None


def short_name(name: str) -> str:
    """A collective's name for a label: its op and where it is, e.g.
    "allreduce (adam)" for "allreduce <graph>/allreduce0|.../adam/SmbAllReduce|0:0",
    "allreduce (one_step_on_data)" for "allreduce <...>/one_step_on_data/allreduce1|..."."""
    op, _, site = name.partition(" ")
    if not site or site == "eager":
        return name
    path, _, rest = site.partition("|")
    node = rest.split("|")[0]
    scopes = [p for p in node.split("/")[:-1] if p and p != "StatefulPartitionedCall"]
    graphs = path.split("/")
    where = scopes[-1] if scopes else graphs[-2] if len(graphs) > 1 else graphs[-1]
    return f"{op} ({where})"


def _rows(events: List[Dict[str, Any]]) -> List[Tuple[int, int, str]]:
    """(pid, tid, label) of every row with complete events, in trace order."""
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[(e["pid"], e["tid"])] = e["args"]["name"]
    keys = sorted({(e["pid"], e["tid"]) for e in events if e.get("ph") == "X"})
    return [(pid, tid, f"rank {pid} · {names.get((pid, tid), tid)}") for pid, tid in keys]


def _window(events: List[Dict[str, Any]], steps: int) -> Tuple[float, float]:
    """A time window (µs) of `steps` steps of rank 0 from the middle of training
    (past the first steps, which trace and warm up); all events without steps."""
    xs = [e for e in events if e.get("ph") == "X"]
    step_events = sorted((e for e in xs if e.get("cat") == "step" and e["pid"] == 0),
                         key=lambda e: e["ts"])
    if steps > 0 and len(step_events) >= steps:
        # Of the runs of `steps` consecutive steps, the one of median length:
        # typical, neither the first (tracing) nor one held up by a slow rank.
        spans = sorted((step_events[i + steps - 1]["ts"] + step_events[i + steps - 1]["dur"]
                        - step_events[i]["ts"], i)
                       for i in range(len(step_events) - steps + 1))
        first = spans[len(spans) // 2][1]
        start = step_events[first]["ts"]
        last = step_events[first + steps - 1]
        end = last["ts"] + last["dur"]
        pad = 0.02 * (end - start)
        return start - pad, end + pad
    start = min(e["ts"] for e in xs)
    end = max(e["ts"] + e["dur"] for e in xs)
    return start, end


def render(trace_path: str, png_path: str, steps: int = 3, title: Optional[str] = None,
           width: float = 14.0) -> str:
    """Draws a trace as a Gantt chart into a PNG: a row per rank and track,
    phases colored, `steps` training steps of rank 0 from the middle of the
    run (or everything, when the trace has no steps). Needs matplotlib."""
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    from matplotlib.patches import Patch  # pylint: disable=import-outside-toplevel

    doc = load(trace_path)
    events = doc["traceEvents"]
    lo, hi = _window(events, steps)
    rows = _rows(events)
    index = {(pid, tid): i for i, (pid, tid, _) in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(width, 0.65 * len(rows) + 1.8))
    ms = lambda us: (us - lo) / 1000.0  # noqa: E731
    axes_points = 0.85 * width * 72  # the axes' width, roughly
    used = set()
    for e in events:
        if e.get("ph") != "X" or e["ts"] + e["dur"] < lo or e["ts"] > hi:
            continue
        y = index[(e["pid"], e["tid"])]
        x0, width_ms = ms(max(e["ts"], lo)), (min(e["ts"] + e["dur"], hi) - max(e["ts"], lo)) / 1000.0
        cat = e.get("cat")
        if cat == "step":
            color = _STEP_COLORS[int(e.get("args", {}).get("step", 0)) % 2]
            ax.broken_barh([(x0, width_ms)], (y - 0.4, 0.8), facecolors=color,
                           edgecolors="#5c7fa3", linewidth=0.6)
            if width_ms > 0.06 * (hi - lo) / 1000.0:
                ax.text(x0 + width_ms / 2, y, f"step {e.get('args', {}).get('step', '')}",
                        ha="center", va="center", fontsize=8)
        elif cat == "epoch":
            continue  # the steps show it
        elif cat == "collective":
            ax.broken_barh([(x0, width_ms)], (y - 0.42, 0.84), facecolors="#f4f1de",
                           edgecolors="#555555", linewidth=0.7, zorder=1)
            used.add("collective")
            label = short_name(e["name"])
            # Only where it fits: ~3.8 points per character of a 6.5-point font.
            if width_ms / ((hi - lo) / 1000.0) * axes_points > 3.8 * len(label):
                ax.text(x0 + width_ms / 2, y - 0.44, label, ha="center",
                        va="bottom", fontsize=6.5, color="#333333", zorder=4, clip_on=True)
        else:
            key = _color_key(e)
            nested = e["name"] == "wait" or cat != "phase"
            height = 0.5 if e["name"] == "wait" else 0.66
            ax.broken_barh([(x0, width_ms)], (y - height / 2, height),
                           facecolors=PHASE_COLORS.get(key, "#999999"),
                           edgecolors="none", zorder=3 if nested else 2)
            used.add(key)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([label for _, _, label in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, (hi - lo) / 1000.0)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)
    for i in range(1, len(rows)):
        if rows[i][0] != rows[i - 1][0]:
            ax.axhline(i - 0.5, color="#888888", linewidth=0.8)
    legend = [Patch(facecolor=_STEP_COLORS[1], edgecolor="#5c7fa3", label="training step")]
    if "collective" in used:
        legend.append(Patch(facecolor="#f4f1de", edgecolor="#555555", label="collective"))
    for name, color in PHASE_COLORS.items():
        if name in used:
            legend.append(Patch(facecolor=color, label=name))
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.3 / len(rows)),
              ncol=min(len(legend), 8), fontsize=8, frameon=False)
    ax.set_title(title or f"tf_smb timeline: {os.path.basename(trace_path)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def summary(trace_path: str) -> Dict[str, Any]:
    """Counts of the trace's complete events: {rank: {category: {name: n}}}."""
    out: Dict[str, Any] = {}
    for e in load(trace_path)["traceEvents"]:
        if e.get("ph") == "X":
            by_cat = out.setdefault(str(e["pid"]), {}).setdefault(e.get("cat", ""), {})
            by_cat[e["name"]] = by_cat.get(e["name"], 0) + 1
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m tf_smb.timeline merge|render|summary``."""
    p = argparse.ArgumentParser(prog="python -m tf_smb.timeline", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="merge the parts left in PATH.parts into PATH")
    m.add_argument("path")
    m.add_argument("--job", help="the job to merge (default: the newest)")
    m.add_argument("--keep-parts", action="store_true")
    r = sub.add_parser("render", help="draw a trace as a PNG (needs matplotlib)")
    r.add_argument("trace")
    r.add_argument("png")
    r.add_argument("--steps", type=int, default=3, help="training steps to show (default 3)")
    r.add_argument("--title")
    s = sub.add_parser("summary", help="print the trace's event counts as JSON")
    s.add_argument("trace")
    a = p.parse_args(argv)
    if a.command == "merge":
        try:
            result = merge(a.path, job=a.job, keep_parts=a.keep_parts)
        except FileNotFoundError as e:
            print(e, file=sys.stderr)
            return 1
        print(json.dumps(result))
        return 0 if not (result["missing_ranks"] or result["partial_ranks"]) else 2
    if a.command == "render":
        print(render(a.trace, a.png, steps=a.steps, title=a.title))
        return 0
    print(json.dumps(summary(a.trace), indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
