#!/usr/bin/env bash
# PyTorch quick start: installs the Debian packages (if missing), builds the
# daemon and libhybrid_paramd.so, then runs python/examples/train_gpt.py on
# the CPU: a coordinator and two hybrid-paramd daemons on loopback hold a
# small GPT's weights (FP8 Linear weights, BF16 rest) and step them with
# AdamW; a PyTorch trainer fetches, trains and pushes, beside a plain torch
# AdamW baseline. Arguments go to the example, e.g.
# `bash tools/torch_demo.sh --summary_json=/tmp/gpt.json --steps=60`;
# `--help` lists them. Relative paths are relative to the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh
source tools/bazel_quiet.sh
echo "== building //server:hybrid-paramd and //client:libhybrid_paramd.so"
bazel_quiet build //server:hybrid-paramd //client:libhybrid_paramd.so
echo "== training a small GPT through the cluster (and the torch baseline)"
export HYBRID_PARAMD_LIB="$PWD/bazel-bin/client/libhybrid_paramd.so"
exec "${PYTHON:-/usr/bin/python3}" python/examples/train_gpt.py \
  --server_binary=bazel-bin/server/hybrid-paramd "$@"
