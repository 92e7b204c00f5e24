"""The benchmarks' worker roles, one module each; a driver starts them as
`python -m benchmarks.roles.ROLE ...` (benchmarks.processes.role_argv) under a launcher,
and each prints its results as `benchmarks.common.RESULT_TAG` + JSON lines:

  * probe: versions, whether Horovod works (and with which controllers), the models'
    shapes (written once for the other workers);
  * allreduce: times a summing all-reduce of tensor sets with SMB, MWMS or Horovod;
  * async_steps: times SMB's per-step box operations (sync all-reduce, async
    read+push, async push+read, async read+sgd);
  * fit: model.fit throughput with a strategy;
  * memcpy: the floor, np.copyto of the same bytes (run inside the driver).
"""
