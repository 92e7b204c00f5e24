"""Smoke test of `python -m benchmarks.allreduce`: tiny sets, every number sane."""
from __future__ import annotations

import csv
import math
import pathlib

from harness import run_single

SMOKE_SETS = ["4KB", "64KB", "mlp"]


def test_benchmark_smoke(tmp_path: pathlib.Path) -> None:
    result = run_single(["-m", "benchmarks.allreduce", "--smoke", f"--out_dir={tmp_path}",
                         "--timeout=240"], timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "| set | MB | SMB ms |" in result.stdout
    assert (tmp_path / "results.md").exists()
    with open(tmp_path / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["set"] for r in rows] == SMOKE_SETS
    for row in rows:
        for column in ("MB", "SMB ms", "memcpy ms", "SMB/memcpy"):
            value = float(row[column])
            assert math.isfinite(value) and value > 0, (column, row)
        for column in ("MWMS-RING ms", "MWMS/SMB"):  # MWMS may fail to start: n/a
            if row[column] != "n/a":
                value = float(row[column])
                assert math.isfinite(value) and value > 0, (column, row)
