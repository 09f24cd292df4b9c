//! The AFMoE decoder block (`AfmoeForCausalLM`, Arcee's Trinity), written once over
//! [`AfmoeOps`]: the dense block's ops ([`BlockOps`]) and the five AFMoE adds. As in
//! [`super::dense`], the order of the ops, the hook sites and the rounding points live here;
//! a backend only decides how each op runs.
//!
//! ```text
//! x ─► [resid_pre] ─► norm ─► QKV ─► head norms ─► (rope, in rotary blocks) ─► attention
//!   ─► × sigmoid(gate) ─► O ─► branch norm ─► [attn_out] ──(+)─► [resid_mid]
//!   ─► norm ─► shared MLP (or 0) ─► (+ routed experts, in sparse blocks) ─► branch norm
//!   ─► [mlp_out] ──(+)─► [resid_post]
//! ```
//! Both branches always go through the branch buffer: each is normed before it joins `x`.

use harvest_core::Site;

use super::ModelConfig;
use super::dense::{BlockOps, Source, Sublayer};
use crate::error::Result;

/// What an AFMoE block adds to the dense block's ops.
pub trait AfmoeOps: BlockOps {
    /// RMSNorm of every query head (`q_norm`) and key head (`k_norm`) of `qkv`, in place, bf16.
    fn head_norms(&mut self, block: &Self::Block) -> Result<()>;
    /// `attn = attn · sigmoid(normed · Wgateᵀ)`, `normed` still the attention's input norm;
    /// the gate's product is bf16, the result rounded to bf16.
    fn attention_gate(&mut self, block: &Self::Block) -> Result<()>;
    /// `branch = rms_norm(branch) · weight` of `sublayer`'s output norm, f32.
    fn branch_norm(&mut self, block: &Self::Block, sublayer: Sublayer) -> Result<()>;
    /// `branch = 0`: a sparse block with no shared experts.
    fn clear_branch(&mut self) -> Result<()>;
    /// `branch += Σ weight · expert(normed)` over each token's routed experts. The router reads
    /// `rms_norm(x)` in f32 (bf16 rounding moves tokens to other experts), its logits are f32,
    /// and the choice is [`super::routing::choose`]; the experts read the bf16 `normed`. With
    /// `route`, the choices (and logits) are also kept in that route slot of the capture
    /// ([`crate::backend::Routes::record`]).
    fn routed_experts(&mut self, block: &Self::Block, route: Option<usize>) -> Result<()>;
}

/// What differs between AFMoE blocks, read off the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AfmoeLayer {
    /// The sliding attention window, if any.
    pub window: Option<usize>,
    /// Whether the block rotates Q and K.
    pub rotary: bool,
    /// Whether the MLP has routed experts.
    pub sparse: bool,
    /// Whether it has a dense MLP or shared experts.
    pub shared_mlp: bool,
}

impl AfmoeLayer {
    /// Block `index` of `config`.
    pub fn of(config: &ModelConfig, index: usize) -> Self {
        Self {
            window: config.attention_windows[index],
            rotary: config.rotary[index],
            sparse: config.is_sparse(index),
            shared_mlp: config.mlp_width(index) > 0,
        }
    }
}

/// Runs one AFMoE block on the batch; `slot` gives the capture slot of each site it keeps,
/// `route` the route slot of its expert choices when they are kept.
pub fn block<O: AfmoeOps>(
    ops: &mut O,
    block: &O::Block,
    layer: AfmoeLayer,
    slot: impl Fn(Site) -> Option<usize>,
    route: Option<usize>,
) -> Result<()> {
    let keep = |ops: &mut O, site: Site, source: Source| match slot(site) {
        Some(slot) => ops.keep(source, slot),
        None => Ok(()),
    };
    keep(ops, Site::ResidPre, Source::Residual)?;
    ops.norm(block, Sublayer::Attention)?;
    ops.qkv(block)?;
    ops.head_norms(block)?;
    if layer.rotary {
        ops.rope()?;
    }
    ops.attention(layer.window)?;
    ops.attention_gate(block)?;
    ops.output_apart(block, Sublayer::Attention)?;
    ops.branch_norm(block, Sublayer::Attention)?;
    keep(ops, Site::AttnOut, Source::Branch)?;
    ops.add_branch()?;
    keep(ops, Site::ResidMid, Source::Residual)?;
    ops.norm(block, Sublayer::Mlp)?;
    if layer.shared_mlp {
        ops.gate_up(block)?;
        ops.swiglu()?;
        ops.output_apart(block, Sublayer::Mlp)?;
    } else {
        ops.clear_branch()?;
    }
    if layer.sparse {
        ops.routed_experts(block, route)?;
    }
    ops.branch_norm(block, Sublayer::Mlp)?;
    keep(ops, Site::MlpOut, Source::Branch)?;
    ops.add_branch()?;
    keep(ops, Site::ResidPost, Source::Residual)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records the ops it is asked to run.
    #[derive(Default)]
    struct Log(Vec<String>);

    impl Log {
        fn push(&mut self, op: impl Into<String>) -> Result<()> {
            self.0.push(op.into());
            Ok(())
        }
    }

    impl BlockOps for Log {
        type Block = ();
        fn norm(&mut self, _: &(), sublayer: Sublayer) -> Result<()> {
            self.push(format!("norm {sublayer:?}"))
        }
        fn qkv(&mut self, _: &()) -> Result<()> {
            self.push("qkv")
        }
        fn rope(&mut self) -> Result<()> {
            self.push("rope")
        }
        fn attention(&mut self, window: Option<usize>) -> Result<()> {
            self.push(format!("attention {window:?}"))
        }
        fn gate_up(&mut self, _: &()) -> Result<()> {
            self.push("gate_up")
        }
        fn swiglu(&mut self) -> Result<()> {
            self.push("swiglu")
        }
        fn output_into_residual(&mut self, _: &(), sublayer: Sublayer) -> Result<()> {
            self.push(format!("x += {sublayer:?}"))
        }
        fn output_apart(&mut self, _: &(), sublayer: Sublayer) -> Result<()> {
            self.push(format!("branch = {sublayer:?}"))
        }
        fn output_bias(&self, _: &(), _: Sublayer) -> bool {
            false
        }
        fn add_branch(&mut self) -> Result<()> {
            self.push("x += branch")
        }
        fn keep(&mut self, source: Source, slot: usize) -> Result<()> {
            self.push(format!("keep {source:?} in {slot}"))
        }
    }

    impl AfmoeOps for Log {
        fn head_norms(&mut self, _: &()) -> Result<()> {
            self.push("head norms")
        }
        fn attention_gate(&mut self, _: &()) -> Result<()> {
            self.push("gate")
        }
        fn branch_norm(&mut self, _: &(), sublayer: Sublayer) -> Result<()> {
            self.push(format!("branch norm {sublayer:?}"))
        }
        fn clear_branch(&mut self) -> Result<()> {
            self.push("branch = 0")
        }
        fn routed_experts(&mut self, _: &(), route: Option<usize>) -> Result<()> {
            match route {
                Some(slot) => self.push(format!("branch += experts, routes in {slot}")),
                None => self.push("branch += experts"),
            }
        }
    }

    const DENSE_FULL: AfmoeLayer = AfmoeLayer {
        window: None,
        rotary: false,
        sparse: false,
        shared_mlp: true,
    };

    #[test]
    fn a_full_attention_dense_block_skips_rope_and_norms_both_branches_before_they_join() {
        let mut log = Log::default();
        block(&mut log, &(), DENSE_FULL, |_| None, Some(0)).unwrap();
        assert_eq!(
            log.0,
            [
                "norm Attention",
                "qkv",
                "head norms",
                "attention None",
                "gate",
                "branch = Attention",
                "branch norm Attention",
                "x += branch",
                "norm Mlp",
                "gate_up",
                "swiglu",
                "branch = Mlp",
                "branch norm Mlp",
                "x += branch"
            ]
        );
    }

    #[test]
    fn a_sliding_sparse_block_rotates_and_adds_its_experts_to_the_shared_ones_before_the_norm() {
        let mut log = Log::default();
        let layer = AfmoeLayer {
            window: Some(6),
            rotary: true,
            sparse: true,
            ..DENSE_FULL
        };
        let slot = |site: Site| Site::ALL.iter().position(|&s| s == site);
        block(&mut log, &(), layer, slot, Some(1)).unwrap();
        let ops: Vec<&str> = log.0.iter().map(String::as_str).collect();
        assert_eq!(ops[3..6], ["head norms", "rope", "attention Some(6)"]);
        assert_eq!(ops[8..10], ["branch norm Attention", "keep Branch in 1"]);
        assert_eq!(
            ops[ops.len() - 7..],
            [
                "swiglu",
                "branch = Mlp",
                "branch += experts, routes in 1",
                "branch norm Mlp",
                "keep Branch in 3",
                "x += branch",
                "keep Residual in 4"
            ]
        );
    }

    #[test]
    fn a_sparse_block_without_shared_experts_starts_its_branch_at_zero() {
        let mut log = Log::default();
        let layer = AfmoeLayer {
            sparse: true,
            shared_mlp: false,
            ..DENSE_FULL
        };
        block(&mut log, &(), layer, |_| None, None).unwrap();
        let ops: Vec<&str> = log.0.iter().map(String::as_str).collect();
        assert_eq!(
            ops[ops.len() - 5..],
            [
                "norm Mlp",
                "branch = 0",
                "branch += experts",
                "branch norm Mlp",
                "x += branch"
            ]
        );
    }
}
