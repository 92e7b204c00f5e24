"""The TensorFlow and Keras internals tf_smb/data_parallel.py,
tf_smb/replica_layout.py and tf_smb/local_replicas.py build on (measured with
TF 2.16-2.21 / Keras 3.3-3.16). A newer TensorFlow or Keras that moves one
fails here, naming what to change, instead of in a multi-worker run.

DataParallelStrategy subclasses tf.distribute.MultiWorkerMirroredStrategy
(only so that Keras takes its multi-worker path for `predict` and logs) and
skips that class's `__init__`; its one extended class subclasses TF's
StrategyExtendedV1 and implements what a strategy's extended class provides.
"""
import inspect

import pytest

tf = pytest.importorskip("tensorflow")

from tensorflow.python.distribute import distribute_lib  # noqa: E402
from tensorflow.python.distribute import distribute_utils  # noqa: E402
from tensorflow.python.distribute import input_util  # noqa: E402
from tensorflow.python.distribute import input_lib  # noqa: E402
from tensorflow.python.distribute import values as values_lib  # noqa: E402
from tensorflow.python.ops import control_flow_util  # noqa: E402

HOME = "tf_smb/data_parallel.py"

# What MultiWorkerMirroredStrategy defines itself (TF 2.21). DataParallelStrategy
# skips its __init__, so any other method could need state that __init__ sets.
MWMS_OWN = {"__doc__", "__init__", "__module__", "_collective_key_base",
            "_from_local_devices", "_tf_api_names", "_tf_api_names_v1", "cluster_resolver"}
# What Python itself records in a class (newer Pythons add some).
PYTHON_RECORDS = {"__qualname__", "__firstlineno__", "__static_attributes__", "__dict__",
                  "__weakref__"}
# Of those, what DataParallelStrategy overrides (the rest is harmless: a class
# constant, a classmethod building a new MWMS, API-name records).
OVERRIDDEN = {"cluster_resolver"}

# StrategyExtendedV1 members DataParallelExtended overrides (TensorFlow calls
# them) or calls.
EXTENDED_USED = (
    "_create_variable", "_experimental_distribute_dataset",
    "_update", "_update_non_slot", "_call_for_each_replica", "_local_results", "_reduce_to",
    "_batch_reduce_to", "_gather_to_implementation", "_distribute_datasets_from_function",
    "_experimental_distribute_values_from_function", "_in_multi_worker_mode",
    "should_checkpoint",
    "should_save_summary", "experimental_should_init", "_num_replicas_in_sync",
    "worker_devices", "parameter_devices", "non_slot_devices", "value_container", "read_var",
    "_broadcast_to", "_validate_colocate_with_variable", "experimental_between_graph",
    "_use_merge_call", "call_for_each_replica", "update", "_container_strategy")
# What TensorFlow calls on an extended class without the base defining it: the
# module of tensorflow/python/distribute that calls it.
EXTENDED_CALLED = {
    "_input_workers_with_options": "input_lib", "_get_local_replica_id": "distribute_lib",
    "_get_replica_id_in_sync_group": "mirrored_run"}


def _params(fn):
    return list(inspect.signature(fn).parameters)


def test_multi_worker_mirrored_strategy_defines_only_what_we_know():
    mwms = tf.distribute.MultiWorkerMirroredStrategy
    assert issubclass(mwms, tf.distribute.Strategy), (
        "tf.distribute.MultiWorkerMirroredStrategy is no longer a tf.distribute.Strategy: "
        f"DataParallelStrategy ({HOME}) must subclass tf.distribute.Strategy instead and "
        "Keras' multi-worker predict/logs path must be reached another way")
    new = sorted(set(vars(mwms)) - MWMS_OWN - PYTHON_RECORDS)
    assert not new, (
        f"MultiWorkerMirroredStrategy now defines {new}. DataParallelStrategy ({HOME}) "
        "skips its __init__: check whether these need state that __init__ sets, "
        "override them in DataParallelStrategy if so, then add them to MWMS_OWN here")
    from tf_smb.data_parallel import DataParallelStrategy
    for name in OVERRIDDEN:
        assert name in vars(DataParallelStrategy), name


def test_strategy_init_takes_only_the_extended():
    assert _params(tf.distribute.Strategy.__init__) == ["self", "extended"], (
        "tf.distribute.Strategy.__init__ changed: DataParallelStrategy._setup "
        f"({HOME}) calls it as Strategy.__init__(self, extended)")


def test_keras_takes_the_multi_worker_path_for_our_strategy():
    from keras.src.backend.tensorflow import trainer
    import tf_smb
    from tf_smb import env
    check = getattr(trainer, "_collective_all_reduce_multi_worker", None)
    assert check is not None, (
        "Keras no longer has trainer._collective_all_reduce_multi_worker: find how it now "
        "decides to gather predict rows from all workers, and make DataParallelStrategy "
        f"({HOME}) pass that test (the MultiWorkerMirroredStrategy base may be unneeded)")
    strategy = tf_smb.SMBStrategy(job=env.JobInfo(rank=0, size=1, job_id="internals",
                                                  box_created=False, launcher="test"))
    assert check(strategy) is False  # one worker: nothing to gather
    strategy.extended._in_multi_worker_mode = lambda: True  # as with 2+ sync workers
    assert check(strategy) is True, (
        "Keras' multi-worker test no longer accepts a MultiWorkerMirroredStrategy "
        "subclass whose extended._in_multi_worker_mode() is True: see what it checks "
        f"now and adapt DataParallelStrategy ({HOME})")


def test_strategy_extended_has_what_we_override_and_call():
    base = distribute_lib.StrategyExtendedV1
    assert _params(base.__init__) == ["self", "container_strategy"], (
        f"StrategyExtendedV1.__init__ changed: DataParallelExtended ({HOME}) calls "
        "super().__init__(container_strategy)")
    missing = [name for name in EXTENDED_USED if not hasattr(base, name)]
    assert not missing, (
        f"StrategyExtendedV1 lacks {missing}: DataParallelExtended ({HOME}) overrides or "
        "calls them; find where TensorFlow moved them and follow")
    import importlib
    for name, module in EXTENDED_CALLED.items():
        source = inspect.getsource(importlib.import_module(
            f"tensorflow.python.distribute.{module}"))
        assert f"extended.{name}(" in source, (
            f"tensorflow/python/distribute/{module}.py no longer calls extended.{name}: "
            f"DataParallelExtended ({HOME}) provides it; find what TensorFlow calls now")
    assert _params(input_lib.InputWorkers.__init__)[:2] == ["self", "worker_device_pairs"], (
        f"input_lib.InputWorkers changed: DataParallelExtended._input_workers_with_options "
        f"({HOME}) builds one from (host, devices) pairs")
    assert callable(distribute_utils.validate_colocate) and callable(
        distribute_lib.UpdateContext), "validate_colocate or UpdateContext is gone"


def test_input_pipeline_functions_take_our_arguments():
    dataset = _params(input_util.get_distributed_dataset)
    assert dataset[:3] == ["dataset", "input_workers", "strategy"] and {
        "num_replicas_in_sync", "input_context", "options"} <= set(dataset), (
        f"input_util.get_distributed_dataset changed to {dataset}: "
        f"DataParallelExtended._experimental_distribute_dataset ({HOME}) must follow")
    from_fn = _params(input_util.get_distributed_datasets_from_function)
    assert from_fn[:4] == ["dataset_fn", "input_workers", "input_contexts", "strategy"] and (
        "options" in from_fn), (
        f"input_util.get_distributed_datasets_from_function changed to {from_fn}: "
        f"DataParallelExtended._distribute_datasets_from_function ({HOME}) must follow")
    assert {"num_input_pipelines", "input_pipeline_id", "num_replicas_in_sync"} <= set(
        _params(distribute_lib.InputContext.__init__)), "InputContext's arguments changed"
    assert _params(distribute_lib.ValueContext.__init__)[1:3] == [
        "replica_id_in_sync_group", "num_replicas_in_sync"], "ValueContext's arguments changed"


def test_distributed_datasets_are_the_classes_the_releaser_knows():
    # tf_smb/iterator_release.py swaps these exact classes for subclasses whose
    # __iter__ hands the iterator to the releaser thread; any other class is left
    # alone, so a renamed class would silently bring back the per-epoch stall.
    from tensorflow.python.distribute import input_lib

    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    made = {type(strategy.experimental_distribute_dataset(tf.data.Dataset.range(4).batch(2))),
            type(strategy.distribute_datasets_from_function(
                lambda ctx: tf.data.Dataset.range(4).batch(2)))}
    assert made == {input_lib.DistributedDataset, input_lib.DistributedDatasetsFromFunction}, (
        f"input_util now makes {made}: update tf_smb/iterator_release.py")
    for cls in made:
        assert "__iter__" in vars(cls), f"{cls.__name__} no longer defines __iter__"


def test_multi_device_iterators_build_device_pipelines_through_the_wrapped_function():
    # tf_smb/iterator_release.py wraps multi_device_iterator_ops._create_device_dataset
    # so that a MultiDeviceIterator's per-device pipelines do not autotune (their
    # destruction waited up to the autotuner's period); if TensorFlow stops
    # calling it by that name, the wrapper is silently bypassed.
    import inspect

    from tensorflow.python.data.ops import multi_device_iterator_ops as mdi
    from tf_smb import iterator_release

    assert mdi._create_device_dataset is iterator_release._create_quiet_device_dataset
    assert _params(iterator_release._create_device_dataset)[:2] == ["prototype_ds", "incarnation_id"]
    for cls in (mdi.MultiDeviceIterator, mdi.OwnedMultiDeviceIterator):
        assert "_create_device_dataset(" in inspect.getsource(cls), cls.__name__


def test_values_and_contexts_we_build():
    assert _params(values_lib.SyncOnReadVariable.__init__)[:4] == [
        "self", "strategy", "values", "aggregation"], (
        "values.SyncOnReadVariable(strategy, values, aggregation) changed: "
        f"DataParallelExtended._create_variable ({HOME}) wraps metric variables with it")
    assert _params(distribute_lib.ReplicaContext.__init__)[:3] == [
        "self", "strategy", "replica_id_in_sync_group"], (
        f"distribute_lib.ReplicaContext changed: _WorkerReplicaContext ({HOME}) subclasses it")
    assert issubclass(values_lib.PerReplica, values_lib.DistributedValues)
    assert _params(distribute_utils.select_replica) == ["replica_id", "structured"], (
        f"distribute_utils.select_replica changed: _call_for_each_replica ({HOME}) uses it")
    assert callable(control_flow_util.GraphOrParentsInXlaContext), (
        f"control_flow_util.GraphOrParentsInXlaContext is gone: check_not_in_xla ({HOME})")


def test_a_one_worker_strategy_works_without_the_skipped_init():
    """What MultiWorkerMirroredStrategy.__init__ would have set is not needed."""
    import tf_smb
    from tf_smb import env
    strategy = tf_smb.SMBStrategy(job=env.JobInfo(rank=0, size=1, job_id="internals",
                                                  box_created=False, launcher="test"))
    assert strategy.num_replicas_in_sync == 1 and strategy.cluster_resolver is None
    with strategy.scope():
        v = tf.Variable(1.0)
    got = strategy.run(lambda: v.assign_add(1.0) * 2.0)
    assert float(strategy.reduce(tf.distribute.ReduceOp.SUM, got, axis=None)) == 4.0
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.range(4).batch(2))
    assert [int(tf.reduce_sum(b)) for b in dataset] == [1, 5]


LOCAL_HOME = "tf_smb/local_replicas.py"


def test_local_replicas_internals():
    from tensorflow.python.distribute import mirrored_run  # noqa: E402
    from tensorflow.python.distribute import ps_values  # noqa: E402
    assert _params(mirrored_run.call_for_each_replica)[:4] == [
        "strategy", "fn", "args", "kwargs"], (
        f"mirrored_run.call_for_each_replica changed: ReplicaThreads ({LOCAL_HOME}) "
        "runs the replicas' threads with it")
    assert _params(ps_values.AggregatingVariable.__init__)[:4] == [
        "self", "strategy", "v", "aggregation"], (
        f"ps_values.AggregatingVariable(strategy, v, aggregation) changed: "
        f"ReplicaThreads.create_variable ({LOCAL_HOME}) wraps the one copy with it")
    assert hasattr(ps_values.AggregatingVariable, "get"), (
        f"ps_values.AggregatingVariable.get is gone: ReplicaThreads ({LOCAL_HOME}) "
        "unwraps variables with it")
    # The one copy points back to its wrapper (DataParallelExtended.value_container),
    # and a mirrored value's first replica is its _primary (ReplicaThreads.apply_update).
    strategy = tf.distribute.get_strategy()
    inner = tf.Variable(1.0)
    wrapped = ps_values.AggregatingVariable(strategy, inner, tf.VariableAggregation.SUM)
    assert inner._aggregating_container() is wrapped, (
        f"AggregatingVariable no longer sets _aggregating_container: {HOME} value_container")
    mirrored = values_lib.Mirrored((tf.constant(1.0), tf.constant(2.0)))
    assert float(mirrored._primary) == 1.0, f"Mirrored._primary changed: {LOCAL_HOME}"
    # Keras' own attributes that tf_smb hooks: tests/test_keras_hooks.py.
