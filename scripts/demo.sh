#!/usr/bin/env bash
# The main job on one machine, with nothing else to install or run: fetch and import
# SmolLM2-135M, start the harvest API on the embedded backend, create a key, submit the seed's
# two example prompts, wait, download a shard through its signed link and print its shapes.
set -euo pipefail
cd "$(dirname "$0")/.."
# One build: the release binaries serve the demo and import the model too.
cargo build --quiet --release -p harvester -p harvest-api
target=${CARGO_TARGET_DIR:-$PWD/target}/release
model=$(HARVESTER="$target/harvester" scripts/fetch-model.sh)
work=$(mktemp -d)
port=${HARVEST_DEMO_PORT:-8080}
cat > "$work/config.json" <<JSON
{"data_dir": "$work/data", "harvester": "$target/harvester", "max_workers": 1,
 "public_url": "http://127.0.0.1:$port",
 "models": [{"name": "smollm2-135m", "path": "$model", "lane": "small"}],
 "accounts": [{"name": "demo"}]}
JSON
key=$("$target/harvest-api" --config "$work/config.json" create-key --account demo --label demo)
"$target/harvest-api" --config "$work/config.json" serve --listen "127.0.0.1:$port" 2>"$work/server.log" &
server=$!
trap 'kill $server 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 1 50); do
  python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/healthz')" 2>/dev/null && break
  sleep 0.2
done
ACS_API_BASE="http://127.0.0.1:$port/v1" ACS_API_KEY="$key" python3 scripts/demo_client.py
