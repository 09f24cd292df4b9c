//! The weights' way to the device: through two page-locked buffers, so the copy engine reads
//! host memory at its full rate and the host fills one buffer (in parallel tasks, from the
//! mapped checkpoint or the conversion's output) while the other is uploaded. From pageable
//! memory the driver copies through a small bounce buffer of its own, one piece at a time:
//! 5.4 to 7.4 GB/s on an H200 (docs/gpu.md), where the link takes several times that.
//!
//! ```text
//! host:   fill A ─ fill B ─ wait A uploaded ─ fill A ─ …
//! stream:          upload A ─ upload B ──────────────── upload A ─ …
//! ```
//!
//! `HARVEST_CUDA_UPLOAD=pageable` keeps the driver's own path (for a window's side-by-side
//! figure); so does a host where page-locked memory cannot be had.

use std::sync::Arc;

use cudarc::driver::sys::{CUdeviceptr, CUevent_flags};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DriverError, PinnedHostSlice};
use rayon::prelude::*;

/// Bytes of each staging buffer.
const STAGING_BYTES: usize = 64 << 20;
/// Bytes one host task copies into a staging buffer: large enough to amortise rayon's
/// scheduling, small enough to spread a buffer over every core.
const STAGING_TASK_BYTES: usize = 2 << 20;

/// The environment variable that keeps the driver's pageable upload (`pageable`).
pub const UPLOAD_VARIABLE: &str = "HARVEST_CUDA_UPLOAD";

/// A value type weights are uploaded in, seen as its bytes.
pub(super) trait Plain: cudarc::driver::DeviceRepr {
    fn bytes(values: &[Self]) -> &[u8]
    where
        Self: Sized;
}

macro_rules! plain {
    ($($t:ty),*) => {$(
        impl Plain for $t {
            fn bytes(values: &[Self]) -> &[u8] {
                // SAFETY: a plain number type: no padding, every byte initialised, and u8's
                // alignment is 1; the view borrows `values` for its lifetime.
                #[allow(unsafe_code)]
                unsafe {
                    std::slice::from_raw_parts(values.as_ptr().cast(), size_of_val(values))
                }
            }
        }
    )*};
}
plain!(u16, f32);

/// Two page-locked buffers and the events that say when each is free again.
pub(super) struct Staging {
    /// Two; a Vec so that `Drop` can leave them unfreed.
    buffers: Vec<PinnedHostSlice<u8>>,
    /// Recorded on the stream after the upload that reads buffer `i`.
    uploaded: [CudaEvent; 2],
    /// The buffer the next chunk goes through.
    next: usize,
}

impl Staging {
    /// The buffers on `context`, or none where `forced` (the value of [`UPLOAD_VARIABLE`]) is
    /// `pageable` or the host refuses page-locked memory (logged; the upload is then the
    /// driver's).
    pub(super) fn new(context: &Arc<CudaContext>, forced: Option<&str>) -> Option<Self> {
        if forced.map(str::trim) == Some("pageable") {
            return None;
        }
        match Self::allocate(context) {
            Ok(staging) => Some(staging),
            Err(error) => {
                tracing::warn!(%error, bytes = 2 * STAGING_BYTES, "no page-locked staging buffers: the weights go up from pageable memory");
                None
            }
        }
    }

    fn allocate(context: &Arc<CudaContext>) -> Result<Self, DriverError> {
        // SAFETY: the buffers are written (up to each chunk's length) before any upload reads
        // them; write-combined suits memory the host only writes and the device only reads.
        #[allow(unsafe_code)]
        let buffer = || unsafe { context.alloc_pinned::<u8>(STAGING_BYTES) };
        let event = || context.new_event(Some(CUevent_flags::CU_EVENT_BLOCKING_SYNC));
        Ok(Self {
            buffers: vec![buffer()?, buffer()?],
            uploaded: [event()?, event()?],
            next: 0,
        })
    }

    /// Queues `bytes` for the device memory at `dst`, which holds at least as many, on
    /// `stream`; returns once the last chunk is in a staging buffer (not on the device).
    pub(super) fn upload(
        &mut self,
        stream: &CudaStream,
        bytes: &[u8],
        dst: CUdeviceptr,
    ) -> Result<(), DriverError> {
        for (index, chunk) in bytes.chunks(STAGING_BYTES).enumerate() {
            let slot = self.next;
            self.next ^= 1;
            // The upload that last read this buffer is done.
            self.uploaded[slot].synchronize()?;
            let host = &mut self.buffers[slot].as_mut_slice()?[..chunk.len()];
            host.par_chunks_mut(STAGING_TASK_BYTES)
                .zip(chunk.par_chunks(STAGING_TASK_BYTES))
                .for_each(|(to, from)| to.copy_from_slice(from));
            let offset = (index * STAGING_BYTES) as CUdeviceptr;
            // The raw call below does not make the stream's context current, as cudarc's own
            // calls do.
            stream.context().bind_to_thread()?;
            // SAFETY: `dst + offset` starts a run of at least `chunk.len()` device bytes (the
            // caller's buffer holds all of `bytes`); the source is page-locked memory that no
            // one writes until `uploaded[slot]`, recorded right after this copy on the same
            // stream, has passed (checked above before the next fill, and in `Drop`).
            #[allow(unsafe_code)]
            unsafe {
                cudarc::driver::result::memcpy_htod_async(dst + offset, host, stream.cu_stream())
            }?;
            self.uploaded[slot].record(stream)?;
        }
        Ok(())
    }

    /// Waits until both buffers' uploads are done.
    pub(super) fn finish(&self) -> Result<(), DriverError> {
        self.uploaded.iter().try_for_each(CudaEvent::synchronize)
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // A load that succeeded waited in `finish` already; this wait is for one that failed
        // with uploads queued. The buffers are freed only once no upload reads them.
        if let Err(error) = self.finish() {
            // Freeing a buffer the copy engine may still read would hand it memory that
            // something else then writes: it is left to the process's end.
            tracing::warn!(error = ?error.0, "the weights' uploads could not be waited for: their page-locked staging buffers are not freed");
            super::settle::leave_unfreed(std::mem::take(&mut self.buffers));
        }
    }
}
