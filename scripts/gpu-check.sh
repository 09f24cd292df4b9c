#!/usr/bin/env bash
# The CUDA backend's check on a GPU machine (issue 7), a few minutes in all. The GPU machine has
# no Rust toolchain and no network: build here and carry the binary and the model over (strip
# the binary: about 15 MB stripped against 90 MB with line tables).
#   cargo build --release -p harvester && strip -o harvester-gpu target/release/harvester
#   scripts/gpu-check.sh ./harvester-gpu ~/.cache/harvest/models/smollm2-135m
# 1. Parity: the parity prompts harvested on the CPU and on CUDA (every layer); token ids must
#    be identical and every token row within 1e-2 relative error (`harvester compare`).
# 2. Throughput: `harvester bench` on 64 prompts of 512 tokens, 3 layers and all layers:
#    tokens/s, the fraction of the bf16 GEMM rate measured in the same run, weight-load GB/s.
# DEVICE=cpu runs the same steps on the CPU (how the script itself is checked without a GPU).
set -euo pipefail
usage="usage: scripts/gpu-check.sh HARVESTER MODEL_DIR"
harvester=${1:?$usage}
model=${2:?$usage}
device=${DEVICE:-cuda}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== parity: cpu against $device"
for engine in cpu "$device"; do
  "$harvester" run --device "$engine" --model "$model" --prompts "$here/gpu/parity_prompts.jsonl" \
    --layers all --shard-size 4 --progress off --out "$work/$engine-out" >/dev/null
done
"$harvester" compare "$work/cpu-out" "$work/$device-out" --max-relative-error 1e-2

echo "== throughput on $device"
python3 -c 'import json, random; random.seed(7); print(json.dumps([[random.randrange(1, 40000) for _ in range(512)] for _ in range(64)]))' >"$work/ids.json"
layers_in_model=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["num_hidden_layers"])' "$model/config.json")
three="$((layers_in_model / 4)),$((layers_in_model / 2)),$((3 * layers_in_model / 4))"
for layers in "$three" all; do
  "$harvester" bench --device "$device" --model "$model" --ids "$work/ids.json" --layers "$layers" --batch-tokens 8192
done
