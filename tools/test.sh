#!/usr/bin/env bash
# Installs what the tests need and runs the whole suite (what CI runs).
#   bash tools/test.sh            # everything
#   bash tools/test.sh --quick    # the quick tier (tests/conftest.py's QUICK), ~5 minutes
#   bash tools/test.sh ARGS...    # extra pytest arguments (e.g. -k NAME, tests/test_x.py)
set -uo pipefail
cd "$(dirname "$0")/.."
select=()
if [ "${1:-}" = "--quick" ]; then
  shift
  select=(-m quick)
fi
bash tools/install.sh --test || exit 1
# The reference strategy's tests need Horovod (built once, then cached).
bash tools/install_horovod.sh || exit 1
VENV=${TF_SMB_VENV:-.venv}
# Test files run on TF_SMB_TEST_WORKERS pytest-xdist workers (default 2; 1: one
# process, in order), a file's tests together on one worker (their module fixtures,
# e.g. simulated nodes, are shared).
workers=${TF_SMB_TEST_WORKERS:-2}
parallel=()
[ "$workers" -gt 1 ] && parallel=(-n "$workers" --dist loadfile)
start=$(date +%s)
# --durations: the slowest tests, to keep the suite's time in view.
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=25 "${parallel[@]}" \
  "${select[@]}" tests "$@"
rc=$?
echo "tools/test.sh: the tests took $(( $(date +%s) - start )) s" >&2
# pytest exits 5 when it collected no tests: say so and fail loudly.
if [ "$rc" -eq 5 ]; then
  echo "tools/test.sh: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
