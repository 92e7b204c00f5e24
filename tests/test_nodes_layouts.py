"""tf_smb past two nodes: 3 (and in --full 4) simulated nodes on one bridge
(tests/simnodes.py), and nodes that run different numbers of workers, as a
scheduler hands them out (2+1, 3+2+1, 1+4). On every layout: sync training equal
to one process on the global batch, the collectives and a broadcast from a rank
that has no counterpart on a smaller node, the asynchronous mode's pushes to
segments homed on every node, the timeline; at 3 nodes, a node lost and then a
survivor whose MPI thread is stuck: the side that hears a majority goes on, the
other stops saying why (no split brain). The two-node versions: test_nodes.py,
test_nodes_async.py, test_nodes_collectives.py."""
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
from harness import REPO, WORKERS, max_diff, run_single
from test_nodes_async import (DTYPE_BYTES, bad_spec, momentum_gain, placement, spec_bytes,
                              _pid_of_rank, _without_noise)

KERAS = os.path.join(WORKERS, "keras_worker.py")
SEGMENTS = os.path.join(WORKERS, "segments_worker.py")
DIGITS = os.path.join(WORKERS, "digits_async.py")
KERAS_DIGITS = os.path.join(REPO, "examples", "keras_digits.py")
ENV = {"TF_SMB_TIMEOUT": "120", "TEST_TIMEOUT": "120"}
B = 8  # per-worker batch
PUSHES = 500
LOST_AFTER_S = 10
del DTYPE_BYTES  # (imported for spec_bytes' sake)

# Layouts as workers per node of a 3-node cluster (0: the node sits out);
# the 4-node ones run on a cluster of their own, in --full.
# (Named here as the tests' ids, which tests/conftest.py's tier lists name.)
LAYOUTS = {"1+1+1": [1, 1, 1], "2+2+2": [2, 2, 2], "3+2+1": [3, 2, 1], "2+1": [2, 1, 0],
           "1+2+2": [1, 2, 2], "1+4": [1, 4, 0], "1+1+1+1": [1, 1, 1, 1]}
FIT_LAYOUTS = ["1+1+1", "2+2+2", "3+2+1", "2+1", "1+4", "1+1+1+1"]


def layouts(*names):
    """The layouts `names` as pytest parameters named after them."""
    return pytest.mark.parametrize("layout", [LAYOUTS[n] for n in names], ids=list(names))


def nodes_of(layout):
    """Each job rank's node: mpirun fills the nodes in order."""
    return [node for node, n in enumerate(l for l in layout if l) for _ in range(n)]


@pytest.fixture(scope="module")
def cluster():
    sim = simnodes.open_or_skip(nodes=3)
    try:
        yield sim
    finally:
        sim.close()


@pytest.fixture(scope="module")
def cluster4():
    sim = simnodes.open_or_skip(nodes=4)
    try:
        yield sim
    finally:
        sim.close()


def on(layout, request):
    """The cluster a layout runs on."""
    return request.getfixturevalue("cluster4" if len(layout) == 4 else "cluster")


@pytest.fixture(scope="module")
def single():
    """The one-process reference of the fit scenario at a global batch, once each."""
    cache = {}

    def get(batch):
        if batch not in cache:
            cache[batch] = run_single([KERAS, "fit", "--batch", str(batch), *rows(batch)],
                                      timeout=300).check().json()
        return cache[batch]
    return get


def rows(global_batch):
    """The fit scenario's rows for a global batch: its 96, or 3 global batches
    where 96 does not split into whole ones (5 workers): every batch then splits
    evenly over the workers, as equality with one process needs (an uneven last
    batch is issue 56's)."""
    return [] if 96 % global_batch == 0 else ["--rows", str(3 * global_batch)]


@layouts(*FIT_LAYOUTS)
def test_fit_evaluate_predict_equal_one_process_with_every_ranks_timeline(
        layout, request, single, tmp_path):
    sim = on(layout, request)
    world = sum(layout)
    folder = f"/dev/shm/tf_smb-test-layouts-{os.getpid()}"
    trace = folder + "/fit.json"
    results = simnodes.run_workers(sim, layout, [KERAS, "fit", "--batch", str(B),
                                                 *rows(world * B)], 600,
                                   str(tmp_path), {**ENV, "TF_SMB_TIMELINE": trace})
    read = sim.run(0, ["cat", trace])
    for node in range(sim.count):
        sim.run(node, ["rm", "-rf", folder])
    assert [r["rank"] for r in results] == list(range(world))
    reference = single(world * B)
    for r in results:
        assert max_diff(r["weights"], reference["weights"]) < 1e-5, f"rank {r['rank']}"
        assert max_diff(r["weights"], results[0]["weights"]) == 0.0, f"rank {r['rank']}"
        for key in ("eval", "eval_numpy"):
            for metric in ("loss", "accuracy"):
                assert r[key][metric] == pytest.approx(reference[key][metric], abs=1e-5), (
                    f"rank {r['rank']} {key} {metric}")
        for key in ("pred", "pred_numpy"):
            np.testing.assert_allclose(r[key], reference[key], atol=1e-5,
                                       err_msg=f"rank {r['rank']} {key}")
    # The timeline: every rank's row in rank 0's file (the nodes share no
    # folder), each with its all-reduces and its time across nodes (a larger
    # node's ranks without counterparts wait there for local rank 0's word).
    assert read.returncode == 0, read.stderr
    data = json.loads(read.stdout)
    assert data["otherData"]["missing_ranks"] == [], data["otherData"]
    events = [e for e in data["traceEvents"] if e["ph"] == "X"]
    for rank in range(world):
        mine = {e["name"] for e in events if e["pid"] == rank}
        assert any(n.startswith("allreduce graph/") for n in mine) and "across nodes" in mine, (
            rank, sorted(mine)[:20])


@layouts("3+2+1", "1+1+1")
def test_every_dtype_and_a_broadcast_from_a_rank_without_counterparts(layout, cluster, tmp_path):
    # keras_worker's "ops": every dtype summed exactly, eager and in a
    # tf.function; broadcasts from rank 1, which on 3+2+1 is local rank 1 of
    # node 0, with no counterpart on node 2; their gradients; and rank 0's
    # initial weights reaching every worker.
    results = simnodes.run_workers(cluster, layout, [KERAS, "ops"], 600, str(tmp_path), ENV)
    for r in results:
        assert r["size"] == sum(layout)
        assert r["bad"] == [], f"rank {r['rank']}: {r['bad']}"


@layouts("1+1+1", "2+1", "1+2+2", "1+1+1+1")
def test_pushes_to_segments_homed_on_every_node_lose_nothing(layout, request, tmp_path):
    # Every rank pushes +1 PUSHES times to every segment (and reads); each
    # segment's home is the node holding the fewest segment bytes so far, so
    # with 3 nodes every node is home to some. Pushes combine per node first.
    nodes = len([n for n in layout if n])
    world = sum(layout)
    launch, results = simnodes.launch_workers(
        on(layout, request), layout, [SEGMENTS, "--pushes", str(PUSHES)], 600, str(tmp_path), ENV)
    segments = results[0]["segments"]
    homes = dict(zip([n for n, _ in segments],
                     placement([spec_bytes(s) for _, s in segments], nodes)))
    assert sorted(set(homes.values())) == list(range(nodes)), homes
    node = nodes_of(layout)
    for rank, r in enumerate(results):
        out = f"\n--- rank {rank} output:\n{launch.rank_output(rank)[-3000:]}"
        assert r["homes"] == homes, f"rank {rank}: homes {r['homes']}, expected {homes}{out}"
        assert r["torn"] == [], f"rank {rank}: torn reads {r['torn']}{out}"
        for name, spec in segments:
            err = r["bad_push_errors"][name]
            assert err and spec in err and bad_spec(spec) in err, (
                f"rank {rank} (node {node[rank]}): pushing {bad_spec(spec)} to {name}: "
                f"{err!r}{out}")
            value = np.asarray(r["final"][name], dtype=np.float64)
            want = np.arange(value.size) % 7 + (
                momentum_gain(r["momentum"], PUSHES * world)
                if name == r["momentum_segment"] else PUSHES * world)
            bad = np.flatnonzero(np.abs(value - want) > 1e-6)
            assert bad.size == 0, (
                f"rank {rank} (node {node[rank]}) read {name} (home node {homes[name]}): "
                f"{bad.size} of {value.size} wrong, e.g. [{bad[0]}] = {value[bad[0]]}, "
                f"expected {want[bad[0]]}{out}")


def _start_digits(cluster, tmp_path, *extra):
    return cluster.start_mpirun(
        3, 1, [sys.executable, DIGITS, "--epochs", "8", "--kill_epoch", "1",
               "--marker_dir", str(tmp_path), *extra],
        env={"TF_SMB_TIMEOUT": "300"}, extra_mca=[("orte_enable_recovery", "1")])


def _wait_for(paths, run, what, timeout=300):
    deadline = time.time() + timeout
    while not all(p.exists() for p in paths):
        assert time.time() < deadline and run.proc.poll() is None, (
            f"{what} within {timeout} s:\n{run.output()[-4000:]}")
        time.sleep(0.5)


def _wait_gone(cluster, timeout, frozen=None):
    deadline = time.time() + timeout
    while [cmd for _, cmd in cluster.processes() if cmd.startswith(sys.executable)]:
        assert time.time() < deadline, f"workers still running: {cluster.processes()}"
        if frozen:
            frozen.reap()
        time.sleep(0.5)


LOST = r"rank\(s\) {rank} \(node {rank}\).* lost .*goes on without them"
CUT_OFF = (r"rank {rank} \(node {rank}\) hears only node\(s\) {rank} of the {alive} alive: "
           r"it is cut off from the rest of the job, which goes on without it, so it stops")


def test_a_node_lost_then_a_survivor_with_a_stuck_mpi_thread(cluster, tmp_path):
    # 3 nodes x 1, async. At epoch 1 node 2 dies: ranks 0 and 1 still hear
    # each other (2 of 3 nodes), count it lost and train on. At epoch 3 rank
    # 1's MPI thread sticks (frozen as Open MPI's can be after a peer died):
    # rank 0 hears 1 of the 2 nodes left, the half that holds the lowest node,
    # so it goes on alone and finishes; rank 1 hears no one and must not go on
    # as a job of its own: it stops, saying it is cut off.
    run = _start_digits(cluster, tmp_path, "--rehold_epoch", "3")
    frozen = failed = None
    try:
        _wait_for([tmp_path / f"held{r}" for r in range(3)], run, "training reached epoch 1")
        assert len(cluster.kill_in_node(2, "digits_async")) == 1
        (tmp_path / "go").touch()
        _wait_for([tmp_path / f"reheld{r}" for r in (0, 1)], run, "ranks 0, 1 reached epoch 3")
        deadline = time.time() + 60  # held there, both count node 2 lost after 10 s
        while not all(re.search(LOST.format(rank=2), run.rank_outputs().get(r, ""))
                      for r in (0, 1)):
            assert time.time() < deadline, f"node 2 not counted lost:\n{run.output()[-4000:]}"
            time.sleep(0.5)
        frozen = FrozenThread(_pid_of_rank(cluster, 1), "smb_link", timeout=30)
        (tmp_path / "go_on").touch()
        _wait_for([tmp_path / "rank0.json"], run, "rank 0 finished")
        _wait_gone(cluster, 90, frozen)
    except AssertionError as e:
        failed = e
    finally:
        if frozen:
            frozen.release()
        cluster.kill_processes()
        out, err = run.kill()
    said = simnodes.rank_outputs(out or "", err or "")
    shown = "".join(f"\n--- rank {r}:\n{_without_noise(said.get(r, ''))[-3000:]}"
                    for r in range(3))
    assert failed is None, f"{failed}{shown}"
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result["accuracy"] >= 0.85, f"{result}{shown}"
    assert not (tmp_path / "rank1.json").exists(), f"rank 1 trained on alone{shown}"
    assert re.search(LOST.format(rank=1), said.get(0, "")), shown
    assert re.search(CUT_OFF.format(rank=1, alive=2), said.get(1, "")), shown


def test_no_split_brain_when_a_node_dies_as_a_survivors_mpi_thread_sticks(cluster, tmp_path):
    # The case that split a job in two: node 2 dies and, at about the same
    # time, rank 1's MPI thread sticks. Rank 1 hears no one and must stop,
    # saying it is cut off. Rank 0 stops too when it finds both silent at once
    # (it hears 1 of 3 nodes); when it finds rank 1 silent first (a loaded
    # machine), it counts it lost with node 2 still heard, and then goes on
    # alone with half of the 2 nodes left, holding the lowest. Either way at
    # most one side goes on: never two jobs training apart.
    run = _start_digits(cluster, tmp_path)
    frozen = failed = None
    try:
        _wait_for([tmp_path / f"held{r}" for r in range(3)], run, "training reached epoch 1")
        assert len(cluster.kill_in_node(2, "digits_async")) == 1
        frozen = FrozenThread(_pid_of_rank(cluster, 1), "smb_link", timeout=30)
        (tmp_path / "go").touch()
        _wait_gone(cluster, 120, frozen)
    except AssertionError as e:
        failed = e
    finally:
        if frozen:
            frozen.release()
        cluster.kill_processes()
        out, err = run.kill()
    said = simnodes.rank_outputs(out or "", err or "")
    shown = "".join(f"\n--- rank {r}:\n{_without_noise(said.get(r, ''))[-3000:]}"
                    for r in range(3))
    assert failed is None, f"{failed}{shown}"
    assert not (tmp_path / "rank1.json").exists(), f"rank 1 trained on alone{shown}"
    assert re.search(CUT_OFF.format(rank=1, alive=r"[23]"), said.get(1, "")), shown
    if not re.search(CUT_OFF.format(rank=0, alive=3), said.get(0, "")):
        assert re.search(LOST.format(rank=1), said.get(0, "")), shown  # it went on alone


HOROVOD_API = os.path.join(WORKERS, "horovod_api_worker.py")


def horovod_placement(layout):
    """[local rank, local size, cross rank, cross size, homogeneous] of each rank,
    as Horovod defines them (cross: among the ranks with the same local rank)."""
    counts = [n for n in layout if n]
    out = []
    for node, n in enumerate(counts):
        for local in range(n):
            peers = [m for m, k in enumerate(counts) if k > local]
            out.append([local, n, peers.index(node), len(peers), len(set(counts)) == 1])
    return out


@layouts("1+1+1", "3+2+1", "1+1+1+1")
def test_horovod_api_and_process_sets_spanning_the_nodes(layout, request, tmp_path):
    results = simnodes.run_workers(on(layout, request), layout, [HOROVOD_API, "layout"], 600,
                                   str(tmp_path), ENV)
    world = sum(layout)
    evens, mixed = list(range(0, world, 2)), sorted({0, 1, world - 1})
    for rank, r in enumerate(results):
        assert r["placement"] == horovod_placement(layout)[rank], f"rank {rank}: {r}"
        assert r["sum"] == [world * (world + 1) / 2] * 5, f"rank {rank}: {r}"
        assert r["gather"] == [q for q in range(world) for _ in range(q + 1)], f"rank {rank}"
        assert r["broadcast"] == [100 + root for root in range(world)], f"rank {rank}"
        assert r["sets"] == [[float(sum(evens))] if rank in evens else None,
                             [float(sum(mixed))] if rank in mixed else None], f"rank {rank}"


@layouts("1+1+1", "2+1")
def test_horovods_keras_mnist_example_across_the_nodes(layout, cluster, tmp_path):
    # Horovod's example as tools/run_horovod_example.py prepares it (--short),
    # under mpirun on 3 nodes x 1 and on 2+1.
    import test_horovod_examples as hx  # pylint: disable=import-outside-toplevel
    if not os.path.isdir(hx.examples.EXAMPLES):
        pytest.skip(f"Horovod's examples are not here ({hx.examples.EXAMPLES})")
    example = "tensorflow2_keras_mnist.py"
    copy = hx.examples.prepare(example, str(tmp_path), short=True)
    python = cluster.python()
    launch = cluster.mpirun(sum(layout), layout, [*python, copy], hx.TIMEOUT,
                            {**cluster.preload_env(python), **hx.ENV}, cwd=str(tmp_path))
    assert launch.returncode == 0, simnodes.describe_failure(launch, list(range(sum(layout))))
    hx._check_output(example, launch.stdout + launch.stderr)  # pylint: disable=protected-access


@layouts("1+1+1", "3+2+1", "1+1+1+1")
def test_keras_digits_async_reaches_090(layout, request, tmp_path):
    # The example in async mode, its segments homed on every node, each node's
    # pushes combined in its box before they cross.
    world = sum(layout)
    cluster = on(layout, request)
    python = cluster.python()
    launch = cluster.mpirun(world, layout, [*python, KERAS_DIGITS, "--mode=async"], 900,
                            {**cluster.preload_env(python), **ENV})
    assert launch.returncode == 0, simnodes.describe_failure(launch, list(range(world)))
    for rank in range(world):
        accs = [float(a) for a in re.findall(r"test accuracy: *([0-9.]+)",
                                             launch.rank_output(rank))]
        assert accs and accs[-1] >= 0.90, (
            f"rank {rank}: test accuracies {accs}\n{launch.rank_output(rank)[-3000:]}")


def test_uneven_nodes_lose_a_node_and_the_survivors_train_on(cluster, tmp_path):
    # 1+2+1 async (ranks 0 | 1, 2 | 3): node 2 dies at epoch 1; the survivors,
    # one node with a rank beyond the streams, hear 2 of 3 nodes, count it lost,
    # move its segments and finish with equal weights.
    run = cluster.start_mpirun(
        4, [1, 2, 1], [sys.executable, DIGITS, "--epochs", "8", "--kill_epoch", "1",
                       "--marker_dir", str(tmp_path)],
        env={"TF_SMB_TIMEOUT": "300"}, extra_mca=[("orte_enable_recovery", "1")])
    failed = None
    try:
        _wait_for([tmp_path / f"held{r}" for r in range(4)], run, "training reached epoch 1")
        assert len(cluster.kill_in_node(2, "digits_async")) == 1
        (tmp_path / "go").touch()
        _wait_for([tmp_path / f"rank{r}.json" for r in range(3)], run, "the survivors finished")
        _wait_gone(cluster, 60)
    except AssertionError as e:
        failed = e
    finally:
        cluster.kill_processes()
        out, err = run.kill()
    said = simnodes.rank_outputs(out or "", err or "")
    shown = "".join(f"\n--- rank {r}:\n{_without_noise(said.get(r, ''))[-3000:]}"
                    for r in range(4))
    assert failed is None, f"{failed}{shown}"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    for rank, res in enumerate(results):
        assert re.search(r"rank\(s\) 3 \(node 2\).* lost .*goes on without them",
                         said.get(rank, "")), f"rank {rank} did not name rank 3 lost{shown}"
        # Trained on: every epoch after the loss ran this rank's whole shard (every
        # 4th batch: the job's size stays 4), and the model learned (8 epochs of async
        # training with a quarter of each epoch lost reach 0.84-0.9; chance is 0.1).
        shard = len(range(rank, res["dataset_batches"][0], 4))
        assert res["trained_batches"] == [shard] * 8, f"rank {rank}: {res}{shown}"
        assert res["accuracy"] >= 0.8, f"rank {rank}: {res}{shown}"
        assert res["weights_sum"] == results[0]["weights_sum"], f"{results}{shown}"
