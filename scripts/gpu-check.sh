#!/usr/bin/env bash
# The CUDA backend's check on a GPU machine (issue 7), a few minutes in all. The GPU machine has
# no Rust toolchain and no network: build here and carry the stripped binary (about 15 MB) and
# a tokenizer (SmolLM2's checkpoint, 270 MB, is larger than a device run may carry; with only
# its tokenizer files the parity model is a SmolLM2-shaped one with random weights).
#   cargo build --release -p harvester && strip -o harvester-gpu target/release/harvester
#   scripts/gpu-check.sh ./harvester-gpu DIR
# DIR holds tokenizer.json and tokenizer_config.json, and model.safetensors if it is a real
# checkpoint to use for parity.
# 1. Parity: the parity prompts harvested on the CPU in bf16 mode (the CUDA backend's reference:
#    the same bf16 inputs and f32 accumulation) and on CUDA (every layer); token ids must be
#    identical and every token row within 2e-3 relative error (`harvester compare`). The f32
#    CPU run is compared too, at 1e-2, for information only.
# 2. Throughput: `harvester bench` on 64 prompts of 512 tokens of an 8B-shaped model with random
#    bf16 weights (made here by `harvester synth-model`), 3 layers and all layers, each with
#    activations kept and with projections onto 8 directions: tokens/s, the fraction of the
#    bf16 GEMM rate measured in the same run, and weight-load GB/s.
# DEVICE=cpu BENCH_SHAPE=smollm2-135m runs the same steps on a small CPU machine (how the script
# itself is checked without a GPU).
# The CUDA libraries (driver, cuBLAS, NVRTC) are looked for wherever the machine has them: the
# dynamic linker's cache, a CUDA toolkit, and the nvidia-* wheels of any Python on PATH; the
# paths used are printed and put on LD_LIBRARY_PATH. A parity failure is reported, and the
# throughput steps still run, so one device run gives both figures; the exit status is then 1.
set -euo pipefail
usage="usage: scripts/gpu-check.sh HARVESTER DIR"
harvester=${1:?$usage}
dir=${2:?$usage}
device=${DEVICE:-cuda}
bench_shape=${BENCH_SHAPE:-llama-8b}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Directories that may hold the CUDA libraries, most specific first.
candidate_dirs() {
  for py in python3 python; do
    command -v "$py" >/dev/null || continue
    "$py" - <<'PY' 2>/dev/null || true
import glob, os, site
roots = list(site.getsitepackages()) + [site.getusersitepackages()]
for root in roots:
    for lib in sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib"))) + sorted(glob.glob(os.path.join(root, "nvidia", "*", "*", "lib"))):
        print(lib)
PY
  done
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib/wsl/lib; do
    [ -d "$d" ] && echo "$d"
  done
  ldconfig -p 2>/dev/null | awk '/libcuda\.so|libcublas|libnvrtc/ {print $NF}' | xargs -r -n1 dirname
}
if [ "$device" != cpu ]; then
  echo "== CUDA libraries"
  dirs=$(candidate_dirs | awk '!seen[$0]++')
  libpath=
  for lib in libcuda.so.1 libcublas.so.13 libcublasLt.so.13 libnvrtc.so.13; do
    found=
    for d in $dirs; do
      if [ -e "$d/$lib" ]; then found=$d; break; fi
    done
    if [ -n "$found" ]; then
      echo "  $lib: $found/$lib"
      case ":$libpath:" in *":$found:"*) ;; *) libpath=${libpath:+$libpath:}$found ;; esac
    else
      echo "  $lib: NOT FOUND (the harvester's probe will name it)"
    fi
  done
  export LD_LIBRARY_PATH=$libpath${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  echo "  LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
fi

model=$dir
if [ ! -f "$dir/model.safetensors" ]; then
  model=$work/smollm2-shaped
  "$harvester" synth-model --shape smollm2-135m --out "$model" --tokenizer-from "$dir"
fi
echo "== parity on $model: cpu (bf16 mode, and f32 for information) against $device"
for precision in bf16 f32; do
  "$harvester" run --device cpu --precision "$precision" --model "$model" \
    --prompts "$here/gpu/parity_prompts.jsonl" --layers all --shard-size 4 --progress off \
    --out "$work/reference-$precision" >/dev/null
done
parity=passed
if ! "$harvester" run --device "$device" --precision bf16 --model "$model" \
  --prompts "$here/gpu/parity_prompts.jsonl" --layers all --shard-size 4 --progress off \
  --out "$work/candidate" >/dev/null; then
  parity="FAILED (the $device run did not finish)"
elif ! "$harvester" compare "$work/reference-bf16" "$work/candidate" --max-relative-error 2e-3; then
  parity=FAILED
fi
echo "== against the f32 CPU run (information only):"
"$harvester" compare "$work/reference-f32" "$work/candidate" --max-relative-error 1e-2 || true
echo "== parity: $parity (the throughput steps run either way)"

echo "== throughput of a $bench_shape-shaped model on $device"
"$harvester" synth-model --shape "$bench_shape" --out "$work/bench-model"
python3 -c 'import json, random; random.seed(7); print(json.dumps([[random.randrange(1, 40000) for _ in range(512)] for _ in range(64)]))' >"$work/ids.json"
blocks=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["num_hidden_layers"])' "$work/bench-model/config.json")
three="$((blocks / 4)),$((blocks / 2)),$((3 * blocks / 4))"
benches_failed=0
for layers in "$three" all; do
  for projection in "" "--directions 8"; do
    # shellcheck disable=SC2086
    "$harvester" bench --device "$device" --model "$work/bench-model" --ids "$work/ids.json" \
      --layers "$layers" --batch-tokens 8192 $projection || benches_failed=$((benches_failed + 1))
  done
done

echo "== summary: parity $parity on $device; $benches_failed of 4 throughput runs failed; figures above"
[ "$parity" = passed ] && [ "$benches_failed" = 0 ]
