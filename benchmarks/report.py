"""How the benchmarks report: numbers, markdown tables, CSV, failures and plots.

Nothing here imports TensorFlow; matplotlib only when a plot is drawn.
"""
from __future__ import annotations

import csv
import dataclasses
import pathlib
import re
import statistics
import sys
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from benchmarks.strategies import COLORS, LABELS, SINGLE_SERIES


# --------------------------------------------------------------------------- numbers, tables

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


def write_csv(path: pathlib.Path, header: Sequence[str], rows: Sequence[Sequence[object]]
              ) -> None:
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([list(header), *map(list, rows)])


def overhead_pct(none: Optional[float], smb: Optional[float]) -> Optional[float]:
    """How much slower (in throughput) the 1-worker SMBStrategy is than no strategy, in %."""
    return 100.0 * (none - smb) / none if none and smb else None


@dataclasses.dataclass
class Cell:
    """One measured number (ms per step, or samples/s), or why there is none."""
    value: Optional[float] = None
    reason: str = ""
    detail: Dict[str, object] = dataclasses.field(default_factory=dict)


# --------------------------------------------------------------------------- failures

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


def failure_reason(reason: str, outputs: Sequence[str]) -> str:
    """The process failure plus the error it printed, e.g. `process 0 exited with code 1: ValueError: …`."""
    error = error_line(outputs)
    return f"{reason}: {error}" if error else reason


# --------------------------------------------------------------------------- plots

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
             strategies: List[str], fit_workers: int) -> None:
    """Bars of fit samples/s: the multi-worker strategies, and the one-worker comparison."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    multi = [s for s in strategies if s != "single"]
    panels = [(f"{fit_workers} workers", multi)] if multi else []
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
