#!/usr/bin/env bash
# Same-GPU trainers (issue 19) in one device call: ipc_test (coordinator +
# gpu daemon on GPU 0, the test process the trainer on the same GPU through
# CUDA VMM mappings), plus the tests of the code it touches (the gpu
# backend's exportable published buffers, the shared device push).
#
#   Here:  bash tests/gpu_ipc_run.sh bundle   (B=DIR: another bundle folder)
#          (bazel --config=cuda build; BUNDLE/bundle.tar.xz holds the
#          binaries at their workspace paths and the non-system shared
#          libraries; BUNDLE/run.sh is this script; git-ignored)
#   There: run(command="bash .gpu_bundle_ipc/run.sh run",
#              carry=[".gpu_bundle_ipc"], kind="nvidia-h200")
#          One GPU is enough. Logs land in $OUT (five files).
# Knobs (run): BENCH=1 runs the figures of docs/BENCHMARKS.md (1.07e9
# parameters; adds ~60 s); FILTER=<gtest filter> for ipc_test; EXTRA=0
# skips the other tests.
set -uo pipefail
B=${B:-.gpu_bundle_ipc}
TARGETS=(
  //server:hybrid-paramd
  //tests/gpu_integration:ipc_test
  //tests/gpu_integration:ipc_pin_loop
  //tests/gpu_integration:daemon_push_test
  //tests/gpu_integration:daemon_fetch_test
  //tests/gpu_integration:device_fetch_loop
  //tests:gpu_daemon_backend_test
)

if [ "${1:-}" = bundle ]; then
  cd "$(dirname "$0")/.."
  source tools/gpu_bundle_lib.sh
  bundle_build_pack "$B" "${TARGETS[@]}" || exit 1
  cp tests/gpu_ipc_run.sh "$B/run.sh"
  cp tools/gpu_bundle_lib.sh "$B/gpu_bundle_lib.sh"
  exit 0
fi

# run: from the repository root of the GPU machine, the bundle carried.
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/gpu_ipc_out}
L=$OUT  # a few log files (they come back even when the call times out)
mkdir -p "$OUT"
source "$HERE/gpu_bundle_lib.sh"
U=/tmp/gpu_bundle_ipc
rm -rf "$U" && bundle_unpack "$HERE" "$U" || exit 1
bundle_run_env "$U"
{ date -u; nvidia-smi --query-gpu=index,name,driver_version,uuid --format=csv; } > "$L/gpu.txt" 2>&1
cat "$L/gpu.txt"
cd "$U"
ldd server/hybrid-paramd | grep "not found" && echo "MISSING LIBRARIES"
export TEST_TMPDIR=/tmp/paramd_ipc_tmp
mkdir -p "$TEST_TMPDIR"
PARAMD_IPC_BENCH=${BENCH:-0} timeout ${IPC_TIMEOUT:-180} tests/gpu_integration/ipc_test \
  ${FILTER:+--gtest_filter=$FILTER} > "$L/ipc_test.log" 2>&1
r1=$?
r2=skipped
r3=skipped
r4=skipped
if [ "${EXTRA:-1}" = 1 ]; then
  # DeviceFetcher with the trainer on its daemons' GPU: the same-GPU path.
  timeout 90 tests/gpu_integration/daemon_fetch_test \
    --gtest_filter="${FETCH_FILTER:-*OneDaemon*:*SplitAcrossTwoDaemons*}" \
    > "$L/daemon_fetch_test.log" 2>&1
  r4=$?
  # The device push (its adds now shared with the in-place push).
  timeout 60 tests/gpu_integration/daemon_push_test > "$L/daemon_push_test.log" 2>&1
  r3=$?
  # The gpu backend with exportable published buffers == the cpu backend.
  timeout 90 tests/gpu_daemon_backend_test > "$L/gpu_daemon_backend_test.log" 2>&1
  r2=$?
fi
echo "---- failures ----"
grep -hE "Failure|FAILED|Expected|Which is|actual|error:" "$L"/*_test.log | head -50
echo "---- figures ----"
grep -h "IPC_BENCH\|IPC_TEST" "$L/ipc_test.log"
echo "==== summary ===="
for t in ipc_test:$r1 gpu_daemon_backend_test:$r2 daemon_push_test:$r3 daemon_fetch_test:$r4; do
  n=${t%%:*}
  echo "$n rc=${t##*:}: $(grep -E '^\[  (PASSED|FAILED)  \]|tests? ran' "$L/$n.log" 2>/dev/null | tr '\n' ' ')"
done
