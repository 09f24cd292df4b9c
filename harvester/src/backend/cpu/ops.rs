//! The CPU backend's block ops ([`BlockOps`]): the model (`crate::model::block`) decides the
//! order, the sites and the rounding points and hands each op its weights; these run each op
//! on the CPU's kernels, in f32 or in the bf16 mode. Two fusions stay
//! behind the ops, each leaving the bits as they were:
//! - the QKV rows' steps (bias and rounding, AFMoE's head norms, RoPE) run in one pass over the
//!   rows when attention needs them ([`CpuOps::finish_qkv`]);
//! - where the MLP's norm writes bits, the attention branch is added to `x` by that norm, row by
//!   row in cache ([`kernels::add_rms_norm_bits_rows`]), unless a site reads `x` before it.

use rayon::prelude::*;

use super::attention::{self, AttentionShape};
use super::matmul::MatRef;
use super::{
    Cpu, CpuMatrix, Pass, ROWS_PER_TASK, Scratch, add_rows, bf16, head_norms, kernels, moe,
    project, project_rounded, project_to_bits, rows_pass, rows_pass_bits, sgemm,
};
use crate::backend::Captured;
use crate::error::Result;
use crate::model::block::{BlockOps, Source, Sublayer};
use crate::model::{HeadNorms, Matrix, MoeWeights};
use crate::projection::Directions;

/// The QKV rows' steps asked for since the product, run together by attention.
#[derive(Debug, Default, Clone, Copy)]
struct QkvSteps<'w> {
    bias: Option<&'w [f32]>,
    head_norms: Option<(&'w [f32], &'w [f32])>,
    rope: bool,
}

/// The forward pass's ops over the batch's scratch buffers, on weights that live for `'p`.
pub(super) struct CpuOps<'p, 's> {
    pass: &'p Pass<'p>,
    s: &'s mut Scratch,
    embed: &'p Matrix,
    /// Where kept sites go, and the directions a projecting job keeps instead.
    out: &'s mut Captured,
    directions: Option<&'p Directions>,
    qkv_steps: QkvSteps<'p>,
    /// The inner width of the last `gate_up`.
    mlp_width: usize,
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
        embed: &'p Matrix,
        (out, directions): (&'s mut Captured, Option<&'p Directions>),
    ) -> Self {
        Self {
            pass,
            s,
            embed,
            out,
            directions,
            qkv_steps: QkvSteps::default(),
            mlp_width: 0,
            branch_pending: false,
            last_output: Sublayer::Attention,
            gate_up_bits: false,
        }
    }

    /// Whether the MLP's norm adds the attention branch itself: where it writes bits, in a
    /// model without branch norms (AFMoE's, which runs in f32 only).
    fn add_in_norm(&self) -> bool {
        self.pass.config.afmoe.is_none() && self.pass.rounds_ahead()
    }

    /// The product's weight in bf16 where the pass before rounded its input to bits.
    fn rounded<'w>(&self, w: &'w CpuMatrix) -> Option<(&'w Matrix, &'w super::Bf16Matrix)> {
        let bits = w.bf16.as_ref().filter(|_| self.pass.rounds_ahead())?;
        Some((&w.weight, bits))
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
        let pass = self.pass;
        let c = pass.config;
        let steps = std::mem::take(&mut self.qkv_steps);
        let rounding = pass.bf16;
        let (qkv_width, eps) = (c.qkv_width(), c.rms_norm_eps as f32);
        let heads = (c.num_heads, c.num_kv_heads, c.head_dim);
        let qk_norm = steps.head_norms;
        let rotary = steps.rope;
        let (cos, sin) = (&pass.rope.cos, &pass.rope.sin);
        let bits_round_qk = bits.is_some();
        let finish = |rows: &mut [f32], positions: &[u32]| {
            if let Some(bias) = steps.bias {
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

impl<'p> BlockOps<'p, Cpu> for CpuOps<'p, '_> {
    fn embed(&mut self, scale: f32) -> Result<()> {
        let hidden = self.pass.config.hidden_size;
        let embed = self.embed;
        let x = &mut self.s.x[..self.pass.tokens * hidden];
        x.par_chunks_mut(hidden)
            .zip(&self.pass.batch.input_ids)
            .for_each(|(row, &id)| {
                embed.decode_rows(id as usize, row);
                if scale != 1.0 {
                    row.iter_mut().for_each(|v| *v *= scale);
                }
            });
        Ok(())
    }

    fn norm(&mut self, weight: &'p Vec<f32>, _: Sublayer) -> Result<()> {
        let (c, tokens) = (self.pass.config, self.pass.tokens);
        let (hidden, eps) = (c.hidden_size, c.rms_norm_eps as f32);
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
        } else if self.pass.rounds_ahead() {
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

    fn qkv(&mut self, weight: &'p CpuMatrix, bias: Option<&'p Vec<f32>>) -> Result<()> {
        let (c, tokens) = (self.pass.config, self.pass.tokens);
        let (hidden, qkv_width) = (c.hidden_size, c.qkv_width());
        let rounded = self.rounded(weight);
        let s = &mut *self.s;
        match rounded {
            Some(w) => project_rounded(w, &mut s.qkv, qkv_width, false, &mut s.gemm),
            None => {
                let normed = MatRef::dense(&s.normed, tokens, hidden);
                let (w, w16) = (&weight.weight, weight.bf16.as_ref());
                project(normed, w, w16, &mut s.qkv, qkv_width, false, &mut s.gemm);
            }
        }
        self.qkv_steps = QkvSteps {
            bias: bias.map(Vec::as_slice),
            ..QkvSteps::default()
        };
        Ok(())
    }

    fn head_norms(&mut self, norms: &'p HeadNorms<Cpu>) -> Result<()> {
        self.qkv_steps.head_norms = Some((&norms.q, &norms.k));
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
        let ahead = self.pass.rounds_ahead();
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

    fn attention_gate(&mut self, weight: &'p CpuMatrix) -> Result<()> {
        let (c, tokens) = (self.pass.config, self.pass.tokens);
        let (hidden, attn_width) = (c.hidden_size, c.num_heads * c.head_dim);
        let s = &mut *self.s;
        // AFMoE runs in f32 only (see `CpuBackend::new`), so `normed` holds the norm.
        let normed = MatRef::dense(&s.normed, tokens, hidden);
        let gate = &mut s.gate[..tokens * attn_width];
        let w = &weight.weight;
        project(normed, w, None, gate, attn_width, false, &mut s.gemm);
        let attn = &mut s.attn[..tokens * attn_width];
        rows_pass(gate, attn_width, attn, attn_width, |g, a| {
            kernels::sigmoid_gate_rows(a, g);
        });
        Ok(())
    }

    fn gate_up(&mut self, weight: &'p CpuMatrix, inter: usize) -> Result<()> {
        let (c, tokens) = (self.pass.config, self.pass.tokens);
        let hidden = c.hidden_size;
        self.mlp_width = inter;
        let rounded = self.rounded(weight);
        let s = &mut *self.s;
        let gate_up = &mut s.gate_up[..tokens * 2 * inter];
        // bf16 mode rounds the gate|up output before SwiGLU: where the product's sums are
        // whole in registers, it stores them rounded, and they never exist in f32 (half the
        // bytes written, and read back).
        self.gate_up_bits = false;
        match rounded {
            Some(w) if bf16::rounds_output(hidden) => {
                let bits = &mut s.gate_up_bits;
                bits.resize(tokens * 2 * inter, 0);
                project_to_bits(w, (bits, 2 * inter), &mut s.gemm);
                self.gate_up_bits = true;
            }
            Some(w) => project_rounded(w, gate_up, 2 * inter, false, &mut s.gemm),
            None => {
                let normed = MatRef::dense(&s.normed, tokens, hidden);
                let (w, w16, gemm) = (&weight.weight, weight.bf16.as_ref(), &mut s.gemm);
                project(normed, w, w16, gate_up, 2 * inter, false, gemm);
            }
        }
        Ok(())
    }

    fn swiglu(&mut self) -> Result<()> {
        let tokens = self.pass.tokens;
        let inter = self.mlp_width;
        let s = &mut *self.s;
        let gate_up = &s.gate_up[..tokens * 2 * inter];
        if !self.pass.rounds_ahead() {
            let act = &mut s.act[..tokens * inter];
            // bf16 mode rounds the gate|up output: as SwiGLU reads it.
            let rounded_inputs = self.pass.bf16;
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

    fn output_into_residual(&mut self, weight: &'p CpuMatrix, sublayer: Sublayer) -> Result<()> {
        // The CPU's products write the branch, then add it: the same f32 addition.
        self.output_apart(weight, None, sublayer)?;
        self.add_branch()
    }

    fn output_apart(
        &mut self,
        weight: &'p CpuMatrix,
        bias: Option<&'p Vec<f32>>,
        sublayer: Sublayer,
    ) -> Result<()> {
        let (c, tokens) = (self.pass.config, self.pass.tokens);
        let hidden = c.hidden_size;
        let rounded = self.rounded(weight);
        let s = &mut *self.s;
        let (input, k) = match sublayer {
            Sublayer::Attention => (&s.attn, c.num_heads * c.head_dim),
            Sublayer::Mlp => (&s.act, self.mlp_width),
        };
        match rounded {
            // The pass before rounded the input into `s.gemm.input_bf16`.
            Some(w) => project_rounded(w, &mut s.branch, hidden, false, &mut s.gemm),
            None => {
                let input = MatRef::dense(&input[..tokens * k], tokens, k);
                let (w, w16) = (&weight.weight, weight.bf16.as_ref());
                project(input, w, w16, &mut s.branch, hidden, false, &mut s.gemm);
            }
        }
        if let Some(bias) = bias {
            s.branch
                .par_chunks_mut(hidden * ROWS_PER_TASK)
                .for_each(|rows| kernels::add_bias_rows(rows, bias));
        }
        self.last_output = sublayer;
        Ok(())
    }

    fn branch_norm(&mut self, weight: &'p Vec<f32>) -> Result<()> {
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

    fn routed_experts(
        &mut self,
        weights: &'p MoeWeights<Cpu>,
        _: &'p Vec<f32>,
        route: Option<usize>,
    ) -> Result<()> {
        // In f32 (AFMoE's only mode here), `normed` is the router's input as it is.
        let Some(config) = &self.pass.config.afmoe else {
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
