#!/usr/bin/env bash
# The main job on one machine: fetch and import SmolLM2-135M, harvest the residual stream of the
# seed's two example prompts at the default quartile layers, and show what was written.
set -euo pipefail
cd "$(dirname "$0")/.."
model=$(scripts/fetch-model.sh)
cargo build --quiet --release -p harvester
harvester=${CARGO_TARGET_DIR:-target}/release/harvester
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/prompts.jsonl" <<'JSONL'
{"text": "The quick brown fox jumps over the lazy dog."}
{"text": "Interpretability research reads the residual stream."}
JSONL
"$harvester" run --model "$model" --prompts "$work/prompts.jsonl" --out "$work/out" --progress off
echo
"$harvester" inspect "$work/out"
