"""SMBStrategy(local_replicas=N): N replicas as threads of each process, one
parameter copy (SingleCaffe's design). N processes x M replicas with batch B
train like one process with batch N*M*B."""
import json
import os

import numpy as np
import pytest

from harness import WORKERS, max_diff, run_python, run_ranks, run_single

KERAS = os.path.join(WORKERS, "keras_worker.py")
GLOBAL = 24  # global batch: divisible by 1x2, 1x3, 2x2 (and 2x3) replicas


def _single(scenario):
    return run_single([KERAS, scenario, "--batch", str(GLOBAL)], timeout=300).check().json()


def _local(scenario, processes, replicas):
    env = {"TEST_LOCAL_REPLICAS": str(replicas)}
    batch = str(GLOBAL // (processes * replicas))
    if processes == 1:
        return [run_single([KERAS, scenario, "--batch", batch], timeout=300,
                           env=env).check().json()]
    return [r.check().json()
            for r in run_ranks([KERAS, scenario, "--batch", batch], processes, timeout=300,
                               env=env)]


@pytest.fixture(scope="module")
def fit_single():
    return _single("fit")


@pytest.mark.parametrize("processes,replicas", [(1, 2), (1, 3), (2, 2)])
def test_fit_evaluate_predict_equal_one_process(fit_single, processes, replicas):
    results = _local("fit", processes, replicas)
    for r in results:
        where = f"rank {r['rank']} of {processes} x {replicas} replicas"
        assert r["size"] == processes and r["replicas"] == processes * replicas, where
        assert max_diff(r["weights"], fit_single["weights"]) < 1e-5, where
        np.testing.assert_allclose(r["loss"], fit_single["loss"], rtol=1e-5, err_msg=where)
        for key in ("eval", "eval_numpy"):
            for metric in ("loss", "accuracy"):
                assert r[key][metric] == pytest.approx(fit_single[key][metric], abs=1e-5), (
                    f"{where}: {key} {metric}")
        for key in ("pred", "pred_numpy"):
            assert np.shape(r[key]) == (53, 3), f"{where}: {key}"
            np.testing.assert_allclose(r[key], fit_single[key], atol=1e-5, err_msg=where)
        # Each epoch's finished input iterator died on tf_smb's releaser thread.
        assert r["iterators_released"] >= 2, where
    if processes > 1:
        assert max_diff(results[0]["weights"], results[1]["weights"]) == 0.0


@pytest.mark.parametrize("processes,replicas", [(1, 3), (2, 2)])
def test_custom_loop_equal_one_process(processes, replicas):
    single = _single("custom")
    for r in _local("custom", processes, replicas):
        where = f"rank {r['rank']} of {processes} x {replicas} replicas"
        assert max_diff(r["weights"], single["weights"]) < 1e-5, where
        np.testing.assert_allclose(r["loss"], single["loss"], rtol=1e-5, err_msg=where)
        # strategy.run gives every replica its own batch; strategy.reduce counts them all.
        assert r["total"] == 53 and r["correct"] == single["correct"], where


def test_one_parameter_copy_per_process():
    """3 local replicas hold one copy of a 64 MiB layer: the process grows like
    a plain one, while MirroredStrategy on the same 3 devices grows by its 2
    extra copies (and per-replica gradients) more (the measurement sees copies)."""
    worker = os.path.join(WORKERS, "memory_worker.py")
    grown = {kind: run_single([worker, kind, str(n)], timeout=300).check().json()
             for kind, n in (("plain", 1), ("smb", 3), ("mirrored", 3))}
    copy = grown["plain"]["copy_mb"]
    assert copy == 64.0 and grown["smb"]["replicas"] == 3
    extra = {k: grown[k]["grown_mb"] - grown["plain"]["grown_mb"] for k in ("smb", "mirrored")}
    assert extra["smb"] < 0.5 * copy, f"SMB with 3 local replicas: {grown}"
    assert extra["mirrored"] > 1.5 * copy, f"MirroredStrategy reference: {grown}"


def test_replica_sum_op_every_dtype_and_bad_parts():
    out = run_python(
        "import json, numpy as np, tensorflow as tf\n"
        "from tf_smb import ops\n"
        "dtypes = [tf.float32, tf.float64, tf.float16, tf.bfloat16, tf.int32, tf.int64]\n"
        "ok = []\n"
        "for n in (2, 3):\n"
        "    parts = [[tf.cast(tf.range(37 * (d + 1)) % 11 + r, dt) for r in range(n)]\n"
        "             for d, dt in enumerate(dtypes)]\n"
        "    sums = ops.replica_sum(parts)\n"
        "    for ps, s in zip(parts, sums):\n"
        "        want = np.sum([p.numpy().astype(np.float64) for p in ps], axis=0)\n"
        "        ok.append(s.dtype == ps[0].dtype and bool(np.array_equal(\n"
        "            s.numpy().astype(np.float64), want)))\n"
        "try:\n"
        "    ops.replica_sum([[tf.zeros([3]), tf.zeros([4])]])\n"
        "    error = ''\n"
        "except tf.errors.InvalidArgumentError as e:\n"
        "    error = e.message\n"
        "print(json.dumps({'ok': ok, 'error': error}))\n")
    result = json.loads(out.strip().splitlines()[-1])
    assert result["ok"] == [True] * 12, result
    assert "replica 1 gave float[4]" in result["error"] and "like replica 0's" in result["error"], (
        result["error"])


@pytest.mark.parametrize("staleness", [0, 2])
def test_async_replica_threads_lose_no_update_within_the_staleness_bound(staleness):
    """3 replica threads push +1 2,000 times each through the parameter-server
    thread: all 6,000 arrive, and no step starts before the updates of the
    steps more than `staleness` behind it are applied."""
    worker = os.path.join(WORKERS, "local_async_worker.py")
    r = run_single([worker, "--steps", "2000", "--staleness", str(staleness)],
                   timeout=300).check().json()
    assert r["replicas"] == 3
    assert r["value"] == r["value_max"] == 6000.0 and r["applied"] == 6000, r
    assert r["min_lead"] >= 0, f"a step read fewer updates than staleness={staleness} allows: {r}"


def test_async_replica_threads_never_read_half_an_update():
    """Consistent reads of a 4 MB variable while the server thread keeps adding
    +1 to all of it: every read has all elements equal (copy-on-write)."""
    worker = os.path.join(WORKERS, "local_async_worker.py")
    r = run_single([worker, "--steps", "150", "--size", "1000000"], timeout=300).check().json()
    assert r["value"] == r["value_max"] == 450.0 and r["applied"] == 450, r
    assert r["spread"] == 0.0, f"a replica read a half-applied update: {r}"


def test_async_replica_threads_of_two_processes_lose_no_update_in_the_box():
    """2 processes x 2 replica threads push +1 1,000 times each; each process's
    server thread applies its replicas' pushes in the box: after
    finish_training both processes hold all 4,000. Apart from the other
    process, each is a replica group of its own: num_replicas_in_sync is 2."""
    worker = os.path.join(WORKERS, "local_async_worker.py")
    results = [r.check().json() for r in run_ranks(
        [worker, "--replicas", "2", "--steps", "1000", "--staleness", "2"], 2, timeout=300)]
    for r in results:
        assert r["replicas"] == 2, r
        assert r["value"] == r["value_max"] == 4000.0 and r["applied"] == 2000, (
            f"rank {r['rank']}: {r}")


def test_batch_norm_statistics_take_the_first_replicas_update():
    """Keras' BatchNormalization assigns its moving statistics inside each
    replica with no aggregation: the one copy takes replica 0's assignment,
    the value a MirroredStrategy model reports (its first copy)."""
    out = run_python(
        "import json, numpy as np\n"
        "import tf_smb\n"
        "strategy = tf_smb.SMBStrategy(local_replicas=2)\n"
        "import tensorflow as tf, keras\n"
        "x = np.concatenate([np.zeros((4, 3)), np.ones((4, 3)) * 10]).astype('float32')\n"
        "with strategy.scope():\n"
        "    model = keras.Sequential([keras.Input((3,)),\n"
        "                              keras.layers.BatchNormalization(momentum=0.0)])\n"
        "    model.compile(keras.optimizers.SGD(0.0), 'mse')\n"
        "model.fit(x, x, batch_size=8, epochs=1, shuffle=False, verbose=0)\n"
        "print(json.dumps({'moving_mean': model.layers[0].moving_mean.numpy().tolist()}))\n")
    # Replica 0's half of the batch is all zeros, replica 1's all tens.
    assert json.loads(out.strip().splitlines()[-1])["moving_mean"] == [0.0, 0.0, 0.0]
