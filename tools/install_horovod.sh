#!/usr/bin/env bash
# Installs Horovod 0.28.1 (the reference strategy's backend) into the venv,
# built for the installed TensorFlow with Gloo and Open MPI.
#
# Horovod 0.28.1 does not build against TF 2.21 as published: its
# horovod/tensorflow/xla_mpi_ops.cc includes a header TF 2.21 no longer has.
# That file only serves XLA/GPU, so a CPU build leaves it out. CMake 4 refuses
# Gloo's old cmake_minimum_required; CMAKE_POLICY_VERSION_MINIMUM=3.5 lets it
# configure. The build takes 3-4 minutes on 2 cores, so the wheel is cached
# outside the repository ($TF_SMB_CACHE, default ~/.cache/tf_smb) and reused.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TF_SMB_VENV:-.venv}
PY="$VENV/bin/python"
CACHE=${TF_SMB_CACHE:-$HOME/.cache/tf_smb}
HVD_VERSION=0.28.1

if "$PY" -c "import horovod.tensorflow" >/dev/null 2>&1; then
  exit 0
fi

if ! dpkg -s libopenmpi-dev >/dev/null 2>&1; then
  echo "tools/install_horovod.sh: installing Open MPI headers (libopenmpi-dev)" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libopenmpi-dev openmpi-bin >/dev/null
fi

# Horovod's runtime dependencies, and what its build needs.
"$PY" -m pip install -q cloudpickle psutil pyyaml packaging cmake

tf_version=$("$PY" -c "import tensorflow as tf; print(tf.__version__)")
py_tag=$("$PY" -c "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')")
wheel_dir="$CACHE/horovod-$HVD_VERSION-tf$tf_version-$py_tag"
wheel=$(ls "$wheel_dir"/horovod-*.whl 2>/dev/null | head -n 1 || true)

if [ -z "$wheel" ]; then
  echo "tools/install_horovod.sh: building Horovod $HVD_VERSION for TensorFlow $tf_version" \
       "(3-4 minutes on 2 cores; cached in $wheel_dir for next time)" >&2
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HVD_VERSION" -d "$work"
  tar -xzf "$work/horovod-$HVD_VERSION.tar.gz" -C "$work"
  src="$work/horovod-$HVD_VERSION"
  sed -i '/xla_mpi_ops.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"
  mkdir -p "$wheel_dir"
  PATH="$VENV/bin:$PATH" \
  CMAKE_POLICY_VERSION_MINIMUM=3.5 \
  HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
  HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
  MAKEFLAGS="-j$(nproc)" \
    "$PY" -m pip wheel -q --no-build-isolation --no-deps "$src" -w "$work/out"
  cp "$work"/out/horovod-*.whl "$wheel_dir/"
  wheel=$(ls "$wheel_dir"/horovod-*.whl | head -n 1)
fi

"$PY" -m pip install -q --no-deps "$wheel"
"$PY" -c "import horovod.tensorflow as hvd; print('horovod', hvd.__version__ if hasattr(hvd, '__version__') else '')" >&2
