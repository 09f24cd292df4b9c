//! The batch tail, hidden (`HARVEST_CUDA_TAIL=overlap`): the next batch's pass is queued
//! before the host takes the last rows of this one. Without it, the device idles at the end of
//! every batch while its deepest kept layer is copied to the host, copied again into the
//! caller's rows, handed on, and the next batch is built and uploaded (a few milliseconds of a
//! llama-8b batch of 8,192 tokens, docs/gpu.md).
//!
//! The deepest kept layer's slots are *deferred*: written and recorded as any slot, but copied
//! to the host only once the host has read the same slots of the batch before (one page-locked
//! buffer a slot, as `download` keeps them), and each slot is written only after the batch
//! before's copy of it has run (an event wait on the compute stream).
//!
//! ```text
//! compute: … k's last block ─ k+1's inputs ─ k+1's blocks … (slot s written after k's copy of s)
//! copies:  … k's deepest slots ──────────────── k+1's earlier slots ─ k+1's deepest slots
//! host:    queue k+1 ─ read k's deepest slots ─ queue k+1's deepest copies ─ read k+1's earlier
//!          slots ─ hand back k
//! ```
//!
//! The order of a call's steps is decided in [`steps`], so it is tested without a GPU against
//! a model of the slots' buffers.
//!
//! The batch's ids, positions, sequence bounds and tiles go up through page-locked memory
//! here (two buffers taking turns), so queueing them never waits for the pass before.
//! Not used by AFMoE, whose router reads each block's logits on the host mid-pass.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DriverError, PinnedHostSlice};

use super::CudaError;
use crate::backend::{Batch, Captured};
use crate::error::Result;

/// The environment variable that hides the batch tail (`overlap`); anything else, or nothing,
/// waits for each batch's last rows before the next is queued.
pub const TAIL_VARIABLE: &str = "HARVEST_CUDA_TAIL";

/// Whether `forced` (the value of [`TAIL_VARIABLE`]) asks for the overlapped tail.
pub(super) fn overlaps(forced: Option<&str>) -> bool {
    forced.map(str::trim) == Some("overlap")
}

/// Whether a device's slot `slot` is its deepest kept layer's, on a device holding `kept` kept
/// layers (its slots are `site * kept + layer`): the slots whose copies are deferred.
pub(super) fn deferred(slot: usize, kept: usize) -> bool {
    kept > 0 && slot % kept == kept - 1
}

/// One step of a call with the tail hidden.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    /// Queue the batch's inputs and blocks, its deepest layer's copies left out (replacing the
    /// batch buffers first where they are too small).
    Queue,
    /// Take the held capture's deepest slots from their page-locked buffers, and hand it back.
    TakeHeld,
    /// Queue the copies of the batch's deepest layer into those buffers.
    QueueDeferredCopies,
    /// Take the batch's other slots as they land.
    ReceiveEarly,
}

/// The steps of a call for a batch with tokens or without, whose buffers `fit` or must be
/// replaced. The batch is queued before the held capture is taken, so the device has work
/// while the host finishes the last batch, except where the buffers must be replaced: the
/// held capture's slots are then read first. Its deepest slots' buffers are read before this
/// batch's copies into them are queued.
pub(super) fn steps(tokens: bool, fit: bool) -> &'static [Step] {
    use Step::*;
    match (tokens, fit) {
        (false, _) => &[TakeHeld],
        (true, true) => &[Queue, TakeHeld, QueueDeferredCopies, ReceiveEarly],
        (true, false) => &[TakeHeld, Queue, QueueDeferredCopies, ReceiveEarly],
    }
}

/// Which of a batch's slots a host read takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Landing {
    /// Every slot: the tail is not hidden.
    All,
    /// The slots of the layers above the deepest.
    Early,
    /// The deepest layer's slots.
    Deferred,
}

impl Landing {
    /// Whether slot `slot` of `kept` kept layers is read now.
    pub(super) fn includes(self, slot: usize, kept: usize) -> bool {
        match self {
            Self::All => true,
            Self::Early => !deferred(slot, kept),
            Self::Deferred => deferred(slot, kept),
        }
    }
}

/// The tail on one device: whether it is hidden, the capture held back, and the batch
/// inputs' page-locked way up.
pub(super) struct Tail {
    pub(super) overlap: bool,
    pub(super) ahead: Option<Ahead>,
    pub(super) inputs: Option<BatchInputs>,
}

impl Tail {
    /// Hidden where [`TAIL_VARIABLE`] asks for it and the model is not AFMoE.
    pub(super) fn new(config: &crate::model::ModelConfig) -> Self {
        let forced = super::super::switches::switch(TAIL_VARIABLE);
        Self {
            overlap: overlaps(forced.as_deref()) && config.afmoe.is_none(),
            ahead: None,
            inputs: None,
        }
    }
}

/// A capture held back for the next call: its deepest slots are still on their way when
/// `pending` (a batch without tokens has none).
pub(super) struct Ahead {
    pub(super) out: Captured,
    pub(super) pending: bool,
}

/// The batch inputs' way up: two page-locked buffers taking turns, each holding one batch's
/// ids, positions, sequence bounds and tiles, and the events that say when each is free again.
pub(super) struct BatchInputs {
    /// Two; a Vec so that `Drop` can leave them unfreed.
    buffers: Vec<PinnedHostSlice<u32>>,
    /// Recorded on the stream after the copies that read buffer `i`.
    uploaded: [CudaEvent; 2],
    next: usize,
}

/// Where a batch's inputs go on the device.
pub(super) struct InputBuffers<'a> {
    pub(super) ids: &'a mut CudaSlice<u32>,
    pub(super) positions: &'a mut CudaSlice<u32>,
    pub(super) cu_seq_lengths: &'a mut CudaSlice<u32>,
    pub(super) tiles: &'a mut CudaSlice<u32>,
}

impl BatchInputs {
    /// Buffers for batches of up to `tokens` tokens, or the driver's refusal.
    pub(super) fn new(context: &Arc<CudaContext>, tokens: usize) -> Result<Self, DriverError> {
        let len = input_values(tokens);
        // SAFETY: each buffer is written (up to what a batch uses) before a copy reads it;
        // write-combined suits memory the host only writes and the device only reads.
        #[allow(unsafe_code)]
        let buffer = || unsafe { context.alloc_pinned::<u32>(len) };
        let event = || context.new_event(Some(CUevent_flags::CU_EVENT_BLOCKING_SYNC));
        Ok(Self {
            buffers: vec![buffer()?, buffer()?],
            uploaded: [event()?, event()?],
            next: 0,
        })
    }

    /// Tokens a batch may have.
    pub(super) fn holds(&self, tokens: usize) -> bool {
        self.buffers
            .iter()
            .all(|buffer| buffer.len() >= input_values(tokens))
    }

    /// Queues `batch`'s inputs and `tiles` for `to` on `stream`, through the buffer whose last
    /// copies are done.
    pub(super) fn upload(
        &mut self,
        stream: &Arc<CudaStream>,
        batch: &Batch,
        tiles: &[u32],
        to: InputBuffers<'_>,
    ) -> Result<()> {
        let copy = CudaError::fault("copying the batch to the device");
        let slot = self.next;
        self.next ^= 1;
        // The copies that last read this buffer are done.
        self.uploaded[slot].synchronize().map_err(&copy)?;
        let host = self.buffers[slot].as_mut_slice().map_err(&copy)?;
        let parts: [&[u32]; 4] = [
            &batch.input_ids,
            &batch.positions,
            &batch.cu_seq_lengths,
            tiles,
        ];
        let mut ranges = [0..0, 0..0, 0..0, 0..0];
        let mut at = 0;
        for (part, range) in parts.iter().zip(&mut ranges) {
            *range = at..at + part.len();
            host[range.clone()].copy_from_slice(part);
            at = range.end;
        }
        let targets = [to.ids, to.positions, to.cu_seq_lengths, to.tiles];
        for (range, target) in ranges.into_iter().zip(targets) {
            let len = range.len();
            // A plain slice of page-locked memory: the driver copies it asynchronously, and
            // nothing writes it until `uploaded[slot]`, recorded below, has passed.
            stream
                .memcpy_htod(&host[range], &mut target.slice_mut(..len))
                .map_err(&copy)?;
        }
        self.uploaded[slot].record(stream).map_err(&copy)?;
        Ok(())
    }

    /// Waits until both buffers' copies are done.
    fn finish(&self) -> Result<(), DriverError> {
        self.uploaded.iter().try_for_each(CudaEvent::synchronize)
    }
}

impl Drop for BatchInputs {
    fn drop(&mut self) {
        if let Err(error) = self.finish() {
            tracing::warn!(error = ?error.0, "the batch inputs' copies could not be waited for: their page-locked buffers are not freed");
            super::settle::leave_unfreed(std::mem::take(&mut self.buffers));
        }
    }
}

/// Values one batch of `tokens` tokens uploads at most: ids, positions, sequence bounds (a
/// sequence has a token at least) and tiles (two values a tile, a tile a token at most).
fn input_values(tokens: usize) -> usize {
    tokens + tokens + (tokens + 1) + 2 * tokens
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deferred_slots_are_every_sites_deepest_layer_and_no_other() {
        // Two sites over three kept layers: slots site * 3 + layer.
        let slots: Vec<usize> = (0..6).filter(|&slot| deferred(slot, 3)).collect();
        assert_eq!(slots, [2, 5]);
        // One kept layer: every slot is the deepest.
        assert!((0..4).all(|slot| deferred(slot, 1)));
        assert!(!deferred(0, 0), "a device keeping no layer defers nothing");
    }

    #[test]
    fn the_early_and_deferred_reads_take_every_slot_once_between_them() {
        for kept in 1..5 {
            for slot in 0..3 * kept {
                let taken = [Landing::Early, Landing::Deferred]
                    .iter()
                    .filter(|landing| landing.includes(slot, kept))
                    .count();
                assert_eq!(taken, 1, "slot {slot} of {kept}");
                assert!(Landing::All.includes(slot, kept));
            }
        }
    }

    /// What the steps do to one deferred slot, followed over a run of calls.
    #[derive(Default)]
    struct Model {
        /// The batch held back, and whether its deepest slot is still to be read.
        held: Option<(usize, bool)>,
        /// The batch whose deepest slot was last queued into the slot's page-locked buffer.
        in_buffer: Option<usize>,
        /// The batches whose deepest slots the host read, in order.
        read: Vec<usize>,
        /// The batches handed back, in order.
        handed_back: Vec<usize>,
    }

    impl Model {
        /// Batch `batch` (with tokens or not, its buffers fitting or not), as the steps run it.
        fn call(&mut self, batch: usize, tokens: bool, fit: bool) {
            let steps = steps(tokens, fit);
            for (at, step) in steps.iter().enumerate() {
                match step {
                    Step::Queue => {
                        assert!(
                            fit || self.held.is_none(),
                            "batch {batch}: buffers replaced while batch {:?} is unread",
                            self.held
                        );
                    }
                    Step::TakeHeld => {
                        if let Some((held, pending)) = self.held.take() {
                            if pending {
                                self.read.push(held);
                            }
                            self.handed_back.push(held);
                        }
                    }
                    Step::QueueDeferredCopies => {
                        if let Some(earlier) = self.in_buffer {
                            assert!(
                                self.read.contains(&earlier),
                                "batch {batch}'s copy overwrites batch {earlier}'s unread rows"
                            );
                        }
                        self.in_buffer = Some(batch);
                    }
                    Step::ReceiveEarly => {}
                }
                if tokens && fit && *step == Step::TakeHeld {
                    assert!(
                        steps[..at].contains(&Step::Queue),
                        "the device idles while the host takes the last batch"
                    );
                }
            }
            // A batch without tokens is held too, with nothing to read.
            self.held = Some((batch, tokens));
        }
    }

    #[test]
    fn the_hidden_tail_never_overwrites_unread_rows_and_hands_batches_back_in_order() {
        // Every run of five calls: each batch with tokens or without, fitting or not.
        for pattern in 0u32..1 << 10 {
            let mut model = Model::default();
            for batch in 0..5 {
                let bits = pattern >> (2 * batch);
                model.call(batch, bits & 1 == 0, bits & 2 == 0);
            }
            // `finish`.
            if let Some((held, _)) = model.held.take() {
                model.handed_back.push(held);
            }
            assert_eq!(model.handed_back, [0, 1, 2, 3, 4], "pattern {pattern:#b}");
        }
    }

    #[test]
    fn only_overlap_hides_the_tail() {
        assert!(overlaps(Some("overlap")) && overlaps(Some(" overlap ")));
        for other in [None, Some("wait"), Some(""), Some("yes")] {
            assert!(!overlaps(other), "{other:?}");
        }
    }
}
