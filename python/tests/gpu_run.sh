#!/usr/bin/env bash
# The Python package's GPU checks in one device call (one H200): a
# --backend=gpu daemon on GPU 0 and the trainer's torch tensors on the same
# GPU (python/tests/gpu_test.py: device fetch == host fetch, device push ==
# host push, torch._scaled_mm forward/dgrad vs a BF16 reference), the GPT
# example on the GPU (fetches into CUDA tensors), and the fetch benchmark
# against a gpu daemon.
#
#   Here:  bash python/tests/gpu_run.sh bundle [DIR]
#          (--config=cuda build; DIR, default /work/main/.gpu_bundle_py,
#          gets bundle.tar.xz: the binaries at their workspace paths and the
#          python/ tree)
#   There: run(command="bash .gpu_bundle_py/run.sh", carry=[".gpu_bundle_py"])
#          (the bundle carries this script as run.sh). The summary goes to
#          stdout; every log is in $OUT/py_logs.tgz (one file, so that the
#          device tool returns it).
set -uo pipefail
if [ "${1:-}" = bundle ]; then
  cd "$(dirname "$0")/../.."
  B=$(realpath -m "${2:-/work/main/.gpu_bundle_py}")
  source tools/gpu_bundle_lib.sh
  TARGETS=(//server:hybrid-paramd //client:libhybrid_paramd.so //python/tests:cpp_client_tool
           //hpctl:hpctl)
  bazel build --config=cuda "${TARGETS[@]}" || exit 1
  rm -rf "$B"
  bundle_targets "$B" pkg "${TARGETS[@]}" || exit 1
  mkdir -p "$B/python"
  cp -r python/hybrid_paramd python/examples python/tests "$B/python/"
  find "$B/python" -name BUILD -delete
  rm -f "$B/python/tests/cpp_client_tool.cc"
  cp tools/gpu_bundle_lib.sh "$B/"
  bundle_pack "$B"
  cp python/tests/gpu_run.sh tools/gpu_bundle_lib.sh "$B/"
  mv "$B/gpu_run.sh" "$B/run.sh"
  du -sh "$B"
  exit 0
fi

here=$(cd "$(dirname "$0")" && pwd)
FINAL_OUT=${OUT:-/tmp/gpu_py_out}
mkdir -p "$FINAL_OUT"
OUT=$(mktemp -d /tmp/gpu_py_logs.XXXXXX)
trap 'tar -czf "$FINAL_OUT/py_logs.tgz" -C "$OUT" . ; rm -rf "$OUT"' EXIT
source "$here/gpu_bundle_lib.sh"
U=/tmp/gpu_bundle_py
rm -rf "$U" && bundle_unpack "$here" "$U" || exit 1
bundle_run_env "$U"
cd "$U"
export HYBRID_PARAMD_LIB=$U/client/libhybrid_paramd.so PARAMD_SERVER=$U/server/hybrid-paramd \
  PARAMD_CPP_TOOL=$U/python/tests/cpp_client_tool PYTHONUNBUFFERED=1
export PYTHONPATH=$U/python:$U/python/tests
{ date -u; nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader;
  python3 -c 'import torch, grpc, google.protobuf as p; print("torch", torch.__version__, "grpc", grpc.__version__, "protobuf", p.__version__)'; } 2>&1 | tee "$OUT/gpu.txt"
ldd "$HYBRID_PARAMD_LIB" | grep "not found" && echo "MISSING LIBRARIES"
export PARAMD_HPCTL=$U/hpctl/hpctl
STEPS=${STEPS:-gpu_test,gpt,hf,bench}  # also: bench_untuned
if [[ ,$STEPS, == *,gpu_test,* ]]; then
  timeout ${GPU_TEST_TIMEOUT:-120} python3 python/tests/gpu_test.py > "$OUT/gpu_test.log" 2>&1
  echo "gpu_test rc=$?"
  grep -E "^test_|^linear|Error|FAIL|^OK|^Ran|ok$" "$OUT/gpu_test.log" | head -40
  grep -q "^OK" "$OUT/gpu_test.log" || tail -40 "$OUT/gpu_test.log"
fi
if [[ ,$STEPS, == *,ipc,* ]]; then  # hybrid_paramd.IpcSession (same-GPU views in place)
  timeout ${IPC_TEST_TIMEOUT:-120} python3 python/tests/ipc_gpu_test.py > "$OUT/ipc_gpu_test.log" 2>&1
  echo "ipc_gpu_test rc=$?"
  grep -E "^test_|Error|FAIL|^OK|^Ran|ok$" "$OUT/ipc_gpu_test.log" | head -20
  grep -q "^OK" "$OUT/ipc_gpu_test.log" || tail -40 "$OUT/ipc_gpu_test.log"
fi
if [[ ,$STEPS, == *,gpt,* ]]; then
  timeout ${GPT_TIMEOUT:-120} python3 python/examples/train_gpt.py --server_binary=$PARAMD_SERVER --daemons=1 \
    --daemon_flags="--backend=gpu --gpu=0" --device=cuda --fetch_device=cuda --steps=60 \
    --summary_json="$OUT/train_gpt_gpu.json" > "$OUT/train_gpt_gpu.log" 2>&1
  echo "train_gpt (gpu daemon, fetch into CUDA tensors) rc=$?"
  grep -E '"(ok|why|loss_start|loss_final|baseline_loss_final|relative_to_baseline|rowwise|columnwise|step_seconds_median|fetch_seconds_median)"' "$OUT/train_gpt_gpu.log"
  tail -15 "$OUT/train_gpt_gpu.log" | grep -iE -A3 "error|traceback"
fi
if [[ ,$STEPS, == *,hf,* ]]; then
  timeout ${HF_TIMEOUT:-90} python3 python/tests/hf_roundtrip_test.py > "$OUT/hf_roundtrip.log" 2>&1
  echo "hf_roundtrip_test rc=$?"
  grep -E "^test_|tensors equal|Error|FAIL|^OK|^Ran|skipped" "$OUT/hf_roundtrip.log" | head -20
fi
# bench: host fetch (cpu) and fetch into CUDA tensors (cuda);
# bench_untuned: the host fetch again with the client's malloc tuning off in
# both clients (PARAMD_CLIENT_MALLOC_TUNING=0; client/host_allocator.h).
bench() {  # NAME DEVICE [ENV...]
  local name=$1 dev=$2
  shift 2
  env "$@" timeout ${BENCH_TIMEOUT:-90} python3 python/tests/fetch_bench.py --server=$PARAMD_SERVER \
    --cpp_tool=$PARAMD_CPP_TOOL --daemon_flags="--backend=gpu --gpu=0" --device=$dev --tensors=200 \
    --rows=1024 --cols=1024 --repeats=10 > "$OUT/bench_$name.json" 2>"$OUT/bench_$name.err"
  echo "bench $name rc=$?"; tr -d '\n' < "$OUT/bench_$name.json"; echo; tail -3 "$OUT/bench_$name.err"
}
if [[ ,$STEPS, == *,bench,* ]]; then
  bench cpu cpu
  bench cuda cuda
fi
if [[ ,$STEPS, == *,bench_untuned,* ]]; then
  bench cpu_untuned cpu PARAMD_CLIENT_MALLOC_TUNING=0
fi
