#!/usr/bin/env bash
# Quick start: installs the Debian packages the build needs (if missing),
# then builds and runs the demo (deploy/demo_main.cc): a coordinator, two
# hybrid-paramd daemons and two trainers on loopback train a small MLP with
# hybrid-quantized weights and compare it with an FP32 baseline.
# Arguments go to the demo, e.g. `bash tools/demo.sh --steps=50
# --summary_json=/tmp/demo.json`; `--help` lists them. Relative paths are
# relative to the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh
source tools/bazel_quiet.sh
echo "== building //deploy:demo (the first build takes several minutes)"
bazel_quiet build //deploy:demo
echo "== running the demo"
exec bazel-bin/deploy/demo "$@"
