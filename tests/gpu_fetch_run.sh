#!/usr/bin/env bash
# Device fetch through hybrid-paramd (issue 5) in one device call: the
# multi-process daemon_fetch_test (coordinator + gpu daemons on GPU 0,
# trainer on GPU 1) and the in-process fetch_test.
#
#   Here:  bash tests/gpu_fetch_run.sh bundle
#          (bazel --config=cuda build; .gpu_bundle_fetch/bundle.tar.xz holds
#          the binaries at their workspace paths, so that the tests find
#          server/hybrid-paramd and tests/gpu_integration/device_fetch_loop
#          from the unpacked root, plus the non-system shared libraries;
#          compressed to stay under the 64 MiB a device call carries;
#          git-ignored)
#   There: run(command="bash tests/gpu_fetch_run.sh run",
#              carry=[".gpu_bundle_fetch"], kind="nvidia-h200-x2")
#          Logs land under $OUT. NVLink multicast stays off.
#          Also runs deploy/gpu_trainer against a real gpu daemon.
# Knobs (run): FILTER=<gtest filter> for daemon_fetch_test; OVERLAP=0 skips
# daemon_overlap_test, BENCH=1 adds its step-loop benchmark (1.07e9
# parameters; figures in docs/BENCHMARKS.md); ONLY=overlap runs nothing
# but daemon_overlap_test (with its bench when BENCH=1; its TwoDaemons case
# needs both GPUs: two gpu daemons all-reducing over NCCL beside the
# trainer's fetches); OVERLAP_FILTER=<gtest filter> narrows
# daemon_overlap_test; OVERLAP_TAG=<name> writes its log to
# daemon_overlap_test_<name>.log (several runs in one call; the test's own
# OVERLAP_WARM_PUSHER / OVERLAP_WARM_STEP / OVERLAP_SWAP pass through the
# environment); VARIANTS=1 adds the two-daemons-on-one-GPU runs
# (docs/ARCHITECTURE.md, known limit); TRAINER=0 skips the trainer example.
set -uo pipefail
cd "$(dirname "$0")/.."
B=.gpu_bundle_fetch
TARGETS=(
  //server:hybrid-paramd
  //tests/gpu_integration:daemon_fetch_test
  //tests/gpu_integration:device_fetch_loop
  //tests/gpu_integration:daemon_push_test
  //tests/gpu_integration:fetch_test
  //tests/gpu_integration:daemon_overlap_test
  //deploy/gpu_trainer:gpu_trainer
)

if [ "${1:-}" = bundle ]; then
  source tools/gpu_bundle_lib.sh
  bundle_build_pack "$B" "${TARGETS[@]}"
  exit $?
fi

OUT=${OUT:-/tmp/gpu_fetch_out}
mkdir -p "$OUT"
# Unpack the bundle outside the tree (it travels compressed).
source tools/gpu_bundle_lib.sh
# Unpacked once per bundle: several runs in one call reuse it.
stamp=$(stat -c %s-%Y "$B/bundle.tar.xz")
if [ "$(cat /tmp/gpu_bundle_fetch/.stamp 2>/dev/null)" != "$stamp" ]; then
  rm -rf /tmp/gpu_bundle_fetch
  bundle_unpack "$B" /tmp/gpu_bundle_fetch || exit 1
  echo "$stamp" > /tmp/gpu_bundle_fetch/.stamp
fi
B=/tmp/gpu_bundle_fetch
bundle_run_env "$B"
{ date -u; nvidia-smi --query-gpu=index,name,driver_version --format=csv; } > "$OUT/gpu.txt" 2>&1
head -4 "$OUT/gpu.txt"
cd "$B"
ldd server/hybrid-paramd | grep "not found" && echo "MISSING LIBRARIES"
export TEST_TMPDIR=/tmp/paramd_fetch_tmp
mkdir -p "$TEST_TMPDIR"
r4=skipped
OLOG=daemon_overlap_test${OVERLAP_TAG:+_$OVERLAP_TAG}
if [ "${OVERLAP:-1}" = 1 ]; then
  # The overlap of issue 5 (in-flight fetch, fetch beside a step, failed step).
  PARAMD_OVERLAP_BENCH=${BENCH:-0} timeout 240 tests/gpu_integration/daemon_overlap_test \
    ${OVERLAP_FILTER:+--gtest_filter=$OVERLAP_FILTER} > "$OUT/$OLOG.log" 2>&1
  r4=$?
  grep -h "OVERLAP_TEST\|OVERLAP_BENCH" "$OUT/$OLOG.log"
fi
if [ "${ONLY:-}" = overlap ]; then
  grep -hE "Failure|FAILED|Expected|Which is|actual|error" "$OUT/$OLOG.log" | head -40
  echo "$OLOG rc=$r4: $(grep -E '^\[  (PASSED|FAILED)  \]|tests? ran' \
    "$OUT/$OLOG.log" | tr '\n' ' ')"
  exit 0
fi
timeout 100 tests/gpu_integration/fetch_test > "$OUT/fetch_test.log" 2>&1
r1=$?
timeout 400 tests/gpu_integration/daemon_fetch_test ${FILTER:+--gtest_filter=$FILTER} \
  > "$OUT/daemon_fetch_test.log" 2>&1
r2=$?
# Gradient push over NCCL (PushGradientsDevice), device vs host push bytes.
timeout 300 tests/gpu_integration/daemon_push_test > "$OUT/daemon_push_test.log" 2>&1
r3=$?
if [ "${VARIANTS:-0}" = 1 ]; then
  # Two daemons on GPU 0: two NCCL channels into the trainer at once.
  PARAMD_SPLIT_SAME_GPU=1 timeout 90 tests/gpu_integration/daemon_fetch_test \
    --gtest_filter='*Split*' > "$OUT/split_same_gpu.log" 2>&1
  echo "split, both daemons on GPU 0, parallel: rc=$?"
  PARAMD_SPLIT_SAME_GPU=1 PARAMD_FETCH_SERIAL=1 timeout 90 tests/gpu_integration/daemon_fetch_test \
    --gtest_filter='*Split*' > "$OUT/split_same_gpu_serial.log" 2>&1
  echo "split, both daemons on GPU 0, serial: rc=$?"
  PARAMD_SPLIT_SAME_GPU=1 NCCL_P2P_DISABLE=1 timeout 90 tests/gpu_integration/daemon_fetch_test \
    --gtest_filter='*Split*' > "$OUT/split_same_gpu_nop2p.log" 2>&1
  echo "split, both daemons on GPU 0, NCCL_P2P_DISABLE=1: rc=$?"
  cs=$(ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  if [ -n "$cs" ]; then
    PARAMD_SPLIT_SAME_GPU=1 timeout 150 "$cs" --print-limit 20 tests/gpu_integration/daemon_fetch_test \
      --gtest_filter='*Split*Fp8Current' > "$OUT/sanitizer.log" 2>&1
    echo "compute-sanitizer: rc=$?"
  else
    echo "no compute-sanitizer"
  fi
  grep -hE "^\[  (PASSED|FAILED)  \]" "$OUT"/split_*.log
fi
if [ "${TRAINER:-1}" = 1 ]; then
  # The trainer example against a real gpu daemon (GPU 0), trainer on GPU 1.
  {
    rm -f /tmp/paramd_trainer.port
    server/hybrid-paramd --backend=gpu --gpu=0 --listen=127.0.0.1:0 \
      --port_file=/tmp/paramd_trainer.port --expected_pushers=1 --lr=3e-3 \
      > /tmp/paramd_trainer_daemon.log 2>&1 &
    dpid=$!
    for i in $(seq 100); do [ -s /tmp/paramd_trainer.port ] && break; sleep 0.1; done
    timeout 120 deploy/gpu_trainer/gpu_trainer --coordinator=127.0.0.1:$(cat /tmp/paramd_trainer.port) \
      --device=1 --check --steps=200 --format=fp8
    echo "gpu_trainer against hybrid-paramd rc=$?"
    kill $dpid; wait $dpid
    echo "---- daemon log ----"; tail -20 /tmp/paramd_trainer_daemon.log
    timeout 60 deploy/gpu_trainer/gpu_trainer --check --steps=200 --format=fp8
    echo "gpu_trainer in-process rc=$?"
  } > "$OUT/gpu_trainer.log" 2>&1
  grep -E "^format|rc=|CHECK|per step" "$OUT/gpu_trainer.log"
fi
echo "---- failures ----"
grep -hE "Failure|FAILED|Expected|Which is|actual|error" "$OUT"/*_test.log | head -60
echo "---- figures ----"
grep -h "DEVICE_FETCH_BENCH\|daemon killed after\|closed: " "$OUT/daemon_fetch_test.log" | head -20
echo "==== summary ===="
for t in fetch_test:$r1 daemon_fetch_test:$r2 daemon_push_test:$r3 daemon_overlap_test:$r4; do
  n=${t%%:*}
  echo "$n rc=${t##*:}: $(grep -E '^\[  (PASSED|FAILED)  \]|tests? ran' "$OUT/$n.log" | tr '\n' ' ')"
done
