//! The routed experts of an AFMoE sparse block, computed grouped by expert:
//!
//! ```text
//! logits = normed · routerᵀ                  [tokens, experts], always f32
//! choose k experts per token by sigmoid(logit) + expert_bias; weight = sigmoid(logit),
//!   normalised over the k chosen and multiplied by route_scale
//! gather each expert's tokens into one block of rows (experts in order, tokens in order)
//! per expert: down(silu(gate) ⊙ up) over its block   one GEMM pair per expert, never per token
//! scatter: out[t] += Σ weight · row, over t's experts in expert order
//! ```
//! AFMoE runs in f32 only: in the bf16 compute mode, rounding moved enough router inputs across
//! a choice to reroute many of the fixture's tokens (docs/engine.md).
//! Every buffer lives in [`MoeScratch`] and only grows.

use rayon::prelude::*;

use super::Cpu;
use super::matmul::MatRef;
use super::{GemmScratch, ROWS_PER_TASK, kernels, project};
use crate::backend::Routes;
use crate::model::routing::{Choice, Grouping, choose};
use crate::model::{AfmoeConfig, MoeWeights};

/// The routed experts' buffers.
#[derive(Debug, Default)]
pub(super) struct MoeScratch {
    /// Router logits, `[tokens, experts]`.
    logits: Vec<f32>,
    /// `[tokens, k]`, each token's choices sorted by expert.
    choices: Vec<Choice>,
    /// The grouped order of the choices.
    grouping: Grouping,
    /// The grouped inputs, `[tokens k, hidden]`.
    rows: Vec<f32>,
    /// One expert's gate|up output and activation.
    gate_up: Vec<f32>,
    act: Vec<f32>,
    /// The grouped expert outputs, `[tokens k, hidden]`.
    out: Vec<f32>,
}

/// A sparse block's routed half: its weights and the routing constants.
pub(super) struct Routed<'a> {
    pub weights: &'a MoeWeights<Cpu>,
    pub config: &'a AfmoeConfig,
}

impl Routed<'_> {
    /// `out += Σ_k weight · expert(normed)` for `tokens` rows of width `hidden`.
    pub fn add_to(
        &self,
        normed: &[f32],
        (tokens, hidden): (usize, usize),
        out: &mut [f32],
        s: &mut MoeScratch,
        gemm: &mut GemmScratch,
    ) {
        let (experts, k) = (self.config.num_experts, self.config.experts_per_token);
        s.logits.resize(tokens * experts, 0.0);
        let input = MatRef::dense(&normed[..tokens * hidden], tokens, hidden);
        project(
            input,
            &self.weights.router,
            None,
            &mut s.logits,
            experts,
            false,
            gemm,
        );
        self.route(tokens, s);
        s.grouping.group(&s.choices, experts, k);
        s.rows.resize(tokens * k * hidden, 0.0);
        gather(s, normed, hidden);
        self.run_experts(hidden, s, gemm);
        scatter(s, out, hidden, k);
    }

    /// Keeps the choices and logits of the batch [`Routed::add_to`] last ran in route slot
    /// `slot` of `routes`.
    pub fn record(&self, s: &MoeScratch, routes: &mut Routes, slot: usize) {
        routes.record(slot, &s.choices, &s.logits, &self.weights.expert_bias);
    }

    /// Fills `s.choices`: each token's top-k experts by score plus bias, weighted by their
    /// normalised scores times `route_scale`.
    fn route(&self, tokens: usize, s: &mut MoeScratch) {
        let (experts, k) = (self.config.num_experts, self.config.experts_per_token);
        let bias = &self.weights.expert_bias;
        let scale = self.config.route_scale as f32;
        s.choices.resize(tokens * k, Choice::default());
        s.choices
            .par_chunks_mut(k * ROWS_PER_TASK)
            .zip(s.logits.par_chunks(experts * ROWS_PER_TASK))
            .for_each(|(choices, logits)| {
                for (chosen, logits) in choices
                    .chunks_exact_mut(k)
                    .zip(logits.chunks_exact(experts))
                {
                    choose(logits, bias, scale, chosen);
                }
            });
    }

    /// Each expert's SwiGLU over its block of grouped rows, written to `s.out`.
    fn run_experts(&self, hidden: usize, s: &mut MoeScratch, gemm: &mut GemmScratch) {
        let inter = self.config.expert_intermediate_size;
        let most = s.grouping.most_rows();
        s.gate_up.resize(most * 2 * inter, 0.0);
        s.act.resize(most * inter, 0.0);
        s.out.resize(s.rows.len(), 0.0);
        for (e, expert) in self.weights.experts.iter().enumerate() {
            let (start, end) = (s.grouping.starts[e], s.grouping.starts[e + 1]);
            let n = end - start;
            if n == 0 {
                continue;
            }
            let rows = MatRef::dense(&s.rows[start * hidden..end * hidden], n, hidden);
            let gate_up = &mut s.gate_up[..n * 2 * inter];
            project(
                rows,
                &expert.gate_up.weight,
                None,
                gate_up,
                2 * inter,
                false,
                gemm,
            );
            let act = &mut s.act[..n * inter];
            kernels::silu_mul_rows(gate_up, inter, act);
            let act = MatRef::dense(act, n, inter);
            let out = &mut s.out[start * hidden..end * hidden];
            project(act, &expert.down.weight, None, out, hidden, false, gemm);
        }
    }
}

/// Copies into each grouped row the input row of the token it holds.
fn gather(s: &mut MoeScratch, normed: &[f32], hidden: usize) {
    s.rows
        .par_chunks_mut(hidden)
        .zip(s.grouping.tokens.par_iter())
        .for_each(|(row, &t)| {
            let t = t as usize;
            row.copy_from_slice(&normed[t * hidden..(t + 1) * hidden]);
        });
}

/// `out[t] += Σ weight · s.out[slot]` over token `t`'s choices, in expert order.
fn scatter(s: &MoeScratch, out: &mut [f32], hidden: usize, k: usize) {
    let tokens = s.choices.len() / k.max(1);
    out[..tokens * hidden]
        .par_chunks_mut(hidden)
        .zip(s.choices.par_chunks(k).zip(s.grouping.slots.par_chunks(k)))
        .for_each(|(dst, (choices, slots))| {
            for (c, &slot) in choices.iter().zip(slots) {
                let row = &s.out[slot as usize * hidden..(slot as usize + 1) * hidden];
                for (d, &v) in dst.iter_mut().zip(row) {
                    *d += c.weight * v;
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_and_scatter_route_rows_and_weigh_them_back() {
        let mut s = MoeScratch::default();
        let pick = |expert, weight| Choice { expert, weight };
        s.choices = vec![pick(0, 0.25), pick(1, 0.75), pick(1, 1.0), pick(2, 2.0)];
        s.grouping.group(&s.choices, 3, 2);
        let normed = [1.0, 2.0, 10.0, 20.0];
        s.rows.resize(4 * 2, 0.0);
        gather(&mut s, &normed, 2);
        assert_eq!(s.rows, [1.0, 2.0, 1.0, 2.0, 10.0, 20.0, 10.0, 20.0]);
        // Experts as identities: out = Σ weight · input, added to what out held.
        s.out = s.rows.clone();
        let mut out = [100.0, 100.0, 0.0, 0.0];
        scatter(&s, &mut out, 2, 2);
        assert_eq!(out, [101.0, 102.0, 30.0, 60.0]);
    }
}
