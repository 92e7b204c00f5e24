"""TF_SMB_TIMELINE: one Chrome-trace / Perfetto JSON per job with every rank's
steps, collectives (and their phases), segment reads/pushes and clock waits
(cc/smb/timeline.h, tf_smb/timeline.py); nothing at all when it is off."""
import json
import os
import subprocess
import sys

import pytest

from harness import REPO, WORKERS, base_env, run_launcher, run_ranks
from sanitized import SANITIZERS, build_and_run

WORKER = os.path.join(WORKERS, "timeline_worker.py")


@pytest.mark.parametrize("sanitizer", sorted(SANITIZERS))
def test_recorder_while_ranks_run_collectives_under_sanitizer(sanitizer, tmp_path):
    # cc/tests/timeline_test.cc: 3 ranks as threads run scheduled collectives
    # and clock ticks while other threads record and flush; then the merge.
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    build_and_run("timeline_test", sanitizer, [str(out_dir)])
    with open(out_dir / "sub" / "trace.json") as f:
        assert json.load(f)["otherData"]["final"] is True


def _x(trace, pid=None, cat=None):
    return [e for e in trace["traceEvents"] if e["ph"] == "X"
            and (pid is None or e["pid"] == pid) and (cat is None or e.get("cat") == cat)]


def _inside(inner, outer, slack=0.002):
    return (outer["ts"] - slack <= inner["ts"]
            and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + slack)


def _check_trace_file(path, world):
    with open(path) as f:
        trace = json.load(f)  # valid JSON
    assert trace["displayTimeUnit"] == "ms"
    assert trace["otherData"]["world"] == world
    assert trace["otherData"]["missing_ranks"] == []
    assert trace["otherData"]["partial_ranks"] == []
    assert not os.path.exists(path + ".parts"), os.listdir(path + ".parts")
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    for rank in range(world):
        assert {"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                "args": {"name": f"rank {rank}"}} in meta
        tracks = {e["args"]["name"] for e in meta
                  if e["pid"] == rank and e["name"] == "thread_name"}
        assert {"steps", "collectives"} <= tracks, tracks
    for e in _x(trace):
        assert 0 <= e["pid"] < world and e["dur"] >= 0 and e["ts"] > 0, e
    return trace


def test_two_worker_fit_traces_every_rank_and_collective(tmp_path):
    path = str(tmp_path / "traces" / "fit.json")  # its directory is made
    results = [r.check().json() for r in
               run_ranks([WORKER, "--epochs", "2", "--steps", "10"], 2, timeout=300,
                         env={"TF_SMB_TIMELINE": path})]
    trace = _check_trace_file(path, world=2)
    for r in results:
        rank, steps = r["rank"], r["steps"]
        assert r["timeline_hooked"] and steps == 20
        step_events = sorted(_x(trace, rank, "step"), key=lambda e: e["ts"])
        assert [e["args"]["step"] for e in step_events] == list(range(steps))
        assert len(_x(trace, rank, "epoch")) == 2
        collectives = _x(trace, rank, "collective")
        # The gradient all-reduce (the optimizer sums the gradients): one per
        # step, inside that step.
        grads = [e for e in collectives
                 if e["name"].startswith("allreduce ") and "/adam/" in e["name"]]
        assert len(grads) == steps, sorted({e["name"] for e in collectives})
        for step in step_events:
            assert sum(_inside(g, step) for g in grads) == 1, step
        # Every collective of the step function: once per step.
        by_site = {}
        for e in collectives:
            if "multi_step_on_iterator" in e["name"]:
                by_site[e["name"]] = by_site.get(e["name"], 0) + 1
        assert by_site and set(by_site.values()) == {steps}, by_site
        # Only the gradients' and the logs': the workers' parts of the data are
        # equally long, so no step asks whether any worker still has data.
        assert len(by_site) == 2, by_site
        assert sorted(e["args"]["call"] for e in grads) == list(range(steps))
        # Phases: every collective negotiates and agrees; each phase lies in
        # its collective.
        phases = _x(trace, rank, "phase")
        names = {e["name"] for e in phases}
        assert {"negotiate", "agree", "wait", "stage", "reduce", "copy out"} <= names, names
        assert sum(e["name"] == "negotiate" for e in phases) == len(collectives)
        collectives.sort(key=lambda e: e["ts"])
        for p in phases:
            assert any(_inside(p, c) for c in collectives), p


def test_off_writes_nothing_and_hooks_nothing(tmp_path):
    results = [r.check().json() for r in
               run_ranks([WORKER, "--epochs", "1", "--steps", "5", "--flush"], 2, timeout=300,
                         env={"TF_SMB_TIMELINE": "", "TMPDIR": str(tmp_path)})]
    for r in results:
        assert r["timeline_hooked"] is False and r["flushed"] == ""
    written = [os.path.join(d, f) for d, dirs, files in os.walk(tmp_path)
               for f in files + dirs if f.endswith((".json", ".parts"))]
    assert written == []


def test_launcher_async_fit_with_flush(tmp_path):
    # Under tf_smb.run; the async mode's segment reads, SGD pushes and clock
    # waits; a flush along the way (a part that is not final) does not end
    # up as the rank's part in the merged file.
    path = str(tmp_path / "async.json")
    # The launcher's --timeline sets TF_SMB_TIMELINE for every worker.
    proc = run_launcher(2, [WORKER, "--mode", "async", "--epochs", "2", "--steps", "8",
                            "--flush"], timeout=300, launcher_args=["--timeline", path])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads(line.split(": ", 1)[1]) for line in proc.stdout.splitlines()
               if ": {" in line]
    assert sorted(r["rank"] for r in results) == [0, 1]
    for r in results:
        assert r["flushed"].startswith(path + ".parts/") and r["flushed"].endswith(
            f".rank{r['rank']}.json")
    trace = _check_trace_file(path, world=2)
    for rank in (0, 1):
        segments = _x(trace, rank, "segment")
        # Fully asynchronous: each step reads the box in one op at its end.
        assert any(e["name"].startswith("push+read (") for e in segments)
        assert any(e["name"].startswith("apply_sgd ") for e in segments)
        clock = [e["name"] for e in _x(trace, rank, "clock")]
        steps = len(_x(trace, rank, "step"))
        assert steps > 0 and clock.count("clock tick wait") >= steps
        assert clock.count("wait all finished") == 1
        # Written at exit: the steps after the flush are there too.
        assert max(e["ts"] for e in _x(trace, rank, "step")) > 0


def _part(directory, job, rank, world, final=True, **other):
    os.makedirs(directory, exist_ok=True)
    events = [{"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
               "args": {"name": f"rank {rank}"}},
              {"name": "step", "cat": "step", "ph": "X", "pid": rank, "tid": 0,
               "ts": 1000.0 + rank, "dur": 5.0, "args": {"step": 0}}]
    with open(os.path.join(directory, f"{job}.rank{rank}.json"), "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                   "otherData": {"tf_smb_job": job, "world": world, "rank": rank,
                                 "final": final, **other}}, f)


def _merge_cli(*args):
    return subprocess.run([sys.executable, "-m", "tf_smb.timeline", "merge", *args],
                          capture_output=True, text=True, timeout=120, env=base_env(), cwd=REPO)


def test_merge_command_for_parts_left_behind(tmp_path):
    path = str(tmp_path / "t.json")
    _part(path + ".parts", "old-job", 0, 2)
    _part(path + ".parts", "job", 0, 3)
    _part(path + ".parts", "job", 2, 3, final=False)
    os.utime(os.path.join(path + ".parts", "old-job.rank0.json"), (1, 1))
    r = _merge_cli(path)  # the newest job; rank 1 missing, rank 2 flushed only
    assert r.returncode == 2, r.stderr
    summary = json.loads(r.stdout)
    assert summary["job"] == "job" and summary["missing_ranks"] == [1]
    assert summary["partial_ranks"] == [2]
    with open(path) as f:
        assert sorted(e["pid"] for e in json.load(f)["traceEvents"] if e["ph"] == "X") == [0, 2]
    _part(path + ".parts", "job", 1, 3)
    _part(path + ".parts", "job", 2, 3)
    r = _merge_cli(path, "--job", "job")
    assert r.returncode == 0 and json.loads(r.stdout)["ranks"] == [0, 1, 2], r.stderr
    assert os.listdir(path + ".parts") == ["old-job.rank0.json"]  # other jobs' parts stay
    r = _merge_cli(str(tmp_path / "none.json"))
    assert r.returncode == 1 and "no timeline parts" in r.stderr


def test_merge_puts_other_hosts_on_rank0s_clock(tmp_path):
    # Each host has its own CLOCK_MONOTONIC (parts say their boot id): the
    # merge moves another host's events by the difference of the hosts'
    # CLOCK_REALTIME leads, and leaves the events of rank 0's host alone.
    path = str(tmp_path / "t.json")
    _part(path + ".parts", "job", 0, 3, boot_id="a", realtime_ahead_ns=5_000_000)
    _part(path + ".parts", "job", 1, 3, boot_id="a", realtime_ahead_ns=5_000_700)
    _part(path + ".parts", "job", 2, 3, boot_id="b", realtime_ahead_ns=7_500_250)
    r = _merge_cli(path)
    assert r.returncode == 0, r.stderr
    with open(path) as f:
        ts = {e["pid"]: e["ts"] for e in json.load(f)["traceEvents"] if e["ph"] == "X"}
    assert ts == {0: 1000.0, 1: 1001.0, 2: pytest.approx(1002.0 + 2500.25)}


def test_render_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from tf_smb import timeline
    path = str(tmp_path / "t.json")
    events = []
    for rank in (0, 1):
        events += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": 16,
                    "args": {"name": "collectives"}}]
        for step in range(4):
            t = 1000.0 * step
            events += [
                {"name": "step", "cat": "step", "ph": "X", "pid": rank, "tid": 0, "ts": t,
                 "dur": 900.0, "args": {"step": step}},
                {"name": "allreduce x", "cat": "collective", "ph": "X", "pid": rank,
                 "tid": 16, "ts": t + 100, "dur": 500.0, "args": {"call": step}},
                {"name": "negotiate", "cat": "phase", "ph": "X", "pid": rank, "tid": 16,
                 "ts": t + 100, "dur": 200.0},
                {"name": "reduce", "cat": "phase", "ph": "X", "pid": rank, "tid": 16,
                 "ts": t + 300, "dur": 300.0}]
    with open(path, "w") as f:
        json.dump({"traceEvents": events}, f)
    png = timeline.render(path, str(tmp_path / "t.png"), steps=2)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
