//! The forward pass of a run: one backend or a chain of pipeline stages (`engine`, `staged`), fed
//! the batches that `batches` packs for both.

pub(super) mod batches;
pub(super) mod engine;
pub(super) mod staged;
