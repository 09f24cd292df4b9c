#!/usr/bin/env python3
"""CPU engine vs PyTorch, side by side, in one run on the same machine and corpus.

    python3 scripts/bench_cpu.py [--prompts 64] [--tokens 256] [--threads N]

All run SmolLM2-135M (the checkpoint imported by scripts/fetch-model.sh) over the same token ids
(seeded), through every block, with the same thread count and the same batch of tokens per
forward pass: ours with --precision f32 and bf16, PyTorch (transformers) in float32 and
bfloat16, running the base model (no LM head) with output_hidden_states, the closest equivalent
of capturing every layer. Prints the CPU's flags, tokens/s for each and the ratio to PyTorch
f32, and our achieved GFLOP/s against a plain f32 GEMM of our GEMM library measured in the same
run.
Needs the pinned environment of scripts/reference/requirements.txt.
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--layers", default="all")
    ap.add_argument("--skip-torch", action="store_true")
    args = ap.parse_args()

    rng = random.Random(0)
    ids = [[rng.randrange(17, 49152) for _ in range(args.tokens)] for _ in range(args.prompts)]
    subprocess.run(["cargo", "build", "--quiet", "--release", "-p", "harvester"], cwd=ROOT, check=True)
    binary = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release" / "harvester"
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ids, f)
    ours = {}
    for precision in ("f32", "bf16"):
        ours[precision] = json.loads(subprocess.run(
            [str(binary), "--threads", str(args.threads), "bench", "--model", str(MODEL), "--ids", f.name,
             "--layers", args.layers, "--batch-tokens", str(args.batch_tokens), "--precision", precision],
            check=True, capture_output=True, text=True).stdout)
    os.unlink(f.name)

    peers = {}
    if not args.skip_torch:
        import torch
        from transformers import AutoModel
        torch.set_num_threads(args.threads)
        per_batch = max(1, args.batch_tokens // args.tokens)
        batches = [torch.tensor(ids[i:i + per_batch]) for i in range(0, len(ids), per_batch)]
        for dtype in (torch.float32, torch.bfloat16):
            model = AutoModel.from_pretrained(MODEL, dtype=dtype).eval()
            with torch.inference_mode():
                model(input_ids=batches[0], output_hidden_states=True, use_cache=False)
                start = time.perf_counter()
                for batch in batches:
                    model(input_ids=batch, output_hidden_states=True, use_cache=False)
                seconds = time.perf_counter() - start
            peers[f"torch {torch.__version__} ({str(dtype).split('.')[-1]})"] = args.prompts * args.tokens / seconds
            del model

    flags = sorted({"avx2", "fma", "avx512f", "avx512_bf16"} & set(
        next(l for l in pathlib.Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags")).split()))
    print(f"cpu flags: {' '.join(flags)}; vdpbf16ps used: {ours['bf16']['bf16_dot_instructions']}")
    print(f"corpus: {args.prompts} prompts x {args.tokens} tokens, {args.threads} threads, "
          f"{args.batch_tokens} tokens per batch, layers={args.layers}, blocks run={ours['f32']['blocks']}")
    print(f"{'engine':<28}{'tokens/s':>12}{'GFLOP/s':>12}{'vs torch f32':>14}")
    base = next((v for k, v in peers.items() if k.endswith("(float32)")), None)
    rows = [(f"harvest cpu ({p})", ours[p]["tokens_per_s"]) for p in ("f32", "bf16")] + list(peers.items())
    per_token = ours["f32"]["gflops"] / ours["f32"]["tokens_per_s"]
    for name, tps in rows:
        ratio = f"{tps / base:.2f}x" if base else "-"
        print(f"{name:<28}{tps:>12.1f}{tps * per_token:>12.1f}{ratio:>14}")
    m, n, k = ours["f32"]["gemm_shape"]
    print(f"plain f32 GEMM [{m}x{k}]·[{k}x{n}] (gemm crate, same run): {ours['f32']['gemm_gflops']:.1f} GFLOP/s; "
          f"harvest f32 reaches {100 * ours['f32']['fraction_of_gemm']:.0f}% of it, bf16 "
          f"{100 * ours['bf16']['gflops'] / ours['f32']['gemm_gflops']:.0f}%")


if __name__ == "__main__":
    sys.exit(main())
