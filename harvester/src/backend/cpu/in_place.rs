//! `out[r, c] = Σ_j a[r, j] · b[j, c]` with both operands read where they lie, for attention's
//! products: probabilities × values, and queries × keys laid out as columns. Their operands are
//! used once per tile, so packing them as the weight products do would cost as much as the
//! sums.
//!
//! Each output is one fused multiply-add chain over `j` in increasing order, started from
//! zero, in the AVX-512 (8 rows × 32 columns in zmm registers), AVX2 (6 × 16 in ymm) and
//! portable kernels alike: they give the same bits. A register block past the last row
//! repeats that row and one past the last column loads zeros (masked), and only the cells
//! that exist are stored.
#![allow(unsafe_code)]

use super::views::{MatRef, output_fits};

/// `out[r, c] = Σ_j a[r, j] · b[j, c]` for `r < a.rows`, `c < b.cols`; `out` has row stride
/// `out_stride`.
///
/// # Panics
/// If a view does not fit its slice, the inner dimensions differ or `out` is short: a bug in
/// the caller.
pub fn product(a: MatRef<'_>, b: MatRef<'_>, out: &mut [f32], out_stride: usize) {
    let (rows, cols) = (a.rows, b.cols);
    assert!(
        a.cols == b.rows
            && a.fits()
            && b.fits()
            && output_fits(out.len(), (rows, cols), out_stride),
        "in-place product shapes do not fit. This is a bug."
    );
    if rows == 0 || cols == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        use super::level::Level;
        if Level::Avx512.enabled() {
            // SAFETY: the level is at most the CPU's, and it includes AVX-512F; the shapes fit
            // (asserted).
            return unsafe { x86::avx512(a, b, out, out_stride) };
        }
        if Level::Avx2.enabled() {
            // SAFETY: the level is at most the CPU's, and it includes AVX2 and FMA; the shapes
            // fit (asserted).
            return unsafe { x86::avx2(a, b, out, out_stride) };
        }
    }
    portable(a, b, out, out_stride);
}

/// Row `r0 + i` of `a`, or its last row for blocks that run past it.
fn block_row(a: MatRef<'_>, r0: usize, i: usize) -> usize {
    (r0 + i).min(a.rows - 1) * a.row_stride
}

/// The portable kernel, 4 rows × 8 columns: any CPU, the same bits.
fn portable(a: MatRef<'_>, b: MatRef<'_>, out: &mut [f32], out_stride: usize) {
    const R: usize = 4;
    const C: usize = 8;
    let (rows, k, cols) = (a.rows, a.cols, b.cols);
    for r0 in (0..rows).step_by(R) {
        let a_rows: [&[f32]; R] = std::array::from_fn(|i| {
            let at = block_row(a, r0, i);
            &a.data[at..at + k]
        });
        for c0 in (0..cols).step_by(C) {
            let width = C.min(cols - c0);
            let mut acc = [[0.0f32; C]; R];
            for j in 0..k {
                let at = j * b.row_stride + c0;
                let mut b_row = [0.0f32; C];
                b_row[..width].copy_from_slice(&b.data[at..at + width]);
                for (sums, a_row) in acc.iter_mut().zip(&a_rows) {
                    for (sum, &y) in sums.iter_mut().zip(&b_row) {
                        *sum = a_row[j].mul_add(y, *sum);
                    }
                }
            }
            for (i, sums) in acc.iter().enumerate().take(rows - r0) {
                let at = (r0 + i) * out_stride + c0;
                out[at..at + width].copy_from_slice(&sums[..width]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m256i, _mm256_fmadd_ps, _mm256_maskload_ps, _mm256_maskstore_ps, _mm256_set1_ps,
        _mm256_setr_epi32, _mm256_setzero_ps, _mm512_fmadd_ps, _mm512_mask_storeu_ps,
        _mm512_maskz_loadu_ps, _mm512_set1_ps, _mm512_setzero_ps,
    };

    use super::{MatRef, block_row};

    /// Lanes `0..n` of 16 set (all for `n >= 16`).
    fn mask16(n: usize) -> u16 {
        if n >= 16 { u16::MAX } else { (1u16 << n) - 1 }
    }

    /// 8 rows × 32 columns, 16 zmm accumulators.
    ///
    /// # Safety
    /// The CPU must have AVX-512F, and the shapes must fit as [`super::product`] asserts.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn avx512(a: MatRef<'_>, b: MatRef<'_>, out: &mut [f32], out_stride: usize) {
        const R: usize = 8;
        let (rows, k, cols) = (a.rows, a.cols, b.cols);
        let (a_ptr, b_ptr, out_ptr) = (a.data.as_ptr(), b.data.as_ptr(), out.as_mut_ptr());
        for r0 in (0..rows).step_by(R) {
            let height = R.min(rows - r0);
            // SAFETY: `block_row` is a row of `a`, whose `k` cells lie inside `a.data`.
            let a_rows: [*const f32; R] =
                std::array::from_fn(|i| unsafe { a_ptr.add(block_row(a, r0, i)) });
            for c0 in (0..cols).step_by(32) {
                let width = 32.min(cols - c0);
                let (low, high) = (mask16(width), mask16(width.saturating_sub(16)));
                let mut acc = [[_mm512_setzero_ps(); 2]; R];
                for j in 0..k {
                    // Masked-off lanes are never read, so the addresses past a row's end
                    // (wrapping_add: never dereferenced there) are harmless.
                    let row = b_ptr.wrapping_add(j * b.row_stride + c0);
                    // SAFETY: lanes `0..width` of row `j` from column `c0` lie inside `b.data`
                    // (`c0 + width <= cols`, `j < k = b.rows`); the rest are masked off.
                    let (b0, b1) = unsafe {
                        (
                            _mm512_maskz_loadu_ps(low, row),
                            _mm512_maskz_loadu_ps(high, row.wrapping_add(16)),
                        )
                    };
                    for (sums, &a_row) in acc.iter_mut().zip(&a_rows) {
                        // SAFETY: j < k, inside the row.
                        let x = _mm512_set1_ps(unsafe { *a_row.add(j) });
                        sums[0] = _mm512_fmadd_ps(x, b0, sums[0]);
                        sums[1] = _mm512_fmadd_ps(x, b1, sums[1]);
                    }
                }
                for (i, sums) in acc.iter().enumerate().take(height) {
                    let dst = out_ptr.wrapping_add((r0 + i) * out_stride + c0);
                    // SAFETY: row r0 + i < rows and columns `c0..c0 + width` lie inside `out`
                    // (asserted by the caller); the other lanes are masked off.
                    unsafe {
                        _mm512_mask_storeu_ps(dst, low, sums[0]);
                        _mm512_mask_storeu_ps(dst.wrapping_add(16), high, sums[1]);
                    }
                }
            }
        }
    }

    /// An AVX2 mask of lanes `0..n` of 8.
    fn mask8(n: usize) -> __m256i {
        let n = n.min(8) as i32;
        let lane = |i: i32| if i < n { -1 } else { 0 };
        // SAFETY: a plain constructor of a register (AVX, which the callers have).
        unsafe {
            _mm256_setr_epi32(
                lane(0),
                lane(1),
                lane(2),
                lane(3),
                lane(4),
                lane(5),
                lane(6),
                lane(7),
            )
        }
    }

    /// 6 rows × 16 columns, 12 ymm accumulators.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA, and the shapes must fit as [`super::product`] asserts.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn avx2(a: MatRef<'_>, b: MatRef<'_>, out: &mut [f32], out_stride: usize) {
        const R: usize = 6;
        let (rows, k, cols) = (a.rows, a.cols, b.cols);
        let (a_ptr, b_ptr, out_ptr) = (a.data.as_ptr(), b.data.as_ptr(), out.as_mut_ptr());
        for r0 in (0..rows).step_by(R) {
            let height = R.min(rows - r0);
            // SAFETY: `block_row` is a row of `a`, whose `k` cells lie inside `a.data`.
            let a_rows: [*const f32; R] =
                std::array::from_fn(|i| unsafe { a_ptr.add(block_row(a, r0, i)) });
            for c0 in (0..cols).step_by(16) {
                let width = 16.min(cols - c0);
                let (low, high) = (mask8(width), mask8(width.saturating_sub(8)));
                let mut acc = [[_mm256_setzero_ps(); 2]; R];
                for j in 0..k {
                    let row = b_ptr.wrapping_add(j * b.row_stride + c0);
                    // SAFETY: as in `avx512`: masked-off lanes are not read.
                    let (b0, b1) = unsafe {
                        (
                            _mm256_maskload_ps(row, low),
                            _mm256_maskload_ps(row.wrapping_add(8), high),
                        )
                    };
                    for (sums, &a_row) in acc.iter_mut().zip(&a_rows) {
                        // SAFETY: j < k, inside the row.
                        let x = _mm256_set1_ps(unsafe { *a_row.add(j) });
                        sums[0] = _mm256_fmadd_ps(x, b0, sums[0]);
                        sums[1] = _mm256_fmadd_ps(x, b1, sums[1]);
                    }
                }
                for (i, sums) in acc.iter().enumerate().take(height) {
                    let dst = out_ptr.wrapping_add((r0 + i) * out_stride + c0);
                    // SAFETY: as in `avx512`: only lanes inside `out` are written.
                    unsafe {
                        _mm256_maskstore_ps(dst, low, sums[0]);
                        _mm256_maskstore_ps(dst.wrapping_add(8), high, sums[1]);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: f32) -> Vec<f32> {
        (0..n).map(|i| (i as f32 * seed).sin() * 3.0).collect()
    }

    #[test]
    fn every_kernel_gives_the_bits_of_the_portable_one_and_a_float64_sum_for_ragged_shapes() {
        for (rows, k, cols, stride) in [
            (1, 1, 1, 1),
            (7, 5, 33, 40),
            (9, 64, 64, 70),
            (20, 130, 17, 17),
        ] {
            let a = values(rows * k, 0.37);
            let b = values(k * stride, 0.11);
            let (a, b) = (
                MatRef::dense(&a, rows, k),
                MatRef {
                    data: &b,
                    rows: k,
                    cols,
                    row_stride: stride,
                },
            );
            let (out_stride, sentinel) = (cols + 3, -7.0);
            let mut fast = vec![sentinel; rows * out_stride];
            let mut reference = fast.clone();
            product(a, b, &mut fast, out_stride);
            portable(a, b, &mut reference, out_stride);
            assert_eq!(fast, reference, "{rows}x{k}x{cols}");
            #[cfg(target_arch = "x86_64")]
            if super::super::level::Level::Avx2.enabled() {
                let mut avx2 = vec![sentinel; rows * out_stride];
                // SAFETY: the level (at most the CPU's) includes AVX2 and FMA; the shapes fit.
                unsafe { x86::avx2(a, b, &mut avx2, out_stride) };
                assert_eq!(avx2, reference, "AVX2, {rows}x{k}x{cols}");
            }
            for r in 0..rows {
                for c in 0..cols {
                    let want: f64 = (0..k)
                        .map(|j| f64::from(a.data[r * k + j]) * f64::from(b.data[j * stride + c]))
                        .sum();
                    let got = f64::from(fast[r * out_stride + c]);
                    assert!((got - want).abs() <= 1e-5 * (1.0 + want.abs()), "[{r},{c}]");
                }
                assert!(
                    fast[r * out_stride + cols..(r + 1) * out_stride]
                        .iter()
                        .all(|&v| v == sentinel)
                );
            }
        }
    }
}
