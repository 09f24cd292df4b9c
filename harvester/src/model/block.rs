//! The forward pass, written once: the embedding and its scale, the block loop, where each
//! hook site is taken and which capture slot it fills, and the decoder block as a sequence of
//! ops over [`BlockOps`]. A backend decides how each op runs (which kernel, fused with what,
//! on which device) and holds the weights in its own [`Form`]; each op is handed the weights
//! it reads. What a block runs follows from what its weights hold ([`BlockWeights`]), not from
//! its family: the head norms where it has QK norms, the attention gate where it has one,
//! branch norms, routed experts. The CPU backend runs it (`backend::cpu::ops`), the CUDA
//! backend on a GPU (`backend::cuda::forward`) and replayed on the CPU
//! (`backend::cuda::replay`), so what a test checks on the replay is the sequence the GPU runs.
//!
//! ```text
//! x ─► [resid_pre] ─► norm ─► QKV ─► (head norms) ─► (rope, in rotary blocks) ─► attention
//!   ─► (× sigmoid(gate)) ─► O ─► (branch norm) ──(+)─► [attn_out before it, resid_mid after]
//!   ─► norm ─► gate|up ─► SwiGLU ─► down (or 0) ─► (+ routed experts) ─► (branch norm)
//!   ──(+)─► [mlp_out before it, resid_post after]
//! ```
//! A branch adds into `x` in its GEMM when its output is not kept and has no bias and no norm;
//! else it is written apart (bias added, normed), kept, then added: one f32 addition to `x`
//! either way, so a site kept or not leaves the stream's bits as they were.

use harvest_core::{Layers, Site, Sites};

use super::ModelConfig;
use super::weights::{BlockWeights, Form, HeadNorms, MoeWeights};
use crate::error::Result;

/// What a kept site is read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The residual stream `x`, f32.
    Residual,
    /// A branch output written apart before it joins `x`, f32.
    Branch,
}

/// The block's two sublayers, each with its RMSNorm and its output projection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sublayer {
    /// Attention: its input norm, and `attn · Woᵀ`.
    Attention,
    /// The MLP: its input norm, and `act · Wdownᵀ`.
    Mlp,
}

/// The operations of the forward pass, on weights in form `W` that live for `'w`. Each reads
/// and writes the backend's own buffers for the batch; the comments give the dataflow and the
/// dtype each result is stored in (bf16 in the bf16 mode; the f32 mode stores f32).
pub trait BlockOps<'w, W: Form> {
    /// `x = embedding(ids) · scale`, f32.
    fn embed(&mut self, scale: f32) -> Result<()>;
    /// `normed = rms_norm(x) · weight`, the norm of `sublayer`, rounded to bf16.
    fn norm(&mut self, weight: &'w W::Norm, sublayer: Sublayer) -> Result<()>;
    /// `qkv = normed · Wqkvᵀ (+ bias)`, summed in f32 and rounded once to bf16.
    fn qkv(&mut self, weight: &'w W::Matrix, bias: Option<&'w W::Bias>) -> Result<()>;
    /// RMSNorm of every query head and every key head of `qkv`, in place, bf16.
    fn head_norms(&mut self, norms: &'w HeadNorms<W>) -> Result<()>;
    /// Rotates the query and key heads of `qkv` in place, bf16.
    fn rope(&mut self) -> Result<()>;
    /// `attn = attention(qkv)`, causal grouped-query attention over each sequence, bf16; with a
    /// `window`, each query sees only the `window` keys up to and including itself.
    fn attention(&mut self, window: Option<usize>) -> Result<()>;
    /// `attn = attn · sigmoid(normed · Wgateᵀ)`, `normed` still the attention's input norm;
    /// the gate's product is bf16, the result rounded to bf16.
    fn attention_gate(&mut self, weight: &'w W::Matrix) -> Result<()>;
    /// `gate_up = normed · Wgate|upᵀ`, `2 width` wide, bf16.
    fn gate_up(&mut self, weight: &'w W::Matrix, width: usize) -> Result<()>;
    /// `act = silu(gate) · up`, bf16, as wide as the last `gate_up` made it.
    fn swiglu(&mut self) -> Result<()>;
    /// `x += input · Wᵀ` for `sublayer`'s output projection, summed in f32.
    fn output_into_residual(&mut self, weight: &'w W::Matrix, sublayer: Sublayer) -> Result<()>;
    /// `branch = input · Wᵀ (+ bias)` for `sublayer`'s output projection, f32.
    fn output_apart(
        &mut self,
        weight: &'w W::Matrix,
        bias: Option<&'w W::Bias>,
        sublayer: Sublayer,
    ) -> Result<()>;
    /// `branch = rms_norm(branch) · weight`, f32.
    fn branch_norm(&mut self, weight: &'w W::Norm) -> Result<()>;
    /// `branch = 0`: a sparse block with no shared experts.
    fn clear_branch(&mut self) -> Result<()>;
    /// `branch += Σ weight · expert(normed)` over each token's routed experts. The router reads
    /// `rms_norm(x) · norm` (the MLP's input norm) in f32 (bf16 rounding moves tokens to other
    /// experts), its logits are f32,
    /// and the choice is [`super::routing::choose`]; the experts read the bf16 `normed`. With
    /// `route`, the choices (and logits) are also kept in that route slot of the capture
    /// ([`crate::backend::Routes::record`]).
    fn routed_experts(
        &mut self,
        moe: &'w MoeWeights<W>,
        norm: &'w W::Norm,
        route: Option<usize>,
    ) -> Result<()>;
    /// `x += branch`.
    fn add_branch(&mut self) -> Result<()>;
    /// Writes `source` into capture slot `slot` (`site * kept layers + layer`, the whole
    /// job's numbering): rounded to bf16, or its projections when the job projects.
    fn keep(&mut self, source: Source, slot: usize) -> Result<()>;
}

/// What the configuration says of one block, beside its weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layer {
    /// The sliding attention window, if any.
    pub window: Option<usize>,
    /// Whether the block rotates Q and K.
    pub rotary: bool,
    /// The dense MLP's (or shared experts') inner width; 0 for none.
    pub mlp_width: usize,
}

impl Layer {
    /// Block `index` of `config`.
    pub fn of(config: &ModelConfig, index: usize) -> Self {
        Self {
            window: config.attention_windows[index],
            rotary: config.rotary[index],
            mlp_width: config.mlp_width(index),
        }
    }
}

/// The blocks a backend runs, in its form.
#[derive(Debug)]
pub struct Stack<'w, W: Form> {
    /// The model's configuration.
    pub config: &'w ModelConfig,
    /// The model's block `blocks[0]` is: 0, unless this is a later pipeline stage, whose `x`
    /// the backend has filled with the stage before's output.
    pub first_block: usize,
    /// Consecutive blocks from `first_block`.
    pub blocks: &'w [BlockWeights<W>],
}

/// What a job keeps of each pass: the layers and the hook sites.
#[derive(Debug, Clone, Copy)]
pub struct Keeps<'a> {
    /// The kept blocks; the pass stops after the deepest.
    pub layers: &'a Layers,
    /// The sites kept of each kept block.
    pub sites: &'a Sites,
}

impl Keeps<'_> {
    /// The capture slot of `site` in model block `index`, if it is kept.
    pub fn slot(&self, site: Site, index: usize) -> Option<usize> {
        Some(self.sites.position(site)? * self.layers.len() + self.layers.position(index)?)
    }

    /// The route slot of model block `index`: its place among the kept sparse blocks, when
    /// the router is kept and it is one.
    pub fn route_slot(&self, config: &ModelConfig, index: usize) -> Option<usize> {
        self.sites.router()?;
        if !config.is_sparse(index) {
            return None;
        }
        let position = self.layers.position(index)?;
        let before = &self.layers.as_slice()[..position];
        Some(before.iter().filter(|&&l| config.is_sparse(l)).count())
    }
}

/// One forward pass over the batch: the embedding on the first stage (scaled by the model's
/// embedding scale), then every block of `stack` up to the deepest kept one, each site kept
/// into its slot of the whole job's capture.
pub fn forward<'w, W: Form, O: BlockOps<'w, W>>(
    ops: &mut O,
    stack: Stack<'w, W>,
    keeps: Keeps<'_>,
) -> Result<()> {
    let config = stack.config;
    if stack.first_block == 0 {
        ops.embed(config.embedding_scale())?;
    }
    let deepest = keeps.layers.deepest();
    for (local, weights) in stack.blocks.iter().enumerate() {
        let index = stack.first_block + local;
        if index > deepest {
            break;
        }
        let slot = |site| keeps.slot(site, index);
        let route = keeps.route_slot(config, index);
        block(ops, weights, Layer::of(config, index), slot, route)?;
    }
    Ok(())
}

/// Runs one block on the batch: `x` gains the attention output, then the MLP output. `slot`
/// gives the capture slot of each site it keeps, `route` the route slot of its expert
/// choices when they are kept.
pub fn block<'w, W: Form, O: BlockOps<'w, W>>(
    ops: &mut O,
    w: &'w BlockWeights<W>,
    layer: Layer,
    slot: impl Fn(Site) -> Option<usize>,
    route: Option<usize>,
) -> Result<()> {
    if let Some(slot) = slot(Site::ResidPre) {
        ops.keep(Source::Residual, slot)?;
    }
    ops.norm(&w.attn_norm, Sublayer::Attention)?;
    ops.qkv(&w.qkv, w.qkv_bias.as_ref())?;
    if let Some(norms) = &w.head_norms {
        ops.head_norms(norms)?;
    }
    if layer.rotary {
        ops.rope()?;
    }
    ops.attention(layer.window)?;
    if let Some(gate) = &w.attn_gate {
        ops.attention_gate(gate)?;
    }
    let norms = w.branch_norms.as_ref();
    let attention = Join {
        weight: &w.o,
        bias: w.o_bias.as_ref(),
        norm: norms.map(|n| &n.attention),
        kept: slot(Site::AttnOut),
    };
    attention.run(ops, Sublayer::Attention)?;
    if let Some(slot) = slot(Site::ResidMid) {
        ops.keep(Source::Residual, slot)?;
    }
    ops.norm(&w.mlp_norm, Sublayer::Mlp)?;
    let mlp = Join {
        weight: &w.down,
        bias: None,
        norm: norms.map(|n| &n.mlp),
        kept: slot(Site::MlpOut),
    };
    match &w.moe {
        None => {
            ops.gate_up(&w.gate_up, layer.mlp_width)?;
            ops.swiglu()?;
            mlp.run(ops, Sublayer::Mlp)?;
        }
        Some(moe) => {
            if layer.mlp_width > 0 {
                ops.gate_up(&w.gate_up, layer.mlp_width)?;
                ops.swiglu()?;
                ops.output_apart(&w.down, None, Sublayer::Mlp)?;
            } else {
                ops.clear_branch()?;
            }
            ops.routed_experts(moe, &w.mlp_norm, route)?;
            mlp.finish(ops)?;
        }
    }
    if let Some(slot) = slot(Site::ResidPost) {
        ops.keep(Source::Residual, slot)?;
    }
    Ok(())
}

/// How a sublayer's output joins the residual stream.
struct Join<'w, W: Form> {
    weight: &'w W::Matrix,
    bias: Option<&'w W::Bias>,
    norm: Option<&'w W::Norm>,
    /// Its capture slot, when its site is kept.
    kept: Option<usize>,
}

impl<'w, W: Form> Join<'w, W> {
    /// The output projection, added into `x`: in its GEMM when nothing needs it apart.
    fn run<O: BlockOps<'w, W>>(&self, ops: &mut O, sublayer: Sublayer) -> Result<()> {
        if self.kept.is_none() && self.bias.is_none() && self.norm.is_none() {
            return ops.output_into_residual(self.weight, sublayer);
        }
        ops.output_apart(self.weight, self.bias, sublayer)?;
        self.finish(ops)
    }

    /// The branch, complete: normed, kept, added.
    fn finish<O: BlockOps<'w, W>>(&self, ops: &mut O) -> Result<()> {
        if let Some(norm) = self.norm {
            ops.branch_norm(norm)?;
        }
        if let Some(slot) = self.kept {
            ops.keep(Source::Branch, slot)?;
        }
        ops.add_branch()
    }
}

#[cfg(test)]
mod tests;
