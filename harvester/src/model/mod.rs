//! Llama-family checkpoints: the validated config and the weights in the layout the forward pass
//! wants (Q|K|V as one matrix, gate|up as another). Matrices keep the checkpoint's precision
//! ([`Matrix`]: bf16 and f16 stay mapped, f32 is decoded); norms and biases are f32.
//!
//! ```text
//! config.json ──► ModelConfig
//! model.safetensors[.index.json] ──mmap──► Checkpoint ──► LlamaWeights { embed, blocks }
//! ```

pub mod checkpoint;
pub mod config;
pub mod matrix;

use std::path::Path;

pub use checkpoint::Checkpoint;
pub use config::{Architecture, ModelConfig, RopeScaling};
pub use matrix::{Half, Matrix};

use crate::error::Result;

/// The weights of one decoder block. Matrices are row-major `[out, in]`, as in PyTorch.
#[derive(Debug, Clone)]
pub struct BlockWeights {
    /// Input RMSNorm weight, `[hidden]`.
    pub attn_norm: Vec<f32>,
    /// Q, K and V projections stacked, `[(heads + 2 kv_heads) head_dim, hidden]`.
    pub qkv: Matrix,
    /// Their biases, stacked likewise (Qwen2, or Llama with `attention_bias`).
    pub qkv_bias: Option<Vec<f32>>,
    /// Attention output projection, `[hidden, heads head_dim]`.
    pub o: Matrix,
    /// Its bias (Llama with `attention_bias`).
    pub o_bias: Option<Vec<f32>>,
    /// Post-attention RMSNorm weight, `[hidden]`.
    pub mlp_norm: Vec<f32>,
    /// Gate and up projections stacked, `[2 intermediate, hidden]`.
    pub gate_up: Matrix,
    /// Down projection, `[hidden, intermediate]`.
    pub down: Matrix,
}

/// Everything the residual stream depends on up to a given block. The final norm and LM head are
/// never loaded: harvest captures block outputs before the final norm.
#[derive(Debug, Clone)]
pub struct LlamaWeights {
    /// The validated config.
    pub config: ModelConfig,
    /// Token embedding, `[vocab, hidden]`.
    pub embed: Matrix,
    /// The first blocks of the model, as many as were asked for.
    pub blocks: Vec<BlockWeights>,
}

impl LlamaWeights {
    /// Loads `config.json` and the first `num_blocks` blocks (all of them if `None`) from a
    /// Hugging Face checkpoint directory.
    pub fn load(dir: &Path, num_blocks: Option<usize>) -> Result<Self> {
        let config = ModelConfig::from_file(&dir.join("config.json"))?;
        let checkpoint = Checkpoint::open(dir)?;
        Self::from_checkpoint(config, &checkpoint, num_blocks)
    }

    /// Decodes the weights from an open checkpoint.
    pub fn from_checkpoint(
        config: ModelConfig,
        checkpoint: &Checkpoint,
        num_blocks: Option<usize>,
    ) -> Result<Self> {
        let num_blocks = num_blocks
            .unwrap_or(config.num_layers)
            .min(config.num_layers);
        let embed = checkpoint.matrix(
            &[("model.embed_tokens.weight".to_owned(), config.vocab_size)],
            config.hidden_size,
        )?;
        let blocks = (0..num_blocks)
            .map(|layer| load_block(&config, checkpoint, layer))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            config,
            embed,
            blocks,
        })
    }

    /// Makes every mapped page resident (see [`Matrix::touch`]).
    pub fn touch(&self) {
        self.embed.touch();
        for b in &self.blocks {
            for m in [&b.qkv, &b.o, &b.gate_up, &b.down] {
                m.touch();
            }
        }
    }

    /// The bytes the weights take in memory (mapped half-precision pages included, once
    /// touched).
    pub fn resident_bytes(&self) -> u64 {
        let vector = |v: &[f32]| (v.len() * 4) as u64;
        let optional = |v: &Option<Vec<f32>>| v.as_deref().map_or(0, vector);
        self.embed.resident_bytes()
            + self
                .blocks
                .iter()
                .map(|b| {
                    vector(&b.attn_norm)
                        + vector(&b.mlp_norm)
                        + optional(&b.qkv_bias)
                        + optional(&b.o_bias)
                        + [&b.qkv, &b.o, &b.gate_up, &b.down]
                            .iter()
                            .map(|m| m.resident_bytes())
                            .sum::<u64>()
                })
                .sum::<u64>()
    }
}

fn load_block(config: &ModelConfig, ckpt: &Checkpoint, layer: usize) -> Result<BlockWeights> {
    let hidden = config.hidden_size;
    let q_rows = config.num_heads * config.head_dim;
    let kv_rows = config.num_kv_heads * config.head_dim;
    let inter = config.intermediate_size;
    let name = |suffix: &str| format!("model.layers.{layer}.{suffix}");

    let qkv = ckpt.matrix(
        &[
            (name("self_attn.q_proj.weight"), q_rows),
            (name("self_attn.k_proj.weight"), kv_rows),
            (name("self_attn.v_proj.weight"), kv_rows),
        ],
        hidden,
    )?;
    let qkv_bias = if config.qkv_bias {
        let mut bias = Vec::with_capacity(config.qkv_width());
        ckpt.append_f32(&name("self_attn.q_proj.bias"), &[q_rows], &mut bias)?;
        ckpt.append_f32(&name("self_attn.k_proj.bias"), &[kv_rows], &mut bias)?;
        ckpt.append_f32(&name("self_attn.v_proj.bias"), &[kv_rows], &mut bias)?;
        Some(bias)
    } else {
        None
    };
    let o_bias = if config.o_bias {
        Some(ckpt.tensor_f32(&name("self_attn.o_proj.bias"), &[hidden])?)
    } else {
        None
    };
    let gate_up = ckpt.matrix(
        &[
            (name("mlp.gate_proj.weight"), inter),
            (name("mlp.up_proj.weight"), inter),
        ],
        hidden,
    )?;
    Ok(BlockWeights {
        attn_norm: ckpt.tensor_f32(&name("input_layernorm.weight"), &[hidden])?,
        qkv,
        qkv_bias,
        o: ckpt.matrix(&[(name("self_attn.o_proj.weight"), hidden)], q_rows)?,
        o_bias,
        mlp_norm: ckpt.tensor_f32(&name("post_attention_layernorm.weight"), &[hidden])?,
        gate_up,
        down: ckpt.matrix(&[(name("mlp.down_proj.weight"), hidden)], inter)?,
    })
}
