"""The asynchronous mode across two simulated nodes (tests/simnodes.py), 2
workers each: segments live in the box of one node each (placement: in creation
order, the node holding the fewest segment bytes so far, ties to the lowest
index); workers on the other node read and push through MPI to that node, with
the same result as on one node: no lost update, no torn read, a wrong shape
refused. Then Keras training in async mode across the nodes (the one-node
versions: test_async.py)."""
import json
import os
import re
import signal
import sys
import time

import numpy as np
import pytest

import simnodes
from frozen_thread import FrozenThread
import harness
from harness import REPO, WORKERS

SEGMENTS = os.path.join(WORKERS, "segments_worker.py")
DIGITS = os.path.join(WORKERS, "digits_async.py")
KERAS_DIGITS = os.path.join(REPO, "examples", "keras_digits.py")
ENV = {"TF_SMB_TIMEOUT": "120", "TEST_TIMEOUT": "120"}
PER_NODE = 2
WORLD = 2 * PER_NODE
PUSHES = 2000
LOST_AFTER_S = 10  # silence after which a rank is lost (cc/smb/link/transport_link.h)
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "int32": 4, "float64": 8, "int64": 8}




def node_of(rank):
    """mpirun fills node 0's slots first: ranks 0, 1 on node 0; 2, 3 on node 1."""
    return rank // PER_NODE


def launch_workers(nodes, args, timeout, result_dir):
    """simnodes.launch_workers with this file's layout and environment."""
    return simnodes.launch_workers(nodes, PER_NODE, args, timeout, result_dir, ENV)


def launch_script(nodes, args, timeout):
    """mpirun of `python args...` on 2x2; fails showing every rank's output."""
    python = nodes.python()
    launch = nodes.mpirun(WORLD, PER_NODE, [*python, *args], timeout,
                          {**nodes.preload_env(python), **ENV})
    if launch.returncode != 0:
        raise AssertionError(simnodes.describe_failure(launch, list(range(WORLD))))
    return launch


def last_json(launch, rank):
    """The last JSON object the rank printed (None if none), decoded from its
    start on its line (whatever follows it ignored)."""
    decoder = json.JSONDecoder()
    for line in reversed(launch.rank_output(rank).splitlines()):
        start = line.find('{"rank"')
        if start >= 0:
            try:
                return decoder.raw_decode(line[start:])[0]
            except ValueError:
                continue
    return None


def output_of(launch, rank, chars=3000):
    return f"\n--- rank {rank} output:\n{launch.rank_output(rank)[-chars:]}"


def placement(sizes, count=2):
    """The documented rule: each segment, in creation order, to the node holding
    the fewest segment bytes so far (ties: the lowest index)."""
    held, homes = [0] * count, []
    for size in sizes:
        home = min(range(count), key=lambda i: (held[i], i))
        held[home] += size
        homes.append(home)
    return homes


def momentum_gain(momentum, steps):
    """What `steps` momentum SGD steps with gradient -1 and learning rate 1 add
    to a parameter (one velocity, starting at 0): v = m*v + 1; w += v. A step
    lost, or a velocity per node instead of one, ends lower (by v, or by
    m/(1-m)**2, the first steps' shortfall, for each extra velocity)."""
    v = w = 0.0
    for _ in range(steps):
        v = momentum * v + 1.0
        w += v
    return w


def spec_bytes(spec):
    """Bytes of a "dtype[d0,d1]" segment."""
    dtype, dims = spec[:-1].split("[")
    return DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",")]))


def bad_spec(spec):
    """The spec of the wrong-shape delta segments_worker pushes (last dim + 1)."""
    dtype, dims = spec[:-1].split("[")
    d = dims.split(",")
    d[-1] = str(int(d[-1]) + 1)
    return f"{dtype}[{','.join(d)}]"


def test_pushes_from_both_nodes_to_segments_on_both_nodes_lose_nothing(nodes, tmp_path):
    # Every rank adds +1 PUSHES times to every segment (push; apply_sgd on the
    # float ones every other time; momentum SGD on one) while reading now and
    # then: on each segment 2 local and 2 remote writers at once.
    launch, results = launch_workers(nodes, [SEGMENTS, "--pushes", str(PUSHES)], 600,
                                     str(tmp_path))
    segments = results[0]["segments"]  # [name, "dtype[shape]"] in creation order
    expected_homes = dict(zip([n for n, _ in segments],
                              placement([spec_bytes(s) for _, s in segments])))
    assert sorted(set(expected_homes.values())) == [0, 1], expected_homes  # the worker's choice
    seconds = {r["rank"]: round(r["push_seconds"], 1) for r in results}
    print(f"seconds pushing, by rank: {seconds}; launch {launch.seconds:.0f}s")
    for rank, r in enumerate(results):
        out = output_of(launch, rank)
        assert r["rank"] == rank and r["size"] == WORLD, f"rank {rank}: {r['rank']}/{r['size']}{out}"
        assert r["homes"] == expected_homes, (
            f"rank {rank}: segment homes {r['homes']}, expected {expected_homes}{out}")
        for name, spec in segments:
            err = r["bad_push_errors"][name]
            where = "remote" if expected_homes[name] != node_of(rank) else "local"
            assert err and not err.startswith("not InvalidArgumentError") \
                and spec in err and bad_spec(spec) in err, (
                    f"rank {rank} (node {node_of(rank)}) pushing {bad_spec(spec)} to {where} "
                    f"segment {name} ({spec}, home node {expected_homes[name]}): "
                    f"expected InvalidArgumentError naming both shapes, got {err!r}{out}")
        assert r["torn"] == [], f"rank {rank}: torn consistent reads {r['torn']}{out}"
        for name, spec in segments:
            value = np.asarray(r["final"][name], dtype=np.float64)
            want = np.arange(value.size) % 7 + (  # initial: index mod 7
                momentum_gain(r["momentum"], PUSHES * WORLD)
                if name == r["momentum_segment"] else PUSHES * WORLD)
            bad = np.flatnonzero(np.abs(value - want) > 1e-6)
            assert bad.size == 0, (
                f"rank {rank} (node {node_of(rank)}) read {name} ({spec}, home node "
                f"{expected_homes[name]}): {bad.size} of {value.size} elements wrong, e.g. "
                f"[{bad[0]}] = {value[bad[0]]} instead of {want[bad[0]]} "
                f"(gains seen: {sorted(set((value - np.arange(value.size) % 7).tolist()))[:8]})"
                f"{out}")


@pytest.mark.parametrize("update", ["delta", "sgd"])
def test_keras_digits_async_across_nodes_reaches_090(nodes, update):
    # Four asynchronous pushers with the box's momentum SGD at the example's
    # default rate (0.05) ended below 0.90 in 3 of 27 runs here (0.80-0.88, a
    # loss spike late in training) and once in CI (the 2x2 threads test in
    # test_examples.py: the same). At 0.03, 27 of 27 ended at 0.93-0.96.
    rate = ["--box_learning_rate=0.03"] if update == "sgd" else []
    launch = launch_script(nodes, [KERAS_DIGITS, "--mode=async", f"--update={update}", *rate],
                           900)
    for rank in range(WORLD):
        accs = [float(a) for a in re.findall(r"test accuracy: *([0-9.]+)",
                                             launch.rank_output(rank))]
        assert accs and accs[-1] >= 0.90, (
            f"rank {rank} (node {node_of(rank)}): test accuracies {accs}"
            f"{output_of(launch, rank)}")


def test_staleness_bound_and_final_values_across_nodes(nodes, tmp_path):
    # Rank 3 (node 1) sleeps 0.05 s a step; with staleness 0 no rank on either
    # node may start a step before every other finished the previous one. After
    # fit every rank loads the box's final values: the same weights everywhere.
    # Results come back in files too: under load mpirun once dropped a
    # simulated node's last line of output although every rank exited 0.
    launch = launch_script(nodes, [DIGITS, "--epochs", "2", "--staleness", "0",
                                   "--slow_rank", "3", "--delay", "0.05",
                                   "--result_dir", str(tmp_path)], 600)
    results = []
    for rank in range(WORLD):
        written = tmp_path / f"rank{rank}.json"
        res = json.loads(written.read_text()) if written.exists() else last_json(launch, rank)
        assert res is not None and res["rank"] == rank, (
            f"rank {rank}: no result line{output_of(launch, rank)}")
        results.append(res)
    for rank, res in enumerate(results):
        assert res["steps"] > 0, f"rank {rank}: {res}{output_of(launch, rank)}"
        assert res["max_gap"] <= 0, (
            f"rank {rank} (node {node_of(rank)}) ran {res['max_gap']} steps ahead of the "
            f"slowest with staleness 0: {res}{output_of(launch, rank)}")
        assert res["weights_sum"] == results[0]["weights_sum"], (
            f"rank {rank} ended with weights summing to {res['weights_sum']}, rank 0 with "
            f"{results[0]['weights_sum']}: {results}{output_of(launch, rank)}")


@pytest.mark.parametrize("how", ["killed", "stalled"])
def test_survivors_finish_when_a_node_is_lost(nodes, tmp_path, how):
    # mpirun --enable-recovery lets node 0's ranks run on when node 1's die.
    # Every rank holds at the start of epoch 1; the test kills node 1's two
    # workers (or stops them with SIGSTOP), then lets the others go. Node 0's
    # ranks find the lost ranks by their silence (10 s), move the segments
    # homed on node 1 into node 0's box from the values they last read
    # (saying so), and finish training: >= 0.90, with the same final weights
    # on both survivors. Stopped ranks that wake up after that must not train
    # on alone: they learn they were left behind and fail saying so. (The
    # survivors need not wait on node 1 before they finish, pushes combined per
    # node go in the background: they hold at epoch 3 until node 1 was woken.)
    # When node 1 is killed, rank 1's MPI thread is frozen too, as Open MPI
    # 4.1's TCP transport at times leaves it in a call that never returns after
    # a peer died mid-message: rank 1 must still count node 1 lost, finish and
    # exit (its watchdog, not its MPI thread, judges the silence).
    run = nodes.start_mpirun(WORLD, PER_NODE,
                             [sys.executable, DIGITS, "--epochs", "12", "--kill_epoch", "1",
                              "--marker_dir", str(tmp_path),
                              "--rehold_epoch", "3" if how == "stalled" else "-1"],
                             env={"TF_SMB_TIMEOUT": "300"},
                             extra_mca=[("orte_enable_recovery", "1")])
    survivors, lost = range(PER_NODE), range(PER_NODE, WORLD)  # node 0, node 1
    failed = frozen = None
    try:
        deadline = time.time() + 300
        while not all((tmp_path / f"held{r}").exists() for r in range(WORLD)):
            assert time.time() < deadline and run.proc.poll() is None, (
                "training never reached epoch 1: " + _early_output(run))
            time.sleep(0.5)
        sig = signal.SIGKILL if how == "killed" else signal.SIGSTOP
        stopped = nodes.kill_in_node(1, "digits_async", sig)
        stopped_at = time.time()
        assert len(stopped) == PER_NODE, stopped
        if how == "killed":
            # (Up to 30 s: under the full suite's load it was once not caught in
            # a futex within 10 s.)
            frozen = FrozenThread(_pid_of_rank(nodes, 1), "smb_link", timeout=30)
        (tmp_path / "go").touch()
        deadline = time.time() + 300
        if how == "stalled":
            # Node 0 has moved on (two epochs on, node 1 silent for 10 s: lost):
            # wake node 1, whose ranks must stop; then node 0 trains on.
            while not all((tmp_path / f"reheld{r}").exists() for r in survivors):
                assert time.time() < deadline, "the survivors did not reach epoch 3"
                time.sleep(0.5)
            time.sleep(max(0.0, stopped_at + LOST_AFTER_S + 3 - time.time()))
            early = [r for r in survivors if (tmp_path / f"rank{r}.json").exists()]
            assert not early, f"rank(s) {early} finished before node 1 was woken"
            nodes.kill_in_node(1, "digits_async", signal.SIGCONT)
            while nodes.kill_in_node(1, "digits_async", 0):  # signal 0: still there?
                assert time.time() < deadline, "node 1's woken ranks did not stop"
                time.sleep(0.5)
            (tmp_path / "go_on").touch()
        while not all((tmp_path / f"rank{r}.json").exists() for r in survivors):
            assert time.time() < deadline, "the survivors did not finish within 300 s"
            time.sleep(0.5)
        # And every worker exits soon (mpirun itself does not end after losing
        # ranks: killed below). A rank told it was left behind must not wait
        # to finalize with ranks that count it as gone (that wait is 60 s).
        deadline = time.time() + 30
        while [cmd for _, cmd in nodes.processes() if cmd.startswith(sys.executable)]:
            assert time.time() < deadline, f"workers still running after 30 s: {nodes.processes()}"
            if frozen:
                frozen.reap()
            time.sleep(0.5)
        # What the ranks printed last may still be on its way through the
        # nodes' mpirun daemons: give it up to 20 s before mpirun is killed.
        deadline = time.time() + 20
        while _unsaid(run, how) and time.time() < deadline:
            time.sleep(0.5)
    except AssertionError as e:
        failed = e
    finally:
        if frozen:
            frozen.release()
        nodes.kill_processes()
        out, err = run.kill()
    printed = simnodes.rank_outputs(out or "", err or "")
    said = {rank: printed.get(rank, "") for rank in range(WORLD)}
    if failed is not None:
        raise AssertionError(f"{failed}" + "".join(
            f"\n--- rank {rank}'s output:\n{_without_noise(said[rank])[-3000:]}"
            for rank in range(WORLD)))

    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in survivors]
    for rank, res in zip(survivors, results):
        shown = _without_noise(said[rank])[-4000:]
        assert re.search(NAMED_LOST, said[rank]), (
            f"rank {rank} did not name the lost ranks:\n{shown}")
        if how == "killed" and rank == 1:
            assert MPI_THREAD_STUCK in said[rank], (
                f"rank 1 did not say its MPI thread is stuck:\n{shown}")
        moved = re.search(MOVED, said[rank])
        assert moved and int(moved.group(1)) >= 1, (
            f"rank {rank} did not say which segments it moved:\n{shown}")
        assert res["accuracy"] >= 0.90, f"rank {rank}: {res}"
        assert res["weights_sum"] == results[0]["weights_sum"], results
    if how == "stalled":
        for rank in lost:
            assert not (tmp_path / f"rank{rank}.json").exists(), f"rank {rank} trained on alone"
            assert re.search(LEFT_BEHIND.format(rank=rank), said[rank]), (
                f"rank {rank} did not say it was left behind:\n"
                f"{_without_noise(said[rank])[-4000:]}")


# What the lost-node test expects the ranks to say (survivors: ranks 0 and 1).
NAMED_LOST = r"rank\(s\) [23] \(node 1\).* lost .*goes on without them"
MOVED = (r"node\(s\) 1 lost, with its box: its (\d+) segment\(s\) .* live on "
         r"node\(s\) 0 now, restarted from the values rank \d last read")
MPI_THREAD_STUCK = "this rank's MPI thread is stuck in an MPI call"
LEFT_BEHIND = (r"rank {rank} \(node 1\) sent nothing for 10 s, so rank [01] went "
               r"on without it .*this rank stops")


def _unsaid(run, how):
    """Whether a line the lost-node test expects is still missing from what the
    draining mpirun `run` printed so far."""
    expected = [(r, NAMED_LOST) for r in (0, 1)] + [(r, MOVED) for r in (0, 1)]
    expected += [(1, re.escape(MPI_THREAD_STUCK))] if how == "killed" else [
        (r, LEFT_BEHIND.format(rank=r)) for r in (2, 3)]
    said = run.rank_outputs()
    return any(not re.search(pattern, said.get(r, "")) for r, pattern in expected)


def _without_noise(output):
    """`output` without Open MPI's TCP errors, which flood it after a kill."""
    return "".join(line for line in output.splitlines(keepends=True)
                   if "btl_tcp" not in line)


def _pid_of_rank(nodes, rank):
    """The pid of the worker that Open MPI made job rank `rank`."""
    pids = [pid for pid, cmd in nodes.processes() if cmd.startswith(sys.executable)]
    pid = harness.pid_with_env(pids, "OMPI_COMM_WORLD_RANK", str(rank))
    if pid is None:
        raise LookupError(f"no worker of rank {rank}: {nodes.processes()}")
    return pid


def _early_output(run):
    return _without_noise(run.output())[-6000:]
