#!/usr/bin/env python3
"""CPU engine vs PyTorch, side by side, in one run on the same machine and corpus.

    python3 scripts/bench_cpu.py [--prompts 64] [--tokens 256] [--threads N] [--rounds 3]

All run SmolLM2-135M (the checkpoint imported by scripts/fetch-model.sh) over the same token ids
(seeded), through every block, with the same thread count and the same batch of tokens per
forward pass: ours with --precision f32 and bf16 (and bf16 once more at the `amx` kernel level, on AMX tiles,
where the CPU runs it), PyTorch (transformers) in float32 and
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

    python3 scripts/bench_cpu.py --shape llama-8b [--blocks 4] [--prompts 8] [--tokens 256]

runs it on Llama 3 8B's shape (width 4,096, MLP 14,336, GQA 32/8, vocabulary 128,256), where
the weight products dominate, with seeded random bf16 weights (`harvester synth-model`, its
first --blocks blocks, written once under $HARVEST_CACHE/bench/), twice: keeping every layer and
keeping only the last block's (every block runs either way; PyTorch stops after it, as a
harvest does). With --memory (the default for this shape) each engine also runs the corpus
once more in a process of its own, and its peak resident memory is printed.
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


class _Stop(Exception):
    """Raised by the deepest kept block's hook: the blocks after it need not run."""


def stop_after(_module, _inputs, _output):
    """A forward hook on the deepest kept block: its output is the harvest's last."""
    raise _Stop


def torch_pass(model, batches, keep):
    """One pass of `model` over `batches` as a harvest takes it: every layer through
    output_hidden_states, or forward hooks on the kept blocks and a stop after the deepest."""
    import torch

    with torch.inference_mode():
        for batch in batches:
            if keep is None:
                model(input_ids=batch, output_hidden_states=True, use_cache=False)
                continue
            hook = model.layers[max(keep)].register_forward_hook(stop_after)
            try:
                model(input_ids=batch, use_cache=False)
            except _Stop:
                pass
            finally:
                hook.remove()


def torch_child(args):
    """`--torch-child DTYPE`: one pass in a process of its own, for its peak memory."""
    import torch
    from transformers import AutoModel

    torch.set_num_threads(args.threads)
    ids = json.loads(pathlib.Path(args.ids).read_text())
    dtype = getattr(torch, args.torch_child)
    model = AutoModel.from_pretrained(args.model, dtype=dtype).eval()
    torch_pass(model, torch_batches(ids, args.batch_tokens), keep_list(args.layers))
    return 0


def torch_batches(ids, batch_tokens):
    import torch

    per_batch = max(1, batch_tokens // len(ids[0]))
    return [torch.tensor(ids[i:i + per_batch]) for i in range(0, len(ids), per_batch)]


def keep_list(layers):
    """The kept layers as indices, or None for every layer."""
    return None if layers == "all" else [int(x) for x in layers.split(",")]


def peak_memory(command):
    """The peak resident memory of `command`, run to its end, in GiB."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"{command[0]} exited {process.returncode} in its memory pass: {' '.join(command)}")
    return usage.ru_maxrss / (1 << 20)


def memory_pass(command):
    """An engine's command for its memory pass: ours times the forward pass alone, since the
    GEMM rates it measures afterwards hold buffers of their own (1.5 GB on the 8B shape)."""
    return command + ["--forward-only"] if "bench" in command else command


def synth_llama_8b(binary, blocks):
    """Llama 3 8B's first `blocks` blocks with seeded random bf16 weights (written once)."""
    path = CACHE / "bench" / f"llama-8b-{blocks}-blocks"
    if not (path / "model.safetensors").exists():
        subprocess.run([str(binary), "synth-model", "--shape", "llama-8b", "--blocks", str(blocks),
                        "--out", str(path)], check=True, stdout=subprocess.DEVNULL)
    return path


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
    ap.add_argument("--shape", choices=("smollm2-135m", "llama-8b"), default="smollm2-135m",
                    help="llama-8b: Llama 3 8B's shape with random weights, its first --blocks blocks")
    ap.add_argument("--blocks", type=int, default=4, help="blocks of the llama-8b shape")
    ap.add_argument("--memory", action=argparse.BooleanOptionalAction, default=None,
                    help="also each engine's peak memory, in a pass of its own (default: on for llama-8b)")
    ap.add_argument("--torch-child", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torch_child:
        return torch_child(args)
    subprocess.run(["cargo", "build", "--quiet", "--release", "-p", "harvester"], cwd=ROOT, check=True)
    binary = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release" / "harvester"
    # Where the CPU runs the `amx` kernel level (which runs only where it is named), ours in
    # bf16 runs once more at it.
    report = json.loads(subprocess.run([str(binary), "cpu-info"], check=True, capture_output=True,
                                       text=True).stdout)
    amx = next(level for level in report["levels"] if level["level"] == "amx")
    args.amx = amx["runs"]
    if not args.amx:
        print(f"harvest cpu (bf16, amx): skipped, this CPU lacks {', '.join(amx['lacks'])}", file=sys.stderr)
    model_dir = MODEL
    precisions = ("f32", "bf16")
    layer_sets = [args.layers]
    if args.afmoe:
        model_dir = AFMOE
        make_afmoe(model_dir)
        precisions = ("f32",)
    elif args.shape == "llama-8b":
        if args.blocks < 1 or args.blocks > 32:
            raise SystemExit(f"--blocks {args.blocks}: llama-8b has 1 to 32 blocks")
        model_dir = synth_llama_8b(binary, args.blocks)
        layer_sets = ["all", str(args.blocks - 1)]
    memory = args.shape == "llama-8b" if args.memory is None else args.memory
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]

    rng = random.Random(0)
    ids = [[rng.randrange(17, vocab) for _ in range(args.tokens)] for _ in range(args.prompts)]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ids, f)
    # Before this process loads any model: Linux carries a process's peak memory into the
    # children it starts, so each engine's memory pass runs while this one is still small.
    peaks = {layers: {name: peak_memory(memory_pass(command)) for name, command in
                      commands(args, binary, model_dir, precisions, layers, f.name).items()}
             for layers in layer_sets} if memory else {}
    torch_models = {}
    if not args.skip_torch:
        import torch
        from transformers import AutoModel
        torch.set_num_threads(args.threads)
        for dtype in (torch.float32, torch.bfloat16):
            torch_models[dtype] = AutoModel.from_pretrained(model_dir, dtype=dtype).eval()
    for index, layers in enumerate(layer_sets):
        if index:
            print()
        table(args, binary, model_dir, precisions, layers, ids, f.name, torch_models, peaks.get(layers, {}))
    os.unlink(f.name)


def torch_name(dtype):
    """An engine's name for PyTorch in `dtype` (float32 or bfloat16)."""
    from importlib.metadata import version
    return f"torch {version('torch')} ({dtype})"


def commands(args, binary, model_dir, precisions, layers, ids_file):
    """Each engine's command for one pass over the corpus keeping `layers`, by engine name."""
    commands = {}
    for precision in precisions:
        commands[f"harvest cpu ({precision})"] = [
            str(binary), "--threads", str(args.threads), "bench", "--model", str(model_dir), "--ids", ids_file,
            "--layers", layers, "--batch-tokens", str(args.batch_tokens), "--precision", precision]
    if args.amx and "bf16" in precisions:
        commands["harvest cpu (bf16, amx)"] = ["env", "HARVEST_CPU_LEVEL=amx"] + commands["harvest cpu (bf16)"]
    if not args.skip_torch:
        for dtype in ("float32", "bfloat16"):
            commands[torch_name(dtype)] = [
                sys.executable, __file__, "--torch-child", dtype, "--model", str(model_dir), "--ids", ids_file,
                "--layers", layers, "--batch-tokens", str(args.batch_tokens), "--threads", str(args.threads)]
    return commands


def table(args, binary, model_dir, precisions, layers, ids, ids_file, torch_models, peaks_gib):
    """Times every engine over the corpus keeping `layers`, in rounds, and prints the table
    (with each engine's peak memory, where `peaks_gib` has it)."""

    # Every engine, as a function that times one pass over the corpus. Rounds run them in turn,
    # so that each engine meets the same drifts of a shared machine's speed.
    engines = {}
    for name, command in commands(args, binary, model_dir, precisions, layers, ids_file).items():
        if name.startswith("harvest"):
            def ours(command=command):
                return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
            engines[name] = ours
    if torch_models:
        import torch
        batches = torch_batches(ids, args.batch_tokens)
        keep = keep_list(layers)
        for dtype, model in torch_models.items():
            def timed(model=model):
                torch_pass(model, batches[:1], keep)
                start = time.perf_counter()
                torch_pass(model, batches, keep)
                return args.prompts * args.tokens / (time.perf_counter() - start)
            engines[torch_name(str(dtype).split('.')[-1])] = timed
    if not args.afmoe and args.shape == "smollm2-135m" and not args.skip_llama_cpp:
        timed, version = llama_cpp_engine(GGUF, ids, args.threads)
        if timed is None:
            print("llama.cpp: llama-cpp-python is not installed; see this script's docstring", file=sys.stderr)
        else:
            engines[f"llama.cpp {version} (Q4_1)"] = timed

    results = {name: [] for name in engines}
    for _ in range(max(1, args.rounds)):
        for name, timed in engines.items():
            results[name].append(timed())
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
          f"{args.batch_tokens} tokens per batch, layers={layers}, blocks run={ours['f32']['blocks']}")
    rounds = len(next(iter(rates.values())))
    print(f"{rounds} rounds of every engine in turn; each figure is the median of its rounds, "
          f"with the range of its rounds' tokens/s and its ratios to torch f32 in the same round")
    memory_header = f"{'peak GiB':>10}" if peaks_gib else ""
    print(f"{'engine':<28}{'tokens/s':>12}{'GFLOP/s':>12}{'vs torch f32':>14}{memory_header}"
          f"   range (tokens/s; vs torch f32)")
    base_name = next((k for k in peers if k.endswith("(float32)")), None)
    per_token = ours["f32"]["gflops"] / ours["f32"]["tokens_per_s"]
    for name, runs in rates.items():
        tps = median(runs)
        ratio, spread = "-", f"{min(runs):.1f}-{max(runs):.1f}"
        if base_name:
            ratio = f"{tps / median(rates[base_name]):.2f}x"
            paired = [r / b for r, b in zip(runs, rates[base_name])]
            spread += f"; {min(paired):.2f}-{max(paired):.2f}x"
        peak = f"{peaks_gib[name]:>10.2f}" if name in peaks_gib else (f"{'-':>10}" if peaks_gib else "")
        print(f"{name:<28}{tps:>12.1f}{tps * per_token:>12.1f}{ratio:>14}{peak}   {spread}")
    m, n, k = ours["f32"]["gemm_shape"]
    print(f"plain f32 GEMM [{m}x{k}]·[{k}x{n}] (our kernel, {ours['f32'].get('gemm_kernel')}, same run): {ours['f32']['gemm_gflops']:.1f} GFLOP/s (gemm crate {ours['f32'].get('gemm_crate_gflops') or 0:.1f}); "
          f"harvest f32 reaches {100 * ours['f32']['fraction_of_gemm']:.0f}% of it" + (
              f", bf16 {100 * ours['bf16']['gflops'] / ours['f32']['gemm_gflops']:.0f}%" if "bf16" in ours else ""))
    if "bf16" in ours and ours["bf16"].get("gemm_bf16_gflops"):
        kind = ("vdpbf16ps, the weight packed at load" if ours["bf16"]["bf16_dot_instructions"]
                else "widened to f32")
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
