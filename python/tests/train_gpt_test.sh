#!/usr/bin/env bash
# tools/torch_demo.sh's run in CI (few steps): the example trains through a
# real cluster on the CPU, the loss falls and ends within 5 % of the torch
# AdamW baseline, and the summary JSON has the figures.
# Usage: train_gpt_test.sh LIB SERVER
set -euo pipefail
export HYBRID_PARAMD_LIB="$PWD/$1"
server="$PWD/$2"
summary="${TEST_TMPDIR:-/tmp}/train_gpt_summary.json"
/usr/bin/python3 python/examples/train_gpt.py --server_binary="$server" --steps=24 \
  --work_dir="${TEST_TMPDIR:-/tmp}/train_gpt" --summary_json="$summary" >/dev/null
/usr/bin/python3 - "$summary" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
assert s["ok"], s["why"]
assert len(s["losses"]) == 24 and len(s["baseline_losses"]) == 24
assert s["losses"][-1] < s["losses"][0], s["losses"]
assert abs(s["relative_to_baseline"]) <= 0.05, s["relative_to_baseline"]
b = s["bytes_fetched"]
assert 0 < b["rowwise_bytes"] < b["rowwise_bf16_bytes"], b
assert 0 < b["columnwise_bytes"] <= b["columnwise_bf16_bytes"] // 2, b
assert s["final_version"] == 24
print("OK: loss %.3f -> %.3f (baseline %.3f), rowwise %.2fx / columnwise %.2fx of BF16 bytes"
      % (s["loss_start"], s["loss_final"], s["baseline_loss_final"],
         s["fetched_vs_bf16"]["rowwise"], s["fetched_vs_bf16"]["columnwise"]))
PY
