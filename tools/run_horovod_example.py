"""Runs one of Horovod 0.28.1's TensorFlow 2 examples on tf_smb.horovod.

    python tools/run_horovod_example.py EXAMPLE.py [-np N] [-- EXAMPLE ARGS...]

The example (from ../shared/peer/horovod-0.28.1/examples/tensorflow2/) is copied
with only these changes, each printed before the run:
  * the import lines: `horovod.tensorflow` -> `tf_smb.horovod` (what a user
    changes); `import horovod` (used only by the horovod.run branch) dropped;
  * Keras 3: `experimental_run_tf_function=False` dropped (compile rejects it)
    and `opt.variables()` -> `opt.variables` (a list in Keras 3);
  * data: MNIST cannot be downloaded here, so `tf.keras.datasets.mnist.load_data(...)`
    reads scikit-learn's 1,797 handwritten 8x8 digits (shipped with it), scaled to
    28x28 and 0..255 like MNIST, 80% for training.
Then it runs under `python -m tf_smb.run -np N`.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(os.path.dirname(REPO), "shared", "peer", "horovod-0.28.1",
                        "examples", "tensorflow2")

LOCAL_MNIST = '''
def _local_mnist(path=None):
    """sklearn's digits as MNIST-shaped arrays (tools/run_horovod_example.py)."""
    import numpy as _np
    from sklearn.datasets import load_digits as _load_digits
    d = _load_digits()
    images = _np.kron(d.images, _np.ones((4, 4)))[:, 2:30, 2:30]  # 8x8 -> 32x32 -> 28x28
    images = (images * (255.0 / 16.0)).astype(_np.uint8)
    labels = d.target.astype(_np.uint8)
    cut = int(0.8 * len(images))
    return (images[:cut], labels[:cut]), (images[cut:], labels[cut:])
'''

CHANGES = [
    (r"import horovod\.tensorflow\.keras as hvd", "import tf_smb.horovod.keras as hvd"),
    (r"import horovod\.tensorflow as hvd", "import tf_smb.horovod as hvd"),
    (r"^import horovod\n", ""),
    (r",\s*experimental_run_tf_function=False", ""),
    (r"opt\.variables\(\)", "opt.variables"),
    (r"tf\.keras\.datasets\.mnist\.load_data\(", "_local_mnist("),
]


def adapted(source: str) -> str:
    for pattern, replacement in CHANGES:
        source, count = re.subn(pattern, replacement, source, flags=re.M)
        if count:
            print(f"changed {count}x: {pattern!r} -> {replacement!r}", flush=True)
    if "_local_mnist(" in source:
        source = source.replace("\ndef main", LOCAL_MNIST + "\n\ndef main", 1)
    return source


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("example")
    p.add_argument("-np", type=int, default=2)
    p.add_argument("rest", nargs="*")
    a = p.parse_args(argv)
    path = a.example if os.path.isfile(a.example) else os.path.join(EXAMPLES, a.example)
    with open(path) as f:
        source = adapted(f.read())
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, os.path.basename(path))
        with open(copy, "w") as f:
            f.write(source)
        argv = [sys.executable, "-m", "tf_smb.run", "-np", str(a.np), sys.executable, copy,
                *a.rest]
        return subprocess.call(argv, cwd=tmp)


if __name__ == "__main__":
    sys.exit(main())
