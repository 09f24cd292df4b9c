//! Element-wise kernels of the Llama block, each over many rows at once so that the CPU-feature
//! dispatch happens once per call, not per element.
//!
//! Every kernel is written once as plain Rust (`*_rows`) and compiled three times: for the
//! baseline target, with AVX2+FMA and with AVX-512 enabled, picked at run time by the kernel
//! level (`level`). The bodies are
//! branch-free loops that LLVM vectorises, including a polynomial `exp`; the builds differ only
//! in vector width, never in the order of an operation, so they give the same bits.
#![allow(unsafe_code)]

/// Runs `$body` compiled with AVX-512 or with AVX2 and FMA when the kernel level allows them
/// (`level`), else the baseline build.
macro_rules! dispatch {
    ($name:ident($($arg:ident: $ty:ty),*) $body:block) => {
        pub fn $name($($arg: $ty),*) {
            #[inline(always)]
            fn generic($($arg: $ty),*) $body

            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
                fn with_avx512($($arg: $ty),*) { generic($($arg),*) }

                #[target_feature(enable = "avx2,fma")]
                fn with_avx2($($arg: $ty),*) { generic($($arg),*) }

                use $crate::backend::cpu::level::Level;
                if Level::Avx512.enabled() {
                    // SAFETY: the level is at most the CPU's, and the avx512 level needs
                    // AVX-512 F, BW, VL and DQ on top of AVX2 and FMA.
                    return unsafe { with_avx512($($arg),*) };
                }

                if Level::Avx2.enabled() {
                    // SAFETY: the level is at most the CPU's, and the avx2 level needs AVX2
                    // and FMA.
                    return unsafe { with_avx2($($arg),*) };
                }
            }
            generic($($arg),*)
        }
    };
}

/// `e^x` to about 2 ulp over the f32 range, branch-free so loops over it vectorise.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    let x = x.clamp(-87.3, 88.3);
    let shifted = x * LOG2E + ROUND;
    let n = shifted - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_5e-1);
    p = p.mul_add(r, 0.5);
    let e = p.mul_add(r * r, r) + 1.0;
    // `n` (within ±127 after the clamp) sits in the low mantissa bits of `shifted`: integer
    // arithmetic on those bits vectorises, where `n as i32` (a saturating conversion) makes
    // LLVM convert lane by lane.
    let biased = shifted
        .to_bits()
        .wrapping_sub(ROUND.to_bits())
        .wrapping_add(127);
    e * f32::from_bits(biased << 23)
}

/// `1 / rms(x)` with `eps`, summed in eight lanes so that it vectorises.
#[inline(always)]
fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for i in 0..8 {
            acc[i] = c[i].mul_add(c[i], acc[i]);
        }
    }
    let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
    let sum_sq = acc.iter().sum::<f32>() + tail;
    1.0 / (sum_sq / x.len() as f32 + eps).sqrt()
}

dispatch!(rms_norm_rows(input: &[f32], weight: &[f32], eps: f32, output: &mut [f32]) {
    let hidden = weight.len();
    for (x, y) in input.chunks_exact(hidden).zip(output.chunks_exact_mut(hidden)) {
        let scale = rms_scale(x, eps);
        for ((y, &x), &w) in y.iter_mut().zip(x).zip(weight) {
            *y = w * (x * scale);
        }
    }
});

dispatch!(rms_norm_bits_rows(input: &[f32], weight: &[f32], eps: f32, bits: &mut [u16]) {
    // `rms_norm_rows` rounded to bf16 bits, for a product that reads nothing else.
    let hidden = weight.len();
    for (x, b) in input.chunks_exact(hidden).zip(bits.chunks_exact_mut(hidden)) {
        let scale = rms_scale(x, eps);
        for ((b, &x), &w) in b.iter_mut().zip(x).zip(weight) {
            *b = bf16_bits(w * (x * scale));
        }
    }
});

dispatch!(add_rms_norm_bits_rows(x: &mut [f32], branch: &[f32], weight: &[f32], eps: f32, bits: &mut [u16]) {
    // `x += branch`, then `rms_norm_bits_rows` of the sum, row by row while it is in cache.
    let hidden = weight.len();
    let rows = x.chunks_exact_mut(hidden).zip(branch.chunks_exact(hidden));
    for ((x, branch), b) in rows.zip(bits.chunks_exact_mut(hidden)) {
        for (x, &v) in x.iter_mut().zip(branch) {
            *x += v;
        }
        let scale = rms_scale(x, eps);
        for ((b, &x), &w) in b.iter_mut().zip(&*x).zip(weight) {
            *b = bf16_bits(w * (x * scale));
        }
    }
});

/// The top half of `value` rounded to the nearest bf16.
#[inline(always)]
fn bf16_bits(value: f32) -> u16 {
    (crate::dtype::bf16_rounded_bits(value) >> 16) as u16
}

/// SwiGLU of one gate and its up value.
#[inline(always)]
fn silu_mul(g: f32, u: f32) -> f32 {
    g / (1.0 + exp(-g)) * u
}

dispatch!(rms_norm_in_place(rows: &mut [f32], weight: &[f32], eps: f32) {
    let width = weight.len();
    for x in rows.chunks_exact_mut(width) {
        let sum_sq: f32 = x.iter().map(|v| v * v).sum();
        let scale = 1.0 / (sum_sq / width as f32 + eps).sqrt();
        for (x, &w) in x.iter_mut().zip(weight) {
            *x = w * (*x * scale);
        }
    }
});

dispatch!(sigmoid_gate_rows(values: &mut [f32], gate: &[f32]) {
    for (v, &g) in values.iter_mut().zip(gate) {
        *v *= 1.0 / (1.0 + exp(-g));
    }
});

dispatch!(silu_mul_rows(gate_up: &[f32], intermediate: usize, output: &mut [f32]) {
    for (gu, out) in gate_up.chunks_exact(2 * intermediate).zip(output.chunks_exact_mut(intermediate)) {
        let (gate, up) = gu.split_at(intermediate);
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = silu_mul(g, u);
        }
    }
});

dispatch!(round_bf16_rows(values: &mut [f32]) {
    for v in values {
        *v = crate::dtype::round_bf16(*v);
    }
});

dispatch!(bf16_bits_rows(values: &[f32], bits: &mut [u16]) {
    for (b, &v) in bits.iter_mut().zip(values) {
        *b = bf16_bits(v);
    }
});

dispatch!(silu_mul_bf16_inputs_rows(gate_up: &[f32], intermediate: usize, output: &mut [f32]) {
    // `silu_mul_rows` on `gate_up` rounded to bf16 first (bf16 mode), without writing it back.
    for (gu, out) in gate_up.chunks_exact(2 * intermediate).zip(output.chunks_exact_mut(intermediate)) {
        let (gate, up) = gu.split_at(intermediate);
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = silu_mul(crate::dtype::round_bf16(g), crate::dtype::round_bf16(u));
        }
    }
});

dispatch!(silu_mul_bf16_bits_rows(gate_up: &[f32], intermediate: usize, bits: &mut [u16]) {
    // `silu_mul_bf16_inputs_rows` rounded to bf16 bits, for a product that reads nothing else.
    for (gu, b) in gate_up.chunks_exact(2 * intermediate).zip(bits.chunks_exact_mut(intermediate)) {
        let (gate, up) = gu.split_at(intermediate);
        for ((b, &g), &u) in b.iter_mut().zip(gate).zip(up) {
            *b = bf16_bits(silu_mul(crate::dtype::round_bf16(g), crate::dtype::round_bf16(u)));
        }
    }
});

dispatch!(silu_mul_bits_rows(gate_up: &[u16], intermediate: usize, bits: &mut [u16]) {
    // `silu_mul_bf16_bits_rows` on gate|up that the product already rounded to bf16 bits.
    let widen = |b: u16| f32::from_bits(u32::from(b) << 16);
    for (gu, b) in gate_up.chunks_exact(2 * intermediate).zip(bits.chunks_exact_mut(intermediate)) {
        let (gate, up) = gu.split_at(intermediate);
        for ((b, &g), &u) in b.iter_mut().zip(gate).zip(up) {
            *b = bf16_bits(silu_mul(widen(g), widen(u)));
        }
    }
});

dispatch!(add_bias_rows(rows: &mut [f32], bias: &[f32]) {
    for row in rows.chunks_exact_mut(bias.len()) {
        for (x, &b) in row.iter_mut().zip(bias) {
            *x += b;
        }
    }
});

dispatch!(softmax_in_place(row: &mut [f32], scale: f32) {
    // The softmax of `row × scale` (scale > 0), scaling as the exponentials are taken: the
    // largest product is the product of the largest value, whatever the rounding. Sixteen
    // independent lanes, so the reductions vectorise (a single float accumulator cannot be
    // reordered by the compiler).
    let mut lanes = [f32::NEG_INFINITY; 16];
    let mut chunks = row.chunks_exact(16);
    for c in &mut chunks {
        for i in 0..16 {
            lanes[i] = if c[i] > lanes[i] { c[i] } else { lanes[i] };
        }
    }
    let max = chunks.remainder().iter().chain(&lanes).fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    let max = max * scale;
    let mut sums = [0.0f32; 16];
    let mut chunks = row.chunks_exact_mut(16);
    for c in &mut chunks {
        for i in 0..16 {
            c[i] = exp(c[i] * scale - max);
            sums[i] += c[i];
        }
    }
    let mut sum: f32 = sums.iter().sum();
    for v in chunks.into_remainder() {
        *v = exp(*v * scale - max);
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in row.iter_mut() {
        *v *= inv;
    }
});

dispatch!(softmax_bits(row: &[f32], scale: f32, bits: &mut [u16], sum: &mut f32) {
    // The softmax of `row × scale` before its division, for a bf16 `P·V` (bf16 mode): each
    // exponential rounded to bf16 bits into `bits` (the largest is exactly 1), and into `sum`
    // the sum of the rounded values, by which the product is divided. The GPU's attention
    // kernel rounds and sums its probabilities so, and the weights then sum to one exactly.
    // The maximum and the lanes as `softmax_in_place`.
    let mut lanes = [f32::NEG_INFINITY; 16];
    let mut chunks = row.chunks_exact(16);
    for c in &mut chunks {
        for i in 0..16 {
            lanes[i] = if c[i] > lanes[i] { c[i] } else { lanes[i] };
        }
    }
    let max = chunks.remainder().iter().chain(&lanes).fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    let max = max * scale;
    let rounded = |v: f32| crate::dtype::bf16_rounded_bits(exp(v * scale - max));
    let mut sums = [0.0f32; 16];
    let mut chunks = row.chunks_exact(16);
    let mut out = bits.chunks_exact_mut(16);
    for (c, o) in (&mut chunks).zip(&mut out) {
        for i in 0..16 {
            let p = rounded(c[i]);
            o[i] = (p >> 16) as u16;
            sums[i] += f32::from_bits(p);
        }
    }
    let mut total: f32 = sums.iter().sum();
    for (&v, o) in chunks.remainder().iter().zip(out.into_remainder()) {
        let p = rounded(v);
        *o = (p >> 16) as u16;
        total += f32::from_bits(p);
    }
    *sum = total;
});

/// Rotates the first `rotated_heads` heads of each row in place (rotate-half RoPE, as Hugging Face
/// Llama). `positions[t]` indexes the `[position, head_dim / 2]` tables.
#[allow(clippy::too_many_arguments)]
pub fn rope_rows(
    rows: &mut [f32],
    row_width: usize,
    rotated_heads: usize,
    head_dim: usize,
    positions: &[u32],
    cos: &[f32],
    sin: &[f32],
) {
    let half = head_dim / 2;
    for (row, &pos) in rows.chunks_exact_mut(row_width).zip(positions) {
        let base = pos as usize * half;
        let (cos, sin) = (&cos[base..base + half], &sin[base..base + half]);
        for head in row[..rotated_heads * head_dim].chunks_exact_mut(head_dim) {
            let (x1, x2) = head.split_at_mut(half);
            for i in 0..half {
                let (a, b) = (x1[i], x2[i]);
                x1[i] = a * cos[i] - b * sin[i];
                x2[i] = b * cos[i] + a * sin[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polynomial_exp_matches_std_to_a_few_ulp() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let rel = ((exp(x) as f64 - (x as f64).exp()) / (x as f64).exp()).abs();
            worst = worst.max(rel);
            x += 0.0137;
        }
        assert!(worst < 4e-7, "worst relative error {worst}");
        assert_eq!(exp(-1000.0), exp(-87.3));
    }

    #[test]
    fn the_exponent_read_from_the_rounding_bits_is_the_converted_integer_at_every_edge() {
        for x in [
            -1000.0f32, -87.3, -87.0, -0.5, -0.0, 0.0, 0.34657, 0.5, 1.0, 88.0, 88.3, 1e9,
        ] {
            let n = (x.clamp(-87.3, 88.3) * std::f32::consts::LOG2_E + 12_582_912.0) - 12_582_912.0;
            let converted = f32::from_bits(((n as i32 + 127) as u32) << 23);
            let ratio = exp(x) / converted;
            assert!(
                (0.7..1.5).contains(&ratio),
                "exp({x}) = {} vs 2^{n}",
                exp(x)
            );
        }
    }

    #[test]
    fn rms_norm_scales_rows_to_unit_rms_times_weight() {
        let input = [3.0, 4.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0];
        let mut out = [0.0; 8];
        rms_norm_rows(&input, &[1.0, 2.0, 1.0, 1.0], 0.0, &mut out);
        let rms = (25.0f32 / 4.0).sqrt();
        assert!((out[0] - 3.0 / rms).abs() < 1e-6);
        assert!((out[1] - 2.0 * 4.0 / rms).abs() < 1e-6);
        assert_eq!(&out[4..], &[1.0, 2.0, 1.0, 1.0]);
    }

    #[test]
    fn swiglu_on_rounded_bits_gives_the_bits_of_swiglu_rounding_its_f32_inputs() {
        let inter = 24;
        let mut gate_up: Vec<f32> = (0..2 * 2 * inter)
            .map(|i| (i as f32 * 0.77).sin() * 9.0)
            .collect();
        gate_up[1] = f32::NAN;
        gate_up[2] = f32::INFINITY;
        let mut expected = vec![0u16; 2 * inter];
        silu_mul_bf16_bits_rows(&gate_up, inter, &mut expected);
        let rounded: Vec<u16> = gate_up.iter().map(|&v| bf16_bits(v)).collect();
        let mut bits = vec![0u16; 2 * inter];
        silu_mul_bits_rows(&rounded, inter, &mut bits);
        assert_eq!(bits, expected);
    }

    #[test]
    fn the_fused_residual_add_and_norm_gives_the_bits_of_the_two_passes() {
        let hidden = 40;
        let x: Vec<f32> = (0..3 * hidden)
            .map(|i| (i as f32 * 0.73).sin() * 3.0)
            .collect();
        let branch: Vec<f32> = (0..3 * hidden).map(|i| (i as f32 * 0.31).cos()).collect();
        let weight: Vec<f32> = (0..hidden).map(|i| 0.5 + i as f32 / 64.0).collect();
        let (mut sum, mut expected) = (x.clone(), vec![0u16; x.len()]);
        for (row, b) in sum
            .chunks_exact_mut(hidden)
            .zip(branch.chunks_exact(hidden))
        {
            add_bias_rows(row, b);
        }
        rms_norm_bits_rows(&sum, &weight, 1e-5, &mut expected);
        let (mut fused, mut bits) = (x, vec![0u16; sum.len()]);
        add_rms_norm_bits_rows(&mut fused, &branch, &weight, 1e-5, &mut bits);
        assert_eq!(fused, sum, "the residual stream");
        assert_eq!(bits, expected, "the norm's bits");
    }

    #[test]
    fn in_place_rms_norm_matches_the_two_buffer_kernel_per_head() {
        let heads = [3.0, 4.0, 1.0, -2.0, 0.5, 0.25];
        let weight = [1.0, 2.0, 0.5];
        let mut expected = [0.0; 6];
        rms_norm_rows(&heads, &weight, 1e-5, &mut expected);
        let mut in_place = heads;
        rms_norm_in_place(&mut in_place, &weight, 1e-5);
        for (a, b) in in_place.iter().zip(expected) {
            assert!((a - b).abs() < 1e-6, "{in_place:?} vs {expected:?}");
        }
    }

    #[test]
    fn the_sigmoid_gate_halves_at_zero_and_closes_far_below() {
        let mut values = [2.0, 2.0, 2.0];
        sigmoid_gate_rows(&mut values, &[0.0, -40.0, 40.0]);
        assert_eq!(values[0], 1.0);
        assert!(values[1] < 1e-16);
        assert!((values[2] - 2.0).abs() < 1e-6);
    }

    #[test]
    fn silu_mul_multiplies_the_gated_half_by_the_up_half() {
        let gate_up = [0.0, 2.0, 10.0, 3.0];
        let mut out = [0.0; 2];
        silu_mul_rows(&gate_up, 2, &mut out);
        assert_eq!(out[0], 0.0);
        let silu2 = 2.0 / (1.0 + (-2.0f32).exp());
        assert!((out[1] - silu2 * 3.0).abs() < 1e-6);
    }

    #[test]
    fn softmax_sums_to_one_and_keeps_order() {
        let mut row = [1.0, 2.0, 3.0, -1e30];
        softmax_in_place(&mut row, 1.0);
        assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(row[2] > row[1] && row[1] > row[0]);
        assert!(row[3] < 1e-30, "a hugely negative score gets no weight");
    }

    #[test]
    fn a_scaled_softmax_gives_the_bits_of_the_softmax_of_the_scaled_row() {
        let row: Vec<f32> = (0..37).map(|i| (i as f32 * 0.71).sin() * 9.0).collect();
        for scale in [0.125, 0.088_388_35, 1.0] {
            let mut scaled = row.clone();
            softmax_in_place(&mut scaled, scale);
            let mut reference: Vec<f32> = row.iter().map(|v| v * scale).collect();
            softmax_in_place(&mut reference, 1.0);
            assert_eq!(scaled, reference, "scale {scale}");
        }
    }

    #[test]
    fn softmax_bits_are_the_rounded_exponentials_and_their_sum_divides_to_the_softmax() {
        let row: Vec<f32> = (0..37).map(|i| (i as f32 * 0.71).sin() * 9.0).collect();
        let scale = 0.125;
        let mut bits = vec![0u16; row.len()];
        let mut sum = 0.0;
        softmax_bits(&row, scale, &mut bits, &mut sum);
        let max = row.iter().fold(f32::MIN, |m, &v| m.max(v));
        let widened: Vec<f32> = bits
            .iter()
            .map(|&b| f32::from_bits(u32::from(b) << 16))
            .collect();
        for (i, (&v, &p)) in row.iter().zip(&widened).enumerate() {
            let exact = ((f64::from(v) - f64::from(max)) * f64::from(scale)).exp();
            assert!(
                (f64::from(p) - exact).abs() <= exact / 256.0,
                "{i}: {p} vs {exact}"
            );
            assert_eq!(p, crate::dtype::round_bf16(p), "{i} is a bf16 value");
            if v == max {
                assert_eq!(p, 1.0, "the largest is exactly one");
            }
        }
        let total: f64 = widened.iter().map(|&p| f64::from(p)).sum();
        assert!(
            (f64::from(sum) - total).abs() <= 1e-6 * total,
            "{sum} vs {total}"
        );
        let mut softmax = row.clone();
        softmax_in_place(&mut softmax, scale);
        for (&p, &q) in widened.iter().zip(&softmax) {
            assert!(
                (p / sum - q).abs() <= q / 128.0 + 1e-7,
                "{} vs {q}",
                p / sum
            );
        }
    }

    #[test]
    fn rope_at_position_zero_is_the_identity_and_preserves_norm_elsewhere() {
        let (cos, sin) = ([1.0, 1.0, 0.6, 0.28], [0.0, 0.0, 0.8, 0.96]);
        let mut rows = [1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0];
        rope_rows(&mut rows, 4, 1, 4, &[0, 1], &cos, &sin);
        assert_eq!(&rows[..4], &[1.0, 2.0, 3.0, 4.0]);
        let norm: f32 = rows[4..].iter().map(|v| v * v).sum();
        assert!((norm - 30.0).abs() < 1e-4, "{norm}");
    }
}
