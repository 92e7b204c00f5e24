"""Smoke test of `python -m benchmarks.async_step`: tiny model, 2 workers, every number sane."""
from __future__ import annotations

import csv
import json
import math
import pathlib
from typing import Dict, List

import pytest

from harness import run_single


def read_csv(path: pathlib.Path) -> List[Dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def assert_positive_numbers(rows: List[Dict[str, str]], skip: str) -> None:
    for row in rows:
        for column, text in row.items():
            if column == skip:
                continue
            value = float(text)  # "n/a" (a failed cell) fails here
            assert math.isfinite(value) and value > 0, (column, row)


def test_benchmark_async_smoke(tmp_path: pathlib.Path) -> None:
    result = run_single(["-m", "benchmarks.async_step", "--smoke", f"--out_dir={tmp_path}",
                         "--timeout=300"], timeout=900, env={"TF_ENABLE_ONEDNN_OPTS": "0"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "| model | workers | params (M) | MB | sync all-reduce ms |" in result.stdout
    assert "| mode | wall s | test accuracy |" in result.stdout
    assert "## Failures" not in (tmp_path / "async_results.md").read_text()

    comm = read_csv(tmp_path / "async_comm.csv")
    assert [(r["model"], r["workers"]) for r in comm] == [("tiny_mlp", "2")]
    for column in ("sync all-reduce ms", "async read+push ms",
                   "async push+read ms (read_at=push)", "async read+sgd ms",
                   "sync/async"):
        assert column in comm[0], column
    assert_positive_numbers(comm, skip="model")

    accuracy = read_csv(tmp_path / "async_accuracy.csv")
    modes = ["sync", "async", "async_sgd", "horovod"]
    assert [r["mode"] for r in accuracy] == ["sync", "async (delta)", "async (sgd in box)",
                                             "Horovod-MPI"]
    to_target = "training s to 0.95"
    for mode, row in zip(modes, accuracy):
        # Two epochs may not reach 0.95; the time to it is then n/a, else the
        # curve's first point at or above it.
        reached = row.pop(to_target)
        assert_positive_numbers([row], skip="mode")
        assert float(row["test accuracy"]) <= 1.0, row
        curve = json.loads((tmp_path / f"curve_{mode}_0.json").read_text())
        # A point after every 4th of rank 0's batches (--tta_curve_every's
        # default) and at each epoch's end, in order of time.
        ends = [p for p in curve if p["epoch_end"]]
        assert [p["epoch"] for p in ends] == [1, 2], (mode, curve)
        assert ends[1]["batches"] == 2 * ends[0]["batches"], (mode, curve)
        assert ends[-1] is curve[-1], (mode, curve)
        within = [p["batches"] for p in curve if not p["epoch_end"]]
        assert within and all(b % 4 == 0 for b in within), (mode, curve)
        assert len(within) >= ends[1]["batches"] // 4 - 1, (mode, curve)
        for earlier, later in zip(curve, curve[1:]):
            assert earlier["batches"] < later["batches"], (mode, curve)
            assert 0 < earlier["train_s"] < later["train_s"], (mode, curve)
        first = next((p["train_s"] for p in curve if p["test_accuracy"] >= 0.95), None)
        if first is None:
            assert reached == "n/a", (mode, row, curve)
        else:
            assert float(reached) == pytest.approx(first, rel=1e-4), (mode, row, curve)
        if mode in ("sync", "horovod"):
            # The last point evaluates the final weights, as the run's own
            # evaluate does (in step, every worker holds the same weights; async
            # workers load the box's final values after their last epoch).
            assert curve[-1]["test_accuracy"] == pytest.approx(
                float(row["test accuracy"]), abs=1e-4), (mode, row, curve)
    assert (tmp_path / "accuracy.png").stat().st_size > 10_000
