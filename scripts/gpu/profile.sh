#!/usr/bin/env bash
# Where the CUDA forward pass's time goes (issue 35), on the GPU machine:   bash .gpu/profile.sh OUT
# Nsight Compute times each kernel of a stretch of the 8B-shaped forward pass (a few blocks
# past the warm-up, clocks left alone), once at 512 tokens a prompt and once at 4,096; the
# durations are summed by kernel, as a share of the stretch. Writes OUT/profile.txt and the raw
# CSVs.
set -uo pipefail
out=${1:?usage: profile.sh OUT}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The harvester travels gzipped (see run.sh).
harvester=$work/harvester
gzip -dc "$here/harvester.gz" >"$harvester" && chmod +x "$harvester" || exit 1
mkdir -p "$out"
exec > >(tee -a "$out/profile.txt") 2>&1
export PATH=$PATH:/usr/local/cuda/bin
source "$here/cuda-env.sh" >/dev/null
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: ${ncu:-NOT FOUND}"
timeout 120 "$harvester" synth-model --shape llama-8b --out "$work/model" >/dev/null
python3 - "$work" <<'PY'
import json, random, sys
random.seed(7)
for name, n, length in (("short", 16, 512), ("long", 2, 4096)):
    json.dump([[random.randrange(1, 40000) for _ in range(length)] for _ in range(n)],
              open(f"{sys.argv[1]}/ids-{name}.json", "w"))
PY
for name in short long; do
  echo "== $name: kernels of blocks 4 onwards of the 8,192-token warm-up batch"
  # One block is 9 launches of ours plus cuBLAS's own; skip the first blocks' worth.
  timeout 150 "$ncu" --clock-control none --launch-skip 60 --launch-count 60 \
    --metrics gpu__time_duration.sum --csv \
    "$harvester" bench --device cuda --precision bf16 --model "$work/model" \
    --ids "$work/ids-$name.json" --layers 8 --batch-tokens 8192 >"$out/ncu-$name.csv" 2>"$work/ncu.err"
  echo "ncu exit $?"; tail -3 "$work/ncu.err"
  python3 - "$out/ncu-$name.csv" <<'PY'
import csv, collections, sys
rows = list(csv.reader(open(sys.argv[1])))
start = next((i for i, r in enumerate(rows) if r and r[0] == "ID"), None)
if start is None:
    print("no kernel rows"); sys.exit()
head = rows[start]
rows = [head] + [r for r in rows[start + 1:] if len(r) == len(head)]
name_at, value_at, unit_at = head.index("Kernel Name"), head.index("Metric Value"), head.index("Metric Unit")
total = collections.Counter(); count = collections.Counter()
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
for r in rows[1:]:
    name = r[name_at].split("(")[0][:60]
    total[name] += float(r[value_at].replace(",", "")) * scale.get(r[unit_at], 1.0)
    count[name] += 1
whole = sum(total.values())
print(f"{len(rows) - 1} kernels, {whole:.0f} us")
for name, us in total.most_common():
    print(f"  {100 * us / whole:5.1f}%  {us:9.0f} us  x{count[name]:<3} {name}")
PY
done
