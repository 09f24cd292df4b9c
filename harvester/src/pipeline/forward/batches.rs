//! How a run's prompts are packed into forward batches, decided once for the single engine and
//! for pipeline stages alike: what "any stage count writes the same bytes" rests on. Batches
//! are consecutive prompts of one shard, so a shard's batches are the same in every run (a
//! resumed run, a part, any number of stages).

use std::ops::Range;

/// Splits the prompts `range` (one shard's) into batches: consecutive prompts while the next one
/// still fits in `budget` tokens. A prompt longer than the budget is a batch of its own.
pub(in crate::pipeline) fn pack(
    range: Range<usize>,
    tokens: impl Fn(usize) -> usize,
    budget: usize,
) -> impl Iterator<Item = Range<usize>> {
    let mut start = range.start;
    std::iter::from_fn(move || {
        if start >= range.end {
            return None;
        }
        let mut end = start + 1;
        let mut packed = tokens(start);
        while end < range.end && packed + tokens(end) <= budget {
            packed += tokens(end);
            end += 1;
        }
        let batch = start..end;
        start = end;
        Some(batch)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn packed(lengths: &[usize], budget: usize) -> Vec<Range<usize>> {
        pack(0..lengths.len(), |i| lengths[i], budget).collect()
    }

    #[test]
    fn prompts_join_a_batch_while_the_next_one_fits_in_the_budget() {
        assert_eq!(packed(&[3, 3, 4, 2, 5], 10), [0..3, 3..5]);
        assert_eq!(packed(&[5, 5, 5], 10), [0..2, 2..3], "an exact fit joins");
    }

    #[test]
    fn a_prompt_longer_than_the_budget_runs_alone() {
        assert_eq!(packed(&[2, 30, 2, 2], 10), [0..1, 1..2, 2..4]);
    }

    #[test]
    fn a_shard_starting_past_zero_packs_only_its_own_prompts() {
        let lengths = [9, 1, 1, 9, 1];
        let batches: Vec<_> = pack(1..4, |i| lengths[i], 10).collect();
        assert_eq!(batches, [1..3, 3..4]);
        assert_eq!(pack(2..2, |i| lengths[i], 10).count(), 0);
    }
}
