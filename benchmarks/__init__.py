"""tf_smb's benchmarks: SMB against Horovod, MultiWorkerMirroredStrategy and memcpy.

Run from the checkout's root (each has --help; --smoke is a quick run for CI):

    python -m benchmarks.suite --out_dir=bench_out       # everything, side by side
    python -m benchmarks.allreduce --out_dir=bench_out   # all-reduce: SMB, MWMS, memcpy
    python -m benchmarks.async_step --out_dir=bench_out  # sync vs async steps, accuracy

Layout:
  suite.py, allreduce.py, async_step.py  the drivers: flags, which jobs to run, tables;
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
