"""Smoke test of `python -m benchmarks.async_step`: tiny model, 2 workers, every number sane."""
from __future__ import annotations

import csv
import math
import pathlib
from typing import Dict, List

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
    for column in ("sync all-reduce ms", "async read+push ms", "async read+sgd ms",
                   "sync/async"):
        assert column in comm[0], column
    assert_positive_numbers(comm, skip="model")

    accuracy = read_csv(tmp_path / "async_accuracy.csv")
    assert [r["mode"] for r in accuracy] == ["sync", "async (delta)", "async (sgd in box)"]
    assert "test accuracy" in accuracy[0]
    assert_positive_numbers(accuracy, skip="mode")
    for row in accuracy:
        assert float(row["test accuracy"]) <= 1.0, row
