#!/usr/bin/env python3
"""Forward-only vs end-to-end `harvester run` throughput on the same corpus, in one run, plus
(with --rss) peak memory of a 64-prompt job next to a 4,096-prompt job.

    python3 scripts/bench_pipeline.py [--prompts 128] [--words 80] [--layers 7,15,22] [--rss]

Forward-only is `harvester bench` (the capture calls alone). End to end is `harvester run` into a
local directory: tokenizing, forward, shard assembly, statistics, writing and the manifest,
timed on the wall clock minus its model-loading time. Uses only the Python standard library.
"""
import argparse
import json
import os
import pathlib
import random
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
CACHE = pathlib.Path(os.environ.get("HARVEST_CACHE", pathlib.Path.home() / ".cache" / "harvest"))
MODEL = CACHE / "models" / "smollm2-135m"
WORDS = ("the residual stream carries features across layers while attention heads move information "
         "between positions and the mlp writes new directions that probes and sparse autoencoders read").split()


def corpus(path, n, words, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(words))}) + "\n")


def harvester():
    subprocess.run(["cargo", "build", "--quiet", "--release", "-p", "harvester"], cwd=ROOT, check=True)
    return str(pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release" / "harvester")


def run_job(binary, prompts, out, layers, shard_size, batch_tokens, timed=False):
    cmd = [binary, "run", "--model", str(MODEL), "--prompts", str(prompts), "--out", str(out), "--layers", layers,
           "--shard-size", str(shard_size), "--batch-tokens", str(batch_tokens), "--progress", "off"]
    if timed:
        cmd = ["/usr/bin/time", "-v"] + cmd
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    result = json.loads((pathlib.Path(out) / "result.json").read_text())
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    return wall, result, int(rss.group(1)) // 1024 if rss else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--words", type=int, default=80)
    ap.add_argument("--layers", default="7,15,22")
    ap.add_argument("--shard-size", type=int, default=32)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--rss", action="store_true")
    args = ap.parse_args()
    binary = harvester()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        corpus(tmp / "corpus.jsonl", args.prompts, args.words)
        forward = json.loads(subprocess.run(
            [binary, "bench", "--model", str(MODEL), "--prompts", str(tmp / "corpus.jsonl"), "--layers", args.layers,
             "--batch-tokens", str(args.batch_tokens)], capture_output=True, text=True, check=True).stdout)
        wall, result, _ = run_job(binary, tmp / "corpus.jsonl", tmp / "out", args.layers, args.shard_size,
                                  args.batch_tokens)
        e2e = result["tokens"] / (wall - result["timings"]["load_s"])
        print(f"corpus: {args.prompts} prompts, {result['tokens']} tokens, layers {args.layers}, "
              f"shard_size {args.shard_size}, {args.batch_tokens} tokens per batch, {forward['threads']} threads")
        print(f"{'path':<44}{'tokens/s':>10}")
        print(f"{'forward only (harvester bench)':<44}{forward['tokens_per_s']:>10.1f}")
        print(f"{'end to end (harvester run, wall - load)':<44}{e2e:>10.1f}")
        print(f"end to end / forward only: {100 * e2e / forward['tokens_per_s']:.1f}%")
        t = result["timings"]
        print(f"run timings: load {t['load_s']:.2f}s forward {t['forward_s']:.2f}s save {t['save_s']:.2f}s "
              f"upload {t['upload_s']:.2f}s, wall {wall:.2f}s, {result['bytes_written'] / 1e6:.1f} MB written")
        if args.rss:
            rows = []
            for n in (64, 4096):
                corpus(tmp / f"rss{n}.jsonl", n, 12, seed=n)
                wall, result, rss = run_job(binary, tmp / f"rss{n}.jsonl", tmp / f"rss{n}", args.layers,
                                            args.shard_size, args.batch_tokens, timed=True)
                rows.append((n, result["tokens"], wall, rss))
            print(f"{'prompts':>8}{'tokens':>10}{'wall s':>10}{'peak RSS MiB':>14}")
            for n, tokens, wall, rss in rows:
                print(f"{n:>8}{tokens:>10}{wall:>10.1f}{rss:>14}")


if __name__ == "__main__":
    sys.exit(main())
