#!/usr/bin/env bash
# The OpenAPI document against the server that serves it: schemathesis (pinned, installed into
# its own venv in the cache) runs every check (`--checks all`) on every operation of
# api/openapi.json, against the embedded server built by cargo (target/debug, or
# HARVEST_BIN_DIR) with the real SmolLM2 checkpoint, on loopback, and prints its report. The
# account's budget is small, so the jobs the fuzzer submits stay small. Exit status: the run's.
set -euo pipefail
cd "$(dirname "$0")/.."
cache=${HARVEST_CACHE:-$HOME/.cache/harvest}
venv=$cache/schemathesis
version=4.32.5
if [ "$(cat "$venv/.installed" 2>/dev/null)" != "$version" ]; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "schemathesis==$version" >&2
  echo "$version" > "$venv/.installed"
fi
bins=${HARVEST_BIN_DIR:-${CARGO_TARGET_DIR:-$PWD/target}/debug}
work=$(mktemp -d)
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat > "$work/config.json" <<JSON
{"data_dir": "$work/data", "harvester": "$bins/harvester", "max_workers": 1, "worker_threads": 1,
 "public_url": "http://127.0.0.1:$port",
 "models": [{"name": "smollm2-135m", "path": "$cache/models/smollm2-135m", "lane": "small"}],
 "accounts": [{"name": "fuzz", "limits": {"small_concurrency": 1, "large_concurrency": 1,
   "daily_tokens": 20000, "monthly_tokens": 20000, "total_tokens": null, "monthly_jobs_per_key": 1000}}]}
JSON
key=$("$bins/harvest-api" --config "$work/config.json" create-key --account fuzz)
RUST_LOG=warn "$bins/harvest-api" --config "$work/config.json" serve --listen "127.0.0.1:$port" 2>"$work/server.log" &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 1 600); do
  python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/readyz', timeout=2)" 2>/dev/null && break
  kill -0 "$server" 2>/dev/null || { cat "$work/server.log" >&2; exit 1; }
  sleep 0.1
done
# One real job, for the operations on one job (scripts/schemathesis.toml).
HARVEST_FUZZ_JOB=$(python3 - "$port" "$key" <<'PY'
import json, sys, urllib.request
port, key = sys.argv[1:]
body = {"model": "smollm2-135m", "prompts": ["The residual stream."], "layers": [3]}
request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/harvest", data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
print(json.load(urllib.request.urlopen(request, timeout=60))["job_id"])
PY
)
export HARVEST_FUZZ_JOB
# DELETE on a job cancels it, and the contract keeps a cancelled job readable (a second
# DELETE answers it again), so use_after_free ("deleted resource still available") is the one
# check that does not apply.
status=0
"$venv/bin/st" --config-file scripts/schemathesis.toml run api/openapi.json \
  --url "http://127.0.0.1:$port" -H "Authorization: Bearer $key" \
  --checks all --exclude-checks use_after_free --workers 1 --rate-limit 40/s --seed 1 --no-color "$@" || status=$?
if grep -q "panicked" "$work/server.log"; then
  echo "the server panicked during the run:" >&2
  grep -A5 "panicked" "$work/server.log" >&2
  status=1
fi
exit "$status"
