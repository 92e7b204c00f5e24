"""Smoke test of `python -m benchmarks.epoch_time --smoke`: every configuration runs
(one process, SMB with the releaser thread and without, without it on an
autotuned dataset, Horovod-MPI)
and every number is sane."""
from __future__ import annotations

import json
import math
import pathlib

from harness import run_single

CONFIGS = ["single", "smb", "smb_owner", "smb_autotune_owner", "horovod_mpi"]


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_benchmark_epoch_time_smoke(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "e.json"
    result = run_single(["-m", "benchmarks.epoch_time", "--smoke", f"--out={out}",
                         "--timeout=240"], timeout=900, env={"TF_ENABLE_ONEDNN_OPTS": "0"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "| config | cnn epoch s | step ms | outside steps s | epoch vs smb |" in result.stdout

    report = json.loads(out.read_text())
    summary = report["summary"]["cnn"]
    assert sorted(summary) == sorted(CONFIGS)
    for config, s in summary.items():
        assert s["ok"] and s["repeats"] == 1, (config, s)
        assert positive(s["epoch_s"]) and positive(s["step_s"]), (config, s)
        assert math.isfinite(s["outside_s"]), (config, s)
        run, = report["runs"]["cnn"][config]
        assert len(run["epoch_walls"]) == 3 and all(positive(t) for t in run["epoch_walls"])
        # The epoch holds its steps: the time outside them is what is left of it.
        assert s["epoch_s"] == run["epoch_s"] and run["steps"] >= 1
        assert math.isclose(run["outside_s"], run["epoch_s"] - run["steps"] * run["step_s"])
