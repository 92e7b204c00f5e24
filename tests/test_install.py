"""A standard install: `pip install .` into a venv that has TensorFlow, the op
library compiled on first import (once, cached, under a lock), and clear errors
when something is missing.

The fresh-venv test takes minutes (a build, the op library compiled); it is marked
slow and CI runs it (tools/test.sh runs all of tests/).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import time
import types
from typing import Dict, List, Optional

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tf_smb import op_library  # noqa: E402  (no TensorFlow needed)

COMPILING = "tf_smb: compiling the TensorFlow op library"
# What a clean clone lacks: build outputs, caches, the venv, git metadata.
_NOT_IN_A_CLONE = ("*.so", "*.o", "__pycache__", "build", "dist", "*.egg-info", ".venv",
                   ".git", ".pytest_cache", "bench_out", "bazel-*", "_smb_ops.json")


def _env(extra: Optional[Dict[str, str]] = None,
         drop: tuple = ("PYTHONPATH", "VIRTUAL_ENV", "TF_SMB_CACHE", "TF_SMB_COMPILE",
                        "CXX")) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PYTHONNOUSERSITE="1", PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")
    env.update(extra or {})
    return env


def _run(cmd: List[str], timeout: float, what: str, **kwargs) -> subprocess.CompletedProcess:
    """Runs `cmd`, output captured; fails the test on timeout or a non-zero exit."""
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout, check=False, **kwargs)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
        pytest.fail(f"{what} took more than {timeout:.0f} s: {cmd}\n{(out or '')[-6000:]}")
    assert proc.returncode == 0, (
        f"{what} exited with {proc.returncode}: {cmd}\n{proc.stdout[-6000:]}")
    return proc


def _copy_package(dest: str) -> str:
    """tf_smb's Python files (no built extensions) under dest/tf_smb; returns dest."""
    shutil.copytree(os.path.join(REPO, "tf_smb"), os.path.join(dest, "tf_smb"),
                    ignore=shutil.ignore_patterns(*_NOT_IN_A_CLONE))
    return dest


# -- the compile-on-import cache, with a stand-in compiler (fast) ----------------

FAKE_CXX = """\
#!{python}
# Stands in for g++: logs each call, fails on request, else writes its -o file.
import os, sys, time
args = sys.argv[1:]
step = "link" if "-shared" in args else "compile"
with open(os.environ["FAKE_CXX_LOG"], "a") as log:
    log.write(step + "\\n")
if step == "compile":  # which source, and whether with MPI's flags
    with open(os.environ["FAKE_CXX_LOG"] + ".sources", "a") as log:
        mpi = "+mpi" if "-DTF_SMB_WITH_MPI" in args else ""
        log.write(args[args.index("-c") + 1] + mpi + "\\n")
if os.environ.get("FAKE_CXX_FAIL"):
    print("fake-cxx: error: boom in " + args[-3])
    sys.exit(1)
if step == "link":
    time.sleep(float(os.environ.get("FAKE_CXX_SLEEP", "0")))
with open(args[args.index("-o") + 1], "w") as out:
    out.write(step)
"""


def fake_tf(version: str = "0.0.test") -> types.SimpleNamespace:
    """What op_library uses of TensorFlow: its version and sysconfig flags."""
    return types.SimpleNamespace(__version__=version, sysconfig=types.SimpleNamespace(
        get_compile_flags=lambda: ["-DFAKE_TF"], get_link_flags=lambda: []))


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """Sources under root/cc, a stand-in compiler as $CXX, an empty $TF_SMB_CACHE."""
    root = tmp_path / "root"
    for d in op_library.SOURCE_DIRS:
        (root / d).mkdir(parents=True)
        (root / d / "a.cc").write_text(f"// {d}\n")
    (root / "cc" / "smb" / "a.h").write_text("// header\n")
    cxx = tmp_path / "fake-cxx"
    cxx.write_text(FAKE_CXX.format(python=sys.executable))
    cxx.chmod(0o755)
    log = tmp_path / "cxx.log"
    log.write_text("")
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("FAKE_CXX_LOG", str(log))
    monkeypatch.setenv("TF_SMB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TF_SMB_COMPILE", raising=False)
    monkeypatch.delenv("FAKE_CXX_FAIL", raising=False)
    return types.SimpleNamespace(root=str(root), log=log, cache=tmp_path / "cache")


def _steps(log) -> List[str]:
    return log.read_text().split()


def test_cache_is_reused(fake_build, capfd):
    tf = fake_tf()
    first = op_library.cached_library(fake_build.root, tf)
    assert _steps(fake_build.log) == ["compile"] * 4 + ["link"]
    assert first.startswith(str(fake_build.cache / "ops" / "0.0.test-"))
    assert capfd.readouterr().err.count(COMPILING) == 1
    mtime = os.stat(first).st_mtime_ns

    again = op_library.cached_library(fake_build.root, tf)
    assert again == first
    assert _steps(fake_build.log) == ["compile"] * 4 + ["link"], "compiled a second time"
    assert os.stat(first).st_mtime_ns == mtime
    assert COMPILING not in capfd.readouterr().err
    # Only the library and its lock are left in the cache directory.
    assert sorted(os.listdir(os.path.dirname(first))) == [".lock", "_smb_ops.so"]


def test_cache_key_follows_sources_and_tensorflow(fake_build):
    tf = fake_tf()
    first = op_library.cached_library(fake_build.root, tf)
    with open(os.path.join(fake_build.root, "cc", "ops", "a.cc"), "a") as f:
        f.write("// changed\n")
    changed = op_library.cached_library(fake_build.root, tf)
    other_tf = op_library.cached_library(fake_build.root, fake_tf("9.9.9"))
    assert len({first, changed, other_tf}) == 3
    assert _steps(fake_build.log).count("link") == 3


def test_builds_reuse_unchanged_objects_and_give_mpi_flags_to_its_sources_only(
        fake_build, monkeypatch):
    root = fake_build.root
    sources = fake_build.log.parent / "cxx.log.sources"
    with open(os.path.join(root, "cc", "smb", "a.cc"), "w") as f:
        f.write('#include "cc/smb/a.h"\n')
    with open(os.path.join(root, "cc", "kernels", "a.cc"), "w") as f:
        f.write("#ifdef TF_SMB_WITH_MPI\n#endif\n")
    with open(os.path.join(root, "cc", "ops", "a.cc"), "w") as f:
        f.write('#include "tensorflow/core/framework/op.h"\n')

    def build(name: str) -> List[str]:
        """The sources compiled for one library (the build record left out)."""
        sources.write_text("")
        op_library.compile_library(root, str(fake_build.cache / name), fake_tf())
        assert os.path.isfile(fake_build.cache / name)
        return sorted(s for s in sources.read_text().split() if "build_record" not in s)

    monkeypatch.setattr(op_library, "mpi_flags", lambda: (["-DTF_SMB_WITH_MPI"], ["-lmpi"]))
    assert build("first.so") == ["cc/kernels/a.cc+mpi", "cc/ops/a.cc", "cc/smb/a.cc"]
    assert build("again.so") == [], "compiled unchanged sources again"
    # A header changed: only the source that includes it.
    with open(os.path.join(root, "cc", "smb", "a.h"), "a") as f:
        f.write("// changed\n")
    assert build("header.so") == ["cc/smb/a.cc"]
    # Without MPI: only the source that tests TF_SMB_WITH_MPI.
    monkeypatch.setattr(op_library, "mpi_flags", lambda: ([], []))
    assert build("no_mpi.so") == ["cc/kernels/a.cc"]
    # Open MPI upgraded in place (the same include folder, another mpi.h): only the
    # source that tests TF_SMB_WITH_MPI, and the library is cached elsewhere.
    mpi_include = fake_build.log.parent / "mpi_include"
    mpi_include.mkdir()
    (mpi_include / "mpi.h").write_text("#define OMPI_MAJOR_VERSION 4\n")
    mpi = (["-I", str(mpi_include), "-DTF_SMB_WITH_MPI"], ["-lmpi"])
    monkeypatch.setattr(op_library, "mpi_flags", lambda: mpi)
    assert build("mpi4.so") == ["cc/kernels/a.cc+mpi"]
    library_dir = op_library.cache_dir(root, fake_tf())
    (mpi_include / "mpi.h").write_text("#define OMPI_MAJOR_VERSION 5\n")
    assert build("mpi5.so") == ["cc/kernels/a.cc+mpi"]
    assert op_library.cache_dir(root, fake_tf()) != library_dir
    assert build("mpi5_again.so") == []
    monkeypatch.setattr(op_library, "mpi_flags", lambda: ([], []))
    # Another TensorFlow (other headers behind the same flags): only the source that
    # includes TensorFlow's headers; the others' objects serve every TensorFlow.
    sources.write_text("")
    op_library.compile_library(root, str(fake_build.cache / "other.so"), fake_tf("9.9.9"))
    assert [s for s in sources.read_text().split() if "build_record" not in s] == [
        "cc/ops/a.cc"]
    # The objects are kept, without partial files; the record is not.
    names = os.listdir(fake_build.cache / "objects")
    assert all(n.endswith(".o") for n in names) and len(names) == 3 + 1 + 1 + 2 + 1, names
    # compile_objects (setup.py builds tf_smb._box with it): a context of its own
    # (Python's and pybind11's versions there) keys every object.
    box = [("cc/smb/a.cc", ["-DBOX"])]
    for context, compiled in (("python=a", 1), ("python=a", 0), ("python=b", 1)):
        sources.write_text("")
        [obj] = op_library.compile_objects(root, box, str(fake_build.cache), context=context)
        assert os.path.isfile(obj) and len(sources.read_text().split()) == compiled, context
    for n in os.listdir(fake_build.cache / "objects"):
        if n not in names:
            os.unlink(fake_build.cache / "objects" / n)
    # Objects unused for OBJECT_CACHE_DAYS go at the next build.
    old = time.time() - (op_library.OBJECT_CACHE_DAYS + 1) * 86400
    for n in names:
        os.utime(fake_build.cache / "objects" / n, (old, old))
    build("prune.so")
    assert len(os.listdir(fake_build.cache / "objects")) == 3, "old objects were kept"


def test_concurrent_first_loads_compile_once(fake_build, tmp_path):
    script = textwrap.dedent(f"""
        import sys, types
        sys.path.insert(0, {REPO!r})
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_install import fake_tf
        from tf_smb import op_library
        print(op_library.cached_library({fake_build.root!r}, fake_tf()))
    """)
    env = _env({"CXX": os.environ["CXX"], "FAKE_CXX_LOG": str(fake_build.log),
                "TF_SMB_CACHE": str(fake_build.cache), "FAKE_CXX_SLEEP": "1"})
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(3)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=60)
            results.append((p.returncode, out.strip(), err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(rc == 0 for rc, _, _ in results), results
    assert len({path for _, path, _ in results}) == 1, results
    assert sum(err.count(COMPILING) for _, _, err in results) == 1, results
    assert _steps(fake_build.log).count("link") == 1, _steps(fake_build.log)


def test_compiler_failure_shows_its_output(fake_build, monkeypatch):
    monkeypatch.setenv("FAKE_CXX_FAIL", "1")
    with pytest.raises(op_library.OpLibraryError) as info:
        op_library.cached_library(fake_build.root, fake_tf())
    message = str(info.value)
    assert "failed (exit code 1)" in message and "fake-cxx: error: boom" in message, message
    assert "Compiler output:" in message, message
    # Nothing half-built is left for the next process to load.
    [directory] = os.listdir(fake_build.cache / "ops")
    assert os.listdir(fake_build.cache / "ops" / directory) == [".lock"]


def test_missing_compiler_says_what_to_install(fake_build, monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(op_library.OpLibraryError, match="install g\\+\\+"):
        op_library.cached_library(fake_build.root, fake_tf())


def test_compiling_can_be_forbidden(fake_build, monkeypatch):
    monkeypatch.setenv("TF_SMB_COMPILE", "0")
    with pytest.raises(op_library.OpLibraryError, match="TF_SMB_COMPILE=0"):
        op_library.cached_library(fake_build.root, fake_tf())
    assert _steps(fake_build.log) == []


def test_install_time_library_needs_a_matching_build_record(fake_build, tmp_path,
                                                            monkeypatch):
    # The real compiler: the record must survive compiling and linking.
    monkeypatch.setenv("CXX", "g++")
    package = tmp_path / "pkg"
    package.mkdir()
    library = str(package / "_smb_ops.cpython-311-x86_64-linux-gnu.so")
    op_library.compile_library(fake_build.root, library, fake_tf("2.21.0"))
    assert op_library.read_build_record(library) == {
        "tensorflow": "2.21.0", "sources": op_library.source_digest(fake_build.root),
        "mpi": "1" if op_library.mpi_flags()[0] else "0"}
    monkeypatch.setattr(op_library, "_PACKAGE_DIR", str(package))
    assert op_library.installed_library(fake_build.root, "2.21.0") == library
    assert op_library.installed_library(None, "2.21.0") == library  # no sources at hand
    # Another TensorFlow, or sources changed since the build: not this library.
    assert op_library.installed_library(fake_build.root, "2.22.0") is None
    with open(os.path.join(fake_build.root, "cc", "smb", "a.h"), "a") as f:
        f.write("// changed\n")
    assert op_library.installed_library(fake_build.root, "2.21.0") is None
    # Built without MPI while Open MPI's development files are there now: not
    # this library (it could not join nodes); the cache gets one with MPI.
    with open(os.path.join(fake_build.root, "cc", "smb", "a.h"), "w") as f:
        f.write("// header\n")
    monkeypatch.setenv("TF_SMB_WITH_MPI", "0")
    op_library.compile_library(fake_build.root, library, fake_tf("2.21.0"))
    assert op_library.read_build_record(library)["mpi"] == "0"
    assert op_library.installed_library(fake_build.root, "2.21.0") == library
    monkeypatch.setattr(op_library, "mpi_flags",
                        lambda: (["-DTF_SMB_WITH_MPI"], ["-lmpi"]))
    assert op_library.installed_library(fake_build.root, "2.21.0") is None
    # Built with MPI where MPI is not wanted now (TF_SMB_WITH_MPI=0, or no mpicxx):
    # not this library either (it would map Open MPI into every process).
    monkeypatch.setattr(op_library, "mpi_flags", lambda: (["-DTF_SMB_WITH_MPI"], []))
    op_library.compile_library(fake_build.root, library, fake_tf("2.21.0"))
    assert op_library.read_build_record(library)["mpi"] == "1"
    assert op_library.installed_library(fake_build.root, "2.21.0") == library
    monkeypatch.setattr(op_library, "mpi_flags", lambda: ([], []))
    assert op_library.installed_library(fake_build.root, "2.21.0") is None
    # No record (built before records existed): not trusted either.
    with open(library, "wb") as f:
        f.write(b"\x7fELF without a record")
    assert op_library.installed_library(None, "2.21.0") is None


# -- a checkout whose extensions are not built ---------------------------------

def test_launcher_without_box_module_says_what_to_run(tmp_path):
    _copy_package(str(tmp_path))
    # -S: no site-packages, so no editable install of this checkout to fall back on.
    proc = subprocess.run(
        [sys.executable, "-S", "-c", "import tf_smb, sys; print(tf_smb.__file__, file=sys.stderr); "
                               "import tf_smb.run"],
        cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=60)
    assert str(tmp_path) in proc.stdout, f"imported another tf_smb:\n{proc.stdout}"
    assert proc.returncode != 0, proc.stdout
    assert "tf_smb._box is missing" in proc.stdout, proc.stdout
    assert "pip install ." in proc.stdout and "build_ext --inplace" in proc.stdout, proc.stdout


def test_ops_without_library_and_no_compiling_says_what_to_run(tmp_path):
    _copy_package(str(tmp_path))
    for d in op_library.SOURCE_DIRS:  # sources where a wheel puts them
        shutil.copytree(os.path.join(REPO, d), tmp_path / "tf_smb" / "_src" / d)
    code = ("import tf_smb, tf_smb.ops, sys; print(tf_smb.__file__, file=sys.stderr); "
            "tf_smb.ops._library()")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path,
        env=_env({"TF_SMB_CACHE": str(tmp_path / "empty-cache"), "TF_SMB_COMPILE": "0"}),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert str(tmp_path) in proc.stdout, f"imported another tf_smb:\n{proc.stdout}"
    assert proc.returncode != 0, proc.stdout
    assert "OpLibraryError" in proc.stdout, proc.stdout
    assert "TF_SMB_COMPILE=0" in proc.stdout and "pip install" in proc.stdout, proc.stdout


def test_launcher_quiets_tensorflow_info_unless_told(tmp_path):
    show = "import os; print('level=' + os.environ['TF_CPP_MIN_LOG_LEVEL'])"
    env = _env()
    del env["TF_CPP_MIN_LOG_LEVEL"]
    default = _run([sys.executable, "-m", "tf_smb.run", "-np", "1", sys.executable, "-c", show],
                   60, "the launcher", cwd=REPO, env=env)
    assert "[0]: level=2" in default.stdout, default.stdout
    chosen = _run([sys.executable, "-m", "tf_smb.run", "-np", "1", sys.executable, "-c", show],
                  60, "the launcher", cwd=REPO, env=dict(env, TF_CPP_MIN_LOG_LEVEL="0"))
    assert "[0]: level=0" in chosen.stdout, chosen.stdout


# -- the real thing: a fresh venv, plain `pip install`, the example -------------
# TensorFlow and the other dependencies come from this run's venv through a .pth
# line (installing TensorFlow into a fresh venv is what tools/install.sh does at
# the start of every run: two minutes more here would test nothing new); tf_smb
# itself is a plain, isolated `pip install` of a clean copy of the repository.


def _dependencies_site() -> str:
    """This interpreter's site-packages, where the suite's dependencies are."""
    site = sysconfig.get_paths()["purelib"]
    assert os.path.isdir(os.path.join(site, "tensorflow")), f"no TensorFlow in {site}"
    return site


@pytest.mark.slow
def test_plain_pip_install_compiles_on_import_and_trains(tmp_path):
    # A clean copy of the repository: nothing built, nothing from this checkout's venv.
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(*_NOT_IN_A_CLONE))
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], 300, "python -m venv", env=_env())
    python = str(venv / "bin" / "python")
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                60, "the venv's site-packages", env=_env()).stdout.strip()
    # Appended after the venv's own site-packages: what pip installs there wins.
    with open(os.path.join(site, "dependencies.pth"), "w") as f:
        f.write(_dependencies_site() + "\n")
    env = _env({"TF_SMB_CACHE": str(tmp_path / "cache")})
    del env["TF_CPP_MIN_LOG_LEVEL"]  # as a user runs it: the launcher's default applies
    # No library is cached, but the compiled objects are shared with this checkout's
    # builds (keyed by their sources, compiler and flags): what is tested here is
    # the isolated install and the build on import, not the compiler again (~200
    # CPU-s). The suite's own install compiles them where no cache exists.
    (tmp_path / "cache").mkdir()
    shared_objects = os.path.join(op_library.cache_root(), "objects")
    os.makedirs(shared_objects, exist_ok=True)
    os.symlink(shared_objects, tmp_path / "cache" / "objects")
    _run([python, "-m", "pip", "install", "-q", str(src)], 900,
         "plain pip install of the repository", env=env, cwd=tmp_path)

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    where = _run([python, "-c", "import os, tf_smb; print(os.path.dirname(tf_smb.__file__))"],
                 120, "import tf_smb", env=env, cwd=run_dir).stdout.strip()
    assert where.startswith(str(venv)) and "site-packages" in where, where
    assert not any(f.startswith("_smb_ops") for f in os.listdir(where)), (
        f"the isolated build made an op library: {os.listdir(where)}")
    assert os.path.isfile(os.path.join(where, "_src", "cc", "ops", "smb_ops.cc")), (
        f"the wheel lacks the C++ sources: {os.listdir(where)}")

    shutil.copy(os.path.join(REPO, "examples", "keras_digits.py"), run_dir)
    run = _run([python, "-m", "tf_smb.run", "-np", "2", python, "keras_digits.py",
                "--epochs=2"], 900, "the example on 2 workers", env=env, cwd=run_dir)
    out = run.stdout
    assert out.count(COMPILING) == 1, f"expected one compile:\n{out}"
    accuracies = {rank: float(acc) for rank, acc in
                  re.findall(r"^\[(\d)\]: test accuracy: ([0-9.]+)$", out, re.M)}
    assert set(accuracies) == {"0", "1"}, f"a rank printed no test accuracy:\n{out}"
    assert accuracies["0"] == accuracies["1"], f"ranks disagree:\n{out}"
    assert accuracies["0"] > 0.5, f"did not learn (10 classes):\n{out}"  # chance is 0.1
    assert "Epoch 2/2" in out, out
    assert "UserWarning" not in out and "cpu_feature_guard" not in out, out

    # A later process reuses the cached library: no compiling, same file.
    [library] = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "cache")
                 for f in files if f == op_library.LIBRARY_NAME]
    mtime = os.stat(library).st_mtime_ns
    again = _run([python, "-m", "tf_smb.op_library"], 300, "loading the op library again",
                 env=env, cwd=run_dir)
    assert COMPILING not in again.stdout, again.stdout
    assert library in again.stdout, again.stdout
    assert os.stat(library).st_mtime_ns == mtime
