#!/usr/bin/env bash
# Every GPU benchmark, in one command: the programs of the targets tagged
# "gpu_bench" (found by a Bazel query), built once with --config=cuda,
# bundled, and run by name on a machine with a GPU, each with the default
# arguments, environment and time limit that the figures in
# docs/BENCHMARKS.md were measured with.
#
#   Here (Bazel, no GPU needed):   bash tools/gpu_bench.sh bundle [BUNDLE]
#       BUNDLE (default .gpu_bundle_bench, git-ignored) then holds one
#       bundle.tar.xz: the benchmark binaries at their workspace paths, what
#       they start (hybrid-paramd, helpers, libhybrid_paramd.so), the
#       Python package, examples and test scripts, and tools/peer_bench.py.
#   On the GPU machine (no Bazel): bash tools/gpu_bench.sh run NAME... [-- ARGS...]
#       From the repository root with the bundle folder: runs the named
#       benchmarks one after the other, each alone on the GPU(s); ARGS are
#       added after each one's default arguments (a repeated flag wins).
#       Each log is $OUT/NAME.log (default OUT=/tmp/gpu_bench_out), result
#       files beside it, the GPUs and clocks in $OUT/gpu.txt; one line
#       "NAME rc=N" per run last. Exits non-zero if any run failed.
#   bash tools/gpu_bench.sh list       the names, what each runs, GPUs needed
#
# Knobs (bundle): BAZEL="bazel --output_base=DIR" and BAZEL_BIN=its bin
# folder, as for tools/gpu_test.sh.
# Knobs (run): BUNDLE=folder (default .gpu_bundle_bench; an unpacked bundle
# works too), RUNS=N runs each named benchmark N times (logs NAME_1.log ...;
# default 1, for step 2), BENCH_TIMEOUT=seconds replaces each run's limit.
#   kernels: SASS=1 first dumps the sm_90a SASS of the quantize kernels
#     (cuobjdump; quantize_sm90a.sass and one sass_patternN.txt per
#     instantiation); NCU=1 then profiles QuantizeTiles (NCU_KERNEL=regex)
#     with ncu --clock-control none, one report per ';'-separated bench
#     --only filter in NCU_ONLY, bench flags NCU_BENCH_ARGS; NCU_SRC=1 the
#     per-SASS-instruction counters of NCU_SRC_ONLY as CSV.
#   peer: reads $OUT/bench.json of a kernels run before it (same OUT);
#     inductor's cache is saved as $OUT/inductor_cache.tgz, and read from
#     BUNDLE/inductor_cache.tgz where it was put there.
#   overlap: PARAMD_OVERLAP_BENCH_* (model size, steps) pass through.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
source tools/gpu_bundle_lib.sh

BAZEL=${BAZEL:-bazel}
BAZEL_BIN=${BAZEL_BIN:-bazel-bin}

# NAME|GPUs|what it runs (workspace path)|description
BENCHES='kernels|1|kernels/cuda/bench|every kernel at 1.07 B parameters against a d2d copy of the master (--json=$OUT/bench.json)
peer|1|tools/peer_bench.py|the torch peer of kernels: eager and torch.compile, same work, with torch'"'"'s own d2d copy
step|2|tests/step_bench/step_bench|daemon store on GPU 0, trainer on GPU 1 over NCCL: push, step, fetch, ratio to raw NCCL (two runs)
backend_step|1|server/gpu_backend/gpu_backend_step_bench|the gpu ShardBackend at 1.07 B parameters, MXFP8: republish, step, host push, host copy
clip|1|server/gpu_backend/gpu_clip_bench|gradient-norm clipping'"'"'s step cost at 1.07 B parameters (--steps=41)
pipeline|1|server/gpu_backend/gpu_pipeline_bench|push + step + fetch loop, whole vs pipelined: host push/fetch, then in place
snapshot|1|server/gpu_backend/gpu_snapshot_bench|a snapshot'"'"'s cost to the step and a restore at 1.07 B: device spare, then live buffers
device_fetch|2|tests/gpu_integration/daemon_fetch_test|daemon_fetch_test alone: device fetch time and fixed cost, kill-to-error time (DEVICE_FETCH_BENCH)
overlap|2|tests/gpu_integration/daemon_overlap_test|daemon_overlap_test with PARAMD_OVERLAP_BENCH=1: its cases and Bench.StepLoop'"'"'s loop modes
trainer|2|deploy/gpu_trainer/gpu_trainer|deploy/gpu_trainer on GPU 1 against hybrid-paramd --backend=gpu on GPU 0, then in-process
ipc|1|tests/gpu_integration/ipc_test|ipc_test with PARAMD_IPC_BENCH=1: same-GPU hand-over, copy and in-place push vs d2d copy
python_fetch|1|python/tests/fetch_bench.py|fetch_bench.py, 2 gpu daemons on GPU 0: C++ vs Python host fetch, then into CUDA tensors
python_fetch_untuned|1|python/tests/fetch_bench.py|python_fetch'"'"'s host fetch with PARAMD_CLIENT_MALLOC_TUNING=0
gpt|1|python/examples/train_gpt.py|the GPT example, 60 steps, a gpu daemon on GPU 0, weights fetched into CUDA tensors
nccl_repro|2|transport/nccl_shared_gpu_repro|diagnostic: 2 senders on GPU 0, receiver on GPU 1, raw NCCL then NcclTransport, bytes checked'

# bench_field NAME FIELD  (2: GPUs, 3: path, 4: description)
bench_field() {
  awk -F'|' -v n="$1" -v f="$2" '$1 == n {print $f}' <<< "$BENCHES"
}

list() {
  local name gpus path desc
  while IFS='|' read -r name gpus path desc; do
    printf '%-21s %-7s %s\n' "$name" "$gpus GPU$([ "$gpus" = 1 ] || echo s)" "$desc"
  done <<< "$BENCHES"
}

# check_programs BINARY_PATH...
#   Every program a benchmark runs is among the bundled binaries (a lost
#   gpu_bench tag would drop it) or, for a script, in the tree.
check_programs() {
  local name gpus path desc missing=0
  while IFS='|' read -r name gpus path desc; do
    case "$path" in
      *.py) [ -f "$path" ] || { echo "$name: no $path" >&2; missing=1; } ;;
      *) printf '%s\n' "$@" | grep -qxF "$path" ||
           { echo "$name: $path is not among the gpu_bench binaries (its target lost the tag?)" >&2; missing=1; } ;;
    esac
  done <<< "$BENCHES"
  return $missing
}

bundle() {
  local bundle=${1:-.gpu_bundle_bench}
  case "$bundle" in .gpu_bundle*) ;; *) echo "bundle folder must be .gpu_bundle* (git-ignored): $bundle" >&2; return 1 ;; esac
  local targets binaries paths=() t
  mapfile -t targets < <(bundle_tagged gpu_bench)
  if [ ${#targets[@]} -eq 0 ]; then echo "no gpu_bench-tagged targets found" >&2; return 1; fi
  # The tagged binaries and tests, and what they start.
  mapfile -t binaries < <({ $BAZEL query "kind('cc_test', set(${targets[*]}))" 2>/dev/null
                            bundle_data_binaries "${targets[@]}"; } | sort -u)
  for t in "${binaries[@]}"; do paths+=("$(bundle_label_path "$t")"); done
  check_programs "${paths[@]}" || return 1
  echo "gpu_bench targets: ${#targets[@]}, binaries: ${#binaries[@]}"
  $BAZEL build --config=cuda "${targets[@]}" "${binaries[@]}" || return 1
  bundle_files "$bundle" "${binaries[@]}"
}

# bundle_files BUNDLE TARGET...: everything after the build.
bundle_files() {
  local bundle=$1
  shift
  rm -rf "$bundle"
  mkdir -p "$bundle/python" "$bundle/tools"
  bundle_targets "$bundle" "$@" || return 1
  # The quantize kernels' object (nvcc's output) for SASS=1.
  if [ -f "$BAZEL_BIN/kernels/cuda/quantize.o" ]; then
    cp -L "$BAZEL_BIN/kernels/cuda/quantize.o" "$bundle/kernels/cuda/quantize.o"
  fi
  cp -r python/hybrid_paramd python/examples python/tests "$bundle/python/"
  find "$bundle/python" \( -name BUILD -o -name '*.bzl' -o -name '*.cc' -o -name __pycache__ \) -prune \
    -exec rm -rf {} +
  cp tools/peer_bench.py "$bundle/tools/"
  printf '%s\n' "$@" > "$bundle/binaries.txt"
  bundle_pack "$bundle"
  du -sh "$bundle"
}

# ---- run (on the GPU machine, from the unpacked bundle) ----
# Each bench_NAME runs with LOG (its log), SUF ("" or "_i" for RUNS > 1) and
# ARGS (the extra arguments) set, and returns the benchmark's exit status.

limit() { echo "${BENCH_TIMEOUT:-$1}"; }

bench_kernels() {
  if [ "${SASS:-0}" = 1 ] && command -v cuobjdump >/dev/null; then
    cuobjdump -sass -arch sm_90a kernels/cuda/quantize.o > "$OUT/quantize_sm90a.sass" 2>&1
    echo "sass rc=$? $(wc -l < "$OUT/quantize_sm90a.sass") lines"
    # One file per kernel instantiation (QuantizeTilesKernel<256, 3, pattern>).
    awk -v out="$OUT" '/Function : /{f=""; if (match($0, /QuantizeTilesKernelILi256ELi3ELi[0-9]/)) \
        f=out "/sass_pattern" substr($0, RSTART + RLENGTH - 1, 1) ".txt"} f != "" {print > f}' \
        "$OUT/quantize_sm90a.sass"
  fi
  timeout "$(limit 200)" kernels/cuda/bench --json="$OUT/bench$SUF.json" "${ARGS[@]}" > "$LOG" 2>&1
  local rc=$?
  if [ "${NCU:-0}" = 1 ] && command -v ncu >/dev/null; then
    local filters f n=0
    IFS=';' read -ra filters <<< "${NCU_ONLY:-per-tensor row+col^T (src bf16)}"
    for f in "${filters[@]}"; do
      # shellcheck disable=SC2086  # NCU_BENCH_ARGS: flags, one word each
      timeout 150 ncu --clock-control none --kernel-name regex:"${NCU_KERNEL:-QuantizeTiles}" \
        --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
        --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis \
        --section InstructionStats \
        kernels/cuda/bench --reps=1 --warmup=1 ${NCU_BENCH_ARGS:-} --only="$f" > "$OUT/ncu$n.log" 2>&1
      echo "ncu[$f] rc=$? ($OUT/ncu$n.log)"
      n=$((n + 1))
    done
  fi
  if [ "${NCU_SRC:-0}" = 1 ] && command -v ncu >/dev/null; then
    # shellcheck disable=SC2086
    timeout 150 ncu --clock-control none --kernel-name regex:QuantizeTiles --launch-skip 1 \
      --launch-count 1 --section SourceCounters --section WarpStateStats --page source \
      --print-source sass --csv \
      kernels/cuda/bench --reps=1 --warmup=1 ${NCU_BENCH_ARGS:-} --only="${NCU_SRC_ONLY:-mxfp8 row+col}" \
      > "$OUT/ncu_source.csv" 2> "$OUT/ncu_source.err"
    echo "ncu source rc=$? $(wc -c < "$OUT/ncu_source.csv") bytes"
  fi
  grep -h 'd2d copy' "$LOG"
  tail -n 40 "$LOG"
  return $rc
}

bench_peer() {
  export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
  if [ -f "$CARRIED/inductor_cache.tgz" ]; then
    mkdir -p "$TORCHINDUCTOR_CACHE_DIR" && tar -xzf "$CARRIED/inductor_cache.tgz" -C "$TORCHINDUCTOR_CACHE_DIR"
  fi
  local ours=()
  if [ -f "$OUT/bench.json" ]; then
    ours=(--ours="$OUT/bench.json")
  else
    echo "(no $OUT/bench.json: run kernels before peer with the same OUT for the ours columns)"
  fi
  PYTHONUNBUFFERED=1 timeout "$(limit 400)" python3 tools/peer_bench.py "${ours[@]}" \
    --json="$OUT/peer$SUF.json" --markdown="$OUT/peer$SUF.md" "${ARGS[@]}" > "$LOG" 2>&1
  local rc=$?
  tar -czf "$OUT/inductor_cache.tgz" -C "$TORCHINDUCTOR_CACHE_DIR" . 2>/dev/null
  grep -h 'd2d copy' "$LOG"
  grep -v '^  ' "$LOG" | tail -n 30
  return $rc
}

bench_step() {
  timeout "$(limit 45)" tests/step_bench/step_bench --json="$OUT/step_bench$SUF.json" "${ARGS[@]}" \
    > "$LOG" 2>&1
  local rc=$?
  grep -E "RATIO|^fp8 |^bf16 |direction communicators" "$LOG"
  return $rc
}

bench_backend_step() {
  timeout "$(limit 90)" server/gpu_backend/gpu_backend_step_bench "${ARGS[@]}" > "$LOG" 2>&1
  local rc=$?
  tail -n 12 "$LOG"
  return $rc
}

bench_clip() {
  timeout "$(limit 100)" server/gpu_backend/gpu_clip_bench --steps=41 "${ARGS[@]}" > "$LOG" 2>&1
  local rc=$?
  cat "$LOG"
  return $rc
}

bench_pipeline() {
  local mode rc=0
  for mode in "--push=host --fetch=host" "--push=device --fetch=device"; do
    # shellcheck disable=SC2086  # the mode's two flags
    timeout "$(limit 90)" server/gpu_backend/gpu_pipeline_bench $mode "${ARGS[@]}" >> "$LOG" 2>&1 || rc=$?
  done
  cat "$LOG"
  return $rc
}

bench_snapshot() {
  local rc=0
  echo "== device spare (default)" >> "$LOG"
  timeout "$(limit 90)" server/gpu_backend/gpu_snapshot_bench "${ARGS[@]}" >> "$LOG" 2>&1 || rc=$?
  echo "== live buffers (PARAMD_GPU_SNAPSHOT_SPARE=0)" >> "$LOG"
  PARAMD_GPU_SNAPSHOT_SPARE=0 timeout "$(limit 60)" server/gpu_backend/gpu_snapshot_bench \
    --rounds=1 --restore=false "${ARGS[@]}" >> "$LOG" 2>&1 || rc=$?
  grep -E "^(==|model|snapshot|capture|restore|loaded|admin step|rank|recovery|\{)" "$LOG" | head -60
  return $rc
}

bench_device_fetch() {
  timeout "$(limit 400)" tests/gpu_integration/daemon_fetch_test "${ARGS[@]}" > "$LOG" 2>&1
  local rc=$?
  grep -h "DEVICE_FETCH_BENCH\|daemon killed after\|closed: " "$LOG" | head -20
  grep -E '^\[  (PASSED|FAILED)  \]' "$LOG"
  return $rc
}

bench_overlap() {
  PARAMD_OVERLAP_BENCH=1 timeout "$(limit 240)" tests/gpu_integration/daemon_overlap_test "${ARGS[@]}" \
    > "$LOG" 2>&1
  local rc=$?
  grep -h "OVERLAP_TEST\|OVERLAP_BENCH" "$LOG"
  grep -E '^\[  (PASSED|FAILED)  \]' "$LOG"
  return $rc
}

bench_trainer() {
  local port=/tmp/gpu_bench_trainer.port
  rm -f "$port"
  (
    rc=0
    server/hybrid-paramd --backend=gpu --gpu=0 --listen=127.0.0.1:0 --port_file="$port" \
      --expected_pushers=1 --lr=3e-3 > "$OUT/trainer_daemon$SUF.log" 2>&1 &
    dpid=$!
    for _ in $(seq 100); do [ -s "$port" ] && break; sleep 0.1; done
    timeout "$(limit 120)" deploy/gpu_trainer/gpu_trainer --coordinator="127.0.0.1:$(cat "$port")" \
      --device=1 --check --steps=200 --format=fp8 "${ARGS[@]}" || rc=$?
    echo "gpu_trainer against hybrid-paramd rc=$rc"
    kill "$dpid"
    wait "$dpid"
    timeout "$(limit 60)" deploy/gpu_trainer/gpu_trainer --check --steps=200 --format=fp8 "${ARGS[@]}"
    r=$?
    echo "gpu_trainer in-process rc=$r"
    if [ "$r" != 0 ]; then rc=$r; fi
    exit $rc
  ) > "$LOG" 2>&1
  local rc=$?
  grep -E "^format|rc=|CHECK|per step" "$LOG"
  return $rc
}

bench_ipc() {
  PARAMD_IPC_BENCH=1 timeout "$(limit 180)" tests/gpu_integration/ipc_test "${ARGS[@]}" > "$LOG" 2>&1
  local rc=$?
  grep -h "IPC_BENCH\|IPC_TEST" "$LOG"
  grep -E '^\[  (PASSED|FAILED)  \]' "$LOG"
  return $rc
}

python_env() {
  export HYBRID_PARAMD_LIB=$PWD/client/libhybrid_paramd.so PARAMD_SERVER=$PWD/server/hybrid-paramd \
    PARAMD_CPP_TOOL=$PWD/python/tests/cpp_client_tool PYTHONUNBUFFERED=1 \
    PYTHONPATH=$PWD/python:$PWD/python/tests
}

# fetch_bench DEVICE [ENV...]: one fetch_bench.py run; JSON to
# $OUT/NAME_DEVICE.json, its stderr appended to the log.
fetch_bench() {
  local dev=$1 json
  shift
  json="$OUT/$NAME${SUF}_$dev.json"
  env "$@" timeout "$(limit 90)" python3 python/tests/fetch_bench.py --server="$PARAMD_SERVER" \
    --cpp_tool="$PARAMD_CPP_TOOL" --daemon_flags="--backend=gpu --gpu=0" --device="$dev" \
    --tensors=200 --rows=1024 --cols=1024 --repeats=10 "${ARGS[@]}" > "$json" 2>> "$LOG"
  local rc=$?
  echo "fetch into $dev rc=$rc"
  tr -d '\n' < "$json"
  echo
  return $rc
}

bench_python_fetch() {
  python_env
  local rc=0
  fetch_bench cpu || rc=$?
  fetch_bench cuda || rc=$?
  tail -n 3 "$LOG"
  return $rc
}

bench_python_fetch_untuned() {
  python_env
  fetch_bench cpu PARAMD_CLIENT_MALLOC_TUNING=0
  local rc=$?
  tail -n 3 "$LOG"
  return $rc
}

bench_gpt() {
  python_env
  timeout "$(limit 120)" python3 python/examples/train_gpt.py --server_binary="$PARAMD_SERVER" \
    --daemons=1 --daemon_flags="--backend=gpu --gpu=0" --device=cuda --fetch_device=cuda \
    --steps=60 --summary_json="$OUT/gpt$SUF.json" "${ARGS[@]}" > "$LOG" 2>&1
  local rc=$?
  grep -E '"(ok|why|loss_start|loss_final|baseline_loss_final|relative_to_baseline|rowwise|columnwise|step_seconds_median|fetch_seconds_median)"' "$LOG"
  tail -n 15 "$LOG" | grep -iE -A3 "error|traceback"
  return $rc
}

bench_nccl_repro() {
  local mode rc=0
  for mode in raw transport; do
    echo "== --mode=$mode" >> "$LOG"
    timeout "$(limit 30)" transport/nccl_shared_gpu_repro --timeout_s=25 --mode=$mode --iters=150 \
      "${ARGS[@]}" >> "$LOG" 2>&1 || rc=$?
  done
  grep -E "^(==|REPRO|HANG|RESULT)|first wrong|exited" "$LOG"
  return $rc
}

run_benches() {
  local names=() arg
  ARGS=()
  while [ $# -gt 0 ]; do
    if [ "$1" = -- ]; then shift; ARGS=("$@"); break; fi
    names+=("$1")
    shift
  done
  if [ ${#names[@]} -eq 0 ]; then echo "run: name at least one benchmark (bash tools/gpu_bench.sh list)" >&2; return 2; fi
  for arg in "${names[@]}"; do
    [ -n "$(bench_field "$arg" 1)" ] || { echo "unknown benchmark: $arg (bash tools/gpu_bench.sh list)" >&2; return 2; }
  done
  CARRIED=$(realpath -m "${BUNDLE:-.gpu_bundle_bench}")
  OUT=$(realpath -m "${OUT:-/tmp/gpu_bench_out}")
  mkdir -p "$OUT"
  local dir
  dir=$(bundle_extract "$CARRIED" /tmp/gpu_bench_bundle) || return 1
  [ -d "$dir" ] || { echo "no bundle at $CARRIED (bash tools/gpu_bench.sh bundle)" >&2; return 1; }
  cd "$dir" || return 1
  bundle_run_env "$PWD"
  export PATH="$PATH:/usr/local/cuda/bin"
  {
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw \
      --format=csv 2>&1
    free -g | head -2
    if [[ " ${names[*]} " =~ \ (peer|python_fetch|python_fetch_untuned|gpt)\  ]]; then
      python3 -c 'import torch; print("torch", torch.__version__)' 2>&1
    fi
  } > "$OUT/gpu.txt"
  cat "$OUT/gpu.txt"
  local gpus
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  local summary=() failed=0 runs i rc start
  for NAME in "${names[@]}"; do
    runs=${RUNS:-1}
    if [ -z "${RUNS:-}" ] && [ "$NAME" = step ]; then runs=2; fi
    for ((i = 1; i <= runs; i++)); do
      SUF=""
      if [ "$runs" -gt 1 ]; then SUF="_$i"; fi
      LOG="$OUT/$NAME$SUF.log"
      : > "$LOG"
      echo "==== $NAME$SUF: $(bench_field "$NAME" 4)"
      if [ "$gpus" -lt "$(bench_field "$NAME" 2)" ]; then
        summary+=("$NAME$SUF not run: needs $(bench_field "$NAME" 2) GPUs, $gpus here")
        failed=1
        continue
      fi
      export TEST_TMPDIR=/tmp/gpu_bench_tmp/$NAME$SUF
      mkdir -p "$TEST_TMPDIR"
      start=$SECONDS
      "bench_$NAME"
      rc=$?
      summary+=("$NAME$SUF rc=$rc $((SECONDS - start)) s ($LOG)")
      [ "$rc" = 0 ] || failed=1
    done
  done
  echo "==== summary"
  printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
  return $failed
}

case "${1:-}" in
  bundle) bundle "${2:-.gpu_bundle_bench}" ;;
  run) shift; run_benches "$@" ;;
  list) list ;;
  -h|--help|help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | cut -c3- ;;
  *) echo "usage: bash tools/gpu_bench.sh bundle [BUNDLE] | run NAME... [-- ARGS...] | list | --help" >&2; exit 2 ;;
esac
