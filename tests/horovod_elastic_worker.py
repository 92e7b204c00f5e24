"""One worker of Horovod's elastic test scripts (or examples), run against
tf_smb.horovod: `python tests/horovod_elastic_worker.py SCRIPT [ARGS...]`.

The script runs unmodified; `import horovod.tensorflow as hvd` (and its keras
module) is tf_smb.horovod, mapped at run time as in tests/horovod_peer_worker.py:
the one-line swap a Horovod user makes. What Keras 3 itself rejects in the
script is adapted at run time too (`keras3_adaptations`).
"""
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import horovod_peer_worker  # noqa: E402


def keras3_adaptations() -> None:
    """Keras 3 optimizers have no `lr`, Keras 2's name of `learning_rate` (the
    scripts' reset callbacks assign it): given back as that alias."""
    import keras
    if not hasattr(keras.optimizers.Optimizer, "lr"):
        keras.optimizers.Optimizer.lr = property(lambda self: self.learning_rate)


def main() -> None:
    horovod_peer_worker.shim_test_helpers()
    horovod_peer_worker.alias_horovod()
    keras3_adaptations()
    script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
