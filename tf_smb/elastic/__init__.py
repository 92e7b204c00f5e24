"""Elastic training: a job whose workers come and go while it runs (docs/elastic.md).

  * protocol.py: what the launcher and its workers tell each other, through files
    in a private directory: the generations and the host updates;
  * driver.py: the launcher's side (`tf_smb.run --min-np/--max-np/...`): hosts,
    blacklist, workers, generations; imports no TensorFlow;
  * worker.py: a worker's side: joining the next generation in the same process
    (`tf_smb.ops.rejoin`) and hearing of host updates;
  * across nodes (each generation one mpirun): nodes_driver.py (the launcher's
    side), rank.py (each rank's wrapper: events to the launcher on stdout, host
    updates from mpirun-forwarded signals) and commit_box.py (a node's last
    commit in its shared memory, where the next generation resumes from).

Horovod's elastic API (`tf_smb.horovod.elastic`) is built on worker.py.
"""
