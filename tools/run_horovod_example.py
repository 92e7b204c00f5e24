"""Runs one of Horovod 0.28.1's TensorFlow 2 examples on tf_smb.horovod.

    python tools/run_horovod_example.py EXAMPLE.py [-np N] [--min-np M] [--horovod] [--short]
                                        [-- EXAMPLE ARGS...]

The example (from ../shared/peer/horovod-0.28.1/examples/tensorflow2/, or its
elastic/tensorflow2/) is copied with only these changes, each printed before the run:
  * the import lines: `horovod.tensorflow` -> `tf_smb.horovod` (what a user
    changes); `import horovod` (used only by the horovod.run branch) dropped;
  * Keras 3: `experimental_run_tf_function=False` dropped (compile rejects it)
    and `opt.variables()` -> `opt.variables` (a list in Keras 3); in the elastic
    examples, a `.h5` ModelCheckpoint path -> `.keras` (Keras 3 saves whole models
    so only), `tf.keras.backend.set_value(X.lr, V)` -> `X.learning_rate.assign(V)`
    and `opt.lr` -> `opt.learning_rate` (Keras 3 has neither `set_value` nor `lr`);
  * data: MNIST cannot be downloaded here, so `tf.keras.datasets.mnist.load_data(...)`
    reads scikit-learn's 1,797 handwritten 8x8 digits (shipped with it), scaled to
    28x28 and 0..255 like MNIST, 80% for training.
--short (for tests) also cuts the examples' fixed lengths: 2 epochs of 60
steps, 100 custom-loop steps. Then it runs under `python -m tf_smb.run -np N`
(--min-np M: an elastic job, `--min-np M --max-np N` on this machine). With --horovod the import
lines stay and the same copy runs on the installed Horovod under `mpirun`: the
comparison swaps one thing only.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER = os.environ.get("TF_SMB_PEER_DIR") or os.path.join(
    os.path.dirname(REPO), "shared", "peer", "horovod-0.28.1")
EXAMPLES = os.path.join(PEER, "examples", "tensorflow2")
ELASTIC_EXAMPLES = os.path.join(PEER, "examples", "elastic", "tensorflow2")

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
    # The elastic examples: Keras 3 saves whole models as .keras only, has no
    # `backend.set_value` and no optimizer `lr` (its name is `learning_rate`).
    (r"(ModelCheckpoint\('[^']*)\.h5'", r"\1.keras'"),
    (r"tf\.keras\.backend\.set_value\(([\w.]+)\.lr,\s*(.+)\)$", r"\1.learning_rate.assign(\2)"),
    (r"\bopt\.lr\.assign\(", "opt.learning_rate.assign("),
]

SHORT = [
    (r"epochs=24-state\.epoch", "epochs=4-state.epoch"),  # elastic: room for a change
    (r"epochs=24\b", "epochs=2"),
    (r"steps_per_epoch=500 // hvd\.size\(\)", "steps_per_epoch=60 // hvd.size()"),
    (r"dataset\.take\(10000 // hvd\.size\(\)\)", "dataset.take(100 // hvd.size())"),
]


def adapted(source: str, keep_horovod: bool = False, short: bool = False) -> str:
    """The example's source with the changes (each printed)."""
    changes = (CHANGES[3:] if keep_horovod else CHANGES) + (SHORT if short else [])
    for pattern, replacement in changes:
        source, count = re.subn(pattern, replacement, source, flags=re.M)
        if count:
            print(f"changed {count}x: {pattern!r} -> {replacement!r}", flush=True)
    if "_local_mnist(" in source:  # defined after the imports, before its first use
        source = re.sub(r"^(import tf_smb\.horovod.*|import horovod\.tensorflow.*)$",
                        lambda m: m.group(0) + "\n" + LOCAL_MNIST, source, count=1, flags=re.M)
    return source


def prepare(example: str, folder: str, keep_horovod: bool = False,
            short: bool = False) -> str:
    """Writes the adapted copy of `example` (a path, or a name in EXAMPLES)
    into `folder`; returns its path."""
    path = example
    if not os.path.isfile(path):
        elastic = os.path.join(ELASTIC_EXAMPLES, example)
        path = elastic if os.path.isfile(elastic) else os.path.join(EXAMPLES, example)
    with open(path) as f:
        source = adapted(f.read(), keep_horovod, short)
    copy = os.path.join(folder, os.path.basename(path))
    with open(copy, "w") as f:
        f.write(source)
    return copy


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("example")
    p.add_argument("-np", type=int, default=2)
    p.add_argument("--horovod", action="store_true",
                   help="run on the installed Horovod (mpirun), imports unchanged")
    p.add_argument("--short", action="store_true", help="cut the examples' fixed lengths")
    p.add_argument("--min-np", type=int, help="an elastic job (tf_smb.run --min-np)")
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    with tempfile.TemporaryDirectory() as tmp:
        copy = prepare(a.example, tmp, a.horovod, a.short)
        if a.horovod:
            launcher = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(a.np)]
        else:
            launcher = [sys.executable, "-m", "tf_smb.run", "-np", str(a.np)]
            if a.min_np is not None:
                launcher += ["--min-np", str(a.min_np), "--max-np", str(a.np)]
        return subprocess.call([*launcher, sys.executable, copy, *rest], cwd=tmp)


if __name__ == "__main__":
    sys.exit(main())
