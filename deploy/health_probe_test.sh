#!/usr/bin/env bash
# //deploy:health_probe_test: hybrid-paramd-health against real processes on
# loopback. A coordinator waiting for its daemon is NOT_SERVING (exit 1, the
# status on stderr), SERVING for paramd.rpc.Coordinator once the daemon has
# joined, the process health "" only once a model is loaded; a closed port is
# exit 1 with the reason; over TLS the probe needs the CA (plaintext to a TLS
# port fails) and succeeds with it.
#   health_probe_test.sh HYBRID_PARAMD HEALTH HPCTL MAKE_CERTS
set -uo pipefail
server=$1 probe=$2 hpctl=$3 make_certs=$4
tmp=$(mktemp -d "${TEST_TMPDIR:-/tmp}/health_probe.XXXXXX")
pids=()
cleanup() {
  for p in ${pids[@]+"${pids[@]}"}; do kill "$p" 2>/dev/null; done
  for p in ${pids[@]+"${pids[@]}"}; do wait "$p" 2>/dev/null; done
  rm -rf "$tmp"
}
trap cleanup EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# Starts hybrid-paramd NAME FLAGS...; sets $port once its port file exists.
start() {
  local name=$1; shift
  rm -f "$tmp/$name.port"
  "$server" --port_file="$tmp/$name.port" "$@" >"$tmp/$name.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 200); do
    [ -s "$tmp/$name.port" ] && { port=$(cat "$tmp/$name.port"); return 0; }
    kill -0 "${pids[-1]}" 2>/dev/null || break
    sleep 0.1
  done
  echo "hybrid-paramd $name did not start:"; cat "$tmp/$name.log"; exit 1
}

# expect RC NEEDLE PROBE-ARGS...: the probe's exit code and that its output
# contains NEEDLE.
expect() {
  local want=$1 needle=$2; shift 2
  local out rc
  out=$("$probe" "$@" 2>&1); rc=$?
  if [ "$rc" != "$want" ]; then
    fail "hybrid-paramd-health $* exited $rc, want $want: $out"
  elif [[ "$out" != *"$needle"* ]]; then
    fail "hybrid-paramd-health $* said '$out', want '$needle'"
  else
    echo "ok: $* -> $rc: $out"
  fi
}

"$hpctl" generate --out "$tmp/m.safetensors" --preset demo >/dev/null || { echo "hpctl generate failed"; exit 1; }

# Plaintext on loopback: a coordinator expecting one daemon.
start coordinator --role=coordinator --listen=127.0.0.1:0 --daemons=1 --expected_pushers=0
c=127.0.0.1:$port
expect 1 NOT_SERVING --address=$c --service=paramd.rpc.Coordinator
expect 1 "NOT_SERVING after 1 s" --address=$c --service=paramd.rpc.Coordinator --wait=1
start daemon --role=daemon --listen=127.0.0.1:0 --coordinator=$c --backend=cpu
expect 0 SERVING --address=$c --service=paramd.rpc.Coordinator --wait=20
# Joined but no model yet: the process as a whole is not ready.
expect 1 NOT_SERVING --address=$c --wait=1
"$hpctl" load "$tmp/m.safetensors" --address "$c" >/dev/null 2>&1 || fail "hpctl load failed"
expect 0 SERVING --address=$c --wait=20
expect 0 SERVING --address=127.0.0.1:$port --service=paramd.rpc.Daemon --wait=20
expect 0 "" --address=$c --quiet
[ -z "$("$probe" --address=$c --quiet 2>&1)" ] || fail "--quiet printed something"
for p in ${pids[@]}; do kill "$p"; wait "$p" 2>/dev/null; done
pids=()
expect 1 "no answer" --address=$c --timeout=1

# TLS: the probe checks the server with the CA.
bash "$make_certs" "$tmp/certs" >/dev/null 2>&1 || { echo "make_certs.sh failed"; exit 1; }
start tls --role=both --listen=127.0.0.1:0 --model="$tmp/m.safetensors" \
  --tls_cert="$tmp/certs/server.pem" --tls_key="$tmp/certs/server.key" --tls_ca="$tmp/certs/ca.pem"
expect 0 SERVING --address=127.0.0.1:$port --tls_ca="$tmp/certs/ca.pem" --wait=20
expect 1 "no answer" --address=127.0.0.1:$port --timeout=1
expect 1 "no answer" --address=127.0.0.1:$port --tls_ca="$tmp/certs/other-ca.pem" --timeout=1
expect 2 "" --address=127.0.0.1:$port --tls_ca="$tmp/certs/missing.pem"

if [ "$failures" -gt 0 ]; then
  echo "$failures check(s) failed"; exit 1
fi
echo "all health probe checks passed"
