"""Elastic jobs across the simulated nodes (tests/simnodes.py): each generation one
mpirun, resuming from the nodes' commit boxes (docs/elastic.md, "Across nodes").

Keras `fit` with SMBStrategy(elastic=True), unchanged (tests/workers/
elastic_fit_worker.py), under `tf_smb.run` in node 0, equal to one process's on the
same global batches (1e-5):
  * fast: 4 workers on nodes 0 and 1 (2 each); a worker on node 1 is SIGKILLed
    mid-epoch (node 1 is blacklisted: 4 -> 2, the next mpirun resumes from the
    commit before), then discovery adds node 2 (2 -> 3, at a commit);
  * --full: a node lost whole, then one removed gracefully (3 -> 2 -> 1).
Then the pieces without mpirun: the commit box, the rank wrapper, the driver's
decisions and its mpirun line.
"""
import json
import os
import shlex
import shutil
import sys

import numpy as np
import pytest

import harness
import simnodes
from test_elastic_fit import WORKER, _weights, async_reference, check_async_result

TIMEOUT_S = 420.0


def _mpi_args(nodes):
    """tf_smb.run's --mpi-args inside the simulated nodes."""
    return shlex.join(nodes.mpirun_options())


def _start_elastic(nodes, tmp_path, discovery, np_, min_np, env):
    """Starts tf_smb.run in node 0: WORKER as an elastic job of up to `np_` workers
    (--min-np `min_np`) across `nodes`, its hosts from a discovery script of the
    shell lines `discovery(progress)` (progress: the file of the lines "epoch
    size" rank 0 writes). Returns (the running job, the progress file)."""
    progress = tmp_path / "progress"
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\n" + discovery(progress) + "exit 0\n")
    discover.chmod(0o700)
    argv = [sys.executable, "-m", "tf_smb.run", "-np", str(np_), "--min-np", str(min_np),
            "--max-np", str(np_), "--host-discovery-script", str(discover),
            "--mpi-args", _mpi_args(nodes), sys.executable, WORKER]
    launch_env = {k: v for k, v in harness.base_env().items()
                  if not k.startswith("TF_SMB_") and k not in harness.env_lib.LAUNCHER_VARS}
    launch_env.update({"PROGRESS": str(progress), "TF_SMB_TIMEOUT": "60", **env})
    return nodes.start(0, argv, launch_env, owns_nodes=True, drain=True), progress


def _lost_then_added(tmp_path, add_when, env):
    """An elastic job across 3 simulated nodes: 2 slots on each of nodes 0 and 1
    (4 workers), node 2 with a slot once `add_when` (an awk condition on the
    progress lines "epoch size") holds. Returns (its output, the progress lines
    as (epoch, size), the last rank 0's summary)."""
    nodes = simnodes.open_or_skip(nodes=3, workers=1)
    try:
        first, second, third = nodes.hostnames
        job, progress = _start_elastic(nodes, tmp_path, lambda progress: (
            f"echo {first}:2\necho {second}:2\n"
            f"awk '{add_when}' {progress} 2>/dev/null | grep -q . && echo {third}:1\n"), 4, 2, env)
        launch = job.wait(TIMEOUT_S)
    finally:
        nodes.close()
    out = launch.stdout + launch.stderr
    assert launch.returncode == 0, out[-10000:]
    assert f"worker rank 3 on host {second} failed (SIGKILL)" in out, out[-10000:]
    assert (f"generation 1: 2 workers ({first}, {first})" in out
            and f"generation 2: 3 workers ({first}, {first}, {third})" in out), out[-10000:]
    ended = [tuple(int(v) for v in line.split()) for line in progress.read_text().splitlines()]
    summary = json.loads([line for line in launch.stdout.splitlines() if '"epochs"' in line][-1]
                         .split("]: ", 1)[-1])
    return out, ended, summary


def test_fit_across_nodes_through_a_lost_node_and_an_added_one_equals_one_process(tmp_path):
    one = harness.run_single([WORKER], TIMEOUT_S, env={"OUT": str(tmp_path / "one.npz")})
    one.check()
    # Rank 3 (node 1's second) dies at epoch 1, batch 6: two batches after the commit
    # at batch 4; after epoch 2 node 2 has a slot.
    _, ended, summary = _lost_then_added(tmp_path, "$1 >= 2", {
        "OUT": str(tmp_path / "elastic.npz"), "KILL_WORKER": "3:1:6"})
    sizes = [size for _, size in ended]
    assert sizes[0] == 4 and 2 in sizes and sizes[-1] == 3, sizes
    # The last generation's processes started at a later epoch: their history ends the job's.
    assert summary["epochs"][-1] == 5 and summary["size"] == 3, summary
    elastic, reference = _weights(tmp_path / "elastic.npz"), _weights(tmp_path / "one.npz")
    for got, want in zip(elastic, reference):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_async_fit_across_nodes_through_a_lost_node_and_an_added_one(tmp_path):
    # SMBStrategy(mode="async", elastic=True) across nodes: rank 3 killed (mpirun stops
    # the rest: the nodes' last commits), then node 2 added once the 2 workers ended an
    # epoch (a host update: every node keeps the box's last values, no rollback).
    reference = async_reference(tmp_path)
    out_path = tmp_path / "elastic.npz"
    _, ended, summary = _lost_then_added(tmp_path, "$2 == 2", {
        "OUT": str(out_path), "MODE": "async", "KILL_WORKER": "3:1:1",
        "STALENESS": "2", "STEP_SLEEP": "0.05"})
    assert ended[0][1] == 4 and ended[-1][1] == 3, ended
    assert sorted({epoch for epoch, _ in ended}) == list(range(6)), ended
    check_async_result(out_path, 3, summary, reference)


def test_fit_across_nodes_through_a_node_lost_whole_and_one_removed_equals_one_process(
        tmp_path):
    """3 nodes of one worker: node 1 dies whole (every process in it, mpirun's daemon
    too: no rank there says how it ended) once epoch 0 is done: 3 -> 2, back to the
    last commit; then discovery drops node 2 (removed gracefully: 2 -> 1 at a
    commit, no rollback). The weights equal one process's."""
    import time
    one = harness.run_single([WORKER], TIMEOUT_S, env={"OUT": str(tmp_path / "one.npz")})
    one.check()
    nodes = simnodes.open_or_skip(nodes=3, workers=1)
    try:
        first, second, third = nodes.hostnames
        # Node 2 goes once epoch 3 is done.
        job, progress = _start_elastic(nodes, tmp_path, lambda progress: (
            f"echo {first}:1\necho {second}:1\n"
            f"awk '$1 >= 3' {progress} 2>/dev/null | grep -q . || echo {third}:1\n"), 3, 1,
            {"OUT": str(tmp_path / "elastic.npz"), "STEP_SLEEP": "0.1"})
        deadline = time.monotonic() + TIMEOUT_S
        while not (progress.exists() and progress.read_text().strip()):
            assert job.proc.poll() is None and time.monotonic() < deadline, job.output()[-8000:]
            time.sleep(0.1)
        killed = nodes.kill_in_node(1, "")  # the node dies: its processes at once
        assert killed, "nothing ran in node 1"
        launch = job.wait(max(1.0, deadline - time.monotonic()))
    finally:
        nodes.close()
    out = launch.stdout + launch.stderr
    assert launch.returncode == 0, out[-10000:]
    assert f"ranks [1] ({second}) ended without a word" in out, out[-10000:]
    assert (f"generation 1: 2 workers ({first}, {third})" in out
            and "hosts removed; the workers stop at their next commit" in out
            and f"generation 2: 1 workers ({first})" in out), out[-10000:]
    sizes = [int(line.split()[1]) for line in progress.read_text().splitlines()]
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 1, sizes
    elastic, reference = _weights(tmp_path / "elastic.npz"), _weights(tmp_path / "one.npz")
    for got, want in zip(elastic, reference):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)

# -- the pieces, without mpirun ------------------------------------------------------

def test_commit_box_keeps_the_last_whole_commit_private_and_refuses_others_files(tmp_path):
    from tf_smb.elastic.commit_box import CommitBox, newest
    box = CommitBox.for_job("job-1.g", directory=str(tmp_path))
    assert box.read() is None and box.serial() == 0
    box.write({"serial": 3, "values": [np.arange(4.0)]})
    box.write({"serial": 4, "values": [np.ones(2)]})
    assert box.serial() == 4 and np.array_equal(box.read()["values"][0], np.ones(2))
    assert os.stat(box.path).st_mode & 0o777 == 0o600
    assert os.listdir(tmp_path) == [os.path.basename(box.path)]  # no temporary left
    with pytest.raises(ValueError, match="int 'serial'"):
        box.write({"values": []})
    with pytest.raises(ValueError, match="letters, digits"):
        CommitBox.for_job("../x", directory=str(tmp_path))
    os.chmod(box.path, 0o644)
    with pytest.raises(PermissionError, match="not this user's private file"):
        box.read()
    box.unlink()
    box.unlink()  # gone already: fine
    assert box.read() is None
    assert newest([0, 5, 7, 7]) == 2 and newest([0, 0]) == 0 and newest([4]) == 0


def test_node_commit_is_written_behind_training_and_its_failure_is_not_silent(tmp_path):
    from tf_smb.elastic.commit_box import CommitBox
    from tf_smb.elastic.worker import ElasticWorker
    worker = ElasticWorker(str(tmp_path), 0, 1, across_nodes="job7", local_rank=0)
    assert worker.resumes() and worker.keeps_node_commit
    worker.commit_box = CommitBox(str(tmp_path / "box"))
    worker.keep_on_node({"serial": 1, "values": [np.zeros(3)]})
    worker.keep_on_node({"serial": 2, "values": [np.ones(3)]})  # waits for the first
    worker.flush_node_commit()
    assert worker.node_commit()["serial"] == 2
    worker.commit_box = CommitBox(str(tmp_path / "missing" / "box"))
    worker.keep_on_node({"serial": 3, "values": []})
    with pytest.raises(RuntimeError, match="could not keep the commit"):
        worker.flush_node_commit()
    other = ElasticWorker(str(tmp_path), 1, 1, across_nodes="job7", local_rank=1)
    other.keep_on_node({"serial": 4, "values": []})  # not the node's first rank: nothing
    assert not other.keeps_node_commit and other.node_commit() is None


STATE_RECORD = """
import json
import keras
import numpy as np
from tf_smb.horovod import elastic

def model_and_optimizer(seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    return model, keras.optimizers.Adam(0.1)

model, opt = model_and_optimizer(1)
x, y = np.ones((4, 3), "float32"), np.zeros((4, 2), "float32")
model.compile(opt, "mse")
model.fit(x, y, verbose=0)  # the optimizer is built, its moments move
state = elastic.TensorFlowKerasState(model, opt, epoch=3, batch=5)
state.save()
state._commits = 7
record = state.record()
# A new process of the next generation: a fresh model, its optimizer not built.
fresh, fresh_opt = model_and_optimizer(2)
resumed = elastic.TensorFlowKerasState(fresh, fresh_opt, epoch=0, batch=0)
resumed.load(record)
same = all(np.array_equal(a, b) for a, b in zip(
    [v.numpy() for v in model.variables + list(opt.variables)],
    [v.numpy() for v in fresh.variables + list(fresh_opt.variables)]))
try:
    resumed.load({**record, "values": record["values"][:1]})
    refused = ""
except ValueError as e:
    refused = str(e)
print(json.dumps({"same": same, "built": fresh_opt.built, "epoch": resumed.epoch,
                  "batch": resumed.batch, "commits": resumed._commits,
                  "refused": refused[:80]}))
"""


def test_horovod_states_record_and_load_a_commit_as_a_new_process_would(tmp_path):
    """What a node's commit box keeps of Horovod's Keras state, and how a process of
    the next generation loads it (its optimizer built first)."""
    script = tmp_path / "state_record.py"
    script.write_text(STATE_RECORD)
    result = harness.run_single([str(script)], 300)
    result.check()
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {"same": True, "built": True, "epoch": 3, "batch": 5, "commits": 7,
                   "refused": out["refused"]}, out
    assert out["refused"].startswith("the commit this job resumes from does not fit"), out


def test_rank_events_survive_mpirun_tags_and_odd_host_names():
    from tf_smb.elastic import protocol
    line = protocol.rank_event("exit", 3, code=-9, host="node a", signal="SIGKILL")
    assert protocol.parse_rank_event(line) == (
        "exit", 3, {"code": "-9", "host": "node a", "signal": "SIGKILL"})
    assert protocol.parse_rank_event("[1,3]<stdout>:" + line)[1] == 3
    assert protocol.parse_rank_event("an ordinary line") is None
    assert protocol.parse_rank_event(protocol.RANK_EVENT_MARK + " exit rank=x") is None


CHILD = """
import json, os, sys, time
d = os.environ["TF_SMB_ELASTIC_DIR"]
generation = json.load(open(os.path.join(d, "generation.json")))
assert generation["number"] == 2 and generation["members"] == [0, 1, 2], generation
assert os.environ["TF_SMB_WORKER_ID"] == "1"
open(os.path.join(d, "joined-2-1"), "w").close()
deadline = time.time() + 60
while not os.path.exists(os.path.join(d, "hosts.json")):
    assert time.time() < deadline, "no host update"
    time.sleep(0.05)
print("update", open(os.path.join(d, "hosts.json")).read(), flush=True)
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("child_exit,wrapper_exit", [(75, 0), (0, 0), (3, 1), (-9, 1)])
def test_rank_wrapper_reports_its_worker_and_passes_host_updates_on(
        tmp_path, child_exit, wrapper_exit):
    import signal
    import subprocess
    import time
    from tf_smb.elastic import protocol
    script = tmp_path / "child.py"
    code = CHILD if child_exit >= 0 else CHILD.replace(
        "sys.exit(int(sys.argv[1]))", "os.kill(os.getpid(), 9)")
    script.write_text(code)
    env = dict(harness.base_env(), OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="3",
               TF_SMB_ELASTIC_GENERATION="2")
    wrapper = subprocess.Popen([sys.executable, "-m", "tf_smb.elastic.rank", "--",
                                sys.executable, str(script), str(child_exit)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env, cwd=harness.REPO)
    events = []
    try:
        for line in wrapper.stdout:
            event = protocol.parse_rank_event(line)
            if event is not None:
                events.append(event)
                if event[0] == "joined":
                    time.sleep(0.2)
                    wrapper.send_signal(signal.SIGUSR1)  # as mpirun forwards it
            elif line.startswith("update"):
                assert '"added": true' in line and '"serial": 1' in line, line
        assert wrapper.wait(60) == wrapper_exit, wrapper.stderr.read()
    finally:
        wrapper.kill()
    names = [e[0] for e in events]
    assert names == ["started", "joined", "exit"], events
    assert all(e[1] == 1 for e in events), events
    assert events[2][2]["code"] == str(child_exit), events
    if child_exit < 0:
        assert events[2][2]["signal"] == "SIGKILL", events


@pytest.fixture(name="nodes_driver")
def _nodes_driver():
    """A NodesDriver on hosts a:2, b:1, c:1 (never started), and its log."""
    from tf_smb.elastic.driver import Options
    from tf_smb.elastic.nodes_driver import NodesDriver
    log = []
    driver = NodesDriver(Options(command=["train"], np=2, min_np=1, max_np=4,
                                 hosts="a:2,b:1,c:1", mpi_args=["--mca", "btl", "tcp,self"]),
                         log=log.append, interrupted=lambda: None)
    driver._hosts = driver._discover()  # pylint: disable=protected-access
    yield driver, log
    shutil.rmtree(driver._dir, ignore_errors=True)


def test_nodes_driver_decides_from_the_ranks_reports(nodes_driver):
    from tf_smb.elastic.driver import JobFailed
    driver, log = nodes_driver
    ranks = ["a", "a", "b", "c"]
    exit_ = lambda code, **kw: {"code": str(code), **kw}  # noqa: E731
    everyone = set(range(4))
    # A rank killed: its host is blacklisted, the others (stopped by mpirun) are not.
    assert driver._outcome(ranks, everyone, {2: exit_(-9, signal="SIGKILL"),
                                             0: exit_(75), 1: exit_(-15, stopped="1")}, 1) is None
    assert not driver._blacklist.allows("b") and driver._blacklist.allows("a")
    assert "worker rank 2 on host b failed (SIGKILL)" in log[-1]
    # Everyone stopped at a commit for a host update: next generation, nobody blamed.
    assert driver._outcome(ranks, everyone, {r: exit_(75) for r in range(4)}, 0) is None
    assert driver._blacklist.allows("c")
    # Ranks that never said how they ended while mpirun failed: their node is lost.
    assert driver._outcome(ranks, everyone, {0: exit_(75), 1: exit_(75), 2: exit_(75)}, 1) is None
    assert not driver._blacklist.allows("c") and "c" in driver._lost
    # Done: every rank ended with 0.
    assert driver._outcome(ranks, everyone, {r: exit_(0) for r in range(4)}, 0) == 0
    with pytest.raises(JobFailed, match=r"training ended on ranks \[0, 1\], but ranks \[2\]"):
        driver._outcome(ranks, everyone, {0: exit_(0), 1: exit_(0), 2: exit_(1)}, 1)
    with pytest.raises(JobFailed, match="started no worker of generation"):
        driver._outcome(ranks, set(), {}, 1)
    with pytest.raises(JobFailed, match="no host is left"):
        driver._outcome(["a", "a"], {0, 1}, {0: exit_(1), 1: exit_(1)}, 1)


def test_nodes_driver_shows_a_line_written_in_two_pieces_whole(nodes_driver, capsys):
    # mpirun tags each piece it reads: unbuffered Python's print (the text, then the
    # newline) came out as '[1,0]<stdout>:{...}[1,0]<stdout>:', which no JSON reader took.
    from tf_smb.elastic import protocol
    driver, _ = nodes_driver
    assert driver._show("out", '[1,0]<stdout>:{"size": 3}[1,0]<stdout>:') is None
    assert driver._show("out", "[1,2]<stderr>:half[1,2]<stderr>: and half") is None
    assert driver._show("out", "a line of mpirun's own") is None
    # Another rank's piece in between stays visible (cut, as mpirun wrote it).
    assert driver._show("out", "[1,0]<stdout>:a[1,1]<stdout>:b") is None
    out, err = capsys.readouterr()
    assert out.splitlines() == ['[0]: {"size": 3}', "a line of mpirun's own",
                                "[0]: a[1,1]<stdout>:b"], out
    assert err.splitlines() == ["[2]: half and half"], err
    event = driver._show("out", f"[1,1]<stdout>:{protocol.rank_event('joined', 1)}[1,1]<stdout>:")
    assert event is not None and event[:2] == ("joined", 1), event


def test_nodes_driver_mpirun_line(nodes_driver, monkeypatch):
    driver, _ = nodes_driver
    monkeypatch.setenv("OMPI_MCA_foo", "1")
    monkeypatch.setenv("MY_SETTING", "x y")
    env, forward = driver._env()
    assert "MY_SETTING" in forward and "PATH" in forward
    assert not [n for n in forward if n.startswith(("OMPI_", "PMIX_", "SLURM_"))], forward
    assert env["TF_SMB_ELASTIC_ACROSS_NODES"] == driver._job
    argv = driver._argv(["a", "a", "b"], forward)
    assert argv[argv.index("-H") + 1] == "a:2,b:1" and argv[argv.index("-np") + 1] == "3"
    assert argv[argv.index("--map-by") + 1] == "slot"
    assert argv[-4:] == ["-m", "tf_smb.elastic.rank", "--", "train"]
    assert ["--mca", "btl", "tcp,self"] == argv[argv.index("--mca"):argv.index("--mca") + 3]


def test_launcher_refuses_mpi_args_outside_elastic_jobs(capsys):
    from tf_smb import run
    assert run.main(["-np", "2", "--mpi-args", "-x A", "true"]) == 2
    assert "--across-nodes and --mpi-args are for elastic jobs" in capsys.readouterr().err
    assert run.main(["-np", "1", "-H", "localhost:1", "--mpi-args", "'", "true"]) == 2
    assert "--mpi-args" in capsys.readouterr().err
