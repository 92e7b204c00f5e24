"""Smoke test of `python -m benchmarks.suite`: every strategy on tiny shapes and tiny
fit runs, then every file it writes (CSV, markdown, PNG) is checked.

Horovod is part of the test environment (tools/test.sh installs it with
tools/install_horovod.sh): without it this test fails rather than skips.
"""
from __future__ import annotations

import csv
import math
import pathlib
import subprocess
from typing import Dict, List, Sequence

from harness import base_env, python, run_single

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Rows that must hold numbers; the others (MWMS: Keras 3's fit may fail under it) may read
# n/a, with a reason.
COMM_REQUIRED = ["SMB sync", "SMB async", "SMB async read_at=push", "Horovod-MPI",
                 "Horovod-Gloo", "memcpy"]
FIT_REQUIRED = ["SMB sync", "SMB async", "Horovod-MPI", "Horovod-Gloo",
                "no strategy (1 worker)", "OneDeviceStrategy (1 worker)", "SMB sync (1 worker)"]


def read_csv(path: pathlib.Path) -> List[Dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def check_rows(rows: List[Dict[str, str]], numeric: Sequence[str], value: str) -> None:
    """Numbers are positive and finite; an n/a value comes with status n/a and a reason."""
    for row in rows:
        if row["status"] == "ok":
            for column in numeric:
                number = float(row[column])
                assert math.isfinite(number) and number > 0, (column, row)
        else:
            assert row["status"] == "n/a", row
            assert row[value] == "n/a", row
            assert row["reason"].strip(), f"n/a without a reason: {row}"


def by_strategy(rows: List[Dict[str, str]], model: str) -> Dict[str, Dict[str, str]]:
    return {r["strategy"]: r for r in rows if r["model"] == model}


def test_horovod_is_installed() -> None:
    p = subprocess.run([*python(), "-c", "import horovod.tensorflow"],
                       capture_output=True, text=True, timeout=300, env=base_env())
    assert p.returncode == 0, ("Horovod must be installed for the benchmark suite's test "
                               "(bash tools/install_horovod.sh):\n" + p.stderr[-2000:])


def test_benchmark_suite_smoke(tmp_path: pathlib.Path) -> None:
    result = run_single(["-m", "benchmarks.suite", "--smoke", f"--out_dir={tmp_path}"],
                        timeout=900, env={"TF_ENABLE_ONEDNN_OPTS": "0"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    # The markdown: written and printed, with every table.
    markdown = (tmp_path / "benchmark.md").read_text()
    for text in ("## Communication per step (ms)",
                 "| model | workers | params (M) | MB | SMB sync ms | SMB async ms | "
                 "SMB async read_at=push ms | Horovod-MPI ms | Horovod-Gloo ms | MWMS-RING ms "
                 "| memcpy ms |",
                 "### Ratios", "Horovod-MPI / SMB sync", "Horovod-Gloo / SMB sync",
                 "## model.fit throughput, 2 workers (samples/s)",
                 "## One worker: SMBStrategy against no strategy", "## Targets",
                 "| target | measured | goal | status |"):
        assert text in markdown, text
        assert text in result.stdout, text

    comm = read_csv(tmp_path / "comm.csv")
    check_rows(comm, ["MB", "tensors", "ms"], "ms")
    assert {(r["model"], r["workers"]) for r in comm} == {("tiny_mlp", "2")}
    rows = by_strategy(comm, "tiny_mlp")
    for strategy in COMM_REQUIRED:
        assert rows[strategy]["status"] == "ok", rows[strategy]
    assert "MWMS-RING" in rows

    fit = read_csv(tmp_path / "fit.csv")
    check_rows(fit, ["samples_per_s", "epoch_s", "epochs_timed"], "samples_per_s")
    for model in ("cnn", "mlp"):
        rows = by_strategy(fit, model)
        for strategy in FIT_REQUIRED:
            assert rows[strategy]["status"] == "ok", rows[strategy]
        assert "MWMS-RING" in rows

    targets = read_csv(tmp_path / "targets.csv")
    assert len(targets) >= 7, targets
    for row in targets:
        assert row["status"] in ("met", "missed", "n/a"), row
        assert row["measured"].strip(), row

    for name in ("comm.png", "fit.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE), name
        assert len(data) > 10_000, (name, len(data))
