"""Builds tf_smb; its metadata and dependencies are in pyproject.toml.

* `tf_smb._box`, the box core as a Python module (pybind11, no TensorFlow).
* The C++ sources of the TensorFlow op library, copied into the package
  (tf_smb/_src/cc) so that tf_smb can compile the library on first import
  against the TensorFlow it runs with (see tf_smb/op_library.py).
* `tf_smb._smb_ops`, the op library itself, only when TensorFlow is importable
  during the build: `pip install --no-build-isolation .` after installing
  TensorFlow (what tools/install.sh does). A plain `pip install .` builds in an
  isolated environment without TensorFlow and leaves the library to the first
  import, which compiles it once into a cache.
"""
import glob
import importlib.util
import os
import sys
import sysconfig
import tempfile

import pybind11
from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
CORE_SOURCES = sorted(glob.glob("cc/smb/**/*.cc", recursive=True))
COMMON_FLAGS = ["-std=c++17", "-O3", "-fvisibility=hidden", "-Wall"]
BOX_EXTENSION = "tf_smb._box"
OPS_EXTENSION = "tf_smb._smb_ops"


def _op_library_module():
    """tf_smb/op_library.py, loaded by path (importing the package is not needed)."""
    spec = importlib.util.spec_from_file_location(
        "_tf_smb_op_library_for_setup", os.path.join(HERE, "tf_smb", "op_library.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


op_library = _op_library_module()


def _build_tensorflow():
    """The TensorFlow of the build environment, or None when there is none."""
    if importlib.util.find_spec("tensorflow") is None:
        return None
    try:
        import tensorflow as tf
    except Exception as e:  # a broken TensorFlow: leave the library to the first import
        print(f"setup.py: TensorFlow is installed but does not import ({e}); the op "
              "library will be compiled on first import instead", file=sys.stderr)
        return None
    return tf


class BuildPy(build_py):
    """Also copies the op library's C++ sources into the package (tf_smb/_src/cc)."""

    def _source_copies(self):
        target = os.path.join(self.build_lib, "tf_smb", op_library.PACKAGED_SOURCES)
        return [(rel, os.path.join(target, rel)) for rel in op_library.source_files(HERE)]

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install compiles from the checkout's cc/
        for rel, dest in self._source_copies():
            self.mkpath(os.path.dirname(dest))
            self.copy_file(os.path.join(HERE, rel), dest, preserve_mode=False)

    def get_outputs(self, include_bytecode=1):
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        return outputs + [dest for _, dest in self._source_copies()]


class BuildExt(build_ext):
    """Builds the extensions in parallel; the op library with op_library's recipe
    (the same one the first import uses)."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = True  # _box and the op library side by side

    def run(self):
        self._tf = _build_tensorflow()  # imported here only: metadata hooks stay fast
        if self._tf is None:
            print("setup.py: TensorFlow is not importable in the build environment; "
                  "tf_smb will compile its TensorFlow op library on first import",
                  file=sys.stderr)
            self.extensions = [e for e in self.extensions if e.name != OPS_EXTENSION]
            # Leave no library from an earlier build in build/ (it would ship).
            stale = os.path.join(self.build_lib, "tf_smb")
            for path in glob.glob(os.path.join(stale, "_smb_ops*.so")):
                os.remove(path)
        super().run()

    def build_extension(self, ext):
        if ext.name == BOX_EXTENSION:
            self._build_box(ext)
            return
        if ext.name != OPS_EXTENSION:
            super().build_extension(ext)
            return
        tf = self._tf
        output = os.path.abspath(self.get_ext_fullpath(ext.name))
        record = op_library.read_build_record(output)
        if (not self.force and record is not None
                and record.get("tensorflow") == tf.__version__
                and record.get("sources") == op_library.source_digest(HERE)):
            print(f"setup.py: {output} is up to date for TensorFlow {tf.__version__}")
            return
        print(f"setup.py: building the TensorFlow op library for TensorFlow {tf.__version__}")
        os.makedirs(os.path.dirname(output), exist_ok=True)
        op_library.compile_library(HERE, output, tf)

    def _build_box(self, ext):
        """_box with op_library's object cache: its sources compiled in parallel, and
        only those whose object the cache lacks (a rebuild after a Python-only
        change compiles nothing)."""
        includes = {sysconfig.get_paths()["include"], sysconfig.get_paths()["platinclude"]}
        # -DNDEBUG as Python's own CFLAGS gave it under setuptools (pybind11 asserts).
        flags = COMMON_FLAGS + ["-fPIC", "-DNDEBUG"] + [f"-I{d}" for d in
                                            sorted(includes) + ext.include_dirs]
        output = os.path.abspath(self.get_ext_fullpath(ext.name))
        os.makedirs(os.path.dirname(output), exist_ok=True)
        context = (f"python={sysconfig.get_config_var('SOABI')};"
                   f"pybind11={pybind11.__version__}")
        with tempfile.TemporaryDirectory(prefix="tf_smb_box_build_") as tmp:
            objects = op_library.compile_objects(
                HERE, [(s, flags) for s in ext.sources], tmp, context=context)
            op_library.link_library(objects, output, list(op_library.EXTRA_LINK_FLAGS),
                                    "tf_smb._box")


setup(
    packages=find_packages(include=["tf_smb", "tf_smb.*"]),
    ext_modules=[
        Extension(
            BOX_EXTENSION,
            sources=CORE_SOURCES + ["cc/python/box_module.cc"],
            include_dirs=[".", pybind11.get_include()],
            extra_compile_args=COMMON_FLAGS,
            language="c++",
        ),
        # Built by BuildExt with op_library's recipe, and only with TensorFlow.
        Extension(
            OPS_EXTENSION,
            sources=[s for s in op_library.source_files(HERE) if s.endswith(".cc")],
            language="c++",
        ),
    ],
    cmdclass={"build_py": BuildPy, "build_ext": BuildExt},
    zip_safe=False,
)
