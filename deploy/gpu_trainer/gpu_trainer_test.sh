#!/usr/bin/env bash
# A full training run of the GPU trainer example with FP8 weights: exits 1
# unless the loss fell 20x (the binary's --check). The embedded run joins
# its daemon and its trainer over NCCL, which needs them on separate GPUs:
# with fewer than 2 the test says it skipped (tools/gpu_test.sh counts the
# "skipped=N" line and lists its reason).
set -euo pipefail
export NCCL_NVLS_ENABLE=0
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if [ "${gpus:-0}" -lt 2 ]; then
  echo "skipped=1 gpu_trainer_test: the embedded daemon and trainer need 2 GPUs (NCCL ranks on separate GPUs), found ${gpus:-0}"
  exit 0
fi
"$1" --check --steps=200 --format=fp8
