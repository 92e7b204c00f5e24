"""Smoke test of `python -m benchmarks.local_replicas`: mlp, N=2, every configuration
(single, SMBStrategy(local_replicas=2), 2 SMB processes, MirroredStrategy and
CentralStorageStrategy over 2 logical CPUs), every number sane."""
from __future__ import annotations

import json
import math
import pathlib

from harness import run_single

CONFIGS = ["single", "smb_local", "smb_procs", "mirrored", "central_storage"]
MEMORY = ("rss_before_fit_mib", "peak_rss_mib")


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_benchmark_local_replicas_smoke(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "r.json"
    result = run_single(["-m", "benchmarks.local_replicas", "--smoke", f"--out={out}",
                         "--timeout=240"], timeout=900, env={"TF_ENABLE_ONEDNN_OPTS": "0"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "## N = 2 replicas" in result.stdout
    assert "| config | mlp samples/s | mlp vs single | mlp vs smb_procs |" in result.stdout
    assert "## Failures" not in result.stdout

    report = json.loads(out.read_text())
    assert report["failures"] == []
    results = report["results"]
    assert sorted(r["config"] for r in results) == sorted(CONFIGS)
    for r in results:
        where = r["config"]
        assert r["ok"] and r["model"] == "mlp", (where, r.get("error"))
        assert r["replicas"] == (1 if where == "single" else 2), where
        processes = 2 if where == "smb_procs" else 1
        assert r["processes"] == processes == len(r["per_process"]), where
        assert r["num_replicas_in_sync"] == r["replicas"], where
        assert positive(r["samples_per_s"]), (where, r["samples_per_s"])
        assert len(r["epoch_s"]) == 2 and all(positive(t) for t in r["epoch_s"]), where
        for key in MEMORY:
            assert positive(r[key]), (where, key, r[key])
            # Past TensorFlow's own footprint (hundreds of MiB), and the total is the sum.
            assert all(positive(p[key]) and p[key] > 100 for p in r["per_process"]), (
                where, key)
            assert r[key] == sum(p[key] for p in r["per_process"]), (where, key)
        assert all(p["peak_rss_mib"] >= p["rss_before_fit_mib"] for p in r["per_process"])
        if where != "single":
            for key in ("vs_single", "vs_smb_procs"):
                assert positive(r[key]), (where, key, r.get(key))
