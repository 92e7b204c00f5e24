#!/usr/bin/env bash
# Installs what the tests need and runs the whole suite (what CI runs).
set -uo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh --test || exit 1
# The reference strategy's tests need Horovod (built once, then cached).
bash tools/install_horovod.sh || exit 1
VENV=${TF_SMB_VENV:-.venv}
# --durations: the slowest tests, to keep the suite's time in view.
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=25 tests "$@"
rc=$?
# pytest exits 5 when it collected no tests: say so and fail loudly.
if [ "$rc" -eq 5 ]; then
  echo "tools/test.sh: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
