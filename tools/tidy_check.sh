#!/usr/bin/env bash
# clang-tidy (.clang-tidy: bugprone-*, performance-*) on the tree's C++.
#
#   bash tools/tidy_check.sh                 # the .cc files changed since origin/main (or HEAD~1)
#   bash tools/tidy_check.sh FILE.cc ...     # these files
#   bash tools/tidy_check.sh --all           # every host .cc file (slow: ~5 s a file per core)
#
# Needs the generated protobuf headers: run `bazel build //...` first.
# Exit 1 when a file has findings; each is printed with file and line.
set -uo pipefail
cd "$(dirname "$0")/.."
TIDY=${CLANG_TIDY:-clang-tidy}
JOBS=${JOBS:-$(nproc)}
if ! command -v "$TIDY" > /dev/null; then
  echo "tidy_check: $TIDY not found (bash tools/install_deps.sh installs clang-tidy)" >&2
  exit 2
fi
if [ ! -d bazel-bin/proto ]; then
  echo "tidy_check: no bazel-bin/proto: run 'bazel build //...' first (generated headers)" >&2
  exit 2
fi
PACKAGES='^(auth|checkpoint|client|common|format|hpctl|ipc|kernels|recipe|safetensors|server|sharding|transport|deploy|tests)/'
if [ "${1:-}" = "--all" ]; then
  mapfile -t FILES < <(git ls-files '*.cc' | grep -E "$PACKAGES")
elif [ $# -gt 0 ]; then
  FILES=("$@")
else
  base=$(git merge-base HEAD origin/main 2> /dev/null || git rev-parse HEAD~1)
  mapfile -t FILES < <(git diff --name-only --diff-filter=AM "$base" -- '*.cc' | grep -E "$PACKAGES")
fi
# Files that only build with CUDA (their headers need the toolkit) are
# checked with the toolkit's include path when it is there.
CUDA_INC=()
[ -d /usr/local/cuda/include ] && CUDA_INC=(-isystem /usr/local/cuda/include -DHPD_WITH_CUDA=1)
if [ ${#FILES[@]} -eq 0 ]; then
  echo "tidy_check: no C++ files to check"
  exit 0
fi
out=$(mktemp)
printf '%s\n' "${FILES[@]}" | xargs -P "$JOBS" -I{} sh -c \
  '"$0" -quiet "{}" -- -std=c++17 -xc++ -I. -Ibazel-bin '"${CUDA_INC[*]}"' 2>/dev/null | grep -E "^[^ ].*(warning|error):" ' \
  "$TIDY" > "$out"
n=$(sort -u "$out" | tee /dev/stderr | wc -l)
rm -f "$out"
echo "tidy_check: ${#FILES[@]} file(s), $n finding(s)"
[ "$n" -eq 0 ]
