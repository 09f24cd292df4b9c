//! The CPU backend's block ops ([`BlockOps`], [`AfmoeOps`]): the model file
//! (`crate::model::dense`, `crate::model::afmoe`) decides the order, the sites and the rounding
//! points; these run each op on the CPU's kernels, in f32 or in the bf16 mode. Two fusions stay
//! behind the ops, each leaving the bits as they were:
//! - the QKV rows' steps (bias and rounding, AFMoE's head norms, RoPE) run in one pass over the
//!   rows when attention needs them ([`CpuOps::finish_qkv`]);
//! - where the MLP's norm writes bits, the attention branch is added to `x` by that norm, row by
//!   row in cache ([`kernels::add_rms_norm_bits_rows`]), unless a site reads `x` before it.

use rayon::prelude::*;

use super::attention::{self, AttentionShape};
use super::matmul::MatRef;
use super::{
    Bf16Block, Pass, ROWS_PER_TASK, Scratch, add_rows, bf16, head_norms, kernels, moe, project,
    project_rounded, project_to_bits, rounds_ahead, rows_pass, rows_pass_bits, sgemm,
};
use crate::backend::Captured;
use crate::error::Result;
use crate::model::BlockWeights;
use crate::model::afmoe::AfmoeOps;
use crate::model::dense::{BlockOps, Source, Sublayer};
use crate::projection::Directions;

/// The QKV rows' steps asked for since the product, run together by attention.
#[derive(Debug, Default, Clone, Copy)]
struct QkvSteps {
    head_norms: bool,
    rope: bool,
}

/// One block's ops over the batch's scratch buffers.
pub(super) struct CpuOps<'p, 's> {
    pub pass: &'p Pass<'p>,
    pub s: &'s mut Scratch,
    /// The block's weights, and in bf16 mode their bf16 bits.
    pub weights: &'p BlockWeights,
    pub w16: Option<&'p Bf16Block>,
    /// Where kept sites go, and the directions a projecting job keeps instead.
    pub out: &'s mut Captured,
    pub directions: Option<&'p Directions>,
    qkv_steps: QkvSteps,
    /// The attention branch waits for the MLP's norm to add it ([`Self::add_in_norm`]).
    branch_pending: bool,
    /// The last output projection written to the branch.
    last_output: Sublayer,
    /// Whether the gate|up product stored its outputs as bits (`s.gate_up_bits`).
    gate_up_bits: bool,
}

impl<'p, 's> CpuOps<'p, 's> {
    pub fn new(
        pass: &'p Pass<'p>,
        s: &'s mut Scratch,
        (weights, w16): (&'p BlockWeights, Option<&'p Bf16Block>),
        (out, directions): (&'s mut Captured, Option<&'p Directions>),
    ) -> Self {
        Self {
            pass,
            s,
            weights,
            w16,
            out,
            directions,
            qkv_steps: QkvSteps::default(),
            branch_pending: false,
            last_output: Sublayer::Attention,
            gate_up_bits: false,
        }
    }

    /// Whether the MLP's norm adds the attention branch itself: where it writes bits, in a
    /// dense block (an AFMoE branch is normed first).
    fn add_in_norm(&self) -> bool {
        self.weights.afmoe.is_none() && rounds_ahead(self.w16)
    }

    /// Adds a pending attention branch now: a site reads `x` before the MLP's norm.
    fn settle_branch(&mut self) {
        if std::mem::take(&mut self.branch_pending) {
            add_rows(&mut self.s.x, &self.s.branch, self.pass.config.hidden_size);
        }
    }

    /// Readies the QKV rows for attention in one parallel pass: the bias, the head norms and
    /// RoPE as asked, rounding to bf16 after each step in bf16 mode. Given `bits`, also writes
    /// the finished rows there as bf16 bits and returns them; attention then reads Q and K
    /// from the bits alone, so the last step that changes only Q and K leaves its rounding to
    /// the bits.
    fn finish_qkv<'b>(&mut self, bits: Option<&'b mut [u16]>) -> Option<&'b [u16]> {
        let (pass, block) = (self.pass, self.weights);
        let c = pass.config;
        let steps = std::mem::take(&mut self.qkv_steps);
        let rounding = self.w16.is_some();
        let (qkv_width, eps) = (c.qkv_width(), c.rms_norm_eps as f32);
        let heads = (c.num_heads, c.num_kv_heads, c.head_dim);
        let qk_norm = block
            .afmoe
            .as_ref()
            .filter(|_| steps.head_norms)
            .map(|a| (&a.q_norm[..], &a.k_norm[..]));
        let rotary = steps.rope;
        let (cos, sin) = (&pass.rope.cos, &pass.rope.sin);
        let bits_round_qk = bits.is_some();
        let finish = |rows: &mut [f32], positions: &[u32]| {
            if let Some(bias) = &block.qkv_bias {
                kernels::add_bias_rows(rows, bias);
            }
            // V's only rounding, and Q's and K's until a later step changes them.
            if rounding {
                bf16::round_rows(rows);
            }
            if let Some(norms) = qk_norm {
                head_norms(rows, heads, norms, eps);
                if rounding && (rotary || !bits_round_qk) {
                    bf16::round_rows(rows);
                }
            }
            if rotary {
                let rotated = heads.0 + heads.1;
                kernels::rope_rows(rows, qkv_width, rotated, heads.2, positions, cos, sin);
                if rounding && !bits_round_qk {
                    bf16::round_rows(rows);
                }
            }
        };
        let chunk = qkv_width * ROWS_PER_TASK;
        let qkv = &mut self.s.qkv[..pass.tokens * qkv_width];
        let positions = pass.batch.positions.par_chunks(ROWS_PER_TASK);
        let Some(bits) = bits else {
            qkv.par_chunks_mut(chunk)
                .zip(positions)
                .for_each(|(rows, positions)| finish(rows, positions));
            return None;
        };
        let bits = &mut bits[..qkv.len()];
        qkv.par_chunks_mut(chunk)
            .zip(bits.par_chunks_mut(chunk))
            .zip(positions)
            .for_each(|((rows, bits), positions)| {
                finish(rows, positions);
                // Rounds Q and K after their last step, as `finish` would have; exact for V.
                kernels::bf16_bits_rows(rows, bits);
            });
        Some(bits)
    }
}

impl BlockOps for CpuOps<'_, '_> {
    type Block = BlockWeights;

    fn norm(&mut self, block: &BlockWeights, sublayer: Sublayer) -> Result<()> {
        let (c, tokens) = (self.pass.config, self.pass.tokens);
        let (hidden, eps) = (c.hidden_size, c.rms_norm_eps as f32);
        let weight = match sublayer {
            Sublayer::Attention => &block.attn_norm,
            Sublayer::Mlp => &block.mlp_norm,
        };
        let s = &mut *self.s;
        if std::mem::take(&mut self.branch_pending) {
            let bits = &mut s.gemm.input_bf16;
            bits.resize(tokens * hidden, 0);
            let chunk = hidden * ROWS_PER_TASK;
            let x = &mut s.x[..tokens * hidden];
            x.par_chunks_mut(chunk)
                .zip(s.branch.par_chunks(chunk))
                .zip(bits.par_chunks_mut(chunk))
                .for_each(|((x, branch), b)| {
                    kernels::add_rms_norm_bits_rows(x, branch, weight, eps, b);
                });
        } else if rounds_ahead(self.w16) {
            rows_pass_bits(&s.x, hidden, &mut s.gemm.input_bf16, hidden, |x, b| {
                kernels::rms_norm_bits_rows(x, weight, eps, b);
            });
        } else {
            rows_pass(&s.x, hidden, &mut s.normed, hidden, |x, y| {
                kernels::rms_norm_rows(x, weight, eps, y);
            });
        }
        Ok(())
    }

    fn qkv(&mut self, block: &BlockWeights) -> Result<()> {
        let (c, tokens) = (self.pass.config, self.pass.tokens);
        let (hidden, qkv_width) = (c.hidden_size, c.qkv_width());
        let s = &mut *self.s;
        match self.w16.filter(|_| rounds_ahead(self.w16)) {
            Some(w16) => {
                let weight = (&block.qkv, &w16.qkv);
                project_rounded(hidden, weight, &mut s.qkv, qkv_width, false, &mut s.gemm);
            }
            None => {
                let normed = MatRef::dense(&s.normed, tokens, hidden);
                let qkv16 = self.w16.map(|w| &w.qkv);
                let (qkv, gemm) = (&mut s.qkv, &mut s.gemm);
                project(normed, &block.qkv, qkv16, qkv, qkv_width, false, gemm);
            }
        }
        self.qkv_steps = QkvSteps::default();
        Ok(())
    }

    fn rope(&mut self) -> Result<()> {
        self.qkv_steps.rope = true;
        Ok(())
    }

    fn attention(&mut self, window: Option<usize>) -> Result<()> {
        let (c, tokens) = (self.pass.config, self.pass.tokens);
        let shape = AttentionShape {
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            window,
        };
        let ahead = rounds_ahead(self.w16);
        let mut qkv_bf16 = std::mem::take(&mut self.s.qkv_bf16);
        let qk_bits = (ahead && attention::scores_from_bits(shape)).then(|| {
            qkv_bf16.resize(tokens * c.qkv_width(), 0);
            &mut qkv_bf16[..]
        });
        let qk_bits = self.finish_qkv(qk_bits);
        let s = &mut *self.s;
        let attn_width = c.num_heads * c.head_dim;
        let out_bits = ahead.then(|| {
            s.gemm.input_bf16.resize(tokens * attn_width, 0);
            &mut s.gemm.input_bf16[..]
        });
        let (keys, out) = (&mut s.keys, &mut s.attn[..]);
        attention::attention(
            &s.qkv,
            qk_bits,
            self.pass.batch,
            shape,
            keys,
            (out, out_bits),
        );
        s.qkv_bf16 = qkv_bf16;
        Ok(())
    }

    fn gate_up(&mut self, block: &BlockWeights) -> Result<()> {
        let (c, tokens) = (self.pass.config, self.pass.tokens);
        let (hidden, inter) = (c.hidden_size, block.down.cols());
        let s = &mut *self.s;
        let gate_up = &mut s.gate_up[..tokens * 2 * inter];
        // bf16 mode rounds the gate|up output before SwiGLU: where the product's sums are
        // whole in registers, it stores them rounded, and they never exist in f32 (half the
        // bytes written, and read back).
        self.gate_up_bits = false;
        match self.w16.filter(|_| rounds_ahead(self.w16)) {
            Some(w16) if bf16::rounds_output(hidden) => {
                let bits = &mut s.gate_up_bits;
                bits.resize(tokens * 2 * inter, 0);
                let weight = (&block.gate_up, &w16.gate_up);
                project_to_bits(hidden, weight, (bits, 2 * inter), &mut s.gemm);
                self.gate_up_bits = true;
            }
            Some(w16) => {
                let weight = (&block.gate_up, &w16.gate_up);
                project_rounded(hidden, weight, gate_up, 2 * inter, false, &mut s.gemm);
            }
            None => {
                let normed = MatRef::dense(&s.normed, tokens, hidden);
                let gate_up16 = self.w16.map(|w| &w.gate_up);
                let (w, gemm) = (&block.gate_up, &mut s.gemm);
                project(normed, w, gate_up16, gate_up, 2 * inter, false, gemm);
            }
        }
        Ok(())
    }

    fn swiglu(&mut self) -> Result<()> {
        let tokens = self.pass.tokens;
        let inter = self.weights.down.cols();
        let s = &mut *self.s;
        let gate_up = &s.gate_up[..tokens * 2 * inter];
        if !rounds_ahead(self.w16) {
            let act = &mut s.act[..tokens * inter];
            // bf16 mode rounds the gate|up output: as SwiGLU reads it.
            let rounded_inputs = self.w16.is_some();
            rows_pass(gate_up, 2 * inter, act, inter, |gu, act| {
                if rounded_inputs {
                    kernels::silu_mul_bf16_inputs_rows(gu, inter, act);
                } else {
                    kernels::silu_mul_rows(gu, inter, act);
                }
            });
            return Ok(());
        }
        let bits = &mut s.gemm.input_bf16;
        if self.gate_up_bits {
            bits.resize(tokens * inter, 0);
            bits.par_chunks_mut(inter * ROWS_PER_TASK)
                .zip(s.gate_up_bits.par_chunks(2 * inter * ROWS_PER_TASK))
                .for_each(|(b, gu)| kernels::silu_mul_bits_rows(gu, inter, b));
        } else {
            rows_pass_bits(gate_up, 2 * inter, bits, inter, |gu, b| {
                kernels::silu_mul_bf16_bits_rows(gu, inter, b);
            });
        }
        Ok(())
    }

    fn output_into_residual(&mut self, block: &BlockWeights, sublayer: Sublayer) -> Result<()> {
        // The CPU's products write the branch, then add it: the same f32 addition.
        self.output_apart(block, sublayer)?;
        self.add_branch()
    }

    fn output_apart(&mut self, block: &BlockWeights, sublayer: Sublayer) -> Result<()> {
        let (c, tokens) = (self.pass.config, self.pass.tokens);
        let hidden = c.hidden_size;
        let ahead = rounds_ahead(self.w16);
        let w16 = self.w16.map(|w| match sublayer {
            Sublayer::Attention => &w.o,
            Sublayer::Mlp => &w.down,
        });
        let s = &mut *self.s;
        let (input, w, k) = match sublayer {
            Sublayer::Attention => (&s.attn, &block.o, c.num_heads * c.head_dim),
            Sublayer::Mlp => (&s.act, &block.down, block.down.cols()),
        };
        match w16.filter(|_| ahead) {
            // The pass before rounded the input into `s.gemm.input_bf16`.
            Some(w16) => project_rounded(k, (w, w16), &mut s.branch, hidden, false, &mut s.gemm),
            None => {
                let input = MatRef::dense(&input[..tokens * k], tokens, k);
                project(input, w, w16, &mut s.branch, hidden, false, &mut s.gemm);
            }
        }
        if let (Some(bias), Sublayer::Attention) = (&block.o_bias, sublayer) {
            s.branch
                .par_chunks_mut(hidden * ROWS_PER_TASK)
                .for_each(|rows| kernels::add_bias_rows(rows, bias));
        }
        self.last_output = sublayer;
        Ok(())
    }

    fn output_bias(&self, block: &BlockWeights, sublayer: Sublayer) -> bool {
        sublayer == Sublayer::Attention && block.o_bias.is_some()
    }

    fn add_branch(&mut self) -> Result<()> {
        if self.last_output == Sublayer::Attention && self.add_in_norm() {
            self.branch_pending = true;
        } else {
            add_rows(&mut self.s.x, &self.s.branch, self.pass.config.hidden_size);
        }
        Ok(())
    }

    fn keep(&mut self, source: Source, slot: usize) -> Result<()> {
        if source == Source::Residual {
            self.settle_branch();
        }
        let (c, tokens) = (self.pass.config, self.pass.tokens);
        let hidden = c.hidden_size;
        let values = match source {
            Source::Residual => &self.s.x,
            Source::Branch => &self.s.branch,
        };
        let values = &values[..tokens * hidden];
        let dst = self.out.layer_mut(slot);
        match self.directions {
            None => dst.copy_from_slice(values),
            Some(directions) => {
                let x = MatRef::dense(values, tokens, hidden);
                let units = MatRef::dense(directions.unit_vectors(), directions.count(), hidden);
                sgemm::product(x, &units, dst, directions.count(), false);
            }
        }
        Ok(())
    }
}

impl AfmoeOps for CpuOps<'_, '_> {
    fn head_norms(&mut self, _: &BlockWeights) -> Result<()> {
        self.qkv_steps.head_norms = true;
        Ok(())
    }

    fn attention_gate(&mut self, block: &BlockWeights) -> Result<()> {
        let Some(a) = &block.afmoe else {
            return Ok(());
        };
        let (c, tokens) = (self.pass.config, self.pass.tokens);
        let (hidden, attn_width) = (c.hidden_size, c.num_heads * c.head_dim);
        let s = &mut *self.s;
        // AFMoE runs in f32 only (see `CpuBackend::new`), so `normed` holds the norm.
        let normed = MatRef::dense(&s.normed, tokens, hidden);
        let gate = &mut s.gate[..tokens * attn_width];
        project(
            normed,
            &a.attn_gate,
            None,
            gate,
            attn_width,
            false,
            &mut s.gemm,
        );
        let attn = &mut s.attn[..tokens * attn_width];
        rows_pass(gate, attn_width, attn, attn_width, |g, a| {
            kernels::sigmoid_gate_rows(a, g);
        });
        Ok(())
    }

    fn branch_norm(&mut self, block: &BlockWeights, sublayer: Sublayer) -> Result<()> {
        let Some(a) = &block.afmoe else {
            return Ok(());
        };
        let weight = match sublayer {
            Sublayer::Attention => &a.attn_out_norm,
            Sublayer::Mlp => &a.mlp_out_norm,
        };
        let c = self.pass.config;
        let (hidden, eps) = (c.hidden_size, c.rms_norm_eps as f32);
        let s = &mut *self.s;
        // `s.normed` is free by then: the norm writes there, and the two swap.
        rows_pass(&s.branch, hidden, &mut s.normed, hidden, |x, y| {
            kernels::rms_norm_rows(x, weight, eps, y);
        });
        std::mem::swap(&mut s.branch, &mut s.normed);
        Ok(())
    }

    fn clear_branch(&mut self) -> Result<()> {
        let n = self.pass.tokens * self.pass.config.hidden_size;
        self.s.branch[..n].fill(0.0);
        Ok(())
    }

    fn routed_experts(&mut self, block: &BlockWeights, route: Option<usize>) -> Result<()> {
        let moe_weights = block.afmoe.as_ref().and_then(|a| a.moe.as_ref());
        let (Some(weights), Some(config)) = (moe_weights, &self.pass.config.afmoe) else {
            return Ok(());
        };
        let (tokens, hidden) = (self.pass.tokens, self.pass.config.hidden_size);
        let routed = moe::Routed { weights, config };
        let s = &mut *self.s;
        routed.add_to(
            &s.normed,
            (tokens, hidden),
            &mut s.branch,
            &mut s.moe,
            &mut s.gemm,
        );
        if let Some(slot) = route {
            routed.record(&s.moe, &mut self.out.routes, slot);
        }
        Ok(())
    }
}
