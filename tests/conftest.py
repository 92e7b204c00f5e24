import os
import sys

# Tests import the package from the checkout and the harness beside them.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


import pytest  # noqa: E402

# The quick tier (`bash tools/test.sh --quick`, under 3 minutes), for the inner loop:
# the core and its ops, 2-worker equivalence, one Keras path, one async path, and
# the structure checks. A file alone takes all its tests.
QUICK = (
    "test_core.py",
    "test_env.py",
    "test_layers.py",
    "test_structure.py",
    "test_worker_mode.py",
    "test_strategy.py",
    "test_keras_optimizer.py::test_clipping_after_sum_equals_one_process_on_global_batch",
    "test_async.py::test_workers_end_with_the_boxs_final_values",
    "test_async.py::test_fit_counts_each_workers_own_batches_and_validates_on_all_data",
)


# The Keras-facing tests, which also run on every tested TensorFlow + Keras pair
# (`bash tools/test.sh --keras PAIR`, tools/keras_venv.sh): equivalence of fit,
# evaluate and predict, the Keras features tf_smb hooks, async and replica-thread fit,
# and the contracts with TensorFlow's and Keras' internals.
KERAS_FACING = (
    "test_keras_hooks.py",
    "test_tf_internals.py",
    "test_keras_callbacks.py",
    "test_keras_optimizer.py::test_clipping_after_sum_equals_one_process_on_global_batch",
    "test_keras_optimizer.py::test_loss_scaling_skips_the_same_step_on_every_rank",
    "test_strategy.py::test_fit_two_workers_equal_one_process_on_global_batch",
    "test_strategy.py::test_evaluate_covers_all_data",
    "test_strategy.py::test_predict_returns_every_row_in_order",
    "test_strategy.py::test_custom_loop_two_workers_equal_one_process",
    "test_ordering.py::test_independent_collectives_pair_correctly_20_rounds",
    "test_ordering.py::test_steps_per_execution_and_gradient_accumulation_equal_one_process",
    "test_async.py::test_workers_end_with_the_boxs_final_values",
    "test_async.py::test_fit_counts_each_workers_own_batches_and_validates_on_all_data",
    "test_async.py::test_a_worker_without_a_batch_finishes_fit",
    "test_local_replicas.py::test_fit_evaluate_predict_equal_one_process",
    "test_same_as_one_process.py::test_custom_train_step_and_default_shuffle_equal_one_process",
    "test_same_as_one_process.py::test_a_model_built_outside_the_scope_is_refused",
    "test_same_as_one_process.py::test_reduce_and_gather_combine_replicas_or_refuse_in_async_mode",
    "test_elastic_fit.py",
)


# The two tiers. `bash tools/test.sh` (the README's test command, what CI runs on
# every change) runs the fast tier; `bash tools/test.sh --full` runs both tiers and
# the Keras-facing tests on every other tested TensorFlow + Keras pair: the
# conformance proofs (Horovod's own tests and examples in full, every Keras pair,
# the longer node counts), run before an issue is called resolved.
FAST, FULL = "fast", "full"

# Every test file with its tier, longest first (its seconds in the fast tier, measured
# on 2 cores): tools/test.sh runs files on two pytest-xdist workers (--dist loadfile),
# which take them in this order, so the long ones do not end the run alone.
# tests/test_structure.py fails when a test file is missing here.
TIER_OF_FILE = {
    # Conformance proofs, whole files (the fast tier keeps a representative of each).
    "test_horovod_peer_3.py": FULL,  # Horovod's test_tensorflow.py at 3 processes
    # Slurm's daemons on simulated nodes, srun and sbatch+mpirun training (~2.5 min);
    # fast: the launchers' variables as the daemons set them (test_env.py).
    "test_slurm.py": FULL,
    # horovodrun (Horovod's launcher) starting SMBStrategy workers across nodes; fast:
    # horovodrun on one node (test_horovod.py) and its variables (test_env.py).
    "test_nodes_launchers.py": FULL,
    # HorovodStrategy's per-worker clipping equals MirroredStrategy's; fast: the same
    # equality for SMBStrategy (test_keras_optimizer.py, 2 workers).
    "test_horovod_clipping.py": FULL,
    # Bazel's build of the same sources from BUILD/WORKSPACE (Debian's offline Bazel);
    # fast: setup.py's and op_library's builds of them (test_install.py, every import).
    "test_bazel_build.py": FULL,
    # Horovod's three elastic examples, a worker killed and a host added (~4 min); fast:
    # Horovod's single-rank-failure scenario (test_elastic_horovod.py).
    "test_elastic_examples.py": FULL,
    # The epoch-time benchmark's smoke (~40 s); fast: the allreduce, async, replica-thread,
    # elastic and N-node smokes.
    "test_benchmark_epoch_time_smoke.py": FULL,
    # Files holding full-tier tests, the longest of --full, ahead of the rest.
    "test_nodes_layouts.py": FAST,
    "test_horovod_examples.py": FAST,
    "test_horovod_peer.py": FAST,
    "test_nodes_async.py": FAST,
    "test_nodes_collectives.py": FAST,
    "test_nodes.py": FAST,
    "test_benchmark_nodes_smoke.py": FAST,
    "test_sanitizers.py": FAST,
    "test_sockets.py": FAST,
    "test_keras_optimizer.py": FAST,
    "test_horovod.py": FAST,
    "test_strategy.py": FAST,
    "test_ordering.py": FAST,
    "test_local_replicas.py": FAST,
    "test_same_as_one_process.py": FAST,
    "test_install.py": FAST,
    "test_benchmark_suite_smoke.py": FAST,
    "test_examples.py": FAST,
    "test_mpi_link.py": FAST,
    "test_async.py": FAST,
    "test_horovod_api.py": FAST,
    "test_keras_callbacks.py": FAST,
    "test_core.py": FAST,
    "test_without_mpi.py": FAST,
    "test_timeline.py": FAST,
    "test_benchmark_async_smoke.py": FAST,
    "test_benchmark_local_replicas_smoke.py": FAST,
    "test_benchmark_smoke.py": FAST,
    "test_launcher.py": FAST,
    "test_async_params.py": FAST,
    "test_iterator_release.py": FAST,
    "test_structure.py": FAST,
    "test_layers.py": FAST,
    "test_keras_hooks.py": FAST,
    "test_tf_internals.py": FAST,
    "test_worker_mode.py": FAST,
    "test_env.py": FAST,
    "test_elastic.py": FAST,
    "test_elastic_horovod.py": FAST,
    "test_elastic_fit.py": FAST,
    "test_benchmark_elastic_smoke.py": FAST,
    "test_elastic_nodes.py": FAST,
}

# Tests of fast files that run in --full only, each a conformance proof whose family
# keeps a representative in the fast tier (named after the test, or after a
# parametrized case: "file::test[param]").
FULL_TESTS = (
    # Horovod's elastic scenarios through tf_smb.run (fast: a single rank failing, by
    # exception and by SIGKILL, with host discovery).
    "test_elastic_horovod.py::test_hosts_added_and_removed",
    "test_elastic_horovod.py::test_fault_tolerance_without_scaling",
    "test_elastic_horovod.py::test_all_ranks_failure",
    "test_elastic_horovod.py::test_all_hosts_blacklisted",
    "test_elastic_horovod.py::test_min_hosts_timeout",
    "test_elastic_horovod.py::test_reset_limit",
    "test_elastic_horovod.py::"
    "test_resurrecting_blacklisted_hosts_exponential_backoff",
    # Elastic across nodes: a node lost whole, then one removed (3 -> 2 -> 1), async
    # through a lost and an added node, and the elastic benchmark's smoke across 2 nodes
    # (fast: a worker killed and a node added, 4 -> 2 -> 3 across 3 nodes, sync; async
    # on one node, test_elastic_fit.py; the smoke on one node).
    "test_elastic_nodes.py::"
    "test_fit_across_nodes_through_a_node_lost_whole_and_one_removed_equals_one_process",
    "test_elastic_nodes.py::test_async_fit_across_nodes_through_a_lost_node_and_an_added_one",
    "test_benchmark_elastic_smoke.py::test_benchmark_elastic_smoke[nodes]",
    # Horovod's test_tensorflow.py whole (fast: one test per collective, the same file).
    "test_horovod_peer.py::test_horovods_tensorflow_tests_at_2_processes",
    # Horovod's three examples at 2 processes, all three across 2 nodes, keras_mnist on
    # 2+1 nodes ...
    "test_horovod_examples.py::test_horovod_example_at_2_processes[tensorflow2_keras_mnist.py]",
    "test_horovod_examples.py::test_horovod_example_at_2_processes[tensorflow2_mnist.py]",
    "test_horovod_examples.py::test_horovod_example_at_2_processes"
    "[tensorflow2_synthetic_benchmark.py]",
    "test_horovod_examples.py::test_horovod_example_across_nodes",
    "test_nodes_layouts.py::test_horovods_keras_mnist_example_across_the_nodes[2+1]",
    # ... and on 1+1+1 (fast: none of Horovod's examples; Horovod's own tests at 2
    # processes and tf_smb.horovod's API tests stand for them there).
    "test_nodes_layouts.py::test_horovods_keras_mnist_example_across_the_nodes[1+1+1]",
    # Per-worker clipping equal to MirroredStrategy's at 3 workers (fast: at 2).
    "test_keras_optimizer.py::test_per_worker_clipping_equals_mirrored_strategy[3]",
    # The benchmark suite side by side with Horovod and MWMS, and the straggler across
    # nodes (fast: the allreduce, async, epoch-time, replica-thread and N-node smokes).
    "test_benchmark_suite_smoke.py::test_benchmark_suite_smoke",
    "test_benchmark_nodes_smoke.py::test_benchmark_straggler_smoke",
    # The 2-node benchmark's smoke, every strategy side by side (fast: the N-node
    # scaling smoke, SMB on 3 x 1 with the bytes each node sent).
    "test_benchmark_nodes_smoke.py::test_benchmark_nodes_smoke",
    # The gather's bytes across 2 nodes against the zero-padded sum (fast: strategy.gather,
    # predict's rows and hvd.allgather equal to one process, test_same_as_one_process.py,
    # test_strategy.py and Horovod's own tests).
    "test_benchmark_nodes_smoke.py::test_benchmark_gather_bytes_smoke",
    # At 4 nodes: sync equality and the timeline, pushes, Horovod's API and process sets,
    # the async example; sync equality on 1+4 workers (fast: the same at 3 nodes, and
    # sync equality at 3+2+1 and 2+1).
    "test_nodes_layouts.py::test_fit_evaluate_predict_equal_one_process_with_every_ranks_timeline"
    "[1+1+1+1]",
    "test_nodes_layouts.py::test_fit_evaluate_predict_equal_one_process_with_every_ranks_timeline"
    "[1+4]",
    "test_nodes_layouts.py::test_pushes_to_segments_homed_on_every_node_lose_nothing[1+1+1+1]",
    "test_nodes_layouts.py::test_horovod_api_and_process_sets_spanning_the_nodes[1+1+1+1]",
    "test_nodes_layouts.py::test_keras_digits_async_reaches_090[1+1+1+1]",
    # The case that split a job in two, at once: a node dies as a survivor's MPI thread
    # sticks (fast: the same one after the other, test_nodes_layouts.py); the async
    # example on 3+2+1 (fast: on 1+1+1).
    "test_nodes_layouts.py::test_no_split_brain_when_a_node_dies_as_a_survivors_mpi_thread_sticks",
    "test_nodes_layouts.py::test_keras_digits_async_reaches_090[3+2+1]",
    # Sync equality at 3x2 (fast: 3+2+1, 2+1); the 3-node harness's smoke (fast: every
    # test_nodes_layouts.py test runs on it).
    "test_nodes_layouts.py::test_fit_evaluate_predict_equal_one_process_with_every_ranks_timeline"
    "[2+2+2]",
    # ... and at 3x1 (fast: 3+2+1 and 2+1, also 3 and 2 nodes).
    "test_nodes_layouts.py::test_fit_evaluate_predict_equal_one_process_with_every_ranks_timeline"
    "[1+1+1]",
    "test_nodes.py::test_smoke_three_uneven_nodes_on_one_bridge_each_reach_the_others",
    # At 2x2: the async example with delta pushes, and pushes to segments on both nodes
    # (fast: both at 3 nodes, on 1+1+1, 2+1, 1+2+2; the example's box SGD at 2x2).
    "test_nodes_async.py::test_keras_digits_async_across_nodes_reaches_090[delta]",
    "test_nodes_async.py::test_pushes_from_both_nodes_to_segments_on_both_nodes_lose_nothing",
    # The socket check across nodes catching a planted listener (fast: the same check on
    # one node, and across nodes finding only Open MPI's sockets).
    "test_sockets.py::test_across_nodes_check_sees_a_planted_listener",
    # The job-wide order of 20 rounds of collectives at 3 workers (fast: at 2, and at 2x2
    # across nodes).
    "test_ordering.py::test_independent_collectives_pair_correctly_20_rounds[3]",
    # A killed node ending a sync job under mpirun's default (fast: mpirun ending a job
    # whose node was killed, test_smoke_killed_ranks_of_a_node_end_mpirun, and sync
    # survivors failing naming the lost ranks, test_nodes_collectives.py).
    "test_nodes.py::test_killed_node_ends_the_job_promptly",
    # Sync equality at 2x1 and 2x3 (fast: 2x2 there, and 3+2+1, 2+1 in
    # test_nodes_layouts.py).
    "test_nodes.py::test_fit_2x1_equals_one_process_on_global_batch",
    "test_nodes.py::test_fit_2x3_equals_one_process_on_global_batch",
    # The survivors of a node killed at 2x2 while a survivor's MPI thread sticks (fast:
    # the same at 3 nodes, test_nodes_layouts.py, and the stalled node at 2x2).
    "test_nodes_async.py::test_survivors_finish_when_a_node_is_lost[killed]",
)


def _full_only(file: str, item) -> bool:
    return (TIER_OF_FILE.get(file) == FULL or f"{file}::{item.originalname}" in FULL_TESTS
            or f"{file}::{item.name}" in FULL_TESTS)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(TIER_OF_FILE)}
    # Without a marker expression (--full) the files with full-tier tests, the
    # longest there (Horovod's whole test files and examples), go first.
    holds_full = set() if config.getoption("markexpr") else {
        os.path.basename(str(item.fspath)) for item in items
        if _full_only(os.path.basename(str(item.fspath)), item)}
    items.sort(key=lambda item: (os.path.basename(str(item.fspath)) not in holds_full,
                                 rank.get(os.path.basename(str(item.fspath)), len(rank))))
    for item in items:
        file = os.path.basename(str(item.fspath))
        name = f"{file}::{item.originalname}"
        if file in QUICK or name in QUICK:
            item.add_marker(pytest.mark.quick)
        if file in KERAS_FACING or name in KERAS_FACING:
            item.add_marker(pytest.mark.keras)
        if _full_only(file, item):
            item.add_marker(pytest.mark.full)


@pytest.fixture(scope="module")
def nodes():
    """Two simulated nodes (tests/simnodes.py) shared by one test module's tests,
    torn down after them; skips only where the kernel refuses namespaces."""
    import simnodes
    sim = simnodes.open_or_skip()
    try:
        yield sim
    finally:
        sim.close()


# Seconds per test file (every phase of its tests, fixtures included), printed
# after the run: the files are what tools/test.sh spreads over its workers, so
# these totals show where the suite's time goes (--durations shows single tests).
_file_seconds: dict = {}


def pytest_runtest_logreport(report):
    # Under pytest-xdist the controller gets the workers' reports here too.
    file = report.nodeid.split("::", 1)[0]
    _file_seconds[file] = _file_seconds.get(file, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if len(_file_seconds) < 2:
        return
    terminalreporter.write_sep("=", "slowest 20 test files (seconds of their tests)")
    for file, seconds in sorted(_file_seconds.items(), key=lambda kv: -kv[1])[:20]:
        terminalreporter.write_line(f"{seconds:8.1f}s {file}")
    terminalreporter.write_line(f"{sum(_file_seconds.values()):8.1f}s in all "
                                f"({len(_file_seconds)} files)")
