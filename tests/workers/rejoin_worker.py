"""A job whose members change while its processes live on (elastic training's
core): ranks 0-2 of a 3-worker job sum once; rank 2 leaves; the other two fail
their next collective, join a 2-worker job and sum; rank 0 moves on to the next
job while rank 1 tries one more sum in this one (it fails: rank 0 left for the
next generation); then a process that was not in either (ROLE=joiner) joins
them in a 3-worker job, and all three sum. The same tf.function runs in every
job. Prints one JSON line.

    TF_SMB_RANK=r TF_SMB_SIZE=3 TF_SMB_JOB_ID=j python rejoin_worker.py   # r = 0, 1, 2
    ROLE=joiner TF_SMB_RANK=3 TF_SMB_SIZE=4 TF_SMB_JOB_ID=j python rejoin_worker.py
"""
import faulthandler
import json
import os
import sys

import tensorflow as tf

from tf_smb import env as env_lib
from tf_smb import ops


def job(started: env_lib.JobInfo, generation: int, rank: int, size: int) -> env_lib.JobInfo:
    return env_lib.JobInfo(rank=rank, size=size, job_id=f"{started.job_id}.g{generation}",
                           box_created=False, launcher="test")


@tf.function
def summed(x):
    return ops.allreduce([x])[0]


def error_of(x: float) -> str:
    """The message of the error a sum of `x` fails with ("no error": it did not)."""
    try:
        summed(tf.constant(x))
        return "no error"
    except tf.errors.OpError as e:
        return e.message


def main() -> int:
    # A hang prints every thread's stack (before the test's own timeout ends it).
    faulthandler.dump_traceback_later(float(os.environ.get("HANG_DUMP_S", "200")), exit=True)
    started = env_lib.detect()
    out = {"start_rank": started.rank}
    if os.environ.get("ROLE") == "joiner":
        ops.init(job(started, 2, 2, 3))
        out["g2"] = float(summed(tf.constant(3.0)))
        out["rank"] = ops.rank()
        print(json.dumps(out), flush=True)
        return 0
    ops.init(started)
    out["g0"] = float(summed(tf.constant(started.rank + 1.0)))
    if started.rank == 2:
        print(json.dumps(out), flush=True)
        return 0  # leaves the job (tf_smb tells the others at exit)
    out["after_leave"] = error_of(1.0)
    ops.rejoin(job(started, 1, started.rank, 2))
    out["g1"] = float(summed(tf.constant(started.rank + 1.0)))
    if started.rank == 1:  # rank 0 goes on to the next job first: this sum fails at once
        out["after_rejoin"] = error_of(1.0)
    ops.rejoin(job(started, 2, started.rank, 3))
    out["g2"] = float(summed(tf.constant(started.rank + 1.0)))
    out["rank"], out["size"] = ops.rank(), ops.size()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
