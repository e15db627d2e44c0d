#!/usr/bin/env bash
# The README's test command: installs what is missing, checks the layering
# rules (tools/layering_check.py) and the source style (tools/format_check.sh),
# runs every test that needs no GPU, runs
# each fuzz target for a few seconds (tools/fuzz.sh;
# FUZZ_SECONDS=0 skips), runs the shell blocks of README.md and
# deploy/README.md (tools/doc_test.py; DOC_TEST=0 skips it), and (where nvcc
# exists) compiles the CUDA build too and runs the CUDA-built daemon's ops
# tests and the CUDA wheel's test (no GPU needed).
# Prints "N passed, N failed" last; exits non-zero if anything failed.
set -uo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh || exit 1
source tools/bazel_quiet.sh

echo "== layering: tools/layering_check.py; style: tools/format_check.sh"
/usr/bin/python3 tools/layering_check.py | tail -n 30
layering_rc=${PIPESTATUS[0]}
bash tools/format_check.sh | tail -n 30
format_rc=${PIPESTATUS[0]}

log=$(mktemp)
bazel_quiet test //... | tee "$log"
rc=${PIPESTATUS[0]}

fuzz_rc=0
fuzz_seconds=${FUZZ_SECONDS:-5}
if [ "$fuzz_seconds" -gt 0 ]; then
  echo "== fuzz targets, ${fuzz_seconds}s each: tools/fuzz.sh"
  bash tools/fuzz.sh --seconds "$fuzz_seconds"
  fuzz_rc=$?
fi

# The documentation's commands (the demo among them): outside Bazel, since
# they run bazel. Skipped under the doc test itself (it does not run this
# script, but a README block that did would recurse).
doc_rc=0
doc_ran=0
if [ "${DOC_TEST:-1}" != 0 ] && [ -z "${HYBRID_PARAMD_DOC_TEST:-}" ]; then
  echo "== README.md and deploy/README.md shell blocks: tools/doc_test.py"
  # Debian's interpreter: a python3 shim (pyenv) would change PATH, which
  # Bazel's actions inherit, and the doc test's builds would redo this one.
  /usr/bin/python3 tools/doc_test.py
  doc_rc=$?
  doc_ran=1
fi

cuda_rc=0
if [ -x /usr/local/cuda/bin/nvcc ] || command -v nvcc >/dev/null 2>&1; then
  echo "== nvcc found: bazel build --config=cuda //..."
  bazel_quiet build --config=cuda //... | tail -n 20
  cuda_rc=${PIPESTATUS[0]}
  if [ "$cuda_rc" -eq 0 ]; then
    # The CUDA build's daemon links the CUDA libraries (their static TLS
    # lands in every thread's stack; libcublasLt's once kept the metrics
    # endpoint's threads from starting): its ops surface, run without a GPU;
    # and the wheel with the CUDA-built library installs and runs.
    echo "== the CUDA build without a GPU: bazel test --config=cuda //tests:server_ops_test //tests:server_single_test //python:wheel_test"
    cuda_log=$(mktemp)
    bazel_quiet test --config=cuda //tests:server_ops_test //tests:server_single_test \
      //python:wheel_test | tee "$cuda_log" | tail -n 5
    cuda_rc=${PIPESTATUS[0]}
    grep -E '^//[^ ]+ +(FAILED|TIMEOUT|NO STATUS|FAILED TO BUILD)' "$cuda_log" || true
    rm -f "$cuda_log"
  fi
fi

passed=$(grep -cE '^//[^ ]+ +(\(cached\) )?PASSED' "$log" || true)
failed=$(grep -cE '^//[^ ]+ +(FAILED|TIMEOUT|NO STATUS|FAILED TO BUILD)' "$log" || true)
[ "$cuda_rc" -ne 0 ] && failed=$((failed + 1)) && echo "CUDA build or its ops tests failed"
[ "$fuzz_rc" -ne 0 ] && failed=$((failed + 1)) && echo "fuzzing failed"
[ "$layering_rc" -ne 0 ] && failed=$((failed + 1)) && echo "the layering check failed"
[ "$layering_rc" -eq 0 ] && passed=$((passed + 1))
[ "$format_rc" -ne 0 ] && failed=$((failed + 1)) && echo "the format check failed"
[ "$format_rc" -eq 0 ] && passed=$((passed + 1))
[ "$doc_rc" -ne 0 ] && failed=$((failed + 1)) && echo "the documentation test failed"
[ "$doc_ran" -eq 1 ] && [ "$doc_rc" -eq 0 ] && passed=$((passed + 1))
rm -f "$log"
echo "$passed passed, $failed failed"
[ "$rc" -eq 0 ] && [ "$cuda_rc" -eq 0 ] && [ "$fuzz_rc" -eq 0 ] && [ "$doc_rc" -eq 0 ] &&
  [ "$layering_rc" -eq 0 ] && [ "$format_rc" -eq 0 ]
