#!/usr/bin/env bash
# libhybrid_paramd.so exports the C API of client/c_api.h (and c_api_ipc.h) and nothing else
# (so it cannot clash with torch / grpcio / protobuf in one process).
set -euo pipefail
# Usage: c_api_symbols_test.sh LIB HEADER...
lib="$1"
shift
exported=$(nm -D --defined-only "$lib" | awk '$2 ~ /^[TDBRVW]$/ {print $3}' | sed 's/@.*//' | sort -u)
declared=$(cat "$@" | grep -oE 'HPD_EXPORT [^(]*\bhpd_[a-z_]+\(' | grep -oE 'hpd_[a-z_]+' | sort -u)
if [ -z "$declared" ]; then echo "no HPD_EXPORT declarations in $*" >&2; exit 1; fi
if [ "$exported" != "$declared" ]; then
  echo "exported symbols differ from the header's API:" >&2
  diff <(echo "$declared") <(echo "$exported") >&2 || true
  exit 1
fi
echo "OK: $(echo "$exported" | wc -l) symbols, all hpd_*"
