"""The worker modes (tf_smb/worker_mode.py) answer for sync and async what the
Extended classes used to decide with flag checks; here without a second worker
(the equivalence tests run them in real jobs)."""
import pytest
import tensorflow as tf

from tf_smb import phase
from tf_smb.async_mode import AsyncConfig
from tf_smb.env import JobInfo
from tf_smb.worker_mode import Independent, InStep

ONE = JobInfo(rank=0, size=1, job_id="t", box_created=False, launcher="test")
RANK_1_OF_3 = JobInfo(rank=1, size=3, job_id="t", box_created=False, launcher="test")


class FakeEngine:
    """What Independent asks of an AsyncEngine, recorded."""

    def __init__(self):
        self.placed, self.updated, self.finished = [], [], 0
        self.segments = {}

    def place(self, variable):
        self.placed.append(variable.name)
        self.segments[variable.ref()] = "segment"

    def segment_of(self, variable):
        return self.segments.get(variable.ref())

    def update(self, var, args, apply_locally, group):
        self.updated.append(var.name)
        return apply_locally()

    def start_step(self, args, kwargs):
        return ["clock", "read"]

    def run_step(self, fn, args, kwargs):
        return ("engine", fn(*args, **kwargs))

    def finish(self):
        self.finished += 1


def _batches(dataset):
    return [int(b) for b in dataset]


def test_in_step_combines_processes_and_reads_a_part_of_every_batch():
    mode = InStep()
    assert not mode.asynchronous and mode.engine is None and mode.segments == {}
    assert mode.combines_processes(RANK_1_OF_3) and not mode.processes_apart(RANK_1_OF_3)
    assert not mode.combines_processes(ONE) and not mode.processes_apart(ONE)
    data = tf.data.Dataset.range(7)
    assert mode.whole_batches(data, RANK_1_OF_3) is None  # rebatched by the Extended
    with phase.evaluating():
        assert mode.whole_batches(data, RANK_1_OF_3) is None  # evaluation reads its part too
    assert mode.training_batches(7, RANK_1_OF_3) == 7
    variable = tf.Variable(1.0)
    assert not mode.place(variable) and mode.start_step((), {}) == []
    assert mode.run_step(lambda x: x + 1, (1,), {}) == 2
    assert mode.update(variable, (), lambda: "applied", True) == "applied"
    with pytest.raises(AttributeError, match="mode='async'"):
        mode.require_engine("steps")


def test_independent_processes_read_every_nth_batch_whole_but_evaluate_on_all():
    engine = FakeEngine()
    mode = Independent(AsyncConfig(staleness=2), engine)
    assert mode.asynchronous and mode.config.staleness == 2 and mode.require_engine("x") is engine
    assert not mode.combines_processes(RANK_1_OF_3) and mode.processes_apart(RANK_1_OF_3)
    data = tf.data.Dataset.range(7)
    assert _batches(mode.whole_batches(data, RANK_1_OF_3)) == [1, 4]
    assert mode.training_batches(7, RANK_1_OF_3) == 2
    with phase.evaluating():
        assert _batches(mode.whole_batches(data, RANK_1_OF_3)) == list(range(7))


def test_independent_keeps_trainable_variables_in_the_box_and_updates_them_there():
    engine = FakeEngine()
    mode = Independent(AsyncConfig(), engine)
    weights, counter = tf.Variable(1.0, name="w"), tf.Variable(0, name="n", trainable=False)
    assert mode.keeps_in_box(True) and not mode.keeps_in_box(False)
    assert mode.place(weights) and not mode.place(counter)
    assert engine.placed == [weights.name] and mode.segments == engine.segments
    assert mode.update(weights, (), lambda: "w applied", True) == "w applied"
    assert mode.update(counter, (), lambda: "n applied", True) == "n applied"
    assert engine.updated == [weights.name]  # the box-held one only
    assert mode.start_step((), {}) == ["clock", "read"]
    assert mode.run_step(lambda: 3, (), {}) == ("engine", 3)
    mode.finish()
    assert engine.finished == 1


def test_independent_replica_threads_of_one_process_have_no_box():
    mode = Independent(AsyncConfig(update="sgd"))
    assert mode.asynchronous and mode.engine is None and mode.segments == {}
    assert not mode.place(tf.Variable(1.0)) and mode.start_step((), {}) == []
    assert mode.run_step(lambda: 3, (), {}) == 3
    mode.finish()  # nothing to wait for
