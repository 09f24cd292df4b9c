"""The GPU window's Hugging Face transformers side (scripts/gpu/run.sh runs it).

parity: the same random SmolLM2-shaped checkpoint in transformers, float32 on the device as the
    reference and bfloat16 as the peer's own error; each harvest given (ours on CUDA, ours on the
    CPU in bf16 mode) is compared with the float32 reference layer by layer, next to
    transformers' bf16 error. Per token row, the relative error is |a - ref| / |ref|.
speed: transformers' forward (SDPA attention, bf16) on the token ids the harvester's bench ran,
    in batches of the same tokens, the kept blocks' outputs taken by forward hooks, the pass
    stopped after the deepest, and the kept layers copied to the host as a harvest must.

Without torch (a CPU machine in CI) it prints that the peer is skipped and exits 0.
"""

import argparse
import glob
import json
import os
import sys
import time


def emit(record):
    print(json.dumps(record), flush=True)


def have_torch():
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        emit({"step": "peer", "skipped": f"torch or transformers is not installed here ({e})"})
        return False
    return True


def load_model(path, dtype, device):
    import torch
    from transformers import AutoModel

    try:
        model = AutoModel.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    except TypeError:
        model = AutoModel.from_pretrained(path, torch_dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


class _Stop(Exception):
    """Raised by the deepest kept block's hook: the blocks after it need not run."""


def harvest(model, input_ids, keep):
    """The residual stream after each block in `keep`, as a harvest takes it: forward hooks on
    the decoder blocks (the last one before the final norm), the pass stopped after the
    deepest kept block, as the harvester stops."""
    import torch

    captured = {}
    deepest = max(keep)
    hooks = []
    for index in keep:
        def hook(_module, _inputs, output, index=index):
            captured[index] = output[0] if isinstance(output, tuple) else output
            if index == deepest:
                raise _Stop
        hooks.append(model.layers[index].register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    except _Stop:
        pass
    finally:
        for h in hooks:
            h.remove()
    return [captured[i] for i in keep]


def read_harvest(directory):
    """{prompt index: (token ids, activations [layers, tokens, hidden] float32)}."""
    from safetensors.torch import load_file

    prompts = {}
    for shard in sorted(glob.glob(os.path.join(directory, "shard_*.safetensors"))):
        tensors = load_file(shard)
        for name, tensor in tensors.items():
            if name.startswith("prompt_"):
                i = int(name.split("_")[1])
                prompts[i] = (tensors[f"tokens_{i}"].long(), tensor.float())
    return prompts


def relative_errors(candidate, reference):
    """Per token row |a - ref| / |ref|, for one layer [tokens, hidden]."""
    import torch

    diff = (candidate.float() - reference.float()).norm(dim=-1)
    return diff / reference.float().norm(dim=-1).clamp_min(1e-30)


def parity(args):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = args.device
    harvests = {name: read_harvest(path) for name, path in args.harvest}
    first = next(iter(harvests.values()))
    layers = next(iter(first.values()))[1].shape[0]
    keep = list(range(layers))
    reference = load_model(args.model, torch.float32, device)
    peer = load_model(args.model, torch.bfloat16, device)
    emit({"step": "parity-config", "rope": str(getattr(reference.config, "rope_parameters", None)
                                                or getattr(reference.config, "rope_theta", None)),
          "layers": layers, "prompts": len(first)})
    errors = {name: [[] for _ in keep] for name in list(harvests) + ["transformers-bf16"]}
    for index, (tokens, _) in sorted(first.items()):
        ids = tokens.to(device)[None]
        ref = harvest(reference, ids, keep)
        bf = harvest(peer, ids, keep)
        for layer in keep:
            r = ref[layer][0]
            errors["transformers-bf16"][layer].append(relative_errors(bf[layer][0], r).cpu())
            for name, prompts in harvests.items():
                their_tokens, acts = prompts[index]
                if not torch.equal(their_tokens, tokens):
                    emit({"step": "parity", "error": f"{name}: prompt {index} has other token ids"})
                    return 1
                errors[name][layer].append(relative_errors(acts[layer].to(device), r).cpu())
    summary = {}
    for name, per_layer in errors.items():
        rows = []
        for layer, chunks in enumerate(per_layer):
            e = torch.cat(chunks)
            rows.append({"layer": layer, "median": float(e.median()), "max": float(e.max())})
        summary[name] = {
            "max": max(r["max"] for r in rows),
            "median_of_medians": sorted(r["median"] for r in rows)[len(rows) // 2],
        }
        for r in rows:
            emit({"step": "parity-layer", "engine": name, **r})
    emit({"step": "parity-summary", "reference": "transformers float32 on " + device,
          "engines": summary})
    return 0


def speed(args):
    import torch

    device = args.device
    start = time.perf_counter()
    model = load_model(args.model, torch.bfloat16, device)
    torch.cuda.synchronize() if device.startswith("cuda") else None
    load_seconds = time.perf_counter() - start
    parameters = sum(p.numel() for p in model.parameters())
    emit({"step": "peer-load", "seconds": load_seconds,
          "gb_per_s": 2 * parameters / load_seconds / 1e9})
    all_blocks = len(model.layers)
    for spec in args.shape:
        name, ids_path, layers, directions = spec.split(":")
        with open(ids_path) as f:
            prompts = json.load(f)
        keep = list(range(all_blocks)) if layers == "all" else [int(x) for x in layers.split(",")]
        blocks = max(keep) + 1
        length = len(prompts[0])
        per_batch = max(1, args.batch_tokens // length)
        batches = [torch.tensor(prompts[i:i + per_batch], device=device)
                   for i in range(0, len(prompts), per_batch)]
        units = None
        if int(directions):
            units = torch.nn.functional.normalize(
                torch.randn(int(directions), model.config.hidden_size, device=device), dim=-1)

        def one_pass():
            for batch in batches:
                kept = harvest(model, batch, keep)
                if units is not None:
                    kept = [h.float() @ units.T for h in kept]
                for h in kept:
                    h.to("cpu")

        one_pass()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        one_pass()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tokens = sum(len(p) for p in prompts)
        emit({"step": "peer-speed", "shape": name, "engine": "transformers-sdpa-bf16",
              "blocks": blocks, "layers": len(keep), "directions": int(directions),
              "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds})
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("parity")
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--harvest", nargs=2, action="append", metavar=("NAME", "DIR"), required=True)
    s = sub.add_parser("speed")
    s.add_argument("--model", required=True)
    s.add_argument("--device", default="cuda")
    s.add_argument("--batch-tokens", type=int, default=8192)
    s.add_argument("--shape", action="append", required=True,
                   help="NAME:IDS_JSON:LAYERS:DIRECTIONS")
    args = parser.parse_args()
    if not have_torch():
        return 0
    return parity(args) if args.command == "parity" else speed(args)


if __name__ == "__main__":
    sys.exit(main())
