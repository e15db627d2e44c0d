#!/usr/bin/env bash
# Soak test of checkpoint crash consistency: runs the kill -9 tests many
# times with fresh random seeds and prints every failing seed.
#
#   bash tools/checkpoint_soak.sh [ROUNDS] [TRIALS_PER_ROUND]
#
# Each round runs, with its own seed:
#  - //checkpoint:crash_test: a child process writing a whole checkpoint
#    (shard files, manifest, KeepLast) is SIGKILLed at a random moment,
#    TRIALS_PER_ROUND times;
#  - //tests:checkpoint_kill_test: a coordinator and two daemon processes
#    checkpoint over gRPC while a daemon (then the coordinator) is SIGKILLed
#    at a random moment, TRIALS_PER_ROUND / 4 times each;
#  - //tests:checkpoint_server_kill_test: the same against real hybrid-paramd
#    processes, each kill followed by a restore on fresh processes,
#    TRIALS_PER_ROUND / 4 times each.
# Defaults: 10 rounds x 100 trials. Exit status 1 if any round failed.
set -uo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-10}
trials=${2:-100}

bazel build //checkpoint:crash_test //tests:checkpoint_kill_test \
  //tests:checkpoint_server_kill_test >/dev/null 2>&1 ||
  { echo "build failed"; exit 1; }
bin=bazel-bin/checkpoint/crash_test
kill_test=$PWD/bazel-bin/tests/checkpoint_kill_test
kill_runfiles=$kill_test.runfiles/hybrid_paramd
server_kill_test=$PWD/bazel-bin/tests/checkpoint_server_kill_test
server_kill_runfiles=$server_kill_test.runfiles/hybrid_paramd

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=0
for round in $(seq 1 "$rounds"); do
  seed=$(( (RANDOM << 15) | RANDOM ))
  mkdir -p "$work/$round"
  if TEST_TMPDIR="$work/$round" CKPT_CRASH_TRIALS="$trials" CKPT_CRASH_SEED="$seed" \
      "$bin" >"$work/log" 2>&1; then
    echo "round $round seed $seed: crash_test ok: $(grep -m1 'kills:' "$work/log")"
  else
    failed=$((failed + 1))
    echo "round $round seed $seed: crash_test FAILED"
    tail -n 30 "$work/log"
  fi
  if (cd "$kill_runfiles" && TEST_TMPDIR="$work/$round" CKPT_KILL_TRIALS=$((trials / 4)) \
      CKPT_KILL_SEED="$seed" "$kill_test") >"$work/log" 2>&1; then
    echo "round $round seed $seed: checkpoint_kill_test ok: $(grep 'interrupted' "$work/log" | tr '\n' ' ')"
  else
    failed=$((failed + 1))
    echo "round $round seed $seed: checkpoint_kill_test FAILED"
    tail -n 30 "$work/log"
  fi
  if (cd "$server_kill_runfiles" && TEST_TMPDIR="$work/$round" CKPT_KILL_TRIALS=$((trials / 4)) \
      CKPT_KILL_SEED="$seed" "$server_kill_test") >"$work/log" 2>&1; then
    echo "round $round seed $seed: checkpoint_server_kill_test ok: $(grep 'interrupted' "$work/log" | tr '\n' ' ')"
  else
    failed=$((failed + 1))
    echo "round $round seed $seed: checkpoint_server_kill_test FAILED"
    tail -n 30 "$work/log"
  fi
  rm -rf "${work:?}/$round"
done
echo "$failed failures in $rounds rounds ($((rounds * trials)) in-process, $((rounds * (trials / 4) * 2)) multi-process and $((rounds * (trials / 4) * 2)) real-server kills)"
[ "$failed" -eq 0 ]
