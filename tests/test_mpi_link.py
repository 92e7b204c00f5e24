"""The link between nodes (cc/smb/link/) over MPI (cc/smb/transport/mpi_transport.cc),
run on this one node: `mpirun` with TF_SMB_ACROSS_NODES=1 takes the cross-node path (MPI starts,
finds one node, the job-wide collective order is decided by node 0's leader
through MPI messages, MPI_Finalize at exit). tests/test_nodes.py runs it across
two simulated nodes."""
import glob
import json
import os
import shutil
import sys
import tempfile
from typing import Dict, List, Optional

from harness import REPO, WORKERS, run_command, base_env, max_diff, run_single

ORDERING = os.path.join(WORKERS, "ordering_worker.py")
KERAS = os.path.join(WORKERS, "keras_worker.py")


def mpirun_json(np_: int, args: List[str], timeout: float,
                env: Optional[Dict[str, str]] = None) -> List[dict]:
    """`mpirun -np N python args...` across the MPI path; every rank's last JSON
    line (from its own output file), by rank. Fails naming mpirun's exit code and
    output."""
    out_dir = tempfile.mkdtemp(prefix="tf_smb_mpi_")
    e = {k: v for k, v in base_env({"TF_SMB_ACROSS_NODES": "1", "TF_SMB_TIMEOUT": "120",
                                    **(env or {})}).items()
         if not k.startswith("TF_SMB_") or k in ("TF_SMB_ACROSS_NODES", "TF_SMB_TIMEOUT")}
    argv = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "mpi_yield_when_idle",
            "1", "--output-filename", out_dir, "-np", str(np_)]
    for name in ("PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL", "TF_SMB_ACROSS_NODES", "TF_SMB_TIMEOUT"):
        argv += ["-x", name]
    argv += [sys.executable, *args]
    try:
        r = run_command(argv, timeout, e, cwd=REPO)
        assert r.returncode == 0, (f"mpirun exited with {r.returncode}:\n{r.stderr[-4000:]}\n"
                                   f"{r.stdout[-3000:]}")
        by_rank = {}
        for path in glob.glob(os.path.join(out_dir, "1", "rank.*", "stdout")):
            with open(path) as f:
                lines = [l for l in f.read().splitlines() if l.startswith("{")]
            if lines:
                result = json.loads(lines[-1])
                by_rank[result["rank"]] = result
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    assert sorted(by_rank) == list(range(np_)), f"results from ranks {sorted(by_rank)}:\n{r.stdout[-3000:]}"
    return [by_rank[k] for k in range(np_)]


def test_job_wide_order_decided_through_mpi_pairs_collectives():
    # Independent collectives that TensorFlow runs in any order: node 0's leader
    # decides the order for the job through MPI messages; every value exact.
    results = mpirun_json(3, [ORDERING, "stress", "--rounds", "3", "--runs", "20"], timeout=600)
    for r in results:
        assert r["error"] is None, f"rank {r['rank']}: {r['error']}"
        assert len(r["rounds"]) == 3, f"rank {r['rank']}"
        for i, rnd in enumerate(r["rounds"]):
            assert rnd == {"session_bad": 0, "function_bad": 0}, f"rank {r['rank']} round {i}: {rnd}"


def test_fit_through_the_mpi_path_equals_one_process():
    single = run_single([KERAS, "fit", "--batch", "16"], timeout=300).check().json()
    workers = mpirun_json(2, [KERAS, "fit", "--batch", "8"], timeout=600)
    for r in workers:
        assert r["size"] == 2
        diff = max_diff(r["weights"], single["weights"])
        assert diff < 1e-5, f"rank {r['rank']}: max |dw| {diff}"
        assert max_diff(r["pred"], single["pred"]) < 1e-5, f"rank {r['rank']}"
