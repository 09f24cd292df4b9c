#!/usr/bin/env python3
"""CPU engine vs PyTorch, side by side, in one run on the same machine and corpus.

    python3 scripts/bench_cpu.py [--prompts 64] [--tokens 256] [--threads N] [--rounds 3]

All run SmolLM2-135M (the checkpoint imported by scripts/fetch-model.sh) over the same token ids
(seeded), through every block, with the same thread count and the same batch of tokens per
forward pass: ours with --precision f32 and bf16, PyTorch (transformers) in float32 and
bfloat16, running the base model (no LM head) with output_hidden_states, the closest equivalent
of capturing every layer. Prints the CPU's flags, tokens/s for each and the ratio to PyTorch
f32, and our achieved GFLOP/s against a plain f32 GEMM of our GEMM library and against the
machine's f32 FMA and bf16 dot ceilings (which `harvester bench` times on registers alone), all
measured in the same run. The engines run in turn, `--rounds` times, and every figure is the
median of its rounds, printed with their range: on a shared VM whose speed drifts by ±10% over
minutes, each engine then meets the same drifts.
Needs the pinned environment of scripts/reference/requirements.txt.

    python3 scripts/bench_cpu.py --afmoe [--prompts 16] [--tokens 256]

With llama-cpp-python importable (it is not in the pinned environment, as it compiles
llama.cpp for several minutes), llama.cpp runs too, on the very GGUF the checkpoint was
imported from (SmolLM2-135M-Instruct.Q4_1.gguf, so its weights are 4-bit and its kernels its
own): prompt processing of the same token ids, one prompt per decode, with every token's
embedding as output (pooling none). Build it without AMX, whose tiles this kind of VM does not
grant (a native build segfaults in its first decode):

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \\
      -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF \\
      -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" python -m pip install llama-cpp-python==0.3.36

`--skip-llama-cpp` leaves it out.

    python3 scripts/bench_cpu.py --afmoe [--prompts 16] [--tokens 256]

runs the same comparison on a bench-sized AFMoE (AfmoeForCausalLM) with seeded random bf16
weights, which transformers writes on first use under $HARVEST_CACHE/bench/: 8 blocks of width
1024 (2 dense), 32 experts with 4 routed per token plus one shared, a 128-token window in three
blocks of four. Ours runs in f32 only (AFMoE has no bf16 mode); transformers in both.
"""
import argparse
import json
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
CACHE = pathlib.Path(os.environ.get("HARVEST_CACHE", pathlib.Path.home() / ".cache" / "harvest"))
MODEL = CACHE / "models" / "smollm2-135m"
GGUF = CACHE / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
AFMOE = CACHE / "bench" / "afmoe-1024x8-e32k4"


def make_afmoe(path):
    """A seeded random AFMoE checkpoint written by transformers (once)."""
    if (path / "model.safetensors").exists():
        return
    import torch
    from transformers import AfmoeConfig, AfmoeForCausalLM
    torch.manual_seed(0)
    config = AfmoeConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512, num_hidden_layers=8,
        num_dense_layers=2, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=32,
        num_experts_per_tok=4, num_shared_experts=1, route_scale=2.0, global_attn_every_n_layers=4,
        sliding_window=128, mup_enabled=True, max_position_embeddings=4096,
    )
    model = AfmoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "router.gate" in name:
                p.normal_(0.0, 0.02)
    model.to(torch.bfloat16).save_pretrained(path)


def llama_cpp_engine(gguf, ids, threads):
    """llama.cpp's prompt processing of `ids`, one prompt per decode, every token's embedding
    output (pooling none): a function that times one pass in tokens per second, and the
    version, or (None, None) without llama-cpp-python."""
    try:
        import llama_cpp
        from llama_cpp import Llama
    except ImportError:
        return None, None
    longest = max(len(p) for p in ids)
    llm = Llama(model_path=str(gguf), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_NONE,
                n_ctx=longest, n_batch=longest, n_ubatch=longest, n_threads=threads, n_threads_batch=threads,
                verbose=False)

    def run(prompt):
        # What Llama.embed does per batch, on token ids instead of text.
        llm._batch.reset()
        llm._batch.add_sequence(prompt, 0, True)
        llm._ctx.kv_cache_clear()
        llm._ctx.decode(llm._batch)

    def timed():
        run(ids[0])
        start = time.perf_counter()
        for prompt in ids:
            run(prompt)
        return sum(len(p) for p in ids) / (time.perf_counter() - start)

    return timed, llama_cpp.__version__


def median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--layers", default="all")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of every engine in turn; each figure is the median of its rounds")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument("--afmoe", action="store_true", help="bench a random AFMoE instead of SmolLM2")
    args = ap.parse_args()
    model_dir = MODEL
    precisions = ("f32", "bf16")
    if args.afmoe:
        model_dir = AFMOE
        make_afmoe(model_dir)
        precisions = ("f32",)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]

    rng = random.Random(0)
    ids = [[rng.randrange(17, vocab) for _ in range(args.tokens)] for _ in range(args.prompts)]
    subprocess.run(["cargo", "build", "--quiet", "--release", "-p", "harvester"], cwd=ROOT, check=True)
    binary = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release" / "harvester"
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ids, f)

    # Every engine, as a function that times one pass over the corpus. Rounds run them in turn,
    # so that each engine meets the same drifts of a shared machine's speed.
    engines = {}
    for precision in precisions:
        def ours(precision=precision):
            return json.loads(subprocess.run(
                [str(binary), "--threads", str(args.threads), "bench", "--model", str(model_dir), "--ids", f.name,
                 "--layers", args.layers, "--batch-tokens", str(args.batch_tokens), "--precision", precision],
                check=True, capture_output=True, text=True).stdout)
        engines[f"harvest cpu ({precision})"] = ours
    if not args.skip_torch:
        import torch
        from transformers import AutoModel
        torch.set_num_threads(args.threads)
        per_batch = max(1, args.batch_tokens // args.tokens)
        batches = [torch.tensor(ids[i:i + per_batch]) for i in range(0, len(ids), per_batch)]
        for dtype in (torch.float32, torch.bfloat16):
            model = AutoModel.from_pretrained(model_dir, dtype=dtype).eval()

            def timed(model=model):
                with torch.inference_mode():
                    model(input_ids=batches[0], output_hidden_states=True, use_cache=False)
                    start = time.perf_counter()
                    for batch in batches:
                        model(input_ids=batch, output_hidden_states=True, use_cache=False)
                    return args.prompts * args.tokens / (time.perf_counter() - start)
            engines[f"torch {torch.__version__} ({str(dtype).split('.')[-1]})"] = timed
    if not args.afmoe and not args.skip_llama_cpp:
        timed, version = llama_cpp_engine(GGUF, ids, args.threads)
        if timed is None:
            print("llama.cpp: llama-cpp-python is not installed; see this script's docstring", file=sys.stderr)
        else:
            engines[f"llama.cpp {version} (Q4_1)"] = timed

    results = {name: [] for name in engines}
    for _ in range(max(1, args.rounds)):
        for name, timed in engines.items():
            results[name].append(timed())
    os.unlink(f.name)
    rates = {name: [r["tokens_per_s"] if isinstance(r, dict) else r for r in runs] for name, runs in results.items()}
    # Our figures beside the rate come from the round whose rate is the median (the lower
    # middle one for an even count), so that they belong to one process.
    ours = {}
    for precision in precisions:
        runs = sorted(results[f"harvest cpu ({precision})"], key=lambda r: r["tokens_per_s"])
        ours[precision] = dict(runs[(len(runs) - 1) // 2])
        fractions = [r["fraction_of_peak"] for r in runs if r.get("fraction_of_peak") is not None]
        ours[precision]["fraction_of_peak"] = median(fractions) if fractions else None
        ours[precision]["fractions_of_peak"] = fractions
    peers = {name: median(r) for name, r in rates.items() if not name.startswith("harvest")}

    flags = sorted({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"} & set(
        next(l for l in pathlib.Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags")).split()))
    used = ours["bf16"]["bf16_dot_instructions"] if "bf16" in ours else "-"
    level = next(iter(ours.values()))["cpu_level"] if ours else "-"
    print(f"cpu flags: {' '.join(flags)}; kernel level: {level}; vdpbf16ps used: {used}; model: {model_dir.name}")
    print(f"corpus: {args.prompts} prompts x {args.tokens} tokens, {args.threads} threads, "
          f"{args.batch_tokens} tokens per batch, layers={args.layers}, blocks run={ours['f32']['blocks']}")
    rounds = len(next(iter(rates.values())))
    print(f"{rounds} rounds of every engine in turn; each figure is the median of its rounds, "
          f"with the range of its rounds' tokens/s and its ratios to torch f32 in the same round")
    print(f"{'engine':<28}{'tokens/s':>12}{'GFLOP/s':>12}{'vs torch f32':>14}   range (tokens/s; vs torch f32)")
    base_name = next((k for k in peers if k.endswith("(float32)")), None)
    per_token = ours["f32"]["gflops"] / ours["f32"]["tokens_per_s"]
    for name, runs in rates.items():
        tps = median(runs)
        ratio, spread = "-", f"{min(runs):.1f}-{max(runs):.1f}"
        if base_name:
            ratio = f"{tps / median(rates[base_name]):.2f}x"
            paired = [r / b for r, b in zip(runs, rates[base_name])]
            spread += f"; {min(paired):.2f}-{max(paired):.2f}x"
        print(f"{name:<28}{tps:>12.1f}{tps * per_token:>12.1f}{ratio:>14}   {spread}")
    m, n, k = ours["f32"]["gemm_shape"]
    print(f"plain f32 GEMM [{m}x{k}]·[{k}x{n}] (our kernel, {ours['f32'].get('gemm_kernel')}, same run): {ours['f32']['gemm_gflops']:.1f} GFLOP/s (gemm crate {ours['f32'].get('gemm_crate_gflops') or 0:.1f}); "
          f"harvest f32 reaches {100 * ours['f32']['fraction_of_gemm']:.0f}% of it" + (
              f", bf16 {100 * ours['bf16']['gflops'] / ours['f32']['gemm_gflops']:.0f}%" if "bf16" in ours else ""))
    if "bf16" in ours and ours["bf16"].get("gemm_bf16_gflops"):
        kind = "vdpbf16ps" if ours["bf16"]["bf16_dot_instructions"] else "widened to f32"
        print(f"plain bf16 GEMM, same shape (our bf16 product, {kind}, same run): "
              f"{ours['bf16']['gemm_bf16_gflops']:.1f} GFLOP/s; harvest bf16 reaches "
              f"{100 * ours['bf16']['gflops'] / ours['bf16']['gemm_bf16_gflops']:.0f}% of it")
    peaks = [ours["f32"].get(name) for name in ("f32_fma_peak", "bf16_dot_peak")]
    print("ceilings (every thread, registers only, same run): " + "; ".join(
        f"{p['instruction']} {p['gflops']:.1f} GFLOP/s" for p in peaks if p))
    for precision in precisions:
        fraction = ours[precision].get("fraction_of_peak")
        if fraction is not None:
            ceiling = "bf16 dot" if precision == "bf16" and ours[precision]["bf16_dot_instructions"] else "f32 FMA"
            each = ", ".join(f"{100 * x:.0f}%" for x in ours[precision]["fractions_of_peak"])
            print(f"harvest {precision} reaches {100 * fraction:.0f}% of its own ceiling ({ceiling}; "
                  f"each round, against the ceiling its own process measured: {each})")
    if base_name and peaks[0]:
        print(f"torch f32 reaches {100 * peers[base_name] * per_token / peaks[0]['gflops']:.0f}% of the f32 FMA ceiling")

if __name__ == "__main__":
    sys.exit(main())
