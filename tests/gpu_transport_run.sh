#!/usr/bin/env bash
# Session 3's verification of the NCCL data plane and the kernels in ONE
# device call on the 2-GPU machine (a machine start costs ~60 s, so the
# kernel tests ride along on GPU 0 instead of a second, 1-GPU call):
#   A  kernels: quantize_test (8 shards), amax_test, optimizer_test on GPU 0
#      (after the kernels/adamw_fold refactor), beside the shared-GPU
#      reproducer with senders that see one GPU (REPRO=visible of
#      tests/gpu_nccl_run.sh: the open two-daemons-on-one-GPU question)
#   B  transport: nccl_test, fetch_test, kill_test, daemon_fetch_test
#      (blocking direction communicators by default, control-channel
#      hang-ups mark a peer dead)
#   C  two daemon processes on GPU 0, the trainer on GPU 1: the guard, the
#      guard bypassed (blocking and non-blocking pairs), NCCL_P2P_DISABLE=1
#   D  the cross-machine path emulated on one host: NCCL_P2P_DISABLE=1
#      NCCL_SHM_DISABLE=1 (NCCL's network transport, as between machines)
#      for nccl_test, kill_test, fetch_test, and a real daemon with
#      --device_channel_listen=0.0.0.0:0 serving deploy/gpu_trainer on GPU 1
#   E  step_bench once, if the time budget allows (BUDGET_S, default 290 s
#      of the command's wall time: later parts are skipped past it)
#
#   Here:  BUNDLE=.gpu_bundle_transport3 bash tests/gpu_transport_run.sh bundle
#   There: run(command="BUNDLE=.gpu_bundle_transport3 bash tests/gpu_transport_run.sh run",
#              carry=[".gpu_bundle_transport3"], kind="nvidia-h200-x2")
#          Logs come back as $OUT/logs.tar.gz, the summary on stdout.
#          NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
# Knobs (run): PARTS (default ABCDE) picks parts; BUDGET_S.
set -uo pipefail
cd "$(dirname "$0")/.."
B=${BUNDLE:-.gpu_bundle_transport3}
TARGETS=(
  //kernels/cuda:quantize_test
  //kernels/cuda:amax_test
  //kernels/cuda:optimizer_test
  //transport:nccl_test
  //transport:nccl_shared_gpu_repro
  //tests/gpu_integration:fetch_test
  //tests/gpu_integration:kill_test
  //tests/gpu_integration:daemon_fetch_test
  //tests/gpu_integration:device_fetch_loop
  //server:hybrid-paramd
  //deploy/gpu_trainer:gpu_trainer
  //tests/step_bench:step_bench
)

if [ "${1:-}" = bundle ]; then
  source tools/gpu_bundle_lib.sh
  bundle_build_pack "$B" "${TARGETS[@]}"
  exit $?
fi

OUT=${OUT:-/tmp/gpu_transport_out}
L=/tmp/gpu_transport_logs
mkdir -p "$OUT" "$L"
U=/tmp/gpu_transport_bundle
source tools/gpu_bundle_lib.sh
bundle_unpack "$B" "$U" || exit 1
bundle_run_env "$U"
PARTS=${PARTS:-ABCDE}
BUDGET=${BUDGET_S:-290}
{
  date -u
  nvidia-smi --query-gpu=index,name,driver_version,pci.bus_id --format=csv
} > "$L/gpu.txt" 2>&1
cat "$L/gpu.txt"
cd "$U"
ldd server/hybrid-paramd kernels/cuda/quantize_test | grep "not found" && echo "MISSING LIBRARIES"
export TEST_TMPDIR=/tmp/paramd_transport_tmp
mkdir -p "$TEST_TMPDIR"
summary=()
save() { tar -C "$L" -czf "$OUT/logs.tar.gz" .; }
has() { [[ "$PARTS" == *"$1"* ]]; }
in_time() {  # part name: false (and noted) once the budget is spent
  if [ "$SECONDS" -ge "$BUDGET" ]; then summary+=("skipped (time, ${SECONDS}s): $1"); return 1; fi
}
result() {  # label, rc, log
  summary+=("$1 rc=$2 (${SECONDS}s): $(grep -E '^\[  (PASSED|FAILED)  \]|tests? ran' "$3" | tr '\n' ' ')")
}

# ---- A: kernel tests on GPU 0, beside the reproducer ----
if has A; then
  kp=()
  for i in 0 1 2 3 4 5 6 7; do
    CUDA_VISIBLE_DEVICES=0 GTEST_TOTAL_SHARDS=8 GTEST_SHARD_INDEX=$i timeout 150 \
      kernels/cuda/quantize_test > "$L/quantize_test.shard$i.log" 2>&1 &
    kp+=($!)
  done
  (CUDA_VISIBLE_DEVICES=0 timeout 100 kernels/cuda/amax_test > "$L/amax_test.log" 2>&1;
   echo "rc=$?" >> "$L/amax_test.log") &
  kp+=($!)
  (CUDA_VISIBLE_DEVICES=0 timeout 150 kernels/cuda/optimizer_test > "$L/optimizer_test.log" 2>&1;
   echo "rc=$?" >> "$L/optimizer_test.log") &
  kp+=($!)
  R=transport/nccl_shared_gpu_repro
  repro() {  # name, args...
    local name=$1; shift
    NCCL_DEBUG=WARN timeout 30 $R --timeout_s=25 "$@" > "$L/repro_$name.log" 2>&1
    local rc=$?
    summary+=("repro $name rc=$rc: $(grep -E '^(REPRO|HANG)' "$L/repro_$name.log" | tr '\n' ' ')")
    grep -hE "^RESULT|first wrong|exited|HANG" "$L/repro_$name.log" | sed "s/^/[$name] /"
  }
  I=${REPRO_ITERS:-100}
  repro transport_visible --mode=transport --senders_see_one_gpu --iters=$I
  repro raw_visible --mode=raw --senders_see_one_gpu --iters=$I
  repro transport_visible_both --mode=transport --senders_see_one_gpu \
    --receiver_uses_sender_gpu --iters=$I
  repro raw_nonblocking_visible_both --mode=raw --nonblocking --senders_see_one_gpu \
    --receiver_uses_sender_gpu --iters=$I
  rk=0
  for p in "${kp[@]}"; do wait "$p" || rk=1; done
  cat "$L"/quantize_test.shard*.log > "$L/quantize_test.log"
  summary+=("quantize_test (8 shards) rc=$rk (${SECONDS}s): $(grep -c '^\[       OK \]' "$L/quantize_test.log") OK, $(grep -cE '^\[  FAILED  \] .*\([0-9]+ ms\)$' "$L/quantize_test.log") failed")
  result "amax_test $(tail -1 "$L/amax_test.log")" - "$L/amax_test.log"
  result "optimizer_test $(tail -1 "$L/optimizer_test.log")" - "$L/optimizer_test.log"
  grep -hE "Failure|FAILED|error" "$L/quantize_test.log" "$L/amax_test.log" "$L/optimizer_test.log" | head -10
  save
fi

# ---- B: the transport tests, in parallel ----
if has B && in_time B; then
  timeout 75 transport/nccl_test > "$L/nccl_test.log" 2>&1 & p1=$!
  timeout 75 tests/gpu_integration/fetch_test > "$L/fetch_test.log" 2>&1 & p2=$!
  timeout 75 tests/gpu_integration/kill_test > "$L/kill_test.log" 2>&1 & p3=$!
  timeout 100 tests/gpu_integration/daemon_fetch_test > "$L/daemon_fetch_test.log" 2>&1 & p4=$!
  wait $p1; r1=$?; wait $p2; r2=$?; wait $p3; r3=$?; wait $p4; r4=$?
  result nccl_test $r1 "$L/nccl_test.log"
  result fetch_test $r2 "$L/fetch_test.log"
  result kill_test $r3 "$L/kill_test.log"
  result daemon_fetch_test $r4 "$L/daemon_fetch_test.log"
  echo "---- B failures / figures ----"
  grep -hE "Failure|FAILED|Expected|Which is|actual" "$L"/nccl_test.log "$L"/fetch_test.log \
    "$L"/kill_test.log "$L"/daemon_fetch_test.log | head -30
  grep -hE "DEVICE_FETCH_BENCH|killed after|closed: |after the kill|hung up" \
    "$L"/daemon_fetch_test.log "$L"/kill_test.log | head -12
  save
fi

# ---- C: two daemons on GPU 0, the trainer on GPU 1 ----
if has C && in_time C; then
  sg() {  # name, env...
    local name=$1; shift
    env PARAMD_SPLIT_SAME_GPU=1 "$@" timeout 40 tests/gpu_integration/daemon_fetch_test \
      --gtest_filter='*Split*/Fp8Current:*Split*/Nvfp4' > "$L/same_gpu_$name.log" 2>&1
    local rc=$?
    summary+=("same-GPU daemons, $name rc=$rc (${SECONDS}s): $(grep -m1 -oE 'FAILED_PRECONDITION[^\"]{0,100}' "$L/same_gpu_$name.log") $(grep -E '^\[  (PASSED|FAILED)  \]' "$L/same_gpu_$name.log" | tr '\n' ' ')")
  }
  sg guard
  sg bypass_blocking PARAMD_ALLOW_SHARED_GPU_NCCL=1
  sg bypass_nonblocking PARAMD_ALLOW_SHARED_GPU_NCCL=1 PARAMD_NCCL_BLOCKING=0
  sg bypass_serial PARAMD_ALLOW_SHARED_GPU_NCCL=1 PARAMD_FETCH_SERIAL=1
  sg p2p_off NCCL_P2P_DISABLE=1
  echo "---- C: what the bypassed runs saw ----"
  grep -hE "Failure|Expected|Which is|illegal|mismatch|wrong" "$L"/same_gpu_bypass*.log | head -16
  save
fi

# ---- D: NCCL's network transport between the two GPUs (as across machines) ----
if has D && in_time D; then
  NET=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET)
  env "${NET[@]}" timeout 90 transport/nccl_test > "$L/net_nccl_test.log" 2>&1 & q1=$!
  env "${NET[@]}" timeout 90 tests/gpu_integration/kill_test > "$L/net_kill_test.log" 2>&1 & q2=$!
  env "${NET[@]}" timeout 90 tests/gpu_integration/fetch_test > "$L/net_fetch_test.log" 2>&1 & q3=$!
  # A real daemon whose device channels listen on every interface (it
  # advertises the hostname), the trainer example on GPU 1 against it.
  {
    rm -f /tmp/paramd_net.port
    env "${NET[@]}" server/hybrid-paramd --backend=gpu --gpu=0 --listen=127.0.0.1:0 \
      --device_channel_listen=0.0.0.0:0 --port_file=/tmp/paramd_net.port \
      --expected_pushers=1 --lr=3e-3 > "$L/net_daemon.log" 2>&1 &
    dpid=$!
    for i in $(seq 100); do [ -s /tmp/paramd_net.port ] && break; sleep 0.1; done
    env "${NET[@]}" timeout 90 deploy/gpu_trainer/gpu_trainer \
      --coordinator=127.0.0.1:$(cat /tmp/paramd_net.port) --device=1 --check --steps=200 --format=fp8
    echo "gpu_trainer against hybrid-paramd (net transport) rc=$?"
    kill $dpid; wait $dpid
  } > "$L/net_gpu_trainer.log" 2>&1
  wait $q1; s1=$?; wait $q2; s2=$?; wait $q3; s3=$?
  result "net nccl_test" $s1 "$L/net_nccl_test.log"
  result "net kill_test" $s2 "$L/net_kill_test.log"
  result "net fetch_test" $s3 "$L/net_fetch_test.log"
  summary+=("net gpu_trainer: $(grep -E 'rc=' "$L/net_gpu_trainer.log" | tr '\n' ' ') $(grep -m2 -E '^format|loss|CHECK' "$L/net_gpu_trainer.log" | tr '\n' ' ')")
  echo "---- D: NCCL transports used / failures ----"
  grep -hoE "via (NET|P2P|SHM)[^ ]*" "$L"/net_nccl_test.log "$L/net_gpu_trainer.log" "$L/net_daemon.log" \
    | sort | uniq -c | head
  grep -hE "Failure|FAILED|Expected|Which is" "$L"/net_*_test.log | head -12
  grep -hE "device channel|listen" "$L/net_daemon.log" | head -4
  save
fi

# ---- E: one step_bench, if time allows ----
if has E && in_time E; then
  timeout 45 tests/step_bench/step_bench --json="$OUT/step_bench.json" > "$L/step_bench.log" 2>&1
  summary+=("step_bench rc=$? (${SECONDS}s)")
  grep -E "RATIO|^fp8 |^bf16 |direction communicators" "$L/step_bench.log"
  save
fi
echo "==== summary ===="
printf '%s\n' "${summary[@]}"
