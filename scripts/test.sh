#!/usr/bin/env bash
# The project's test command: fetches and imports the real test model (cached), then runs every
# test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-model.sh >/dev/null
cargo test --workspace "$@"
