#!/usr/bin/env bash
# Builds and runs the libFuzzer targets of fuzz/ (Debian clang + libfuzzer-14-dev):
#   safetensors_fuzz      SafetensorsFile::Open (hpctl inspect/load, Coordinator.Load)
#   recipe_fuzz           Recipe::Parse and Resolve (RE2 patterns)
#   request_checks_fuzz   the request validation of every RPC handler
#
#   bash tools/fuzz.sh                      # each target 600 s (the long run)
#   bash tools/fuzz.sh --seconds 5          # what CI runs (tools/test.sh)
#   bash tools/fuzz.sh --seconds 60 recipe_fuzz
#
# Each target starts from its seed corpus fuzz/corpus/<target minus _fuzz>/
# (read only; new inputs go to a scratch corpus under the build directory)
# and runs with AddressSanitizer + UndefinedBehaviorSanitizer and a 10 s
# per-input timeout, so a crash, a sanitizer report or a hang (a regex that
# backtracks) fails the run; the reproducer is left in the build directory,
# named in the output. Exit status: 0 if every target ran clean.
#
# Why a script and not Bazel: the Bazel toolchain here is the autodetected
# gcc one, and libFuzzer needs clang's -fsanitize=fuzzer; adding a second
# C++ toolchain to Bazel 4 (offline, no rules_cc download) costs more than
# compiling these few sources directly against the same system libraries
# (protobuf, abseil, re2 from Debian), which is what this does.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=600
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds="$2"; shift 2 ;;
    --seconds=*) seconds="${1#*=}"; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[ ${#targets[@]} -eq 0 ] && targets=(safetensors_fuzz recipe_fuzz request_checks_fuzz)

CXX=${CXX:-clang++}
command -v "$CXX" >/dev/null || { echo "fuzz.sh: $CXX not found (apt-get install clang libfuzzer-14-dev)" >&2; exit 1; }
build=${FUZZ_BUILD_DIR:-/tmp/hybrid-paramd-fuzz-$(id -u)}
mkdir -p "$build/gen"

# Generated protobuf code, once per proto change.
for proto in proto/paramd.proto proto/recipe.proto proto/optimizer.proto proto/frozen.proto; do
  out="$build/gen/${proto%.proto}.pb.cc"
  if [ ! -f "$out" ] || [ "$proto" -nt "$out" ]; then
    protoc -I. --cpp_out="$build/gen" "$proto"
  fi
done

FLAGS=(-std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
       -I. -I"$build/gen" -w)
ABSL_LIBS=(-labsl_statusor -labsl_status -labsl_cord -labsl_cordz_info -labsl_cord_internal
           -labsl_cordz_functions -labsl_cordz_handle -labsl_str_format_internal -labsl_strings
           -labsl_strings_internal -labsl_synchronization -labsl_graphcycles_internal -labsl_time
           -labsl_time_zone -labsl_hash -labsl_city -labsl_low_level_hash -labsl_raw_hash_set
           -labsl_stacktrace -labsl_symbolize -labsl_debugging_internal -labsl_demangle_internal
           -labsl_malloc_internal -labsl_int128 -labsl_throw_delegate -labsl_base
           -labsl_raw_logging_internal -labsl_log_severity -labsl_spinlock_wait
           -labsl_exponential_biased -labsl_bad_optional_access -labsl_strerror)

sources_of() {
  case "$1" in
    safetensors_fuzz) echo fuzz/safetensors_fuzz.cc safetensors/safetensors.cc safetensors/json_util.cc \
                           safetensors/atomic_file.cc common/file_util.cc common/names.cc ;;
    recipe_fuzz) echo fuzz/recipe_fuzz.cc recipe/recipe.cc kernels/format.cc common/names.cc common/file_util.cc \
                      "$build/gen/proto/recipe.pb.cc" "$build/gen/proto/optimizer.pb.cc" ;;
    request_checks_fuzz) echo fuzz/request_checks_fuzz.cc server/rpc/request_checks.cc common/names.cc \
                              safetensors/safetensors.cc safetensors/json_util.cc \
                              safetensors/atomic_file.cc common/file_util.cc \
                              "$build/gen/proto/paramd.pb.cc" "$build/gen/proto/optimizer.pb.cc" \
                              "$build/gen/proto/frozen.pb.cc" ;;
    *) echo "fuzz.sh: unknown target $1" >&2; return 1 ;;
  esac
}

rc=0
for t in "${targets[@]}"; do
  srcs=$(sources_of "$t")
  bin="$build/$t"
  # Rebuild when any source is newer than the binary.
  stale=0
  [ -x "$bin" ] || stale=1
  for s in $srcs; do [ "$s" -nt "$bin" ] && stale=1; done
  if [ $stale = 1 ]; then
    echo "== fuzz.sh: building $t"
    # shellcheck disable=SC2086
    "$CXX" "${FLAGS[@]}" $srcs -o "$bin" -lprotobuf -lre2 "${ABSL_LIBS[@]}" -lpthread
  fi
  seeds="fuzz/corpus/${t%_fuzz}"
  scratch="$build/corpus/$t"
  mkdir -p "$scratch"
  echo "== fuzz.sh: $t for ${seconds}s (seeds $seeds)"
  if ! (cd "$build" && "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
          -max_len=65536 -print_final_stats=1 "$scratch" "$OLDPWD/$seeds" \
          > "$build/$t.log" 2>&1); then
    echo "FAILED: $t (log $build/$t.log; reproducer in $build)" >&2
    tail -n 40 "$build/$t.log" >&2
    rc=1
  else
    grep -E "^(stat::number_of_executed_units|#[0-9]+ +DONE)" "$build/$t.log" | tail -n 2 || true
    echo "ok: $t"
  fi
done
exit $rc
