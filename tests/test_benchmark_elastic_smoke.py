"""Smoke test of `python -m benchmarks.elastic --smoke` (one node, and `--nodes`: two
simulated nodes): today's job and the elastic-capable one run side by side, commits
are timed, and a worker's death is caught and recovered from, every number sane (the
targets are judged on the full run, docs/elastic.md, not here). Across nodes the
survivor is a new process alone in its generation: it must resume from its node's
commit through the elastic fit (a 1-worker generation once trained without it)."""
from __future__ import annotations

import json
import math
import pathlib

import pytest

import simnodes
from harness import run_single


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.parametrize("where", ["one_node", "nodes"])
def test_benchmark_elastic_smoke(tmp_path: pathlib.Path, where: str) -> None:
    if where == "nodes":
        simnodes.open_or_skip(nodes=2).close()  # skips (not in CI) where none can be made
    out = tmp_path / "e.json"
    result = run_single(["-m", "benchmarks.elastic", "--smoke", f"--out={out}",
                         "--timeout=240", *(["--nodes"] if where == "nodes" else [])],
                        timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "| model | workers | epoch s | elastic | ratio |" in result.stdout
    report = json.loads(out.read_text())
    row, = report["rows"]
    for key in ("epoch_s", "elastic_epoch_s", "step_s", "elastic_step_s", "commit_s",
                "detect_s", "resume_s"):
        assert positive(row[key]), (key, row)
    assert math.isclose(row["epoch_ratio"], row["elastic_epoch_s"] / row["epoch_s"])
    assert 0 < row["commit_share"] < 1, row
    killed, = report["jobs"]["small"]["killed"]
    assert killed["ok"] and killed["resume_s"] == row["resume_s"], killed
