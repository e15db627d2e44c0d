#!/usr/bin/env bash
# Quick start: installs the Debian packages the build needs (if missing),
# then builds and runs the demo (deploy/demo_main.cc): a coordinator, two
# hybrid-paramd daemons and two trainers on loopback train a small MLP with
# hybrid-quantized weights and compare it with an FP32 baseline.
# Arguments go to the demo, e.g. `bash tools/demo.sh --steps=50
# --summary_json=/tmp/demo.json`; `--help` lists them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh
exec bazel run //deploy:demo -- "$@"
