#!/usr/bin/env bash
# The project's test command: fetches and imports the real test model and installs the
# test-only tools (both cached in ~/.cache/harvest), then runs every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-model.sh >/dev/null
tools=$(scripts/test-tools.sh)
export HARVEST_WEED=$tools/weed HARVEST_PYTHON=$tools/python
cargo test --workspace "$@"
