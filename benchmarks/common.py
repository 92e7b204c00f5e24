"""What the benchmark drivers and their worker roles share: names, shapes, result lines.

Model shapes: `model_shapes(name)` builds the Keras model once and returns the shapes of
its trainable variables. A driver that starts many workers computes them once (the probe
role writes them to a JSON file) and names that file in $TF_SMB_BENCH_SHAPES; workers
then read the shapes from it instead of building the model again.

Result lines: a worker prints RESULT_TAG + one JSON object per result; the driver finds
them in its output with `parse_tagged` (launchers may prefix or interleave the lines).

Nothing here imports TensorFlow at import time, so a driver stays light.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
from typing import Dict, List, Optional, Sequence, Tuple

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULT_TAG = "BENCH_RESULT "
SHAPES_ENV = "TF_SMB_BENCH_SHAPES"
# tiny_mlp: Dense 32-64-64-10; mlp: Dense 784-512-512-10; the others are
# keras.applications models with weights=None (shapes only, nothing downloaded).
MODELS = ("tiny_mlp", "mlp", "resnet50", "vgg16", "inception_v3")
# Sets of one float32 tensor: name -> number of elements (MB = MiB).
FLAT_SETS = {"4KB": 1 << 10, "64KB": 1 << 14, "1MB": 1 << 18, "16MB": 1 << 22,
             "100MB": 25 << 20}

Shapes = List[Tuple[int, ...]]


def build_model_shapes(name: str) -> Shapes:
    """Builds model `name` and returns the shapes of its trainable variables."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    import keras  # only here: the drivers need no TensorFlow
    if name == "tiny_mlp":
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(10)])
    elif name == "mlp":
        model = keras.Sequential([keras.Input((784,)),
                                  keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(10)])
    else:
        model = {"resnet50": keras.applications.ResNet50, "vgg16": keras.applications.VGG16,
                 "inception_v3": keras.applications.InceptionV3}[name](weights=None)
    shapes = [tuple(int(d) for d in v.shape) for v in model.trainable_variables]
    del model
    keras.backend.clear_session()
    return shapes


def model_shapes(name: str) -> Shapes:
    """Model `name`'s trainable-variable shapes: from $TF_SMB_BENCH_SHAPES if it has them."""
    path = os.environ.get(SHAPES_ENV)
    if path:
        try:
            cached = json.loads(pathlib.Path(path).read_text())
        except (OSError, ValueError):
            cached = {}
        if name in cached:
            return [tuple(s) for s in cached[name]]
    return build_model_shapes(name)


def write_shapes_file(names: Sequence[str], path: pathlib.Path) -> Dict[str, Shapes]:
    """Builds each model once and writes {name: shapes} to `path` (for $TF_SMB_BENCH_SHAPES)."""
    shapes = {n: build_model_shapes(n) for n in names}
    path.write_text(json.dumps(shapes))
    return shapes


def set_shapes(name: str) -> Shapes:
    """The float32 shapes of a tensor set: one flat tensor (FLAT_SETS) or a model's."""
    if name in FLAT_SETS:
        return [(FLAT_SETS[name],)]
    if name not in MODELS:
        raise ValueError(f"unknown set {name!r}; known: {[*FLAT_SETS, *MODELS]}")
    return model_shapes(name)


def set_bytes(shapes: Sequence[Tuple[int, ...]]) -> int:
    """Bytes of float32 tensors of these shapes."""
    return sum(4 * math.prod(s) for s in shapes)


def num_params(shapes: Sequence[Tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes)


def split_list(value: Optional[str], default: str) -> List[str]:
    """A comma-list flag's items (`default` when the flag is unset; empty: none)."""
    return [s for s in (default if value is None else value).split(",") if s]


def print_result(result: dict) -> None:
    """What a worker prints for the driver: RESULT_TAG and the result as JSON."""
    print(RESULT_TAG + json.dumps(result), flush=True)


def parse_tagged(output: str, tag: str = RESULT_TAG) -> List[dict]:
    """Every JSON object printed after `tag` (launchers may prefix the lines).

    mpirun can put two ranks' lines on one line; each object is decoded from its
    own tag on, and one cut by another rank's output is left out.
    """
    decoder, found = json.JSONDecoder(), []
    for match in re.finditer(re.escape(tag), output):
        try:
            value, _ = decoder.raw_decode(output, match.end())
        except ValueError:
            continue
        if isinstance(value, dict):
            found.append(value)
    return found


def parse_driver_args(prog: str, description: str, argv: Optional[Sequence[str]],
                      out_dir: str, smoke_help: str, full: dict, smoke: dict,
                      report_file: str) -> argparse.Namespace:
    """A driver's arguments: --out_dir, --smoke, one flag per key of `full` (its
    default there, or in `smoke` with --smoke) and --report_from (a finished run's
    `report_file`, whose report is written again; the other flags then stay None)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--out_dir", default=out_dir)
    parser.add_argument("--smoke", action="store_true", help=smoke_help)
    for key, value in full.items():
        parser.add_argument(f"--{key}", type=type(value), default=None,
                            help=f"default {value}; smoke {smoke[key]}")
    parser.add_argument("--report_from", default="", help=f"a run's {report_file}: write "
                        "its tables, CSV and plot again into --out_dir (nothing is measured)")
    args = parser.parse_args(argv)
    if not args.report_from:
        for key, value in (smoke if args.smoke else full).items():
            if getattr(args, key) is None:
                setattr(args, key, value)
    return args

