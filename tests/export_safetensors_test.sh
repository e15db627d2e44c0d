#!/usr/bin/env bash
# Export -> independent Python reader (tests/read_safetensors.py, standard
# library + struct only): the files parse, the index lists every tensor
# exactly once, BF16 values are the RNE of the FP32 masters (NaN stays NaN)
# and FP32 values are bit-identical. Then damages the export three ways and
# checks that the reader notices each (so the checks can fail).
#
# Usage (from Bazel): export_safetensors_test.sh FIXTURE READER
set -euo pipefail
fixture=$1
reader=$2
work=${TEST_TMPDIR:-$(mktemp -d)}/export_py
rm -rf "$work" && mkdir -p "$work/masters"

fail() { echo "FAIL: $*"; exit 1; }

"$fixture" --out "$work/bf16" --masters "$work/masters" --max_shard_size 20000
ls "$work/bf16"
[ -f "$work/bf16/model-00001-of-00002.safetensors" ] || fail "expected 2 shards"
python3 "$reader" "$work/bf16" --masters "$work/masters" --format pt || fail "bf16 export"

"$fixture" --out "$work/fp32" --masters "$work/masters" --dtype fp32 --max_shard_size 5GB
[ -f "$work/fp32/model-00001-of-00001.safetensors" ] || fail "expected 1 shard"
python3 "$reader" "$work/fp32" --masters "$work/masters" --dtype fp32 --format pt || fail "fp32 export"

# 1. One BF16 value changed (last byte of the data of the last shard).
cp -r "$work/bf16" "$work/flip"
python3 - "$work/flip/model-00002-of-00002.safetensors" <<'PY'
import sys
path = sys.argv[1]
with open(path, "r+b") as f:
    f.seek(-1, 2)
    b = f.read(1)
    f.seek(-1, 2)
    f.write(bytes([b[0] ^ 0x01]))
PY
if python3 "$reader" "$work/flip" --masters "$work/masters" --quiet; then
  fail "reader accepted a changed value"
fi

# 2. A tensor missing from the index.
cp -r "$work/bf16" "$work/missing"
python3 - "$work/missing/model.safetensors.index.json" <<'PY'
import json, sys
path = sys.argv[1]
index = json.load(open(path))
index["weight_map"].pop("lm_head.weight")
json.dump(index, open(path, "w"))
PY
if python3 "$reader" "$work/missing" --quiet; then fail "reader accepted an incomplete index"; fi

# 3. A tensor mapped to the wrong shard.
cp -r "$work/bf16" "$work/wrong"
python3 - "$work/wrong/model.safetensors.index.json" <<'PY'
import json, sys
path = sys.argv[1]
index = json.load(open(path))
wm = index["weight_map"]
wm["model.embed_tokens.weight"] = "model-00002-of-00002.safetensors"
json.dump(index, open(path, "w"))
PY
if python3 "$reader" "$work/wrong" --quiet; then fail "reader accepted a wrong mapping"; fi

# 4. Metadata other than {"format": "pt"} is noticed.
if python3 "$reader" "$work/bf16" --format tf --quiet; then fail "reader ignored --format"; fi

echo "PASS"
