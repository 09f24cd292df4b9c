#!/usr/bin/env bash
# The GPU window (issue 33): everything a bare GPU machine needs, prepared on a CPU machine.
#
#   scripts/gpu-window.sh pack
#
# builds the release harvester once, strips and gzips it, and fills the ignored folder .gpu/ with it,
# SmolLM2's tokenizer, the parity prompts, the CPU references (the parity prompts harvested on
# the CPU from the seeded SmolLM2-shaped checkpoint, in bf16 mode and in f32), the
# transformers peer (peer.py) and run.sh, the GPU side. It checks that .gpu/ and the tree that
# travels with it fit the 64 MiB a device run takes, and prints the one command to run there.
# `DEVICE=cpu .gpu/run.sh OUT` runs the same steps on this machine (CI does).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
[ "${1:-}" = pack ] || { echo "usage: scripts/gpu-window.sh pack" >&2; exit 2; }
limit=$((64 * 1024 * 1024))
pack=$root/.gpu

cargo build --release --quiet -p harvester
rm -rf "$pack"
mkdir -p "$pack/tokenizer"
# The stripped harvester runs this script's steps; gzipped, it travels in 40% of the bytes
# (run.sh and profile.sh unpack it first).
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
harvester=$work/harvester
strip -o "$harvester" "${CARGO_TARGET_DIR:-$root/target}/release/harvester"
gzip -9c "$harvester" >"$pack/harvester.gz"
model=$(HARVESTER=$harvester scripts/fetch-model.sh | tail -1)
cp "$model/tokenizer.json" "$model/tokenizer_config.json" "$pack/tokenizer/"
cp scripts/gpu/parity_prompts.jsonl scripts/gpu/run.sh scripts/gpu/cuda-env.sh scripts/gpu/profile.sh \
  scripts/gpu/peer.py "$pack/"

# The CPU references: the checkpoint is rebuilt from its seed on the GPU machine (270 MB does
# not travel), and its harvests are small.
"$harvester" synth-model --shape smollm2-135m --out "$work/smol" \
  --tokenizer-from "$pack/tokenizer" >/dev/null
for precision in bf16 f32; do
  "$harvester" run --device cpu --precision "$precision" --model "$work/smol" \
    --prompts "$pack/parity_prompts.jsonl" --layers all --shard-size 4 --progress off \
    --out "$pack/reference-$precision" >/dev/null
done

# What travels: the tracked files, the untracked ones git does not ignore, and .gpu/.
tree_bytes=$(git ls-files -z --cached --others --exclude-standard \
  | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
pack_bytes=$(du -sb "$pack" | cut -f1)
total=$((tree_bytes + pack_bytes))
printf 'pack: .gpu/ %.1f MiB + tree %.1f MiB = %.1f MiB of the %d MiB that travels\n' \
  "$(echo "$pack_bytes / 1048576" | bc -l)" "$(echo "$tree_bytes / 1048576" | bc -l)" \
  "$(echo "$total / 1048576" | bc -l)" $((limit / 1048576))
if [ "$total" -gt "$limit" ]; then
  echo "pack: too large to travel: $total bytes over $limit" >&2
  exit 1
fi
echo "run on the GPU machine, carrying .gpu (output under OUT):"
echo '  bash .gpu/run.sh "$OUT"      # STEPS=a,b reruns only those steps (docs/gpu.md)'
