#!/usr/bin/env python3
"""Writes the Hugging Face reference fixtures that the harvester's parity tests compare against.

Run after `scripts/fetch-model.sh` (which imports SmolLM2 into the cache):

    python3 scripts/reference/make_fixtures.py

It writes, under harvester/tests/fixtures/:
  smollm2_reference.safetensors  residuals of the imported SmolLM2 checkpoint, computed by
                                 transformers in float64 with hooks on the raw block outputs
                                 (before the final norm), plus token ids for both
                                 add_special_tokens values from the tokenizer that transformers
                                 builds from the GGUF itself;
  smollm2_gguf_weights.json      sha256 of every weight as transformers' own GGUF loader
                                 dequantises it, rounded to bf16, so a wrong import is caught;
  tiny-*/                        tiny random-weight checkpoints for features SmolLM2 lacks
                                 (llama3 RoPE scaling, f16 and sharded weights, a BOS-adding
                                 tokenizer, Qwen2 QKV bias, Mistral's sliding window), each with
                                 its own reference.safetensors.

Every reference holds, per prompt p, residual_p (the block outputs, resid_post) and the other hook
sites as {site}_p: resid_pre (the block's input), attn_out (self_attn's output, after o_proj),
resid_mid (the input of post_attention_layernorm) and mlp_out (the mlp's output), each
[layers, tokens, hidden], from float64 hooks on those modules.

    python3 scripts/reference/make_fixtures.py --sites-only

adds the site tensors to the existing references from the committed checkpoints, leaving
everything else as it is.

    python3 scripts/reference/make_fixtures.py --router-only

adds transformers' own router outputs to tiny-afmoe-bf16/reference.safetensors, from the
committed checkpoint, leaving everything else as it is: per prompt p, router_ids_p (int32),
router_weights_p and router_logits_p (float32), [sparse kept layers, tokens, k or experts], as
AfmoeTokenChoiceRouter returns them (torch.topk's order: highest score plus bias first). The
metadata records the sparse kept layers and the smallest gap between adjacent keys, so the test
knows how decisive each choice and each rank is.

    python3 scripts/reference/make_fixtures.py --afmoe-only

writes tiny-afmoe-bf16/ alone: an AfmoeForCausalLM with dense and sparse blocks, a non-zero
expert_bias, a route_scale, shared experts, muP embedding scaling, sliding (RoPE) and full
(no RoPE) blocks and a window shorter than the prompts. Its sites are the branch outputs as the
residual stream receives them: attn_out is post_attention_layernorm's output, resid_mid the input
of pre_mlp_layernorm, mlp_out post_mlp_layernorm's output. Every routing choice is checked to
win by at least ROUTING_MARGIN, so float32 rounding cannot flip one.
"""
import hashlib
import json
import os
import pathlib
import sys

import numpy as np
import torch
from safetensors.numpy import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "harvester" / "tests" / "fixtures"
CACHE = pathlib.Path(os.environ.get("HARVEST_CACHE", pathlib.Path.home() / ".cache" / "harvest"))
GGUF_DIR = CACHE / "models"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
IMPORTED = GGUF_DIR / "smollm2-135m"

# A small context limit for the truncation case; the Rust test applies the same limit.
TRUNCATE_AT = 48
SMOLLM2_LAYERS = [0, 1, 7, 15, 22, 29]

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé: naïve café, 東京タワー, emoji 🦀🚀 and Ελληνικά.",
    "spaces    and\ttabs\n\n\nnewlines   end   ",
    "Digits 0123456789, 3.14159 and 1,000,000 plus 2026-11-30.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "<|im_start|>user\nWhat is a residual stream?<|im_end|>\n<|im_start|>assistant\n",
    "Hi",
    " ".join(f"word{i}" for i in range(40)) + " and a long tail that must be cut at the limit.",
]

torch.manual_seed(0)


OTHER_SITES = ["resid_pre", "attn_out", "resid_mid", "mlp_out"]


def first(value):
    return value[0] if isinstance(value, tuple) else value


def sites(model, ids, layers):
    """Every hook site of the given decoder blocks for one prompt: {site: [layers, tokens, hidden]}
    float64, resid_post being the raw block output (before the final norm)."""
    captured = {}

    def keep(site, k, value):
        captured[(site, k)] = first(value)[0].double().numpy().copy()

    hooks = []
    for k in layers:
        block = model.model.layers[k]
        hooks += [
            block.register_forward_pre_hook(
                lambda _m, args, kwargs, k=k: keep("resid_pre", k, args[0] if args else kwargs["hidden_states"]),
                with_kwargs=True,
            ),
            block.self_attn.register_forward_hook(lambda _m, _i, out, k=k: keep("attn_out", k, out)),
            block.post_attention_layernorm.register_forward_pre_hook(
                lambda _m, args, k=k: keep("resid_mid", k, args[0])
            ),
            block.mlp.register_forward_hook(lambda _m, _i, out, k=k: keep("mlp_out", k, out)),
            block.register_forward_hook(lambda _m, _i, out, k=k: keep("resid_post", k, out)),
        ]
    with torch.no_grad():
        model.model(input_ids=torch.tensor([ids]), use_cache=False)
    for h in hooks:
        h.remove()
    return {site: np.stack([captured[(site, k)] for k in layers]) for site in OTHER_SITES + ["resid_post"]}


def prompt_tensors(model, p, ids, layers):
    """residual_p and {site}_p of one prompt, float32 as the fixtures store them."""
    found = sites(model, ids, layers)
    tensors = {f"residual_{p}": found["resid_post"].astype(np.float32)}
    tensors.update({f"{site}_{p}": found[site].astype(np.float32) for site in OTHER_SITES})
    return tensors


def smollm2():
    print("SmolLM2: tokenizer and weights from transformers' GGUF loader", file=sys.stderr)
    gguf_tok = AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME)
    ours_tok = AutoTokenizer.from_pretrained(IMPORTED)
    gguf_model = AutoModelForCausalLM.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME, dtype=torch.float32)
    hashes = {}
    for name, tensor in gguf_model.state_dict().items():
        if name == "lm_head.weight" and gguf_model.config.tie_word_embeddings:
            continue
        raw = tensor.contiguous().to(torch.bfloat16).view(torch.int16).numpy().tobytes()
        hashes[name] = {"sha256": hashlib.sha256(raw).hexdigest(), "shape": list(tensor.shape)}
    (FIXTURES / "smollm2_gguf_weights.json").write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")
    del gguf_model

    print("SmolLM2: float64 residuals of the imported checkpoint", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(IMPORTED, dtype=torch.float64, attn_implementation="eager")
    model.eval()
    tensors = {}
    for p, text in enumerate(PROMPTS):
        for special, tag in ((True, "special"), (False, "plain")):
            ids = gguf_tok(text, add_special_tokens=special)["input_ids"]
            assert ours_tok(text, add_special_tokens=special)["input_ids"] == ids, (p, special)
            tensors[f"ids_{p}_{tag}"] = np.array(ids, dtype=np.int32)
        ids = tensors[f"ids_{p}_special"].tolist()[:TRUNCATE_AT]
        tensors.update(prompt_tensors(model, p, ids, SMOLLM2_LAYERS))
    meta = {"prompts": json.dumps(PROMPTS), "layers": json.dumps(SMOLLM2_LAYERS), "truncate_at": str(TRUNCATE_AT)}
    save_file(tensors, FIXTURES / "smollm2_reference.safetensors", metadata=meta)


def tiny_tokenizer(out_dir, add_bos):
    """A small byte-level BPE tokenizer trained on a fixed text, optionally adding BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([" ".join(PROMPTS)] * 4, trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out_dir)
    return fast


def tiny(name, config_cls, model_cls, config_kwargs, dtype, shard, add_bos, layers):
    print(f"tiny model {name}", file=sys.stderr)
    out_dir = FIXTURES / name
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = tiny_tokenizer(out_dir, add_bos)
    config = config_cls(
        vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, **config_kwargs,
    )
    model = model_cls(config)
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1 so their weights matter
            p.add_(torch.randn_like(p) * 0.05)
    model = model.to(dtype)
    model.save_pretrained(out_dir, max_shard_size="100KB" if shard else "100MB", safe_serialization=True)
    ref = model.to(torch.float64)
    ref.config._attn_implementation = "eager"
    ref.eval()
    tensors = {}
    for p, text in enumerate(PROMPTS):
        for special, tag in ((True, "special"), (False, "plain")):
            tensors[f"ids_{p}_{tag}"] = np.array(tok(text, add_special_tokens=special)["input_ids"], dtype=np.int32)
        ids = tensors[f"ids_{p}_special"].tolist()[:TRUNCATE_AT]
        tensors.update(prompt_tensors(ref, p, ids, layers))
    meta = {"prompts": json.dumps(PROMPTS), "layers": json.dumps(layers), "truncate_at": str(TRUNCATE_AT)}
    save_file(tensors, out_dir / "reference.safetensors", metadata=meta)


def tiny_models():
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    llama3 = dict(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    tiny("tiny-llama3-f16-sharded", LlamaConfig, LlamaForCausalLM, llama3, torch.float16, True, True, [0, 1, 2])
    tiny("tiny-qwen2-f32", Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True), torch.float32, False,
         False, [0, 2])
    tiny("tiny-mistral-window-bf16", MistralConfig, MistralForCausalLM, dict(sliding_window=8, head_dim=16),
         torch.bfloat16, False, True, [1, 2])


def add_sites(reference, checkpoint, load_dtype):
    """Adds {site}_p to an existing reference from its checkpoint, after checking that the
    checkpoint still reproduces the stored residuals. `load_dtype` is the dtype the reference
    model went through before float64 (its buffers, RoPE's inverse frequencies among them,
    were rounded to it)."""
    from safetensors.numpy import load_file
    from safetensors import safe_open

    print(f"sites for {reference}", file=sys.stderr)
    with safe_open(reference, "np") as f:
        meta = f.metadata()
    tensors = load_file(reference)
    layers = json.loads(meta["layers"])
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=load_dtype, attn_implementation="eager")
    # Loading keeps the inverse frequencies in float32; the reference model had them cast too.
    model = model.to(load_dtype).to(torch.float64)
    model.config._attn_implementation = "eager"
    model.eval()
    for p in range(len(json.loads(meta["prompts"]))):
        ids = tensors[f"ids_{p}_special"].tolist()[: int(meta["truncate_at"])]
        found = prompt_tensors(model, p, ids, layers)
        # Every site comes from one pass, so residual_p is replaced too, once it is checked to be
        # the stored one within float64 noise (library versions move the last digits).
        old, new = tensors[f"residual_{p}"].astype(np.float64), found[f"residual_{p}"].astype(np.float64)
        per_token = np.linalg.norm(new - old, axis=-1) / np.linalg.norm(old, axis=-1)
        assert per_token.max() < 1e-4, (reference, p, per_token.max())
        tensors.update(found)
    save_file(tensors, reference, metadata=meta)


# The smallest gap allowed between a token's k-th and (k+1)-th expert key (score + bias): float32
# arithmetic moves the keys by about 1e-7, so a choice this decisive is made alike in both.
ROUTING_MARGIN = 1e-5


def afmoe_sites(model, ids, layers):
    """Like sites(), for AFMoE's sandwich norms; also returns the smallest routing margin."""
    captured, margins = {}, []
    k = model.config.num_experts_per_tok

    def keep(site, layer, value):
        captured[(site, layer)] = first(value)[0].double().numpy().copy()

    def margin(block):
        def hook(_m, args):
            x = args[0].reshape(-1, args[0].shape[-1])
            scores = torch.sigmoid(block.mlp.router.gate(x).double())
            keys = (scores + block.mlp.expert_bias.double()).sort(dim=-1, descending=True).values
            margins.append(float((keys[:, k - 1] - keys[:, k]).min()))
        return hook

    hooks = []
    for index, block in enumerate(model.model.layers):
        if index >= model.config.num_dense_layers:
            hooks.append(block.mlp.register_forward_pre_hook(margin(block)))
        if index not in layers:
            continue
        hooks += [
            block.register_forward_pre_hook(
                lambda _m, args, kwargs, k=index: keep("resid_pre", k, args[0] if args else kwargs["hidden_states"]),
                with_kwargs=True,
            ),
            block.post_attention_layernorm.register_forward_hook(lambda _m, _i, out, k=index: keep("attn_out", k, out)),
            block.pre_mlp_layernorm.register_forward_pre_hook(lambda _m, args, k=index: keep("resid_mid", k, args[0])),
            block.post_mlp_layernorm.register_forward_hook(lambda _m, _i, out, k=index: keep("mlp_out", k, out)),
            block.register_forward_hook(lambda _m, _i, out, k=index: keep("resid_post", k, out)),
        ]
    with torch.no_grad():
        model.model(input_ids=torch.tensor([ids]), use_cache=False)
    for h in hooks:
        h.remove()
    found = {site: np.stack([captured[(site, k)] for k in layers]) for site in OTHER_SITES + ["resid_post"]}
    return found, min(margins)


def tiny_afmoe():
    from transformers import AfmoeConfig, AfmoeForCausalLM

    name = "tiny-afmoe-bf16"
    print(f"tiny model {name}", file=sys.stderr)
    out_dir = FIXTURES / name
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = tiny_tokenizer(out_dir, True)
    layers = [0, 1, 3, 4]
    config = AfmoeConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=5,
        num_dense_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, num_shared_experts=1, route_scale=2.5, global_attn_every_n_layers=2,
        sliding_window=6, mup_enabled=True, max_position_embeddings=128, rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    model = AfmoeForCausalLM(config)
    with torch.no_grad():
        for name_, p in model.named_parameters():
            if "router.gate" in name_:
                p.normal_(0.0, 0.5)  # decisive routing: the keys spread over most of (0, 1)
            else:
                p.add_(torch.randn_like(p) * 0.05)  # norms away from 1 so their weights matter
        for layer in model.model.layers[config.num_dense_layers:]:
            layer.mlp.expert_bias.copy_(torch.randn(config.num_experts) * 0.1)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    # The reference is the saved checkpoint loaded in float64, as a user would load it.
    ref = AutoModelForCausalLM.from_pretrained(
        out_dir, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager"
    )
    ref.eval()
    tensors, worst_margin = {}, 1.0
    for p, text in enumerate(PROMPTS):
        for special, tag in ((True, "special"), (False, "plain")):
            tensors[f"ids_{p}_{tag}"] = np.array(tok(text, add_special_tokens=special)["input_ids"], dtype=np.int32)
        ids = tensors[f"ids_{p}_special"].tolist()[:TRUNCATE_AT]
        found, margin = afmoe_sites(ref, ids, layers)
        worst_margin = min(worst_margin, margin)
        tensors[f"residual_{p}"] = found["resid_post"].astype(np.float32)
        tensors.update({f"{site}_{p}": found[site].astype(np.float32) for site in OTHER_SITES})
    print(f"{name}: smallest routing margin {worst_margin:.3e}", file=sys.stderr)
    assert worst_margin > ROUTING_MARGIN, f"a routing choice is within {worst_margin:.1e}: pick another seed"
    meta = {"prompts": json.dumps(PROMPTS), "layers": json.dumps(layers), "truncate_at": str(TRUNCATE_AT),
            "routing_margin": f"{worst_margin:.3e}"}
    save_file(tensors, out_dir / "reference.safetensors", metadata=meta)


def router_only():
    """Adds transformers' router outputs to the committed AFMoE fixture's reference."""
    from safetensors.numpy import load_file
    from safetensors import safe_open

    out_dir = FIXTURES / "tiny-afmoe-bf16"
    reference = out_dir / "reference.safetensors"
    tensors = load_file(reference)
    with safe_open(reference, "np") as f:
        meta = dict(f.metadata())
    layers = json.loads(meta["layers"])
    model = AutoModelForCausalLM.from_pretrained(
        out_dir, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager"
    )
    model.eval()
    k = model.config.num_experts_per_tok
    sparse = [l for l in layers if l >= model.config.num_dense_layers]
    choice_gap, rank_gap = 1.0, 1.0
    for p in range(len(json.loads(meta["prompts"]))):
        ids = tensors[f"ids_{p}_special"].tolist()[: int(meta["truncate_at"])]
        found = {}
        hooks = []
        for index in sparse:
            block = model.model.layers[index]

            def keep(_m, args, out, index=index, block=block):
                logits, weights, chosen = out
                found[index] = (logits, weights, chosen)
                keys = (torch.sigmoid(logits.double()) + block.mlp.expert_bias.double()).sort(dim=-1, descending=True).values
                gaps.append((float((keys[:, k - 1] - keys[:, k]).min()), float((keys[:, :k - 1] - keys[:, 1:k]).min())))

            hooks.append(block.mlp.router.register_forward_hook(keep))
        gaps = []
        with torch.no_grad():
            model.model(input_ids=torch.tensor([ids]), use_cache=False)
        for h in hooks:
            h.remove()
        for gap_choice, gap_rank in gaps:
            choice_gap, rank_gap = min(choice_gap, gap_choice), min(rank_gap, gap_rank)
        tensors[f"router_ids_{p}"] = np.stack([found[l][2].numpy().astype(np.int32) for l in sparse])
        tensors[f"router_weights_{p}"] = np.stack([found[l][1].float().numpy() for l in sparse])
        tensors[f"router_logits_{p}"] = np.stack([found[l][0].float().numpy() for l in sparse])
    print(f"router: layers {sparse}, smallest choice gap {choice_gap:.3e}, rank gap {rank_gap:.3e}", file=sys.stderr)
    meta.update({"router_layers": json.dumps(sparse), "router_choice_gap": f"{choice_gap:.3e}",
                 "router_rank_gap": f"{rank_gap:.3e}"})
    save_file(tensors, reference, metadata=meta)


def sites_only():
    tiny = {"tiny-llama3-f16-sharded": torch.float16, "tiny-qwen2-f32": torch.float32,
            "tiny-mistral-window-bf16": torch.bfloat16}
    for name, dtype in tiny.items():
        add_sites(FIXTURES / name / "reference.safetensors", FIXTURES / name, dtype)
    add_sites(FIXTURES / "smollm2_reference.safetensors", IMPORTED, torch.float64)


if __name__ == "__main__":
    FIXTURES.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(os.cpu_count() or 1)
    if sys.argv[1:] == ["--router-only"]:
        router_only()
        sys.exit(0)
    if sys.argv[1:] == ["--afmoe-only"]:
        tiny_afmoe()
        sys.exit(0)
    if sys.argv[1:] == ["--sites-only"]:
        sites_only()
        print("site references added under", FIXTURES, file=sys.stderr)
        sys.exit(0)
    tiny_models()
    tiny_afmoe()
    smollm2()
    print("fixtures written to", FIXTURES, file=sys.stderr)
