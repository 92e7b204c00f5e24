"""Elastic training: a job whose workers come and go while it runs (docs/elastic.md).

  * protocol.py: what the launcher and its workers tell each other, through files
    in a private directory: the generations and the host updates;
  * driver.py: the launcher's side (`tf_smb.run --min-np/--max-np/...`): hosts,
    blacklist, workers, generations; imports no TensorFlow;
  * worker.py: a worker's side: joining the next generation in the same process
    (`tf_smb.ops.rejoin`) and hearing of host updates.

Horovod's elastic API (`tf_smb.horovod.elastic`) is built on worker.py.
"""
