//! The bf16 compute mode's matrix product: bf16 inputs, f32 accumulation.
//!
//! `out[r, c] (+)= Σ_k a[r, k] · b[c, k]` with `a` and `b` row-major bf16 (`b` a PyTorch
//! `[out, in]` weight). On a CPU with AVX512-BF16, `b` is packed per product into panels of
//! [`PANEL`] columns with each pair of `k` adjacent (the layout `vdpbf16ps` reads), and an
//! [`MR`]-row × [`PANEL`]-column block of `out` accumulates in registers, one pair of `k` at a
//! time: 32 products per instruction, no horizontal sums. Elsewhere both operands widen exactly
//! to f32 and the f32 kernel (`sgemm`) runs, which differs only in the order of the f32 sums.
//! Either way each output is one row of `a` against one row of `b`, summed in a fixed order, so
//! the result does not depend on the batch it is in or on the thread count.
#![allow(unsafe_code)]

use rayon::prelude::*;

use super::matmul::MatRef;
use super::sgemm;

/// Rows of `a` in one register block.
pub const MR: usize = 8;
/// Columns of `out` in one register block and one packed panel of `b` (two zmm of f32).
pub const PANEL: usize = 32;
/// Rows of `a` one rayon task takes (a multiple of [`MR`]): enough that each packed panel is
/// reused across many register blocks while it is in cache.
const ROWS_PER_TASK: usize = 8 * MR;

/// A bf16 value's bits from an f32, rounded to nearest even (NaN stays NaN).
#[inline]
pub fn to_bf16_bits(value: f32) -> u16 {
    (crate::dtype::bf16_rounded_bits(value) >> 16) as u16
}

/// Rounds `src` to bf16 bits into `dst` (the same length), in parallel.
pub fn round_into(src: &[f32], dst: &mut [u16]) {
    dst.par_chunks_mut(4096)
        .zip(src.par_chunks(4096))
        .for_each(|(d, s)| {
            for (d, &s) in d.iter_mut().zip(s) {
                *d = to_bf16_bits(s);
            }
        });
}

/// Rounds every value of `values` to the nearest bf16, in place (kept as f32).
pub fn round_in_place(values: &mut [f32]) {
    values.par_chunks_mut(4096).for_each(round_rows);
}

/// [`round_in_place`] on one chunk, for callers that already split the work.
pub fn round_rows(values: &mut [f32]) {
    for v in values {
        *v = crate::dtype::round_bf16(*v);
    }
}

/// Little-endian bf16 bytes as `u16`s without a copy, when they are 2-byte aligned and the
/// machine is little-endian.
pub fn aligned(bytes: &[u8]) -> Option<&[u16]> {
    // SAFETY: every bit pattern is a valid u16, and align_to only reinterprets the aligned
    // middle of the slice; a non-empty prefix or suffix is refused below.
    let (head, body, tail) = unsafe { bytes.align_to::<u16>() };
    (head.is_empty() && tail.is_empty() && cfg!(target_endian = "little")).then_some(body)
}

/// Whether this CPU runs the `vdpbf16ps` kernel.
pub fn has_dot_instructions() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512bf16")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Scratch of the packed product, kept across calls so steady state allocates nothing.
#[derive(Debug, Default)]
pub struct Packed {
    /// `a` padded to whole register blocks and an even `k`.
    a: Vec<u16>,
    /// `b` in panels: `[panel][k / 2][PANEL][2]`.
    b: Vec<u16>,
}

/// `out[r, c] (+)= Σ_k a[r, k] · b[c, k]` for `a: [rows, k]` and `b: [cols, k]` bf16 bits;
/// `out` has row stride `out_stride` and its first `cols` columns are written.
///
/// # Panics
/// If a slice is shorter than its shape: a bug in the caller.
pub fn matmul_bf16(
    a: &[u16],
    b: &[u16],
    k: usize,
    out: &mut [f32],
    out_stride: usize,
    accumulate: bool,
    packed: &mut Packed,
) {
    let rows = a.len().checked_div(k).unwrap_or(0);
    let cols = b.len().checked_div(k).unwrap_or(0);
    assert!(
        a.len() == rows * k
            && b.len() == cols * k
            && cols <= out_stride
            && (rows == 0 || out.len() >= (rows - 1) * out_stride + cols),
        "bf16 matmul shapes do not fit. This is a bug."
    );
    if rows == 0 || cols == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_dot_instructions() {
        let kp = k.next_multiple_of(2);
        pack(a, b, k, packed);
        let (a, b) = (&packed.a, &packed.b);
        out.par_chunks_mut(ROWS_PER_TASK * out_stride)
            .enumerate()
            .for_each(|(task, out)| {
                let first = task * ROWS_PER_TASK;
                let task_rows = ROWS_PER_TASK.min(rows - first);
                let a = &a[first * kp..(first + task_rows.next_multiple_of(MR)) * kp];
                for (panel, b) in b.chunks_exact(kp * PANEL).enumerate() {
                    let c = panel * PANEL;
                    let width = PANEL.min(cols - c);
                    for (block, a) in a.chunks_exact(MR * kp).enumerate() {
                        let r = block * MR;
                        let height = MR.min(task_rows - r);
                        let out = &mut out[r * out_stride + c..];
                        let tile = Tile {
                            out,
                            out_stride,
                            height,
                            width,
                            accumulate,
                        };
                        // SAFETY: the CPU has AVX512-F, AVX512-BW and AVX512-BF16 (checked
                        // above); the kernel only indexes slices, bounds-checked.
                        unsafe { avx512::kernel(a, b, kp, tile) }
                    }
                }
            });
        return;
    }
    let _ = packed;
    widened(a, b, k, out, out_stride, accumulate);
}

/// One register block's destination.
struct Tile<'a> {
    out: &'a mut [f32],
    out_stride: usize,
    /// Rows of the block that exist (the rest of `a` is padding).
    height: usize,
    /// Columns of the panel that exist.
    width: usize,
    accumulate: bool,
}

/// Pads `a` to whole register blocks of rows and an even `k`, and packs `b` into panels of
/// [`PANEL`] columns with pairs of `k` adjacent, zero-padded.
fn pack(a: &[u16], b: &[u16], k: usize, packed: &mut Packed) {
    let kp = k.next_multiple_of(2);
    let rows = a.len() / k;
    let cols = b.len() / k;
    packed.a.clear();
    packed.a.resize(rows.next_multiple_of(MR) * kp, 0);
    packed
        .a
        .par_chunks_mut(kp)
        .zip(a.par_chunks(k))
        .for_each(|(dst, src)| dst[..k].copy_from_slice(src));
    let panels = cols.div_ceil(PANEL);
    packed.b.clear();
    packed.b.resize(panels * kp * PANEL, 0);
    packed
        .b
        .par_chunks_mut(kp * PANEL)
        .enumerate()
        .for_each(|(panel, dst)| {
            for j in 0..PANEL.min(cols - panel * PANEL) {
                let src = &b[(panel * PANEL + j) * k..][..k];
                for (i, &v) in src.iter().enumerate() {
                    dst[(i / 2) * 2 * PANEL + j * 2 + i % 2] = v;
                }
            }
        });
}

/// The portable path: `a` widened exactly to f32, then the f32 kernel, which widens `b` as it
/// packs it. (The engine rounds its f32 input itself and calls the f32 kernel directly; this
/// serves direct callers.)
fn widened(a: &[u16], b: &[u16], k: usize, out: &mut [f32], out_stride: usize, accumulate: bool) {
    let a32: Vec<f32> = a
        .par_iter()
        .map(|&v| half::bf16::from_bits(v).to_f32())
        .collect();
    let b = sgemm::Bf16Rows { bits: b, cols: k };
    sgemm::product(
        MatRef::dense(&a32, a.len() / k, k),
        &b,
        out,
        out_stride,
        accumulate,
    );
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::{
        __m512, __m512bh, __m512i, _mm512_add_ps, _mm512_dpbf16_ps, _mm512_loadu_epi16,
        _mm512_loadu_ps, _mm512_set1_epi32, _mm512_setzero_ps, _mm512_storeu_ps,
    };

    use super::{MR, PANEL, Tile};

    /// Bit-for-bit reinterpretation of 32 16-bit lanes as 32 bf16 lanes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    fn as_bf16(v: __m512i) -> __m512bh {
        // SAFETY: both are 512-bit plain-data vectors; every bit pattern is valid in each.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
    }

    /// One [`MR`] × [`PANEL`] block: `a` is `MR` padded rows of `kp` bf16, `b` one packed panel.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) fn kernel(a: &[u16], b: &[u16], kp: usize, tile: Tile<'_>) {
        let mut lo = [_mm512_setzero_ps(); MR];
        let mut hi = [_mm512_setzero_ps(); MR];
        let a = &a[..MR * kp];
        let b = &b[..kp * PANEL];
        for p in 0..kp / 2 {
            let pair = &b[p * 2 * PANEL..(p + 1) * 2 * PANEL];
            // SAFETY: `pair` holds 64 u16 = two 512-bit loads, in bounds.
            let (b0, b1) = unsafe {
                (
                    as_bf16(_mm512_loadu_epi16(pair.as_ptr().cast())),
                    as_bf16(_mm512_loadu_epi16(pair[PANEL..].as_ptr().cast())),
                )
            };
            for i in 0..MR {
                let x = u32::from(a[i * kp + 2 * p]) | (u32::from(a[i * kp + 2 * p + 1]) << 16);
                let x = as_bf16(_mm512_set1_epi32(x as i32));
                lo[i] = _mm512_dpbf16_ps(lo[i], x, b0);
                hi[i] = _mm512_dpbf16_ps(hi[i], x, b1);
            }
        }
        store(&lo, &hi, tile);
    }

    /// Writes (or adds) the block's existing rows and columns.
    #[target_feature(enable = "avx512f")]
    fn store(lo: &[__m512; MR], hi: &[__m512; MR], tile: Tile<'_>) {
        let Tile {
            out,
            out_stride,
            height,
            width,
            accumulate,
        } = tile;
        for i in 0..height {
            let row = &mut out[i * out_stride..];
            if width == PANEL {
                let row = &mut row[..PANEL];
                // SAFETY: `row` holds 32 f32 = two 512-bit vectors, in bounds.
                unsafe {
                    let (mut l, mut h) = (lo[i], hi[i]);
                    if accumulate {
                        l = _mm512_add_ps(l, _mm512_loadu_ps(row.as_ptr()));
                        h = _mm512_add_ps(h, _mm512_loadu_ps(row[16..].as_ptr()));
                    }
                    _mm512_storeu_ps(row.as_mut_ptr(), l);
                    _mm512_storeu_ps(row[16..].as_mut_ptr(), h);
                }
            } else {
                let mut lanes = [0.0f32; PANEL];
                // SAFETY: `lanes` holds 32 f32 = two 512-bit vectors.
                unsafe {
                    _mm512_storeu_ps(lanes.as_mut_ptr(), lo[i]);
                    _mm512_storeu_ps(lanes[16..].as_mut_ptr(), hi[i]);
                }
                for (cell, &v) in row[..width].iter_mut().zip(&lanes) {
                    *cell = if accumulate { *cell + v } else { v };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(values: &[f32]) -> Vec<u16> {
        values.iter().map(|&v| to_bf16_bits(v)).collect()
    }

    fn reference(a: &[u16], b: &[u16], k: usize) -> Vec<f64> {
        let wide = |v: u16| f64::from(half::bf16::from_bits(v).to_f32());
        let (rows, cols) = (a.len() / k, b.len() / k);
        let mut out = vec![0.0; rows * cols];
        for r in 0..rows {
            for c in 0..cols {
                out[r * cols + c] = (0..k)
                    .map(|i| wide(a[r * k + i]) * wide(b[c * k + i]))
                    .sum();
            }
        }
        out
    }

    #[test]
    fn the_bf16_product_matches_a_float64_sum_of_the_same_bf16_inputs_for_ragged_shapes() {
        for (rows, cols, k) in [
            (1, 1, 1),
            (5, 7, 33),
            (37, 6, 64),
            (4, 4, 96),
            (9, 13, 200),
            (70, 40, 31),
        ] {
            let a: Vec<f32> = (0..rows * k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
                .collect();
            let b: Vec<f32> = (0..cols * k)
                .map(|i| ((i * 53 % 89) as f32 - 44.0) / 23.0)
                .collect();
            let (a, b) = (bits(&a), bits(&b));
            let mut out = vec![1.0f32; rows * (cols + 2)];
            matmul_bf16(&a, &b, k, &mut out, cols + 2, true, &mut Packed::default());
            let expected = reference(&a, &b, k);
            for r in 0..rows {
                for c in 0..cols {
                    let got = f64::from(out[r * (cols + 2) + c]) - 1.0;
                    let want = expected[r * cols + c];
                    assert!(
                        (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "{rows}x{cols}x{k} [{r},{c}]: {got} vs {want}"
                    );
                }
                assert_eq!(
                    out[r * (cols + 2) + cols],
                    1.0,
                    "columns past cols are untouched"
                );
            }
        }
    }

    #[test]
    fn a_row_gives_the_same_bits_alone_as_in_a_batch() {
        let k = 70;
        let a: Vec<u16> = bits(
            &(0..9 * k)
                .map(|i| (i as f32 * 0.37).sin())
                .collect::<Vec<_>>(),
        );
        let b: Vec<u16> = bits(
            &(0..5 * k)
                .map(|i| (i as f32 * 0.11).cos())
                .collect::<Vec<_>>(),
        );
        let mut all = vec![0.0; 9 * 5];
        matmul_bf16(&a, &b, k, &mut all, 5, false, &mut Packed::default());
        let mut one = vec![0.0; 5];
        matmul_bf16(
            &a[6 * k..7 * k],
            &b,
            k,
            &mut one,
            5,
            false,
            &mut Packed::default(),
        );
        assert_eq!(one, all[6 * 5..7 * 5]);
    }
}
