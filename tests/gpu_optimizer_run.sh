#!/usr/bin/env bash
# The optimizer's GPU checks (schedule, clipping, per-rule overrides,
# skip_step, SGD momentum on/off on the gpu backend) in one device call:
# first the clipping cost at 1.07 B parameters (gpu_clip_bench, alone on the
# GPU), then in parallel: the device gradient norm == its definition
# (grad_norm_test), the gpu backend == the cpu backend bit for bit
# (gpu_backend_clip_test), the one-pass step (one_pass_step_test), the
# optimizer kernels (optimizer_test, gpu_backend_optimizer_test; QUANTIZE=1
# adds quantize_test), the gpu backend vs cpu daemons and its checkpoints
# (gpu_daemon_backend_test, gpu_backend_checkpoint_test), the NCCL device
# push with clipping (daemon_push_test DeviceEqualsHost.*) and the same-GPU
# in-place push under SKIP_STEP (ipc_test PushInPlace*).
#
#   Here:  bash tests/gpu_optimizer_run.sh bundle [BUNDLE]
#          (--config=cuda build; BUNDLE, default .gpu_bundle_optimizer, holds
#          one bundle.tar.xz: the binaries, their non-system libraries and
#          this script; git-ignored by /.gpu_bundle*/)
#   There: run(command="mkdir -p /tmp/o && tar -C /tmp/o -xJf
#              .gpu_bundle_optimizer/bundle.tar.xz && bash /tmp/o/gpu_optimizer_run.sh run /tmp/o",
#              carry=[".gpu_bundle_optimizer"], kind="nvidia-h200")
#          Logs go to one $OUT/logs.tar.gz (the run tool returns few files);
#          the summary and the bench print to stdout.
# Knobs (run): BENCH=0 skips the bench, TESTS=0 the tests, BENCH_ARGS
# replaces the gpu_clip_bench flags (default --steps=41).
set -uo pipefail
TARGETS=(
  //server:hybrid-paramd
  //server/gpu_backend:grad_norm_test
  //server/gpu_backend:gpu_backend_clip_test
  //server/gpu_backend:one_pass_step_test
  //server/gpu_backend:gpu_backend_optimizer_test
  //server/gpu_backend:gpu_clip_bench
  //kernels/cuda:optimizer_test
  //kernels/cuda:quantize_test
  //tests:gpu_daemon_backend_test
  //tests:gpu_backend_checkpoint_test
  //tests/gpu_integration:daemon_push_test
  //tests/gpu_integration:ipc_test
)

if [ "${1:-}" = bundle ]; then
  set -e
  here=$(pwd)
  bundle=${2:-.gpu_bundle_optimizer}
  [[ "$bundle" = /* ]] || bundle="$here/$bundle"
  cd "$(dirname "$0")/.."
  source tools/gpu_bundle_lib.sh
  bundle_build_pack "$bundle" "${TARGETS[@]}" -- tests/gpu_optimizer_run.sh tools/gpu_bundle_lib.sh
  exit 0
fi

DIR=${2:-$(cd "$(dirname "$0")" && pwd)}
OUT=${OUT:-/tmp/gpu_optimizer_out}
LOGS=/tmp/gpu_optimizer_logs
mkdir -p "$OUT" "$LOGS"
cd "$DIR"
source ./gpu_bundle_lib.sh
bundle_run_env "$DIR"
export TEST_TMPDIR=${TEST_TMPDIR:-/tmp/gpu_optimizer_tmp}
mkdir -p "$TEST_TMPDIR"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.memory --format=csv,noheader
date -u +%Y-%m-%dT%H:%M:%SZ
# The bench first, alone on the GPU (its figures are what a cut call loses
# otherwise).
if [ "${BENCH:-1}" = 1 ]; then
  timeout "${BENCH_TIMEOUT:-100}" ./server/gpu_backend/gpu_clip_bench ${BENCH_ARGS:---steps=41} 2>&1 |
    tee "$LOGS/gpu_clip_bench.log"
fi
if [ "${TESTS:-1}" = 1 ]; then
  # name:binary:shards, in parallel (the binaries start server/hybrid-paramd
  # relative to this folder).
  tests=(server/gpu_backend/grad_norm_test:1 server/gpu_backend/gpu_backend_clip_test:1
         server/gpu_backend/one_pass_step_test:1
         server/gpu_backend/gpu_backend_optimizer_test:1 kernels/cuda/optimizer_test:1
         tests/gpu_daemon_backend_test:3 tests/gpu_backend_checkpoint_test:1
         tests/gpu_integration/daemon_push_test:1 tests/gpu_integration/ipc_test:1)
  [ "${QUANTIZE:-0}" = 1 ] && tests+=(kernels/cuda/quantize_test:2)
  # Only the cases of this code (the others are the device-fetch and
  # same-GPU scripts'); gtest filters by binary name.
  declare -A filter=([daemon_push_test]='*DeviceEqualsHost.*'
                     [ipc_test]='Ipc.PushInPlace*')
  pids=()
  for entry in "${tests[@]}"; do
    bin=${entry%%:*}
    shards=${entry##*:}
    name=$(basename "$bin")
    for ((i = 0; i < shards; ++i)); do
      mkdir -p "$TEST_TMPDIR/$name.$i"
      GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i TEST_TMPDIR="$TEST_TMPDIR/$name.$i" \
        timeout "${TEST_TIMEOUT:-100}" "./$bin" ${filter[$name]:+--gtest_filter=${filter[$name]}} \
        > "$LOGS/$name.$i.log" 2>&1 &
      pids+=("$name.$i:$!")
    done
  done
  for tp in "${pids[@]}"; do
    wait "${tp##*:}"
    rc=$?
    log="$LOGS/${tp%%:*}.log"
    echo "${tp%%:*} rc=$rc $(grep -E '^\[  (PASSED|FAILED)  \]' "$log" | tr '\n' ' ')"
  done
  grep -h -B2 -A8 "Failure$\|^\[  FAILED  \]" "$LOGS"/*.log | head -80
fi
tar -C "$LOGS" -czf "$OUT/logs.tar.gz" .
