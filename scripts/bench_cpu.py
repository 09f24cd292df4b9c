#!/usr/bin/env python3
"""CPU engine vs PyTorch, side by side, in one run on the same machine and corpus.

    python3 scripts/bench_cpu.py [--prompts 64] [--tokens 256] [--threads N]

Both run SmolLM2-135M (the checkpoint imported by scripts/fetch-model.sh) in f32 over the same
token ids (seeded), through every block, with the same thread count and the same batch of
tokens per forward pass. PyTorch runs the base model (no LM head) with output_hidden_states, the
closest equivalent of capturing every layer. Prints tokens/s for each and their ratio, and our
achieved GFLOP/s against a plain f32 GEMM of our GEMM library measured in the same run.
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
    ours = json.loads(subprocess.run(
        [str(binary), "--threads", str(args.threads), "bench", "--model", str(MODEL), "--ids", f.name,
         "--layers", args.layers, "--batch-tokens", str(args.batch_tokens)],
        check=True, capture_output=True, text=True).stdout)
    os.unlink(f.name)

    torch_tps = None
    if not args.skip_torch:
        import torch
        from transformers import AutoModel
        torch.set_num_threads(args.threads)
        model = AutoModel.from_pretrained(MODEL, dtype=torch.float32).eval()
        per_batch = max(1, args.batch_tokens // args.tokens)
        batches = [torch.tensor(ids[i:i + per_batch]) for i in range(0, len(ids), per_batch)]
        with torch.inference_mode():
            model(input_ids=batches[0], output_hidden_states=True, use_cache=False)
            start = time.perf_counter()
            for batch in batches:
                model(input_ids=batch, output_hidden_states=True, use_cache=False)
            torch_s = time.perf_counter() - start
        torch_tps = args.prompts * args.tokens / torch_s

    print(f"corpus: {args.prompts} prompts x {args.tokens} tokens, {args.threads} threads, "
          f"{args.batch_tokens} tokens per batch, layers={args.layers}, blocks run={ours['blocks']}")
    print(f"{'engine':<28}{'tokens/s':>12}{'GFLOP/s':>12}")
    print(f"{'harvest cpu (f32)':<28}{ours['tokens_per_s']:>12.1f}{ours['gflops']:>12.1f}")
    if torch_tps is not None:
        torch_gflops = ours["gflops"] * torch_tps / ours["tokens_per_s"]
        print(f"{'torch ' + torch.__version__ + ' (f32)':<28}{torch_tps:>12.1f}{torch_gflops:>12.1f}")
        print(f"ratio harvest/torch: {ours['tokens_per_s'] / torch_tps:.2f}x")
    m, n, k = ours["gemm_shape"]
    print(f"plain f32 GEMM [{m}x{k}]·[{k}x{n}] (gemm crate, same run): {ours['gemm_gflops']:.1f} GFLOP/s; "
          f"harvest reaches {100 * ours['fraction_of_gemm']:.0f}% of it")


if __name__ == "__main__":
    sys.exit(main())
