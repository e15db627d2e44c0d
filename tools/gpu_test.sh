#!/usr/bin/env bash
# Every GPU test, in one command: the targets tagged "gpu" (found by a Bazel
# query, so no list to keep up to date), built once with --config=cuda,
# bundled, and run on a machine with a GPU. Ends with one line
#   N passed, N failed, N skipped
# counting gtest cases (and each sh_test as one), then the skipped cases with
# their reasons. Exits non-zero if anything failed or did not run.
#
#   Here (Bazel, no GPU needed):   bash tools/gpu_test.sh bundle [BUNDLE]
#       BUNDLE (default .gpu_bundle_test, git-ignored) then holds one
#       bundle.tar.xz: the test binaries in their workspace layout, what
#       they start (hybrid-paramd, helpers, the Python package and
#       libhybrid_paramd.so) and this script.
#   On the GPU machine (no Bazel):  bash tools/gpu_test.sh run [BUNDLE]
#       Logs and a summary under $OUT (default /tmp/gpu_test_out).
#   Both on one machine with Bazel and a GPU:  bash tools/gpu_test.sh
#
# Knobs (bundle): BAZEL="bazel --output_base=DIR" and BAZEL_BIN=its bin
# folder, to keep the CUDA build out of the CPU build's outputs.
# Knobs (run): JOBS=3 tests at a time (the GPU is shared; 1 for timings),
# TEST_TIMEOUT=600 seconds per test binary, ONLY=regex of targets to run,
# EXCEPT=regex of targets not to run, FIRST=regex of targets to start
# before the rest (the longest, so they do not end the run alone),
# GTEST_FILTER passed to every gtest binary, SHARDS="name:N ..." runs the
# gtest binary "name" as N gtest shards at once (default quantize_test:8, the
# format sweep; each shard counts as one of JOBS only once).
set -uo pipefail
cd "$(dirname "$0")/.."

source tools/gpu_bundle_lib.sh
BAZEL=${BAZEL:-bazel}
BAZEL_BIN=${BAZEL_BIN:-bazel-bin}

# The sh_tests run a script with arguments; everything else is a gtest binary.
target_kind() {
  $BAZEL query --output=label_kind "$1" 2>/dev/null | awk '{print $1}'
}

bundle() {
  local bundle=${1:-.gpu_bundle_test}
  case "$bundle" in .gpu_bundle*) ;; *) echo "bundle folder must be .gpu_bundle* (git-ignored): $bundle" >&2; return 1 ;; esac
  local targets
  mapfile -t targets < <(bundle_tagged gpu tests)
  if [ ${#targets[@]} -eq 0 ]; then echo "no gpu-tagged tests found" >&2; return 1; fi
  echo "gpu-tagged tests: ${#targets[@]}"
  # What they start: the binaries among their data and runfiles.
  local data
  mapfile -t data < <(bundle_data_binaries "${targets[@]}")
  $BAZEL build --config=cuda "${targets[@]}" "${data[@]}" //client:libhybrid_paramd.so || return 1
  rm -rf "$bundle"
  mkdir -p "$bundle"
  : > "$bundle/tests.txt"
  local t kind name pkg
  for t in "${targets[@]}"; do
    kind=$(target_kind "$t")
    name=${t##*:}
    pkg=${t%%:*}
    pkg=${pkg#//}
    if [ "$kind" = sh_test ]; then
      # Its script and the arguments Bazel gives it, with each
      # $(location //pkg:name) as the workspace path pkg/name, which the
      # bundle keeps.
      local rule script args
      rule=$($BAZEL query --output=build "$t" 2>/dev/null)
      script=$(sed -n 's/^ *srcs = \["\([^"]*\)"\],$/\1/p' <<< "$rule" | head -1)
      script=${script#//}
      script=${script/://}
      args=$(sed -n 's/^ *args = \[\(.*\)\],$/\1/p' <<< "$rule" | head -1 |
             sed -E 's/"\$\(location \/\/([^:")]*):([^")]*)\)"/\1\/\2/g; s/"\$\(location :([^")]*)\)"/'"${pkg//\//\\/}"'\/\1/g; s/[",]//g')
      mkdir -p "$bundle/$(dirname "$script")"
      cp "$script" "$bundle/$script"
      echo "$t sh $script $args" >> "$bundle/tests.txt"
    else
      bundle_binary "$BAZEL_BIN/$pkg/$name" "$bundle/$pkg/$name" "$bundle" || return 1
      echo "$t gtest $pkg/$name" >> "$bundle/tests.txt"
    fi
  done
  for t in "${data[@]}"; do
    name=${t##*:}
    pkg=${t%%:*}
    pkg=${pkg#//}
    [ -e "$BAZEL_BIN/$pkg/$name" ] || continue
    bundle_binary "$BAZEL_BIN/$pkg/$name" "$bundle/$pkg/$name" "$bundle" || return 1
  done
  # The Python tests: the package, the library, their scripts.
  mkdir -p "$bundle/python"
  cp -r python/hybrid_paramd python/tests "$bundle/python/"
  cp tools/gpu_test.sh tools/gpu_bundle_lib.sh "$bundle/"
  bundle_pack "$bundle"
  du -sh "$bundle"
}

# Runs one test; prints "RESULT passed failed skipped" on its last line.
run_one() {
  local target=$1 kind=$2 path=$3 log=$4 tmp=$5
  shift 5
  local rc
  mkdir -p "$tmp"
  if [ "$kind" = sh ]; then
    TEST_TMPDIR="$tmp" timeout "${TEST_TIMEOUT:-600}" bash "$path" "$@" > "$log" 2>&1
    rc=$?
    local skipped
    skipped=$(grep -oE 'skipped=[0-9]+' "$log" | tail -1 | cut -d= -f2)
    # A line "skipped=N reason" at its start: the whole script skipped.
    if [ "$rc" -eq 0 ] && grep -qE '^skipped=[0-9]+ ' "$log"; then echo "RESULT 0 0 1 0"
    elif [ "$rc" -eq 0 ]; then echo "RESULT 1 0 ${skipped:-0} 0"
    else echo "RESULT 0 1 0 0 rc=$rc"; fi
    return
  fi
  local shards=1 entry
  for entry in ${SHARDS-quantize_test:8}; do
    if [ "${entry%%:*}" = "$(basename "$path")" ]; then shards=${entry##*:}; fi
  done
  local i pids=() shard_rc
  rc=0
  : > "$log"  # the shards' logs are appended: a rerun into the same $OUT starts empty
  for ((i = 0; i < shards; i++)); do
    mkdir -p "$tmp/shard$i"
    GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i TEST_TMPDIR="$tmp/shard$i" \
      timeout "${TEST_TIMEOUT:-600}" "./$path" \
      ${GTEST_FILTER:+--gtest_filter=$GTEST_FILTER} > "$log.shard$i" 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"
    shard_rc=$?
    if [ "$shard_rc" -ne 0 ]; then rc=$shard_rc; fi
    cat "$log.shard$i" >> "$log"
    rm -f "$log.shard$i"
  done
  local ok failed skipped
  ok=$(grep -cE '^\[       OK \] .* \([0-9]+ ms\)$' "$log")
  failed=$(grep -cE '^\[  FAILED  \] .* \([0-9]+ ms\)$' "$log")
  skipped=$(grep -cE '^\[  SKIPPED \] .* \([0-9]+ ms\)$' "$log")
  # A binary that crashed or timed out fails even where no case said so.
  if [ "$rc" -ne 0 ] && [ "$failed" -eq 0 ]; then failed=1; fi
  echo "RESULT $ok $failed $skipped 0 rc=$rc"
}

run_all() {
  local dir=${1:-.}
  OUT=${OUT:-/tmp/gpu_test_out}
  local logs="$OUT/logs"
  mkdir -p "$logs"
  cd "$dir" || return 1
  source ./gpu_bundle_lib.sh
  bundle_run_env "$PWD"
  # The Python tests run under this machine's python3 (the one with CUDA
  # torch), not the build machine's /usr/bin/python3.
  PYTHON=${PYTHON:-$(command -v python3)}
  export PYTHON
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
  date -u +%Y-%m-%dT%H:%M:%SZ | tee -a "$OUT/gpu.txt"
  local jobs=${JOBS:-3} running=0 line target kind path
  local -a order=()
  local -a lines=()
  if [ -n "${FIRST:-}" ]; then
    mapfile -t lines < <(awk -v re="$FIRST" '$1 ~ re' tests.txt; awk -v re="$FIRST" '$1 !~ re' tests.txt)
  else
    mapfile -t lines < tests.txt
  fi
  for line in "${lines[@]}"; do
    read -r target kind path args <<< "$line"
    if [ -n "${ONLY:-}" ] && ! [[ "$target" =~ $ONLY ]]; then continue; fi
    if [ -n "${EXCEPT:-}" ] && [[ "$target" =~ $EXCEPT ]]; then continue; fi
    local name=${target#//}
    name=${name//[:\/]/_}
    order+=("$target|$name")
    # shellcheck disable=SC2086  # the sh_test's arguments, one word each
    ( run_one "$target" "$kind" "$path" "$logs/$name.log" "/tmp/gpu_test_tmp/$name" $args \
        > "$logs/$name.result" ) &
    running=$((running + 1))
    if [ "$running" -ge "$jobs" ]; then wait -n; running=$((running - 1)); fi
  done
  wait
  local passed failed skipped entry p f s ps rest
  for entry in "${order[@]}"; do
    target=${entry%%|*}
    local name=${entry##*|}
    read -r _ p f s ps rest < <(tail -1 "$logs/$name.result" 2>/dev/null || echo "RESULT 0 1 0 0 no result")
    printf '%-60s %s passed, %s failed, %s skipped %s\n' "$target" "$p" "$f" "$s" "${rest:-}"
    if [ "$f" -gt 0 ]; then
      grep -h -B2 -A12 -E 'Failure$|^\[  FAILED  \]|^FAIL:|^ERROR:|Traceback' "$logs/$name.log" | head -60
    fi
  done | tee "$OUT/summary.txt"
  # The totals from the per-test lines (the loop above ran in a pipeline).
  passed=$(grep -E '^//' "$OUT/summary.txt" | awk '{p += $2} END {print p+0}')
  failed=$(grep -E '^//' "$OUT/summary.txt" | awk '{f += $4} END {print f+0}')
  skipped=$(grep -E '^//' "$OUT/summary.txt" | awk '{s += $6} END {print s+0}')
  echo "== skipped, and why"
  grep -h -B1 -E '^\[  SKIPPED \] .* \([0-9]+ ms\)$' "$logs"/*.log | grep -vE '^--$' |
    paste - - | sed -E 's/^[^:]+:[0-9]+: Skipped\t?//' | head -50
  grep -h -E "skipped '" "$logs"/*.log | sort | uniq -c | head -20
  grep -h -E '^skipped=[0-9]+ ' "$logs"/*.log | head -20
  tar -C "$logs" -czf "$OUT/logs.tar.gz" .
  echo "$passed passed, $failed failed, $skipped skipped"
  [ "$failed" -eq 0 ]
}

case "${1:-all}" in
  bundle) bundle "${2:-.gpu_bundle_test}" ;;
  run)
    dir=$(bundle_extract "${2:-.gpu_bundle_test}" /tmp/gpu_test_bundle) || exit 1
    run_all "$dir"
    ;;
  all)
    bundle .gpu_bundle_test || exit 1
    run_all "$(bundle_extract .gpu_bundle_test /tmp/gpu_test_bundle)"
    ;;
  -h|--help) sed -n '2,20p' "$0" ;;
  *) echo "usage: bash tools/gpu_test.sh [bundle [BUNDLE] | run [BUNDLE]]" >&2; exit 2 ;;
esac
