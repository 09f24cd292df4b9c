#!/usr/bin/env python3
"""The shuffled layout against the by-prompt layout, side by side, in one run on one machine.

    python3 scripts/bench_layout.py [--prompts 256] [--words 120] [--layers 7,15,22] [--sites resid_post]

Runs `harvester run` (release) twice over the same corpus with SmolLM2-135M (imported by
scripts/fetch-model.sh): once with --layout by_prompt, once with --layout shuffled, each from
an empty output directory, alternating the order over --rounds rounds. Prints the CPU's
flags, each layout's wall seconds, its rows and bytes, and shuffled / by_prompt.
"""
import argparse
import json
import os
import pathlib
import shutil
import subprocess
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
CACHE = pathlib.Path(os.environ.get("HARVEST_CACHE", pathlib.Path.home() / ".cache" / "harvest"))
MODEL = CACHE / "models" / "smollm2-135m"


def cpu_flags():
    wanted = {"avx2", "fma", "avx512f", "avx512_bf16"}
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return sorted(wanted & set(line.split(":", 1)[1].split()))
    return []


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--words", type=int, default=120)
    ap.add_argument("--layers", default="7,15,22")
    ap.add_argument("--sites", default="resid_post")
    ap.add_argument("--rows-per-file", type=int, default=65536)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    subprocess.run(["cargo", "build", "--quiet", "--release", "-p", "harvester"], cwd=ROOT, check=True)
    binary = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release" / "harvester"
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-layout-"))
    prompts = work / "prompts.jsonl"
    words = "the residual stream carries features from block to block".split()
    with prompts.open("w") as f:
        for i in range(args.prompts):
            text = " ".join(words[(i + j) % len(words)] for j in range(args.words))
            f.write(json.dumps({"text": f"Prompt {i}: {text}"}) + "\n")

    times = {"by_prompt": [], "shuffled": []}
    results = {}
    for round_ in range(args.rounds):
        order = ["by_prompt", "shuffled"] if round_ % 2 == 0 else ["shuffled", "by_prompt"]
        for layout in order:
            out = work / layout
            shutil.rmtree(out, ignore_errors=True)
            command = [str(binary), "run", "--model", str(MODEL), "--prompts", str(prompts), "--out", str(out),
                       "--layers", args.layers, "--sites", args.sites, "--layout", layout, "--progress", "off"]
            if layout == "shuffled":
                command += ["--rows-per-file", str(args.rows_per_file), "--seed", "0"]
            start = time.perf_counter()
            done = subprocess.run(command, check=True, capture_output=True, text=True)
            times[layout].append(time.perf_counter() - start)
            results[layout] = json.loads(done.stdout)
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"cpu_flags": cpu_flags(), "threads": os.cpu_count()}))
    for layout in ("by_prompt", "shuffled"):
        r = results[layout]
        print(f"{layout:<10} wall {min(times[layout]):7.2f} s (best of {args.rounds})  tokens {r['tokens']}  "
              f"files {r['n_shards']}  bytes {r['bytes_written']}  forward {r['timings']['forward_s']:.2f} s")
    print(f"shuffled / by_prompt = {min(times['shuffled']) / min(times['by_prompt']):.3f}")


if __name__ == "__main__":
    main()
