//! Captured rows on their way to the host, overlapped with the rest of the pass. Each kept
//! layer has its own slot on the device and its own pinned host buffer. As soon as a kept block
//! has run, its slot is queued for copying on a second stream (behind an event, so the copy
//! waits for that block and nothing later), and the host copies each slot into the caller's
//! rows as its copy lands, while later blocks still run. Only the deepest kept layer's copies
//! are left at the end of a batch.
//!
//! Activations travel and are held as bf16 (`Held::Bf16`): the shards store bf16, so nothing a
//! shard keeps is lost, and the copies and the host's capture buffers take half the bytes.
//! Projections travel and are held as f32, as their shards store them.
//!
//! ```text
//! compute stream: block k ─ keep k ─ record computed[k] ─ block k+1 ─ …
//! copy stream:              wait computed[k] ─ copy slot k → pinned[k] ─ record downloaded[k]
//! host:                                          wait downloaded[k] ─ copy pinned[k] → out[k]
//! ```

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{
    CudaEvent, CudaSlice, CudaStream, DeviceRepr, PinnedHostSlice, ValidAsZeroBits,
};
use rayon::prelude::*;

use super::error::CudaError;
use crate::error::Result;

/// What a failed [`Slots::send`] was doing.
const SEND_ACTION: &str = "queueing a kept layer's copy to the host";

/// Values each host thread copies at a time: large enough to amortise rayon's scheduling,
/// small enough to spread one slot of a small batch over the cores.
const COPY_CHUNK: usize = 1 << 16;

/// A value type a slot travels in: bf16 bits or f32.
pub(super) trait Element:
    DeviceRepr + ValidAsZeroBits + Copy + Default + Send + Sync
{
}

impl Element for u16 {}

impl Element for f32 {}

/// Copies `source` into `out` (the same length) on the rayon pool.
fn copy_on_pool<T: Element>(source: &[T], out: &mut [T]) {
    out.par_chunks_mut(COPY_CHUNK)
        .zip(source.par_chunks(COPY_CHUNK))
        .for_each(|(out, source)| out.copy_from_slice(source));
}

/// Where a slot lands on the host.
enum HostRows<T> {
    /// Page-locked: the copy engine writes it while the host goes on queueing.
    PageLocked(PinnedHostSlice<T>),
    /// Where the host refuses page-locked memory: the driver copies into pageable memory
    /// before the call that queues the copy returns, so the pass waits at each kept layer.
    Pageable(Vec<T>),
}

/// `count` buffers from `page_locked`, or from `pageable` for each one from the first
/// refusal on (the rest are not tried); the refusal is returned, to be reported once.
fn allocate_each<B, E>(
    count: usize,
    mut page_locked: impl FnMut() -> std::result::Result<B, E>,
    pageable: impl Fn() -> B,
) -> (Vec<B>, Option<E>) {
    let mut refusal = None;
    let buffers = (0..count)
        .map(|_| {
            if refusal.is_none() {
                match page_locked() {
                    Ok(buffer) => return buffer,
                    Err(error) => refusal = Some(error),
                }
            }
            pageable()
        })
        .collect();
    (buffers, refusal)
}

/// The kept layers' slots of one batch, on the device and on the host.
pub(super) struct Slots<T> {
    /// `[kept, capacity]` on the device; the forward pass writes slot `k` at
    /// `k * capacity..`.
    pub device: CudaSlice<T>,
    /// Slot `k`'s copy on the host, page-locked where the host allows it.
    host: Vec<HostRows<T>>,
    /// Recorded on the compute stream once slot `k` is written.
    computed: Vec<CudaEvent>,
    /// Recorded on the copy stream once slot `k` is on the host.
    downloaded: Vec<CudaEvent>,
    /// Values per slot: tokens times width of the largest batch.
    pub capacity: usize,
}

impl<T: Element> Slots<T> {
    /// Slots for `kept` layers of `capacity` values each, on `stream`'s device.
    pub fn new(stream: &Arc<CudaStream>, kept: usize, capacity: usize) -> Result<Self> {
        let action = "allocating the captured rows";
        let context = stream.context();
        // One value at least: a pipeline stage may keep no layer, and the driver refuses an
        // allocation of zero bytes.
        let device = stream
            .alloc_zeros::<T>((kept * capacity).max(1))
            .map_err(|e| CudaError::from_driver(action, e))?;
        let page_locked = || {
            // SAFETY: the memory is filled with zeros below before any read. Flags 0: cached,
            // not write-combined, since the host reads it back.
            #[allow(unsafe_code)]
            let mut slice = unsafe { context.alloc_pinned_with_flags::<T>(capacity, 0) }?;
            slice.as_mut_slice()?.fill(T::default());
            Ok::<_, cudarc::driver::DriverError>(HostRows::PageLocked(slice))
        };
        let pageable = || HostRows::Pageable(vec![T::default(); capacity]);
        let (host, refusal) = allocate_each(kept, page_locked, pageable);
        if let Some(error) = refusal {
            let pageable = host
                .iter()
                .filter(|h| matches!(h, HostRows::Pageable(_)))
                .count();
            tracing::warn!(error = ?error.0, pageable, kept, "no page-locked memory for the captured rows: those slots are copied to pageable memory, and the pass waits for each");
        }
        let event = |flags| {
            context
                .new_event(Some(flags))
                .map_err(|e| CudaError::from_driver(action, e))
        };
        let computed = (0..kept)
            .map(|_| event(CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .collect::<std::result::Result<_, _>>()?;
        // The host blocks on these: a blocking wait yields the core instead of spinning (the
        // flag cannot be combined with DISABLE_TIMING through cudarc's enum; timing costs
        // little at one record a slot).
        let downloaded = (0..kept)
            .map(|_| event(CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .collect::<std::result::Result<_, _>>()?;
        Ok(Self {
            device,
            host,
            computed,
            downloaded,
            capacity,
        })
    }

    /// Page-locked host bytes these slots hold.
    pub fn host_bytes(&self) -> usize {
        self.host
            .iter()
            .map(|host| match host {
                HostRows::PageLocked(slice) => slice.num_bytes(),
                HostRows::Pageable(_) => 0,
            })
            .sum()
    }

    /// Queues slot `slot`'s first `len` values for the host, after the work queued on
    /// `compute` so far (which wrote the slot); a `deferred` slot is only marked written, its
    /// copy queued later by [`Self::queue_copy`].
    pub fn send(
        &mut self,
        compute: &CudaStream,
        copies: &Arc<CudaStream>,
        (slot, len): (usize, usize),
        deferred: bool,
    ) -> Result<()> {
        self.computed[slot]
            .record(compute)
            .map_err(|e| CudaError::from_driver(SEND_ACTION, e))?;
        if deferred {
            return Ok(());
        }
        self.queue_copy(copies, slot, len)
    }

    /// Queues the copy of slot `slot`'s first `len` values to the host, behind the last
    /// recorded write of the slot.
    pub fn queue_copy(&mut self, copies: &Arc<CudaStream>, slot: usize, len: usize) -> Result<()> {
        let fault = |e| CudaError::from_driver(SEND_ACTION, e);
        copies.wait(&self.computed[slot]).map_err(fault)?;
        let start = slot * self.capacity;
        let rows = self.device.slice(start..start + len);
        match &mut self.host[slot] {
            HostRows::PageLocked(host) => copies.memcpy_dtoh(&rows, host),
            HostRows::Pageable(host) => copies.memcpy_dtoh(&rows, host),
        }
        .map_err(fault)?;
        self.downloaded[slot].record(copies).map_err(fault)?;
        Ok(())
    }

    /// Makes the work queued on `compute` from now on wait until the last queued copy of slot
    /// `slot` has read it: a batch overwrites a slot the batch before may still be copying.
    pub fn wait_copied(&self, compute: &CudaStream, slot: usize) -> Result<()> {
        compute
            .wait(&self.downloaded[slot])
            .map_err(|e| CudaError::from_driver(SEND_ACTION, e).into())
    }

    /// Waits until slot `slot` is on the host, then copies its first `out.len()` values into
    /// `out`.
    pub fn receive(&self, slot: usize, out: &mut [T]) -> Result<()> {
        // A kernel fault of the pass surfaces here, the first wait after it.
        let action = "running the forward pass and copying its captures";
        self.downloaded[slot]
            .synchronize()
            .map_err(|e| CudaError::from_driver(action, e))?;
        let host = match &self.host[slot] {
            HostRows::PageLocked(host) => host
                .as_slice()
                .map_err(|e| CudaError::from_driver(action, e))?,
            HostRows::Pageable(host) => host.as_slice(),
        };
        copy_on_pool(&host[..out.len()], out);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_lands_in_the_callers_rows_bit_for_bit_across_chunk_edges() {
        let bits: Vec<u16> = (0..COPY_CHUNK * 2 + 37)
            .map(|i| (i * 7919 % 65_536) as u16)
            .collect();
        let mut out = vec![0u16; bits.len()];
        copy_on_pool(&bits, &mut out);
        assert_eq!(out, bits);
        let values: Vec<f32> = (0..1000).map(|i| i as f32 * -1.5e-3).collect();
        let mut out = vec![0.0; values.len()];
        copy_on_pool(&values, &mut out);
        assert_eq!(out, values);
    }

    #[test]
    fn after_the_first_refusal_of_page_locked_memory_every_later_slot_is_pageable() {
        let mut tries = 0;
        let (buffers, refusal) = allocate_each(
            5,
            || {
                tries += 1;
                if tries <= 2 {
                    Ok("page-locked")
                } else {
                    Err("refused")
                }
            },
            || "pageable",
        );
        assert_eq!(
            buffers,
            [
                "page-locked",
                "page-locked",
                "pageable",
                "pageable",
                "pageable"
            ]
        );
        assert_eq!(refusal, Some("refused"));
        assert_eq!(
            tries, 3,
            "no page-locked memory is asked for after a refusal"
        );
        let (buffers, refusal) = allocate_each(2, || Ok::<_, ()>("page-locked"), || "pageable");
        assert_eq!((buffers, refusal), (vec!["page-locked"; 2], None));
    }
}
