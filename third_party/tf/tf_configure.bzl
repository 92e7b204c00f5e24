"""Repository rule: TensorFlow's headers and framework library from the
pip-installed TensorFlow (the approach of tensorflow/custom-op's configure)."""

def _tf_configure_impl(ctx):
    python = ctx.os.environ.get("PYTHON_BIN_PATH", "python3")
    result = ctx.execute([python, "-c", "\n".join([
        "import tensorflow as tf",
        "print(tf.sysconfig.get_include())",
        "print(tf.sysconfig.get_lib())",
    ])], quiet = True)
    if result.return_code != 0:
        fail("cannot import tensorflow with %s (set PYTHON_BIN_PATH): %s" % (python, result.stderr))
    lines = result.stdout.strip().splitlines()
    include_dir, lib_dir = lines[-2], lines[-1]
    ctx.symlink(include_dir, "include")
    ctx.symlink(lib_dir + "/libtensorflow_framework.so.2", "libtensorflow_framework.so.2")
    ctx.file("BUILD", """
cc_library(
    name = "tf_header_lib",
    hdrs = glob(["include/**/*.h", "include/**/*.inc", "include/**"], allow_empty = True),
    includes = ["include"],
    defines = ["_GLIBCXX_USE_CXX11_ABI=1", "EIGEN_MAX_ALIGN_BYTES=64"],
    visibility = ["//visibility:public"],
)

cc_import(
    name = "libtensorflow_framework",
    shared_library = "libtensorflow_framework.so.2",
    visibility = ["//visibility:public"],
)
""")

tf_configure = repository_rule(
    implementation = _tf_configure_impl,
    environ = ["PYTHON_BIN_PATH"],
    local = True,
)
