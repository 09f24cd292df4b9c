//! The assembler's token selection: which positions of each prompt a shard keeps, by the pure
//! rules of [`harvest_core::selection`] and, with `max_norm_multiple`, the running median of the
//! `resid_post` norms at the deepest kept layer.

use harvest_core::selection::{Dropped, NormHistogram, Reason, TokenSelection};

use crate::backend::Captured;
use crate::tokenizer::Encoded;

/// Decides the kept positions of each prompt, in prompt order.
#[derive(Debug)]
pub(in crate::pipeline) struct Selector {
    selection: TokenSelection,
    /// Ids the tokenizer marks special, ascending.
    special: Vec<u32>,
    /// The captured slot whose row norms the norm filter reads.
    norm_slot: Option<usize>,
    /// Every candidate norm so far, over every shard before this one and this one so far.
    running: NormHistogram,
    kept: Vec<u32>,
    candidates: Vec<(u32, f64)>,
}

/// One prompt's selection.
pub(in crate::pipeline) struct Selected<'a> {
    /// Kept positions, ascending.
    pub kept: &'a [u32],
    /// What was dropped, by reason.
    pub dropped: Dropped,
}

impl Selector {
    /// A selector for `selection`; `norm_slot` is the slot of `resid_post` at the deepest kept
    /// layer (used only when the selection filters on norms).
    pub fn new(selection: TokenSelection, special: Vec<u32>, norm_slot: Option<usize>) -> Self {
        Self {
            norm_slot: norm_slot.filter(|_| selection.max_norm_multiple.is_some()),
            selection,
            special,
            running: NormHistogram::default(),
            kept: Vec::new(),
            candidates: Vec::new(),
        }
    }

    /// Whether the norm filter runs (and shards carry their norm histograms).
    pub fn filters_norms(&self) -> bool {
        self.norm_slot.is_some()
    }

    /// Adds the norms of a shard that an earlier run finished, so the running median is what
    /// it would have been had this run made that shard too.
    pub fn skip_shard(&mut self, histogram: &NormHistogram) {
        self.running.merge(histogram);
    }

    /// The kept positions of prompt `prompt`, `encoded`, whose rows are `rows` of `captured`.
    /// Its candidate norms are also added to `shard_norms`.
    pub fn select(
        &mut self,
        prompt: usize,
        encoded: &Encoded,
        captured: &Captured,
        rows: std::ops::Range<usize>,
        shard_norms: &mut NormHistogram,
    ) -> Selected<'_> {
        let mut dropped = Dropped::default();
        self.kept.clear();
        self.candidates.clear();
        let roles = encoded.roles.as_ref().map(|r| r.roles.as_slice());
        for (position, id) in encoded.ids.iter().enumerate() {
            let special = self.special.binary_search(id).is_ok();
            let role = roles.and_then(|roles| roles.get(position).copied());
            match self.selection.pre_norm(prompt, position, special, role) {
                Some(reason) => reason.count(&mut dropped),
                None => self.kept.push(position as u32),
            }
        }
        if let (Some(slot), Some(multiple)) = (self.norm_slot, self.selection.max_norm_multiple) {
            let block = captured.values(slot, rows);
            let width = captured.width;
            for &position in &self.kept {
                let at = position as usize * width;
                let norm = block
                    .slice(at..at + width)
                    .iter()
                    .map(|v| f64::from(v).powi(2))
                    .sum::<f64>()
                    .sqrt();
                self.running.push(norm);
                shard_norms.push(norm);
                self.candidates.push((position, norm));
            }
            let limit = self
                .running
                .median()
                .map_or(f64::INFINITY, |m| multiple * m);
            self.kept.clear();
            for &(position, norm) in &self.candidates {
                if norm > limit {
                    Reason::Norm.count(&mut dropped);
                } else {
                    self.kept.push(position);
                }
            }
        }
        Selected {
            kept: &self.kept,
            dropped,
        }
    }
}

#[cfg(test)]
mod tests {
    use harvest_core::selection::RawSelection;

    use super::*;

    #[test]
    fn an_outlier_norm_is_dropped_against_the_median_and_counted() {
        let selection = RawSelection {
            max_norm_multiple: Some(4.0),
            exclude_special_tokens: Some(true),
            ..RawSelection::default()
        }
        .validate()
        .unwrap();
        let values = [100.0, 1.0, 1.2, 0.9, 50.0];
        // Held as f32 (the CPU's rows) and as bf16 (a GPU's).
        let mut as_f32 = Captured::default();
        as_f32.reset(1, 1, 5, 1);
        as_f32.data = values.to_vec();
        let mut as_bf16 = Captured::default();
        as_bf16.reset_held(crate::backend::Held::Bf16, (1, 1, 5, 1));
        as_bf16.bits = values.map(|v| half::bf16::from_f32(v).to_bits()).to_vec();
        for captured in [as_f32, as_bf16] {
            let mut selector = Selector::new(selection, vec![1], Some(0));
            let mut norms = NormHistogram::default();
            let encoded = Encoded {
                ids: vec![7, 8, 1, 9, 10],
                truncated_from: None,
                roles: None,
            };
            let selected = selector.select(0, &encoded, &captured, 0..5, &mut norms);
            assert_eq!(selected.kept, [1, 3], "{:?}", captured.held);
            assert_eq!((selected.dropped.special, selected.dropped.norm), (1, 2));
            assert_eq!(norms.total(), 4, "special tokens are not candidates");
        }
    }
}
