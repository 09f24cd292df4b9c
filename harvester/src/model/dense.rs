//! The dense decoder block (Llama's layout: Mistral and Qwen2 differ only in what an op does),
//! written once as a sequence of block operations over [`BlockOps`]. A backend decides how each
//! op runs (which kernel, fused with what, on which device); the order of the ops, where the
//! hook sites are taken and which values are rounded live here alone. The CUDA backend runs
//! it on a GPU (`backend::cuda::forward`) and replayed on the CPU (`backend::cuda::replay`,
//! `--device cuda-replay`), so what a test checks on the replay is the sequence the GPU runs.
//!
//! ```text
//! x ─► [resid_pre] ─► norm ─► QKV ─► rope ─► attention ─► O ──(+)─► [resid_mid]
//!   ─► norm ─► gate|up ─► SwiGLU ─► down ──(+)─► [resid_post]
//! ```
//! A branch (O, down) adds into `x` in its GEMM when its output is not kept and has no bias;
//! when it is kept (`attn_out`, `mlp_out`) or has a bias, it is written apart (bias added),
//! kept, then added: one f32 addition to `x` either way, so a site kept or not leaves the
//! stream's bits as they were.

use harvest_core::Site;

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

/// The operations of a dense block. Each reads and writes the backend's own buffers for the
/// batch; the comments give the dataflow and the dtype each result is stored in.
pub trait BlockOps {
    /// One block's weights as the backend holds them.
    type Block;

    /// `normed = rms_norm(x) · weight` of `sublayer`'s norm, rounded to bf16.
    fn norm(&mut self, block: &Self::Block, sublayer: Sublayer) -> Result<()>;
    /// `qkv = normed · Wqkvᵀ (+ bias)`, summed in f32 and rounded once to bf16.
    fn qkv(&mut self, block: &Self::Block) -> Result<()>;
    /// Rotates the query and key heads of `qkv` in place, bf16.
    fn rope(&mut self) -> Result<()>;
    /// `attn = attention(qkv)`, causal grouped-query attention over each sequence, bf16; with a
    /// `window`, each query sees only the `window` keys up to and including itself.
    fn attention(&mut self, window: Option<usize>) -> Result<()>;
    /// `gate_up = normed · Wgate|upᵀ`, bf16.
    fn gate_up(&mut self, block: &Self::Block) -> Result<()>;
    /// `act = silu(gate) · up`, bf16.
    fn swiglu(&mut self) -> Result<()>;
    /// `x += input · Wᵀ` for `sublayer`'s output projection, summed in f32.
    fn output_into_residual(&mut self, block: &Self::Block, sublayer: Sublayer) -> Result<()>;
    /// `branch = input · Wᵀ (+ bias)` for `sublayer`'s output projection, f32.
    fn output_apart(&mut self, block: &Self::Block, sublayer: Sublayer) -> Result<()>;
    /// Whether `sublayer`'s output projection has a bias (Llama's `attention_bias`).
    fn output_bias(&self, block: &Self::Block, sublayer: Sublayer) -> bool;
    /// `x += branch`.
    fn add_branch(&mut self) -> Result<()>;
    /// Writes `source` into capture slot `slot`: rounded to bf16, or its projections when the
    /// job projects.
    fn keep(&mut self, source: Source, slot: usize) -> Result<()>;
}

/// Runs one dense block on the batch: `x` gains the attention output, then the MLP output.
/// `window` is the block's sliding attention window (`ModelConfig::attention_windows`), and
/// `slot` gives the capture slot of each site this block keeps.
pub fn block<O: BlockOps>(
    ops: &mut O,
    block: &O::Block,
    window: Option<usize>,
    slot: impl Fn(Site) -> Option<usize>,
) -> Result<()> {
    if let Some(slot) = slot(Site::ResidPre) {
        ops.keep(Source::Residual, slot)?;
    }
    ops.norm(block, Sublayer::Attention)?;
    ops.qkv(block)?;
    ops.rope()?;
    ops.attention(window)?;
    join(ops, block, Sublayer::Attention, slot(Site::AttnOut))?;
    if let Some(slot) = slot(Site::ResidMid) {
        ops.keep(Source::Residual, slot)?;
    }
    ops.norm(block, Sublayer::Mlp)?;
    ops.gate_up(block)?;
    ops.swiglu()?;
    join(ops, block, Sublayer::Mlp, slot(Site::MlpOut))?;
    if let Some(slot) = slot(Site::ResidPost) {
        ops.keep(Source::Residual, slot)?;
    }
    Ok(())
}

/// Adds `sublayer`'s output into `x`; kept into `kept` on the way when it is a kept site.
fn join<O: BlockOps>(
    ops: &mut O,
    block: &O::Block,
    sublayer: Sublayer,
    kept: Option<usize>,
) -> Result<()> {
    if kept.is_none() && !ops.output_bias(block, sublayer) {
        return ops.output_into_residual(block, sublayer);
    }
    ops.output_apart(block, sublayer)?;
    if let Some(slot) = kept {
        ops.keep(Source::Branch, slot)?;
    }
    ops.add_branch()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records the ops it is asked to run; a block says whether its O projection has a bias.
    #[derive(Default)]
    struct Log(Vec<String>);

    impl BlockOps for Log {
        type Block = bool;
        fn norm(&mut self, _: &bool, sublayer: Sublayer) -> Result<()> {
            self.0.push(format!("norm {sublayer:?}"));
            Ok(())
        }
        fn qkv(&mut self, _: &bool) -> Result<()> {
            self.0.push("qkv".into());
            Ok(())
        }
        fn rope(&mut self) -> Result<()> {
            self.0.push("rope".into());
            Ok(())
        }
        fn attention(&mut self, window: Option<usize>) -> Result<()> {
            self.0
                .push(window.map_or("attention".into(), |w| format!("attention, window {w}")));
            Ok(())
        }
        fn gate_up(&mut self, _: &bool) -> Result<()> {
            self.0.push("gate_up".into());
            Ok(())
        }
        fn swiglu(&mut self) -> Result<()> {
            self.0.push("swiglu".into());
            Ok(())
        }
        fn output_into_residual(&mut self, _: &bool, sublayer: Sublayer) -> Result<()> {
            self.0.push(format!("x += {sublayer:?}"));
            Ok(())
        }
        fn output_apart(&mut self, _: &bool, sublayer: Sublayer) -> Result<()> {
            self.0.push(format!("branch = {sublayer:?}"));
            Ok(())
        }
        fn add_branch(&mut self) -> Result<()> {
            self.0.push("x += branch".into());
            Ok(())
        }
        fn keep(&mut self, source: Source, slot: usize) -> Result<()> {
            self.0.push(format!("keep {source:?} in {slot}"));
            Ok(())
        }
        fn output_bias(&self, o_bias: &bool, sublayer: Sublayer) -> bool {
            *o_bias && sublayer == Sublayer::Attention
        }
    }

    #[test]
    fn a_block_keeping_no_site_adds_each_branch_in_its_projection() {
        let mut log = Log::default();
        block(&mut log, &false, None, |_| None).unwrap();
        assert_eq!(
            log.0,
            [
                "norm Attention",
                "qkv",
                "rope",
                "attention",
                "x += Attention",
                "norm Mlp",
                "gate_up",
                "swiglu",
                "x += Mlp"
            ]
        );
    }

    #[test]
    fn every_site_is_kept_where_the_block_computes_it_and_branches_are_kept_before_they_join() {
        let mut log = Log::default();
        let slot = |site: Site| Site::ALL.iter().position(|&s| s == site);
        block(&mut log, &false, Some(8), slot).unwrap();
        assert_eq!(
            log.0,
            [
                "keep Residual in 0",
                "norm Attention",
                "qkv",
                "rope",
                "attention, window 8",
                "branch = Attention",
                "keep Branch in 1",
                "x += branch",
                "keep Residual in 2",
                "norm Mlp",
                "gate_up",
                "swiglu",
                "branch = Mlp",
                "keep Branch in 3",
                "x += branch",
                "keep Residual in 4"
            ]
        );
    }

    #[test]
    fn an_output_projection_with_a_bias_joins_the_stream_through_the_branch_kept_or_not() {
        let mut log = Log::default();
        block(&mut log, &true, None, |_| None).unwrap();
        assert_eq!(
            log.0[4..7],
            ["branch = Attention", "x += branch", "norm Mlp"],
            "{:?}",
            log.0
        );
        assert_eq!(log.0.last().map(String::as_str), Some("x += Mlp"));
    }
}
