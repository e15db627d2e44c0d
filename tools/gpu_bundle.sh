#!/usr/bin/env bash
# Builds the GPU tests and benchmark HERE (bazel --config=cuda) and bundles
# them for the GPU machine, which has no Bazel. Usage:
#   bash tools/gpu_bundle.sh [BUNDLE_DIR]     (default .gpu_bundle)
# Binaries in BUNDLE_DIR/bin,
# the non-system shared libraries they load (ldd closure minus glibc,
# libstdc++, libgcc, CUDA driver/runtime, cuBLAS and NCCL) in
# BUNDLE_DIR/lib, and libcudart in BUNDLE_DIR/fallback (used there only if
# the machine has none). .gpu_bundle*/ is git-ignored: pass it as `carry`.
#
# The device call that runs everything and brings the logs back:
#   run(command="bash tools/gpu_run.sh", carry=[".gpu_bundle"], kind="nvidia-h200")
# or, with another folder (each engineer bundles into their own):
#   run(command="BUNDLE=.gpu_bundle_x bash tools/gpu_run.sh", carry=[".gpu_bundle_x"])
# (gpu_run.sh writes quantize_test.log, amax_test.log, optimizer_test.log,
# bench.log, bench.json and gpu.txt under $OUT.)
set -euo pipefail
cd "$(dirname "$0")/.."

TARGETS=(
  //kernels/cuda:quantize_test
  //kernels/cuda:amax_test
  //kernels/cuda:optimizer_test
  //kernels/cuda:bench
  //server/gpu_backend:one_pass_step_test
)
bazel build --config=cuda "${TARGETS[@]}"

B=${1:-.gpu_bundle}
case "$B" in .gpu_bundle*) ;; *) echo "bundle folder must be .gpu_bundle* (git-ignored): $B" >&2; exit 1 ;; esac
rm -rf "$B"
source tools/gpu_bundle_lib.sh
bundle_targets "$B" bin "${TARGETS[@]}"
du -sh "$B"
ls "$B/bin"
echo "$(ls "$B/lib" | wc -l) libraries in $B/lib"
