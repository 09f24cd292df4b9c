"""A tiny random Llama with Llama 3.1 RoPE scaling, written twice: as a Hugging Face checkpoint
whose config.json carries the scaling parameters, and as a GGUF that carries them the way
llama.cpp's convert_hf_to_gguf.py does (a rope_freqs tensor, Q and K rows permuted), written
with gguf-py. For the importer's rope_freqs test (harvester/tests/gguf_import.rs).

    python tiny_llama3_gguf.py OUT_DIR

writes OUT_DIR/hf/{config.json,model.safetensors}, OUT_DIR/hf-unscaled/ (the same without the
scaling) and OUT_DIR/tiny.gguf."""

import json
import math
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFWriter
from safetensors.numpy import save_file

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 32, 48, 2, 2, 1, 64
HEAD_DIM = HIDDEN // HEADS
THETA, EPS, CONTEXT = 10000.0, 1e-5, 1024
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 256}


def rope_factors():
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors, in float32 as it computes."""
    freqs = 1.0 / (THETA ** (np.arange(0, HEAD_DIM, 2, dtype=np.float32) / HEAD_DIM))
    factor, low, high = SCALING["factor"], SCALING["low_freq_factor"], SCALING["high_freq_factor"]
    old = SCALING["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def permute(weights, n_head):
    """convert_hf_to_gguf.py's LlamaModel.permute (rotate-half to interleaved rows)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def main():
    out = Path(sys.argv[1])
    rng = np.random.default_rng(3)
    w = lambda *shape: (rng.standard_normal(shape) * 0.3).astype(np.float32)
    tensors = {"model.embed_tokens.weight": w(VOCAB, HIDDEN), "model.norm.weight": np.ones(HIDDEN, np.float32)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": 1 + w(HIDDEN) * 0.3,
            p + "post_attention_layernorm.weight": 1 + w(HIDDEN) * 0.3,
            p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": w(INTER, HIDDEN),
            p + "mlp.up_proj.weight": w(INTER, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, INTER),
        }
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "rms_norm_eps": EPS, "rope_theta": THETA,
              "max_position_embeddings": CONTEXT, "vocab_size": VOCAB, "tie_word_embeddings": True}
    for name, scaling in (("hf", SCALING), ("hf-unscaled", None)):
        (out / name).mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / name / "model.safetensors"))
        (out / name / "config.json").write_text(json.dumps({**config, "rope_scaling": scaling}))

    writer = GGUFWriter(str(out / "tiny.gguf"), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(THETA)
    writer.add_layer_norm_rms_eps(EPS)
    writer.add_tokenizer_model("gpt2")
    tokens = [chr(0x21 + i) for i in range(VOCAB - 1)] + ["!\""]
    writer.add_token_list(tokens)
    writer.add_token_merges(["! \""])
    writer.add_token_types([1] * VOCAB)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    writer.add_tensor("token_embd.weight", tensors["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", tensors["model.norm.weight"])
    writer.add_tensor("rope_freqs.weight", rope_factors())
    for i in range(LAYERS):
        for hf, gg in names.items():
            value = tensors[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                value = permute(value, HEADS)
            elif gg == "attn_k":
                value = permute(value, KV_HEADS)
            writer.add_tensor(f"blk.{i}.{gg}.weight", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()
