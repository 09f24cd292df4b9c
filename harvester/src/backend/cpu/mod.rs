//! The CPU backend: the Llama block in f32, multi-threaded with rayon, matrix products through
//! `gemm` (AVX-512/AVX2 picked at run time). It is the reference the CUDA backend is checked
//! against.
//!
//! One block, on packed rows `x: [tokens, hidden]`:
//! ```text
//! normed = rms_norm(x)                  qkv = normed · Wqkvᵀ (+ bias), RoPE on Q and K
//! attn   = causal GQA attention(qkv)    x  += attn · Woᵀ (+ bias)
//! normed = rms_norm(x)                  gate_up = normed · W(gate|up)ᵀ
//! act    = silu(gate) ⊙ up              x  += act · Wdownᵀ          ← block output, captured
//! ```
//! Every buffer lives in [`Scratch`] and only grows, so steady-state batches allocate nothing.

mod attention;
pub mod kernels;
pub mod matmul;

use std::path::Path;

use gemm::Parallelism;
use harvest_core::LayerSelection;
use rayon::prelude::*;

use self::attention::AttentionShape;
use self::matmul::{MatRef, matmul_transposed};
use super::{Backend, Batch, CaptureSpec, Captured};
use crate::error::Result;
use crate::model::{LlamaWeights, ModelConfig};
use crate::projection::Directions;

/// Rows handed to one rayon task in the element-wise passes.
const ROWS_PER_TASK: usize = 16;

/// The f32 reference backend.
#[derive(Debug)]
pub struct CpuBackend {
    weights: LlamaWeights,
    spec: CaptureSpec,
    inv_freq: Vec<f32>,
    rope: RopeTable,
    scratch: Scratch,
}

#[derive(Debug, Default)]
struct RopeTable {
    positions: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

#[derive(Debug, Default)]
struct Scratch {
    x: Vec<f32>,
    normed: Vec<f32>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
}

impl CpuBackend {
    /// Builds a backend over loaded weights. The weights must reach the deepest kept block.
    pub fn new(weights: LlamaWeights, spec: CaptureSpec) -> Result<Self> {
        spec.check(&weights)?;
        let inv_freq = weights
            .config
            .inverse_frequencies()
            .iter()
            .map(|&f| f as f32)
            .collect();
        Ok(Self {
            weights,
            spec,
            inv_freq,
            rope: RopeTable::default(),
            scratch: Scratch::default(),
        })
    }

    /// Loads a checkpoint directory, reading only the blocks that `layers` needs.
    pub fn load(
        dir: &Path,
        layers: &LayerSelection,
        directions: Option<Directions>,
    ) -> Result<Self> {
        let config = ModelConfig::from_file(&dir.join("config.json"))?;
        let layers = layers.resolve(config.num_layers)?;
        let weights = LlamaWeights::load(dir, Some(layers.deepest() + 1))?;
        Self::new(weights, CaptureSpec { layers, directions })
    }

    /// The loaded weights.
    pub fn weights(&self) -> &LlamaWeights {
        &self.weights
    }

    /// Extends the cos/sin tables to cover `positions`, computing angles in f32 as Hugging Face
    /// does (`position * inv_freq`), then cos and sin of that f32 angle.
    fn ensure_rope(&mut self, positions: usize) {
        if positions <= self.rope.positions {
            return;
        }
        let half = self.inv_freq.len();
        self.rope
            .cos
            .reserve((positions - self.rope.positions) * half);
        for pos in self.rope.positions..positions {
            for &freq in &self.inv_freq {
                let angle = f64::from(pos as f32 * freq);
                self.rope.cos.push(angle.cos() as f32);
                self.rope.sin.push(angle.sin() as f32);
            }
        }
        self.rope.positions = positions;
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn capture_width(&self) -> usize {
        self.spec.width(self.weights.config.hidden_size)
    }

    fn spec(&self) -> &CaptureSpec {
        &self.spec
    }

    fn capture(&mut self, batch: &Batch, out: &mut Captured) -> Result<()> {
        batch.validate(self.weights.config.vocab_size)?;
        self.ensure_rope(batch.max_length as usize);
        let config = &self.weights.config;
        let tokens = batch.num_tokens();
        let hidden = config.hidden_size;
        let (qkv_width, attn_width) = (config.qkv_width(), config.num_heads * config.head_dim);
        let inter = config.intermediate_size;
        let eps = config.rms_norm_eps as f32;
        let width = self.capture_width();
        out.reset(self.spec.layers.len(), tokens, width);

        let s = &mut self.scratch;
        s.x.resize(tokens * hidden, 0.0);
        s.normed.resize(tokens * hidden, 0.0);
        s.qkv.resize(tokens * qkv_width, 0.0);
        s.attn.resize(tokens * attn_width, 0.0);
        s.gate_up.resize(tokens * 2 * inter, 0.0);
        s.act.resize(tokens * inter, 0.0);
        let all = Parallelism::Rayon(0);
        let embed = &self.weights.embed;
        s.x.par_chunks_mut(hidden)
            .zip(&batch.input_ids)
            .for_each(|(row, &id)| {
                let id = id as usize;
                row.copy_from_slice(&embed[id * hidden..(id + 1) * hidden]);
            });

        for (index, block) in self.weights.blocks[..=self.spec.layers.deepest()]
            .iter()
            .enumerate()
        {
            rows_pass(&s.x, hidden, &mut s.normed, hidden, |x, y| {
                kernels::rms_norm_rows(x, &block.attn_norm, eps, y);
            });
            let normed = MatRef::dense(&s.normed, tokens, hidden);
            let w_qkv = MatRef::dense(&block.qkv, qkv_width, hidden);
            matmul_transposed(normed, w_qkv, &mut s.qkv, qkv_width, 1.0, false, all);
            let rotated_heads = config.num_heads + config.num_kv_heads;
            let head_dim = config.head_dim;
            let (cos, sin) = (&self.rope.cos, &self.rope.sin);
            s.qkv
                .par_chunks_mut(qkv_width * ROWS_PER_TASK)
                .zip(batch.positions.par_chunks(ROWS_PER_TASK))
                .for_each(|(rows, positions)| {
                    if let Some(bias) = &block.qkv_bias {
                        kernels::add_bias_rows(rows, bias);
                    }
                    kernels::rope_rows(
                        rows,
                        qkv_width,
                        rotated_heads,
                        head_dim,
                        positions,
                        cos,
                        sin,
                    );
                });
            let shape = AttentionShape {
                num_heads: config.num_heads,
                num_kv_heads: config.num_kv_heads,
                head_dim: config.head_dim,
                window: config.attention_windows[index],
            };
            attention::attention(&s.qkv, batch, shape, &mut s.attn);
            let attn = MatRef::dense(&s.attn, tokens, attn_width);
            matmul_transposed(
                attn,
                MatRef::dense(&block.o, hidden, attn_width),
                &mut s.x,
                hidden,
                1.0,
                true,
                all,
            );
            if let Some(bias) = &block.o_bias {
                s.x.par_chunks_mut(hidden * ROWS_PER_TASK)
                    .for_each(|rows| kernels::add_bias_rows(rows, bias));
            }

            rows_pass(&s.x, hidden, &mut s.normed, hidden, |x, y| {
                kernels::rms_norm_rows(x, &block.mlp_norm, eps, y);
            });
            let normed = MatRef::dense(&s.normed, tokens, hidden);
            let w_gate_up = MatRef::dense(&block.gate_up, 2 * inter, hidden);
            matmul_transposed(
                normed,
                w_gate_up,
                &mut s.gate_up,
                2 * inter,
                1.0,
                false,
                all,
            );
            rows_pass(&s.gate_up, 2 * inter, &mut s.act, inter, |gu, act| {
                kernels::silu_mul_rows(gu, inter, act);
            });
            let act = MatRef::dense(&s.act, tokens, inter);
            matmul_transposed(
                act,
                MatRef::dense(&block.down, hidden, inter),
                &mut s.x,
                hidden,
                1.0,
                true,
                all,
            );

            if let Some(kept) = self.spec.layers.position(index) {
                let dst = &mut out.data[kept * tokens * width..(kept + 1) * tokens * width];
                match &self.spec.directions {
                    None => dst.copy_from_slice(&s.x),
                    Some(directions) => {
                        let x = MatRef::dense(&s.x, tokens, hidden);
                        let units =
                            MatRef::dense(directions.unit_vectors(), directions.count(), hidden);
                        matmul_transposed(x, units, dst, width, 1.0, false, all);
                    }
                }
            }
        }
        Ok(())
    }
}

/// Applies a row kernel to `[rows, in_width]` → `[rows, out_width]` in parallel chunks of rows.
fn rows_pass(
    input: &[f32],
    in_width: usize,
    output: &mut [f32],
    out_width: usize,
    kernel: impl Fn(&[f32], &mut [f32]) + Sync,
) {
    output
        .par_chunks_mut(out_width * ROWS_PER_TASK)
        .zip(input.par_chunks(in_width * ROWS_PER_TASK))
        .for_each(|(out, inp)| kernel(inp, out));
}
