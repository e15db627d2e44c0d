#!/usr/bin/env bash
# Runs ON THE GPU MACHINE (from the repo root, with the bundle carried; see
# tools/gpu_bundle.sh): the gpu-tagged tests and the kernel benchmark, with
# every log under $OUT. Prints a short summary last.
#
# Environment knobs:
#   BUNDLE=.gpu_bundle_x        the carried bundle folder (default .gpu_bundle)
#   RUN_TESTS=0 / RUN_BENCH=0   skip a part
#   GTEST_FILTER=...            passed to the tests
#   SHARDS=8                    quantize_test runs as N parallel gtest shards
#   BENCH_ARGS="--reps=30"      extra benchmark flags
#   SASS=1                      dump the sm_90a SASS of the quantize kernels (cuobjdump),
#                               and each pattern instantiation alone (sass_patternN.txt)
#   PEER=1                      after the benchmark, the torch peer (tools/peer_bench.py,
#                               torch 2.11 there) in the same call: peer.md is the table
#                               ours / torch eager / torch.compile; PEER_ARGS="--reps=10"
#                               extra flags. Inductor's cache is saved as
#                               $OUT/inductor_cache.tgz; put it in the bundle folder
#                               (BUNDLE/inductor_cache.tgz) to skip recompiling next time.
#   NCU=1                       also profile the named kernels with ncu
#                               (--clock-control none), NCU_ONLY=<bench --only>,
#                               NCU_BENCH_ARGS="--tensors=1" (smaller problem)
set -uo pipefail
cd "$(dirname "$0")/.."
B=${BUNDLE:-.gpu_bundle}
OUT=${OUT:-/tmp/gpu_run_out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if ! ls /usr/local/cuda/lib64/libcudart.so.13* >/dev/null 2>&1 &&
   ! ldconfig -p 2>/dev/null | grep -q libcudart.so.13; then
  export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$PWD/$B/fallback"
  echo "(using the bundled libcudart)"
fi
export NCCL_NVLS_ENABLE=0

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv 2>&1
} > "$OUT/gpu.txt"
cat "$OUT/gpu.txt"
missing=$(ldd $B/bin/quantize_test | grep "not found" || true)
[ -n "$missing" ] && echo "MISSING LIBRARIES: $missing"

summary=()
if [ "${SASS:-0}" = 1 ] && command -v cuobjdump >/dev/null; then
  cuobjdump -sass -arch sm_90a $B/lib/libkernels_Scuda_Slibquantize_Uimpl.so > "$OUT/quantize_sm90a.sass" 2>&1
  summary+=("sass rc=$? $(wc -l < "$OUT/quantize_sm90a.sass") lines")
  # One file per kernel instantiation (QuantizeTilesKernel<256, 3, pattern>).
  awk -v out="$OUT" '/Function : /{f=""; if (match($0, /QuantizeTilesKernelILi256ELi3ELi[0-9]/)) \
      f=out "/sass_pattern" substr($0, RSTART + RLENGTH - 1, 1) ".txt"} f != "" {print > f}' \
      "$OUT/quantize_sm90a.sass"
fi
if [ "${RUN_TESTS:-1}" = 1 ]; then
  shards=${SHARDS:-8}
  pids=()
  for ((i = 0; i < shards; i++)); do
    GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i \
      timeout 300 $B/bin/quantize_test ${GTEST_FILTER:+--gtest_filter=$GTEST_FILTER} \
      > "$OUT/quantize_test.shard$i.log" 2>&1 &
    pids+=($!)
  done
  timeout 200 $B/bin/optimizer_test ${GTEST_FILTER:+--gtest_filter=$GTEST_FILTER} > "$OUT/optimizer_test.log" 2>&1
  summary+=("optimizer_test rc=$? $(grep -E '^\[  (PASSED|FAILED)  \]' "$OUT/optimizer_test.log" | tr '\n' ' ')")
  if [ -x $B/bin/amax_test ]; then
    timeout 100 $B/bin/amax_test ${GTEST_FILTER:+--gtest_filter=$GTEST_FILTER} > "$OUT/amax_test.log" 2>&1
    summary+=("amax_test rc=$? $(grep -E '^\[  (PASSED|FAILED)  \]' "$OUT/amax_test.log" | tr '\n' ' ')")
  fi
  if [ -x $B/bin/one_pass_step_test ]; then
    timeout 100 $B/bin/one_pass_step_test ${GTEST_FILTER:+--gtest_filter=$GTEST_FILTER} > "$OUT/one_pass_step_test.log" 2>&1
    summary+=("one_pass_step_test rc=$? $(grep -E '^\[  (PASSED|FAILED)  \]' "$OUT/one_pass_step_test.log" | tr '\n' ' ')")
  fi
  rc_all=0
  for p in "${pids[@]}"; do wait "$p" || rc_all=1; done
  cat "$OUT"/quantize_test.shard*.log > "$OUT/quantize_test.log"
  rm -f "$OUT"/quantize_test.shard*.log
  passed=$(grep -c '^\[       OK \]' "$OUT/quantize_test.log")
  failed=$(grep -cE '^\[  FAILED  \] .* \([0-9]+ ms\)$' "$OUT/quantize_test.log")
  summary+=("quantize_test rc=$rc_all: $passed tests OK, $failed failed lines")
  echo "---- failures (first 40 lines) ----"
  grep -E "Failure|failures; first|FAILED|MISSING|error" "$OUT/quantize_test.log" "$OUT/optimizer_test.log" \
    "$OUT"/amax_test.log "$OUT"/one_pass_step_test.log 2>/dev/null | head -40
fi

if [ "${RUN_BENCH:-1}" = 1 ]; then
  timeout 200 $B/bin/bench --json="$OUT/bench.json" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  summary+=("bench rc=$?")
  if [ "${NCU:-0}" = 1 ] && command -v ncu >/dev/null; then
    # NCU_ONLY: ';'-separated bench --only filters, one ncu report each.
    IFS=';' read -ra filters <<< "${NCU_ONLY:-per-tensor row+col^T (src bf16)}"
    n=0
    for f in "${filters[@]}"; do
      timeout 150 ncu --clock-control none --kernel-name regex:"${NCU_KERNEL:-QuantizeTiles}" \
        --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
        --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis \
        --section InstructionStats \
        $B/bin/bench --reps=1 --warmup=1 ${NCU_BENCH_ARGS:-} --only="$f" > "$OUT/ncu$n.log" 2>&1
      summary+=("ncu[$f] rc=$?")
      n=$((n + 1))
    done
  fi
  if [ "${NCU_SRC:-0}" = 1 ] && command -v ncu >/dev/null; then
    # Per-SASS-instruction counters of one kernel (hot spots), as CSV.
    timeout 150 ncu --clock-control none --kernel-name regex:QuantizeTiles --launch-skip 1 \
      --launch-count 1 --section SourceCounters --section WarpStateStats --page source \
      --print-source sass --csv \
      $B/bin/bench --reps=1 --warmup=1 ${NCU_BENCH_ARGS:-} --only="${NCU_SRC_ONLY:-mxfp8 row+col}" \
      > "$OUT/ncu_source.csv" 2> "$OUT/ncu_source.err"
    summary+=("ncu source rc=$? $(wc -c < "$OUT/ncu_source.csv") bytes")
  fi
  tail -n 40 "$OUT/bench.log"
fi
if [ "${PEER:-0}" = 1 ]; then
  export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
  if [ -f "$B/inductor_cache.tgz" ]; then
    mkdir -p "$TORCHINDUCTOR_CACHE_DIR" && tar -xzf "$B/inductor_cache.tgz" -C "$TORCHINDUCTOR_CACHE_DIR"
  fi
  PYTHONUNBUFFERED=1 timeout 400 python3 tools/peer_bench.py --ours="$OUT/bench.json" \
    --json="$OUT/peer.json" --markdown="$OUT/peer.md" ${PEER_ARGS:-} > "$OUT/peer.log" 2>&1
  summary+=("peer_bench rc=$?")
  tar -czf "$OUT/inductor_cache.tgz" -C "$TORCHINDUCTOR_CACHE_DIR" . 2>/dev/null
  grep -v '^  ' "$OUT/peer.log" | tail -n 30
fi
echo "==== summary ===="
printf '%s\n' "${summary[@]}"
