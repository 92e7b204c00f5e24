#!/usr/bin/env bash
# Installs what the tests need and runs them (tests/conftest.py declares the tiers).
#   bash tools/test.sh            # the fast tier: what CI runs on every change (~14.5 minutes)
#   bash tools/test.sh --full     # both tiers, then the Keras-facing tests on every other
#                                 # tested pair: the conformance proofs (~40 minutes); run it
#                                 # before calling an issue resolved
#   bash tools/test.sh --quick    # the quick tier (tests/conftest.py's QUICK), under 3 minutes
#   bash tools/test.sh --keras PAIR   # the Keras-facing tests on one tested TensorFlow +
#                                     # Keras pair (tools/keras_venv.sh: tf2.16, tf2.19, next)
#   bash tools/test.sh --keras-next   # the canary: the same on the newest keras-nightly
#   bash tools/test.sh [--full] ARGS...  # extra pytest arguments within the tier
#                                        # (e.g. -k NAME, tests/test_x.py)
# TF_SMB_KERAS_PAIRS="" leaves the other pairs out of --full.
set -uo pipefail
cd "$(dirname "$0")/.."
select=(-m "not full")
pair=""
full=0
case "${1:-}" in
  --full) shift; select=(); full=1 ;;
  --quick) shift; select=(-m quick) ;;
  --keras) pair=${2:?"--keras needs a pair (see tools/keras_venv.sh)"}; shift 2 ;;
  --keras-next) shift; pair=newest ;;
esac
# (The pairs below run after the suite's own install: TF_SMB_INSTALLED=1.)
[ "${TF_SMB_INSTALLED:-0}" = 1 ] || bash tools/install.sh --test || exit 1
# --full also runs Slurm's daemons on simulated nodes (tests/test_slurm.py): Debian's
# Slurm, munge and Slurm's MPI plugins (PMIx), installed only for it.
if [ "$full" = 1 ] && { ! command -v slurmctld >/dev/null 2>&1 || ! command -v slurmd >/dev/null 2>&1 ||
    ! command -v srun >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1 ||
    ! dpkg -s slurm-wlm-basic-plugins >/dev/null 2>&1; }; then
  echo "tools/test.sh: installing Slurm for --full (slurmctld slurmd slurm-client munge slurm-wlm-basic-plugins)" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge slurm-wlm-basic-plugins >/dev/null || exit 1
fi
VENV=${TF_SMB_VENV:-.venv}
if [ -n "$pair" ]; then
  VENV=$(bash tools/keras_venv.sh "$pair") || exit 1
  select=(-m keras)
else
  # The reference strategy's tests need Horovod (built once, then cached).
  bash tools/install_horovod.sh || exit 1
fi
# Test files run on TF_SMB_TEST_WORKERS pytest-xdist workers (default 2; 1: one
# process, in order), a file's tests together on one worker (their module fixtures,
# e.g. simulated nodes, are shared), in the order tests/conftest.py gives them
# (longest first; pytest-xdist would otherwise reorder files by their test count).
workers=${TF_SMB_TEST_WORKERS:-2}
parallel=()
[ "$workers" -gt 1 ] && parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
start=$(date +%s)
# --durations: the slowest tests, to keep the suite's time in view.
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=25 "${parallel[@]}" \
  "${select[@]}" tests "$@"
rc=$?
echo "tools/test.sh: the tests took $(( $(date +%s) - start )) s" >&2
# pytest exits 5 when it collected no tests: say so and fail loudly.
if [ "$rc" -eq 5 ]; then
  echo "tools/test.sh: pytest selected no tests (a test of the full tier needs --full)" >&2
  rc=1
fi
if [ "$full" = 1 ] && [ $# -eq 0 ]; then
  for other in ${TF_SMB_KERAS_PAIRS-tf2.16 tf2.19 next}; do
    echo "tools/test.sh: the Keras-facing tests on $other" >&2
    TF_SMB_INSTALLED=1 bash tools/test.sh --keras "$other"
    pair_rc=$?
    [ "$rc" -eq 0 ] && rc=$pair_rc
  done
  echo "tools/test.sh: --full took $(( $(date +%s) - start )) s" >&2
fi
exit "$rc"
