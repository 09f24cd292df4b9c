//! AFMoE's ops replayed on the host (for [`HostOps`]' [`crate::model::block::BlockOps`]), kernel for kernel as
//! `forward/afmoe.rs` launches them: `head_norm`, `sigmoid_gate`, `rms_norm_wide`, the f32
//! router (cuBLAS's order is its own: here eight running sums), the routing rule itself
//! ([`crate::model::routing`], the code the CUDA backend runs on its downloaded logits), the
//! grouped expert GEMMs, and `moe_scatter`'s fused multiply-adds in expert order.

use super::{HostOps, HostValue, Replayed, gemm, rms_norm_wide, swiglu};
use crate::backend::cuda::emulation::{WARP, warp_sum};
use crate::error::Result;
use crate::model::routing::{Choice, Grouping, choose};
use crate::model::{HeadNorms, MoeWeights};

/// A model without AFMoE's configuration reached its routing: a bug in the caller.
fn not_afmoe(op: &'static str) -> crate::Error {
    crate::error::CudaError::Fault {
        action: op,
        reason: "the model has no routed experts".into(),
    }
    .into()
}

impl<T: HostValue> HostOps<'_, T> {
    /// `head_norm`: each query head by `q`, each key head by `k`.
    pub(super) fn head_norms_of(&mut self, norms: &HeadNorms<Replayed<T>>) -> Result<()> {
        let c = self.config;
        let eps = c.rms_norm_eps as f32;
        for row in self.qkv.chunks_exact_mut(c.qkv_width()) {
            let heads = row
                .chunks_exact_mut(c.head_dim)
                .take(c.num_heads + c.num_kv_heads);
            for (head, h) in heads.enumerate() {
                let weight = if head < c.num_heads {
                    &norms.q
                } else {
                    &norms.k
                };
                head_norm(h, weight, eps);
            }
        }
        Ok(())
    }

    /// `sigmoid_gate` on the gate's product.
    pub(super) fn attention_gate_of(&mut self, weight: &[T]) -> Result<()> {
        let c = self.config;
        let gate = gemm(
            &self.normed,
            weight,
            c.num_heads * c.head_dim,
            c.hidden_size,
        );
        for (attn, g) in self.attn.iter_mut().zip(gate) {
            let g = T::stored(g).widen();
            *attn = T::stored(attn.widen() / (1.0 + (-g).exp()));
        }
        Ok(())
    }

    /// The f32 router on `rms_norm_wide(x) · norm`, the routing, the grouped expert GEMMs
    /// and `moe_scatter`.
    pub(super) fn routed_experts_of(
        &mut self,
        moe: &MoeWeights<Replayed<T>>,
        norm: &[T],
        route: Option<usize>,
    ) -> Result<()> {
        let Some(config) = &self.config.afmoe else {
            return Err(not_afmoe("routing"));
        };
        let (c, tokens) = (self.config, self.tokens());
        let hidden = c.hidden_size;
        let (experts, k) = (config.num_experts, config.experts_per_token);
        let inter = config.expert_intermediate_size;
        let wide = rms_norm_wide(&self.x, norm, hidden, c.rms_norm_eps as f32);
        let logits = gemm_f32(&wide, &moe.router, experts, hidden);
        let mut choices = vec![Choice::default(); tokens * k];
        for (chosen, logits) in choices
            .chunks_exact_mut(k)
            .zip(logits.chunks_exact(experts))
        {
            choose(logits, &moe.expert_bias, config.route_scale as f32, chosen);
        }
        if let Some(slot) = route {
            (self.out.routes).record(slot, &choices, &logits, &moe.expert_bias);
        }
        let mut grouping = Grouping::default();
        grouping.group(&choices, experts, k);
        // moe_gather
        let rows: Vec<T> = grouping
            .tokens
            .iter()
            .flat_map(|&t| self.normed[t as usize * hidden..][..hidden].iter().copied())
            .collect();
        let mut out = vec![0.0f32; tokens * k * hidden];
        for (e, expert) in moe.experts.iter().enumerate() {
            let span = grouping.rows(e);
            if span.is_empty() {
                continue;
            }
            let input = &rows[span.start * hidden..span.end * hidden];
            let product = gemm(input, &expert.gate_up, 2 * inter, hidden);
            let gate_up: Vec<T> = product.iter().map(|&v| T::stored(v)).collect();
            let act = swiglu(&gate_up, inter);
            let expert_out = gemm(&act, &expert.down, hidden, inter);
            out[span.start * hidden..span.end * hidden].copy_from_slice(&expert_out);
        }
        moe_scatter(
            &out,
            (&grouping.slots, &choices),
            &mut self.branch,
            (hidden, k),
        );
        Ok(())
    }
}

/// `norm_heads` on one head: lane `l` sums the squares of dimensions `l, l + 32, ...`
/// (fused), the warp butterfly, then each value times the scale times its weight, stored in
/// the mode's type.
fn head_norm<T: HostValue>(head: &mut [T], weight: &[T], eps: f32) {
    let mut lanes = [0.0f32; WARP];
    for (lane, sum) in lanes.iter_mut().enumerate() {
        for &v in head.iter().skip(lane).step_by(WARP) {
            let v = v.widen();
            *sum = v.mul_add(v, *sum);
        }
    }
    let scale = 1.0 / (warp_sum(lanes) / head.len() as f32 + eps).sqrt();
    for (h, &w) in head.iter_mut().zip(weight) {
        *h = T::stored(h.widen() * scale * w.widen());
    }
}

/// `moe_scatter`: each token's branch row gains `weight · out[slot]` per choice, in expert
/// order, one fused multiply-add each.
fn moe_scatter(
    out: &[f32],
    (slots, choices): (&[u32], &[Choice]),
    branch: &mut [f32],
    (hidden, k): (usize, usize),
) {
    for ((row, slots), choices) in branch
        .chunks_exact_mut(hidden)
        .zip(slots.chunks_exact(k))
        .zip(choices.chunks_exact(k))
    {
        for (&slot, choice) in slots.iter().zip(choices) {
            let expert_row = &out[slot as usize * hidden..][..hidden];
            for (b, &v) in row.iter_mut().zip(expert_row) {
                *b = choice.weight.mul_add(v, *b);
            }
        }
    }
}

/// `c[t, n] = a[t, :] · w[n, :]` all in f32, as [`gemm`] sums (eight running sums; cuBLAS's
/// order is its own).
fn gemm_f32(a: &[f32], w: &[f32], n: usize, k: usize) -> Vec<f32> {
    let mut c = Vec::with_capacity(a.len() / k * n);
    for a_row in a.chunks_exact(k) {
        for w_row in w.chunks_exact(k) {
            let mut sums = [0.0f32; 8];
            for (i, (&x, &y)) in a_row.iter().zip(w_row).enumerate() {
                sums[i % 8] += x * y;
            }
            c.push(sums.iter().sum());
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::backend::cuda::emulation::kernel_bf16;

    fn bits(values: &[f32]) -> Vec<u16> {
        values.iter().map(|&v| kernel_bf16(v)).collect()
    }

    #[test]
    fn a_head_norm_gives_each_head_unit_rms_times_its_weight() {
        let mut head = bits(&[3.0, -1.0, 2.0, 0.5, 1.5, -2.5, 0.25, 4.0]);
        let weight = bits(&[1.0; 8]);
        head_norm(&mut head, &weight, 1e-6);
        let mean_square: f32 = head.iter().map(|&v| v.widen() * v.widen()).sum::<f32>() / 8.0;
        assert!((mean_square - 1.0).abs() < 1e-2, "{mean_square}");
    }

    #[test]
    fn the_scatter_adds_each_choice_weighed_to_its_token_in_expert_order() {
        // Two tokens of width 2, one choice each plus a second for token 0.
        let out = [1.0, 2.0, 10.0, 20.0, 100.0, 200.0, 0.0, 0.0];
        let pick = |expert, weight| Choice { expert, weight };
        let choices = [pick(0, 0.5), pick(1, 2.0), pick(1, 1.0), pick(1, 0.0)];
        let slots = [0, 1, 2, 3];
        let mut branch = [1.0, 1.0, 0.0, 0.0];
        moe_scatter(&out, (&slots, &choices), &mut branch, (2, 2));
        assert_eq!(branch, [1.0 + 0.5 + 20.0, 1.0 + 1.0 + 40.0, 100.0, 200.0]);
    }
}
