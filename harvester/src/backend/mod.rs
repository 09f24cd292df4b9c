//! The backend seam: a forward pass over a packed varlen batch that returns the captured layers.
//!
//! A backend owns its device and its copy of the weights; the caller owns the output buffer so
//! the hot loop allocates nothing per batch once buffers have grown to the largest batch.
//!
//! ```text
//! Batch { input_ids, positions, cu_seq_lengths } ──Backend::capture──► Captured [sites, layers, tokens, width]
//! ```
//! A run drives it through `capture_next`, which may hand a capture back one call late, so a
//! GPU starts the next batch before the host has the last rows of this one.
//! The CPU backend is the reference; the CUDA backend (`cuda`) implements the same
//! trait.

pub mod cpu;
pub mod cuda;
pub mod stages;

use harvest_core::{Layers, Sites};

use crate::error::{Error, InputError, Result};
use crate::model::ModelConfig;
use crate::model::routing::{self, Choice};
use crate::projection::Directions;

/// Prompts packed end to end without padding. Sequence `s` holds tokens
/// `cu_seq_lengths[s]..cu_seq_lengths[s + 1]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Batch {
    /// Token ids, all sequences concatenated.
    pub input_ids: Vec<u32>,
    /// Each token's position within its own sequence.
    pub positions: Vec<u32>,
    /// Cumulative sequence lengths, starting at 0; one more entry than there are sequences.
    pub cu_seq_lengths: Vec<u32>,
    /// The longest sequence.
    pub max_length: u32,
}

impl Batch {
    /// Packs sequences of token ids into one batch.
    pub fn from_sequences<S: AsRef<[u32]>>(sequences: &[S]) -> Self {
        let mut batch = Self::default();
        for sequence in sequences {
            batch.push(sequence.as_ref());
        }
        batch
    }

    /// Appends one sequence.
    pub fn push(&mut self, ids: &[u32]) {
        if self.cu_seq_lengths.is_empty() {
            self.cu_seq_lengths.push(0);
        }
        self.input_ids.extend_from_slice(ids);
        self.positions.extend(0..ids.len() as u32);
        self.cu_seq_lengths.push(self.input_ids.len() as u32);
        self.max_length = self.max_length.max(ids.len() as u32);
    }

    /// Empties the batch, keeping its allocations.
    pub fn clear(&mut self) {
        self.input_ids.clear();
        self.positions.clear();
        self.cu_seq_lengths.clear();
        self.max_length = 0;
    }

    /// Total tokens.
    pub fn num_tokens(&self) -> usize {
        self.input_ids.len()
    }

    /// Number of sequences.
    pub fn num_sequences(&self) -> usize {
        self.cu_seq_lengths.len().saturating_sub(1)
    }

    /// Token range of sequence `s`.
    pub fn sequence(&self, s: usize) -> std::ops::Range<usize> {
        self.cu_seq_lengths[s] as usize..self.cu_seq_lengths[s + 1] as usize
    }

    /// Checks the invariants every backend relies on.
    pub fn validate(&self, vocab_size: usize) -> Result<()> {
        let invalid = |reason: String| Err(Error::InvalidBatch { reason });
        if self.positions.len() != self.input_ids.len() {
            return invalid("positions and input_ids differ in length".into());
        }
        if self.cu_seq_lengths.first().copied().unwrap_or(0) != 0
            || self.cu_seq_lengths.windows(2).any(|w| w[0] >= w[1])
            || self.cu_seq_lengths.last().copied().unwrap_or(0) as usize != self.input_ids.len()
        {
            return invalid("cu_seq_lengths must rise strictly from 0 to the token count".into());
        }
        if let Some(&id) = self.input_ids.iter().find(|&&id| id as usize >= vocab_size) {
            return invalid(format!(
                "token id {id} is outside the vocabulary of {vocab_size}"
            ));
        }
        Ok(())
    }
}

/// What a backend keeps from each forward pass. Fixed for the life of a job.
#[derive(Debug, Clone)]
pub struct CaptureSpec {
    /// The blocks whose outputs are kept; the pass stops after the deepest.
    pub layers: Layers,
    /// The hook sites kept of each kept block.
    pub sites: Sites,
    /// The arithmetic; every backend honours both.
    pub precision: harvest_core::plan::Precision,
    /// If present, each kept row is projected onto these unit directions instead of copied.
    pub directions: Option<Directions>,
}

impl CaptureSpec {
    /// Checks that `weights` reach the deepest kept block and that projection directions have
    /// the model's width; every backend calls it before it takes the weights.
    pub fn check(&self, weights: &crate::model::LlamaWeights) -> Result<()> {
        let deepest = self.layers.deepest();
        let reached = weights.first_block + weights.blocks.len();
        if deepest >= reached {
            return Err(harvest_core::LayerError::OutOfRange {
                layer: deepest as i64,
                num_layers: reached,
            }
            .into());
        }
        self.check_directions(weights)
    }

    /// Checks that projection directions have the model's width.
    pub fn check_directions(&self, weights: &crate::model::LlamaWeights) -> Result<()> {
        let hidden = weights.config.hidden_size;
        if let Some(directions) = &self.directions
            && directions.hidden() != hidden
        {
            return Err(Error::Input(InputError::BadDirections {
                reason: format!(
                    "directions have width {}, but the model's hidden size is {hidden}",
                    directions.hidden()
                ),
            }));
        }
        Ok(())
    }

    /// Captured rows per token: one per kept site of each kept layer.
    pub fn slots(&self) -> usize {
        self.sites.len() * self.layers.len()
    }

    /// How many of the `blocks` loaded from the model's block `first_block` on a pass runs:
    /// those up to the deepest kept one.
    pub fn blocks_to_run(&self, first_block: usize, blocks: usize) -> usize {
        blocks.min((self.layers.deepest() + 1).saturating_sub(first_block))
    }

    /// The kept layers (positions in `layers`) among the model's blocks `blocks`: what a
    /// pipeline stage holding those blocks captures.
    pub fn kept_in(&self, blocks: std::ops::Range<usize>) -> std::ops::Range<usize> {
        let kept = self.layers.as_slice();
        kept.partition_point(|&b| b < blocks.start)..kept.partition_point(|&b| b < blocks.end)
    }

    /// Values per captured token for a model of width `hidden`: `hidden`, or the number of
    /// directions for projections.
    pub fn width(&self, hidden: usize) -> usize {
        self.directions.as_ref().map_or(hidden, Directions::count)
    }

    /// The kept layers whose expert choices are kept (the `router` site): the sparse blocks
    /// among them, ascending. Empty when the router is not kept.
    pub fn route_layers(&self, config: &ModelConfig) -> Vec<usize> {
        match self.sites.router() {
            None => Vec::new(),
            Some(_) => config.shape().router_layers(&self.layers),
        }
    }

    /// The layers and sites kept, as the forward pass reads them.
    pub fn keeps(&self) -> crate::model::block::Keeps<'_> {
        crate::model::block::Keeps {
            layers: &self.layers,
            sites: &self.sites,
        }
    }

    /// What each batch's [`Routes`] hold for a model of `config`.
    pub fn route_shape(&self, config: &ModelConfig) -> RouteShape {
        let (k, experts) = config
            .afmoe
            .as_ref()
            .map_or((0, 0), |a| (a.experts_per_token, a.num_experts));
        RouteShape {
            layers: self.route_layers(config).len(),
            k,
            experts: match self.sites.router() {
                Some(router) if router.logits() => experts,
                _ => 0,
            },
        }
    }
}

/// The geometry of a batch's [`Routes`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RouteShape {
    /// Kept sparse blocks (route slots); 0 when the router is not kept.
    pub layers: usize,
    /// Experts per token.
    pub k: usize,
    /// Router logits kept per token: every expert's, or 0 when they are not kept.
    pub experts: usize,
}

/// The expert choices of a batch, for a job that keeps the `router` site: per route slot (a
/// kept sparse block, [`crate::model::block::Keeps::route_slot`]), each token's top-k expert ids in the order
/// the router ranks them (highest key first) and their gate weights (what multiplies each
/// expert's output), and the router's logits when kept.
#[derive(Debug, Clone, Default)]
pub struct Routes {
    /// The geometry.
    pub shape: RouteShape,
    /// Tokens in the batch.
    pub tokens: usize,
    /// Expert ids, `[layers, tokens, k]`.
    pub ids: Vec<i32>,
    /// Gate weights, `[layers, tokens, k]`.
    pub weights: Vec<f32>,
    /// Router logits, `[layers, tokens, experts]`.
    pub logits: Vec<f32>,
}

impl Routes {
    /// Resizes for a batch, keeping the allocations when they are large enough.
    pub fn reset(&mut self, shape: RouteShape, tokens: usize) {
        self.shape = shape;
        self.tokens = tokens;
        let choices = shape.layers * tokens * shape.k;
        self.ids.resize(choices, 0);
        self.weights.resize(choices, 0.0);
        self.logits
            .resize(shape.layers * tokens * shape.experts, 0.0);
    }

    /// Records route slot `slot`: `choices` `[tokens, k]` as [`routing::choose`] left them,
    /// and `logits` `[tokens, experts]`, scored with the block's `bias`.
    pub fn record(&mut self, slot: usize, choices: &[Choice], logits: &[f32], bias: &[f32]) {
        let (tokens, k) = (self.tokens, self.shape.k);
        let all_experts = bias.len();
        let base = slot * tokens * k;
        let ids = &mut self.ids[base..base + tokens * k];
        let weights = &mut self.weights[base..base + tokens * k];
        for (t, ((ids, weights), chosen)) in ids
            .chunks_exact_mut(k)
            .zip(weights.chunks_exact_mut(k))
            .zip(choices.chunks_exact(k))
            .enumerate()
        {
            let logits = &logits[t * all_experts..(t + 1) * all_experts];
            routing::ranked(chosen, logits, bias, ids, weights);
        }
        let kept = self.shape.experts;
        if kept > 0 {
            let base = slot * tokens * kept;
            self.logits[base..base + tokens * kept].copy_from_slice(&logits[..tokens * kept]);
        }
    }

    /// Token rows `rows` of route slot `slot`: its ids, weights and logits.
    pub fn rows(&self, slot: usize, rows: std::ops::Range<usize>) -> (&[i32], &[f32], &[f32]) {
        let (k, experts) = (self.shape.k, self.shape.experts);
        let choices = slot * self.tokens * k;
        let range = choices + rows.start * k..choices + rows.end * k;
        let logits = slot * self.tokens * experts;
        (
            &self.ids[range.clone()],
            &self.weights[range],
            &self.logits[logits + rows.start * experts..logits + rows.end * experts],
        )
    }
}

/// How a [`Captured`] holds its values on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Held {
    /// f32: the CPU backend's rows, and projections.
    #[default]
    F32,
    /// bf16 bits: activations from the CUDA arithmetic (a GPU, or its replay), which are bf16 on
    /// the device and in the shards, so the host holds half the bytes and loses nothing.
    Bf16,
}

impl Held {
    /// How a backend keeps `spec`'s values: bf16 for activations where `cuda_arithmetic`
    /// computes them, f32 otherwise. The one place this is decided.
    pub fn of(cuda_arithmetic: bool, spec: &CaptureSpec) -> Self {
        if cuda_arithmetic && spec.directions.is_none() {
            Self::Bf16
        } else {
            Self::F32
        }
    }

    /// Bytes one value takes.
    pub fn bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 => 2,
        }
    }
}

/// bf16 bits as f32: the top half of the f32's bits, exactly (a NaN's payload too, as the
/// copy from a GPU widens it).
pub fn widen_bf16(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// Captured values as they are held: f32, or bf16 bits.
#[derive(Debug, Clone, Copy)]
pub enum Values<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

impl<'a> Values<'a> {
    /// How many values.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(values) => values.len(),
            Self::Bf16(bits) => bits.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Values `range`.
    pub fn slice(self, range: std::ops::Range<usize>) -> Self {
        match self {
            Self::F32(values) => Self::F32(&values[range]),
            Self::Bf16(bits) => Self::Bf16(&bits[range]),
        }
    }

    /// Each value as f32 (bf16 widens exactly).
    pub fn iter(self) -> impl Iterator<Item = f32> + 'a {
        let (f32s, bits) = match self {
            Self::F32(values) => (values, &[][..]),
            Self::Bf16(bits) => (&[][..], bits),
        };
        f32s.iter()
            .copied()
            .chain(bits.iter().map(|&b| widen_bf16(b)))
    }
}

/// Captured rows, `[sites, layers, tokens, width]` row-major, where `width` is the hidden size,
/// or the number of directions for projections, held as [`Held`] says: f32 in `data`, or bf16
/// in `bits`. A *slot* is one (site, layer) pair, `site * layers + layer`; with one site, slot
/// `k` is kept layer `k`.
#[derive(Debug, Clone, Default)]
pub struct Captured {
    /// Kept sites.
    pub sites: usize,
    /// Kept layers.
    pub layers: usize,
    /// Tokens in the batch.
    pub tokens: usize,
    /// Values per token.
    pub width: usize,
    /// How the values are held.
    pub held: Held,
    /// The values, where they are held as f32.
    pub data: Vec<f32>,
    /// The values' bf16 bits, where they are held as bf16.
    pub bits: Vec<u16>,
    /// The expert choices, when the `router` site is kept.
    pub routes: Routes,
}

impl Captured {
    /// Resizes for a batch of f32 values, keeping the allocation when it is large enough.
    pub fn reset(&mut self, sites: usize, layers: usize, tokens: usize, width: usize) {
        self.reset_held(Held::F32, (sites, layers, tokens, width));
    }

    /// Resizes for a batch held as `held`, keeping the allocation when it is large enough (a
    /// change of `held` frees the other one).
    pub fn reset_held(
        &mut self,
        held: Held,
        (sites, layers, tokens, width): (usize, usize, usize, usize),
    ) {
        self.sites = sites;
        self.layers = layers;
        self.tokens = tokens;
        self.width = width;
        self.held = held;
        let len = sites * layers * tokens * width;
        match held {
            Held::F32 => {
                self.bits = Vec::new();
                self.data.resize(len, 0.0);
            }
            Held::Bf16 => {
                self.data = Vec::new();
                self.bits.resize(len, 0);
            }
        }
    }

    /// Slots: kept sites times kept layers.
    pub fn slots(&self) -> usize {
        self.sites * self.layers
    }

    /// The slot of kept site `site` at kept layer `layer`.
    pub fn slot(&self, site: usize, layer: usize) -> usize {
        site * self.layers + layer
    }

    /// The f32 values, or a panic naming the bug.
    fn f32s(&self) -> &[f32] {
        assert_eq!(
            self.held,
            Held::F32,
            "f32 rows of a bf16 capture. This is a bug."
        );
        &self.data
    }

    /// The `[tokens, width]` rows of slot `slot`, held as f32.
    ///
    /// # Panics
    /// If they are held as bf16 ([`Captured::values`] reads either): a bug in the caller.
    pub fn layer(&self, slot: usize) -> &[f32] {
        let size = self.tokens * self.width;
        &self.f32s()[slot * size..(slot + 1) * size]
    }

    /// The `[tokens, width]` rows of slot `slot`, held as f32, to fill.
    ///
    /// # Panics
    /// If they are held as bf16: a bug in the caller.
    pub fn layer_mut(&mut self, slot: usize) -> &mut [f32] {
        assert_eq!(
            self.held,
            Held::F32,
            "f32 rows of a bf16 capture. This is a bug."
        );
        let size = self.tokens * self.width;
        &mut self.data[slot * size..(slot + 1) * size]
    }

    /// The `[tokens, width]` rows of slot `slot`, held as bf16, to fill.
    ///
    /// # Panics
    /// If they are held as f32: a bug in the caller.
    pub fn layer_bits_mut(&mut self, slot: usize) -> &mut [u16] {
        assert_eq!(
            self.held,
            Held::Bf16,
            "bf16 rows of an f32 capture. This is a bug."
        );
        let size = self.tokens * self.width;
        &mut self.bits[slot * size..(slot + 1) * size]
    }

    /// Token rows `rows` of slot `slot`, held as f32.
    ///
    /// # Panics
    /// If they are held as bf16 ([`Captured::values`] reads either): a bug in the caller.
    pub fn rows(&self, slot: usize, rows: std::ops::Range<usize>) -> &[f32] {
        let base = slot * self.tokens * self.width;
        &self.f32s()[base + rows.start * self.width..base + rows.end * self.width]
    }

    /// Token rows `rows` of slot `slot`, as they are held.
    pub fn values(&self, slot: usize, rows: std::ops::Range<usize>) -> Values<'_> {
        let base = slot * self.tokens * self.width;
        let range = base + rows.start * self.width..base + rows.end * self.width;
        match self.held {
            Held::F32 => Values::F32(&self.data[range]),
            Held::Bf16 => Values::Bf16(&self.bits[range]),
        }
    }

    /// The same capture held as f32 (bf16 widens exactly): for readers that want f32 rows.
    pub fn widened(mut self) -> Self {
        if self.held == Held::Bf16 {
            let bits = std::mem::take(&mut self.bits);
            self.data = Values::Bf16(&bits).iter().collect();
            self.held = Held::F32;
        }
        self
    }
}

/// A forward-pass engine with capture.
pub trait Backend: Send {
    /// A short name for logs and benchmarks, e.g. `"cpu"`.
    fn name(&self) -> &'static str;

    /// Values per captured token: hidden size, or number of projection directions.
    fn capture_width(&self) -> usize;

    /// What is kept.
    fn spec(&self) -> &CaptureSpec;

    /// Runs the forward pass over `batch` up to the deepest kept block and fills `out`.
    fn capture(&mut self, batch: &Batch, out: &mut Captured) -> Result<()>;

    /// Runs `batch` into `out` as [`Backend::capture`] does, but may hold `out` back until
    /// the next call, so that the device starts the next batch before the host has taken the
    /// last rows of this one: returns the captures completed by this call, in batch order
    /// (the one before `batch`'s, or `batch`'s own, or none). [`Backend::finish`] returns the
    /// last one held. By default nothing is held.
    fn capture_next(&mut self, batch: &Batch, mut out: Captured) -> Result<Option<Captured>> {
        self.capture(batch, &mut out)?;
        Ok(Some(out))
    }

    /// The capture [`Backend::capture_next`] still holds, completed.
    fn finish(&mut self) -> Result<Option<Captured>> {
        Ok(None)
    }
}

/// One pipeline stage: a contiguous range of a model's blocks on one device, run on a batch's
/// residual stream as it arrives from the stage before.
pub trait Stage: Send {
    /// Runs the stage's blocks (up to the deepest kept one) on `x`, `[tokens, hidden]` f32,
    /// which the first stage fills from the embedding first; writes the kept sites of its
    /// blocks into `out`, which the caller has sized for the whole batch.
    fn forward(&mut self, batch: &Batch, x: &mut Vec<f32>, out: &mut Captured) -> Result<()>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_capture_held_as_bf16_reads_as_its_exact_f32_widening_and_frees_the_f32_buffer() {
        let mut captured = Captured::default();
        captured.reset(2, 1, 2, 3);
        assert_eq!((captured.held, captured.data.len()), (Held::F32, 12));
        captured.reset_held(Held::Bf16, (2, 1, 2, 3));
        assert_eq!((captured.data.capacity(), captured.bits.len()), (0, 12));
        let values: Vec<f32> = (0..12).map(|i| (i as f32 - 5.5) * 0.25).collect();
        for slot in 0..2 {
            let bits = captured.layer_bits_mut(slot);
            for (b, &v) in bits.iter_mut().zip(&values[slot * 6..]) {
                *b = half::bf16::from_f32(v).to_bits();
            }
        }
        let read: Vec<f32> = captured.values(1, 1..2).iter().collect();
        assert_eq!(read, values[9..12]);
        assert!(matches!(captured.values(0, 0..2), Values::Bf16(b) if b.len() == 6));
        let widened = captured.widened();
        assert_eq!((widened.held, widened.data), (Held::F32, values));
    }

    #[test]
    #[should_panic(expected = "f32 rows of a bf16 capture")]
    fn reading_a_bf16_capture_as_f32_rows_is_a_bug_caught_at_once() {
        let mut captured = Captured::default();
        captured.reset_held(Held::Bf16, (1, 1, 1, 4));
        let _ = captured.rows(0, 0..1);
    }

    #[test]
    fn activations_are_held_as_bf16_only_from_the_cuda_arithmetic() {
        let spec = |directions| CaptureSpec {
            layers: harvest_core::LayerSelection::All.resolve(2).unwrap(),
            sites: Sites::default(),
            precision: harvest_core::plan::Precision::Bf16,
            directions,
        };
        assert_eq!(Held::of(true, &spec(None)), Held::Bf16);
        assert_eq!(Held::of(false, &spec(None)), Held::F32);
        let directions = Directions::new(&[1.0, 0.0], 1, 2, 2).unwrap();
        assert_eq!(Held::of(true, &spec(Some(directions))), Held::F32);
    }

    #[test]
    fn packing_records_offsets_and_positions() {
        let batch = Batch::from_sequences(&[vec![5, 6, 7], vec![8], vec![9, 10]]);
        assert_eq!(batch.cu_seq_lengths, [0, 3, 4, 6]);
        assert_eq!(batch.positions, [0, 1, 2, 0, 0, 1]);
        assert_eq!(batch.max_length, 3);
        assert_eq!(batch.sequence(2), 4..6);
        batch.validate(11).unwrap();
    }

    #[test]
    fn a_stage_keeps_the_kept_layers_of_its_own_blocks_and_runs_up_to_the_deepest() {
        let spec = CaptureSpec {
            layers: Layers::from(vec![1, 4, 5, 9]),
            sites: Sites::default(),
            precision: harvest_core::plan::Precision::Bf16,
            directions: None,
        };
        assert_eq!(spec.kept_in(0..4), 0..1);
        assert_eq!(spec.kept_in(4..9), 1..3);
        assert_eq!(spec.kept_in(9..12), 3..4);
        assert_eq!(spec.kept_in(6..9), 3..3, "a stage may keep nothing");
        assert_eq!(spec.blocks_to_run(0, 4), 4);
        assert_eq!(spec.blocks_to_run(0, 30), 10);
        assert_eq!(spec.blocks_to_run(8, 4), 2, "blocks 8 and 9");
        assert_eq!(spec.blocks_to_run(10, 2), 0);
    }

    #[test]
    fn an_out_of_vocabulary_id_is_rejected_by_value() {
        let batch = Batch::from_sequences(&[vec![1, 99]]);
        let err = batch.validate(50).unwrap_err().to_string();
        assert!(err.contains("99"), "{err}");
    }

    #[test]
    fn an_empty_sequence_breaks_the_offsets_invariant() {
        let batch = Batch::from_sequences(&[vec![1], vec![]]);
        assert!(batch.validate(50).is_err());
    }
}
