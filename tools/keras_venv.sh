#!/usr/bin/env bash
# Prints the path of a virtual environment with one tested TensorFlow + Keras pair,
# creating it first when it is missing. The venvs live outside the repository
# ($TF_SMB_CACHE/venvs, default ~/.cache/tf_smb/venvs) and are reused while the pair's
# requirements stay the same; the checkout is on their path (a .pth file), and the op
# library compiles against their TensorFlow on first import (tf_smb/op_library.py).
#   bash tools/keras_venv.sh tf2.16      # TensorFlow 2.16.2 + Keras 3.3.3
#   bash tools/keras_venv.sh tf2.19      # TensorFlow 2.19 + Keras 3.10
#   bash tools/keras_venv.sh next        # TensorFlow 2.21 + the pinned keras-nightly
#   bash tools/keras_venv.sh newest      # TensorFlow 2.21 + the newest keras-nightly
#                                        # (the canary; always reinstalled)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
CACHE=${TF_SMB_CACHE:-$HOME/.cache/tf_smb}
pair=${1:?"usage: tools/keras_venv.sh tf2.16|tf2.19|next|newest"}
# What every pair's tests need besides TensorFlow and Keras.
common="numpy absl-py tensorboard pybind11 setuptools wheel scikit-learn pytest pytest-xdist"
nightly=""
case "$pair" in
  tf2.16) tf="tensorflow-cpu==2.16.2"; keras="keras==3.3.3" ;;
  tf2.19) tf="tensorflow-cpu==2.19.*"; keras="keras==3.10.*" ;;
  next) tf="tensorflow-cpu==2.21.*"; keras=""; nightly="keras-nightly==3.16.0.dev2026102704" ;;
  newest) tf="tensorflow-cpu==2.21.*"; keras=""; nightly="keras-nightly" ;;
  *) echo "tools/keras_venv.sh: unknown pair '$pair' (expected tf2.16, tf2.19, next or newest)" >&2
     exit 2 ;;
esac
spec="$tf $keras $nightly $common"
key=$(printf '%s' "$spec" | sha256sum | cut -c1-12)
venv="$CACHE/venvs/$pair-$key"
stamp="$venv/.tf_smb-complete"
if [ "$pair" = newest ] || [ ! -f "$stamp" ]; then
  echo "tools/keras_venv.sh: installing $spec into $venv" >&2
  rm -rf "$venv"
  mkdir -p "$CACHE/venvs"
  "$PYTHON" -m venv "$venv"
  pip=("$venv/bin/python" -m pip)
  "${pip[@]}" install -q --upgrade pip >&2
  # shellcheck disable=SC2086
  "${pip[@]}" install -q $tf $keras $common >&2
  if [ -n "$nightly" ]; then
    # keras-nightly installs into the same `keras` folder as keras: one or the other.
    "${pip[@]}" uninstall -q -y keras >&2
    "${pip[@]}" install -q "$nightly" >&2
  fi
  touch "$stamp"
fi
# The checkout on the venv's path (what an editable install does, without building
# into the checkout: tf_smb._box is TensorFlow-free and shared with .venv's build).
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$PWD" > "$site/tf_smb_checkout.pth"
echo "$venv"
