//! The machine's arithmetic ceilings, measured: every thread runs independent chains of the
//! widest f32 FMA the CPU has (and of `vdpbf16ps`, where it has one) on registers alone, so the
//! rate is what the cores can issue, with no memory in the way. A benchmark divides an engine's
//! rate by these to say how close to the hardware it runs.
#![allow(unsafe_code)]

use std::time::Instant;

/// Independent accumulator chains per thread: more than latency × ports on every core we
/// know (4 cycles × 2 FMA ports), so the chains never wait on each other.
const CHAINS: usize = 12;
/// Steps of every chain per timed round: about 0.1 s of work per thread on a 3 GHz core.
const STEPS: usize = 20_000_000;
/// Timed rounds; the best counts (the first warms the cores' clocks up).
const ROUNDS: usize = 3;

/// One ceiling: its rate over all threads and the instruction that reached it.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Peak {
    /// GFLOP/s summed over every rayon thread.
    pub gflops: f64,
    /// The instruction timed, as its mnemonic and register width.
    pub instruction: &'static str,
}

/// The f32 FMA ceiling: 512-bit FMA with AVX-512F, 256-bit with AVX2 and FMA, else `None`.
pub fn f32_fma() -> Option<Peak> {
    f32_fma_over(STEPS)
}

fn f32_fma_over(steps: usize) -> Option<Peak> {
    #[cfg(target_arch = "x86_64")]
    {
        use super::level::Level;
        if Level::Avx512.enabled() {
            // SAFETY: the level (at most the CPU's) includes AVX-512F.
            let rate = all_threads(|| unsafe { x86::fma512(steps) });
            return Some(Peak {
                gflops: rate,
                instruction: "vfmadd231ps zmm",
            });
        }
        if Level::Avx2.enabled() {
            // SAFETY: the level (at most the CPU's) includes AVX2 and FMA.
            let rate = all_threads(|| unsafe { x86::fma256(steps) });
            return Some(Peak {
                gflops: rate,
                instruction: "vfmadd231ps ymm",
            });
        }
    }
    None
}

/// The bf16 dot ceiling (`vdpbf16ps zmm`), where the bf16 product uses it; else `None`.
pub fn bf16_dot() -> Option<Peak> {
    #[cfg(target_arch = "x86_64")]
    if super::bf16::has_dot_instructions() {
        // SAFETY: AVX512-F, AVX512-BW and AVX512-BF16 were detected by has_dot_instructions.
        let rate = all_threads(|| unsafe { x86::dot_bf16(STEPS) });
        return Some(Peak {
            gflops: rate,
            instruction: "vdpbf16ps zmm",
        });
    }
    None
}

/// GFLOP/s over every rayon thread at once of `work`, which returns the FLOP it did; the best
/// of [`ROUNDS`] rounds.
fn all_threads(work: impl Fn() -> f64 + Sync) -> f64 {
    (0..ROUNDS)
        .map(|_| {
            let start = Instant::now();
            let flops: f64 = rayon::broadcast(|_| work()).into_iter().sum();
            flops / start.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m256, __m512, __m512bh, _mm256_add_ps, _mm256_fmadd_ps, _mm256_set1_ps, _mm256_storeu_ps,
        _mm512_add_ps, _mm512_dpbf16_ps, _mm512_fmadd_ps, _mm512_reduce_add_ps, _mm512_set1_epi32,
        _mm512_set1_ps,
    };
    use std::hint::black_box;

    use super::CHAINS;

    /// `steps` steps of [`CHAINS`] 256-bit FMA chains; returns the FLOP done.
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn fma256(steps: usize) -> f64 {
        // Values that stay finite for ever: x ← 0.999 x + 1e-3 tends to 1.
        let (scale, shift) = (_mm256_set1_ps(0.999), _mm256_set1_ps(1e-3));
        let mut acc: [__m256; CHAINS] = [_mm256_set1_ps(black_box(0.5)); CHAINS];
        for _ in 0..steps {
            for a in &mut acc {
                *a = _mm256_fmadd_ps(*a, scale, shift);
            }
        }
        let sum = acc
            .iter()
            .fold(_mm256_set1_ps(0.0), |s, &a| _mm256_add_ps(s, a));
        let mut lanes = [0.0f32; 8];
        // SAFETY: `lanes` holds 8 f32, one 256-bit store.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sum) };
        black_box(lanes);
        (steps * CHAINS * 8 * 2) as f64
    }

    /// `steps` steps of [`CHAINS`] 512-bit FMA chains; returns the FLOP done.
    #[target_feature(enable = "avx512f")]
    pub(super) fn fma512(steps: usize) -> f64 {
        let (scale, shift) = (_mm512_set1_ps(0.999), _mm512_set1_ps(1e-3));
        let mut acc: [__m512; CHAINS] = [_mm512_set1_ps(black_box(0.5)); CHAINS];
        for _ in 0..steps {
            for a in &mut acc {
                *a = _mm512_fmadd_ps(*a, scale, shift);
            }
        }
        let sum = acc
            .iter()
            .fold(_mm512_set1_ps(0.0), |s, &a| _mm512_add_ps(s, a));
        black_box(_mm512_reduce_add_ps(sum));
        (steps * CHAINS * 16 * 2) as f64
    }

    /// `steps` steps of [`CHAINS`] `vdpbf16ps` chains (32 products each); returns the FLOP done.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) fn dot_bf16(steps: usize) -> f64 {
        // bf16 pairs of 2^-12 (0x3980): each step adds 2 · 2^-24 per lane, which stays finite
        // over any step count we run.
        let tiny = _mm512_set1_epi32(black_box(0x3980_3980));
        // SAFETY: both are 512-bit plain-data vectors; every bit pattern is valid in each.
        let pairs: __m512bh = unsafe { std::mem::transmute(tiny) };
        let mut acc: [__m512; CHAINS] = [_mm512_set1_ps(black_box(0.0)); CHAINS];
        for _ in 0..steps {
            for a in &mut acc {
                *a = _mm512_dpbf16_ps(*a, pairs, pairs);
            }
        }
        let sum = acc
            .iter()
            .fold(_mm512_set1_ps(0.0), |s, &a| _mm512_add_ps(s, a));
        black_box(_mm512_reduce_add_ps(sum));
        (steps * CHAINS * 32 * 2) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ceiling_counts_the_flop_of_every_chain_on_every_thread() {
        let threads = rayon::current_num_threads() as f64;
        let flops = all_threads(|| 1e9);
        // One round of 1 GFLOP per thread in under a second rates above `threads` GFLOP/s.
        assert!(flops > threads, "{flops} GFLOP/s over {threads} threads");
    }

    #[test]
    fn an_x86_cpu_with_avx2_reports_a_positive_fma_ceiling() {
        #[cfg(target_arch = "x86_64")]
        if super::super::level::Level::Avx2.enabled() {
            let peak = f32_fma_over(10_000).expect("the level allows AVX2 and FMA");
            assert!(peak.gflops.is_finite() && peak.gflops > 0.0, "{peak:?}");
            assert!(peak.instruction.starts_with("vfmadd231ps"), "{peak:?}");
        }
    }
}
