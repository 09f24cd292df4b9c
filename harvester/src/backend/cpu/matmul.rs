//! The doorway to the matrix products. Products with a weight go to our own kernel
//! ([`super::sgemm`]), whose summation order is fixed. The `gemm` crate remains as the peer
//! that `harvester bench` times our kernel against ([`matmul_transposed`]); its shapes are
//! checked here, before any pointer is handed over.
#![allow(unsafe_code)]

use gemm::Parallelism;

pub use super::views::MatRef;
use crate::model::Matrix;

/// `out[r, c] (+)= scale * Σ_k a[r, k] · b[c, k]`: `a` times the transpose of `b`, which is how a
/// PyTorch `[out, in]` weight is applied. `out` has row stride `out_stride`.
///
/// # Panics
/// If a view does not fit its slice or the inner dimensions differ: a bug in the caller.
pub fn matmul_transposed(
    a: MatRef<'_>,
    b: MatRef<'_>,
    out: &mut [f32],
    out_stride: usize,
    scale: f32,
    accumulate: bool,
    threads: Parallelism,
) {
    // gemm's right operand is [k, n]: for bᵀ, k runs along b's rows' elements (stride 1) and n
    // along b's rows (stride row_stride).
    let rhs = Rhs {
        n: b.rows,
        k: b.cols,
        k_stride: 1,
        n_stride: b.row_stride,
    };
    product(a, b.data, rhs, out, out_stride, scale, accumulate, threads);
}

/// `out (+)= a · wᵀ` for a weight as the checkpoint stores it (f32, or bf16 and f16 widened
/// exactly as they are packed), in the fixed summation order of [`super::sgemm`]: a row's bits
/// do not depend on the batch or the thread count.
pub fn matmul_weight(
    a: MatRef<'_>,
    w: &Matrix,
    out: &mut [f32],
    out_stride: usize,
    accumulate: bool,
) {
    super::sgemm::product(a, w, out, out_stride, accumulate);
}

/// The right operand's shape and strides as gemm sees it: `[k, n]`.
struct Rhs {
    n: usize,
    k: usize,
    k_stride: usize,
    n_stride: usize,
}

#[allow(clippy::too_many_arguments)]
fn product(
    a: MatRef<'_>,
    b: &[f32],
    rhs: Rhs,
    out: &mut [f32],
    out_stride: usize,
    scale: f32,
    accumulate: bool,
    threads: Parallelism,
) {
    assert!(
        a.fits(),
        "matmul operand view out of bounds. This is a bug."
    );
    assert_eq!(
        a.cols, rhs.k,
        "matmul inner dimensions differ. This is a bug."
    );
    let (m, n, k) = (a.rows, rhs.n, a.cols);
    if m == 0 || n == 0 {
        return;
    }
    let last_b = if k == 0 {
        0
    } else {
        (k - 1) * rhs.k_stride + (n - 1) * rhs.n_stride + 1
    };
    assert!(
        last_b <= b.len(),
        "matmul operand view out of bounds. This is a bug."
    );
    assert!(
        (m - 1) * out_stride + n <= out.len(),
        "matmul output view out of bounds. This is a bug."
    );
    // SAFETY: the asserts above prove every element gemm touches lies inside `a.data` (checked by
    // `fits`), `b` (its last element is at `last_b - 1`) and `out` (rows `0..m` at
    // `out_stride`, columns `0..n`). `out` is borrowed mutably, so it cannot alias the inputs.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            out_stride as isize,
            accumulate,
            a.data.as_ptr(),
            1,
            a.row_stride as isize,
            b.as_ptr(),
            rhs.n_stride as isize,
            rhs.k_stride as isize,
            if accumulate { 1.0 } else { 0.0 },
            scale,
            false,
            false,
            false,
            threads,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transposed_product_matches_the_naive_sum() {
        let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]; // [2, 3]
        let b = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 1.0, 1.0, 1.0]; // [4, 3]
        let mut out = [100.0; 8];
        matmul_transposed(
            MatRef::dense(&a, 2, 3),
            MatRef::dense(&b, 4, 3),
            &mut out,
            4,
            1.0,
            false,
            Parallelism::None,
        );
        assert_eq!(out, [4.0, 2.0, 12.0, 6.0, 10.0, 5.0, 30.0, 15.0]);
        matmul_transposed(
            MatRef::dense(&a, 2, 3),
            MatRef::dense(&b, 4, 3),
            &mut out,
            4,
            0.5,
            true,
            Parallelism::None,
        );
        assert_eq!(out, [6.0, 3.0, 18.0, 9.0, 15.0, 7.5, 45.0, 22.5]);
    }
}
