#!/usr/bin/env bash
# Runs Debian's offline bazel-bootstrap (Bazel 4) on this workspace: rules_cc
# and rules_java, which it would download, are local stand-ins.
#   bash tools/bazel.sh build //:_smb_ops.so //:smb_core_test
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
cmd=$1
shift
export PYTHON_BIN_PATH=${PYTHON_BIN_PATH:-$root/.venv/bin/python}
# Build outputs are reused across checkouts (a clean clone rebuilds nothing
# unchanged) from a disk cache beside the op library's: $TF_SMB_CACHE/bazel.
cache=()
case "$cmd" in
  build|test|run) cache=(--disk_cache="${TF_SMB_CACHE:-$HOME/.cache/tf_smb}/bazel") ;;
esac
exec bazel "$cmd" "${cache[@]}" \
  --override_repository=rules_cc="$root/third_party/bazel/rules_cc" \
  --override_repository=rules_java="$root/third_party/bazel/rules_java" "$@"
