"""keras_worker's scenarios under any launcher (horovodrun, srun, ...), with
where each rank ran: its host, the job tf_smb detected (launcher, spans_nodes)
and the tf_smb boxes mapped into it. Writes RESULT_DIR/rank<r>.json.

    launcher_worker.py SCENARIO[,SCENARIO...] [--batch B] --result_dir DIR

Several scenarios run in turn in one job (one launch), each from the same seed
as keras_worker.main gives it; their results are then keyed by scenario name.
"""
import argparse
import os
import socket
import sys

import keras

import keras_worker  # tests/workers: this script's folder
import tf_smb
from common import report
from tf_smb import ops as smb_ops

# What launchers set that tells a rank its place (for the failure messages).
PLACE_VARS = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
              "OMPI_COMM_WORLD_LOCAL_SIZE", "HOROVOD_RANK", "HOROVOD_SIZE",
              "HOROVOD_LOCAL_SIZE", "SLURM_PROCID", "SLURM_STEP_NUM_NODES")


def mapped_boxes():
    """The names of the tf_smb boxes (/dev/shm/tf_smb_*) this process maps."""
    names = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split(maxsplit=5)[5].strip() if len(line.split()) > 5 else ""
            if "/tf_smb_" in path:
                names.add(os.path.basename(path.replace(" (deleted)", "")))
    return sorted(names)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("scenario")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rows", type=int, default=96, help="keras_worker's fit: training rows")
    p.add_argument("--result_dir", required=True)
    a = p.parse_args()
    scenarios = a.scenario.split(",")
    strategy = tf_smb.SMBStrategy(timeout_s=float(os.environ.get("TEST_TIMEOUT", "60")))
    results = {}
    for scenario in scenarios:
        keras.utils.set_random_seed(1234)  # as keras_worker.main
        results[scenario] = getattr(keras_worker, "scenario_" + scenario)(strategy, a)
    result = results[scenarios[0]] if len(scenarios) == 1 else results
    job = smb_ops.job()
    result.update(rank=strategy.rank, size=strategy.size, host=socket.gethostname(),
                  launcher=job.launcher, spans_nodes=job.spans_nodes, boxes=mapped_boxes(),
                  place={k: os.environ[k] for k in PLACE_VARS if k in os.environ})
    report(result, a.result_dir)


if __name__ == "__main__":
    sys.exit(main())
