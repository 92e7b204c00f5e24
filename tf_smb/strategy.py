"""SMBStrategy: data-parallel training whose workers share parameters through
the Soft Memory Box instead of passing messages.

One replica per process (or `local_replicas` threads of one process sharing
one parameter copy: tf_smb/local_replicas.py). Variables created in the
strategy's scope start equal on every worker (broadcast from rank 0). mode="sync": gradients are summed
through the box in one fused collective per step, so N workers with batch B
train like one process with batch N*B. mode="async": trainable variables live
in the box; workers read them every step and push updates without waiting.

The machinery is shared with the reference HorovodStrategy
(tf_smb/horovod_strategy.py) and lives in tf_smb/data_parallel.py; what is
SMB's own: the box's collectives (tf_smb/collectives.py) and the asynchronous
mode (tf_smb/async_mode.py).
"""
from __future__ import annotations

from typing import Literal, Optional

from tf_smb import env as env_lib
from tf_smb.keras_support import elastic as elastic_lib
from tf_smb import keras_support
from tf_smb import local_replicas as local_replicas_lib
from tf_smb import ops as smb_ops
from tf_smb.async_mode import AsyncEngine, take_segment_name
from tf_smb.options import AsyncConfig, StrategyOptions
from tf_smb.replica_layout import OneReplica, ReplicaLayout
from tf_smb.collectives import SMBCollectives
# DataParallelStrategy and GradientClipping stay importable from here too.
from tf_smb.data_parallel import (DataParallelExtended, DataParallelStrategy,
                                  GradientClipping)
from tf_smb.worker_mode import Independent, InStep, WorkerMode

__all__ = ["SMBStrategy", "DataParallelStrategy", "GradientClipping", "Mode", "Update",
           "Consistency"]

Mode = Literal["sync", "async"]
Update = Literal["delta", "sgd"]
ReadAt = Literal["start", "push"]
Consistency = Literal["consistent", "hogwild"]


def _async_engine(job: env_lib.JobInfo, config: AsyncConfig,
                  collectives: SMBCollectives) -> Optional[AsyncEngine]:
    """The box's engine of an async job; None for one worker, which has no one
    to wait for or share with."""
    return AsyncEngine(job, config, collectives) if job.size > 1 else None


class SMBStrategy(DataParallelStrategy):
    """Data parallelism through the Soft Memory Box, synchronous or not.

    Swap it in for any tf.distribute strategy and launch N processes:

        strategy = tf_smb.SMBStrategy()
        with strategy.scope():
            model = build_and_compile_model()
        model.fit(dataset, epochs=3)   # dataset batched with the GLOBAL batch

        $ python -m tf_smb.run -np 2 python train.py

    Rank and size come from tf_smb.run, horovodrun, mpirun (Open MPI) or Slurm;
    without a launcher the process is a single worker.

    mode="sync": gradients are summed through the box every step; N workers
    with batch B train like one process with batch N*B. `model.fit` shards the
    data per worker; `evaluate` reports metrics over all workers' data and
    `predict` returns every row, on every worker; rank 0 writes checkpoints.

    mode="async": the master copy of every trainable variable lives in the box.
    Every step a worker computes gradients on its own shard (every size-th
    batch) from the box's values and pushes its update without waiting for
    the others; the box applies updates atomically per stripe, so none is
    lost. A step reads at its start (after the clock's wait) and pushes in
    one op at its end; with read_at="push", the next step's read is done in
    the same pass as the push. `evaluate`/`predict` run on each worker over all the data with the
    box's current values. When `fit` returns, every worker has waited for the
    others (live ones) to finish and holds the box's final values. A worker
    that dies does not stop the others.

    Args:
      mode: "sync" or "async".
      staleness: async only. A worker may be at most this many steps ahead of
        the slowest live worker (stale-synchronous parallel); None: no bound;
        0: lockstep, like synchronous training.
      update: async only. "delta": the worker's own Keras optimizer (Adam,
        AdamW, RMSprop, ...) turns its gradient into a change of the variable,
        which is accumulated into the box. "sgd": the box applies
        `w -= lr * grad` itself (with `momentum`, `v = m*v - lr*grad; w += v`),
        lr being the optimizer's current learning rate; use a Keras 3
        optimizer such as keras.optimizers.SGD (a variable update that brings
        a gradient without a learning rate, as tf_keras/Keras 2 optimizers
        make, raises ValueError). Keras' weight decay and EMA overwrite are
        applied by the worker and accumulated into the box as with "delta".
      momentum: with update="sgd" (ValueError with "delta": give the Keras
        optimizer its momentum instead).
      consistency: async only. "consistent" reads never return a half-written
        stripe (256 KiB, seqlock per stripe: a larger variable may combine
        stripes from before and after a concurrent push); "hogwild" reads skip
        that check: faster under heavy pushing, but a read may mix two updates
        anywhere.
      timeout_s: how long any wait for other workers lasts before failing
        with an error naming them (default $TF_SMB_TIMEOUT or 600).
      staging_bytes: staging memory per worker when this process creates the
        box; larger tensors move in chunks of this size.
      job: where this process sits; detected from the launcher when None.
      gradient_clipping: where Keras optimizers created in this scope clip
        (`clipnorm`, `clipvalue`, `global_clipnorm`). "after_sum" (default):
        the gradient summed over workers is clipped, so N workers with batch B
        clip like one process with batch N*B. "per_worker": each worker clips
        its own part before the sum, as Keras does under
        tf.distribute.MirroredStrategy (and MultiWorkerMirroredStrategy). In
        async mode there is no sum: each worker clips its own gradient.
      local_replicas: replicas in each process, as threads on their own
        logical CPU devices sharing one copy of the parameters (SingleCaffe's
        design, tf_smb/local_replicas.py); `num_replicas_in_sync` is
        local_replicas x processes. Asynchronously, with update="sgd", a
        parameter-server thread applies the replicas' steps (to the box with
        several processes). Create the strategy before other TensorFlow
        work: TensorFlow fixes its devices at its first op.
      read_at: async only. "start" (default): a training step reads the box
        at its start, and pushes its updates in one op at its end. "push":
        that op also reads the box back into the variables, stripe by stripe
        right after each push (one pass over the parameters instead of two:
        ResNet-50's step communication 37 -> 30 ms, VGG-16's 152 -> 117 ms at
        2 workers), and the next step starts from those values. The values a
        step computes on are then older by the time between steps: on a job
        whose steps are short against Keras' own time between them
        (keras_digits) it needed about twice the batches to reach 0.95.
        Needs staleness=None and local_replicas=1.
      elastic: Keras `fit` goes on through changes of the job's members
        under tf_smb's elastic launcher (`tf_smb.run --min-np A --max-np B
        --host-discovery-script S ...`): a worker lost (the others go back to
        the last commit), a host removed or added (at the next commit); the
        global batch stays the one the data has, split over the members of the
        moment, so the job trains as one process on the same batches would
        (docs/elastic.md). With mode="async" (one node) the box keeps the
        parameters through a change: no rollback. local_replicas=1 only.
        Outside an elastic launch it changes nothing.
      commit_steps: elastic only: `fit` commits (in memory) every this many
        batches, and at each epoch's end; a lost worker costs the batches since.

    In async mode every worker must create the same trainable variables in
    the same order; each gets a box segment named after its path, and a
    worker whose variable differs from the others' (name, dtype or shape)
    makes every worker raise ValueError at its creation.

    Custom training loops: in async mode `strategy.reduce` and
    `strategy.gather` raise ValueError (workers are not in step); use each
    worker's own values.
    """

    def __init__(self, mode: Mode = "sync", staleness: Optional[int] = None,
                 update: Update = "delta", momentum: float = 0.0,
                 consistency: Consistency = "consistent", timeout_s: Optional[float] = None,
                 staging_bytes: Optional[int] = None,
                 job: Optional[env_lib.JobInfo] = None,
                 gradient_clipping: GradientClipping = "after_sum",
                 local_replicas: int = 1, read_at: ReadAt = "start",
                 elastic: bool = False,
                 commit_steps: int = elastic_lib.DEFAULT_COMMIT_STEPS) -> None:
        # Every option is checked here, once (tf_smb/options.py).
        options = StrategyOptions(mode=mode, staleness=staleness, update=update,
                                  momentum=momentum, consistency=consistency,
                                  gradient_clipping=gradient_clipping,
                                  local_replicas=local_replicas, read_at=read_at)
        config = options.async_config()
        # Before the job starts: a Keras without a hook target stops here, saying why.
        keras_support.check_hooks()
        if local_replicas != 1:
            # Before anything else runs an op: TensorFlow fixes its devices then.
            devices = local_replicas_lib.logical_cpu_devices(local_replicas)
        worker = elastic_lib.elastic_worker(elastic, mode, local_replicas, commit_steps)
        job = job or env_lib.detect()
        if job.size > 1 or worker is not None:
            job = smb_ops.init(job, timeout_s=timeout_s, staging_bytes=staging_bytes)
        self._mode = mode
        collectives = SMBCollectives()
        worker_mode: WorkerMode = InStep()
        if mode == "async":
            keras_support.install_async_hooks()
            # One worker trains in step with itself, unless its replica threads
            # update apart.
            engine = _async_engine(job, config, collectives)
            if engine is not None or local_replicas != 1 or worker is not None:
                # Elastic: a generation of one worker too (a later one may have more).
                worker_mode = Independent(config, engine, segment_name_of=(
                    take_segment_name if worker is not None else None))
        layout: ReplicaLayout = OneReplica()
        if local_replicas != 1:
            layout = local_replicas_lib.ReplicaThreads(
                devices, timeout_s if timeout_s is not None else smb_ops.DEFAULT_TIMEOUT_S)
        extended = DataParallelExtended(self, job, collectives, layout=layout, mode=worker_mode)
        keras_support.install_strategy_hooks(job, elastic=worker is not None)
        self._setup(job, extended, gradient_clipping)
        if worker is not None:
            self._make_elastic(worker, elastic_lib.ElasticFit(self, worker, commit_steps))
        if worker_mode.engine is not None:
            keras_support.note_async_strategy(self)  # for layers' set_weights

    @property
    def mode(self) -> Mode:
        """"sync" or "async"."""
        return self._mode

    def rejoined(self, job: env_lib.JobInfo) -> None:
        """As DataParallelStrategy.rejoined; in async mode also a new engine for
        the new generation's box (none for one worker), which holds the
        variables once `place_box_variables` ran."""
        super().rejoined(job)
        mode = self.extended.worker_mode
        if isinstance(mode, Independent):
            engine = _async_engine(job, mode.config, self.extended.collectives)
            self.extended._mode = Independent(  # pylint: disable=protected-access
                mode.config, engine, segment_name_of=mode.segment_name_of, noted=mode.noted)
            if engine is not None:
                keras_support.note_async_strategy(self)

    def place_box_variables(self) -> int:
        """Elastic async mode: this generation's box takes the trainable
        variables it does not hold yet, from rank 0's values (a collective: every
        member calls it at the start of each try of `fit`); how many."""
        mode = self.extended.worker_mode
        return mode.place_noted() if isinstance(mode, Independent) else 0

    def finish_training(self) -> None:
        """Async mode: this worker is done; wait for the other live workers,
        then load the box's final values. `model.fit` calls it on return;
        call it yourself at the end of a custom training loop."""
        self.extended.finish()  # replica threads: the server thread's updates first
