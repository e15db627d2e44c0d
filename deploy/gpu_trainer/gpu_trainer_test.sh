#!/usr/bin/env bash
# A full training run of the GPU trainer example with FP8 weights: exits 1
# unless the loss fell 20x (the binary's --check).
set -euo pipefail
export NCCL_NVLS_ENABLE=0
"$1" --check --steps=200 --format=fp8
