#!/usr/bin/env bash
# Runs the same five plans (quartile layers; every layer in shards of 4; every hook site of two
# layers, the router's too on a MoE model; projections onto 3 directions without special tokens;
# three pipeline stages) with two harvester binaries on
# SmolLM2 and says whether every output file but result.json (whose timings differ) is
# byte-identical. For refactors that must not change a harvest's bytes:
#   scripts/same-bytes.sh OLD_HARVESTER NEW_HARVESTER
# A side written HARVESTER@LEVEL runs at that CPU kernel level (HARVEST_CPU_LEVEL), and
# PRECISION=bf16 runs the bf16 mode (f32 by default). The f32 mode promises the same bytes at
# every level; the bf16 mode, the same bytes at one level (docs/engine.md):
#   scripts/same-bytes.sh target/release/harvester@portable target/release/harvester
#   PRECISION=bf16 scripts/same-bytes.sh target/release/harvester@avx2 target/release/harvester@avx2
# MODEL=DIR runs another checkpoint (its blocks: the `sites` plan keeps its first and last), and
# DEVICE=cuda-replay the CUDA backend's replay, e.g. on the test fixtures:
#   MODEL=harvester/tests/fixtures/tiny-afmoe-bf16 DEVICE=cuda-replay scripts/same-bytes.sh OLD NEW
set -euo pipefail
old=$1 new=$2
precision=${PRECISION:-f32}
device=${DEVICE:-cpu}
model=${MODEL:-${HARVEST_CACHE:-$HOME/.cache/harvest}/models/smollm2-135m}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
read -r hidden last moe < <(python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); print(c["hidden_size"], c["num_hidden_layers"]-1, "num_experts" in c)' "$model/config.json")
router=
[[ $moe == True ]] && router=,router,router_logits
python3 - "$work" "$hidden" <<'PY'
import json, random, struct, sys
work, hidden = sys.argv[1], int(sys.argv[2])
random.seed(7)
words = "the residual stream of a language model carries features across layers while attention moves information between tokens".split()
with open(f"{work}/prompts.jsonl", "w") as f:
    for _ in range(40):
        f.write(json.dumps({"text": " ".join(random.choice(words) for _ in range(random.randint(3, 60)))}) + "\n")
values = [((i * 7919) % 101 - 50) / 7.0 for i in range(3 * hidden)]
header = f"{{'descr': '<f4', 'fortran_order': False, 'shape': (3, {hidden}), }}"
header += " " * ((64 - (10 + len(header) + 1) % 64) % 64) + "\n"
with open(f"{work}/dirs.npy", "wb") as f:
    f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode())
    f.write(struct.pack(f"<{len(values)}f", *values))
PY
status=0
for plan in quartiles all sites projections stages; do
  for side in old new; do
    bin=${!side%@*}
    level=
    [[ ${!side} == *@* ]] && level=${!side##*@}
    out=$work/$side-$plan
    case $plan in
      quartiles) args=() ;;
      all) args=(--layers all --shard-size 4) ;;
      sites) args=(--layers 0,$last --sites resid_pre,attn_out,resid_mid,mlp_out,resid_post$router) ;;
      projections) args=(--layers 1,$last --project-onto "$work/dirs.npy" --shard-size 16 --no-special-tokens) ;;
      stages) args=(--layers all --pipeline-stages $(( last < 2 ? last + 1 : 3 )) --sites resid_mid,mlp_out,resid_post) ;;
    esac
    HARVEST_CPU_LEVEL=$level "$bin" run --model "$model" --prompts "$work/prompts.jsonl" --out "$out" \
      --progress off --precision "$precision" --device "$device" "${args[@]}" >/dev/null
    (cd "$out" && find . -type f ! -name result.json | sort | xargs sha256sum) > "$work/$side-$plan.sha"
  done
  files=$(wc -l < "$work/old-$plan.sha")
  if cmp -s "$work/old-$plan.sha" "$work/new-$plan.sha"; then
    echo "$plan: $files files, byte-identical"
  else
    echo "$plan: $files files, DIFFERENT:"; diff "$work/old-$plan.sha" "$work/new-$plan.sha" || true; status=1
  fi
done
exit "$status"
