//! Llama-family checkpoints (and AFMoE, which extends the Llama block): the validated config and
//! the weights in the layout the forward pass wants (Q|K|V as one matrix, gate|up as another).
//! Matrices keep the checkpoint's precision ([`Matrix`]: bf16 and f16 stay mapped, f32 is
//! decoded); norms and biases are f32.
//!
//! ```text
//! config.json ──► ModelConfig
//! model.safetensors[.index.json] ──mmap──► Checkpoint ──► LlamaWeights { embed, blocks }
//! ```

pub mod block;
pub mod checkpoint;
pub mod config;
pub mod matrix;
pub mod routing;
pub mod weights;

use std::path::Path;

pub use checkpoint::Checkpoint;
pub use config::{AfmoeConfig, Architecture, ModelConfig, RopeScaling};
pub use matrix::{Half, Matrix};
pub use weights::{BlockWeights, BranchNorms, Expert, HeadNorms, MoeWeights};

use crate::error::Result;

/// Bytes one prefault task reads.
pub const PREFAULT_CHUNK: usize = 64 << 20;

/// Everything the residual stream depends on up to a given block. The final norm and LM head are
/// never loaded: harvest captures block outputs before the final norm.
#[derive(Debug, Clone)]
pub struct LlamaWeights {
    /// The validated config.
    pub config: ModelConfig,
    /// Token embedding, `[vocab, hidden]` (no rows in weights that start past block 0).
    pub embed: Matrix,
    /// The index of `blocks[0]` in the model: 0, unless these weights serve a later pipeline
    /// stage.
    pub first_block: usize,
    /// Consecutive blocks of the model from `first_block`, as many as were asked for.
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
        Self::range_from_checkpoint(config, checkpoint, 0..num_blocks)
    }

    /// Decodes blocks `range` (clamped to the model) from an open checkpoint, and the
    /// embedding only when the range starts at block 0: what one pipeline stage holds.
    pub fn range_from_checkpoint(
        config: ModelConfig,
        checkpoint: &Checkpoint,
        range: std::ops::Range<usize>,
    ) -> Result<Self> {
        let range = range.start.min(config.num_layers)..range.end.min(config.num_layers);
        let embed = if range.start == 0 {
            checkpoint.matrix(
                &[("model.embed_tokens.weight".to_owned(), config.vocab_size)],
                config.hidden_size,
            )?
        } else {
            Matrix::from_f32(0, config.hidden_size, Vec::new())
        };
        let blocks = range
            .clone()
            .map(|layer| load_block(&config, checkpoint, layer))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            config,
            embed,
            first_block: range.start,
            blocks,
        })
    }

    /// Reads every mapped page of the blocks' matrices into memory, many files and regions at
    /// once (one rayon task per [`PREFAULT_CHUNK`]), calling `read(bytes)` after each chunk.
    /// The embedding is left to fault in by row, as only the rows of the tokens that run are
    /// ever read.
    pub fn prefault(&self, read: &(dyn Fn(u64) + Sync)) {
        use rayon::prelude::*;
        let chunks: Vec<&[u8]> = self
            .blocks
            .iter()
            .flat_map(BlockWeights::matrices)
            .flat_map(Matrix::half_bytes)
            .flat_map(|part| part.chunks(PREFAULT_CHUNK))
            .collect();
        chunks.par_iter().for_each(|chunk| {
            let mut sum = 0u8;
            for page in chunk.iter().step_by(4096) {
                sum = sum.wrapping_add(*page);
            }
            std::hint::black_box(sum);
            read(chunk.len() as u64);
        });
    }

    /// Bytes [`LlamaWeights::prefault`] reads.
    pub fn mapped_block_bytes(&self) -> u64 {
        self.blocks
            .iter()
            .flat_map(BlockWeights::matrices)
            .flat_map(Matrix::half_bytes)
            .map(|part| part.len() as u64)
            .sum()
    }

    /// Makes every mapped page resident, the embedding's too (see [`Matrix::touch`]).
    pub fn touch(&self) {
        self.embed.touch();
        self.prefault(&|_| {});
    }

    /// The bytes the weights take in memory (mapped half-precision pages included, once
    /// touched).
    pub fn resident_bytes(&self) -> u64 {
        self.embed.resident_bytes()
            + self
                .blocks
                .iter()
                .map(|b| {
                    let vectors: usize = b.vectors().iter().map(|v| v.len() * 4).sum();
                    vectors as u64 + b.matrices().iter().map(|m| m.resident_bytes()).sum::<u64>()
                })
                .sum::<u64>()
    }
}

fn load_block(config: &ModelConfig, ckpt: &Checkpoint, layer: usize) -> Result<BlockWeights> {
    let hidden = config.hidden_size;
    let q_rows = config.num_heads * config.head_dim;
    let kv_rows = config.num_kv_heads * config.head_dim;
    let inter = config.mlp_width(layer);
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
    let afmoe = config.architecture == Architecture::Afmoe;
    let mlp_norm = match afmoe {
        true => "pre_mlp_layernorm.weight",
        false => "post_attention_layernorm.weight",
    };
    let (gate_up, down) = load_mlp(ckpt, &name(dense_mlp(config, layer)), hidden, inter)?;
    let mut block = BlockWeights {
        attn_norm: ckpt.tensor_f32(&name("input_layernorm.weight"), &[hidden])?,
        qkv,
        qkv_bias,
        head_norms: None,
        attn_gate: None,
        o: ckpt.matrix(&[(name("self_attn.o_proj.weight"), hidden)], q_rows)?,
        o_bias,
        branch_norms: None,
        mlp_norm: ckpt.tensor_f32(&name(mlp_norm), &[hidden])?,
        gate_up,
        down,
        moe: None,
    };
    if afmoe {
        load_afmoe(config, ckpt, layer, &mut block)?;
    }
    Ok(block)
}

/// Where block `layer`'s dense MLP lives: `mlp`, or a sparse block's `mlp.shared_experts`.
fn dense_mlp(config: &ModelConfig, layer: usize) -> &'static str {
    if config.is_sparse(layer) {
        "mlp.shared_experts"
    } else {
        "mlp"
    }
}

/// The stacked gate|up and the down projection of the SwiGLU MLP under `prefix`, `inter` wide
/// (zero: an MLP that is not there, as a sparse block without shared experts).
fn load_mlp(
    ckpt: &Checkpoint,
    prefix: &str,
    hidden: usize,
    inter: usize,
) -> Result<(Matrix, Matrix)> {
    if inter == 0 {
        return Ok((
            Matrix::from_f32(0, hidden, Vec::new()),
            Matrix::from_f32(hidden, 0, Vec::new()),
        ));
    }
    let gate_up = ckpt.matrix(
        &[
            (format!("{prefix}.gate_proj.weight"), inter),
            (format!("{prefix}.up_proj.weight"), inter),
        ],
        hidden,
    )?;
    let down = ckpt.matrix(&[(format!("{prefix}.down_proj.weight"), hidden)], inter)?;
    Ok((gate_up, down))
}

/// An AFMoE block's extras, in the published layout: `self_attn.{q,k}_norm`,
/// `self_attn.gate_proj`, the two output norms, and for a sparse block `mlp.router.gate`,
/// `mlp.expert_bias` and `mlp.experts.{e}.{gate,up,down}_proj`.
fn load_afmoe(
    config: &ModelConfig,
    ckpt: &Checkpoint,
    layer: usize,
    block: &mut BlockWeights,
) -> Result<()> {
    let hidden = config.hidden_size;
    let name = |suffix: &str| format!("model.layers.{layer}.{suffix}");
    let head = [config.head_dim];
    block.moe = match &config.afmoe {
        Some(moe) if config.is_sparse(layer) => {
            let experts = (0..moe.num_experts)
                .map(|e| {
                    let prefix = name(&format!("mlp.experts.{e}"));
                    let (gate_up, down) =
                        load_mlp(ckpt, &prefix, hidden, moe.expert_intermediate_size)?;
                    Ok(Expert { gate_up, down })
                })
                .collect::<Result<Vec<_>>>()?;
            Some(MoeWeights {
                router: ckpt
                    .matrix(&[(name("mlp.router.gate.weight"), moe.num_experts)], hidden)?,
                expert_bias: ckpt.tensor_f32(&name("mlp.expert_bias"), &[moe.num_experts])?,
                experts,
            })
        }
        _ => None,
    };
    block.head_norms = Some(HeadNorms {
        q: ckpt.tensor_f32(&name("self_attn.q_norm.weight"), &head)?,
        k: ckpt.tensor_f32(&name("self_attn.k_norm.weight"), &head)?,
    });
    block.attn_gate = Some(ckpt.matrix(
        &[(
            name("self_attn.gate_proj.weight"),
            config.num_heads * config.head_dim,
        )],
        hidden,
    )?);
    block.branch_norms = Some(BranchNorms {
        attention: ckpt.tensor_f32(&name("post_attention_layernorm.weight"), &[hidden])?,
        mlp: ckpt.tensor_f32(&name("post_mlp_layernorm.weight"), &[hidden])?,
    });
    Ok(())
}
