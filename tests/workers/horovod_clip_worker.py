"""keras_optimizer_worker.py under HorovodStrategy(gradient_clipping=...).

keras_optimizer_worker.py gives its --gradient_clipping to SMBStrategy only;
this runs its scenarios with tf_smb.HorovodStrategy taking that option too.
Launch with mpirun or horovodrun; arguments as for keras_optimizer_worker.py
(--strategy horovod).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tf_smb  # noqa: E402

import keras_optimizer_worker  # noqa: E402


def main():
    argv = sys.argv[1:]
    clipping = (argv[argv.index("--gradient_clipping") + 1]
                if "--gradient_clipping" in argv else "after_sum")
    horovod_strategy = tf_smb.HorovodStrategy
    tf_smb.HorovodStrategy = lambda: horovod_strategy(gradient_clipping=clipping)
    return keras_optimizer_worker.main()


if __name__ == "__main__":
    sys.exit(main())
