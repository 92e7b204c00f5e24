"""Probe: versions, whether Horovod imports (and with which controllers), the models' shapes.

    python -m benchmarks.roles.probe --models=mlp,resnet50 --shapes_out=/tmp/shapes.json
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
from typing import Dict, Optional, Sequence

from benchmarks import common


def run(models: Sequence[str], shapes_out: str) -> None:
    import tensorflow as tf
    import keras
    info: Dict[str, object] = {"python": sys.version.split()[0], "tensorflow": tf.__version__,
                               "keras": keras.__version__, "cpus": os.cpu_count()}
    try:
        import horovod
        import horovod.tensorflow as hvd
        info.update(horovod=horovod.__version__, horovod_mpi=bool(hvd.mpi_built()),
                    horovod_gloo=bool(hvd.gloo_built()))
    except Exception as e:  # pylint: disable=broad-except  (any failure: unavailable)
        info["horovod_error"] = f"{type(e).__name__}: {e}"
    shapes = common.write_shapes_file(models, pathlib.Path(shapes_out))
    info["models"] = {m: {"bytes": common.set_bytes(s), "params": common.num_params(s),
                          "tensors": len(s)} for m, s in shapes.items()}
    common.print_result({"probe": info})


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.roles.probe")
    parser.add_argument("--models", required=True, help="comma list of models")
    parser.add_argument("--shapes_out", required=True, help="where the shapes go (JSON)")
    args = parser.parse_args(argv)
    run(common.split_list(args.models, ""), args.shapes_out)


if __name__ == "__main__":
    main()
