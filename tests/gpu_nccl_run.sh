#!/usr/bin/env bash
# Issue 5's NCCL runs in one device call: the shared-GPU reproducer (raw
# NCCL and the transport), the NCCL transport tests, the fetch / kill tests,
# the multi-process daemon_fetch_test (with the two-daemons-on-one-GPU
# guard check) and the step benchmark twice.
#
#   Here:  BUNDLE=.gpu_bundle_transport2 bash tests/gpu_nccl_run.sh bundle
#          (bazel --config=cuda build; $BUNDLE/bundle.tar.xz holds the
#          binaries at their workspace paths (daemon_fetch_test finds
#          server/hybrid-paramd and tests/gpu_integration/device_fetch_loop
#          from the unpacked root) plus the non-system shared libraries,
#          compressed to stay under the 64 MiB a call carries; git-ignored
#          by /.gpu_bundle*/)
#   There: run(command="BUNDLE=.gpu_bundle_transport2 bash tests/gpu_nccl_run.sh run",
#              carry=[".gpu_bundle_transport2"], kind="nvidia-h200-x2")
#          Logs come back as $OUT/logs.tar.gz, the bench JSONs as
#          $OUT/step_bench_<n>.json, the summary on stdout. NVLink multicast
#          stays off (NCCL_NVLS_ENABLE=0).
# Knobs (run): REPRO=0 / TESTS=0 / BENCH=0 / EXTRA=0 skip a part; REPRO=visible
# runs the reproducer with senders that see one GPU (like hybrid-paramd
# --gpu=0), also with a receiver that holds a context on the senders' GPU,
# instead; TESTS=daemon runs only daemon_fetch_test and its
# two-daemons-on-one-GPU variants (guard, guard bypassed, NCCL_P2P_DISABLE=1);
# BENCH_RUNS (2);
# BENCH_ARGS extra step_bench flags; REPRO_ITERS (150); EXTRA_UNTIL (110: the
# reproducer's variants run at the end while the script is younger).
set -uo pipefail
cd "$(dirname "$0")/.."
B=${BUNDLE:-.gpu_bundle_nccl}
TARGETS=(
  //transport:nccl_test
  //transport:nccl_shared_gpu_repro
  //tests/gpu_integration:fetch_test
  //tests/gpu_integration:kill_test
  //tests/gpu_integration:daemon_fetch_test
  //tests/gpu_integration:device_fetch_loop
  //server:hybrid-paramd
  //tests/step_bench:step_bench
)

if [ "${1:-}" = bundle ]; then
  source tools/gpu_bundle_lib.sh
  bundle_build_pack "$B" "${TARGETS[@]}"
  exit $?
fi

OUT=${OUT:-/tmp/gpu_nccl_out}
L=/tmp/gpu_nccl_logs
mkdir -p "$OUT" "$L"
U=/tmp/gpu_nccl_bundle
source tools/gpu_bundle_lib.sh
bundle_unpack "$B" "$U" || exit 1
bundle_run_env "$U"
{
  date -u
  nvidia-smi --query-gpu=index,name,driver_version,pci.bus_id --format=csv
  nvidia-smi topo -m
} > "$L/gpu.txt" 2>&1
head -4 "$L/gpu.txt"
cd "$U"
ldd transport/nccl_test | grep -E "nccl|cudart"
ldd server/hybrid-paramd tests/step_bench/step_bench | grep "not found" && echo "MISSING LIBRARIES"
export TEST_TMPDIR=/tmp/paramd_nccl_tmp
mkdir -p "$TEST_TMPDIR"
summary=()

R=transport/nccl_shared_gpu_repro
repro() {  # name, env..., -- args...
  local name=$1; shift
  local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  env "${envs[@]}" timeout 30 $R --timeout_s=25 "$@" > "$L/repro_$name.log" 2>&1
  local rc=$?
  summary+=("repro $name rc=$rc: $(grep -E '^(REPRO|HANG)' "$L/repro_$name.log" | tr '\n' ' ')")
  grep -hE "^RESULT|first wrong|exited|HANG" "$L/repro_$name.log" | sed "s/^/[$name] /"
}
save() { tar -C "$L" -czf "$OUT/logs.tar.gz" .; }
if [ "${TESTS:-1}" = daemon ]; then
  # The multi-process test in the background while the reproducer runs.
  timeout 90 tests/gpu_integration/daemon_fetch_test > "$L/daemon_fetch_test.log" 2>&1 & pd=$!
fi
if [ "${REPRO:-1}" = 1 ]; then
  I=${REPRO_ITERS:-150}
  repro raw NCCL_DEBUG=WARN -- --mode=raw --iters=$I
  repro transport NCCL_DEBUG=WARN -- --mode=transport --iters=$I
  save
elif [ "${REPRO:-1}" = visible ]; then
  # Senders that see only their GPU, like hybrid-paramd --gpu=0.
  I=${REPRO_ITERS:-150}
  repro raw_visible NCCL_DEBUG=WARN -- --mode=raw --senders_see_one_gpu --iters=$I
  repro transport_visible NCCL_DEBUG=WARN -- --mode=transport --senders_see_one_gpu --iters=$I
  repro raw_nonblocking_visible NCCL_DEBUG=WARN -- --mode=raw --nonblocking --senders_see_one_gpu --iters=$I
  # ...and a receiver that also holds a context on the senders' GPU, like
  # daemon_fetch_test's process.
  repro transport_visible_both NCCL_DEBUG=WARN -- --mode=transport --senders_see_one_gpu \
    --receiver_uses_sender_gpu --iters=$I
  repro raw_nonblocking_visible_both NCCL_DEBUG=WARN -- --mode=raw --nonblocking \
    --senders_see_one_gpu --receiver_uses_sender_gpu --iters=$I
  save
fi
if [ "${TESTS:-1}" = daemon ]; then
  # Two daemons on GPU 0, the trainer on GPU 1: the guard must refuse
  # (FAILED_PRECONDITION); with it bypassed (PARAMD_ALLOW_SHARED_GPU_NCCL=1)
  # the corruption shows or not; with NCCL_P2P_DISABLE=1 it must pass.
  sg() {  # name, env...
    local name=$1; shift
    env PARAMD_SPLIT_SAME_GPU=1 "$@" timeout 40 tests/gpu_integration/daemon_fetch_test \
      --gtest_filter='*Split*/Fp8Current:*Split*/Nvfp4' > "$L/same_gpu_$name.log" 2>&1
    local rc=$?
    summary+=("same-GPU daemons, $name rc=$rc: $(grep -m1 -oE 'FAILED_PRECONDITION[^\"]{0,120}' "$L/same_gpu_$name.log") $(grep -E '^\[  (PASSED|FAILED)  \]' "$L/same_gpu_$name.log" | tr '\n' ' ')")
  }
  sg guard
  sg bypass_blocking PARAMD_ALLOW_SHARED_GPU_NCCL=1
  sg bypass_nonblocking PARAMD_ALLOW_SHARED_GPU_NCCL=1 PARAMD_NCCL_BLOCKING=0
  sg p2p_off NCCL_P2P_DISABLE=1
  grep -hE "Failure|Expected|Which is|illegal|FAILED_PRECONDITION" "$L"/same_gpu_bypass*.log | head -12
  wait $pd
  rd=$?
  summary+=("daemon_fetch_test rc=$rd: $(grep -E '^\[  (PASSED|FAILED)  \]|tests? ran' "$L/daemon_fetch_test.log" | tr '\n' ' ')")
  save
  grep -hE "Failure|FAILED|Expected|Which is|actual" "$L"/daemon_fetch_test.log | head -20
  grep -h "DEVICE_FETCH_BENCH\|daemon killed after\|closed: " "$L/daemon_fetch_test.log" | head -8
fi

if [ "${TESTS:-1}" = 1 ]; then
  timeout 75 transport/nccl_test > "$L/nccl_test.log" 2>&1 & p1=$!
  timeout 75 tests/gpu_integration/fetch_test > "$L/fetch_test.log" 2>&1 & p2=$!
  timeout 75 tests/gpu_integration/kill_test > "$L/kill_test.log" 2>&1 & p3=$!
  timeout 75 tests/gpu_integration/daemon_fetch_test > "$L/daemon_fetch_test.log" 2>&1 & p4=$!
  wait $p1; r1=$?; wait $p2; r2=$?; wait $p3; r3=$?; wait $p4; r4=$?
  for t in nccl_test:$r1 fetch_test:$r2 kill_test:$r3 daemon_fetch_test:$r4; do
    n=${t%%:*}
    summary+=("$n rc=${t##*:}: $(grep -E '^\[  (PASSED|FAILED)  \]|tests? ran' "$L/$n.log" | tr '\n' ' ')")
  done
  # Two daemons on GPU 0, the trainer on GPU 1: the guard must refuse
  # (FAILED_PRECONDITION); with NCCL_P2P_DISABLE=1 it must pass.
  PARAMD_SPLIT_SAME_GPU=1 timeout 60 tests/gpu_integration/daemon_fetch_test \
    --gtest_filter='*Split*/Fp8Current' > "$L/same_gpu_guard.log" 2>&1
  rg=$?
  summary+=("same-GPU daemons, guard (expect a FAILED_PRECONDITION failure) rc=$rg: $(grep -m1 -oE 'FAILED_PRECONDITION[^\"]{0,160}' "$L/same_gpu_guard.log")")
  PARAMD_SPLIT_SAME_GPU=1 NCCL_P2P_DISABLE=1 timeout 60 tests/gpu_integration/daemon_fetch_test \
    --gtest_filter='*Split*/Fp8Current:*Split*/Nvfp4:*Split*/Mxfp8' > "$L/same_gpu_p2p_off.log" 2>&1
  rp=$?
  summary+=("same-GPU daemons, NCCL_P2P_DISABLE=1 rc=$rp: $(grep -E '^\[  (PASSED|FAILED)  \]' "$L/same_gpu_p2p_off.log" | tr '\n' ' ')")
  save
  echo "---- failures ----"
  grep -hE "Failure|FAILED|error:|Expected|Which is|actual|code [0-9]+ after" \
    "$L"/nccl_test.log "$L"/fetch_test.log "$L"/kill_test.log "$L"/daemon_fetch_test.log | head -40
fi

if [ "${BENCH:-1}" = 1 ]; then
  for i in $(seq "${BENCH_RUNS:-2}"); do
    timeout 45 tests/step_bench/step_bench --json="$OUT/step_bench_$i.json" ${BENCH_ARGS:-} \
      > "$L/step_bench_$i.log" 2>&1
    rb=$?
    summary+=("step_bench $i rc=$rb")
    grep -E "RATIO|^fp8 |^bf16 |direction communicators" "$L/step_bench_$i.log"
  done
fi
save
# The reproducer's variants, while the call's time lasts (EXTRA_UNTIL s).
if [ "${REPRO:-1}" = 1 ] && [ "${EXTRA:-1}" = 1 ]; then
  for v in "raw_p2p_off NCCL_P2P_DISABLE=1 -- --mode=raw --iters=80" \
           "raw_nonblocking NCCL_DEBUG=WARN -- --mode=raw --nonblocking --iters=80" \
           "raw_skew NCCL_DEBUG=WARN -- --mode=raw --skew --iters=80" \
           "raw_cumem_off NCCL_CUMEM_ENABLE=0 -- --mode=raw --iters=80" \
           "transport_p2p_off NCCL_P2P_DISABLE=1 -- --mode=transport --iters=80"; do
    [ "$SECONDS" -lt "${EXTRA_UNTIL:-110}" ] || { summary+=("skipped (time): ${v%% *}"); continue; }
    repro $v
  done
  save
fi
echo "==== summary ===="
printf '%s\n' "${summary[@]}"
