//! The activations' type between kernels, one per compute mode: bf16 bits (`u16`) in the bf16
//! mode, `f32` in the f32 mode. The pass is generic over it ([`super::Device`]); the weights
//! are uploaded in it, its GEMMs take it as input, and `kernels.cu` has an entry point of each
//! typed kernel for each (`name`, `name_f32`).

use std::time::Instant;

use crate::backend::cuda::blas::{ComputeType, DataType};
use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use harvest_core::plan::Precision;
use rayon::prelude::*;

use super::upload::{CONVERT_ROWS, bf16_bits};
use super::{F32, Pass, Uploader, bf16_values, rounded_bf16};
use crate::backend::cuda::launch;
use crate::error::Result;
use crate::model::{Half, Matrix};

/// The type of the activations between kernels and of the weights, for one compute mode.
pub(super) trait Activation:
    DeviceRepr + ValidAsZeroBits + Copy + Default + Unpin + Send + Sync + std::fmt::Debug + 'static
{
    /// The mode this type computes.
    const PRECISION: Precision;
    /// cuBLAS's name for the type.
    const DATA_TYPE: DataType;
    /// The GEMMs' compute type over it: f32 sums, and for f32 inputs the pedantic type, so no
    /// TF32 rounding creeps into the f32 mode.
    const COMPUTE: ComputeType;
    /// The suffix of this mode's entry points in `kernels.cu`.
    const KERNEL_SUFFIX: &'static str;
    /// The norm kept in f32 (AFMoE's branch norms and router input) for this mode's weights.
    const WIDE_NORM: &'static str;

    /// f32 values (norm weights) in this type, on the device.
    fn upload_values(up: &mut Uploader<'_>, values: &[f32]) -> Result<CudaSlice<Self>>;

    /// A weight matrix in this type, on the device.
    fn upload_matrix(up: &mut Uploader<'_>, matrix: &Matrix) -> Result<CudaSlice<Self>>;

    /// `out = a · wᵀ + bias` over the pass's tokens, `shape` being `(n, k)`: a projection with
    /// a bias (Qwen2's QKV). `wide` is an f32 buffer of `tokens · n` where the mode needs one.
    fn biased_product(
        p: &Pass<'_>,
        inputs: (&CudaSlice<Self>, &CudaSlice<Self>, &CudaSlice<f32>),
        outputs: (&mut CudaSlice<Self>, &mut CudaSlice<f32>),
        shape: (usize, usize),
    ) -> Result<()>;
}

impl Activation for u16 {
    const PRECISION: Precision = Precision::Bf16;
    const DATA_TYPE: DataType = DataType::R_16BF;
    const COMPUTE: ComputeType = ComputeType::F32;
    const KERNEL_SUFFIX: &'static str = "";
    const WIDE_NORM: &'static str = "rms_norm_wide";

    /// Rounded to bf16.
    fn upload_values(up: &mut Uploader<'_>, values: &[f32]) -> Result<CudaSlice<u16>> {
        let start = Instant::now();
        let bits = bf16_values(values);
        up.phases.convert_seconds += start.elapsed().as_secs_f64();
        let mut device = up.alloc(bits.len())?;
        up.copy(&bits, &mut device, 0)?;
        Ok(device)
    }

    /// A bf16 checkpoint's mapped bytes go straight to the device; f32 or f16 weights are
    /// rounded to bf16 once on the host.
    fn upload_matrix(up: &mut Uploader<'_>, matrix: &Matrix) -> Result<CudaSlice<u16>> {
        let mut device = up.alloc(matrix.len())?;
        if matrix.half() == Some(Half::Bf16) {
            let mut offset = 0;
            for part in matrix.half_bytes() {
                match bf16_bits(part) {
                    Some(bits) => up.copy(bits, &mut device, offset)?,
                    None => {
                        let start = Instant::now();
                        let bits: Vec<u16> = part
                            .chunks_exact(2)
                            .map(|b| u16::from_le_bytes([b[0], b[1]]))
                            .collect();
                        up.phases.convert_seconds += start.elapsed().as_secs_f64();
                        up.copy(&bits, &mut device, offset)?;
                    }
                }
                offset += part.len() / 2;
            }
            return Ok(device);
        }
        let start = Instant::now();
        let bits = rounded_bf16(matrix);
        up.phases.convert_seconds += start.elapsed().as_secs_f64();
        up.copy(&bits, &mut device, 0)?;
        Ok(device)
    }

    /// The product summed in f32 into `wide`, then the f32 bias added and the sum rounded
    /// once (`add_bias_bf16`).
    fn biased_product(
        p: &Pass<'_>,
        (a, w, bias): (&CudaSlice<u16>, &CudaSlice<u16>, &CudaSlice<f32>),
        (out, wide): (&mut CudaSlice<u16>, &mut CudaSlice<f32>),
        (n, k): (usize, usize),
    ) -> Result<()> {
        p.gemm(a, w, wide, F32, (n, k), 0.0)?;
        let kernel = &p.kernels.add_bias_bf16;
        launch::add_bias_bf16(p.stream, kernel, wide, bias, out, (p.tokens * n, n))
    }
}

impl Activation for f32 {
    const PRECISION: Precision = Precision::F32;
    const DATA_TYPE: DataType = DataType::R_32F;
    const COMPUTE: ComputeType = ComputeType::F32_PEDANTIC;
    const KERNEL_SUFFIX: &'static str = "_f32";
    const WIDE_NORM: &'static str = "rms_norm_f32";

    /// As they are.
    fn upload_values(up: &mut Uploader<'_>, values: &[f32]) -> Result<CudaSlice<f32>> {
        up.f32s(values)
    }

    /// Widened exactly from the checkpoint's storage, as the CPU's f32 mode reads it.
    fn upload_matrix(up: &mut Uploader<'_>, matrix: &Matrix) -> Result<CudaSlice<f32>> {
        let start = Instant::now();
        let values = decoded_f32(matrix);
        up.phases.convert_seconds += start.elapsed().as_secs_f64();
        let mut device = up.alloc(values.len())?;
        up.copy(&values, &mut device, 0)?;
        Ok(device)
    }

    /// The f32 product gains its bias in place (`add_bias`): nothing to round.
    fn biased_product(
        p: &Pass<'_>,
        (a, w, bias): (&CudaSlice<f32>, &CudaSlice<f32>, &CudaSlice<f32>),
        (out, _): (&mut CudaSlice<f32>, &mut CudaSlice<f32>),
        (n, k): (usize, usize),
    ) -> Result<()> {
        p.gemm(a, w, out, F32, (n, k), 0.0)?;
        launch::add_bias(p.stream, &p.kernels.add_bias, out, bias, (p.tokens * n, n))
    }
}

/// A matrix's values in f32, its rows decoded in parallel tasks of [`CONVERT_ROWS`].
pub(in crate::backend::cuda) fn decoded_f32(matrix: &Matrix) -> Vec<f32> {
    let cols = matrix.cols();
    let mut values = vec![0.0f32; matrix.len()];
    if cols == 0 {
        return values;
    }
    values
        .par_chunks_mut(cols * CONVERT_ROWS)
        .enumerate()
        .for_each(|(task, out)| matrix.decode_rows(task * CONVERT_ROWS, out));
    values
}
