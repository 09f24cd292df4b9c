//! The bf16 compute mode's matrix product: bf16 inputs, f32 accumulation.
//!
//! `out[r, c] (+)= Σ_k a[r, k] · b[c, k]` with `a` and `b` row-major bf16 (`b` a PyTorch
//! `[out, in]` weight). On a CPU with AVX512-BF16 it runs like the f32 product (`sgemm`), on
//! pairs of `k` (what one `vdpbf16ps` lane sums): per block of at most [`KC`] of `k`, every
//! panel of [`PANEL`] rows of `b` is packed once, `[pairs][PANEL]`, and tasks sweep [`MR`] rows
//! of `a` at a time across the panels. An `MR × PANEL` block of `out` accumulates in 16 zmm
//! registers, 32 products per instruction, each row's pair of `a` broadcast straight from `a`
//! itself: a row-major row already holds its pairs adjacent, so `a` is not packed (only copied
//! once, padded, when `k` is odd). Blocks of `k` continue the sums through `out`. Elsewhere both
//! operands widen exactly to f32 and the f32 kernel runs, which differs only in the order of
//! the f32 sums. Either way each output is one row of `a` against one row of `b`, summed in an
//! order fixed by `k` alone, so the result does not depend on the batch it is in or on the
//! thread count.
//!
//! The engine packs each weight once, at load ([`PackedWeight`]): every block's panels as its
//! products read them, which then skip packing (on a Zen 4 EPYC a 32-row product ran 1.5-2.3×
//! as fast, a 4,096-row one the same). Other operands are packed by each product ([`Packed`]).
#![allow(unsafe_code)]

use rayon::prelude::*;

use super::amx;
use super::schedule::{self, Dst, Grid, Out, PANEL_CHUNK_BYTES, Threads};
use super::sgemm::{self, WeightRows};
use super::views::{MatRef, output_fits};

/// Rows of `a` in one register block: 16 zmm accumulators. (12 rows, as the f32 kernel has,
/// measured 5-15% slower on a Zen 4 EPYC.)
pub const MR: usize = 8;
/// Columns of `out` in one register block and one packed panel of `b` (two zmm of f32).
pub const PANEL: usize = 32;
/// Columns of `k` per block, at most (as even blocks): `MR` rows of `a` are `KC × MR` bf16 (24
/// KiB, in L1) and a panel `KC × PANEL` (96 KiB, streaming from L2). On a Zen 4 EPYC, blocks of
/// 256 measured 5-20% slower (the sums go through `out` more often), 2048 as much slower on
/// llama-8b's `k` of 4096 (the rows fill L1); 1536 against 1024 took SmolLM2's down product
/// (`k` 1536, one block instead of two) from 385-393 to 419-440 GFLOP/s (`sgemm_bench`,
/// alternated), llama-8b's shapes within the noise.
pub const KC: usize = 1536;

/// A bf16 value's bits from an f32, rounded to nearest even (NaN stays NaN).
#[inline]
pub fn to_bf16_bits(value: f32) -> u16 {
    (crate::dtype::bf16_rounded_bits(value) >> 16) as u16
}

/// Rounds `src` to bf16 bits into `dst` (the same length), in parallel.
pub fn round_into(src: &[f32], dst: &mut [u16]) {
    dst.par_chunks_mut(4096)
        .zip(src.par_chunks(4096))
        .for_each(|(d, s)| super::kernels::bf16_bits_rows(s, d));
}

/// Rounds every value of `values` to the nearest bf16, in place (kept as f32): one chunk of a
/// pass the caller has already split.
pub fn round_rows(values: &mut [f32]) {
    super::kernels::round_bf16_rows(values);
}

/// Little-endian bf16 bytes as `u16`s without a copy, when they are 2-byte aligned and the
/// machine is little-endian.
pub fn aligned(bytes: &[u8]) -> Option<&[u16]> {
    // SAFETY: every bit pattern is a valid u16, and align_to only reinterprets the aligned
    // middle of the slice; a non-empty prefix or suffix is refused below.
    let (head, body, tail) = unsafe { bytes.align_to::<u16>() };
    (head.is_empty() && tail.is_empty() && cfg!(target_endian = "little")).then_some(body)
}

/// Whether the `vdpbf16ps` kernel runs: the CPU has it and the kernel level allows it.
pub fn has_dot_instructions() -> bool {
    super::level::Level::Avx512Bf16.enabled()
}

/// Set for a whole process by [`emulate_tiles_in_this_process`].
static EMULATED_TILES: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Runs every bf16 weight product of this process that would run on `vdpbf16ps` on the AMX
/// tile kernel's emulator instead (`amx::Emulated`, slow): for a test process that checks how
/// the tile product composes into the whole pass on a CPU without AMX, called before it builds
/// a backend (weights are packed at load for the engine that runs them). Nothing else sets it.
#[doc(hidden)]
pub fn emulate_tiles_in_this_process() {
    EMULATED_TILES.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Scratch of the packed product, kept across calls so steady state allocates nothing.
#[derive(Debug, Default)]
pub struct Packed {
    /// Every panel of `b` for one block of `k`, `[panel][pairs][PANEL]`.
    panels: Vec<u32>,
    /// `a` with each row padded to an even length, when `k` is odd.
    a_even: Vec<u16>,
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
    let cols = b.len().checked_div(k).unwrap_or(0);
    assert!(
        b.len() == cols * k,
        "bf16 matmul shapes do not fit. This is a bug."
    );
    let b = Weight::Rows(Bf16View::dense(b, cols, k));
    weight_product(a, b, out, out_stride, accumulate, packed);
}

/// [`matmul_bf16`] with `b` as a [`Weight`]: rows, or packed at load.
///
/// # Panics
/// If a slice is shorter than its shape, or a packed weight was packed for another engine: a
/// bug in the caller.
pub fn weight_product(
    a: &[u16],
    b: Weight<'_>,
    out: &mut [f32],
    out_stride: usize,
    accumulate: bool,
    packed: &mut Packed,
) {
    let k = b.k();
    let rows = a.len().checked_div(k).unwrap_or(0);
    assert!(
        a.len() == rows * k,
        "bf16 matmul shapes do not fit. This is a bug."
    );
    let a = Bf16View::dense(a, rows, k);
    matmul_bf16_views(a, b, out, out_stride, accumulate, Threads::Pool, packed);
}

/// `rows × cols` bf16 bits, rows `stride` apart.
#[derive(Debug, Clone, Copy)]
pub struct Bf16View<'a> {
    pub bits: &'a [u16],
    pub rows: usize,
    pub cols: usize,
    pub stride: usize,
}

impl<'a> Bf16View<'a> {
    /// Rows packed end to end.
    pub fn dense(bits: &'a [u16], rows: usize, cols: usize) -> Self {
        Self {
            bits,
            rows,
            cols,
            stride: cols,
        }
    }

    fn fits(&self) -> bool {
        self.cols <= self.stride
            && (self.rows == 0 || (self.rows - 1) * self.stride + self.cols <= self.bits.len())
    }
}

/// `out[r, c] (+)= Σ_k a[r, k] · b[c, k]` for `a: [rows, k]` and `b: [cols, k]`; `out` has
/// row stride `out_stride` and its first `cols` columns are written.
///
/// # Panics
/// If a view does not fit its slice, the inner dimensions differ, or a packed weight was packed
/// for another engine: a bug in the caller.
pub fn matmul_bf16_views(
    a: Bf16View<'_>,
    b: Weight<'_>,
    out: &mut [f32],
    out_stride: usize,
    accumulate: bool,
    threads: Threads,
    packed: &mut Packed,
) {
    let (rows, cols, k) = (a.rows, b.cols(), a.cols);
    assert!(
        a.fits() && b.fits() && b.k() == k && output_fits(out.len(), (rows, cols), out_stride),
        "bf16 matmul shapes do not fit. This is a bug."
    );
    if rows == 0 || cols == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            out.chunks_mut(out_stride)
                .take(rows)
                .for_each(|row| row[..cols].fill(0.0));
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(engine) = Engine::current() {
        let out = Target::F32(Out {
            ptr: out.as_mut_ptr(),
            stride: out_stride,
        });
        return on_engine(engine, a, b, out, accumulate, threads, packed);
    }
    let _ = (packed, threads);
    match b {
        Weight::Rows(b) => widened(a, b, out, out_stride, accumulate),
        Weight::Packed(_) => panic!(
            "a weight packed for bf16 dot instructions on a CPU without them. This is a bug."
        ),
    }
}

/// `bits[r, c] = bf16(Σ_k a[r, k] · b[c, k])` for `a: [rows, k]` and `b: [cols, k]` bf16 bits,
/// each sum rounded to the nearest bf16 as the register block stores it: for a product whose
/// output is rounded to bf16 next, which then never exists in f32. `bits` has row stride
/// `stride`; its first `cols` columns are written. The sums are [`matmul_bf16`]'s, bit for bit.
///
/// Without `vdpbf16ps`, or with `k` over one block ([`KC`]), the sums cannot be rounded in
/// registers ([`rounds_output`]): they are then [`matmul_bf16`]'s on its other path, made in a
/// temporary f32 buffer and rounded from there. Slower, the same contract, never a panic.
///
/// # Panics
/// If a slice is shorter than its shape: a bug in the caller.
pub fn matmul_bf16_rounded(
    a: &[u16],
    b: &[u16],
    k: usize,
    out: (&mut [u16], usize),
    packed: &mut Packed,
) {
    let cols = b.len().checked_div(k).unwrap_or(0);
    assert!(
        b.len() == cols * k,
        "rounded bf16 matmul shapes do not fit. This is a bug."
    );
    let b = Weight::Rows(Bf16View::dense(b, cols, k));
    weight_product_rounded(a, b, out, packed);
}

/// [`matmul_bf16_rounded`] with `b` as a [`Weight`]: rows, or packed at load.
///
/// # Panics
/// If a slice is shorter than its shape, or a packed weight was packed for another engine: a
/// bug in the caller.
pub fn weight_product_rounded(
    a: &[u16],
    b: Weight<'_>,
    (bits, stride): (&mut [u16], usize),
    packed: &mut Packed,
) {
    let (cols, k) = (b.cols(), b.k());
    let rows = a.len().checked_div(k).unwrap_or(0);
    assert!(
        a.len() == rows * k && b.fits() && output_fits(bits.len(), (rows, cols), stride),
        "rounded bf16 matmul shapes do not fit. This is a bug."
    );
    if rows == 0 || cols == 0 {
        return;
    }
    if !rounds_output(k) {
        let mut sums = vec![0.0f32; rows * cols];
        weight_product(a, b, &mut sums, cols, false, packed);
        for (r, row) in sums.chunks_exact(cols).enumerate() {
            round_into(row, &mut bits[r * stride..r * stride + cols]);
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(engine) = Engine::current() {
        let out = Target::Bits(OutBits {
            ptr: bits.as_mut_ptr(),
            stride,
        });
        on_engine(
            engine,
            Bf16View::dense(a, rows, k),
            b,
            out,
            false,
            Threads::Pool,
            packed,
        );
    }
}

/// Whether [`matmul_bf16_rounded`] runs products of width `k`: on `vdpbf16ps`, in one block of
/// `k`, so that each sum is whole in registers when it is stored.
pub fn rounds_output(k: usize) -> bool {
    has_dot_instructions() && k <= KC
}

/// Where a product's sums go: f32 cells, or bf16 bits rounded as they are stored (one block of
/// `k` only, since later blocks continue the sums through the output).
#[derive(Clone, Copy)]
enum Target {
    F32(Out),
    Bits(OutBits),
}

/// A bf16 output: `ptr` and its row stride.
#[derive(Clone, Copy)]
struct OutBits {
    ptr: *mut u16,
    stride: usize,
}

// SAFETY: as for `Out`: each task writes a disjoint block of rows × columns, and the output is
// borrowed mutably for the whole call.
unsafe impl Send for OutBits {}
// SAFETY: as above.
unsafe impl Sync for OutBits {}

/// The product of two checked operands on `engine` into `out`.
#[cfg(target_arch = "x86_64")]
fn on_engine(
    engine: Engine,
    a: Bf16View<'_>,
    b: Weight<'_>,
    out: Target,
    accumulate: bool,
    threads: Threads,
    packed: &mut Packed,
) {
    let (rows, cols, k) = (a.rows, b.cols(), a.cols);
    let Packed { panels, a_even } = packed;
    let (b_bits, b_stride, panels) = match b {
        Weight::Rows(b) => (b.bits, b.stride, Panels::Pack(panels)),
        Weight::Packed(w) => {
            assert!(
                w.engine == engine,
                "a weight packed for {:?} products run on {engine:?}. This is a bug.",
                w.engine
            );
            (&[][..], 0, Panels::Packed(&w.panels))
        }
    };
    let mut operands = Operands {
        a: a.bits,
        a_stride: a.stride,
        b: b_bits,
        b_stride,
        k,
        rows,
        cols,
    };
    // The register block reads each pair of `a` as one 32-bit word.
    if k % 2 == 1 || a.stride % 2 == 1 {
        let even = k.next_multiple_of(2);
        a_even.clear();
        a_even.resize(rows * even, 0);
        for (r, dst) in a_even.chunks_mut(even).enumerate() {
            dst[..k].copy_from_slice(&a.bits[r * a.stride..r * a.stride + k]);
        }
        operands.a = a_even;
        operands.a_stride = even;
    }
    product(engine, operands, out, accumulate, threads, panels);
}

/// `u32`s one packed panel of rows of width `k` takes: [`pack_rows`] writes one per
/// [`PANEL`] rows.
pub fn panel_len(k: usize) -> usize {
    k.div_ceil(2) * PANEL
}

/// Every panel of `b`'s rows over all of its columns, `[panel][pairs][PANEL]`, for products
/// that share them (`product_packed`): attention packs each sequence's keys once for all of
/// its queries.
///
/// # Panics
/// If `dst` is not `b.rows.div_ceil(PANEL)` panels long: a bug in the caller.
pub fn pack_rows(b: Bf16View<'_>, dst: &mut [u32]) {
    let k = b.cols;
    assert!(
        b.fits() && dst.len() == b.rows.div_ceil(PANEL) * panel_len(k),
        "bf16 panel shapes do not fit. This is a bug."
    );
    if k == 0 {
        return;
    }
    let block = PairBlock {
        operands: Operands {
            a: &[],
            a_stride: 0,
            b: b.bits,
            b_stride: b.stride,
            k,
            rows: 0,
            cols: b.rows,
        },
        first_pair: 0,
        pairs: k.div_ceil(2),
        load: false,
    };
    for (p, panel) in dst.chunks_exact_mut(panel_len(k)).enumerate() {
        block.pack_panel(p, panel);
    }
}

/// `out[r, c] = Σ_k a[r, k] · b[c, k]` for `c < cols` on the calling thread, `b` as
/// [`pack_rows`] packed it (its first panel first), in one block of all of `k`: the sums of
/// [`matmul_bf16_views`] for a `k` of at most [`KC`].
///
/// Private to the crate: its one caller, attention, asks [`has_dot_instructions`] first
/// (`scores_from_bits`), and packed panels have no other use.
///
/// # Panics
/// If the kernel level lacks `vdpbf16ps`, `k` or `a`'s stride is odd, or a shape does not fit:
/// a bug in the caller.
pub(crate) fn product_packed(
    a: Bf16View<'_>,
    panels: &[u32],
    cols: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    let (rows, k) = (a.rows, a.cols);
    let pairs = k.div_ceil(2);
    assert!(
        has_dot_instructions()
            && a.fits()
            && k.is_multiple_of(2)
            && a.stride.is_multiple_of(2)
            && k <= KC
            && panels.len() >= cols.div_ceil(PANEL) * panel_len(k)
            && output_fits(out.len(), (rows, cols), out_stride),
        "packed bf16 product shapes do not fit. This is a bug."
    );
    if rows == 0 || cols == 0 || k == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let block = PairBlock {
            operands: Operands {
                a: a.bits,
                a_stride: a.stride,
                b: &[],
                b_stride: 0,
                k,
                rows,
                cols,
            },
            first_pair: 0,
            pairs,
            load: false,
        };
        let out = Target::F32(Out {
            ptr: out.as_mut_ptr(),
            stride: out_stride,
        });
        block.run(0..rows, 0..cols.div_ceil(PANEL), panels, out);
    }
}

/// `u32`s [`pack_columns`] writes for `b: [rows, cols]`: one panel of [`PANEL`] columns by
/// every pair of rows.
pub fn column_panels_len(rows: usize, cols: usize) -> usize {
    cols.div_ceil(PANEL) * rows.div_ceil(2) * PANEL
}

/// Every panel of `b`'s columns over all of its rows, `[panel][pairs][PANEL]`: pair `q` of
/// column `c` holds rows `2q` and `2q + 1` in its low and high halves, zero past the rows and
/// columns that exist. The layout [`pack_rows`] gives `bᵀ`, for products whose second operand
/// lies `[k, cols]`: attention packs each sequence's values once for all of its queries' `P·V`.
///
/// # Panics
/// If `dst` is not [`column_panels_len`] long: a bug in the caller.
pub fn pack_columns(b: Bf16View<'_>, dst: &mut [u32]) {
    let pairs = b.rows.div_ceil(2);
    assert!(
        b.fits() && dst.len() == column_panels_len(b.rows, b.cols),
        "bf16 column panel shapes do not fit. This is a bug."
    );
    if dst.is_empty() {
        return;
    }
    for (p, panel) in dst.chunks_exact_mut(pairs * PANEL).enumerate() {
        let first = p * PANEL;
        let width = PANEL.min(b.cols - first);
        for (q, cells) in panel.chunks_exact_mut(PANEL).enumerate() {
            let (cells, past) = cells.split_at_mut(width);
            let low = &b.bits[2 * q * b.stride + first..][..width];
            if 2 * q + 1 < b.rows {
                let high = &b.bits[(2 * q + 1) * b.stride + first..][..width];
                for ((cell, &low), &high) in cells.iter_mut().zip(low).zip(high) {
                    *cell = u32::from(low) | (u32::from(high) << 16);
                }
            } else {
                for (cell, &low) in cells.iter_mut().zip(low) {
                    *cell = u32::from(low);
                }
            }
            past.fill(0);
        }
    }
}

/// `out[r, c] = Σ_k a[r, k] · b[k, c]` for `c < cols` on the calling thread, `b`'s columns as
/// [`pack_columns`] packed them, read from pair `first_pair` of each panel (panels
/// `panel_stride` `u32`s apart), so that a product may start at any even row of `b`. `k`
/// (`a.cols`) is even: where `b`'s rows end inside the last pair, `a` holds a zero there. The
/// blocks of `k` are the weight products' (on `vdpbf16ps`), each cell one chain per block
/// continued through `out`, so each cell's sums depend on `k` alone.
///
/// Private to the crate: its one caller, attention, asks [`has_dot_instructions`] first
/// (`scores_from_bits`).
///
/// # Panics
/// If the kernel level lacks `vdpbf16ps`, `k` or `a`'s stride is odd, or a shape does not fit:
/// a bug in the caller.
pub(crate) fn product_columns(
    a: Bf16View<'_>,
    (panels, panel_stride, first_pair): (&[u32], usize, usize),
    cols: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    let (rows, k) = (a.rows, a.cols);
    let (pairs, panel_count) = (k / 2, cols.div_ceil(PANEL));
    assert!(
        has_dot_instructions()
            && a.fits()
            && k.is_multiple_of(2)
            && a.stride.is_multiple_of(2)
            && (first_pair + pairs) * PANEL <= panel_stride
            && panel_count * panel_stride <= panels.len()
            && output_fits(out.len(), (rows, cols), out_stride),
        "bf16 column panel product shapes do not fit. This is a bug."
    );
    if rows == 0 || cols == 0 || k == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let target = Out {
            ptr: out.as_mut_ptr(),
            stride: out_stride,
        };
        for (block_pair, block_pairs) in Engine::Pairs.blocks(k) {
            for r in (0..rows).step_by(MR) {
                let height = MR.min(rows - r);
                let from = r * a.stride + 2 * block_pair;
                let a_rows = &a.bits[from..from + (height - 1) * a.stride + 2 * block_pairs];
                for p in 0..panel_count {
                    let start = p * panel_stride + (first_pair + block_pair) * PANEL;
                    let operands = avx512::Operands {
                        a: a_rows,
                        a_stride: a.stride,
                        panel: &panels[start..start + block_pairs * PANEL],
                        pairs: block_pairs,
                    };
                    let c = p * PANEL;
                    // SAFETY: row `r` < rows and column `c` < cols, inside `out` (asserted
                    // above); the sums continue from `out` after the first block of `k`.
                    let dst = unsafe {
                        target.block((r, c), (height, PANEL.min(cols - c)), block_pair > 0)
                    };
                    // SAFETY: `dst` is `height × width` cells of `out`, which this call holds
                    // alone; the CPU has AVX512-F, -BW and -BF16 (asserted above).
                    unsafe { avx512::block(operands, avx512::Store::F32(dst)) }
                }
            }
        }
    }
}

/// Both operands of a product, as bf16 rows.
#[derive(Clone, Copy)]
struct Operands<'a> {
    /// `rows` rows `a_stride` apart (even).
    a: &'a [u16],
    a_stride: usize,
    /// `cols` rows `b_stride` apart.
    b: &'a [u16],
    b_stride: usize,
    k: usize,
    rows: usize,
    cols: usize,
}

/// Which kernel runs the bf16 products where the CPU has a bf16 dot instruction: fixed for the
/// process by the kernel level (and by [`emulate_tiles_in_this_process`] in its test process).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Engine {
    /// `vdpbf16ps` register blocks of [`MR`] × [`PANEL`].
    Pairs,
    /// AMX tiles, blocks of [`amx::ROWS`] × [`amx::COLS`] (`amx`).
    Tiles,
    /// The tile kernel on its emulator.
    EmulatedTiles,
}

impl Engine {
    /// This process's engine; `None` where no bf16 dot instruction runs.
    fn current() -> Option<Self> {
        if !has_dot_instructions() {
            return None;
        }
        Some(
            if EMULATED_TILES.load(std::sync::atomic::Ordering::Relaxed) {
                Self::EmulatedTiles
            } else if super::level::Level::Amx.enabled() {
                Self::Tiles
            } else {
                Self::Pairs
            },
        )
    }

    /// The blocks of pairs a product of width `k` runs in, `(first pair, pairs)`: `k`'s pairs
    /// split as evenly as possible into blocks of at most [`KC`] of `k`, on tiles in whole tile
    /// steps. The split depends on `k` alone, so each cell's order of sums does too.
    fn blocks(self, k: usize) -> impl Iterator<Item = (usize, usize)> {
        let pairs = k.div_ceil(2);
        let even = pairs.div_ceil(pairs.div_ceil(KC / 2).max(1)).max(1);
        let step = match self {
            Self::Pairs => even,
            Self::Tiles | Self::EmulatedTiles => even.next_multiple_of(amx::STEP_PAIRS),
        };
        (0..pairs)
            .step_by(step)
            .map(move |first| (first, step.min(pairs - first)))
    }

    /// The pairs one panel of a block of `pairs` holds: on tiles, zeros up to whole steps.
    fn padded(self, pairs: usize) -> usize {
        match self {
            Self::Pairs => pairs,
            Self::Tiles | Self::EmulatedTiles => pairs.next_multiple_of(amx::STEP_PAIRS),
        }
    }

    /// Rows of `a` one register or tile block covers.
    fn rows(self) -> usize {
        match self {
            Self::Pairs => MR,
            Self::Tiles | Self::EmulatedTiles => amx::ROWS,
        }
    }
}

/// A weight's panels packed once, at load, for every product with it: what a product would
/// otherwise pack into [`Packed`] block of `k` by block, here every block in order, each
/// `[panel][pairs][PANEL]` padded as the engine reads it. A product reads the same panels
/// either way, so its sums are the same bits; it only skips the packing.
#[derive(Debug, Clone)]
pub struct PackedWeight {
    cols: usize,
    k: usize,
    engine: Engine,
    panels: Vec<u32>,
}

impl PackedWeight {
    /// `b: [cols, k]` bf16 bits packed for this process's engine, in parallel; `None` where
    /// the CPU has no bf16 dot instruction (the f32 kernel then widens the weight as it packs
    /// it, product by product).
    ///
    /// # Panics
    /// If `b` is not a whole number of rows of `k`: a bug in the caller.
    pub fn of(b: &[u16], k: usize) -> Option<Self> {
        Engine::current().map(|engine| Self::for_engine(b, k, engine))
    }

    fn for_engine(b: &[u16], k: usize, engine: Engine) -> Self {
        let cols = b.len().checked_div(k).unwrap_or(0);
        assert_eq!(b.len(), cols * k, "bf16 weight shape. This is a bug.");
        let panel_count = cols.div_ceil(PANEL);
        let block_len = |pairs| panel_count * engine.padded(pairs) * PANEL;
        let total = engine.blocks(k).map(|(_, pairs)| block_len(pairs)).sum();
        let mut panels = vec![0u32; total];
        let operands = Operands {
            a: &[],
            a_stride: 0,
            b,
            b_stride: k,
            k,
            rows: 0,
            cols,
        };
        let mut rest = &mut panels[..];
        for (first_pair, pairs) in engine.blocks(k) {
            let (dst, tail) = rest.split_at_mut(block_len(pairs));
            let block = PairBlock {
                operands,
                first_pair,
                pairs,
                load: false,
            };
            block.pack(engine.padded(pairs), false, dst);
            rest = tail;
        }
        Self {
            cols,
            k,
            engine,
            panels,
        }
    }

    /// Rows of the weight: columns of a product's output.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes the panels take.
    pub fn bytes(&self) -> u64 {
        (self.panels.len() * size_of::<u32>()) as u64
    }
}

/// The right operand of a bf16 product: rows of bits, packed by each product, or a weight
/// packed once ([`PackedWeight`]).
#[derive(Debug, Clone, Copy)]
pub enum Weight<'a> {
    Rows(Bf16View<'a>),
    Packed(&'a PackedWeight),
}

impl Weight<'_> {
    /// Rows of `b`: columns of the output.
    pub fn cols(&self) -> usize {
        match self {
            Self::Rows(b) => b.rows,
            Self::Packed(w) => w.cols,
        }
    }

    /// Width of `b`'s rows.
    fn k(&self) -> usize {
        match self {
            Self::Rows(b) => b.cols,
            Self::Packed(w) => w.k,
        }
    }

    fn fits(&self) -> bool {
        match self {
            Self::Rows(b) => b.fits(),
            Self::Packed(_) => true,
        }
    }
}

/// Where a product's panels of `b` come from.
enum Panels<'a> {
    /// Packed block of `k` by block into this scratch, from the operands' `b`.
    Pack(&'a mut Vec<u32>),
    /// Packed at load: every block's, in order ([`PackedWeight`]).
    Packed(&'a [u32]),
}

/// The product on `engine`, block of `k` by block of `k`; later blocks continue the sums
/// through `out`.
#[cfg(target_arch = "x86_64")]
fn product(
    engine: Engine,
    operands: Operands<'_>,
    out: Target,
    accumulate: bool,
    threads: Threads,
    mut panels: Panels<'_>,
) {
    let Operands { k, rows, cols, .. } = operands;
    assert!(
        matches!(out, Target::F32(_)) || (engine.blocks(k).count() == 1 && !accumulate),
        "a rounded bf16 output takes one block of k. This is a bug."
    );
    let panel_count = cols.div_ceil(PANEL);
    let serial = threads == Threads::Caller || rows * cols * k < schedule::SERIAL_BELOW;
    let threads = if serial {
        1
    } else {
        rayon::current_num_threads()
    };
    let grid = Grid::new(rows, panel_count, engine.rows(), threads);
    let mut offset = 0;
    for (first_pair, pairs) in engine.blocks(k) {
        let block = PairBlock {
            operands,
            first_pair,
            pairs,
            // The sums continue from `out` after the first block of `k`.
            load: accumulate || first_pair > 0,
        };
        let padded = engine.padded(pairs);
        let len = panel_count * padded * PANEL;
        let panels: &[u32] = match &mut panels {
            Panels::Pack(scratch) => {
                scratch.resize(len, 0);
                block.pack(padded, serial, &mut scratch[..len]);
                &scratch[..len]
            }
            Panels::Packed(all) => {
                offset += len;
                &all[offset - len..offset]
            }
        };
        let run = |task: usize| {
            let (task_rows, task_panels) = grid.task(task, rows, panel_count);
            let panels_padded = (panels, padded);
            match engine {
                Engine::Pairs => block.run(task_rows, task_panels, panels, out),
                Engine::Tiles => {
                    block.run_tiles::<amx::Hardware>(task_rows, task_panels, panels_padded, out);
                }
                Engine::EmulatedTiles => {
                    block.run_tiles::<amx::Emulated>(task_rows, task_panels, panels_padded, out);
                }
            }
        };
        if serial {
            (0..grid.tasks()).for_each(run);
        } else {
            (0..grid.tasks()).into_par_iter().for_each(run);
        }
    }
}

/// A thread's buffers for the tile product: its rows of `a` padded to whole tile steps, and
/// one block of sums.
#[derive(Debug, Default)]
struct TileScratch {
    a: Vec<u16>,
    sums: Vec<f32>,
}

thread_local! {
    static TILE_SCRATCH: std::cell::RefCell<TileScratch> = std::cell::RefCell::default();
}

/// One block of pairs of `k` of a product.
#[derive(Clone, Copy)]
struct PairBlock<'a> {
    operands: Operands<'a>,
    first_pair: usize,
    pairs: usize,
    load: bool,
}

impl PairBlock<'_> {
    /// The columns of `k` this block covers (the last pair is half past `k` when it is odd).
    fn columns(&self) -> (usize, usize) {
        let from = 2 * self.first_pair;
        (from, (from + 2 * self.pairs).min(self.operands.k))
    }

    /// Every panel of this block into `dst`, `[panel][padded][PANEL]`, zeros past its pairs.
    fn pack(&self, padded: usize, serial: bool, dst: &mut [u32]) {
        let pack = |(p, dst): (usize, &mut [u32])| {
            let (present, zeros) = dst.split_at_mut(self.pairs * PANEL);
            self.pack_panel(p, present);
            zeros.fill(0);
        };
        if serial {
            dst.chunks_mut(padded * PANEL).enumerate().for_each(pack);
        } else {
            dst.par_chunks_mut(padded * PANEL)
                .enumerate()
                .for_each(pack);
        }
    }

    /// Panel `panel` of `b` for this block, `[pairs][PANEL]`: row `j` of the panel goes to lane
    /// `j` of each pair, zero past the rows that exist.
    fn pack_panel(&self, panel: usize, dst: &mut [u32]) {
        #[cfg(target_arch = "x86_64")]
        {
            let (from, to) = self.columns();
            if to - from == 2 * self.pairs && has_transpose_instructions() {
                let first_row = panel * PANEL;
                let rows = Rows {
                    bits: self.operands.b,
                    stride: self.operands.b_stride,
                    first_row,
                    present: PANEL.min(self.operands.cols.saturating_sub(first_row)),
                    from,
                };
                // SAFETY: the CPU has AVX-512F (checked just above).
                return unsafe { avx512::pack_panel(rows, self.pairs, dst) };
            }
        }
        self.pack_panel_portable(panel, dst);
    }

    /// [`Self::pack_panel`] one cell at a time: the reference, and the path for an odd `k`.
    fn pack_panel_portable(&self, panel: usize, dst: &mut [u32]) {
        let Operands {
            b, b_stride, cols, ..
        } = self.operands;
        let (from, to) = self.columns();
        for j in 0..PANEL {
            let row = panel * PANEL + j;
            let cells = dst[j..].iter_mut().step_by(PANEL);
            if row >= cols {
                cells.for_each(|c| *c = 0);
                continue;
            }
            let segment = &b[row * b_stride + from..row * b_stride + to];
            let (whole, odd) = segment.as_chunks::<2>();
            let mut cells = cells;
            // `whole` leads the zip, so that no cell is taken past its end.
            for (&[low, high], cell) in whole.iter().zip(cells.by_ref()) {
                *cell = u32::from(low) | (u32::from(high) << 16);
            }
            if let (Some(cell), [low]) = (cells.next(), odd) {
                *cell = u32::from(*low);
            }
        }
    }

    /// One task: its panels in chunks of `PANEL_CHUNK_BYTES` (they stay in the caches), and
    /// for each chunk its rows of `a`, [`MR`] at a time, each swept across the chunk. Each cell
    /// is still one register block's chain over this block of pairs: the order of the sweep
    /// changes no bits.
    #[cfg(target_arch = "x86_64")]
    fn run(
        &self,
        rows: std::ops::Range<usize>,
        panels: std::ops::Range<usize>,
        packed: &[u32],
        out: Target,
    ) {
        let chunk = (PANEL_CHUNK_BYTES / (self.pairs * PANEL * size_of::<u32>())).max(1);
        for first in panels.clone().step_by(chunk) {
            let chunk = first..(first + chunk).min(panels.end);
            for r in rows.clone().step_by(MR) {
                self.sweep((r, MR.min(rows.end - r)), chunk.clone(), packed, out);
            }
        }
    }

    /// Rows `r..r + height` of `a` across `panels`.
    #[cfg(target_arch = "x86_64")]
    fn sweep(
        &self,
        (r, height): (usize, usize),
        panels: std::ops::Range<usize>,
        packed: &[u32],
        out: Target,
    ) {
        let Operands {
            a, a_stride, cols, ..
        } = self.operands;
        let pairs = self.pairs;
        // The block's rows of `a`, from its first pair on.
        let from = r * a_stride + 2 * self.first_pair;
        let a = &a[from..from + (height - 1) * a_stride + 2 * pairs];
        for p in panels {
            let c = p * PANEL;
            let (height, width) = (height, PANEL.min(cols - c));
            // SAFETY: row `r` < rows and column `c` < cols, inside `out` (checked against
            // its length by the public function that made it).
            let dst = match out {
                Target::F32(out) => {
                    avx512::Store::F32(unsafe { out.block((r, c), (height, width), self.load) })
                }
                Target::Bits(bits) => avx512::Store::Bits {
                    ptr: unsafe { bits.ptr.add(r * bits.stride + c) },
                    stride: bits.stride,
                    height,
                    width,
                },
            };
            let operands = avx512::Operands {
                a,
                a_stride,
                panel: &packed[p * pairs * PANEL..(p + 1) * pairs * PANEL],
                pairs,
            };
            // SAFETY: `dst` is `height × width` cells of this task's own rows and panels of
            // `out`, which no other task touches; the CPU has AVX512-F, -BW and -BF16
            // (checked by the public function that made `out`).
            unsafe { avx512::block(operands, dst) }
        }
    }
}

impl PairBlock<'_> {
    /// One task on AMX tiles: as [`Self::run`], its panels in chunks that stay in the caches
    /// and its rows of `a` [`amx::ROWS`] at a time, swept across the chunk's panels, each
    /// `packed` panel `padded` pairs long. The tiles read 32 whole rows of whole steps of `a`
    /// where they exist, else a copy padded with zeros; they sum straight into `out` where a
    /// block covers 32 × 32 cells of f32, else through a block of scratch.
    fn run_tiles<T: amx::Tiles + Default>(
        &self,
        rows: std::ops::Range<usize>,
        panels: std::ops::Range<usize>,
        (packed, padded): (&[u32], usize),
        out: Target,
    ) {
        let Operands {
            a, a_stride, cols, ..
        } = self.operands;
        let (from, to) = self.columns();
        let steps = padded / amx::STEP_PAIRS;
        let chunk = (PANEL_CHUNK_BYTES / (padded * PANEL * size_of::<u32>())).max(1);
        schedule::with(&TILE_SCRATCH, |scratch| {
            let TileScratch { a: padded_a, sums } = scratch;
            padded_a.resize(amx::ROWS * 2 * padded, 0);
            sums.resize(amx::ROWS * amx::COLS, 0.0);
            let mut tiles = T::default();
            // SAFETY: `T` is the emulator, or the tiles where the kernel level is `amx`,
            // which the level check grants only after the tiles passed their self-check.
            unsafe { tiles.configure(&amx::Config::full()) };
            for first in panels.clone().step_by(chunk) {
                for r in rows.clone().step_by(amx::ROWS) {
                    let height = amx::ROWS.min(rows.end - r);
                    let rows_of_a = if height == amx::ROWS && to - from == 2 * padded {
                        (&a[r * a_stride + from..], a_stride)
                    } else {
                        self.pad_rows((r, height), (padded_a, 2 * padded));
                        (&padded_a[..], 2 * padded)
                    };
                    for p in first..(first + chunk).min(panels.end) {
                        let c = p * PANEL;
                        let cell = ((r, c), (height, PANEL.min(cols - c)));
                        let panel = &packed[p * padded * PANEL..(p + 1) * padded * PANEL];
                        let direct = match out {
                            Target::F32(out) if cell.1 == (amx::ROWS, amx::COLS) => Some(out),
                            _ => None,
                        };
                        let target = match direct {
                            Some(out) => amx::Sums {
                                // SAFETY: (r, c) lies inside `out` (the grid's contract).
                                ptr: unsafe { out.ptr.add(r * out.stride + c) },
                                stride: out.stride,
                                from_zero: !self.load,
                            },
                            None => self.load_sums(out, cell, sums),
                        };
                        // SAFETY: configured above; `target` is 32 × 32 cells of this task's
                        // own rows and panels of `out`, or of its scratch; `block` checks the
                        // operands' lengths.
                        unsafe { amx::block(&mut tiles, rows_of_a, panel, steps, target) };
                        if direct.is_none() {
                            store_sums(sums, out, cell);
                        }
                    }
                }
            }
            // SAFETY: as for `configure`.
            unsafe { tiles.release() };
        });
    }

    /// Rows `r..r + height` of `a` over this block's columns into `dst`, rows `stride` apart,
    /// zero past the columns and rows that exist.
    fn pad_rows(&self, (r, height): (usize, usize), (dst, stride): (&mut [u16], usize)) {
        let Operands { a, a_stride, .. } = self.operands;
        let (from, to) = self.columns();
        for (i, row) in dst.chunks_exact_mut(stride).enumerate() {
            let present = if i < height { to - from } else { 0 };
            let src = (r + i) * a_stride + from;
            if present > 0 {
                row[..present].copy_from_slice(&a[src..src + present]);
            }
            row[present..].fill(0);
        }
    }

    /// The scratch block a block of cells sums through: from `out`'s cells where the block
    /// continues them, else from zero.
    fn load_sums(
        &self,
        out: Target,
        ((r, c), (height, width)): Cell,
        sums: &mut [f32],
    ) -> amx::Sums {
        let target = amx::Sums {
            ptr: sums.as_mut_ptr(),
            stride: amx::COLS,
            from_zero: !self.load,
        };
        if let (Target::F32(out), true) = (out, self.load) {
            sums.fill(0.0);
            for (i, row) in sums.chunks_exact_mut(amx::COLS).take(height).enumerate() {
                // SAFETY: rows r..r + height and columns c..c + width lie inside `out` and
                // belong to this task alone (the grid's contract).
                let src = unsafe {
                    std::slice::from_raw_parts(out.ptr.add((r + i) * out.stride + c), width)
                };
                row[..width].copy_from_slice(src);
            }
        }
        target
    }
}

/// A block of cells of `out`: its first row and column, its height and width.
type Cell = ((usize, usize), (usize, usize));

/// Writes a block's sums to its cells of `out`: as they are, or rounded to bf16 bits.
fn store_sums(sums: &[f32], out: Target, ((r, c), (height, width)): Cell) {
    for (i, row) in sums.chunks_exact(amx::COLS).take(height).enumerate() {
        let row = &row[..width];
        // SAFETY: as in `load_sums`: this task's own cells of `out`.
        unsafe {
            match out {
                Target::F32(out) => {
                    let dst = out.ptr.add((r + i) * out.stride + c);
                    std::slice::from_raw_parts_mut(dst, width).copy_from_slice(row);
                }
                Target::Bits(bits) => {
                    let dst = bits.ptr.add((r + i) * bits.stride + c);
                    let dst = std::slice::from_raw_parts_mut(dst, width);
                    dst.iter_mut()
                        .zip(row)
                        .for_each(|(d, &v)| *d = to_bf16_bits(v));
                }
            }
        }
    }
}

/// Whether panels are packed with the AVX-512 transpose (the kernel level allows AVX-512).
#[cfg(target_arch = "x86_64")]
fn has_transpose_instructions() -> bool {
    super::level::Level::Avx512.enabled()
}

/// The rows of `b` one panel packs: `present` of [`PANEL`] exist (the rest pack as zeros), each
/// read from column `from` on.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Rows<'a> {
    bits: &'a [u16],
    stride: usize,
    first_row: usize,
    present: usize,
    from: usize,
}

/// The portable path: `a` widened exactly to f32, then the f32 kernel, which widens `b` as it
/// packs it. (The engine rounds its f32 input itself and calls the f32 kernel directly; this
/// serves direct callers.)
fn widened(a: Bf16View<'_>, b: Bf16View<'_>, out: &mut [f32], out_stride: usize, accumulate: bool) {
    let k = a.cols;
    let a32: Vec<f32> = (0..a.rows)
        .flat_map(|r| &a.bits[r * a.stride..r * a.stride + k])
        .map(|&v| half::bf16::from_bits(v).to_f32())
        .collect();
    sgemm::product(
        MatRef::dense(&a32, a.rows, k),
        &b,
        out,
        out_stride,
        accumulate,
    );
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::{
        __m256i, __m512, __m512bh, __m512i, _mm256_storeu_si256, _mm512_add_epi32,
        _mm512_and_si512, _mm512_castps_si512, _mm512_cmpgt_epi32_mask, _mm512_cvtepi32_epi16,
        _mm512_dpbf16_ps, _mm512_loadu_ps, _mm512_loadu_si512, _mm512_mask_mov_epi32,
        _mm512_maskz_loadu_epi32, _mm512_or_si512, _mm512_set1_epi32, _mm512_setzero_ps,
        _mm512_setzero_si512, _mm512_shuffle_i32x4, _mm512_srli_epi32, _mm512_storeu_ps,
        _mm512_storeu_si512, _mm512_unpackhi_epi32, _mm512_unpackhi_epi64, _mm512_unpacklo_epi32,
        _mm512_unpacklo_epi64,
    };

    use super::{Dst, MR, PANEL, Rows};

    /// Pairs one transpose moves per row: a zmm of `u32`.
    const PAIRS_PER_STEP: usize = 16;

    /// `dst[q][j]` = pair `q` of row `j` of `rows` (zero past the rows present), for `pairs`
    /// pairs: 16 rows by 16 pairs at a time, through registers.
    ///
    /// # Safety
    /// The CPU must have AVX-512F.
    ///
    /// # Panics
    /// If `dst` is not `pairs × PANEL` long or a present row is shorter than `from + 2 × pairs`:
    /// a bug in the caller.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn pack_panel(rows: Rows<'_>, pairs: usize, dst: &mut [u32]) {
        let Rows {
            bits,
            stride,
            first_row,
            present,
            from,
        } = rows;
        assert!(
            dst.len() == pairs * PANEL
                && present <= PANEL
                && (present == 0
                    || (first_row + present - 1) * stride + from + 2 * pairs <= bits.len()),
            "bf16 panel shapes do not fit. This is a bug."
        );
        let dst = dst.as_mut_ptr();
        for q0 in (0..pairs).step_by(PAIRS_PER_STEP) {
            let count = PAIRS_PER_STEP.min(pairs - q0);
            let mask = (1u32 << count).wrapping_sub(1) as u16;
            for half in 0..PANEL / 16 {
                let mut block = [_mm512_setzero_si512(); 16];
                for (i, row) in block.iter_mut().enumerate() {
                    let j = half * 16 + i;
                    if j < present {
                        let start = (first_row + j) * stride + from + 2 * q0;
                        // SAFETY: `count` pairs (2 × count u16) from `start` lie inside `bits`
                        // (asserted above); masked-off lanes are not read.
                        *row = unsafe {
                            _mm512_maskz_loadu_epi32(mask, bits.as_ptr().add(start).cast())
                        };
                    }
                }
                let columns = transpose(block);
                for (c, column) in columns.iter().enumerate().take(count) {
                    // SAFETY: pair q0 + c < pairs, so its 16 cells from row `half × 16` lie
                    // inside `dst` (asserted `pairs × PANEL` long).
                    unsafe {
                        _mm512_storeu_si512(dst.add((q0 + c) * PANEL + half * 16).cast(), *column);
                    };
                }
            }
        }
    }

    /// The 16 × 16 transpose of 32-bit cells: `out[c]` lane `r` = `rows[r]` lane `c`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn transpose(rows: [__m512i; 16]) -> [__m512i; 16] {
        // Lanes of 128 bits are `L`; after two rounds of unpacking, `by_four[g][o]` holds, in
        // lane `L`, column `4L + o` of rows `4g..4g + 4`.
        let mut by_four = [[_mm512_setzero_si512(); 4]; 4];
        for (g, four) in by_four.iter_mut().enumerate() {
            let r = &rows[4 * g..4 * g + 4];
            let (t0, t1) = (
                _mm512_unpacklo_epi32(r[0], r[1]),
                _mm512_unpackhi_epi32(r[0], r[1]),
            );
            let (t2, t3) = (
                _mm512_unpacklo_epi32(r[2], r[3]),
                _mm512_unpackhi_epi32(r[2], r[3]),
            );
            *four = [
                _mm512_unpacklo_epi64(t0, t2),
                _mm512_unpackhi_epi64(t0, t2),
                _mm512_unpacklo_epi64(t1, t3),
                _mm512_unpackhi_epi64(t1, t3),
            ];
        }
        let mut out = [_mm512_setzero_si512(); 16];
        for o in 0..4 {
            let [w0, w1, w2, w3] = [by_four[0][o], by_four[1][o], by_four[2][o], by_four[3][o]];
            // Lanes 0 and 1, then 2 and 3, of two groups side by side.
            let x0 = _mm512_shuffle_i32x4::<0b01_00_01_00>(w0, w1);
            let x1 = _mm512_shuffle_i32x4::<0b11_10_11_10>(w0, w1);
            let y0 = _mm512_shuffle_i32x4::<0b01_00_01_00>(w2, w3);
            let y1 = _mm512_shuffle_i32x4::<0b11_10_11_10>(w2, w3);
            out[o] = _mm512_shuffle_i32x4::<0b10_00_10_00>(x0, y0);
            out[4 + o] = _mm512_shuffle_i32x4::<0b11_01_11_01>(x0, y0);
            out[8 + o] = _mm512_shuffle_i32x4::<0b10_00_10_00>(x1, y1);
            out[12 + o] = _mm512_shuffle_i32x4::<0b11_01_11_01>(x1, y1);
        }
        out
    }

    /// What one register block reads.
    pub(super) struct Operands<'a> {
        /// The block's rows of `a` from its first pair on, `a_stride` apart (even).
        pub a: &'a [u16],
        pub a_stride: usize,
        /// One packed panel, `[pairs][PANEL]`.
        pub panel: &'a [u32],
        pub pairs: usize,
    }

    /// Bit-for-bit reinterpretation of 32 16-bit lanes as 32 bf16 lanes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    fn as_bf16(v: __m512i) -> __m512bh {
        // SAFETY: both are 512-bit plain-data vectors; every bit pattern is valid in each.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
    }

    /// Where one register block's sums go.
    pub(super) enum Store {
        /// f32 cells, which the sums may start from.
        F32(Dst),
        /// bf16 bits, each sum rounded to the nearest (the sums start from zero).
        Bits {
            ptr: *mut u16,
            stride: usize,
            height: usize,
            width: usize,
        },
    }

    impl Store {
        fn height(&self) -> usize {
            match self {
                Self::F32(dst) => dst.height,
                Self::Bits { height, .. } => *height,
            }
        }
    }

    /// One block, monomorphised on its height.
    ///
    /// # Safety
    /// `dst` must describe `height × width` writable cells that no other thread touches, and
    /// the CPU must have AVX512-F, -BW and -BF16.
    pub(super) unsafe fn block(operands: Operands<'_>, dst: Store) {
        macro_rules! by_height {
            ($($h:literal)*) => {
                match dst.height() {
                    // SAFETY: passed on from the caller.
                    $($h => unsafe { rows::<$h>(operands, dst) },)*
                    _ => unreachable!("block height beyond MR. This is a bug."),
                }
            };
        }
        by_height!(1 2 3 4 5 6 7 8);
    }

    /// # Safety
    /// As [`block`], with `H` its height.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn rows<const H: usize>(operands: Operands<'_>, dst: Store) {
        let Operands {
            a,
            a_stride,
            panel,
            pairs,
        } = operands;
        assert!(
            H <= MR
                && a_stride.is_multiple_of(2)
                && (H - 1) * a_stride + 2 * pairs <= a.len()
                && pairs * PANEL <= panel.len(),
            "bf16 register block shapes. This is a bug."
        );
        let mut acc = [[_mm512_setzero_ps(); 2]; H];
        if let Store::F32(dst) = &dst
            && dst.load
        {
            for (i, row) in acc.iter_mut().enumerate() {
                // SAFETY: row i < height, and `load_row` reads `width` cells.
                *row = unsafe { load_row(dst.ptr.add(i * dst.stride), dst.width) };
            }
        }
        let (a_ptr, b_ptr) = (a.as_ptr(), panel.as_ptr());
        for q in 0..pairs {
            // SAFETY: q < pairs, so `q * PANEL + PANEL <= panel.len()` and, for every row
            // i < H, the pair at `i * a_stride + 2 * q` lies inside `a` (both asserted above).
            unsafe {
                let b0 = as_bf16(_mm512_loadu_si512(b_ptr.add(q * PANEL).cast()));
                let b1 = as_bf16(_mm512_loadu_si512(b_ptr.add(q * PANEL + 16).cast()));
                for (i, row) in acc.iter_mut().enumerate() {
                    let pair = a_ptr
                        .add(i * a_stride + 2 * q)
                        .cast::<i32>()
                        .read_unaligned();
                    let x = as_bf16(_mm512_set1_epi32(pair));
                    row[0] = _mm512_dpbf16_ps(row[0], x, b0);
                    row[1] = _mm512_dpbf16_ps(row[1], x, b1);
                }
            }
        }
        match dst {
            Store::F32(dst) => {
                for (i, row) in acc.iter().enumerate() {
                    // SAFETY: as for the load.
                    unsafe { store_row(dst.ptr.add(i * dst.stride), dst.width, row) };
                }
            }
            Store::Bits {
                ptr, stride, width, ..
            } => {
                for (i, row) in acc.iter().enumerate() {
                    // SAFETY: row i < height, and `store_bits_row` writes `width` cells.
                    unsafe { store_bits_row(ptr.add(i * stride), width, row) };
                }
            }
        }
    }

    /// `crate::dtype::bf16_rounded_bits` of every lane, in the low 16 bits of each.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn rounded_bits(v: __m512) -> __m256i {
        let bits = _mm512_castps_si512(v);
        let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
        let rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
        let magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFF_FFFF));
        let nan = _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(0x7F80_0000));
        let quiet = _mm512_or_si512(bits, _mm512_set1_epi32(0x0040_0000));
        let chosen = _mm512_mask_mov_epi32(rounded, nan, quiet);
        _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(chosen))
    }

    /// Writes the first `width` lanes of `row`, rounded to bf16 bits, to `ptr`.
    ///
    /// # Safety
    /// `ptr` must have `width` writable cells.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn store_bits_row(ptr: *mut u16, width: usize, row: &[__m512; 2]) {
        let halves = [rounded_bits(row[0]), rounded_bits(row[1])];
        // SAFETY: `width <= PANEL` cells are writable at `ptr` (the caller's contract);
        // `halves` holds PANEL.
        unsafe {
            if width == PANEL {
                _mm256_storeu_si256(ptr.cast(), halves[0]);
                _mm256_storeu_si256(ptr.add(16).cast(), halves[1]);
                return;
            }
            std::ptr::copy_nonoverlapping(halves.as_ptr().cast::<u16>(), ptr, width);
        }
    }

    /// Two vectors from `width` cells at `ptr` (zero past them).
    ///
    /// # Safety
    /// `ptr` must have `width` readable cells.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load_row(ptr: *const f32, width: usize) -> [__m512; 2] {
        let mut lanes = [0.0f32; PANEL];
        // SAFETY: `width <= PANEL` cells are readable at `ptr` (the caller's contract).
        unsafe {
            if width == PANEL {
                return [_mm512_loadu_ps(ptr), _mm512_loadu_ps(ptr.add(16))];
            }
            std::ptr::copy_nonoverlapping(ptr, lanes.as_mut_ptr(), width);
            [
                _mm512_loadu_ps(lanes.as_ptr()),
                _mm512_loadu_ps(lanes.as_ptr().add(16)),
            ]
        }
    }

    /// Writes the first `width` lanes of `row` to `ptr`.
    ///
    /// # Safety
    /// `ptr` must have `width` writable cells.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn store_row(ptr: *mut f32, width: usize, row: &[__m512; 2]) {
        let mut lanes = [0.0f32; PANEL];
        // SAFETY: `width <= PANEL` cells are writable at `ptr` (the caller's contract); `lanes`
        // holds PANEL.
        unsafe {
            if width == PANEL {
                _mm512_storeu_ps(ptr, row[0]);
                _mm512_storeu_ps(ptr.add(16), row[1]);
                return;
            }
            _mm512_storeu_ps(lanes.as_mut_ptr(), row[0]);
            _mm512_storeu_ps(lanes.as_mut_ptr().add(16), row[1]);
            std::ptr::copy_nonoverlapping(lanes.as_ptr(), ptr, width);
        }
    }
}

impl WeightRows for Bf16View<'_> {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn widen_segment(&self, row: usize, start: usize, dst: &mut [f32]) {
        let from = row * self.stride + start;
        let bits = &self.bits[from..from + dst.len()];
        for (d, &b) in dst.iter_mut().zip(bits) {
            *d = f32::from_bits(u32::from(b) << 16);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i * 7919 + seed * 104_729) % 2003) as f32 - 1001.0) / 317.0)
            .collect()
    }

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
    fn a_bf16_weight_gives_the_bits_of_its_f32_widening() {
        let (m, n, k) = (9, 45, 270);
        let a = values(m * k, 6);
        let bits: Vec<u16> = values(n * k, 7)
            .iter()
            .map(|&v| (crate::dtype::bf16_rounded_bits(v) >> 16) as u16)
            .collect();
        let widened: Vec<f32> = bits
            .iter()
            .map(|&b| f32::from_bits(u32::from(b) << 16))
            .collect();
        let (mut from_bits, mut from_f32) = (vec![0.0; m * n], vec![0.0; m * n]);
        let a = MatRef::dense(&a, m, k);
        sgemm::product(a, &Bf16View::dense(&bits, n, k), &mut from_bits, n, false);
        sgemm::product(a, &MatRef::dense(&widened, n, k), &mut from_f32, n, false);
        assert_eq!(from_bits, from_f32);
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
            (13, 33, 600),
            (200, 70, 2 * KC + 77),
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
    fn a_product_over_column_panels_matches_a_float64_sum_from_any_even_row_of_b() {
        if !has_dot_instructions() {
            eprintln!("skipped: the kernel level has no vdpbf16ps");
            return;
        }
        // (rows of a, cols, rows of b, first pair, k): b's rows ending inside the last pair,
        // a head narrower than a panel, a start inside b, and k over two blocks.
        for (rows, cols, b_rows, first_pair, k) in [
            (16, 18, 37, 0, 38),
            (9, 33, 100, 10, 60),
            (5, 64, 2 * KC + 77, 16, 2 * KC + 40),
        ] {
            let b = bits(&values(b_rows * cols, 3));
            let mut a = bits(&values(rows * k, 4));
            for row in a.chunks_exact_mut(k) {
                // Past b's rows a holds zeros, as attention's probabilities do.
                row.iter_mut()
                    .skip(b_rows - 2 * first_pair)
                    .for_each(|v| *v = 0);
            }
            let mut panels = vec![u32::MAX; column_panels_len(b_rows, cols)];
            pack_columns(Bf16View::dense(&b, b_rows, cols), &mut panels);
            let panel_stride = b_rows.div_ceil(2) * PANEL;
            let mut out = vec![7.0f32; rows * (cols + 2)];
            let view = Bf16View::dense(&a, rows, k);
            product_columns(
                view,
                (&panels, panel_stride, first_pair),
                cols,
                &mut out,
                cols + 2,
            );
            let wide = |v: u16| f64::from(half::bf16::from_bits(v).to_f32());
            for r in 0..rows {
                for c in 0..cols {
                    let want: f64 = (0..k)
                        .filter(|i| 2 * first_pair + i < b_rows)
                        .map(|i| wide(a[r * k + i]) * wide(b[(2 * first_pair + i) * cols + c]))
                        .sum();
                    let got = f64::from(out[r * (cols + 2) + c]);
                    assert!(
                        (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "{rows}x{cols} from pair {first_pair}, k {k} [{r},{c}]: {got} vs {want}"
                    );
                }
                assert_eq!(
                    out[r * (cols + 2) + cols],
                    7.0,
                    "columns past cols are untouched"
                );
            }
        }
    }

    #[test]
    fn a_product_rounded_as_it_is_stored_gives_the_bits_of_the_f32_product_rounded() {
        // In registers where `vdpbf16ps` runs; past one block of `k`, or at a kernel level
        // without it, through the f32 product.
        for (rows, cols, k) in [
            (1, 1, 2),
            (5, 7, 33),
            (37, 70, 64),
            (19, 40, KC),
            (3, 9, KC + 6),
        ] {
            let mut a = bits(
                &(0..rows * k)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                    .collect::<Vec<_>>(),
            );
            let mut b = bits(
                &(0..cols * k)
                    .map(|i| ((i * 53 % 89) as f32 - 44.0) / 3.0)
                    .collect::<Vec<_>>(),
            );
            // An infinity meets a zero weight (a NaN sum, which must stay a NaN as bits) and
            // the other weights (infinite sums).
            a[0] = to_bf16_bits(f32::INFINITY);
            b[0] = 0;
            let mut f32_out = vec![0.0f32; rows * cols];
            matmul_bf16(&a, &b, k, &mut f32_out, cols, false, &mut Packed::default());
            assert!(f32_out[0].is_nan(), "the test's NaN");
            let expected: Vec<u16> = f32_out.iter().map(|&v| to_bf16_bits(v)).collect();
            let mut rounded = vec![7u16; rows * (cols + 1)];
            let out = (&mut rounded[..], cols + 1);
            matmul_bf16_rounded(&a, &b, k, out, &mut Packed::default());
            for r in 0..rows {
                let row = &rounded[r * (cols + 1)..(r + 1) * (cols + 1)];
                assert_eq!(
                    row[..cols],
                    expected[r * cols..(r + 1) * cols],
                    "{rows}x{cols}x{k} row {r}"
                );
                assert_eq!(row[cols], 7, "columns past cols are untouched");
            }
        }
    }

    #[test]
    fn panels_packed_through_registers_equal_panels_packed_cell_by_cell() {
        // Ragged rows (a last panel part empty), pairs past a multiple of 16, an odd stride
        // (unaligned pairs) and a block of `k` that starts past the first pair.
        for (cols, k, stride, first_pair) in [
            (70, 64, 64, 0),
            (32, 2, 3, 0),
            (5, 94, 97, 7),
            (100, 600, 601, 13),
            (64, 40, 40, 10),
        ] {
            let b: Vec<u16> = (0..cols * stride)
                .map(|i| (i * 7919 % 65521) as u16)
                .collect();
            let block = PairBlock {
                operands: Operands {
                    a: &[],
                    a_stride: 0,
                    b: &b,
                    b_stride: stride,
                    k,
                    rows: 0,
                    cols,
                },
                first_pair,
                pairs: k / 2 - first_pair,
                load: false,
            };
            for panel in 0..cols.div_ceil(PANEL) {
                let mut fast = vec![1; block.pairs * PANEL];
                let mut slow = vec![2; block.pairs * PANEL];
                block.pack_panel(panel, &mut fast);
                block.pack_panel_portable(panel, &mut slow);
                assert_eq!(
                    fast, slow,
                    "{cols} rows, k {k}, stride {stride}, panel {panel}"
                );
            }
        }
    }

    #[test]
    fn a_column_gives_the_same_bits_in_a_product_whose_panels_span_several_chunks() {
        if !has_dot_instructions() {
            eprintln!("skipped: this CPU has no vdpbf16ps");
            return;
        }
        // One block of `k`, and columns enough that each task's panels span several chunks.
        let (rows, cols, k) = (MR + 3, 6000usize, KC);
        let chunk = PANEL_CHUNK_BYTES / (k / 2 * PANEL * size_of::<u32>());
        let grid = Grid::new(rows, cols.div_ceil(PANEL), MR, 1);
        let (_, first_task) = grid.task(0, rows, cols.div_ceil(PANEL));
        assert!(first_task.len() > 2 * chunk, "{} panels", first_task.len());
        let values = |n: usize, step: f32| (0..n).map(|i| (i as f32 * step).sin()).collect();
        let (a, b): (Vec<f32>, Vec<f32>) = (values(rows * k, 0.37), values(cols * k, 0.11));
        let (a, b) = (bits(&a), bits(&b));
        let product = |b: &[u16]| {
            let cols = b.len() / k;
            let mut out = vec![0.0; rows * cols];
            let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build();
            pool.unwrap().install(|| {
                matmul_bf16(&a, b, k, &mut out, cols, false, &mut Packed::default());
            });
            out
        };
        let wide = product(&b);
        // Few enough columns for one chunk.
        for first in [0, 1000, cols - 40] {
            let narrow = product(&b[first * k..(first + 40) * k]);
            for r in 0..rows {
                assert_eq!(
                    narrow[r * 40..(r + 1) * 40],
                    wide[r * cols + first..r * cols + first + 40],
                    "row {r}, columns {first}.."
                );
            }
        }
    }

    /// [`product`] on `engine`: `out (+)= a · bᵀ`.
    fn on_tiles(
        engine: Engine,
        (a, b, k): (&[u16], &[u16], usize),
        (out, out_stride): (&mut [f32], usize),
        accumulate: bool,
    ) {
        let (rows, cols) = (a.len() / k, b.len() / k);
        assert!(output_fits(out.len(), (rows, cols), out_stride));
        let operands = Operands {
            a,
            a_stride: k,
            b,
            b_stride: k,
            k,
            rows,
            cols,
        };
        let out = Target::F32(Out {
            ptr: out.as_mut_ptr(),
            stride: out_stride,
        });
        let panels = Panels::Pack(&mut Vec::new());
        product(engine, operands, out, accumulate, Threads::Pool, panels);
    }

    /// Runs `test` on the emulated tiles, and on this CPU's where it has AMX (named as skipped
    /// where it has not).
    fn on_every_tile_unit(
        test: impl Fn(&str, &(dyn Fn((&[u16], &[u16], usize), (&mut [f32], usize), bool) + Sync)),
    ) {
        test("emulated", &|a, out, acc| {
            on_tiles(Engine::EmulatedTiles, a, out, acc);
        });
        match amx::self_check() {
            Ok(()) => test("hardware", &|a, out, acc| {
                on_tiles(Engine::Tiles, a, out, acc);
            }),
            Err(why) => eprintln!("skipped on this CPU's tiles: {why}"),
        }
    }

    #[test]
    fn the_tile_product_matches_a_float64_sum_of_the_same_bf16_inputs_for_ragged_shapes() {
        on_every_tile_unit(|unit, product| {
            for (rows, cols, k) in [
                (1, 1, 1),
                (5, 7, 33),
                (37, 6, 64),
                (33, 40, 31),
                (13, 33, 600),
                (70, 65, 2 * KC + 77),
            ] {
                let a: Vec<f32> = (0..rows * k)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
                    .collect();
                let b: Vec<f32> = (0..cols * k)
                    .map(|i| ((i * 53 % 89) as f32 - 44.0) / 23.0)
                    .collect();
                let (a, b) = (bits(&a), bits(&b));
                let mut out = vec![1.0f32; rows * (cols + 2)];
                product((&a, &b, k), (&mut out, cols + 2), true);
                let expected = reference(&a, &b, k);
                for r in 0..rows {
                    for c in 0..cols {
                        let got = f64::from(out[r * (cols + 2) + c]) - 1.0;
                        let want = expected[r * cols + c];
                        assert!(
                            (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "{unit}: {rows}x{cols}x{k} [{r},{c}]: {got} vs {want}"
                        );
                    }
                    assert_eq!(out[r * (cols + 2) + cols], 1.0, "{unit}: past cols");
                }
            }
        });
    }

    /// `bf16(a · bᵀ)` on `T`'s tiles, as [`matmul_bf16_rounded`] stores it, and the f32 sums.
    fn rounded_on_tiles(engine: Engine, a: &[u16], b: &[u16], k: usize) -> (Vec<u16>, Vec<f32>) {
        let (rows, cols) = (a.len() / k, b.len() / k);
        let operands = Operands {
            a,
            a_stride: k,
            b,
            b_stride: k,
            k,
            rows,
            cols,
        };
        let mut rounded = vec![7u16; rows * cols];
        let out = Target::Bits(OutBits {
            ptr: rounded.as_mut_ptr(),
            stride: cols,
        });
        product(
            engine,
            operands,
            out,
            false,
            Threads::Pool,
            Panels::Pack(&mut Vec::new()),
        );
        let mut sums = vec![0.0; rows * cols];
        on_tiles(engine, (a, b, k), (&mut sums, cols), false);
        (rounded, sums)
    }

    #[test]
    fn on_tiles_a_product_rounded_as_it_is_stored_gives_the_bits_of_the_f32_product_rounded() {
        let (rows, cols, k) = (37, 70, 64);
        let a = bits(
            &(0..rows * k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                .collect::<Vec<_>>(),
        );
        let b = bits(
            &(0..cols * k)
                .map(|i| ((i * 53 % 89) as f32 - 44.0) / 3.0)
                .collect::<Vec<_>>(),
        );
        let mut runs = vec![(
            "emulated",
            rounded_on_tiles(Engine::EmulatedTiles, &a, &b, k),
        )];
        match amx::self_check() {
            Ok(()) => runs.push(("hardware", rounded_on_tiles(Engine::Tiles, &a, &b, k))),
            Err(why) => eprintln!("skipped on this CPU's tiles: {why}"),
        }
        for (unit, (rounded, sums)) in runs {
            let expected: Vec<u16> = sums.iter().map(|&v| to_bf16_bits(v)).collect();
            assert_eq!(rounded, expected, "{unit}");
        }
    }

    #[test]
    fn on_tiles_a_row_gives_the_same_bits_alone_as_in_any_batch_on_any_thread_count() {
        // Rows over two tasks and a `k` over two blocks of uneven steps.
        let (rows, cols, k) = (2 * schedule::STRIPS_PER_BLOCK * amx::ROWS + 7, 40, KC + 78);
        let a = bits(
            &(0..rows * k)
                .map(|i| (i as f32 * 0.37).sin())
                .collect::<Vec<_>>(),
        );
        let b = bits(
            &(0..cols * k)
                .map(|i| (i as f32 * 0.11).cos())
                .collect::<Vec<_>>(),
        );
        on_every_tile_unit(|unit, product| {
            let run = |a: &[u16], threads: usize| {
                let mut out = vec![0.0; a.len() / k * cols];
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build();
                pool.unwrap()
                    .install(|| product((a, &b, k), (&mut out, cols), false));
                out
            };
            let all = run(&a, 2);
            assert_eq!(run(&a, 1), all, "{unit}: one thread or two");
            for row in [0, amx::ROWS + 3, rows - 1] {
                let one = run(&a[row * k..(row + 1) * k], 2);
                assert_eq!(
                    one,
                    all[row * cols..(row + 1) * cols],
                    "{unit}: row {row} alone"
                );
            }
        });
    }

    #[test]
    fn a_row_gives_the_same_bits_alone_as_in_any_batch_on_any_thread_count() {
        // More rows than one task takes and a `k` over two blocks, so that tasks, strips and
        // blocks of `k` all split the batch.
        let (rows, cols, k) = (2 * schedule::STRIPS_PER_BLOCK * MR + 7, 70, 2 * KC + 78);
        let a = bits(
            &(0..rows * k)
                .map(|i| (i as f32 * 0.37).sin())
                .collect::<Vec<_>>(),
        );
        let b = bits(
            &(0..cols * k)
                .map(|i| (i as f32 * 0.11).cos())
                .collect::<Vec<_>>(),
        );
        let product = |a: &[u16], threads: usize| {
            let mut out = vec![0.0; a.len() / k * cols];
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build();
            pool.unwrap().install(|| {
                matmul_bf16(a, &b, k, &mut out, cols, false, &mut Packed::default());
            });
            out
        };
        let all = product(&a, 2);
        assert_eq!(product(&a, 1), all, "one thread or two");
        for row in [0, MR + 3, rows - 1] {
            let one = product(&a[row * k..(row + 1) * k], 2);
            assert_eq!(one, all[row * cols..(row + 1) * cols], "row {row} alone");
        }
    }

    /// Every engine this CPU runs: `vdpbf16ps` where it has it, the emulated tiles, and its own
    /// tiles where it has AMX (each named as skipped where it is not).
    fn every_engine() -> Vec<Engine> {
        let mut engines = vec![Engine::EmulatedTiles];
        if has_dot_instructions() {
            engines.push(Engine::Pairs);
        } else {
            eprintln!("skipped on vdpbf16ps: the kernel level lacks it");
        }
        match amx::self_check() {
            Ok(()) => engines.push(Engine::Tiles),
            Err(why) => eprintln!("skipped on this CPU's tiles: {why}"),
        }
        engines
    }

    #[test]
    fn a_weight_packed_at_load_gives_the_bits_of_panels_packed_by_each_product() {
        for engine in every_engine() {
            // An odd `k`, several panels with a ragged last one, and `k` over two blocks.
            for (rows, cols, k) in [(9, 70, 33), (41, 33, 96), (35, 40, KC + 78)] {
                let a = bits(&values(rows * k, 3));
                let b = bits(&values(cols * k, 4));
                let packed = PackedWeight::for_engine(&b, k, engine);
                let sums = |weight: Weight<'_>, accumulate: bool| {
                    let mut out = vec![0.5f32; rows * (cols + 3)];
                    let out_target = Target::F32(Out {
                        ptr: out.as_mut_ptr(),
                        stride: cols + 3,
                    });
                    let a = Bf16View::dense(&a, rows, k);
                    let threads = Threads::Pool;
                    let packed = &mut Packed::default();
                    on_engine(engine, a, weight, out_target, accumulate, threads, packed);
                    out
                };
                let rows_of_b = Weight::Rows(Bf16View::dense(&b, cols, k));
                for accumulate in [false, true] {
                    let (each, once) = (
                        sums(rows_of_b, accumulate),
                        sums(Weight::Packed(&packed), accumulate),
                    );
                    assert!(
                        each.iter()
                            .zip(&once)
                            .all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{engine:?} {rows}x{cols}x{k}, accumulate {accumulate}"
                    );
                    assert_ne!(each[0], 0.5, "{engine:?}: the product ran");
                }
                if k <= KC {
                    let rounded = |weight: Weight<'_>| {
                        let mut out = vec![7u16; rows * cols];
                        let out_target = Target::Bits(OutBits {
                            ptr: out.as_mut_ptr(),
                            stride: cols,
                        });
                        let a = Bf16View::dense(&a, rows, k);
                        let packed = &mut Packed::default();
                        on_engine(engine, a, weight, out_target, false, Threads::Pool, packed);
                        out
                    };
                    assert_eq!(
                        rounded(rows_of_b),
                        rounded(Weight::Packed(&packed)),
                        "{engine:?} {rows}x{cols}x{k}, rounded"
                    );
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "a weight packed for")]
    fn a_weight_packed_for_one_engine_is_refused_by_another() {
        let (rows, cols, k) = (3, 5, 32);
        let (a, b) = (bits(&values(rows * k, 1)), bits(&values(cols * k, 2)));
        let packed = PackedWeight::for_engine(&b, k, Engine::EmulatedTiles);
        let mut out = vec![0.0f32; rows * cols];
        let out = Target::F32(Out {
            ptr: out.as_mut_ptr(),
            stride: cols,
        });
        let a = Bf16View::dense(&a, rows, k);
        let weight = Weight::Packed(&packed);
        on_engine(
            Engine::Pairs,
            a,
            weight,
            out,
            false,
            Threads::Pool,
            &mut Packed::default(),
        );
    }
}
