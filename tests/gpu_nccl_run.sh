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
# Everything in one call (kernels + transport + investigation + network path):
#   run(command="BUNDLE=.gpu_bundle_transport3 KERNELS=1 NET=1 REPRO=visible TESTS=all
#                BENCH_RUNS=1 EXTRA=0 bash tests/gpu_nccl_run.sh run",
#       carry=[".gpu_bundle_transport3"], kind="nvidia-h200-x2")
# Knobs (run): REPRO=0 / TESTS=0 / BENCH=0 / EXTRA=0 skip a part; REPRO=visible
# runs the reproducer with senders that see one GPU (like hybrid-paramd
# --gpu=0), also with a receiver that holds a context on the senders' GPU,
# instead; TESTS=daemon runs only daemon_fetch_test and its
# two-daemons-on-one-GPU variants (guard, guard bypassed, NCCL_P2P_DISABLE=1);
# TESTS=all runs both sets; KERNELS=1 runs quantize_test (8 shards), amax_test
# and optimizer_test on GPU 0 beside the reproducer (saves a 1-GPU call's
# machine start); NET=1 emulates the cross-machine path on one host:
# NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 (NCCL's network transport) for
# nccl_test, kill_test, fetch_test and a real daemon with
# --device_channel_listen=0.0.0.0:0 serving deploy/gpu_trainer on GPU 1;
# BUDGET_S (400): parts after the tests are skipped once the script is older;
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
  //deploy/gpu_trainer:gpu_trainer
  //kernels/cuda:quantize_test
  //kernels/cuda:amax_test
  //kernels/cuda:optimizer_test
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
TESTS=${TESTS:-1}
in_time() {  # part: false (and noted) once the script is older than BUDGET_S
  if [ "$SECONDS" -ge "${BUDGET_S:-400}" ]; then summary+=("skipped (time, ${SECONDS}s): $1"); return 1; fi
}
result() {  # name, rc, log
  summary+=("$1 rc=$2 (${SECONDS}s): $(grep -E '^\[  (PASSED|FAILED)  \]|tests? ran' "$3" | tr '\n' ' ')")
}
if [ "${KERNELS:-0}" = 1 ]; then
  # The kernel tests on GPU 0 while the reproducer runs.
  kp=()
  for i in 0 1 2 3 4 5 6 7; do
    CUDA_VISIBLE_DEVICES=0 GTEST_TOTAL_SHARDS=8 GTEST_SHARD_INDEX=$i timeout 150 \
      kernels/cuda/quantize_test > "$L/quantize_test.shard$i.log" 2>&1 &
    kp+=($!)
  done
  CUDA_VISIBLE_DEVICES=0 timeout 100 kernels/cuda/amax_test > "$L/amax_test.log" 2>&1 & ka=$!
  CUDA_VISIBLE_DEVICES=0 timeout 150 kernels/cuda/optimizer_test > "$L/optimizer_test.log" 2>&1 & ko=$!
fi
if [ "$TESTS" = daemon ]; then
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
if [ "${KERNELS:-0}" = 1 ]; then
  rk=0
  for p in "${kp[@]}"; do wait "$p" || rk=1; done
  wait $ka; ra=$?; wait $ko; ro=$?
  cat "$L"/quantize_test.shard*.log > "$L/quantize_test.log"
  rm -f "$L"/quantize_test.shard*.log
  summary+=("quantize_test (8 shards) rc=$rk (${SECONDS}s): $(grep -c '^\[       OK \]' "$L/quantize_test.log") OK, $(grep -cE '^\[  FAILED  \] .*\([0-9]+ ms\)$' "$L/quantize_test.log") failed")
  result amax_test $ra "$L/amax_test.log"
  result optimizer_test $ro "$L/optimizer_test.log"
  grep -hE "Failure|FAILED|error" "$L"/quantize_test.log "$L"/amax_test.log "$L"/optimizer_test.log | head -10
  save
fi
if [ "$TESTS" = daemon ] || [ "$TESTS" = all ]; then
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
  sg bypass_serial PARAMD_ALLOW_SHARED_GPU_NCCL=1 PARAMD_FETCH_SERIAL=1
  sg p2p_off NCCL_P2P_DISABLE=1
  grep -hE "Failure|Expected|Which is|illegal|FAILED_PRECONDITION" "$L"/same_gpu_bypass*.log | head -12
  save
fi
if [ "$TESTS" = daemon ]; then
  wait $pd
  rd=$?
  summary+=("daemon_fetch_test rc=$rd: $(grep -E '^\[  (PASSED|FAILED)  \]|tests? ran' "$L/daemon_fetch_test.log" | tr '\n' ' ')")
  save
  grep -hE "Failure|FAILED|Expected|Which is|actual" "$L"/daemon_fetch_test.log | head -20
  grep -h "DEVICE_FETCH_BENCH\|daemon killed after\|closed: " "$L/daemon_fetch_test.log" | head -8
fi

if [ "$TESTS" = 1 ] || [ "$TESTS" = all ]; then
  timeout 75 transport/nccl_test > "$L/nccl_test.log" 2>&1 & p1=$!
  timeout 75 tests/gpu_integration/fetch_test > "$L/fetch_test.log" 2>&1 & p2=$!
  timeout 75 tests/gpu_integration/kill_test > "$L/kill_test.log" 2>&1 & p3=$!
  timeout 100 tests/gpu_integration/daemon_fetch_test > "$L/daemon_fetch_test.log" 2>&1 & p4=$!
  wait $p1; r1=$?; wait $p2; r2=$?; wait $p3; r3=$?; wait $p4; r4=$?
  result nccl_test $r1 "$L/nccl_test.log"
  result fetch_test $r2 "$L/fetch_test.log"
  result kill_test $r3 "$L/kill_test.log"
  result daemon_fetch_test $r4 "$L/daemon_fetch_test.log"
  if [ "$TESTS" = 1 ]; then
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
  fi
  save
  echo "---- failures ----"
  grep -hE "Failure|FAILED|error:|Expected|Which is|actual|code [0-9]+ after" \
    "$L"/nccl_test.log "$L"/fetch_test.log "$L"/kill_test.log "$L"/daemon_fetch_test.log | head -40
  grep -hE "DEVICE_FETCH_BENCH|killed after|closed: |hung up" \
    "$L"/daemon_fetch_test.log "$L"/kill_test.log | head -12
fi

if [ "${NET:-0}" = 1 ] && in_time net; then
  # NCCL's network transport between the two GPUs, as between machines.
  NETENV=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET)
  env "${NETENV[@]}" timeout 90 transport/nccl_test > "$L/net_nccl_test.log" 2>&1 & q1=$!
  env "${NETENV[@]}" timeout 90 tests/gpu_integration/kill_test > "$L/net_kill_test.log" 2>&1 & q2=$!
  env "${NETENV[@]}" timeout 90 tests/gpu_integration/fetch_test > "$L/net_fetch_test.log" 2>&1 & q3=$!
  # A real daemon whose device channels listen on every interface (it
  # advertises the hostname), the trainer example on GPU 1 against it.
  {
    rm -f /tmp/paramd_net.port
    env "${NETENV[@]}" server/hybrid-paramd --backend=gpu --gpu=0 --listen=127.0.0.1:0 \
      --device_channel_listen=0.0.0.0:0 --insecure_listen_anywhere --port_file=/tmp/paramd_net.port \
      --expected_pushers=1 --lr=3e-3 > "$L/net_daemon.log" 2>&1 &
    dpid=$!
    for i in $(seq 100); do [ -s /tmp/paramd_net.port ] && break; sleep 0.1; done
    env "${NETENV[@]}" timeout 90 deploy/gpu_trainer/gpu_trainer \
      --coordinator=127.0.0.1:$(cat /tmp/paramd_net.port) --device=1 --check --steps=200 --format=fp8
    echo "gpu_trainer against hybrid-paramd (network transport) rc=$?"
    kill $dpid; wait $dpid
  } > "$L/net_gpu_trainer.log" 2>&1
  wait $q1; s1=$?; wait $q2; s2=$?; wait $q3; s3=$?
  result "net nccl_test" $s1 "$L/net_nccl_test.log"
  result "net kill_test" $s2 "$L/net_kill_test.log"
  result "net fetch_test" $s3 "$L/net_fetch_test.log"
  summary+=("net gpu_trainer: $(grep -E 'rc=' "$L/net_gpu_trainer.log" | tr '\n' ' ')")
  echo "---- network transport: NCCL paths used, failures ----"
  grep -hoE "via (NET|P2P|SHM)[^ ]*" "$L"/net_*.log | sort | uniq -c | head
  grep -hE "Failure|FAILED|Expected|Which is" "$L"/net_*_test.log | head -12
  grep -hE "^format|loss|CHECK|per step" "$L/net_gpu_trainer.log" | head -6
  save
fi

if [ "${BENCH:-1}" = 1 ] && in_time bench; then
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
