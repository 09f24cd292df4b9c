//! AFMoE's routing rule, shared by every backend: which experts a token goes to and with what
//! weight, and the grouped order the experts' rows run in. Pure: the CPU backend calls it on
//! its own logits, the CUDA backend on the logits it downloads, so both route by the same code.
//!
//! ```text
//! key[e] = sigmoid(logit[e]) + expert_bias[e]     top k keys (the lower index wins a tie)
//! weight = sigmoid(logit) / Σ chosen sigmoid(logit) · route_scale
//! grouped rows: experts ascending, and within an expert its tokens ascending
//! ```

/// One token's routing to one expert.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Choice {
    /// The expert.
    pub expert: u32,
    /// Its weight in the token's sum.
    pub weight: f32,
}

/// The top `chosen.len()` experts of one token by `sigmoid(logit) + bias` (the lower index wins
/// a tie), in ascending expert order, weighted by their sigmoid scores normalised to sum to one
/// and multiplied by `scale`.
pub fn choose(logits: &[f32], bias: &[f32], scale: f32, chosen: &mut [Choice]) {
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

/// Writes one token's `chosen` experts (as [`choose`] left them) into `ids` and `weights` in
/// the order [`choose`] took them: key `sigmoid(logit) + bias` descending, the lower index first
/// on a tie. This is the order of `torch.topk` in the reference implementation.
pub fn ranked(
    chosen: &[Choice],
    logits: &[f32],
    bias: &[f32],
    ids: &mut [i32],
    weights: &mut [f32],
) {
    let key = |e: usize| 1.0 / (1.0 + (-logits[e]).exp()) + bias[e];
    for (filled, c) in chosen.iter().enumerate() {
        let e = c.expert as usize;
        // Insertion: later positions hold lower keys (or equal keys of higher index).
        let mut at = filled;
        while at > 0 && key(ids[at - 1] as usize) < key(e) {
            ids[at] = ids[at - 1];
            weights[at] = weights[at - 1];
            at -= 1;
        }
        ids[at] = e as i32;
        weights[at] = c.weight;
    }
}

/// The grouped order of a batch's choices. Every buffer only grows.
#[derive(Debug, Default, Clone)]
pub struct Grouping {
    /// Where each expert's rows start (one more entry than experts).
    pub starts: Vec<usize>,
    /// For each choice (`[tokens, k]`), its row in the grouped order.
    pub slots: Vec<u32>,
    /// The token each grouped row holds.
    pub tokens: Vec<u32>,
    /// Each expert's next free row while grouping.
    cursor: Vec<usize>,
}

impl Grouping {
    /// Counts each expert's rows into `starts`, gives every choice its row (experts ascending,
    /// and within an expert its tokens ascending) and records which token each row holds.
    /// `choices` is `[tokens, k]`.
    pub fn group(&mut self, choices: &[Choice], experts: usize, k: usize) {
        self.starts.clear();
        self.starts.resize(experts + 1, 0);
        for c in choices {
            self.starts[c.expert as usize + 1] += 1;
        }
        for e in 0..experts {
            self.starts[e + 1] += self.starts[e];
        }
        self.cursor.clear();
        self.cursor.extend_from_slice(&self.starts[..experts]);
        self.slots.resize(choices.len(), 0);
        self.tokens.resize(choices.len(), 0);
        for (i, (slot, c)) in self.slots.iter_mut().zip(choices).enumerate() {
            let next = &mut self.cursor[c.expert as usize];
            *slot = *next as u32;
            self.tokens[*next] = (i / k) as u32;
            *next += 1;
        }
    }

    /// Expert `e`'s rows in the grouped order.
    pub fn rows(&self, e: usize) -> std::ops::Range<usize> {
        self.starts[e]..self.starts[e + 1]
    }

    /// The most rows any one expert holds.
    pub fn most_rows(&self) -> usize {
        self.starts
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or(0)
    }
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
    fn the_choices_are_recorded_highest_key_first_and_the_lower_expert_first_on_a_tie() {
        // Keys: 0.5, 0.5 + 0.3, 0.27, 0.5: expert 1 leads, then 0 and 3 tie (0 first).
        let logits = [0.0, 0.0, -1.0, 0.0];
        let bias = [0.0, 0.3, 0.0, 0.0];
        let mut chosen = [Choice::default(); 3];
        choose(&logits, &bias, 1.0, &mut chosen);
        assert_eq!(chosen.map(|c| c.expert), [0, 1, 3], "the forward's order");
        let (mut ids, mut weights) = ([0i32; 3], [0f32; 3]);
        ranked(&chosen, &logits, &bias, &mut ids, &mut weights);
        assert_eq!(ids, [1, 0, 3]);
        assert_eq!(
            weights,
            [chosen[1].weight, chosen[0].weight, chosen[2].weight]
        );
    }

    #[test]
    fn a_tie_goes_to_the_lower_expert() {
        let mut chosen = [Choice::default(); 1];
        choose(&[0.5, 0.5, 0.5], &[0.0; 3], 1.0, &mut chosen);
        assert_eq!(chosen[0].expert, 0);
    }

    #[test]
    fn grouping_orders_rows_by_expert_then_token() {
        let pick = |expert| Choice {
            expert,
            weight: 1.0,
        };
        // Three tokens, two choices each: {0, 2}, {1, 2}, {0, 1}.
        let choices = [pick(0), pick(2), pick(1), pick(2), pick(0), pick(1)];
        let mut g = Grouping::default();
        g.group(&choices, 3, 2);
        assert_eq!(g.starts, [0, 2, 4, 6]);
        // Expert 0: tokens 0, 2 → rows 0, 1. Expert 1: tokens 1, 2 → rows 2, 3. Expert 2: 4, 5.
        assert_eq!(g.slots, [0, 4, 2, 5, 1, 3]);
        assert_eq!(g.tokens, [0, 2, 1, 2, 0, 1]);
        assert_eq!((g.rows(1), g.most_rows()), (2..4, 2));
    }
}
