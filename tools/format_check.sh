#!/usr/bin/env bash
# The C++/CUDA sources in the style of .clang-format (Google, 100 columns):
# lists each file clang-format would change and exits 1 if there is any.
#   bash tools/format_check.sh          # check
#   bash tools/format_check.sh --fix    # reformat in place
set -uo pipefail
cd "$(dirname "$0")/.."
if ! command -v clang-format >/dev/null 2>&1; then
  echo "format_check: clang-format is not installed (bash tools/install_deps.sh)" >&2
  exit 1
fi
mapfile -t files < <(git ls-files '*.h' '*.cc' '*.cu' '*.cuh' | grep -v '^third_party/')
if [ "${1:-}" = "--fix" ]; then
  clang-format -i "${files[@]}"
  exit 0
fi
bad=0
for f in "${files[@]}"; do
  if ! clang-format --dry-run -Werror "$f" >/dev/null 2>&1; then
    echo "format_check: $f is not formatted (bash tools/format_check.sh --fix)"
    bad=$((bad + 1))
  fi
done
echo "format_check: ${#files[@]} files, $bad to reformat"
[ "$bad" -eq 0 ]
