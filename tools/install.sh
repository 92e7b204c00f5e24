#!/usr/bin/env bash
# Installs everything tf_smb needs into .venv (system packages through apt-get
# when missing), then builds and installs tf_smb in editable mode.
#   bash tools/install.sh          # runtime + examples
#   bash tools/install.sh --test   # also what the test suite needs
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${TF_SMB_VENV:-.venv}
want_test=0
[ "${1:-}" = "--test" ] && want_test=1

have_build_tools() {
  command -v g++ >/dev/null 2>&1 && command -v "$PYTHON" >/dev/null 2>&1 &&
    "$PYTHON" - <<'PY' 2>/dev/null
import os, sysconfig, venv, ensurepip
assert os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
PY
}

if ! have_build_tools; then
  echo "tools/install.sh: installing system packages (g++, Python headers, venv)" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
    g++ python3 python3-dev python3-venv python3-pip >/dev/null
fi

# The tests also launch workers with Open MPI's mpirun (across simulated nodes:
# network namespaces from iproute2, unshare/nsenter from util-linux), build
# the op library's MPI transport (libopenmpi-dev) and build with Debian's
# offline Bazel.
if [ "$want_test" = 1 ] && { ! command -v mpirun >/dev/null 2>&1 || ! command -v mpicxx >/dev/null 2>&1 ||
    ! command -v bazel >/dev/null 2>&1 || ! command -v ip >/dev/null 2>&1 ||
    ! command -v nsenter >/dev/null 2>&1; }; then
  echo "tools/install.sh: installing Open MPI, Bazel and namespace tools (openmpi-bin libopenmpi-dev bazel-bootstrap iproute2 util-linux) for the tests" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openmpi-bin libopenmpi-dev \
    bazel-bootstrap iproute2 util-linux >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
if [ "$want_test" = 1 ]; then
  $PIP install -q -r requirements-test.txt
else
  $PIP install -q -r requirements.txt
fi
# The op library is compiled against the TensorFlow just installed.
$PIP install -q --no-build-isolation -e .
echo "tools/install.sh: tf_smb installed in $VENV" >&2
