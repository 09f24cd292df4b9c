//! `harvester synth-model`: a Llama checkpoint of a given shape with seeded random bf16
//! weights, for benchmarks and backend checks where a real checkpoint cannot be brought
//! (an 8B-shaped model for throughput; a SmolLM2-shaped one for CPU/GPU parity; a 405B-shaped
//! one cut to a few blocks for one block's time; small ones with what a GPU must check:
//! 128-wide heads with a sliding window, 256-wide heads, attention biases; and an AFMoE model
//! large enough to time, written as transformers writes `AfmoeForCausalLM`). The weights are
//! uniform in ±√(3 / fan_in) (unit variance per output), biases (and AFMoE's expert bias) in
//! ±0.1, norms are 1.

use std::path::Path;

use rayon::prelude::*;
use safetensors::Dtype;
use safetensors::tensor::TensorView;

use crate::error::{Error, ModelError, Result};

/// A model shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Residual width.
    pub hidden: usize,
    /// Decoder blocks.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// MLP width.
    pub intermediate: usize,
    /// Vocabulary.
    pub vocab: usize,
}

impl Shape {
    /// Llama 3 8B: 32 blocks, hidden 4096, GQA 32/8, MLP 14336, vocabulary 128256.
    pub const LLAMA_8B: Self = Self {
        hidden: 4096,
        layers: 32,
        heads: 32,
        kv_heads: 8,
        intermediate: 14336,
        vocab: 128_256,
    };
    /// SmolLM2-135M: 30 blocks, hidden 576, GQA 9/3, MLP 1536, vocabulary 49152.
    pub const SMOLLM2_135M: Self = Self {
        hidden: 576,
        layers: 30,
        heads: 9,
        kv_heads: 3,
        intermediate: 1536,
        vocab: 49_152,
    };

    /// Llama 3.1 405B: 126 blocks, hidden 16384, GQA 128/8, MLP 53248, vocabulary 128256.
    pub const LLAMA_405B: Self = Self {
        hidden: 16_384,
        layers: 126,
        heads: 128,
        kv_heads: 8,
        intermediate: 53_248,
        vocab: 128_256,
    };

    /// A preset by name: `llama-8b`, `llama-405b` or `smollm2-135m`.
    pub fn named(name: &str) -> Option<Self> {
        Variant::named(name).map(|(shape, _)| shape)
    }

    /// Parameters, embedding included.
    pub fn parameters(&self) -> u64 {
        let head_dim = self.hidden / self.heads;
        let attention = self.hidden * (self.heads + 2 * self.kv_heads) * head_dim
            + self.heads * head_dim * self.hidden;
        let block = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden;
        (self.vocab * self.hidden + self.layers * block) as u64
    }
}

/// What a shape adds to the plain Llama block.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Variant {
    /// A sliding window of this many keys on every block (written as Mistral), or on AFMoE's
    /// local blocks.
    pub sliding_window: Option<usize>,
    /// Q, K, V and O biases (Llama's `attention_bias`).
    pub attention_bias: bool,
    /// AFMoE's blocks instead of Llama's.
    pub moe: Option<MoeShape>,
}

/// An AFMoE model's routing and its blocks' extra parts (QK norms, the attention gate, the
/// branch norms); `Shape::intermediate` is the dense blocks' MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeShape {
    /// Blocks before the first routed one, each with a dense MLP.
    pub dense_layers: usize,
    /// Routed experts of each later block.
    pub experts: usize,
    /// Experts a token is routed to.
    pub experts_per_token: usize,
    /// Each expert's MLP width.
    pub expert_width: usize,
    /// Shared experts, run for every token (one MLP of their summed width).
    pub shared_experts: usize,
    /// Every this many blocks, one attends globally; the rest use the window.
    pub global_every: usize,
}

/// The shapes `synth-model --shape` takes, with what each checks.
pub const SHAPES: [&str; 7] = [
    "llama-8b",
    "llama-405b",
    "smollm2-135m",
    "window-128",
    "heads-256",
    "attention-bias",
    "afmoe",
];

impl Variant {
    /// The shape and variant of preset `name` (see [`SHAPES`]). The small ones share SmolLM2's
    /// vocabulary, so its tokenizer serves them.
    pub fn named(name: &str) -> Option<(Shape, Self)> {
        let small = |heads, kv_heads| Shape {
            hidden: 512,
            layers: 4,
            heads,
            kv_heads,
            intermediate: 1024,
            vocab: Shape::SMOLLM2_135M.vocab,
        };
        Some(match name {
            "llama-8b" => (Shape::LLAMA_8B, Self::default()),
            "llama-405b" => (Shape::LLAMA_405B, Self::default()),
            "smollm2-135m" => (Shape::SMOLLM2_135M, Self::default()),
            // 128-wide heads with a window: the tensor-core attention's window and tile skipping.
            "window-128" => (
                small(4, 2),
                Self {
                    sliding_window: Some(16),
                    ..Self::default()
                },
            ),
            // 256-wide heads: the CUDA-core attention's widest.
            "heads-256" => (small(2, 1), Self::default()),
            // AFMoE large enough to time beside transformers on one GPU (5.5 GB in bf16):
            // Trinity's block (QK norms, attention gate, branch norms, 128-wide heads, a global
            // block every 4th, 4 routed experts a token plus one shared) at width 2,048, with 64
            // experts of 1,024 and 2 dense blocks of 8; SmolLM2's vocabulary.
            "afmoe" => (
                Shape {
                    hidden: 2048,
                    layers: 8,
                    heads: 16,
                    kv_heads: 4,
                    intermediate: 6144,
                    vocab: Shape::SMOLLM2_135M.vocab,
                },
                Self {
                    sliding_window: Some(512),
                    attention_bias: false,
                    moe: Some(MoeShape {
                        dense_layers: 2,
                        experts: 64,
                        experts_per_token: 4,
                        expert_width: 1024,
                        shared_experts: 1,
                        global_every: 4,
                    }),
                },
            ),
            // QKV and O biases: `add_bias_bf16`, `add_bias` and the branch buffer they need.
            "attention-bias" => (
                Shape {
                    layers: 4,
                    ..Shape::SMOLLM2_135M
                },
                Self {
                    attention_bias: true,
                    ..Self::default()
                },
            ),
            _ => return None,
        })
    }
}

/// `n` bf16 values uniform in `offset ± scale`, from `seed` (splitmix64 per 4096-value chunk,
/// so chunks fill in parallel and the result does not depend on the thread count).
fn random_bf16(n: usize, scale: f32, offset: f32, seed: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; 2 * n];
    bytes
        .par_chunks_mut(2 * 4096)
        .enumerate()
        .for_each(|(chunk, out)| {
            let mut state = seed ^ (chunk as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            for pair in out.chunks_exact_mut(2) {
                state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
                let mut z = state;
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                z ^= z >> 31;
                let unit = (z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                let value = half::bf16::from_f32(offset + scale * unit);
                pair.copy_from_slice(&value.to_le_bytes());
            }
        });
    bytes
}

/// Every tensor of a Llama checkpoint of `shape` that harvest loads, in Hugging Face naming:
/// `(name, dims, is a norm weight)`.
pub fn tensors(shape: Shape) -> Vec<(String, Vec<usize>, bool)> {
    tensors_of(shape, Variant::default())
}

/// The tensors of `shape` with `variant`'s (biases after each block's weights).
pub fn tensors_of(shape: Shape, variant: Variant) -> Vec<(String, Vec<usize>, bool)> {
    let (h, i) = (shape.hidden, shape.intermediate);
    let head_dim = h / shape.heads.max(1);
    let (q_rows, kv_rows) = (shape.heads * head_dim, shape.kv_heads * head_dim);
    let mut specs = vec![(
        "model.embed_tokens.weight".into(),
        vec![shape.vocab, h],
        false,
    )];
    for l in 0..shape.layers {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        specs.extend([
            (p("input_layernorm.weight"), vec![h], true),
            (p("post_attention_layernorm.weight"), vec![h], true),
            (p("self_attn.q_proj.weight"), vec![q_rows, h], false),
            (p("self_attn.k_proj.weight"), vec![kv_rows, h], false),
            (p("self_attn.v_proj.weight"), vec![kv_rows, h], false),
            (p("self_attn.o_proj.weight"), vec![h, q_rows], false),
        ]);
        let mlp = |prefix: &str, width: usize| {
            [
                (
                    p(&format!("{prefix}.gate_proj.weight")),
                    vec![width, h],
                    false,
                ),
                (
                    p(&format!("{prefix}.up_proj.weight")),
                    vec![width, h],
                    false,
                ),
                (
                    p(&format!("{prefix}.down_proj.weight")),
                    vec![h, width],
                    false,
                ),
            ]
        };
        match variant.moe {
            Some(moe) => {
                specs.extend([
                    (p("pre_mlp_layernorm.weight"), vec![h], true),
                    (p("post_mlp_layernorm.weight"), vec![h], true),
                    (p("self_attn.gate_proj.weight"), vec![q_rows, h], false),
                    (p("self_attn.q_norm.weight"), vec![head_dim], true),
                    (p("self_attn.k_norm.weight"), vec![head_dim], true),
                ]);
                if l < moe.dense_layers {
                    specs.extend(mlp("mlp", i));
                } else {
                    specs.push((p("mlp.router.gate.weight"), vec![moe.experts, h], false));
                    specs.push((p("mlp.expert_bias"), vec![moe.experts], false));
                    for e in 0..moe.experts {
                        specs.extend(mlp(&format!("mlp.experts.{e}"), moe.expert_width));
                    }
                    if moe.shared_experts > 0 {
                        let width = moe.expert_width * moe.shared_experts;
                        specs.extend(mlp("mlp.shared_experts", width));
                    }
                }
            }
            None => specs.extend(mlp("mlp", i)),
        }
        if variant.attention_bias {
            specs.extend([
                (p("self_attn.q_proj.bias"), vec![q_rows], false),
                (p("self_attn.k_proj.bias"), vec![kv_rows], false),
                (p("self_attn.v_proj.bias"), vec![kv_rows], false),
                (p("self_attn.o_proj.bias"), vec![h], false),
            ]);
        }
    }
    specs
}

/// Writes the checkpoint of the shape named `name` into `dir`, its first `blocks` blocks only
/// where that is given (a large shape cut short), with the tokenizer files of `tokenizer_from`
/// copied beside it (their vocabulary must match); returns the weight bytes.
pub fn write_named(
    name: &str,
    dir: &Path,
    seed: u64,
    (blocks, tokenizer_from): (Option<usize>, Option<&Path>),
) -> Result<u64> {
    let bad = |reason: String| {
        Error::Model(ModelError::BadConfig {
            path: dir.join("config.json"),
            reason,
        })
    };
    let (mut shape, variant) = Variant::named(name).ok_or_else(|| {
        bad(format!(
            "unknown shape {name:?}: use one of {}",
            SHAPES.join(", ")
        ))
    })?;
    if let Some(blocks) = blocks {
        if blocks == 0 || blocks > shape.layers {
            return Err(bad(format!(
                "--blocks {blocks} is not between 1 and {name}'s {} blocks",
                shape.layers
            )));
        }
        shape.layers = blocks;
    }
    let bytes = write_variant(shape, variant, dir, seed)?;
    if let Some(from) = tokenizer_from {
        for file in ["tokenizer.json", "tokenizer_config.json"] {
            let source = from.join(file);
            std::fs::copy(&source, dir.join(file)).map_err(|e| Error::io("copying", source, e))?;
        }
    }
    Ok(bytes)
}

/// Writes `config.json` and `model.safetensors` for `shape` into `dir`; returns the weight
/// bytes written.
pub fn write(shape: Shape, dir: &Path, seed: u64) -> Result<u64> {
    write_variant(shape, Variant::default(), dir, seed)
}

/// [`write()`] with `variant`'s additions.
pub fn write_variant(shape: Shape, variant: Variant, dir: &Path, seed: u64) -> Result<u64> {
    if shape.heads == 0
        || !shape.hidden.is_multiple_of(shape.heads)
        || !shape.heads.is_multiple_of(shape.kv_heads.max(1))
    {
        return Err(Error::Model(ModelError::BadConfig {
            path: dir.join("config.json"),
            reason: format!(
                "{} query heads must divide hidden {} and be a multiple of {} key/value heads",
                shape.heads, shape.hidden, shape.kv_heads
            ),
        }));
    }
    let (h, i) = (shape.hidden, shape.intermediate);
    let specs = tensors_of(shape, variant);
    let data: Vec<Vec<u8>> = specs
        .iter()
        .enumerate()
        .map(|(index, (_, dims, norm))| {
            let n: usize = dims.iter().product();
            let fan_in = dims.last().copied().unwrap_or(1) as f32;
            let (scale, offset) = if *norm {
                (0.0, 1.0)
            } else if dims.len() == 1 {
                (0.1, 0.0)
            } else {
                ((3.0 / fan_in).sqrt(), 0.0)
            };
            random_bf16(n, scale, offset, seed.wrapping_add(index as u64))
        })
        .collect();
    let mut views = Vec::with_capacity(specs.len());
    for ((name, dims, _), bytes) in specs.iter().zip(&data) {
        let view = TensorView::new(Dtype::BF16, dims.clone(), bytes).map_err(|e| {
            Error::Model(ModelError::BadConfig {
                path: dir.join("model.safetensors"),
                reason: e.to_string(),
            })
        })?;
        views.push((name.clone(), view));
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io("creating", dir, e))?;
    let path = dir.join("model.safetensors");
    safetensors::serialize_to_file(views, None, &path).map_err(|e| {
        Error::Model(ModelError::BadConfig {
            path: path.clone(),
            reason: e.to_string(),
        })
    })?;
    let mut config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
        "intermediate_size": i, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
        "vocab_size": shape.vocab, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
        "attention_bias": variant.attention_bias,
    });
    if let Some(moe) = variant.moe {
        afmoe_config(&mut config, shape, moe, variant.sliding_window);
    } else if let Some(window) = variant.sliding_window {
        config["architectures"] = serde_json::json!(["MistralForCausalLM"]);
        config["model_type"] = serde_json::json!("mistral");
        config["sliding_window"] = serde_json::json!(window);
    }
    let config_path = dir.join("config.json");
    std::fs::write(&config_path, config.to_string())
        .map_err(|e| Error::io("writing", config_path, e))?;
    Ok(data.iter().map(|d| d.len() as u64).sum())
}

/// `config` made an AFMoE model's, with the fields transformers writes for
/// `AfmoeForCausalLM` (`layer_types` from `global_every`: each `global_every`-th block global).
fn afmoe_config(
    config: &mut serde_json::Value,
    shape: Shape,
    moe: MoeShape,
    window: Option<usize>,
) {
    let layer_types: Vec<&str> = (0..shape.layers)
        .map(|l| match window {
            Some(_) if (l + 1) % moe.global_every.max(1) != 0 => "sliding_attention",
            _ => "full_attention",
        })
        .collect();
    let fields = serde_json::json!({
        "architectures": ["AfmoeForCausalLM"], "model_type": "afmoe",
        "head_dim": shape.hidden / shape.heads.max(1), "hidden_act": "silu",
        "num_dense_layers": moe.dense_layers, "num_experts": moe.experts,
        "num_experts_per_tok": moe.experts_per_token, "num_shared_experts": moe.shared_experts,
        "moe_intermediate_size": moe.expert_width, "route_scale": 2.5, "mup_enabled": true,
        "global_attn_every_n_layers": moe.global_every, "sliding_window": window,
        "layer_types": layer_types,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "dtype": "bfloat16",
    });
    if let (Some(config), Some(fields)) = (config.as_object_mut(), fields.as_object()) {
        config.remove("rope_theta");
        config.remove("torch_dtype");
        config.extend(fields.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::LlamaWeights;

    #[test]
    fn a_synthetic_checkpoint_loads_with_its_shape_and_is_reproducible() {
        let dir = tempfile::tempdir().unwrap();
        let shape = Shape {
            hidden: 64,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            intermediate: 96,
            vocab: 100,
        };
        let bytes = write(shape, dir.path(), 7).unwrap();
        assert_eq!(bytes, 2 * shape.parameters());
        let weights = LlamaWeights::load(dir.path(), None).unwrap();
        assert_eq!(weights.blocks.len(), 2);
        assert_eq!(weights.config.head_dim, 16);
        assert!(weights.blocks[0].attn_norm.iter().all(|&w| w == 1.0));
        let bound = (3.0f32 / 64.0).sqrt() * 1.01;
        assert!(
            weights.blocks[1]
                .qkv
                .to_f32_vec()
                .iter()
                .all(|w| w.abs() <= bound)
        );
        let again = tempfile::tempdir().unwrap();
        write(shape, again.path(), 7).unwrap();
        assert_eq!(
            std::fs::read(dir.path().join("model.safetensors")).unwrap(),
            std::fs::read(again.path().join("model.safetensors")).unwrap()
        );
        // Llama 3 8B less its LM head and final norm, which harvest never loads.
        assert_eq!(Shape::LLAMA_8B.parameters(), 7_504_920_576);
    }

    #[test]
    fn an_afmoe_checkpoint_loads_as_afmoe_with_its_routing_windows_and_block_parts() {
        let dir = tempfile::tempdir().unwrap();
        let shape = Shape {
            hidden: 64,
            layers: 4,
            heads: 4,
            kv_heads: 2,
            intermediate: 96,
            vocab: 100,
        };
        let moe = MoeShape {
            dense_layers: 1,
            experts: 8,
            experts_per_token: 2,
            expert_width: 32,
            shared_experts: 1,
            global_every: 2,
        };
        let variant = Variant {
            sliding_window: Some(6),
            attention_bias: false,
            moe: Some(moe),
        };
        write_variant(shape, variant, dir.path(), 3).unwrap();
        let weights = LlamaWeights::load(dir.path(), None).unwrap();
        let routing = weights.config.afmoe.as_ref().expect("an AFMoE config");
        assert_eq!(
            (routing.num_experts, routing.experts_per_token),
            (8, 2),
            "{routing:?}"
        );
        assert_eq!(
            weights.config.attention_windows,
            [Some(6), None, Some(6), None]
        );
        assert!(weights.blocks[0].moe.is_none());
        assert!(weights.blocks[1..].iter().all(|b| b.moe.is_some()));
        assert!(
            weights
                .blocks
                .iter()
                .all(|b| b.head_norms.is_some() && b.attn_gate.is_some())
        );
        // The timed preset: about 2.75 billion parameters, 5.5 GB in bf16.
        let (preset, variant) = Variant::named("afmoe").unwrap();
        let values: usize = tensors_of(preset, variant)
            .iter()
            .map(|(_, dims, _)| dims.iter().product::<usize>())
            .sum();
        assert!((2_700_000_000..2_800_000_000).contains(&values), "{values}");
    }

    #[test]
    fn each_named_shape_loads_as_what_it_checks_and_a_cut_keeps_its_first_blocks() {
        let load = |name: &str, blocks| {
            let dir = tempfile::tempdir().unwrap();
            write_named(name, dir.path(), 1, (blocks, None)).unwrap();
            (LlamaWeights::load(dir.path(), None).unwrap(), dir)
        };
        let (window, _dir) = load("window-128", None);
        assert_eq!(window.config.head_dim, 128);
        assert!(
            window
                .config
                .attention_windows
                .iter()
                .all(|w| *w == Some(16))
        );
        let (wide, _dir) = load("heads-256", None);
        assert_eq!(wide.config.head_dim, 256);
        let (biased, _dir) = load("attention-bias", None);
        assert!(
            biased
                .blocks
                .iter()
                .all(|b| b.qkv_bias.is_some() && b.o_bias.is_some())
        );
        let (cut, _dir) = load("smollm2-135m", Some(3));
        assert_eq!(cut.blocks.len(), 3);
        let dir = tempfile::tempdir().unwrap();
        let error = write_named("llama-405b", dir.path(), 1, (Some(127), None))
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("--blocks 127") && error.contains("126 blocks"),
            "{error}"
        );
        let error = write_named("llama-3b", dir.path(), 1, (None, None))
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("\"llama-3b\"") && error.contains("window-128"),
            "{error}"
        );
    }
}
