"""One node without MPI (issue 8, point 6): everything that worked before still
works, and `import tf_smb` does not need MPI.

Open MPI is installed on this machine, so its absence is made for the workers:
`TF_SMB_WITH_MPI=0` has tf_smb build (once, cached under its own key) and use its
op library without the MPI transport, as it does where Open MPI's development
files are missing; and a PATH without Open MPI's programs has `mpicxx` missing
for real. Each test then checks, from the worker processes themselves, which op
library they mapped (its build record says mpi=0) and that no Open MPI library
is mapped in them (/proc/self/maps).

Needs op_library.installed_library to pass over an install-time library built
with MPI (build record mpi=1) when MPI is not wanted (TF_SMB_WITH_MPI=0 or no
mpicxx): otherwise an up-to-date `pip install -e .` build in tf_smb/ is loaded,
with libmpi, whatever TF_SMB_WITH_MPI says.
"""
import json
import os
import shutil
import subprocess
import time

import pytest

from harness import (WORKERS, max_diff, rank_lines, run_launcher, run_ranks,
                     run_single)

WORKER = os.path.join(WORKERS, "no_mpi_worker.py")
B = 8  # per-worker batch
NO_MPI = {"TF_SMB_WITH_MPI": "0"}
# Seconds: the first compile of the MPI-less library (about 1-2 minutes on this
# 2-core machine, longer when it is shared), and one TensorFlow process or job.
COMPILE_TIMEOUT_S = 600
JOB_TIMEOUT_S = 240
# Open MPI's programs (mpirun, mpiexec, mpicc, mpicxx, orterun, opal_wrapper, ...).
MPI_PROGRAM_PREFIXES = ("mpi", "orte", "ompi", "opal", "osh", "shmem")


def _show(p: subprocess.CompletedProcess) -> str:
    return f"stdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"


@pytest.fixture(scope="module")
def library():
    """The MPI-less op library, compiled first if the cache lacks it (one process
    compiles, so that the jobs below do not wait on its lock within their timeouts)."""
    start = time.monotonic()
    try:
        p = run_single(["-m", "tf_smb.op_library"], timeout=COMPILE_TIMEOUT_S, env=NO_MPI)
    except subprocess.TimeoutExpired as e:  # the harness has stopped it
        pytest.fail(f"compiling the op library without MPI took over {COMPILE_TIMEOUT_S} s:"
                    f"\n{e.stderr}")
    assert p.returncode == 0, (f"python -m tf_smb.op_library failed:\nstdout:\n"
                               f"{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}")
    path = p.stdout.strip().splitlines()[-1].rsplit(" (", 1)[0]
    print(f"op library without MPI: {path} ({time.monotonic() - start:.0f} s)")
    return path


@pytest.fixture(scope="module")
def fit_single(library):
    """One process on the global batch (the reference; the same MPI-less library)."""
    return run_single([WORKER, "fit", "--batch", str(2 * B)], timeout=JOB_TIMEOUT_S,
                      env=NO_MPI).check().json()


@pytest.fixture(scope="module")
def path_without_mpi(tmp_path_factory):
    """This PATH with every directory that holds mpirun or mpicxx replaced by a
    directory of symlinks to its programs other than Open MPI's: python, the
    compiler and the basic tools stay, mpirun and mpicxx go."""
    farm_root = tmp_path_factory.mktemp("path_without_mpi")
    farms, entries = {}, []
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if not directory:
            continue
        if not any(os.path.exists(os.path.join(directory, p)) for p in ("mpirun", "mpicxx")):
            entries.append(directory)
            continue
        real = os.path.realpath(directory)
        if real not in farms:
            farm = farm_root / f"bin{len(farms)}"
            farm.mkdir()
            for name in os.listdir(real):
                target = os.path.join(real, name)
                if (name.startswith(MPI_PROGRAM_PREFIXES) or os.path.basename(
                        os.path.realpath(target)).startswith(MPI_PROGRAM_PREFIXES)):
                    continue
                (farm / name).symlink_to(target)
            farms[real] = str(farm)
        entries.append(farms[real])
    path = os.pathsep.join(dict.fromkeys(entries))
    for program in ("mpirun", "mpiexec", "mpicxx", "mpicc", "orterun", "opal_wrapper"):
        assert shutil.which(program, path=path) is None, (program, path)
    for program in ("g++", "sh", "env"):
        assert shutil.which(program, path=path), f"{program} lost from PATH {path}"
    return path


def _launch_fit(tmp_path, env):
    """`python -m tf_smb.run -np 2` of the fit scenario; each rank's result."""
    p = run_launcher(2, [WORKER, "fit", "--batch", str(B), "--result_dir", str(tmp_path)],
                     timeout=JOB_TIMEOUT_S, env=env)
    assert p.returncode == 0, f"tf_smb.run -np 2 exited with {p.returncode}:\n{_show(p)}"
    results = []
    for rank in range(2):
        result_file = tmp_path / f"rank{rank}.json"
        assert result_file.exists(), (f"rank {rank} wrote no result; its output:\n"
                                      + "\n".join(rank_lines(p.stdout + p.stderr, rank))[-4000:])
        results.append(json.loads(result_file.read_text()))
    return results


def _check_fit_without_mpi(results, fit_single, library):
    assert [r["rank"] for r in results] == [0, 1] and [r["size"] for r in results] == [2, 2]
    for r in [fit_single, *results]:
        who = f"rank {r['rank']} of {r['size']}"
        assert r["mpi_mapped"] == [], f"{who} mapped Open MPI: {r['mpi_mapped']}"
        # A single process needs no op library (its collectives are local); workers do.
        assert len(r["op_libraries"]) == (r["size"] > 1), (
            f"{who} mapped op libraries {r['op_libraries']}")
        for loaded in r["op_libraries"]:
            record = r["build_records"][loaded]
            assert record and record.get("mpi") == "0", f"{who} loaded {loaded}: {record}"
            assert os.path.realpath(loaded) == os.path.realpath(library), (who, loaded, library)
    for r in results:
        assert max_diff(r["weights"], fit_single["weights"]) < 1e-5, f"rank {r['rank']}"
    assert max_diff(results[0]["weights"], results[1]["weights"]) == 0.0


def test_import_tf_smb_maps_no_mpi(path_without_mpi):
    for env in ({}, {"PATH": path_without_mpi}):
        r = run_single([WORKER, "import_only"], timeout=120, env=env, fresh=True).check().json()
        assert r["mpi_mapped"] == [], f"`import tf_smb` mapped Open MPI ({env}): {r}"
        assert r["op_libraries"] == [] and not r["tensorflow_imported"], r
        if env:
            assert r["which"] == {"mpirun": None, "mpiexec": None, "mpicxx": None}, r["which"]


def test_fit_two_workers_without_mpi_equal_one_process(library, fit_single, tmp_path):
    results = _launch_fit(tmp_path, NO_MPI)
    _check_fit_without_mpi(results, fit_single, library)


def test_across_nodes_without_mpi_fails_at_start_on_every_rank(library):
    start = time.monotonic()
    results = run_ranks([WORKER, "fit", "--batch", str(B)], 2, timeout=JOB_TIMEOUT_S,
                        env={**NO_MPI, "TF_SMB_ACROSS_NODES": "1", "TF_SMB_TIMEOUT": "30",
                             "TEST_TIMEOUT": "30"})
    elapsed = time.monotonic() - start
    for r in results:
        assert r.returncode != 0, f"rank {r.rank} did not fail; stdout:\n{r.stdout[-3000:]}"
        assert not any(line.startswith("{") for line in r.stdout.splitlines()), (
            f"rank {r.rank} ran its scenario:\n{r.stdout[-3000:]}")
        for words in ("this job spans several nodes",
                      "tf_smb's library was built without MPI",
                      "apt-get install libopenmpi-dev", "rebuilt with MPI"):
            assert words in r.stderr, (
                f"rank {r.rank} (exit {r.returncode}) lacks {words!r}; stderr:\n"
                f"{r.stderr[-3000:]}")
    # At start: no collective waited for its timeout (each process spends most of
    # this importing TensorFlow on a busy machine).
    assert elapsed < 120, f"the failing job took {elapsed:.0f} s"


def test_fit_without_mpirun_or_mpicxx_on_path(library, fit_single, path_without_mpi, tmp_path):
    # MPI wanted (the default), but mpicxx is missing for real: the library is the
    # MPI-less one.
    results = _launch_fit(tmp_path, {"PATH": path_without_mpi, "TF_SMB_WITH_MPI": "1"})
    for r in results:
        assert r["which"] == {"mpirun": None, "mpiexec": None, "mpicxx": None}, r["which"]
    _check_fit_without_mpi(results, fit_single, library)
