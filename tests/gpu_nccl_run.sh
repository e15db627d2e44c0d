#!/usr/bin/env bash
# Issue 5's GPU runs (NCCL transport, GPU daemon store, fetch, kill tests,
# step benchmark) in one device call.
#
#   Here:  bash tests/gpu_nccl_run.sh bundle
#          (bazel --config=cuda build + .gpu_bundle_nccl/ with the binaries
#          and the non-system shared libraries they load; git-ignored
#          through .git/info/exclude)
#   There: run(command="bash tests/gpu_nccl_run.sh run",
#              carry=[".gpu_bundle_nccl"], kind="nvidia-h200-x2")
#          Logs and step_bench.json land under $OUT. NVLink multicast stays
#          off (NCCL_NVLS_ENABLE=0).
# Knobs (run): TESTS=0 / BENCH=0 / TRAINER=0 skip a part; BENCH_ARGS extra
# flags; TEST_TIMEOUT / BENCH_TIMEOUT (s) bound each test binary / the bench;
# BENCH_NAME names the bench's log and json under $OUT (default step_bench).
set -uo pipefail
cd "$(dirname "$0")/.."
B=.gpu_bundle_nccl
TARGETS=(
  //transport:nccl_test
  //tests/gpu_integration:fetch_test
  //tests/gpu_integration:kill_test
  //tests/step_bench:step_bench
)
# Bundled when it builds (it belongs to another part of the tree, which may
# be mid-change); the run skips it otherwise.
OPTIONAL=(//deploy/gpu_trainer:gpu_trainer)

if [ "${1:-}" = bundle ]; then
  set -e
  grep -qx "/$B/" .git/info/exclude 2>/dev/null || echo "/$B/" >> .git/info/exclude
  bazel build --config=cuda "${TARGETS[@]}"
  built=("${TARGETS[@]}")
  for t in "${OPTIONAL[@]}"; do
    if bazel build --config=cuda "$t"; then built+=("$t"); else echo "SKIPPED (does not build): $t"; fi
  done
  rm -rf "$B"
  mkdir -p "$B/bin" "$B/lib" "$B/fallback"
  for t in "${built[@]}"; do
    name=${t##*:}
    pkg=${t%%:*}
    pkg=${pkg#//}
    cp -L "bazel-bin/$pkg/$name" "$B/bin/$name"
    ldd "bazel-bin/$pkg/$name" | awk '/=>/ && $3 ~ /^\// {print $3}' | while read -r lib; do
      base=$(basename "$lib")
      case "$base" in
        libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libresolv.so*) ;;
        libstdc++.so*|libgcc_s.so*|libcuda.so*|libcublas*|libnvidia*) ;;
        libnccl*) ;;
        libcudart.so*) cp -Ln "$lib" "$B/fallback/" ;;
        *) cp -Ln "$lib" "$B/lib/" ;;
      esac
    done
  done
  chmod -R u+w "$B"
  du -sh "$B"
  exit 0
fi

OUT=${OUT:-/tmp/gpu_nccl_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export LD_LIBRARY_PATH="$PWD/$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if ! ldconfig -p 2>/dev/null | grep -q libcudart.so.13 && ! ls /usr/local/cuda/lib64/libcudart.so.13* >/dev/null 2>&1; then
  export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$PWD/$B/fallback"
fi
if ! ldconfig -p 2>/dev/null | grep -q libnccl.so.2 && ! ls /usr/local/cuda/lib*/libnccl.so.2 >/dev/null 2>&1; then
  # NCCL is too large to carry: use the one of the image's Python packages.
  d=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__ or nvidia.nccl.__path__[0]))' 2>/dev/null)
  [ -z "$d" ] && d=$(dirname "$(find / -name 'libnccl.so.2*' -not -path '*/proc/*' 2>/dev/null | head -1)")
  export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$d/lib:$d"
  echo "(libnccl from $d)"
fi
ldd $B/bin/nccl_test | grep -E "nccl|cudart"
{
  date -u
  nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem --format=csv
  nvidia-smi topo -m
} > "$OUT/gpu.txt" 2>&1
head -4 "$OUT/gpu.txt"
ldd $B/bin/step_bench | grep "not found" && echo "MISSING LIBRARIES"

summary=()
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TEST_TIMEOUT:-200} $B/bin/nccl_test > "$OUT/nccl_test.log" 2>&1 & p1=$!
  timeout ${TEST_TIMEOUT:-200} $B/bin/fetch_test > "$OUT/fetch_test.log" 2>&1 & p2=$!
  timeout ${TEST_TIMEOUT:-200} $B/bin/kill_test > "$OUT/kill_test.log" 2>&1 & p3=$!
  if [ -x $B/bin/gpu_trainer ] && [ "${TRAINER:-1}" = 1 ]; then
    timeout 120 $B/bin/gpu_trainer --check --steps=200 --format=fp8 > "$OUT/gpu_trainer.log" 2>&1 & p4=$!
  else
    p4=
  fi
  wait $p1; r1=$?; wait $p2; r2=$?; wait $p3; r3=$?
  if [ -n "$p4" ]; then
    wait $p4; r4=$?
    for f in mxfp8 nvfp4; do
      timeout 45 $B/bin/gpu_trainer --steps=200 --format=$f >> "$OUT/gpu_trainer.log" 2>&1
    done
    summary+=("gpu_trainer fp8 --check rc=$r4: $(grep -E '^format' "$OUT/gpu_trainer.log" | tr '\n' ' ')")
  else
    summary+=("gpu_trainer: not run (not bundled or TRAINER=0)")
  fi
  for t in nccl_test:$r1 fetch_test:$r2 kill_test:$r3; do
    n=${t%%:*}
    summary+=("$n rc=${t##*:}: $(grep -E '^\[  (PASSED|FAILED)  \]|tests? ran' "$OUT/$n.log" | tr '\n' ' ')")
  done
  echo "---- failures ----"
  grep -hE "Failure|FAILED|error:|WARN|Expected|Which is|actual|code [0-9]+ after" "$OUT"/*_test.log | head -60
fi
if [ "${BENCH:-1}" = 1 ]; then
  n=${BENCH_NAME:-step_bench}
  timeout ${BENCH_TIMEOUT:-240} $B/bin/step_bench --json="$OUT/$n.json" ${BENCH_ARGS:-} > "$OUT/$n.log" 2>&1
  summary+=("$n rc=$?")
  tail -n 8 "$OUT/$n.log"
fi
echo "==== summary ===="
printf '%s\n' "${summary[@]}"
