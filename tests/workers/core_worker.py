"""One rank of a core (no TensorFlow) scenario; prints a JSON result line."""
import argparse
import json
import os
import sys
import time

import ml_dtypes
import numpy as np

from tf_smb import _box

DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64"]
SIZES = [0, 1, 7, 4097, 1_000_003]


def np_dtype(name):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def data(rank, n, dtype):
    # Small integers: every dtype sums them exactly, so results must be exact.
    return ((np.arange(n) * (rank + 3)) % 17 - 8).astype(np_dtype(dtype))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("scenario")
    p.add_argument("--staging", type=int, default=1 << 20)
    p.add_argument("--timeout", type=float, default=60)
    a = p.parse_args()
    rank, world = int(os.environ["TF_SMB_RANK"]), int(os.environ["TF_SMB_SIZE"])
    job = os.environ["TF_SMB_JOB_ID"]
    comm = _box.Communicator(job, rank, world, timeout_s=a.timeout,
                             create=(rank == 0), staging_bytes=a.staging)
    result = {"rank": rank}
    if a.scenario == "allreduce":
        bad = []
        for dtype in DTYPES:
            for n in SIZES:
                out = comm.allreduce([data(rank, n, dtype)])[0]
                want = data(0, n, dtype).astype(np.float64)
                for r in range(1, world):
                    want = want + data(r, n, dtype).astype(np.float64)
                if out.dtype != np_dtype(dtype) or not np.array_equal(
                        out.astype(np.float64), want):
                    bad.append(f"{dtype}[{n}]")
        # Fused: many tensors of mixed dtypes in one collective.
        fused_in = [data(rank, n, d) for d in DTYPES for n in (3, 5000)]
        fused = comm.allreduce(fused_in)
        for t, out in zip(fused_in, fused):
            n = t.size
            want = sum(data(r, n, str(t.dtype)).astype(np.float64) for r in range(world))
            if not np.array_equal(out.astype(np.float64), want):
                bad.append(f"fused {t.dtype}[{n}]")
        result["bad"] = bad
    elif a.scenario == "broadcast":
        bad = []
        for root in range(world):
            for dtype in DTYPES:
                for n in (0, 1, 4097, 300_001):
                    out = comm.broadcast([data(rank, n, dtype)], root=root)[0]
                    if not np.array_equal(out, data(root, n, dtype)):
                        bad.append(f"root{root} {dtype}[{n}]")
        result["bad"] = bad
    elif a.scenario == "barrier":
        # Rank r sleeps r*0.3 s; after the barrier everyone has passed the sleeps.
        time.sleep(rank * 0.3)
        t0 = time.time()
        comm.barrier()
        result["left_at"] = time.time()
        result["waited"] = time.time() - t0
    elif a.scenario == "mismatch":
        n = 10 if rank == 0 else 11
        dtype = "float32" if rank != world - 1 else "float64"
        try:
            comm.allreduce([np.zeros(n, dtype)])
            result["error"] = None
        except ValueError as e:
            result["error"] = str(e)
        # The box is still usable after a caught mismatch.
        result["after"] = comm.allreduce([np.ones(4, np.float32)])[0].tolist()
    elif a.scenario == "die":
        # Rank world-1 dies between collectives; the others must fail, naming it.
        comm.allreduce([np.ones(8, np.float32)])
        if rank == world - 1:
            os.kill(os.getpid(), 9)
        t0 = time.time()
        try:
            comm.allreduce([np.ones(1 << 20, np.float32)])
            result["error"] = None
        except Exception as e:  # noqa: BLE001 - the message is what we test
            result["error"] = f"{type(e).__name__}: {e}"
        result["seconds"] = time.time() - t0
    elif a.scenario == "hold":
        # Keep the box mapped until killed (for the leftover-reclaim test).
        comm.barrier()
        print(json.dumps({"rank": rank, "shm": _box.shm_name(job)}), flush=True)
        time.sleep(600)
    elif a.scenario == "segments":
        if rank == 0:
            key = comm.create_segment("weights", "float32", [3, 4])
            view = comm.attach_segment(key, "float32", [3, 4])
            view[:] = np.arange(12, dtype=np.float32).reshape(3, 4)
        comm.barrier()
        key = comm.lookup_segment("weights")
        view = comm.attach_segment(key, "float32", [3, 4])
        result["values"] = view.ravel().tolist()
        errors = []
        for dtype, shape in (("float64", [3, 4]), ("float32", [4, 3]), ("float32", [12])):
            try:
                comm.attach_segment(key, dtype, shape)
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        result["attach_errors"] = errors
        try:
            comm.create_segment("weights", "int32", [3, 4])
            result["recreate_error"] = None
        except ValueError as e:
            result["recreate_error"] = str(e)
        comm.barrier()
    elif a.scenario == "push":
        # Every rank adds +1 (and 0.5 by axpy) to the same segments 2,000 times.
        keys = {d: comm.create_segment(f"acc-{d}", d, [257]) for d in
                ("float32", "float64", "int32", "int64")}
        axpy_key = comm.create_segment("axpy", "float32", [1000])
        # Locked in stripes: the ranks push to different stripes at once; over
        # 8 MiB, so reads of it bypass the caches (cc/smb/copy.h).
        big = 33 * _box.STRIPE_BYTES // 4 + 1000
        big_key = comm.create_segment("big", "float32", [big])
        comm.barrier()
        for i in range(2000):
            for d, key in keys.items():
                comm.accumulate(key, np.ones(257, np_dtype(d)))
            comm.axpy(axpy_key, 0.5, np.ones(1000, np.float32))
            if i % 50 == 0:
                comm.accumulate(big_key, np.ones(big, np.float32))
                comm.axpy(big_key, 0.5, np.ones(big, np.float32))
        # Wrong shape and dtype: refused, nothing written.
        errors = []
        for bad in (np.ones(256, np.float32), np.ones(257, np.float64)):
            try:
                comm.accumulate(keys["float32"], bad)
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        comm.barrier()
        result["values"] = {d: np.unique(comm.read(k, np.zeros(257, np_dtype(d)))).tolist()
                            for d, k in keys.items()}
        result["axpy"] = np.unique(comm.read(axpy_key, np.zeros(1000, np.float32))).tolist()
        result["big"] = np.unique(comm.read(big_key, np.zeros(big, np.float32))).tolist()
        result["errors"] = errors
    elif a.scenario == "torn":
        # Rank 0 writes whole-tensor patterns 1,1,1... / 2,2,2... alternately
        # into a segment of 2.5 stripes; the others check that every stripe of
        # every consistent read is one pattern (stripes may differ).
        stripe = _box.STRIPE_BYTES // 4
        n = 2 * stripe + stripe // 2
        key = comm.create_segment("pattern", "float32", [n])
        stop = comm.create_segment("stop", "int32", [1])
        if rank == 0:
            comm.assign(key, np.full(n, 2.0, np.float32))
        comm.barrier()
        if rank == 0:
            patterns = [np.full(n, 1.0, np.float32), np.full(n, 2.0, np.float32)]
            writes = 0
            while comm.read(stop, np.zeros(1, np.int32))[0] < world - 1:
                comm.assign(key, patterns[writes % 2])
                writes += 1
            result["writes"] = writes
        else:
            buf = np.zeros(n, np.float32)
            torn = seen_1 = seen_2 = 0
            for _ in range(10_000):
                comm.read(key, buf, os.environ.get("HOGWILD") != "1")
                for part in (buf[i:i + stripe] for i in range(0, n, stripe)):
                    lo, hi = part.min(), part.max()
                    torn += int(lo != hi)
                    seen_1 += int(lo == hi == 1.0)
                    seen_2 += int(lo == hi == 2.0)
            result.update(torn=torn, seen_1=seen_1, seen_2=seen_2)
            comm.accumulate(stop, np.ones(1, np.int32))
        comm.barrier()
    elif a.scenario == "staleness":
        # Rank 1 is slow; record the largest gap seen in the box's raw clocks.
        staleness = int(os.environ["STALENESS"])
        delay = 0.02 if rank == 1 else 0.0
        comm.barrier()
        # With a bound both run 40 steps (a rank that finished stops counting,
        # so neither may stop early); without one both run for 2 seconds.
        end = time.time() + 2.0
        steps = max_gap = 0
        while (steps < 40) if staleness >= 0 else (time.time() < end):
            comm.clock_tick(staleness)
            clocks = comm.clocks()
            max_gap = max(max_gap, clocks[rank] - min(clocks))
            steps += 1
            time.sleep(delay)
        comm.clock_finish()
        comm.wait_all_finished()
        result.update(steps=steps, max_gap=max_gap)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
