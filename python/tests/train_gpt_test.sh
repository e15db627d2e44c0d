#!/usr/bin/env bash
# tools/torch_demo.sh's run in CI (few steps), then the same training data
# parallel: the example trains through a real cluster on the CPU, the loss
# falls and ends within 5 % of the torch AdamW baseline, and the summary
# JSON has the figures; with two ranks (each half of the global batch, the
# cluster expecting two pushers) every rank reaches the same version and
# the loss matches the single-rank run's within the same 5 %.
# The ranks are started as torchrun starts them (RANK, LOCAL_RANK,
# WORLD_SIZE, MASTER_ADDR, MASTER_PORT): Debian 12's torch 1.13 torchrun
# fails at start on Python 3.11 (its elastic agent's option parsing).
# Usage: train_gpt_test.sh LIB SERVER
set -euo pipefail
export HYBRID_PARAMD_LIB="$PWD/$1"
server="$PWD/$2"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
/usr/bin/python3 python/examples/train_gpt.py --server_binary="$server" --steps=24 --quiet \
  --summary_json="$tmp/one.json" >/dev/null

port=$(/usr/bin/python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
pids=()
for rank in 0 1; do
  RANK=$rank LOCAL_RANK=$rank WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    /usr/bin/python3 python/examples/train_gpt.py --server_binary="$server" --steps=24 --quiet \
    --summary_json="$tmp/two.json" >"$tmp/rank$rank.log" 2>&1 &
  pids+=($!)
done
for rank in 0 1; do
  if ! wait "${pids[$rank]}"; then
    echo "rank $rank failed:"; tail -n 30 "$tmp/rank$rank.log"; exit 1
  fi
done

/usr/bin/python3 - "$tmp/one.json" "$tmp/two.json" <<'PY'
import json, sys
one, two = (json.load(open(p)) for p in sys.argv[1:])
for s in (one, two):
    assert s["ok"], s["why"]
    assert len(s["losses"]) == 24 and len(s["baseline_losses"]) == 24
    assert s["losses"][-1] < s["losses"][0], s["losses"]
    assert abs(s["relative_to_baseline"]) <= 0.05, s["relative_to_baseline"]
    assert s["final_version"] == 24
b = one["bytes_fetched"]
assert 0 < b["rowwise_bytes"] < b["rowwise_bf16_bytes"], b
assert 0 < b["columnwise_bytes"] <= b["columnwise_bf16_bytes"] // 2, b
assert one["ranks"] == 1 and two["ranks"] == 2
# The same global batches, the same initial weights: two ranks of half the
# batch each train as one rank does.
gap = abs(two["loss_final"] / one["loss_final"] - 1)
assert gap <= 0.05, (one["loss_final"], two["loss_final"])
print("OK: loss %.3f -> %.3f (baseline %.3f), rowwise %.2fx / columnwise %.2fx of BF16 bytes; "
      "2 ranks end at %.3f (%.2f%% from 1 rank)"
      % (one["loss_start"], one["loss_final"], one["baseline_loss_final"],
         one["fetched_vs_bf16"]["rowwise"], one["fetched_vs_bf16"]["columnwise"],
         two["loss_final"], 100 * gap))
PY
