"""keras_worker.py's scenarios, with what the process has loaded added to the
result: the op library it mapped (and that library's build record), any Open
MPI library it mapped, and whether mpirun/mpicxx are on its PATH.

    no_mpi_worker.py import_only     # `import tf_smb` and nothing else
    no_mpi_worker.py SCENARIO ARGS   # keras_worker.py SCENARIO ARGS

Imports nothing but the standard library before the scenario runs, so that
`import_only` sees what `import tf_smb` alone maps.
"""
import json
import os
import re
import shutil
import sys

# Open MPI's libraries (libmpi, libopen-rte, libopen-pal, its PMIx) and its
# plugins (mca_*.so, under .../openmpi/).
_MPI_LIBRARY = re.compile(r"^(libmpi|libopen-rte|libopen-pal|libpmix|mca_)[^/]*\.so")


def loaded():
    """What this process has mapped and can run, as a JSON-able dict."""
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split(None, 5)[5].strip() for line in maps
                        if len(line.split(None, 5)) == 6 and "/" in line.split(None, 5)[5]})
    op_libraries = [p for p in paths if os.path.basename(p).startswith("_smb_ops")]
    records = {}
    if op_libraries:
        from tf_smb import op_library  # no TensorFlow import: the module is light
        records = {p: op_library.read_build_record(p) for p in op_libraries}
    return {
        "mpi_mapped": [p for p in paths
                       if _MPI_LIBRARY.match(os.path.basename(p)) or "/openmpi/" in p],
        "op_libraries": op_libraries,
        "build_records": records,
        "which": {name: shutil.which(name) for name in ("mpirun", "mpiexec", "mpicxx")},
        "tensorflow_imported": "tensorflow" in sys.modules,
    }


def main():
    if sys.argv[1:] == ["import_only"]:
        import tf_smb  # noqa: F401 - the import is what is tested
        print(json.dumps(loaded()), flush=True)
        return 0
    import keras_worker  # tests/workers is this script's directory, so on sys.path
    report = keras_worker.report

    def report_with_loaded(result, result_dir=None):
        result.update(loaded())
        report(result, result_dir)

    keras_worker.report = report_with_loaded
    return keras_worker.main()


if __name__ == "__main__":
    sys.exit(main())
