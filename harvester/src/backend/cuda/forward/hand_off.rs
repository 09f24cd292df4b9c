//! The residual stream's way between pipeline stages: through one page-locked host buffer per
//! stage, so the copy engine moves it at the link's rate both ways, and the host copies it to
//! and from the pipeline's own rows in parallel tasks. From pageable memory the driver copies
//! through a small bounce buffer of its own, a piece at a time (5.4 to 7.4 GB/s measured for
//! the weights, docs/gpu.md): for a 405B model a batch of 8,192 tokens hands on 537 MB.
//!
//! The buffer is cached (not write-combined), since the host reads it back. One buffer is
//! enough: on the stage's stream the upload that reads it comes before the download that
//! writes it, and the host waits for the download before it reads the buffer or refills it.
//! Where page-locked memory cannot be had, the driver's pageable path stays.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DriverError, PinnedHostSlice};
use rayon::prelude::*;

/// Values one host task copies at a time.
const HAND_OFF_TASK: usize = 1 << 18;

/// A stage's page-locked buffer for the residual stream; it only grows.
#[derive(Default)]
pub(super) struct HandOff {
    buffer: Option<PinnedHostSlice<f32>>,
    /// The stream its copies run on, waited for before the buffer is freed.
    stream: Option<Arc<CudaStream>>,
    /// The host refused page-locked memory once: the pageable path stays.
    refused: bool,
}

impl Drop for HandOff {
    fn drop(&mut self) {
        // The device waits for its streams before it drops this (`settle`); this wait is for
        // an owner that did not.
        if let (Some(stream), Some(_)) = (&self.stream, &self.buffer)
            && let Err(error) = stream.synchronize()
        {
            // Freeing a buffer an upload may still read would corrupt whatever takes the
            // memory next: it is left to the process's end.
            tracing::warn!(error = ?error.0, "the residual stream's copies could not be waited for: its page-locked buffer is not freed");
            super::settle::leave_unfreed(self.buffer.take());
        }
    }
}

impl HandOff {
    /// The buffer, of at least `values`, or none where the host refuses page-locked memory
    /// (logged once).
    fn buffer(
        &mut self,
        stream: &Arc<CudaStream>,
        values: usize,
    ) -> Result<Option<&mut PinnedHostSlice<f32>>, DriverError> {
        if self.refused {
            return Ok(None);
        }
        if self.buffer.as_ref().is_none_or(|b| b.len() < values) {
            // The old buffer goes once no copy reads it.
            if self.buffer.is_some() {
                stream.synchronize()?;
            }
            self.buffer = None;
            self.stream = Some(stream.clone());
            // SAFETY: every value the host reads is first written: by `upload`'s copy, or by
            // the download it waits for. Flags 0: cached, since the host reads it back.
            #[allow(unsafe_code)]
            match unsafe { stream.context().alloc_pinned_with_flags::<f32>(values, 0) } {
                Ok(buffer) => self.buffer = Some(buffer),
                Err(error) => {
                    tracing::warn!(%error, values, "no page-locked buffer for the residual stream: it is handed on from pageable memory");
                    self.refused = true;
                }
            }
        }
        Ok(self.buffer.as_mut())
    }

    /// Queues `x` for `device` (at least as long) on `stream`.
    pub(super) fn upload(
        &mut self,
        stream: &Arc<CudaStream>,
        x: &[f32],
        device: &mut CudaSlice<f32>,
    ) -> Result<(), DriverError> {
        let mut view = device.slice_mut(..x.len());
        let Some(buffer) = self.buffer(stream, x.len())? else {
            return stream.memcpy_htod(x, &mut view);
        };
        let staged = &mut buffer.as_mut_slice()?[..x.len()];
        parallel_copy(x, staged);
        // The slice, not the pinned buffer itself, so that cudarc records no event of its own
        // on it: the stream's order and the wait in `download` keep the buffer safe.
        stream.memcpy_htod(&*staged, &mut view)
    }

    /// Copies `device`'s first `x.len()` values into `x` once the work queued on `stream` so
    /// far is done, waiting for it.
    pub(super) fn download(
        &mut self,
        stream: &Arc<CudaStream>,
        device: &CudaSlice<f32>,
        x: &mut [f32],
    ) -> Result<(), DriverError> {
        let view = device.slice(..x.len());
        let Some(buffer) = self.buffer(stream, x.len())? else {
            stream.memcpy_dtoh(&view, x)?;
            return stream.synchronize();
        };
        let staged = &mut buffer.as_mut_slice()?[..x.len()];
        stream.memcpy_dtoh(&view, staged)?;
        stream.synchronize()?;
        parallel_copy(staged, x);
        Ok(())
    }
}

/// `to.copy_from_slice(from)` in parallel tasks of [`HAND_OFF_TASK`] values.
fn parallel_copy(from: &[f32], to: &mut [f32]) {
    to.par_chunks_mut(HAND_OFF_TASK)
        .zip(from.par_chunks(HAND_OFF_TASK))
        .for_each(|(to, from)| to.copy_from_slice(from));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parallel_copy_moves_every_value_across_task_edges() {
        let from: Vec<f32> = (0..2 * HAND_OFF_TASK + 5).map(|i| i as f32 * 0.5).collect();
        let mut to = vec![f32::NAN; from.len()];
        parallel_copy(&from, &mut to);
        assert_eq!(to, from);
    }
}
