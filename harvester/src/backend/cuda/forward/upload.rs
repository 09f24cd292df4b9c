//! Putting weights on the device: the load's conversion (f32 and f16 checkpoints rounded to
//! bf16 in parallel row tasks; a bf16 checkpoint's mapped bytes skip it) and its upload,
//! through the page-locked staging buffers of `staging`, timed apart ([`LoadPhases`]).

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtrMut};
use rayon::prelude::*;

use super::staging::{Plain, Staging};
use super::{Activation, OnDevice, memory_error};
use crate::error::Result;
use crate::model::Matrix;
use crate::model::weights::{Convert, Host};

/// Rows one conversion task rounds.
pub(super) const CONVERT_ROWS: usize = 64;

/// f32 values (norm weights) rounded to bf16 bits (`half`'s rounding, to nearest even).
pub(in crate::backend::cuda) fn bf16_values(values: &[f32]) -> Vec<u16> {
    values
        .par_iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect()
}

/// A matrix rounded to bf16 bits, its rows decoded and rounded in parallel tasks of
/// [`CONVERT_ROWS`] (the load's conversion phase: a bf16 checkpoint's mapped bytes skip it).
pub(in crate::backend::cuda) fn rounded_bf16(matrix: &Matrix) -> Vec<u16> {
    let cols = matrix.cols();
    let mut bits = vec![0u16; matrix.len()];
    if cols == 0 {
        return bits;
    }
    bits.par_chunks_mut(cols * CONVERT_ROWS)
        .enumerate()
        .for_each(|(task, out)| {
            let mut values = vec![0.0f32; out.len()];
            matrix.decode_rows(task * CONVERT_ROWS, &mut values);
            for (b, &v) in out.iter_mut().zip(&values) {
                *b = half::bf16::from_f32(v).to_bits();
            }
        });
    bits
}

/// Seconds each phase of putting the weights on the device took.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct LoadPhases {
    /// Rounding f32 or f16 weights to bf16 on the host (none for a bf16 checkpoint).
    pub convert_seconds: f64,
    /// Copying the weights to the device (staged: from the first chunk queued to the last
    /// one done).
    pub upload_seconds: f64,
    /// Compiling the kernels and loading their module.
    pub kernels_seconds: f64,
    /// The form of the kernels that loaded.
    pub kernel_code: &'static str,
    /// The attention kernel chosen for the model's head width.
    pub attention_kernel: &'static str,
    /// Whether the weights went up through page-locked staging buffers (else from pageable
    /// memory, by the driver).
    pub staged: bool,
}

/// A mapped bf16 part viewed as bf16 bits, when it is 2-byte aligned (a safetensors payload
/// is; the view is refused otherwise and the caller converts).
pub(super) fn bf16_bits(part: &[u8]) -> Option<&[u16]> {
    // SAFETY: every bit pattern is a valid u16, and `align_to` only yields the aligned middle;
    // empty ends mean the whole part was viewed. x86-64 is little-endian, as safetensors is.
    #[allow(unsafe_code)]
    let (head, bits, tail) = unsafe { part.align_to::<u16>() };
    (head.is_empty() && tail.is_empty()).then_some(bits)
}

/// Puts weights on the device, timing conversion and upload apart.
pub(super) struct Uploader<'a> {
    pub(super) stream: &'a Arc<CudaStream>,
    pub(super) phases: LoadPhases,
    /// Page-locked buffers the weights pass through, unless the driver's pageable path is
    /// kept (`staging`).
    pub(super) staging: Option<Staging>,
}

impl Uploader<'_> {
    /// Queues `values` for `device` starting at element `offset`; `values` may be dropped on
    /// return (they are staged, or copied by the driver before it returns).
    pub(super) fn copy<T: Plain>(
        &mut self,
        values: &[T],
        device: &mut CudaSlice<T>,
        offset: usize,
    ) -> Result<()> {
        let start = Instant::now();
        let failed = |e| memory_error("uploading the weights")(e);
        let mut view = device.slice_mut(offset..offset + values.len());
        match &mut self.staging {
            Some(staging) => {
                let (dst, _record) = view.device_ptr_mut(self.stream);
                staging
                    .upload(self.stream, T::bytes(values), dst)
                    .map_err(failed)?;
            }
            None => self.stream.memcpy_htod(values, &mut view).map_err(failed)?,
        }
        self.phases.upload_seconds += start.elapsed().as_secs_f64();
        Ok(())
    }

    /// Waits for the last staged uploads, counting the wait as upload time.
    pub(super) fn finish(&mut self) -> Result<()> {
        let start = Instant::now();
        if let Some(staging) = &self.staging {
            staging
                .finish()
                .map_err(|e| memory_error("uploading the weights")(e))?;
        }
        self.phases.upload_seconds += start.elapsed().as_secs_f64();
        Ok(())
    }

    pub(super) fn alloc<T: Plain>(&mut self, len: usize) -> Result<CudaSlice<T>> {
        // SAFETY: every element is written by `copy` before any kernel reads it (the callers
        // cover `0..len` with their parts).
        #[allow(unsafe_code)]
        // One value at least: the driver refuses empty allocations (a sparse block without
        // shared experts has no MLP of its own).
        let slice = unsafe { self.stream.alloc::<T>(len.max(1)) };
        slice.map_err(|e| memory_error("allocating the weights")(e))
    }

    /// f32 values (biases) as they are.
    pub(super) fn f32s(&mut self, values: &[f32]) -> Result<CudaSlice<f32>> {
        let start = Instant::now();
        let device = self
            .stream
            .clone_htod(values)
            .map_err(|e| memory_error("uploading the weights")(e))?;
        self.phases.upload_seconds += start.elapsed().as_secs_f64();
        Ok(device)
    }
}

/// The upload of each kind of weight: matrices and norms in `E`, biases and the router in f32.
impl<E: Activation> Convert<Host, OnDevice<E>> for Uploader<'_> {
    fn matrix(&mut self, matrix: Matrix) -> Result<CudaSlice<E>> {
        E::upload_matrix(self, &matrix)
    }
    fn norm(&mut self, norm: Vec<f32>) -> Result<CudaSlice<E>> {
        E::upload_values(self, &norm)
    }
    fn bias(&mut self, bias: Vec<f32>) -> Result<CudaSlice<f32>> {
        self.f32s(&bias)
    }
    fn router(&mut self, router: Matrix) -> Result<CudaSlice<f32>> {
        // f32: the logits choose experts, so they are not rounded.
        self.f32s(&router.to_f32_vec())
    }
}
