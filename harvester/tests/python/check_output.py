#!/usr/bin/env python3
"""Reads a harvest's output back the way researchers do, with Python's safetensors and numpy,
and checks it against docs/format.md.

    python3 check_output.py OUTPUT_DIR MODEL_DIR PROMPTS_JSONL

Checks: every shard's sha256 and size against the manifest; each shard holds exactly prompt_i
and tokens_i for its prompts, with the documented dtypes and shapes; tokens_i equals what the
model's tokenizer gives for the prompt; stats.safetensors and mean_token_norm match statistics
recomputed from the shards (bf16, so within bf16 tolerance), leaving out each leading BOS.
"""
import hashlib
import json
import pathlib
import sys

import numpy as np
from safetensors import safe_open
from tokenizers import Tokenizer


def bf16_tensors(path):
    """safetensors' numpy loader has no bfloat16; decode those tensors from the raw layout."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__" or info["dtype"] != "BF16":
            continue
        start, end = info["data_offsets"]
        bits = np.frombuffer(raw[8 + n + start:8 + n + end], dtype="<u2").astype(np.uint32) << 16
        out[name] = bits.view(np.float32).reshape(info["shape"])
    return out


def main(out_dir, model_dir, prompts_path):
    out_dir, model_dir = pathlib.Path(out_dir), pathlib.Path(model_dir)
    manifest = json.loads((out_dir / "manifest.json").read_text())
    prompts = [json.loads(line)["text"] for line in pathlib.Path(prompts_path).read_text().splitlines() if line.strip()]
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    special = manifest["tokenizer"]["add_special_tokens"]
    bos = manifest["tokenizer"]["bos_token_id"]
    n_layers = len(manifest["layer_indices"])
    assert manifest["contents"] == "activations" and manifest["dtype"] == "bfloat16", manifest["contents"]
    assert manifest["n_prompts"] == len(prompts)

    rows = [[] for _ in range(n_layers)]
    seen = 0
    for entry in manifest["shards"]:
        path = out_dir / entry["file"]
        data = path.read_bytes()
        assert len(data) == entry["bytes"], entry["file"]
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], entry["file"]
        first, counts = entry["first_prompt"], entry["token_counts"]
        assert first == seen, (first, seen)
        expected_keys = {f"{kind}_{first + k}" for k in range(len(counts)) for kind in ("prompt", "tokens")}
        values = bf16_tensors(path)
        with safe_open(str(path), framework="numpy") as f:
            assert set(f.keys()) == expected_keys, (entry["file"], sorted(f.keys()))
            for k, count in enumerate(counts):
                i = first + k
                tokens = f.get_tensor(f"tokens_{i}")
                assert tokens.dtype == np.int32 and tokens.shape == (count,), (i, tokens.dtype, tokens.shape)
                ids = tokenizer.encode(prompts[i], add_special_tokens=special).ids
                assert tokens.tolist() == ids, f"tokens_{i} differs from the tokenizer"
                x = values[f"prompt_{i}"]
                assert x.shape == (n_layers, count, manifest["model"]["hidden_size"]), (i, x.shape)
                skip = 1 if bos is not None and ids[0] == bos else 0
                for layer in range(n_layers):
                    rows[layer].append(x[layer, skip:].astype(np.float64))
        seen += len(counts)
    assert seen == len(prompts)

    with safe_open(str(out_dir / "stats.safetensors"), framework="numpy") as f:
        mean, std, count = f.get_tensor("mean"), f.get_tensor("std"), f.get_tensor("count")
    assert mean.shape == std.shape == (n_layers, manifest["model"]["hidden_size"])
    for layer in range(n_layers):
        x = np.concatenate(rows[layer])
        assert count[0] == x.shape[0] == manifest["stats_tokens"], (count, x.shape)
        scale = x.std(axis=0) + np.abs(x.mean(axis=0)) + 1e-3
        assert np.all(np.abs(x.mean(axis=0) - mean[layer]) <= 1e-2 * scale), f"mean of layer {layer}"
        assert np.all(np.abs(x.std(axis=0) - std[layer]) <= 1e-2 * scale), f"std of layer {layer}"
        norm = np.linalg.norm(x, axis=1).mean()
        assert abs(norm - manifest["mean_token_norm"][layer]) <= 1e-2 * norm, f"mean_token_norm of layer {layer}"
    print(f"python check: ok ({len(manifest['shards'])} shards, {seen} prompts, {n_layers} layers)")


if __name__ == "__main__":
    main(*sys.argv[1:])
