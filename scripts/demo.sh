#!/usr/bin/env bash
# The main job on one machine: fetch and import SmolLM2-135M, then capture the residual stream
# of the seed's example prompts at every layer and print what was captured.
set -euo pipefail
cd "$(dirname "$0")/.."
model=$(scripts/fetch-model.sh)
cargo build --quiet --release -p harvester
target=${CARGO_TARGET_DIR:-target}
for prompt in "The quick brown fox jumps over the lazy dog." \
              "Interpretability research reads the residual stream."; do
  "$target/release/harvester" probe --model "$model" --layers all "$prompt"
  echo
done
