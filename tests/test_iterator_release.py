"""Finished input iterators die on the releaser thread (tf_smb/iterator_release.py),
and nothing anyone still refers to is dropped."""
import json
import threading
import time
import weakref

import numpy as np
import pytest
import tensorflow as tf

from harness import run_single
from tf_smb.iterator_release import (IteratorReleaser, tend_iterators,
                                      without_autotune_thread)


class Tracked:
    """Records the name of the thread its destructor ran on."""

    def __init__(self, deaths):
        self._deaths = deaths

    def __del__(self):
        self._deaths.append(threading.current_thread().name)


def wait_for(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_an_object_left_to_the_releaser_dies_on_its_thread():
    releaser, deaths = IteratorReleaser(poll_s=0.01), []
    obj = Tracked(deaths)
    releaser.hold(obj)
    assert releaser.holds(obj)
    del obj
    assert wait_for(lambda: deaths), "the releaser never dropped the object"
    assert deaths == [releaser.thread_name]
    assert releaser.released == 1


def test_an_object_still_referred_to_is_kept():
    releaser, deaths = IteratorReleaser(poll_s=0.01), []
    obj = Tracked(deaths)
    releaser.hold(obj)
    time.sleep(0.2)  # 20 polls
    assert releaser.holds(obj) and not deaths and releaser.released == 0
    del obj
    assert wait_for(lambda: deaths) and deaths == [releaser.thread_name]


def test_past_the_cap_the_oldest_is_let_go_to_its_owner():
    releaser, deaths = IteratorReleaser(max_held=2, poll_s=0.01), []
    objs = [Tracked(deaths) for _ in range(3)]
    for obj in objs:
        releaser.hold(obj)
    assert not releaser.holds(objs[0]) and releaser.holds(objs[1]) and releaser.holds(objs[2])
    first = objs.pop(0)
    del first  # the owner's reference was the last: it dies here, as without tf_smb
    assert deaths == [threading.current_thread().name]


def test_distributed_dataset_iterators_are_held_and_datasets_stay_tensorflows():
    # TensorFlow's distributed datasets, as tf_smb's strategies make them (their
    # wiring is checked by the fit tests of tests/test_strategy.py and
    # tests/test_local_replicas.py, which count the iterators released).
    from tf_smb import iterator_release

    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    ds = tf.data.Dataset.from_tensor_slices(np.arange(16.0, dtype=np.float32)).batch(4)
    for dist in (strategy.experimental_distribute_dataset(ds),
                 strategy.distribute_datasets_from_function(lambda ctx: ds)):
        dist = tend_iterators(dist)
        assert isinstance(dist, tf.distribute.DistributedDataset)
        it = iter(dist)
        assert iterator_release.RELEASER.holds(it)
        assert sum(float(tf.reduce_sum(batch)) for batch in it) == pytest.approx(120.0)
        gone = weakref.ref(it)
        del it
        assert wait_for(lambda: gone() is None), "the iterator was never released"


def test_anything_else_is_returned_unchanged():
    ds = tf.data.Dataset.range(3)
    assert tend_iterators(ds) is ds and type(ds) is type(tend_iterators(ds))


def test_owner_setting_leaves_destruction_to_the_owner(monkeypatch):
    from tf_smb import iterator_release

    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    ds = tf.data.Dataset.range(8).batch(4)
    monkeypatch.setenv("TF_SMB_ITERATOR_RELEASE", "owner")
    dist = tend_iterators(strategy.experimental_distribute_dataset(ds))
    assert isinstance(dist, tf.distribute.DistributedDataset)
    it = iter(dist)
    assert not iterator_release.RELEASER.holds(it)
    monkeypatch.setenv("TF_SMB_ITERATOR_RELEASE", "later")
    with pytest.raises(ValueError, match="TF_SMB_ITERATOR_RELEASE must be one of thread, owner"):
        tend_iterators(strategy.experimental_distribute_dataset(ds))


# Two logical CPUs need a fresh process: TensorFlow fixes its devices once.
MULTI_DEVICE_AUTOTUNE = """
import json
import tensorflow as tf
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)
from tf_smb.iterator_release import tend_iterators
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
ds = tf.data.Dataset.range(16).batch(4)

def device_autotune(dataset):
    multi_device = iter(dataset)._iterators[0]._iterator
    return [it._dataset.options().autotune.enabled for it in multi_device._device_iterators]

print(json.dumps({
    "tf_smb": device_autotune(tend_iterators(strategy.experimental_distribute_dataset(ds))),
    "tensorflow": device_autotune(strategy.experimental_distribute_dataset(ds))}))
"""


@pytest.mark.parametrize("release", ["thread", "owner"])
def test_multi_device_pipelines_do_not_autotune_only_under_tf_smb(release):
    # TensorFlow feeds each device from a pipeline of its own, with its own options.
    p = run_single(["-c", MULTI_DEVICE_AUTOTUNE], timeout=120,
                   env={"TF_SMB_ITERATOR_RELEASE": release})
    assert p.returncode == 0, p.stderr[-3000:]
    found = json.loads(p.stdout.strip().splitlines()[-1])
    assert found == {"tf_smb": [False, False], "tensorflow": [None, None]}, found


def test_shutdown_stops_the_thread_and_lets_go_here():
    releaser, deaths = IteratorReleaser(poll_s=0.01), []
    kept = Tracked(deaths)
    releaser.hold(kept)
    releaser.hold(Tracked(deaths))
    assert wait_for(lambda: deaths == [releaser.thread_name])
    assert releaser.running
    releaser.shutdown()
    assert not releaser.running and not releaser.holds(kept)
    del kept
    assert deaths == [releaser.thread_name, threading.current_thread().name]


def test_autotune_thread_is_turned_off_only_where_the_user_left_it_unset():
    ds = tf.data.Dataset.range(8).map(lambda x: x + 1, num_parallel_calls=tf.data.AUTOTUNE)
    assert ds.options().autotune.enabled is None
    off = without_autotune_thread(ds)
    assert off.options().autotune.enabled is False
    assert list(off.as_numpy_iterator()) == list(range(1, 9))
    for chosen in (True, False):
        options = tf.data.Options()
        options.autotune.enabled = chosen
        users = ds.with_options(options)
        assert without_autotune_thread(users) is users
    assert without_autotune_thread([1, 2]) == [1, 2]
