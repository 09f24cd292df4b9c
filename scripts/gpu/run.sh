#!/usr/bin/env bash
# The GPU window (issues 33, 51), the GPU side: `scripts/gpu-window.sh pack` copies this into .gpu/
# with the stripped harvester (gzipped), a tokenizer, the parity prompts and the CPU references, and
# prints the one command that runs it there:   bash .gpu/run.sh OUT
# Every step has its own time limit, and the whole run one deadline (WINDOW_SECONDS, default
# 540, below the device call's 600): a step gets what is left of it, less a reserve for the
# summary, so a slow step costs the later ones, never the summary. OUT holds three files:
# summary.txt (one line per figure), log.txt (everything), and details.tar.gz (each step's
# JSON: env, cuda-info, parity, sanitizer, bench, load, peer), packed at exit whatever happens.
# STEPS=kernels,parity,... runs only the steps named (environment and summary always run), so
# a rerun repeats only what failed: upload, kernels, parity, variants, auto, cuda12, sites,
# replay, fixtures, f32, stages, shapes, batch, speed, load, block405, afmoe.
# After parity, every hook site of three layers is compared with the CPU bf16 mode (run on the
# GPU machine's own CPU), and resid_post alone with resid_post beside every other site; then
# the GPU's parity run with the CUDA replay of it on the GPU machine's CPU.
# DEVICE=cpu runs the same steps on the CPU with a SmolLM2-shaped bench model (how CI checks
# this script); the transformers peer is skipped where torch is missing, and says so.
set -uo pipefail
out=${1:?usage: run.sh OUT}
device=${DEVICE:-cuda}
here=$(cd "$(dirname "$0")" && pwd)
# Scratch (the bench models, about 0.5 GB): removed at exit unless the caller gave WORK.
if [ -n "${WORK:-}" ]; then
  work=$WORK
else
  work=$(mktemp -d)
fi
details=$out/details
mkdir -p "$out" "$work" "$details"
exec > >(tee -a "$out/log.txt") 2>&1
summary=$out/summary.txt
: >"$summary"
# At exit, every step's file goes into one archive, so what comes back is three files.
pack_details() {
  [ -d "$details" ] || return 0
  tar -czf "$out/details.tar.gz" -C "$out" details && rm -rf "$details"
}
trap 'pack_details; [ -z "${WORK:-}" ] && rm -rf "$work"' EXIT
# On a CPU (CI) the same steps take minutes longer, with no device call to fit in.
deadline=$((SECONDS + ${WINDOW_SECONDS:-$([ "$device" = cpu ] && echo 3600 || echo 540)}))
# Seconds kept back for the summary and the packing.
reserve=20
steps=${STEPS:-all}
# Whether step $1 runs: STEPS names it, or names none.
wanted() { [ "$steps" = all ] || [[ ",$steps," == *",$1,"* ]]; }
note() { echo "$*" | tee -a "$summary"; }
# The harvester travels gzipped (it is most of the 64 MiB a device run carries): unpacked into
# the scratch before anything else.
harvester=$work/harvester
if ! { gzip -dc "$here/harvester.gz" >"$harvester" && chmod +x "$harvester"; }; then
  note "harvester: FAILED to unpack $here/harvester.gz"
  exit 1
fi
# One summary line LABEL: CANDIDATE against REFERENCE with `harvester compare` at GUARD.
judge() {
  local label=$1 guard=$2 reference=$3 candidate=$4 judged
  if judged=$("$harvester" compare "$reference" "$candidate" --max-relative-error "$guard" 2>&1); then
    note "$label (guard $guard): passed: $(echo "$judged" | head -1)"
  else
    note "$label (guard $guard): FAILED: $(echo "$judged" | head -2 | tr '\n' ' ')"
    failures=$((failures + 1))
  fi
}
# One summary line LABEL: whether two runs wrote the same bytes (every file but result.json).
same_bytes() {
  local label=$1 reference=$2 candidate=$3 differs
  if differs=$(diff -rq --exclude=result.json "$reference" "$candidate" 2>&1); then
    note "$label: the same bytes"
  else
    note "$label: FAILED: $(echo "$differs" | head -3 | tr '\n' ' ')"
    failures=$((failures + 1))
  fi
}
step() { echo; echo "== $* ($(date +%T))"; }
failures=0
# Runs "$@" under a time limit of $1 seconds, or what is left of the window's deadline if that
# is less, saying so when it is killed or not started.
limited() {
  local seconds=$1 left=$((deadline - reserve - SECONDS)); shift
  [ "$left" -lt "$seconds" ] && seconds=$left
  # Said in the summary too, since the step's own output may be going to /dev/null.
  if [ "$seconds" -le 0 ]; then
    note "!! no time left in the window for: ${*:1:3}" >&2
    return 124
  fi
  timeout --kill-after=5 "$seconds" "$@"
  local rc=$?
  [ "$rc" = 124 ] && note "!! timed out after ${seconds}s: ${*:1:3}" >&2
  return "$rc"
}

# ---------------------------------------------------------------------------------------------
step "environment"
{
  date -u
  uname -a
  grep -m1 'model name' /proc/cpuinfo
  grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E 'avx512|avx2|amx' | tr '\n' ' '; echo
  nproc; free -g | head -2
} 2>&1 | tee "$details/env.txt"
export PATH=$PATH:/usr/local/cuda/bin:/usr/local/cuda/compute-sanitizer
if [ "$device" != cpu ]; then
  limited 20 nvidia-smi 2>&1 | tee -a "$details/env.txt"
  driver=$(limited 20 nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
  driver_cuda=$(limited 20 nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -1)
  echo "driver $driver, CUDA $driver_cuda" | tee -a "$details/env.txt"

  source "$here/cuda-env.sh"
  note "libraries: chosen folder ${chosen:-NONE (all four libraries in one folder were not found)}; driver ${driver_dir:-from the linker cache}; LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  command -v compute-sanitizer >/dev/null && note "compute-sanitizer: $(command -v compute-sanitizer)"
fi

# ---------------------------------------------------------------------------------------------
# Compiled kernels are cached here for the window (a fresh cache: the first start compiles).
export HARVEST_KERNEL_CACHE=$work/kernel-cache
if [ "$device" != cpu ] && wanted kernels; then
  step "kernels: compile for the device's own architecture (cubin and PTX), load and run each; then a second start from the disk cache"
  if limited 120 "$harvester" cuda-info --device "$device" >"$details/cuda-info.json"; then
    cat "$details/cuda-info.json"
  else
    cat "$details/cuda-info.json"; failures=$((failures + 1))
  fi
  # The second start must find both forms in the cache (no NVRTC) and still load and run them.
  limited 120 "$harvester" cuda-info --device "$device" >"$work/cuda-info-cached.json"
  cat "$work/cuda-info-cached.json"
  python3 - "$details/cuda-info.json" "$work/cuda-info-cached.json" <<'PY' | tee -a "$summary"
import json, sys
try:
    info = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"kernels: no report ({e})"); sys.exit()
libs = info["libraries"]
print(f"device: {info['device']} ({info['arch']}, capability {info['compute_capability']}), driver CUDA {info['driver_cuda']}, {info['free_bytes']/2**30:.1f} of {info['total_bytes']/2**30:.1f} GiB free")
print(f"libraries: CUDA {libs['major']}: cuBLAS {libs['cublas']['version']} ({libs['cublas']['path']}), NVRTC {libs['nvrtc']['version']} ({libs['nvrtc']['path']}); why: {libs['why']}")
for k in info["kernels"]:
    print(f"kernels as {k['code']} for {k['target']}: {'RAN' if k['ran'] else 'FAILED'}, {k['bytes']} bytes, {'cache read' if k['cached'] else 'NVRTC'} {k['compile_seconds']:.2f} s, load {k['load_seconds']:.3f} s{'; ' + k['error'] if k['error'] else ''}")
print("loaded: " + ", ".join(info["loaded_libraries"]))
try:
    cached = json.load(open(sys.argv[2]))
    for k in cached["kernels"]:
        verdict = "passed" if k["cached"] and k["ran"] else "FAILED"
        print(f"second start, {k['code']}: {verdict}: {'from the cache' if k['cached'] else 'NVRTC again'} in {k['compile_seconds']:.3f} s, {'ran' if k['ran'] else 'did not run'}")
except Exception as e:
    print(f"second start: FAILED: no report ({e})")
PY
  grep -q "second start, .*: FAILED" "$summary" && failures=$((failures + 1))
fi

# ---------------------------------------------------------------------------------------------
# What most steps share: the guards, the SmolLM2-shaped checkpoint and the parity run's output.
vs_cpu=${PARITY_VS_CPU:-1.5e-2}
vs_sites=${PARITY_SITES:-3e-2}
vs_replay=${PARITY_REPLAY:-5e-3}
[ "$device" = cpu ] && vs_replay=1
vs_f32=${PARITY_F32:-5e-3}
smol=$work/smollm2-shaped
limited 120 "$harvester" synth-model --shape smollm2-135m --out "$smol" --tokenizer-from "$here/tokenizer" >/dev/null
candidate=$work/candidate
: >"$details/parity.jsonl"
# The parity run, in $candidate: the reference of the steps after parity. A rerun of STEPS
# without parity makes it first.
parity_run() {
  [ -f "$candidate/manifest.json" ] && return 0
  CUDA_LAUNCH_BLOCKING=1 limited 180 "$harvester" run --device "$device" --precision bf16 \
    --model "$smol" --prompts "$here/parity_prompts.jsonl" --layers all --shard-size 4 \
    --progress off --out "$candidate" >/dev/null
}

if [ "$device" != cpu ] && wanted upload; then
  step "upload: the weights staged through page-locked memory against the driver's pageable path (the same bits)"
  # Seconds long, before anything else that uploads: every CUDA run stages its weights, so if
  # the two differ the rest of the window runs pageable (and says so) instead of failing.
  if limited 120 "$harvester" run --device "$device" --precision bf16 --model "$smol" \
      --prompts "$here/parity_prompts.jsonl" --layers all --shard-size 4 --progress off \
      --out "$work/upload-staged" >/dev/null \
    && HARVEST_CUDA_UPLOAD=pageable limited 120 "$harvester" run --device "$device" --precision bf16 \
      --model "$smol" --prompts "$here/parity_prompts.jsonl" --layers all --shard-size 4 \
      --progress off --out "$work/upload-pageable" >/dev/null; then
    if same=$("$harvester" compare "$work/upload-pageable" "$work/upload-staged" --max-relative-error 0 2>&1); then
      note "upload staged vs pageable: passed, the same bits: $(echo "$same" | head -1)"
    else
      note "upload staged vs pageable: FAILED, the rest of the window runs pageable: $(echo "$same" | head -2 | tr '\n' ' ')"
      export HARVEST_CUDA_UPLOAD=pageable
      failures=$((failures + 1))
    fi
  else
    note "upload: a run FAILED; the rest of the window runs pageable"
    export HARVEST_CUDA_UPLOAD=pageable
    failures=$((failures + 1))
  fi
fi

if wanted parity; then
step "parity: SmolLM2-shaped random checkpoint, $device against the CPU bf16 reference"
# Two bf16 engines that round at different points differ by about as much as each differs from
# the float32 truth (the first window measured 8.7e-3 between CUDA and the CPU bf16 mode, each
# about 1.2e-2 from transformers float32), so the CPU check is a guard (PARITY_VS_CPU), and the
# verdict is against transformers float32: no further from it than the CPU bf16 mode (times
# 1.25) and than transformers' own bf16 pass.
parity=passed
if parity_run; then
  "$harvester" compare "$here/reference-bf16" "$candidate" --max-relative-error "$vs_cpu" \
    | tee -a "$details/parity.jsonl" || parity="FAILED (against the CPU bf16 mode)"
  "$harvester" compare "$here/reference-f32" "$candidate" --max-relative-error 1 \
    | sed 's/^{/{"against":"cpu-f32",/' | tee -a "$details/parity.jsonl" || true
else
  parity="FAILED (the $device run did not finish)"
fi
if [ -d "$candidate/partial" ] || [ -f "$candidate/manifest.json" ]; then
  step "parity against transformers (float32 on $device as the reference, bf16 as the peer)"
  peer_device=$([ "$device" = cpu ] && echo cpu || echo cuda)
  limited 150 python3 "$here/peer.py" parity --model "$smol" --device "$peer_device" \
    --harvest "harvester-$device" "$candidate" --harvest harvester-cpu-bf16 "$here/reference-bf16" \
    | tee "$details/peer.jsonl"
fi
verdict=$(python3 - "$details/parity.jsonl" "$details/peer.jsonl" "$parity" "$device" "$vs_cpu" <<'PY' 2>&1
import json, sys
parity_file, peer_file, parity, device, vs_cpu = sys.argv[1:]
def records(path):
    try:
        return [json.loads(l) for l in open(path) if l.startswith("{")]
    except FileNotFoundError:
        return []
lines = records(parity_file)
bf16 = next((l for l in lines if "against" not in l), None)
f32 = next((l for l in lines if l.get("against") == "cpu-f32"), None)
if bf16:
    print(f"parity {device} vs cpu bf16 (guard {vs_cpu}): max {bf16['max_relative_error']:.3e}, mean {bf16['mean_relative_error']:.3e} over {bf16['rows']} rows")
if f32:
    print(f"parity {device} vs cpu f32 (information): max {f32['max_relative_error']:.3e}, mean {f32['mean_relative_error']:.3e}")
for r in records(peer_file):
    if r.get("step") == "parity-summary":
        e = r["engines"]
        for name, v in e.items():
            print(f"vs transformers f32: {name}: max {v['max']:.3e}, median of layer medians {v['median_of_medians']:.3e}")
        ours, cpu, peer = e[f"harvester-{device}"]["max"], e["harvester-cpu-bf16"]["max"], e["transformers-bf16"]["max"]
        if parity == "passed" and not (ours <= 1.25 * cpu and ours <= peer):
            parity = f"FAILED (against transformers f32: {ours:.3e}, over 1.25 x the CPU bf16 mode's {cpu:.3e} or transformers bf16's {peer:.3e})"
    elif r.get("skipped"):
        print("transformers peer: skipped: " + r["skipped"])
print(f"parity: {parity}")
PY
)
echo "$verdict" | tee -a "$summary"
case "$verdict" in *"parity: passed"*) ;; *)
  failures=$((failures + 1))
  if [ "$device" != cpu ] && command -v compute-sanitizer >/dev/null; then
    step "the parity run again under compute-sanitizer --tool memcheck"
    limited 150 compute-sanitizer --tool memcheck --print-limit 50 \
      "$harvester" run --device "$device" --precision bf16 --model "$smol" \
      --prompts "$here/parity_prompts.jsonl" --layers all --shard-size 4 --progress off \
      --out "$work/sanitized" >"$details/sanitizer.txt" 2>&1
    tail -40 "$details/sanitizer.txt"
    note "sanitizer: $(grep -m1 -E 'ERROR SUMMARY' "$details/sanitizer.txt" || echo 'no summary line')"
  fi ;;
esac
fi
if [ "$device" != cpu ] && wanted variants && parity_run; then
  step "the parity run with the kernels as PTX, with the weights uploaded from pageable memory, with the batch tail hidden, and with CUDA-core attention, against the default"
  # PTX, the pageable upload and the hidden tail (batches of 96 tokens: many hand-backs) must
  # give the same bits as the default (a cubin, staged, waited tail), so they are judged at 0;
  # the CUDA-core attention is another kernel, judged by the CPU guard.
  for variant in HARVEST_CUDA_CODE=ptx:0 HARVEST_CUDA_UPLOAD=pageable:0 HARVEST_CUDA_TAIL=overlap:0 HARVEST_CUDA_ATTENTION=simple:$vs_cpu; do
    guard=${variant##*:}; variant=${variant%:*}
    if (export "$variant"; limited 120 "$harvester" run --device "$device" --precision bf16 \
      --model "$smol" --prompts "$here/parity_prompts.jsonl" --layers all --shard-size 4 \
      --progress off --out "$work/candidate-$variant" >/dev/null); then
      judge "$variant" "$guard" "$candidate" "$work/candidate-$variant"
    else
      note "$variant: the run FAILED"
      failures=$((failures + 1))
    fi
  done
  [ -d "$work/candidate-HARVEST_CUDA_ATTENTION=simple" ] && limited 150 python3 "$here/peer.py" parity \
    --model "$smol" --device cuda --harvest harvester-cuda-simple-attention \
    "$work/candidate-HARVEST_CUDA_ATTENTION=simple" --harvest harvester-cpu-bf16 "$here/reference-bf16" \
    | grep parity-summary | sed 's/^/simple attention: /' | tee -a "$summary"
fi

if wanted auto && parity_run; then
step "auto: --device auto takes the $device's place and writes the same bytes"
# A job that names nothing unchecked runs on GPU 0 when one is usable (on DEVICE=cpu, here,
# on the CPU), says so in result.json, and is the same run as naming the device.
expected=$([ "$device" = cpu ] && echo cpu || echo cuda:0)
auto_ref=$candidate
if limited 180 "$harvester" run --device auto --precision bf16 --model "$smol" \
    --prompts "$here/parity_prompts.jsonl" --layers all --shard-size 4 --progress off \
    --out "$work/auto" >/dev/null; then
  chose=$(python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); print(r.get("device"), "|", r.get("device_reason"))' "$work/auto/result.json")
  if [ "${chose%% |*}" = "$expected" ] && diff -rq --exclude=result.json "$auto_ref" "$work/auto" >/dev/null; then
    note "auto: passed: ran on ${chose%% |*}, the same bytes as --device $device (${chose#*| })"
  else
    note "auto: FAILED: ran on ${chose%% |*} (expected $expected): ${chose#*| }; $(diff -rq --exclude=result.json "$auto_ref" "$work/auto" 2>&1 | head -2 | tr '\n' ' ')"
    failures=$((failures + 1))
  fi
else
  note "auto: the run FAILED"
  failures=$((failures + 1))
fi
fi
if [ "$device" != cpu ] && wanted cuda12 && parity_run; then
  step "CUDA 12's libraries on this driver (HARVEST_CUDA_MAJOR=12), against the default's"
  # Information: the libraries a driver of the 12 line would load. cuBLAS 12 may pick other
  # GEMM algorithms, so the bits may differ within the bf16 engines' spread.
  if HARVEST_CUDA_MAJOR=12 limited 60 "$harvester" cuda-info --device "$device" >"$work/cuda12.json" 2>"$work/cuda12.err"; then
    if HARVEST_CUDA_MAJOR=12 limited 180 "$harvester" run --device "$device" --precision bf16 \
        --model "$smol" --prompts "$here/parity_prompts.jsonl" --layers all --shard-size 4 \
        --progress off --out "$work/candidate-cuda12" >/dev/null; then
      libs12=$(python3 - "$work/cuda12.json" <<'PY'
import json, sys
libs = json.load(open(sys.argv[1]))["libraries"]
print(f"cuBLAS {libs['cublas']['version']}, NVRTC {libs['nvrtc']['version']}")
PY
)
      note "CUDA 12 libraries ($libs12) vs the default's: $("$harvester" compare "$candidate" "$work/candidate-cuda12" --max-relative-error "$vs_cpu" 2>&1 | head -1)"
    else
      note "CUDA 12 libraries: the run FAILED"
      failures=$((failures + 1))
    fi
  else
    note "CUDA 12 libraries: not here ($(tail -1 "$work/cuda12.err"))"
  fi
fi

# ---------------------------------------------------------------------------------------------
if wanted sites; then
step "every hook site: $device against the CPU bf16 mode (both run here), and resid_post with and without the other sites kept"
# The CPU reference is made here: the bf16 mode gives the same bytes on every CPU of one kind
# (docs/engine.md), and three layers of five sites do not fit the pack. A branch output kept
# apart joins the stream by the same one f32 addition as the GEMM's beta = 1, so resid_post
# must keep its bits whatever else is kept.
all_sites=resid_pre,attn_out,resid_mid,mlp_out,resid_post
sites_plan=(--precision bf16 --model "$smol" --prompts "$here/parity_prompts.jsonl" --layers 0,14,29
  --shard-size 4 --progress off)
if limited 120 "$harvester" run --device cpu "${sites_plan[@]}" --sites "$all_sites" \
    --out "$work/sites-cpu" >/dev/null \
  && CUDA_LAUNCH_BLOCKING=1 limited 120 "$harvester" run --device "$device" "${sites_plan[@]}" \
    --sites "$all_sites" --out "$work/sites-$device" >/dev/null \
  && limited 120 "$harvester" run --device "$device" "${sites_plan[@]}" \
    --out "$work/post-$device" >/dev/null; then
  if sites=$("$harvester" compare "$work/sites-cpu" "$work/sites-$device" --max-relative-error "$vs_sites" 2>&1); then
    note "sites $device vs cpu bf16 (guard $vs_sites): passed: $(echo "$sites" | head -1)"
  else
    note "sites $device vs cpu bf16 (guard $vs_sites): FAILED: $(echo "$sites" | head -2 | tr '\n' ' ')"
    failures=$((failures + 1))
  fi
  echo "$sites" | head -1 | sed 's/^{/{"against":"cpu-bf16-sites",/' >>"$details/parity.jsonl"
  if same=$("$harvester" compare "$work/post-$device" "$work/sites-$device" --max-relative-error 0 2>&1); then
    note "resid_post alone against resid_post with every site kept: the same bits: $(echo "$same" | head -1)"
  else
    note "resid_post alone against resid_post with every site kept: DIFFERENT: $(echo "$same" | head -2 | tr '\n' ' ')"
    failures=$((failures + 1))
  fi
else
  note "sites: a run FAILED"
  failures=$((failures + 1))
fi

fi

# ---------------------------------------------------------------------------------------------
if wanted replay && parity_run; then
step "the CUDA replay (--device cuda-replay, on this machine's CPU) against the $device parity run"
# The replay runs the same dense block over the kernels' arithmetic replayed on the CPU; it can
# differ from the GPU only by cuBLAS's summation order, the GPU's approximate exp, sincos and
# rsqrt, and fused products. The guard (PARITY_REPLAY) was set before any GPU run compared
# them: the first window's figure decides whether the replay stands in for the GPU in CI. On
# DEVICE=cpu the comparison is with the CPU bf16 mode, which rounds elsewhere: information only.
if [ -f "$candidate/manifest.json" ] && limited 300 "$harvester" run --device cuda-replay \
    --model "$smol" --prompts "$here/parity_prompts.jsonl" --layers all --shard-size 4 \
    --progress off --out "$work/replay" >/dev/null; then
  if replay=$("$harvester" compare "$candidate" "$work/replay" --max-relative-error "$vs_replay" 2>&1); then
    note "replay vs $device (guard $vs_replay): passed: $(echo "$replay" | head -1)"
  else
    note "replay vs $device (guard $vs_replay): FAILED: $(echo "$replay" | head -2 | tr '\n' ' ')"
    failures=$((failures + 1))
  fi
  echo "$replay" | head -1 | sed 's/^{/{"against":"cuda-replay",/' >>"$details/parity.jsonl"
else
  note "replay: the $device parity run or the replay run FAILED"
  failures=$((failures + 1))
fi

fi

if wanted fixtures; then
step "16-wide heads, a QKV bias, a sliding window and AFMoE (the Llama 3, Qwen2, Mistral and AFMoE test fixtures): $device against the replay"
# None has run on a GPU before: the replay, tied to the kernels, is their check until here.
# AFMoE runs on a GPU only when asked for until this step has passed (HARVEST_CUDA_AFMOE); its
# routing can differ from the replay's where a token's margin is below the two's rounding
# differences, which this step would show as a few tokens over the guard. The CPU runs AFMoE in
# f32 only, so on DEVICE=cpu that fixture runs in f32 on both, under the f32 mode's guard.
fixtures=$here/../harvester/tests/fixtures
for fixture in tiny-llama3-f16-sharded tiny-qwen2-f32 tiny-mistral-window-bf16 tiny-afmoe-bf16; do
  runs=ok
  precision=bf16
  guard=$vs_replay
  [ "$device" = cpu ] && [ "$fixture" = tiny-afmoe-bf16 ] && precision=f32 && guard=${PARITY_F32:-5e-3}
  # AFMoE keeps its expert choices too: compare counts the tokens routed otherwise
  # (routed_differently of routed_tokens), the GPU's router site against the replay's.
  sites=resid_pre,attn_out,resid_mid,mlp_out,resid_post
  [ "$fixture" = tiny-afmoe-bf16 ] && sites=$sites,router_logits
  for engine in "$device" cuda-replay; do
    HARVEST_CUDA_AFMOE=try CUDA_LAUNCH_BLOCKING=1 limited 120 "$harvester" run --device "$engine" --precision "$precision" \
      --model "$fixtures/$fixture" --prompts "$here/parity_prompts.jsonl" --layers all \
      --sites "$sites" --shard-size 4 --progress off \
      --out "$work/$fixture-$engine" >/dev/null || runs="the $engine run FAILED"
  done
  if [ "$runs" != ok ]; then
    note "$fixture: $runs"
    failures=$((failures + 1))
  elif fixture_vs=$("$harvester" compare "$work/$fixture-cuda-replay" "$work/$fixture-$device" \
      --max-relative-error "$guard" 2>&1); then
    note "$fixture $device vs replay, $precision (guard $guard): passed: $(echo "$fixture_vs" | head -1)"
  else
    note "$fixture $device vs replay, $precision (guard $guard): FAILED: $(echo "$fixture_vs" | head -2 | tr '\n' ' ')"
    failures=$((failures + 1))
  fi
  # And against the CPU engine, which shares no kernel logic with the device: its bf16 mode
  # (PARITY_SITES, the bf16 engines' spread), or for AFMoE, which the CPU runs in f32 only, its
  # f32 mode, information only (a bf16 run reroutes a few tokens, docs/engine.md).
  [ "$runs" = ok ] && [ "$device" != cpu ] || continue
  cpu_precision=bf16; cpu_guard=$vs_sites
  [ "$fixture" = tiny-afmoe-bf16 ] && cpu_precision=f32 && cpu_guard=1e9
  if limited 120 "$harvester" run --device cpu --precision "$cpu_precision" \
      --model "$fixtures/$fixture" --prompts "$here/parity_prompts.jsonl" --layers all \
      --sites "$sites" --shard-size 4 --progress off \
      --out "$work/$fixture-cpu" >/dev/null; then
    judge "$fixture $device vs cpu $cpu_precision" "$cpu_guard" "$work/$fixture-cpu" "$work/$fixture-$device"
  else
    note "$fixture: the cpu run FAILED"
    failures=$((failures + 1))
  fi
done

fi

if wanted f32; then
step "the f32 mode: $device against the replay's f32 mode and the CPU's f32 mode"
# The f32 mode keeps every activation in f32 (the kernels' _f32 entry points, f32 GEMMs on the
# pedantic compute type). It runs on a GPU only when asked for until this step has passed
# (HARVEST_CUDA_F32). Three f32 engines differ by summation orders and exp alone, a few f32
# ulps, which the bf16 shards show as an occasional flipped last bit: on the CPU the replay is
# at 1.4e-3 of the CPU's f32 mode (mean 2.4e-5), the bf16 modes near 1e-2. Guard PARITY_F32.
f32_plan=(--precision f32 --model "$smol" --prompts "$here/parity_prompts.jsonl" --layers all
  --shard-size 4 --progress off)
f32_runs=ok
for engine in cpu cuda-replay "$device"; do
  [ -d "$work/f32-$engine" ] && continue
  HARVEST_CUDA_F32=try CUDA_LAUNCH_BLOCKING=1 limited 300 "$harvester" run --device "$engine" \
    "${f32_plan[@]}" --out "$work/f32-$engine" >/dev/null || f32_runs="the $engine run FAILED"
done
if [ "$f32_runs" != ok ]; then
  note "f32: $f32_runs"
  failures=$((failures + 1))
else
  for against in cuda-replay cpu; do
    [ "$against" = "$device" ] && continue
    if f32_vs=$("$harvester" compare "$work/f32-$against" "$work/f32-$device" \
        --max-relative-error "$vs_f32" 2>&1); then
      note "f32 $device vs $against f32 (guard $vs_f32): passed: $(echo "$f32_vs" | head -1)"
    else
      note "f32 $device vs $against f32 (guard $vs_f32): FAILED: $(echo "$f32_vs" | head -2 | tr '\n' ' ')"
      failures=$((failures + 1))
    fi
    echo "$f32_vs" | head -1 | sed "s/^{/{\"against\":\"$against-f32\",/" >>"$details/parity.jsonl"
  done
fi

fi

if wanted stages && parity_run; then
step "2 pipeline stages on one $device against 1: the same bytes"
# Each stage on the same GPU (--stage-devices 0,0) runs the blocks the single run runs, the
# residual stream handed on through host memory: every file but result.json must be equal.
# CUDA stages run only when asked for until this step has passed on a GPU (HARVEST_CUDA_STAGES).
stage_flags=(--pipeline-stages 2); [ "$device" = cpu ] || stage_flags+=(--stage-devices 0,0)
if [ -f "$candidate/manifest.json" ] && HARVEST_CUDA_STAGES=try CUDA_LAUNCH_BLOCKING=1 limited 180 "$harvester" run \
    --device "$device" --precision bf16 --model "$smol" --prompts "$here/parity_prompts.jsonl" \
    --layers all --shard-size 4 --progress off "${stage_flags[@]}" --out "$work/staged" >/dev/null; then
  same_bytes "2 stages on one $device vs 1" "$candidate" "$work/staged"
else
  note "2 stages: the parity run or the staged run FAILED"
  failures=$((failures + 1))
fi
# Eight stages on one device, kept layers on both sides of every cut: the same bytes too.
eight_flags=(--pipeline-stages 8); [ "$device" = cpu ] || eight_flags+=(--stage-devices 0,0,0,0,0,0,0,0)
if HARVEST_CUDA_STAGES=try limited 240 "$harvester" run --device "$device" --precision bf16 \
    --model "$smol" --prompts "$here/parity_prompts.jsonl" --layers all --shard-size 4 \
    --progress off "${eight_flags[@]}" --out "$work/staged-8" >/dev/null; then
  same_bytes "8 stages on one $device vs 1" "$candidate" "$work/staged-8"
else
  note "8 stages: the run FAILED"
  failures=$((failures + 1))
fi
fi

if wanted shapes; then
step "128-wide heads with a window, 256-wide heads, attention biases (synth-model shapes): $device against the replay and the CPU, bf16; the biases in f32 too"
# None of these has met a GPU: the tensor-core attention's window and key-tile skipping
# (window-128), the CUDA-core attention at its widest heads (heads-256), the QKV and O biases
# (attention-bias). Each runs every site of every block on the device, replayed, and on the
# CPU; the device is judged against the replay (PARITY_REPLAY) and against the CPU's bf16 mode
# (PARITY_SITES, the bf16 engines' spread). On DEVICE=cpu the CPU is the device: information.
for shape in window-128 heads-256 attention-bias; do
  model=$work/shape-$shape
  limited 60 "$harvester" synth-model --shape "$shape" --out "$model" --tokenizer-from "$here/tokenizer" >/dev/null
  runs=ok
  for engine in "$device" cuda-replay cpu; do
    [ -d "$work/$shape-$engine" ] && continue
    CUDA_LAUNCH_BLOCKING=1 limited 120 "$harvester" run --device "$engine" --precision bf16 \
      --model "$model" --prompts "$here/parity_prompts.jsonl" --layers all \
      --sites resid_pre,attn_out,resid_mid,mlp_out,resid_post --shard-size 4 --progress off \
      --out "$work/$shape-$engine" >/dev/null || runs="the $engine run FAILED"
  done
  if [ "$runs" != ok ]; then
    note "$shape: $runs"
    failures=$((failures + 1))
    continue
  fi
  for against in cuda-replay cpu; do
    [ "$against" = "$device" ] && continue
    guard=$vs_replay; [ "$against" = cpu ] && guard=$vs_sites
    [ "$device" = cpu ] && guard=1
    judge "$shape $device vs $against, bf16" "$guard" "$work/$shape-$against" "$work/$shape-$device"
  done
done
# The biases in the f32 mode: the bias joins the f32 product in place (add_bias). Against the
# replay's f32 mode and the CPU's (on DEVICE=cpu, the CPU against the replay).
bias_f32=ok
for engine in cpu cuda-replay "$device"; do
  [ -d "$work/bias-f32-$engine" ] && continue
  HARVEST_CUDA_F32=try CUDA_LAUNCH_BLOCKING=1 limited 120 "$harvester" run --device "$engine" \
    --precision f32 --model "$work/shape-attention-bias" --prompts "$here/parity_prompts.jsonl" \
    --layers all --shard-size 4 --progress off --out "$work/bias-f32-$engine" >/dev/null \
    || bias_f32="the $engine run FAILED"
done
if [ "$bias_f32" != ok ]; then
  note "attention-bias f32: $bias_f32"
  failures=$((failures + 1))
else
  for against in cuda-replay cpu; do
    [ "$against" = "$device" ] && continue
    judge "attention-bias f32 $device vs $against f32" "$vs_f32" "$work/bias-f32-$against" "$work/bias-f32-$device"
  done
fi
fi

if wanted batch && parity_run; then
step "batch invariance: the parity prompts one batch at a time, and in two parts, against one full batch"
# The CPU promises a prompt's bits whatever batch it runs in; on a GPU cuBLAS may choose its
# kernels by a GEMM's row count, so there the figures are reported, not judged, until they say
# what it would cost to make them equal. The parity run above is one full batch.
batch_judge=1; [ "$device" = cpu ] && batch_judge=0
if limited 180 "$harvester" run --device "$device" --precision bf16 --model "$smol" \
    --prompts "$here/parity_prompts.jsonl" --layers all --shard-size 4 --batch-tokens 64 \
    --progress off --out "$work/batch-small" >/dev/null; then
  if judged=$("$harvester" compare "$candidate" "$work/batch-small" --max-relative-error "$batch_judge" 2>&1); then
    note "batches of 64 tokens vs one batch ($([ "$batch_judge" = 0 ] && echo 'the same bits required' || echo information)): $(echo "$judged" | head -1)"
  else
    note "batches of 64 tokens vs one batch: FAILED, the bits differ: $(echo "$judged" | head -1)"
    failures=$((failures + 1))
  fi
else
  note "batch invariance: the small-batch run FAILED"
  failures=$((failures + 1))
fi
# The hidden batch tail hands each batch back one call late, and must change no bit: the same
# batches of 64 tokens (five hand-backs), judged at 0 on every device.
if [ -d "$work/batch-small" ] && HARVEST_CUDA_TAIL=overlap limited 180 "$harvester" run     --device "$device" --precision bf16 --model "$smol" --prompts "$here/parity_prompts.jsonl"     --layers all --shard-size 4 --batch-tokens 64 --progress off --out "$work/batch-tail" >/dev/null; then
  judge "batches of 64 tokens with the tail hidden (HARVEST_CUDA_TAIL=overlap)" 0 "$work/batch-small" "$work/batch-tail"
else
  note "batches of 64 tokens with the tail hidden: the run FAILED"
  failures=$((failures + 1))
fi
parts_ok=ok
for part in 0/2 1/2; do
  limited 120 "$harvester" run --device "$device" --precision bf16 --model "$smol" \
    --prompts "$here/parity_prompts.jsonl" --layers all --shard-size 4 --part "$part" \
    --progress off --out "$work/batch-parts" >/dev/null || parts_ok="part $part FAILED"
done
[ "$parts_ok" = ok ] && { limited 60 "$harvester" finalize --device "$device" --precision bf16 \
  --model "$smol" --prompts "$here/parity_prompts.jsonl" --layers all --shard-size 4 \
  --progress off --out "$work/batch-parts" >/dev/null || parts_ok="finalize FAILED"; }
if [ "$parts_ok" != ok ]; then
  note "two parts: $parts_ok"
  failures=$((failures + 1))
elif parts=$(diff -rq --exclude=result.json "$candidate" "$work/batch-parts" 2>&1); then
  note "two parts finalized vs one run: the same bytes"
else
  note "two parts finalized vs one run: $([ "$device" = cpu ] && echo FAILED || echo 'information, they differ'): $(echo "$parts" | head -3 | tr '\n' ' ')"
  [ "$device" = cpu ] && failures=$((failures + 1))
fi
fi

# ---------------------------------------------------------------------------------------------
if [ "$device" = cpu ]; then
  shape=${BENCH_SHAPE:-smollm2-135m}; short=(4 64); long=(2 256); batch_tokens=256
else
  shape=${BENCH_SHAPE:-llama-8b}; short=(64 512); long=(8 4096); batch_tokens=8192
fi
bench_model=$work/bench-model
# The bench model, made once for the speed and load steps.
bench_model_made() {
  [ -f "$bench_model/config.json" ] && return 0
  local start
  start=$(date +%s.%N)
  limited 240 "$harvester" synth-model --shape "$shape" --out "$bench_model" >/dev/null || return 1
  note "synth $shape: $(python3 -c "print(f'{$(date +%s.%N) - $start:.1f}')") s"
}
: >"$details/bench.jsonl"
if wanted speed && bench_model_made; then
step "speed: a $shape-shaped random bf16 model on $device"
python3 - "$work" "${short[@]}" "${long[@]}" <<'PY'
import json, random, sys
work, a, b, c, d = sys.argv[1], *map(int, sys.argv[2:])
random.seed(7)
for name, n, length in (("short", a, b), ("long", c, d)):
    ids = [[random.randrange(1, 40000) for _ in range(length)] for _ in range(n)]
    json.dump(ids, open(f"{work}/ids-{name}.json", "w"))
PY
blocks=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["num_hidden_layers"])' "$bench_model/config.json")
three="$((blocks / 4)),$((blocks / 2)),$((3 * blocks / 4))"
# name : ids : layers : directions
shapes=("${short[0]}x${short[1]}-3-layers:$work/ids-short.json:$three:0"
        "${short[0]}x${short[1]}-all-layers:$work/ids-short.json:all:0"
        "${long[0]}x${long[1]}-all-layers:$work/ids-long.json:all:0"
        "${short[0]}x${short[1]}-8-directions:$work/ids-short.json:all:8")
for spec in "${shapes[@]}"; do
  IFS=: read -r name ids layers directions <<<"$spec"
  projection=(); [ "$directions" != 0 ] && projection=(--directions "$directions")
  echo "-- $name"
  if limited 150 "$harvester" bench --device "$device" --precision bf16 --model "$bench_model" \
    --ids "$ids" --layers "$layers" --batch-tokens "$batch_tokens" "${projection[@]}" \
    >"$work/bench.json"; then
    sed "s/^{/{\"shape\":\"$name\",/" "$work/bench.json" | tee -a "$details/bench.jsonl"
  else
    echo "{\"shape\":\"$name\",\"failed\":true}" | tee -a "$details/bench.jsonl"
    failures=$((failures + 1))
  fi
done
if [ "$device" != cpu ]; then
  # Information for the speed work: the same corpus in batches four times larger.
  echo "-- ${short[0]}x${short[1]}-3-layers-batch-$((4 * batch_tokens))"
  limited 150 "$harvester" bench --device "$device" --precision bf16 --model "$bench_model" \
    --ids "$work/ids-short.json" --layers "$three" --batch-tokens $((4 * batch_tokens)) \
    | sed "s/^{/{\"shape\":\"${short[0]}x${short[1]}-3-layers-batch-$((4 * batch_tokens))\",/" \
    | tee -a "$details/bench.jsonl"
  # The batch tail hidden (HARVEST_CUDA_TAIL=overlap: the next batch queued before the last
  # rows are taken, the inputs through page-locked memory), beside the rows above.
  for spec in "${shapes[@]:0:2}"; do
    IFS=: read -r name ids layers directions <<<"$spec"
    echo "-- $name-tail-hidden"
    HARVEST_CUDA_TAIL=overlap limited 150 "$harvester" bench --device "$device" --precision bf16 \
      --model "$bench_model" --ids "$ids" --layers "$layers" --batch-tokens "$batch_tokens" \
      | sed "s/^{/{\"shape\":\"$name-tail-hidden\",/" | tee -a "$details/bench.jsonl"
  done
  # Information: what the f32 mode costs (f32 weights, f32 GEMMs without TF32, CUDA-core
  # attention), on the same corpus.
  echo "-- ${short[0]}x${short[1]}-3-layers-f32"
  HARVEST_CUDA_F32=try limited 200 "$harvester" bench --device "$device" --precision f32 \
    --model "$bench_model" --ids "$work/ids-short.json" --layers "$three" \
    --batch-tokens "$batch_tokens" \
    | sed "s/^{/{\"shape\":\"${short[0]}x${short[1]}-3-layers-f32\",/" \
    | tee -a "$details/bench.jsonl"
fi
step "speed: transformers on the same token ids"
peer_device=$([ "$device" = cpu ] && echo cpu || echo cuda)
peer_shapes=(); for spec in "${shapes[@]}"; do peer_shapes+=(--shape "$spec"); done
limited 240 python3 "$here/peer.py" speed --model "$bench_model" --device "$peer_device" \
  --batch-tokens "$batch_tokens" "${peer_shapes[@]}" | tee -a "$details/peer.jsonl"
fi

if wanted load && bench_model_made; then
step "load: page-locked staging against the driver's pageable path, warm and cold, beside the disk's own read rate"
# The weights go up through two page-locked buffers (forward/staging.rs) unless
# HARVEST_CUDA_UPLOAD=pageable. Cold: the checkpoint's pages are dropped from the page cache
# first (posix_fadvise DONTNEED, after a sync), as for the disk's read rate of the same files;
# issue 35 asks for a load at 80% of that rate or more. Each bench runs one 8-token prompt, so
# its time is the load's.
echo '[[1, 2, 3, 4, 5, 6, 7, 8]]' >"$work/ids-tiny.json"
evict() {
  limited 60 sync
  python3 - "$bench_model" <<'PY'
import glob, os, sys
for path in glob.glob(os.path.join(sys.argv[1], "*.safetensors")):
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
PY
}
: >"$details/load.jsonl"
evict
limited 120 python3 - "$bench_model" <<'PY' | tee -a "$details/load.jsonl"
import glob, json, os, sys, time
paths = glob.glob(os.path.join(sys.argv[1], "*.safetensors"))
start, total = time.perf_counter(), 0
for path in paths:
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(16 << 20):
            total += len(chunk)
seconds = time.perf_counter() - start
print(json.dumps({"load": "disk read, cold", "bytes": total, "seconds": round(seconds, 3), "gb_per_s": round(total / seconds / 1e9, 2)}))
PY
for run in cold-staged cold-pageable warm-staged warm-pageable; do
  upload=; [ "${run#*-}" = pageable ] && upload=pageable
  [ "${run%-*}" = cold ] && evict
  if HARVEST_CUDA_UPLOAD=$upload limited 120 "$harvester" bench --device "$device" --precision bf16 \
      --model "$bench_model" --ids "$work/ids-tiny.json" --layers all --batch-tokens 8 \
      >"$work/load.json"; then
    python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); print(json.dumps({"load": sys.argv[2], "bytes": r.get("weight_bytes_bf16"), "seconds": r.get("load_seconds"), "gb_per_s": r.get("load_gb_per_s"), "phases": r.get("cuda_load")}))' \
      "$work/load.json" "$run" | tee -a "$details/load.jsonl"
  else
    note "load $run: the bench FAILED"
    failures=$((failures + 1))
  fi
done

fi

if [ "$device" != cpu ] && wanted block405; then
step "one block of a 405B-shaped model (16,384 wide, two blocks written): its time, for the 8-GPU prediction"
# docs/models.md predicts llama-405b's rate on 8 GPUs from one block's time at the bench's
# batch; two blocks (about 17 GB with the embedding) fit any window's GPU and disk.
big=$work/llama-405b-2
python3 -c 'import json, random; random.seed(7); json.dump([[random.randrange(1, 40000) for _ in range(512)] for _ in range(16)], open("'"$work"'/ids-405b.json", "w"))'
if limited 150 "$harvester" synth-model --shape llama-405b --blocks 2 --out "$big" >/dev/null \
  && limited 120 "$harvester" bench --device "$device" --precision bf16 --model "$big" \
    --ids "$work/ids-405b.json" --layers 1 --batch-tokens 8192 >"$work/block405.json"; then
  sed 's/^{/{"shape":"llama-405b-2-blocks",/' "$work/block405.json" | tee -a "$details/bench.jsonl"
  block=$(python3 - "$work/block405.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{r['tokens_per_s']:.0f} tok/s over 2 blocks, {r['seconds'] / 2 / r['tokens'] * 1e6:.1f} ms a block per 1,000 tokens, {r['gflops'] / 1000:.0f} TFLOP/s")
PY
)
  note "llama-405b, 2 blocks of 16,384 wide, 16 x 512 tokens: $block"
else
  note "llama-405b, 2 blocks: FAILED"
  failures=$((failures + 1))
fi
rm -rf "$big"
fi

if wanted afmoe; then
step "AFMoE large enough to time (synth-model --shape afmoe): $device beside transformers on the same token ids"
# 5.5 GB in bf16 on a GPU, all 8 blocks; on the CPU (CI) the first 3 (two dense, one routed)
# and a few short prompts in the f32 mode (the CPU's only one for AFMoE), which checks the
# step, not the speed.
moe=$work/afmoe
if [ "$device" = cpu ]; then
  moe_cut=(--blocks 3); moe_ids=(2 64); moe_precision=f32
else
  moe_cut=(); moe_ids=(16 512); moe_precision=bf16
fi
python3 -c 'import json, random, sys; random.seed(11); n, length = map(int, sys.argv[2:]); json.dump([[random.randrange(1, 40000) for _ in range(length)] for _ in range(n)], open(sys.argv[1], "w"))' \
  "$work/ids-afmoe.json" "${moe_ids[@]}"
moe_shape="${moe_ids[0]}x${moe_ids[1]}-all-layers"
if limited 150 "$harvester" synth-model --shape afmoe "${moe_cut[@]}" --out "$moe" >/dev/null \
  && HARVEST_CUDA_AFMOE=try limited 150 "$harvester" bench --device "$device" \
    --precision "$moe_precision" --model "$moe" --ids "$work/ids-afmoe.json" --layers all --batch-tokens 8192 >"$work/afmoe.json"; then
  # Its figures and transformers' are in the summary's speed lines, under afmoe-$moe_shape.
  sed "s/^{/{\"shape\":\"afmoe-$moe_shape\",/" "$work/afmoe.json" | tee -a "$details/bench.jsonl"
  limited 180 python3 "$here/peer.py" speed --model "$moe" \
    --device "$([ "$device" = cpu ] && echo cpu || echo cuda)" --batch-tokens 8192 \
    --shape "afmoe-$moe_shape:$work/ids-afmoe.json:all:0" | tee "$work/afmoe-peer.jsonl" \
    | tee -a "$details/peer.jsonl"
  skipped=$(python3 -c 'import json, sys; print(*[json.loads(l)["skipped"] for l in open(sys.argv[1]) if "skipped" in l])' "$work/afmoe-peer.jsonl")
  [ -n "$skipped" ] && note "afmoe, transformers: skipped: $skipped"
else
  note "afmoe, $moe_shape: FAILED"
  failures=$((failures + 1))
fi
rm -rf "$moe"
fi

# ---------------------------------------------------------------------------------------------
step "summary"
touch "$details/bench.jsonl" "$details/peer.jsonl"
python3 - "$details/bench.jsonl" "$details/peer.jsonl" "$device" <<'PY' | tee -a "$summary"
import json, sys
H200_BF16_GFLOPS = 790_000.0  # bf16 products measured on this kind of machine
ours = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
peer = {r["shape"]: r for r in map(json.loads, (l for l in open(sys.argv[2]) if l.startswith("{")))
        if r.get("step") == "peer-speed"}
for r in ours:
    if r.get("failed"):
        print(f"speed {r['shape']}: ours FAILED"); continue
    p = peer.get(r["shape"])
    line = (f"speed {r['shape']}: ours {r['tokens_per_s']:.0f} tok/s ({r['gflops']/1000:.1f} TFLOP/s, "
            f"{100*r['fraction_of_gemm']:.1f}% of the {r['gemm_gflops']/1000:.0f} TFLOP/s GEMM measured here")
    if sys.argv[3] != "cpu":
        line += f", {100*r['gflops']/H200_BF16_GFLOPS:.1f}% of 790 TFLOP/s"
    line += ")"
    line += f"; transformers {p['tokens_per_s']:.0f} tok/s ({r['tokens_per_s']/p['tokens_per_s']:.2f}x)" if p else "; transformers: no figure"
    print(line)
    c = r.get("cuda_load") or {}
    print(f"load {r['shape']}: {r['weight_bytes_bf16']/1e9:.1f} GB in {r['load_seconds']:.1f} s = {r['load_gb_per_s']:.1f} GB/s"
          f" (read {r['load_read_seconds']:.1f} s, convert {c.get('convert_seconds', 0):.1f} s, upload {c.get('upload_seconds', 0):.1f} s,"
          f" kernels {c.get('kernels_seconds', 0):.2f} s as {c.get('kernel_code', '-')}; attention {c.get('attention_kernel', '-')})")
for l in open(sys.argv[2]):
    r = json.loads(l) if l.startswith("{") else {}
    if r.get("step") == "peer-load":
        print(f"load transformers: {r['seconds']:.1f} s = {r['gb_per_s']:.1f} GB/s")
PY
note "steps failed: $failures"
[ "$failures" = 0 ]
