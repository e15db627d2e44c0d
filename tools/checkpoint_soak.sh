#!/usr/bin/env bash
# Soak test of checkpoint crash consistency: runs the kill -9 tests many
# times with fresh random seeds and prints every failing seed.
#
#   bash tools/checkpoint_soak.sh [ROUNDS] [TRIALS_PER_ROUND]
#
# Each round runs //checkpoint:crash_test (a child writing a checkpoint is
# SIGKILLed at a random moment, TRIALS_PER_ROUND times) with its own seed.
# Defaults: 10 rounds x 100 trials. Exit status 1 if any round failed.
set -uo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-10}
trials=${2:-100}

bazel build //checkpoint:crash_test >/dev/null 2>&1 || { echo "build failed"; exit 1; }
bin=bazel-bin/checkpoint/crash_test

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=0
for round in $(seq 1 "$rounds"); do
  seed=$(( (RANDOM << 15) | RANDOM ))
  mkdir -p "$work/$round"
  if TEST_TMPDIR="$work/$round" CKPT_CRASH_TRIALS="$trials" CKPT_CRASH_SEED="$seed" \
      "$bin" >"$work/log" 2>&1; then
    echo "round $round seed $seed: ok: $(grep -m1 'kills:' "$work/log")"
  else
    failed=$((failed + 1))
    echo "round $round seed $seed: FAILED"
    tail -n 30 "$work/log"
  fi
  rm -rf "${work:?}/$round"
done
echo "$((rounds - failed)) of $rounds rounds passed ($((rounds * trials)) kills in all)"
[ "$failed" -eq 0 ]
