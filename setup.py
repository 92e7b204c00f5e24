"""Builds tf_smb: the box core as a Python module and the TensorFlow op library.

The op library is compiled against the TensorFlow installed in the build
environment, so install with `pip install --no-build-isolation .` after
installing TensorFlow.
"""
import glob

import pybind11
from setuptools import Extension, find_packages, setup

CORE_SOURCES = sorted(glob.glob("cc/smb/**/*.cc", recursive=True))
COMMON_FLAGS = ["-std=c++17", "-O3", "-fvisibility=hidden", "-Wall"]


def tf_op_library() -> Extension:
    """The SMB ops, built with the flags of the installed TensorFlow."""
    import tensorflow as tf  # only needed at build time

    return Extension(
        "tf_smb._smb_ops",
        sources=CORE_SOURCES
        + sorted(glob.glob("cc/ops/*.cc"))
        + sorted(glob.glob("cc/kernels/*.cc")),
        include_dirs=["."],
        extra_compile_args=tf.sysconfig.get_compile_flags()
        + ["-O3", "-Wno-deprecated-declarations"],
        extra_link_args=tf.sysconfig.get_link_flags(),
        language="c++",
    )


setup(
    name="tf_smb",
    version="0.1.0",
    description="Soft Memory Box: a shared-memory tf.distribute strategy",
    packages=find_packages(include=["tf_smb", "tf_smb.*"]),
    python_requires=">=3.9",
    install_requires=["numpy", "absl-py"],
    ext_modules=[
        Extension(
            "tf_smb._box",
            sources=CORE_SOURCES + ["cc/python/box_module.cc"],
            include_dirs=[".", pybind11.get_include()],
            extra_compile_args=COMMON_FLAGS,
            language="c++",
        ),
        tf_op_library(),
    ],
    zip_safe=False,
)
