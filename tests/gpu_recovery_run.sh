#!/usr/bin/env bash
# Snapshots and recovery of the gpu backend (issue 16) in one device call:
# the capture test (gpu_snapshot_test: device spare and live-buffer capture
# hold their version byte for byte and restore to the same bytes), the
# snapshot's cost at 1.07 B parameters (gpu_snapshot_bench, spare then live
# buffers), a SIGKILLed gpu daemon replaced from its buddy's snapshot at
# 1.07 B (gpu_recovery_test, two daemons on the GPU), then the gpu backend's
# daemon and checkpoint tests (the step and host-state paths the capture
# touches).
#
#   Here:  bash tests/gpu_recovery_run.sh bundle [BUNDLE]
#          (--config=cuda build; BUNDLE, default .gpu_bundle_recovery, holds
#          one bundle.tar.xz; git-ignored by /.gpu_bundle*/)
#   There: run(command="mkdir -p /tmp/r && tar -C /tmp/r -xJf
#              .gpu_bundle_recovery/bundle.tar.xz && bash /tmp/r/gpu_recovery_run.sh run /tmp/r",
#              carry=[".gpu_bundle_recovery"], kind="nvidia-h200")
#          Logs go to one $OUT/logs.tar.gz; the figures print to stdout.
# Knobs (run): BENCH=0 skips the benches; RECOVERY_TIMEOUT (s, default
# 400) bounds gpu_recovery_test; TESTS=0 skips the checkpoint test, TESTS=2
# adds gpu_daemon_backend_test; BENCH_ARGS adds
# gpu_snapshot_bench flags; PARAMD_GPU_RECOVERY_TENSORS / _ROWS size the
# recovery test.
set -uo pipefail
TARGETS=(
  //server:hybrid-paramd
  //server/gpu_backend:gpu_snapshot_test
  //server/gpu_backend:gpu_snapshot_bench
  //tests:gpu_recovery_test
  //tests:gpu_daemon_backend_test
  //tests:gpu_backend_checkpoint_test
)

if [ "${1:-}" = bundle ]; then
  set -e
  here=$(pwd)
  bundle=${2:-.gpu_bundle_recovery}
  [[ "$bundle" = /* ]] || bundle="$here/$bundle"
  cd "$(dirname "$0")/.."
  source tools/gpu_bundle_lib.sh
  bundle_build_pack "$bundle" "${TARGETS[@]}" -- tests/gpu_recovery_run.sh tools/gpu_bundle_lib.sh
  exit 0
fi

DIR=${2:-$(cd "$(dirname "$0")" && pwd)}
OUT=${OUT:-/tmp/gpu_recovery_out}
LOGS=/tmp/gpu_recovery_logs
mkdir -p "$OUT" "$LOGS"
cd "$DIR"
source ./gpu_bundle_lib.sh
bundle_run_env "$DIR"
export TEST_TMPDIR=${TEST_TMPDIR:-/tmp/gpu_recovery_tmp}
mkdir -p "$TEST_TMPDIR"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
free -g | head -2
date -u +%Y-%m-%dT%H:%M:%SZ
step() {  # name timeout command...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  mkdir -p "$TEST_TMPDIR/$name"
  TEST_TMPDIR="$TEST_TMPDIR/$name" timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $((SECONDS - start)) s $(grep -E '^\[  (PASSED|FAILED)  \]' "$LOGS/$name.log" | tr '\n' ' ')"
  grep -E "^(model|snapshot|capture|restore|loaded|admin step|rank|recovery|\{)" "$LOGS/$name.log" | head -30
  [ "$rc" = 0 ] || grep -h -B2 -A8 "Failure$\|^\[  FAILED  \]\|rror" "$LOGS/$name.log" | head -40
}
step gpu_snapshot_test 60 ./server/gpu_backend/gpu_snapshot_test
if [ "${BENCH:-1}" = 1 ]; then  # about 85 s on an H200
  step snapshot_bench_spare 90 ./server/gpu_backend/gpu_snapshot_bench ${BENCH_ARGS:-}
  step snapshot_bench_direct 60 env PARAMD_GPU_SNAPSHOT_SPARE=0 \
    ./server/gpu_backend/gpu_snapshot_bench --rounds=1 --restore=false ${BENCH_ARGS:-}
fi
# At 1.07 B this writes a 4 GiB model, loads it into two daemons, sends two
# 6 GiB buddy copies and restores both ranks through their host mirrors
# (about 15 s each from the bench's figures): give it a call of its own.
step gpu_recovery_test "${RECOVERY_TIMEOUT:-400}" ./tests/gpu_recovery_test
[ "${TESTS:-1}" -ge 1 ] && step gpu_backend_checkpoint_test 60 ./tests/gpu_backend_checkpoint_test
[ "${TESTS:-1}" -ge 2 ] && step gpu_daemon_backend_test 100 ./tests/gpu_daemon_backend_test
tar -C "$LOGS" -czf "$OUT/logs.tar.gz" .
