#!/usr/bin/env bash
# The pipelined step's GPU checks and its one-GPU benchmark in one device
# call: the gpu backend's pipelined step == its whole step == the cpu
# backend bit for bit, and its abandon rules (gpu_pipelined_step_test); the
# daemons' pipelined step through hybrid-paramd processes on the gpu backend
# (tests/pipelined_step_test with PARAMD_TEST_DAEMON_BACKEND=gpu); the
# store's step refactor and the out-of-place optimizer kernel
# (gpu_backend_clip_test, one_pass_step_test, optimizer_test,
# gpu_backend_optimizer_test); then gpu_pipeline_bench at 1.07 B
# parameters (host push + host fetch, and in place on the GPU), alone on
# the GPU.
#
#   Here:  bash tests/gpu_pipeline_run.sh bundle [BUNDLE]
#          (--config=cuda build; BUNDLE, default .gpu_bundle_pipeline, holds
#          one bundle.tar.xz; git-ignored by /.gpu_bundle*/)
#   There: run(command="mkdir -p /tmp/o && tar -C /tmp/o -xJf
#              .gpu_bundle_pipeline/bundle.tar.xz && bash /tmp/o/gpu_pipeline_run.sh run /tmp/o",
#              carry=[".gpu_bundle_pipeline"], kind="nvidia-h200")
#          Logs go to one $OUT/logs.tar.gz; the summary and the bench print
#          to stdout.
# Knobs (run): BENCH=0 skips the bench, TESTS=0 the tests.
set -uo pipefail
TARGETS=(
  //server:hybrid-paramd
  //server/gpu_backend:gpu_pipelined_step_test
  //server/gpu_backend:gpu_backend_clip_test
  //server/gpu_backend:one_pass_step_test
  //server/gpu_backend:gpu_backend_optimizer_test
  //server/gpu_backend:gpu_pipeline_bench
  //kernels/cuda:optimizer_test
  //tests:pipelined_step_test
)

if [ "${1:-}" = bundle ]; then
  set -e
  here=$(pwd)
  bundle=${2:-.gpu_bundle_pipeline}
  [[ "$bundle" = /* ]] || bundle="$here/$bundle"
  cd "$(dirname "$0")/.."
  source tools/gpu_bundle_lib.sh
  bundle_build_pack "$bundle" "${TARGETS[@]}" -- tests/gpu_pipeline_run.sh tools/gpu_bundle_lib.sh
  exit 0
fi

DIR=${2:-$(cd "$(dirname "$0")" && pwd)}
OUT=${OUT:-/tmp/gpu_pipeline_out}
LOGS=/tmp/gpu_pipeline_logs
mkdir -p "$OUT" "$LOGS"
cd "$DIR"
source ./gpu_bundle_lib.sh
bundle_run_env "$DIR"
export TEST_TMPDIR=${TEST_TMPDIR:-/tmp/gpu_pipeline_tmp}
mkdir -p "$TEST_TMPDIR"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.memory --format=csv,noheader
date -u +%Y-%m-%dT%H:%M:%SZ
if [ "${TESTS:-1}" = 1 ]; then
  # name:binary:shards, in parallel.
  tests=(server/gpu_backend/gpu_pipelined_step_test:3 server/gpu_backend/gpu_backend_clip_test:1
         server/gpu_backend/one_pass_step_test:1 server/gpu_backend/gpu_backend_optimizer_test:1
         kernels/cuda/optimizer_test:1 tests/pipelined_step_test:1)
  pids=()
  for entry in "${tests[@]}"; do
    bin=${entry%%:*}
    shards=${entry##*:}
    name=$(basename "$bin")
    for ((i = 0; i < shards; ++i)); do
      mkdir -p "$TEST_TMPDIR/$name.$i"
      PARAMD_TEST_DAEMON_BACKEND=gpu GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i \
        TEST_TMPDIR="$TEST_TMPDIR/$name.$i" \
        timeout "${TEST_TIMEOUT:-100}" "./$bin" > "$LOGS/$name.$i.log" 2>&1 &
      pids+=("$name.$i:$!")
    done
  done
  for tp in "${pids[@]}"; do
    wait "${tp##*:}"
    rc=$?
    log="$LOGS/${tp%%:*}.log"
    echo "${tp%%:*} rc=$rc $(grep -E '^\[  (PASSED|FAILED)  \]' "$log" | tr '\n' ' ')"
  done
  grep -h -B2 -A10 "Failure$\|^\[  FAILED  \]" "$LOGS"/*.log | head -120
fi
if [ "${BENCH:-1}" = 1 ]; then
  for mode in "--push=host --fetch=host" "--push=device --fetch=device"; do
    timeout "${BENCH_TIMEOUT:-90}" ./server/gpu_backend/gpu_pipeline_bench $mode ${BENCH_ARGS:-} 2>&1 |
      tee -a "$LOGS/gpu_pipeline_bench.log"
  done
fi
tar -C "$LOGS" -czf "$OUT/logs.tar.gz" .
