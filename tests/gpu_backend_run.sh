#!/usr/bin/env bash
# The gpu daemon backend's GPU tests (issue 5) in one device call.
#
#   Here:  bash tests/gpu_backend_run.sh bundle
#          (bazel --config=cuda build + .gpu_bundle_backend/ with
#          server/hybrid-paramd, the test binaries in tests/, and the
#          non-system shared libraries they load in lib/ (libcudart in
#          fallback/); git-ignored by /.gpu_bundle*/)
#   There: run(command="bash tests/gpu_backend_run.sh run",
#              carry=[".gpu_bundle_backend"], kind="nvidia-h200-x2")
#          Each binary runs from the bundle folder (the tests start
#          server/hybrid-paramd relative to their working directory), in
#          parallel; logs land under $OUT. NCCL_NVLS_ENABLE=0.
# Knobs (run): ONLY="name ..." runs only those binaries; GTEST_FILTER as usual.
# daemon_fetch_test is bundled but not run by default (tests/gpu_fetch_run.sh
# runs it on two GPUs); ONLY=daemon_fetch_test GTEST_FILTER=Kills.KillDaemonMidFetch
# runs the daemon-kill case on one GPU (trainer and daemon share it).
set -uo pipefail
cd "$(dirname "$0")/.."
B=.gpu_bundle_backend
TARGETS=(
  //server:hybrid-paramd
  //tests:gpu_daemon_backend_test
  //tests:gpu_backend_checkpoint_test
  //server/gpu_backend:gpu_backend_optimizer_test
  //server/gpu_backend:gpu_backend_step_bench
  //kernels/cuda:optimizer_test
  //tests/gpu_integration:daemon_fetch_test
)

if [ "${1:-}" = bundle ]; then
  set -e
  bazel build --config=cuda "${TARGETS[@]}"
  rm -rf "$B"
  source tools/gpu_bundle_lib.sh
  for t in "${TARGETS[@]}"; do
    name=${t##*:}
    pkg=${t%%:*}
    if [ "$name" = hybrid-paramd ]; then dest="$B/server"; else dest="$B/tests"; fi
    bundle_binary "bazel-bin/${pkg#//}/$name" "$dest/$name" "$B" || exit 1
  done
  du -sh "$B"
  exit 0
fi

OUT=${OUT:-/tmp/gpu_backend_out}
mkdir -p "$OUT"
cd "$B"
export NCCL_NVLS_ENABLE=0 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export LD_LIBRARY_PATH="$PWD/lib:/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:$PWD/fallback"
export TEST_TMPDIR=${TEST_TMPDIR:-/tmp/gpu_backend_tmp}
mkdir -p "$TEST_TMPDIR"
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
ldd server/hybrid-paramd | grep "not found" && echo "MISSING LIBRARIES"

# name[:shards] (gtest sharding: the shards run in parallel).
tests=(gpu_backend_optimizer_test optimizer_test gpu_daemon_backend_test:3
       gpu_backend_checkpoint_test)
[ -n "${ONLY:-}" ] && tests=(${ONLY})
pids=()
for entry in "${tests[@]}"; do
  t=${entry%%:*}
  shards=1
  [ "$entry" != "$t" ] && shards=${entry##*:}
  [ -x "tests/$t" ] || continue
  for ((i = 0; i < shards; ++i)); do
    log="$OUT/$t.log"
    [ "$shards" -gt 1 ] && log="$OUT/$t.$i.log"
    mkdir -p "$TEST_TMPDIR/$t.$i"
    GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i TEST_TMPDIR="$TEST_TMPDIR/$t.$i" \
      timeout 200 "tests/$t" > "$log" 2>&1 &
    pids+=("$(basename "$log" .log):$!")
  done
done
summary=()
for tp in "${pids[@]}"; do
  t=${tp%%:*}
  wait "${tp##*:}"
  rc=$?
  summary+=("$t rc=$rc: $(grep -E '^\[  (PASSED|FAILED)  \]|^\[  SKIPPED \]|tests? ran' "$OUT/$t.log" | tr '\n' ' ')")
done
echo "---- failures ----"
grep -hE "^\[  FAILED  \]|Failure|error:|Expected|Which is|actual" "$OUT"/*.log | head -60
if [ "${BENCH:-1}" = 1 ] && [ -x tests/gpu_backend_step_bench ]; then
  timeout 90 tests/gpu_backend_step_bench ${BENCH_ARGS:-} > "$OUT/step_bench.log" 2>&1
  summary+=("gpu_backend_step_bench rc=$?")
  tail -n 12 "$OUT/step_bench.log"
fi
echo "==== summary ===="
printf '%s\n' "${summary[@]}"
