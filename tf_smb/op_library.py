"""Finds, or compiles, the SMB TensorFlow op library for the TensorFlow in use.

A TensorFlow op library only works with the TensorFlow it was compiled against,
so `load()` takes, in order:

1. the library built at install time (``tf_smb/_smb_ops*.so``, built when
   TensorFlow was importable during the build, e.g. ``pip install
   --no-build-isolation .``), if its build record (a string compiled into it)
   names the running TensorFlow version and the current sources;
2. a library compiled earlier into the cache,
   ``$TF_SMB_CACHE/ops/<TensorFlow version>-<key>/_smb_ops.so``
   (``TF_SMB_CACHE`` defaults to ``~/.cache/tf_smb``; the key hashes the C++
   sources and the compile flags);
3. otherwise it compiles the library into the cache (once: concurrent
   processes wait on a file lock) with ``$CXX`` (default ``g++``) and the
   flags of ``tf.sysconfig``, which takes about a minute; objects compiled
   earlier are reused from ``$TF_SMB_CACHE/objects`` (each kept under a key of
   its source, the headers it includes, the compiler and the flags), so a build
   after an edit compiles only what the edit touched.

``TF_SMB_COMPILE=0`` turns step 3 into an error, for machines that must not
compile. The C++ sources ship inside the package (``tf_smb/_src/cc``); in a
source checkout they are the checkout's ``cc/``.

This module imports TensorFlow only when a function needs it, so setup.py can
use `source_digest()` and `compile_library()` as well.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import glob
import hashlib
import re
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import types
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

# Directories under the include root whose sources make up the op library.
SOURCE_DIRS = ("cc/smb", "cc/ops", "cc/kernels")
# The package directory the sources are copied into when a wheel is built.
PACKAGED_SOURCES = "_src"
# Starts the build record compiled into every library: "key=value;" pairs.
BUILD_RECORD_TAG = b"TF_SMB_BUILD_RECORD:"
LIBRARY_NAME = "_smb_ops.so"
# Flags added to tf.sysconfig's (the same for install-time and on-import builds).
EXTRA_COMPILE_FLAGS = ("-O3", "-DNDEBUG", "-fPIC", "-Wno-deprecated-declarations")
EXTRA_LINK_FLAGS = ("-lpthread", "-lrt")
# Object files unused for this many days are removed from the object cache.
OBJECT_CACHE_DAYS = 7
MPI_MACRO = b"TF_SMB_WITH_MPI"
_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)
# Seconds one compiler or linker run may take.
COMPILE_TIMEOUT_S = 1800.0
# How much of the compiler's output an error shows.
ERROR_OUTPUT_CHARS = 8000

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_LIB: Optional[types.ModuleType] = None


class OpLibraryError(ImportError):
    """The op library cannot be found, compiled or loaded; the message says why."""


def _import_tensorflow() -> types.ModuleType:
    try:
        import tensorflow as tf
    except ImportError as e:
        raise OpLibraryError(
            "tf_smb needs TensorFlow, which is not installed here (tf_smb does not "
            "install it, so that you can choose the build): run `pip install "
            f"tensorflow` (or `pip install tensorflow-cpu`). Import error: {e}") from e
    return tf


def source_root() -> Optional[str]:
    """The include root that holds ``cc/smb``, ``cc/ops`` and ``cc/kernels``, or None.

    The copy packaged inside tf_smb (an installed wheel) comes first, then the
    ``cc/`` of the source checkout the package sits in.
    """
    checkout = os.path.dirname(_PACKAGE_DIR)
    candidates = [os.path.join(_PACKAGE_DIR, PACKAGED_SOURCES)]
    if os.path.exists(os.path.join(checkout, "setup.py")):
        candidates.append(checkout)
    for root in candidates:
        if all(os.path.isdir(os.path.join(root, d)) for d in SOURCE_DIRS):
            return root
    return None


def source_files(root: str) -> List[str]:
    """The op library's sources and headers under ``root``, as sorted relative paths."""
    files = []
    for d in SOURCE_DIRS:
        for pattern in ("*.cc", "*.h"):
            files.extend(os.path.relpath(p, root)
                         for p in glob.glob(os.path.join(root, d, "**", pattern),
                                            recursive=True))
    return sorted(files)


def source_digest(root: str) -> str:
    """A hex SHA-256 of the op library's sources under ``root`` (names and contents)."""
    h = hashlib.sha256()
    for rel in source_files(root):
        h.update(rel.encode() + b"\0")
        with open(os.path.join(root, rel), "rb") as f:
            h.update(f.read())
        h.update(b"\0")
    return h.hexdigest()


def compiler() -> List[str]:
    """The C++ compiler command: ``$CXX`` (split as a shell would) or ``g++``."""
    return shlex.split(os.environ.get("CXX") or "g++")


def mpi_flags() -> tuple:
    """Compile and link flags for the MPI transport between nodes, from Open MPI's
    ``mpicxx --showme``; empty (no MPI: jobs stay on one node) when Open MPI's
    development files are missing or ``TF_SMB_WITH_MPI=0``."""
    if os.environ.get("TF_SMB_WITH_MPI", "1").strip().lower() in ("0", "false", "no"):
        return [], []
    try:
        compile_flags = subprocess.run(["mpicxx", "--showme:compile"], capture_output=True,
                                       text=True, timeout=60, check=True).stdout.split()
        link_flags = subprocess.run(["mpicxx", "--showme:link"], capture_output=True,
                                    text=True, timeout=60, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return [], []
    # Only the C library: the C++ bindings are not used.
    link_flags = [f for f in link_flags if f != "-lmpi_cxx"]
    # OMPI_SKIP_MPICXX: mpi.h without the C++ bindings (and their symbols).
    return compile_flags + ["-DTF_SMB_WITH_MPI", "-DOMPI_SKIP_MPICXX=1"], link_flags


def mpi_header_identity(compile_flags: Sequence[str]) -> str:
    """A digest of the ``mpi.h`` that ``compile_flags``' include folders lead to
    ("" when none does). Paths are left out of the cache keys (so checkouts share
    objects), so this is what tells an Open MPI upgraded in place from the one the
    cached MPI transport was compiled against."""
    folders = [f[2:] or (compile_flags[i + 1] if i + 1 < len(compile_flags) else "")
               for i, f in enumerate(compile_flags) if f.startswith("-I")]
    for folder in folders:
        try:
            with open(os.path.join(folder, "mpi.h"), "rb") as f:
                return "mpi.h:" + hashlib.sha256(f.read()).hexdigest()[:16]
        except OSError:
            continue
    return ""


def _flags(tf: types.ModuleType) -> Tuple[List[str], List[str], List[str]]:
    """(flags for compiling every source, flags added for the sources of the MPI
    transport, link flags)."""
    mpi_compile, mpi_link = mpi_flags()
    return (list(tf.sysconfig.get_compile_flags()) + list(EXTRA_COMPILE_FLAGS), mpi_compile,
            list(tf.sysconfig.get_link_flags()) + list(EXTRA_LINK_FLAGS) + mpi_link)


def _read(root: str, rel: str, files: Dict[str, bytes]) -> bytes:
    """The bytes of ``rel`` under ``root``, read once per build (``files`` keeps them)."""
    if rel not in files:
        with open(os.path.join(root, rel), "rb") as f:
            files[rel] = f.read()
    return files[rel]


def _uses_mpi(root: str, rel: str, files: Dict[str, bytes]) -> bool:
    """Whether a source tests TF_SMB_WITH_MPI, so needs MPI's flags. Only these
    get them: the other objects are then the same with or without MPI, and a
    build without MPI reuses them from the object cache."""
    return MPI_MACRO in _read(root, rel, files)


def _includes(root: str, rel: str, files: Dict[str, bytes], found: Optional[Set[str]] = None,
              outside: Optional[Set[str]] = None) -> Tuple[Set[str], Set[str]]:
    """({``rel`` and every header of the include root it includes, at any depth},
    the quoted includes found outside the root, e.g. TensorFlow's); ``files``: the
    bytes read so far (`_read`)."""
    found = set() if found is None else found
    outside = set() if outside is None else outside
    if rel not in found:
        found.add(rel)
        for header in _INCLUDE.findall(_read(root, rel, files)):
            header = header.decode()
            if header in files or os.path.isfile(os.path.join(root, header)):
                _includes(root, header, files, found, outside)
            else:
                outside.add(header)
    return found, outside


def cache_root() -> str:
    """``$TF_SMB_CACHE`` or ``~/.cache/tf_smb``: where compiled libraries are kept."""
    return os.path.abspath(os.path.expanduser(
        os.environ.get("TF_SMB_CACHE") or os.path.join("~", ".cache", "tf_smb")))


def cache_dir(root: str, tf: Optional[types.ModuleType] = None) -> str:
    """The cache directory for the sources under ``root`` and the running TensorFlow.

    Its name is ``<TensorFlow version>-<key>``; the key hashes the sources, the
    compiler command and the flags other than paths, so two environments with the
    same TensorFlow version share one library.
    """
    tf = tf or _import_tensorflow()
    compile_flags, mpi_compile, link_flags = _flags(tf)
    h = hashlib.sha256(source_digest(root).encode())
    for flag in compiler() + compile_flags + mpi_compile + link_flags:
        if not flag.startswith(("-I", "-L")):
            h.update(flag.encode() + b"\0")
    h.update(mpi_header_identity(mpi_compile).encode() + b"\0")
    h.update(sys.platform.encode() + os.uname().machine.encode())
    return os.path.join(cache_root(), "ops", f"{tf.__version__}-{h.hexdigest()[:16]}")


def _run_tool(cmd: Sequence[str], what: str, cwd: Optional[str] = None) -> None:
    try:
        proc = subprocess.run(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=COMPILE_TIMEOUT_S, check=False, cwd=cwd)
    except FileNotFoundError as e:
        raise OpLibraryError(
            f"tf_smb: cannot run the C++ compiler {cmd[0]!r} ({e}). Compiling the "
            "TensorFlow op library needs a C++17 compiler: install g++ (e.g. "
            "`apt-get install g++`) or name one in $CXX") from e
    except subprocess.TimeoutExpired as e:
        raise OpLibraryError(
            f"tf_smb: {what} took more than {COMPILE_TIMEOUT_S:.0f} s; command: "
            f"{shlex.join(cmd)}") from e
    if proc.returncode != 0:
        output = proc.stdout.decode("utf-8", errors="replace")
        if len(output) > ERROR_OUTPUT_CHARS:
            output = "...\n" + output[-ERROR_OUTPUT_CHARS:]
        raise OpLibraryError(
            f"tf_smb: {what} failed (exit code {proc.returncode}).\n"
            f"Command: {shlex.join(cmd)}\nCompiler output:\n{output}")


def _object_cache(fallback: str) -> str:
    """``$TF_SMB_CACHE/objects``, where compiled sources are kept for later builds;
    ``fallback`` (no reuse) when it cannot be written."""
    directory = os.path.join(cache_root(), "objects")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError:
        return fallback
    return directory if os.access(directory, os.W_OK) else fallback


def _compiler_identity(compiler: Sequence[str]) -> str:
    """The compiler's resolved file, size and mtime, and its arguments: a changed
    or upgraded compiler gives other objects."""
    binary = shutil.which(compiler[0]) or compiler[0]
    try:
        info = os.stat(binary)
        identity = f"{os.path.realpath(binary)}:{info.st_size}:{info.st_mtime_ns}"
    except OSError:
        identity = binary  # not found: compiling will say so
    return "\0".join([identity, *compiler[1:]])


def _object_key(root: str, rel: str, compiler_identity: str, flags: Sequence[str],
                context: str, outside_context: str, files: Dict[str, bytes]) -> str:
    """Hashes what the object of ``rel`` is made from: the file and the headers of
    the include root it includes, the compiler (`_compiler_identity`), the flags
    other than paths and ``context``; and ``outside_context`` (e.g. TensorFlow's
    version, whose headers the include paths lead to) when it includes headers from
    outside the root. The core includes none, so its objects serve every TensorFlow.
    ``files``: the bytes read so far (`_read`)."""
    h = hashlib.sha256(context.encode() + b"\0" + compiler_identity.encode() + b"\0")
    for flag in flags:
        if not flag.startswith(("-I", "-L")):
            h.update(flag.encode() + b"\0")
    deps, outside = _includes(root, rel, files)
    if outside:
        h.update(outside_context.encode() + b"\0")
    for dep in sorted(deps):
        h.update(dep.encode() + b"\0" + files[dep] + b"\0")
    return h.hexdigest()[:20]


def _compile_object(command: List[str], cwd: str, obj: str, what: str) -> None:
    """Runs ``command`` (whose output is ``obj``) into a temporary name, then renames
    it to ``obj``, so that a concurrent build never links a partial object."""
    partial = f"{obj}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        _run_tool(command + ["-o", partial], what, cwd=cwd)
        os.replace(partial, obj)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _prune_objects(directory: str) -> None:
    """Removes objects (and leftovers of interrupted builds) unused for
    OBJECT_CACHE_DAYS days."""
    cutoff = time.time() - OBJECT_CACHE_DAYS * 86400
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            if entry.name.endswith((".o", ".tmp")) and entry.stat().st_mtime < cutoff:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def compile_objects(root: str, sources: Sequence[Tuple[str, List[str]]], tmp: str,
                    context: str = "", outside_context: str = "",
                    jobs: Optional[int] = None,
                    files: Optional[Dict[str, bytes]] = None,
                    source_context: Optional[Mapping[str, str]] = None) -> List[str]:
    """The objects of ``sources`` (each a path under ``root`` and its compile flags),
    compiled ``jobs`` at a time (default: the CPUs this process may use) where the
    object cache lacks them; ``tmp`` holds them when the cache cannot be written.

    Each object is kept in the object cache (`_object_cache`) under a key of what
    it is made from (`_object_key`), so a later build compiles only the sources
    whose object changed: after an edit, the edited sources and those that
    include an edited header. ``files``: the bytes of files under ``root`` the
    caller read already (`_read`), so each file is read once per build.
    ``source_context``: more of the key for some sources (e.g. the MPI transport:
    `mpi_header_identity`).

    Raises:
      OpLibraryError: the compiler is missing or fails (with its output).
    """
    cxx = compiler()
    identity = _compiler_identity(cxx)
    cache = _object_cache(tmp)
    files = {} if files is None else files
    objects, builds = [], []
    for rel, flags in sources:
        extra = (source_context or {}).get(rel)
        key = _object_key(root, rel, identity, flags,
                          context if extra is None else f"{context}\0{extra}", outside_context,
                          files)
        obj = os.path.join(cache, f"{os.path.basename(rel)}-{key}.o")
        objects.append(obj)
        if os.path.exists(obj):
            os.utime(obj)  # used: kept by _prune_objects
        else:
            # Given relative to the root (the compiler's working directory), so the
            # object names no checkout's path (__FILE__) and serves any.
            builds.append((cxx + flags + ["-I", root, "-c", rel], root, obj,
                           f"compiling {os.path.basename(rel)}"))
    with concurrent.futures.ThreadPoolExecutor(
            max_workers=jobs or max(1, len(os.sched_getaffinity(0)))) as pool:
        futures = [pool.submit(_compile_object, *build) for build in builds]
        for future in futures:
            future.result()  # the first failure, in source order
    if cache != tmp:
        _prune_objects(cache)
    return objects


def compile_library(root: str, output: str, tf: Optional[types.ModuleType] = None,
                    jobs: Optional[int] = None) -> None:
    """Compiles the sources under ``root`` into the op library ``output``.

    One compiler process per source file whose object the object cache lacks
    (`compile_objects`), then one link. Only the sources that test
    TF_SMB_WITH_MPI get MPI's flags, so a build without MPI compiles the MPI
    transport alone; only those that include TensorFlow's headers depend on its
    version. The library carries a build record (see `read_build_record`).
    Writes ``output`` directly; callers that need atomicity pass a temporary
    name and rename it.

    Raises:
      OpLibraryError: the compiler is missing or fails (with its output).
    """
    tf = tf or _import_tensorflow()
    compile_flags, mpi_compile, link_flags = _flags(tf)
    cxx = compiler()
    sources = [s for s in source_files(root) if s.endswith(".cc")]
    if not sources:
        raise OpLibraryError(f"tf_smb: no C++ sources under {root}")
    files: Dict[str, bytes] = {}
    mpi_sources = {rel for rel in sources if _uses_mpi(root, rel, files)}
    mpi_header = mpi_header_identity(mpi_compile)
    with tempfile.TemporaryDirectory(prefix="tf_smb_ops_build_") as tmp:
        objects = compile_objects(
            root, [(rel, compile_flags + (mpi_compile if rel in mpi_sources else []))
                   for rel in sources],
            tmp, outside_context=f"tensorflow={tf.__version__}", jobs=jobs, files=files,
            source_context={rel: mpi_header for rel in mpi_sources})
        record = os.path.join(tmp, "build_record.cc")
        with open(record, "w") as f:
            f.write(_build_record_source(tf.__version__, source_digest(root),
                                         with_mpi=bool(mpi_compile)))
        objects.append(os.path.join(tmp, "build_record.o"))
        _compile_object(cxx + compile_flags + ["-c", record], tmp, objects[-1],
                        "compiling the build record")
        link_library(objects, output, link_flags, "the op library")


def link_library(objects: Sequence[str], output: str, link_flags: Sequence[str],
                 what: str) -> None:
    """Links ``objects`` into the shared library ``output`` (``what``, for errors)."""
    _run_tool(compiler() + ["-shared", "-o", output, *objects, *link_flags], f"linking {what}")


@contextlib.contextmanager
def locked(path: str) -> Iterator[None]:
    """Holds an exclusive fcntl lock on ``path`` (created if missing)."""
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _compile_allowed() -> bool:
    return os.environ.get("TF_SMB_COMPILE", "1").strip().lower() not in ("0", "false", "no")


def cached_library(root: str, tf: Optional[types.ModuleType] = None) -> str:
    """The cached library for ``root``'s sources and the running TensorFlow, compiled
    first if the cache lacks it; returns its path.

    Processes that start together compile once: the first takes a file lock and
    compiles into a temporary name that it renames into place; the others wait
    for the lock and find the library.
    """
    tf = tf or _import_tensorflow()
    directory = cache_dir(root, tf)
    path = os.path.join(directory, LIBRARY_NAME)
    if os.path.exists(path):
        return path
    if not _compile_allowed():
        raise OpLibraryError(
            f"tf_smb: the TensorFlow op library is not built for TensorFlow "
            f"{tf.__version__} (nothing in {directory} and no matching library in "
            f"{_PACKAGE_DIR}), and TF_SMB_COMPILE=0 forbids compiling it on import. "
            "Unset TF_SMB_COMPILE, or build it at install time with TensorFlow "
            "installed: `pip install --no-build-isolation .` (or `python setup.py "
            "build_ext --inplace` in a source checkout)")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise OpLibraryError(
            f"tf_smb: cannot create the op library cache {directory} ({e}); "
            "set TF_SMB_CACHE to a writable directory") from e
    with locked(os.path.join(directory, ".lock")):
        if os.path.exists(path):  # another process compiled it while we waited
            return path
        print(f"tf_smb: compiling the TensorFlow op library for TensorFlow "
              f"{tf.__version__} (once, about a minute) into {directory} ...",
              file=sys.stderr, flush=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".so", dir=directory)
        os.close(fd)
        try:
            compile_library(root, tmp, tf)
            os.chmod(tmp, 0o755)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def _build_record_source(tf_version: str, digest: str, with_mpi: bool = False) -> str:
    """C++ for the build record: which TensorFlow and sources the library is from,
    and whether it has the MPI transport between nodes."""
    record = f"tensorflow={tf_version};sources={digest};mpi={int(with_mpi)};"
    if not re.fullmatch(r"[\w.+=;-]*", record):
        raise OpLibraryError(f"tf_smb: unexpected TensorFlow version {tf_version!r}")
    return ("// Generated by tf_smb/op_library.py.\n"
            'extern "C" __attribute__((visibility("default"), used))\n'
            f'const char tf_smb_build_record[] = "{BUILD_RECORD_TAG.decode()}{record}";\n')


def read_build_record(library: str) -> Optional[dict]:
    """The build record compiled into ``library`` as a dict (keys ``tensorflow``
    and ``sources``), or None when the file is unreadable or has none."""
    try:
        with open(library, "rb") as f:
            data = f.read()
    except OSError:
        return None
    start = data.find(BUILD_RECORD_TAG)
    if start < 0:
        return None
    end = data.find(b"\0", start)
    text = data[start + len(BUILD_RECORD_TAG):end if end >= 0 else None].decode(
        "ascii", errors="replace")
    return dict(item.split("=", 1) for item in text.split(";") if "=" in item)


def installed_library(root: Optional[str], tf_version: str) -> Optional[str]:
    """The library built at install time, if its build record matches ``tf_version``
    and (when the sources are at hand) the current sources; else None."""
    for library in sorted(glob.glob(os.path.join(_PACKAGE_DIR, "_smb_ops*.so"))):
        record = read_build_record(library)
        if record is None or record.get("tensorflow") != tf_version:
            continue
        if root is not None and record.get("sources") != source_digest(root):
            continue  # a checkout whose sources changed since the build
        if (record.get("mpi") == "1") != bool(mpi_flags()[0]):
            # Built before Open MPI's development files were installed, or with
            # them where MPI is not wanted now (TF_SMB_WITH_MPI=0, no mpicxx).
            continue
        return library
    return None


def library_path() -> str:
    """The path of an op library for the running TensorFlow, compiling it if needed.

    Raises:
      OpLibraryError: TensorFlow is missing, the sources are missing, or compiling
        is impossible or fails.
    """
    tf = _import_tensorflow()
    root = source_root()
    library = installed_library(root, tf.__version__)
    if library is not None:
        return library
    if root is None:
        raise OpLibraryError(
            f"tf_smb: no TensorFlow op library for TensorFlow {tf.__version__} in "
            f"{_PACKAGE_DIR} and no C++ sources to compile one (expected "
            f"{os.path.join(_PACKAGE_DIR, PACKAGED_SOURCES, 'cc')}). Reinstall tf_smb "
            "(`pip install .` in its source checkout), or in a source checkout run "
            "`python setup.py build_ext --inplace`")
    return cached_library(root, tf)


def load() -> types.ModuleType:
    """Loads the op library for the running TensorFlow (once per process) and returns it.

    Compiles it first when neither the install nor the cache has one (see the
    module docstring).

    Raises:
      OpLibraryError: the library cannot be found, compiled or loaded.
    """
    global _LIB
    if _LIB is None:
        path = library_path()
        tf = _import_tensorflow()
        try:
            _LIB = tf.load_op_library(path)
        except (tf.errors.NotFoundError, OSError) as e:
            raise OpLibraryError(
                f"tf_smb: cannot load the TensorFlow op library {path} with "
                f"TensorFlow {tf.__version__}: {e}. If TensorFlow changed since it "
                "was built, reinstall tf_smb, or remove that file to have it "
                "compiled again") from e
    return _LIB


def _main() -> int:
    """``python -m tf_smb.op_library``: compiles (if needed) and prints the path."""
    start = time.monotonic()
    try:
        load()
    except OpLibraryError as e:
        print(e, file=sys.stderr)
        return 1
    print(f"{library_path()} ({time.monotonic() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
