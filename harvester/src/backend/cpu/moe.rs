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

use super::matmul::MatRef;
use super::{GemmScratch, ROWS_PER_TASK, kernels, project};
use crate::model::{AfmoeConfig, MoeWeights};

/// One token's routing: the chosen experts in ascending order and their weights.
#[derive(Debug, Clone, Copy, Default)]
struct Choice {
    expert: u32,
    weight: f32,
}

/// The routed experts' buffers.
#[derive(Debug, Default)]
pub(super) struct MoeScratch {
    /// Router logits, `[tokens, experts]`.
    logits: Vec<f32>,
    /// `[tokens, k]`, each token's choices sorted by expert.
    choices: Vec<Choice>,
    /// For each choice, its row in the grouped order.
    slots: Vec<u32>,
    /// Where each expert's rows start in the grouped order (one more entry than experts).
    starts: Vec<usize>,
    /// Each expert's next free row while grouping.
    cursor: Vec<usize>,
    /// The token each grouped row holds.
    tokens: Vec<u32>,
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
    pub weights: &'a MoeWeights,
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
        group(s, experts, k);
        s.rows.resize(tokens * k * hidden, 0.0);
        gather(s, normed, hidden);
        self.run_experts(hidden, s, gemm);
        scatter(s, out, hidden, k);
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
        let most = s.starts.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
        s.gate_up.resize(most * 2 * inter, 0.0);
        s.act.resize(most * inter, 0.0);
        s.out.resize(s.rows.len(), 0.0);
        for (e, expert) in self.weights.experts.iter().enumerate() {
            let (start, end) = (s.starts[e], s.starts[e + 1]);
            let n = end - start;
            if n == 0 {
                continue;
            }
            let rows = MatRef::dense(&s.rows[start * hidden..end * hidden], n, hidden);
            let gate_up = &mut s.gate_up[..n * 2 * inter];
            project(rows, &expert.gate_up, None, gate_up, 2 * inter, false, gemm);
            let act = &mut s.act[..n * inter];
            kernels::silu_mul_rows(gate_up, inter, act);
            let act = MatRef::dense(act, n, inter);
            let out = &mut s.out[start * hidden..end * hidden];
            project(act, &expert.down, None, out, hidden, false, gemm);
        }
    }
}

/// The top `chosen.len()` experts of one token by `sigmoid(logit) + bias` (the lower index wins
/// a tie), in ascending expert order, weighted by their sigmoid scores normalised to sum to one
/// and multiplied by `scale`.
fn choose(logits: &[f32], bias: &[f32], scale: f32, chosen: &mut [Choice]) {
    let score = |logit: f32| 1.0 / (1.0 + (-logit).exp());
    for taken in 0..chosen.len() {
        let (done, rest) = chosen.split_at_mut(taken);
        let mut best: Option<(usize, f32)> = None;
        for (e, (&logit, &b)) in logits.iter().zip(bias).enumerate() {
            let key = score(logit) + b;
            let free = !done.iter().any(|c| c.expert as usize == e);
            if free && best.is_none_or(|(_, top)| key > top) {
                best = Some((e, key));
            }
        }
        let e = best.map_or(0, |(e, _)| e);
        rest[0] = Choice {
            expert: e as u32,
            weight: score(logits[e]),
        };
    }
    chosen.sort_unstable_by_key(|c| c.expert);
    let total: f32 = chosen.iter().map(|c| c.weight).sum::<f32>() + 1e-20;
    for c in chosen.iter_mut() {
        c.weight = c.weight / total * scale;
    }
}

/// Counts each expert's tokens into `s.starts`, gives every choice its row in the grouped order
/// (`s.slots`: experts ascending, and within an expert its tokens ascending), and records which
/// token each grouped row holds (`s.tokens`).
fn group(s: &mut MoeScratch, experts: usize, k: usize) {
    s.starts.clear();
    s.starts.resize(experts + 1, 0);
    for c in &s.choices {
        s.starts[c.expert as usize + 1] += 1;
    }
    for e in 0..experts {
        s.starts[e + 1] += s.starts[e];
    }
    s.cursor.clear();
    s.cursor.extend_from_slice(&s.starts[..experts]);
    s.slots.resize(s.choices.len(), 0);
    s.tokens.resize(s.choices.len(), 0);
    for (i, (slot, c)) in s.slots.iter_mut().zip(&s.choices).enumerate() {
        let next = &mut s.cursor[c.expert as usize];
        *slot = *next as u32;
        s.tokens[*next] = (i / k) as u32;
        *next += 1;
    }
}

/// Copies into each grouped row the input row of the token it holds.
fn gather(s: &mut MoeScratch, normed: &[f32], hidden: usize) {
    s.rows
        .par_chunks_mut(hidden)
        .zip(s.tokens.par_iter())
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
        .zip(s.choices.par_chunks(k).zip(s.slots.par_chunks(k)))
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
    fn the_bias_chooses_experts_but_the_scores_weight_them() {
        // Logit 0 scores 0.5; logit 2 scores 0.88. The bias lifts expert 2 above expert 1.
        let logits = [2.0, 0.0, 0.0, -1.0];
        let bias = [0.0, 0.0, 0.5, 0.0];
        let mut chosen = [Choice::default(); 2];
        choose(&logits, &bias, 2.0, &mut chosen);
        assert_eq!([chosen[0].expert, chosen[1].expert], [0, 2]);
        let (s0, s2) = (1.0 / (1.0 + (-2.0f32).exp()), 0.5);
        assert!((chosen[0].weight - s0 / (s0 + s2) * 2.0).abs() < 1e-6);
        assert!((chosen[1].weight - s2 / (s0 + s2) * 2.0).abs() < 1e-6);
    }

    #[test]
    fn grouping_orders_rows_by_expert_then_token() {
        let mut s = MoeScratch::default();
        let pick = |expert| Choice {
            expert,
            weight: 1.0,
        };
        // Three tokens, two choices each: {0, 2}, {1, 2}, {0, 1}.
        s.choices = vec![pick(0), pick(2), pick(1), pick(2), pick(0), pick(1)];
        group(&mut s, 3, 2);
        assert_eq!(s.starts, [0, 2, 4, 6]);
        // Expert 0: tokens 0, 2 → rows 0, 1. Expert 1: tokens 1, 2 → rows 2, 3. Expert 2: 4, 5.
        assert_eq!(s.slots, [0, 4, 2, 5, 1, 3]);
    }

    #[test]
    fn gather_and_scatter_route_rows_and_weigh_them_back() {
        let mut s = MoeScratch::default();
        let pick = |expert, weight| Choice { expert, weight };
        s.choices = vec![pick(0, 0.25), pick(1, 0.75), pick(1, 1.0), pick(2, 2.0)];
        group(&mut s, 3, 2);
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
