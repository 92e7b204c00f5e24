"""tf_smb's benchmarks: SMB against Horovod, MultiWorkerMirroredStrategy and memcpy.

Run from the checkout's root (each has --help; --smoke is a quick run for CI):

    python -m benchmarks.suite --out_dir=bench_out       # everything, side by side
    python -m benchmarks.allreduce --out_dir=bench_out   # all-reduce: SMB, MWMS, memcpy
    python -m benchmarks.async_step --out_dir=bench_out  # sync vs async steps, accuracy
    python -m benchmarks.epoch_time                      # time between fit epochs
    python -m benchmarks.local_replicas                  # replica threads vs processes
    python -m benchmarks.nodes --out_dir=bench_nodes     # two simulated nodes (root)
    python -m benchmarks.nodes_scaling                   # N simulated nodes, SMB vs Horovod (root)
    python -m benchmarks.straggler                       # a slow node: async vs sync (root)
    python -m benchmarks.horovod_api                     # tf_smb.horovod vs SMB, Horovod

The measured records and how to rerun each: docs/benchmarks.md (across N nodes and the
cost model: docs/scaling.md).

Layout:
  suite.py, allreduce.py, async_step.py, epoch_time.py, local_replicas.py, nodes.py,
  nodes_scaling.py, straggler.py, horovod_api.py the drivers: flags, which jobs to run,
  tables;
  digits_curve.py  examples/keras_digits.py with rank 0's accuracy curve (async_step's
                 and straggler's time to accuracy; stragglers on request);
  roles/         what the workers run, one module per role (probe, allreduce,
                 async_steps, fit; memcpy runs in the driver);
  strategies.py  the compared strategies: launch mode, worker kinds, labels, colours,
                 availability;
  processes.py   worker environment, launch commands (tf_smb.run, mpirun, horovodrun,
                 MWMS's TF_CONFIG) and running them under tf_smb.supervisor;
  common.py      model shapes and tensor sets, result lines (RESULT_TAG + JSON);
  report.py      numbers, markdown, CSV, failures, plots;
  targets.py     the suite's goals, checked against the measurements.
"""
