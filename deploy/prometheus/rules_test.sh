#!/usr/bin/env bash
# //deploy/prometheus:rules_test: alerts.yml is valid (promtool check rules),
# each alert fires and stays quiet as alerts_test.yml says (promtool test
# rules), and every metric its expressions name is one a running
# hybrid-paramd serves (a coordinator + daemon with a model, scraped once).
#   rules_test.sh HYBRID_PARAMD HEALTH HPCTL ALERTS ALERTS_TEST
set -euo pipefail
server=$1 health=$2 hpctl=$3 alerts=$4 alerts_test=$5
command -v promtool >/dev/null || { echo "promtool missing: bash tools/install_deps.sh (Debian package prometheus)"; exit 1; }
promtool check rules "$alerts"
# promtool resolves rule_files relative to the test file.
(cd "$(dirname "$alerts_test")" && promtool test rules "$(basename "$alerts_test")")

tmp=$(mktemp -d "${TEST_TMPDIR:-/tmp}/rules.XXXXXX")
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$tmp"' EXIT
"$hpctl" generate --out "$tmp/m.safetensors" --preset demo >/dev/null
metrics_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$server" --role=both --listen=127.0.0.1:0 --port_file="$tmp/port" --model="$tmp/m.safetensors" \
  --metrics_listen="127.0.0.1:$metrics_port" >"$tmp/server.log" 2>&1 &
pid=$!
for _ in $(seq 200); do [ -s "$tmp/port" ] && break; sleep 0.1; done
[ -s "$tmp/port" ] || { echo "hybrid-paramd did not start:"; cat "$tmp/server.log"; exit 1; }
"$health" --address="127.0.0.1:$(cat "$tmp/port")" --wait=20
# One refused RPC (a checkpoint without --checkpoint_dir), so that
# paramd_refused_requests_total has a series.
if "$hpctl" checkpoint --address="127.0.0.1:$(cat "$tmp/port")" >/dev/null 2>&1; then
  echo "a checkpoint without --checkpoint_dir succeeded"; exit 1
fi
scrape=$(python3 -c "import urllib.request,sys; print(urllib.request.urlopen('http://127.0.0.1:$metrics_port/metrics').read().decode())")
missing=0
for name in $(grep -E '^ *expr:' "$alerts" | grep -oE '\b(paramd|process)_[a-z_]+' | sort -u); do
  if grep -qE "^# TYPE $name " <<< "$scrape"; then
    echo "served: $name"
  else
    echo "FAIL: alerts.yml names $name, which hybrid-paramd does not serve"
    missing=$((missing + 1))
  fi
done
[ "$missing" = 0 ] || exit 1
echo "alert rules checked"
