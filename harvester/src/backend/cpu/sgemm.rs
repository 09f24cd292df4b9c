//! The f32 product with a weight: `out[r, c] (+)= Σ_k a[r, k] · w[c, k]`, `w` a PyTorch
//! `[out, in]` matrix in whatever precision the checkpoint stores it.
//!
//! **One summation order.** Every output is one fused multiply-add chain over `k` in increasing
//! order, started from zero (or from `out` when accumulating). Blocks of `k` continue the chain
//! through `out`, which holds the partial sum exactly. No split of the rows, columns or threads
//! changes that order, so a prompt gives the same bits alone as in any batch, on any thread
//! count, and with the AVX-512, AVX2 or portable kernel alike. (A general GEMM such as the
//! `gemm` crate picks its blocking of `k` from the matrix shape, so a row's bits there depend on
//! the rows beside it.)
//!
//! **Packing converts.** Per block of [`KC`] columns of `k`, `w` is widened exactly to f32 as it
//! is packed into panels of `NR` rows (`[k][NR]`, what the register block reads), so a bf16 or
//! f16 weight is never widened whole: beside the weights a product holds `n × KC` packed values
//! and, per thread, one strip of rows of `a`. A bf16 weight and its f32 widening give the same
//! bits.
//!
//! Blocking: per block of `k`, every panel of `w` is packed once (in parallel) and shared. Tasks
//! of up to `STRIPS_PER_BLOCK × MR` rows then pack one strip of `MR` rows at a time (it stays in
//! L1) and sweep it across their share of the panels, which stream in from L2 or L3, writing the
//! output row by row in order.
#![allow(unsafe_code)]

use std::cell::RefCell;

use rayon::prelude::*;

pub use super::schedule::Threads;
use super::schedule::{Dst, Grid, Out, PANEL_CHUNK_BYTES, SERIAL_BELOW, with};
use super::views::MatRef;

/// Columns of `k` packed and summed per pass, at most (as even blocks: 576 runs as 3 × 192): a
/// strip of `a` is `KC × MR` values (6 KiB with AVX2) and stays in L1 beside the panel of `w`
/// streaming past it (16 KiB).
pub const KC: usize = 256;
/// The same for AVX-512: a strip of 12 rows is 24 KiB and stays in a 32 KiB L1 (Zen 4's;
/// Intel's since Ice Lake have 48) while the panels (64 KiB) stream from L2. Measured on a Zen 4
/// EPYC with `sgemm_bench`: 0.92-0.96× the `gemm` crate at 128, 1.00-1.03× at 512; 1024 (a
/// 48 KiB strip) lost a quarter on llama-8b's `k` of 4096.
const KC_AVX512: usize = 512;
/// Panels of `w` one packing task widens.
const PANELS_PER_PACK_TASK: usize = 4;
/// A matrix whose rows the product packs: `[rows, cols]`, read a row segment at a time.
pub trait WeightRows: Sync {
    /// Rows (output columns of the product).
    fn rows(&self) -> usize;
    /// Columns (the shared `k`).
    fn cols(&self) -> usize;
    /// Columns `[start, start + dst.len())` of row `row`, widened exactly to f32.
    fn widen_segment(&self, row: usize, start: usize, dst: &mut [f32]);

    /// Rows `[first_row, first_row + nr)`, columns `[k0, k0 + kc)`, as the panel the register
    /// block reads, `[kc][nr]`, zero past the last row. `rows` is scratch. A matrix whose
    /// columns lie in memory as rows overrides it with plain copies.
    fn pack_panel(
        &self,
        first_row: usize,
        (k0, kc): (usize, usize),
        nr: usize,
        panel: &mut [f32],
        rows: &mut Vec<f32>,
    ) {
        rows.resize(nr * kc, 0.0);
        for (j, row) in rows.chunks_exact_mut(kc).enumerate() {
            if first_row + j < self.rows() {
                self.widen_segment(first_row + j, k0, row);
            } else {
                row.fill(0.0);
            }
        }
        interleave(rows, panel, kc, nr);
    }
}

impl WeightRows for crate::model::Matrix {
    fn rows(&self) -> usize {
        self.rows()
    }

    fn cols(&self) -> usize {
        self.cols()
    }

    fn widen_segment(&self, row: usize, start: usize, dst: &mut [f32]) {
        self.decode_segment(row, start, dst);
    }
}

impl WeightRows for MatRef<'_> {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn widen_segment(&self, row: usize, start: usize, dst: &mut [f32]) {
        let from = row * self.row_stride + start;
        dst.copy_from_slice(&self.data[from..from + dst.len()]);
    }
}

/// The register-block kernel this CPU runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// 12 rows × 32 columns in zmm registers.
    Avx512,
    /// 6 rows × 16 columns in ymm registers.
    Avx2,
    /// Scalar `mul_add`, 4 rows × 8 columns: any CPU, the same bits.
    Portable,
}

impl Kernel {
    /// The fastest kernel this CPU has that passes [`agrees_with_portable`], chosen once. Each
    /// kernel is thereby checked on every machine where it is used (a CPU model none of ours
    /// has run, a toolchain that builds it differently), and a wrong one is passed over rather
    /// than trusted.
    pub fn detect() -> Self {
        static DETECTED: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
        *DETECTED.get_or_init(|| {
            first_agreeing(
                [Self::Avx512, Self::Avx2].into_iter().filter(|&k| runs(k)),
                agrees_with_portable,
            )
        })
    }

    /// The name benchmarks print.
    pub fn name(self) -> &'static str {
        match self {
            Self::Avx512 => "avx512 12x32",
            Self::Avx2 => "avx2 6x16",
            Self::Portable => "portable 4x8",
        }
    }

    /// Columns of `k` it sums per block, at most.
    fn kc(self) -> usize {
        if self == Self::Avx512 { KC_AVX512 } else { KC }
    }

    /// Rows and columns of its register block.
    fn block(self) -> (usize, usize) {
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => (x86::avx512::MR, x86::avx512::NR),
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => (x86::avx2::MR, x86::avx2::NR),
            _ => (portable::MR, portable::NR),
        }
    }
}

/// A task's buffers, grown once and reused by every product after.
#[derive(Default)]
struct TaskBuffers {
    /// One strip of rows of `a`: `[kc][MR]`.
    strip: Vec<f32>,
    /// One panel's rows as widened, `[NR][kc]`, before they are interleaved.
    rows: Vec<f32>,
}

thread_local! {
    /// Every panel of `w` for one block of `k`, `[panel][kc][NR]`: held by the thread that
    /// calls a product, read by its tasks.
    static PANELS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static TASK: RefCell<TaskBuffers> = RefCell::new(TaskBuffers::default());
}

/// Bytes of packing buffers a product with `n` output columns holds (for the memory check):
/// its panels of `w`, and each thread's rows of `a`.
pub fn working_bytes(n: usize, threads: usize) -> u64 {
    let kernel = Kernel::detect();
    let ((mr, nr), kc) = (kernel.block(), kernel.kc());
    let panels = n.next_multiple_of(nr) * kc;
    let per_thread = mr * kc + STRIP_SLACK + nr * kc;
    ((panels + threads * per_thread) * 4) as u64
}

/// `out[r, c] (+)= Σ_k a[r, k] · w[c, k]` on `kernel` (tests pin one; the engine passes
/// [`Kernel::detect`]). `out` has row stride `out_stride`; its first `w.rows()` columns of
/// `a.rows` rows are written.
///
/// # Panics
/// If a view does not fit its slice, the inner dimensions differ, or `kernel` is not one this
/// CPU runs: a bug in the caller.
pub fn product_on<W: WeightRows>(
    kernel: Kernel,
    a: MatRef<'_>,
    w: &W,
    out: &mut [f32],
    out_stride: usize,
    accumulate: bool,
) {
    product_threaded(kernel, a, w, (out, out_stride), accumulate, Threads::Pool);
}

/// [`product_on`], on the calling thread alone if `threads` says so.
pub fn product_threaded<W: WeightRows>(
    kernel: Kernel,
    a: MatRef<'_>,
    w: &W,
    (out, out_stride): (&mut [f32], usize),
    accumulate: bool,
    threads: Threads,
) {
    let (m, n, k) = (a.rows, w.rows(), a.cols);
    assert_eq!(
        k,
        w.cols(),
        "matmul inner dimensions differ. This is a bug."
    );
    assert!(
        m == 0 || k == 0 || (m - 1) * a.row_stride + k <= a.data.len(),
        "matmul operand view out of bounds. This is a bug."
    );
    assert!(
        m == 0 || n == 0 || (n <= out_stride && (m - 1) * out_stride + n <= out.len()),
        "matmul output view out of bounds. This is a bug."
    );
    assert!(
        runs(kernel),
        "the {} kernel does not run on this CPU. This is a bug.",
        kernel.name()
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            out.chunks_mut(out_stride)
                .take(m)
                .for_each(|row| row[..n].fill(0.0));
        }
        return;
    }
    let (mr, nr) = kernel.block();
    let panel_count = n.div_ceil(nr);
    let serial = threads == Threads::Caller || m * n * k < SERIAL_BELOW;
    let threads = if serial {
        1
    } else {
        rayon::current_num_threads()
    };
    let grid = Grid::new(m, panel_count, mr, threads);
    let most = kernel.kc();
    let kc_step = k.div_ceil(k.div_ceil(most));
    let out = Out {
        ptr: out.as_mut_ptr(),
        stride: out_stride,
    };
    with(&PANELS, |panels| {
        for k0 in (0..k).step_by(kc_step) {
            let kc = kc_step.min(k - k0);
            panels.resize(panel_count * kc * nr, 0.0);
            pack_all(w, panels, k0, kc, nr, serial);
            let block = Block {
                kernel,
                a,
                panels,
                n,
                k0,
                kc,
                // The chain continues from `out` after the first block of `k`.
                load: accumulate || k0 > 0,
            };
            block.run_all(grid, out, serial);
        }
    });
}

/// Packs every panel of `w` for columns `[k0, k0 + kc)` of `k` into `panels`, in parallel
/// unless `serial`.
fn pack_all<W: WeightRows>(
    w: &W,
    panels: &mut [f32],
    k0: usize,
    kc: usize,
    nr: usize,
    serial: bool,
) {
    let pack = |(task, chunk): (usize, &mut [f32])| {
        let first = task * PANELS_PER_PACK_TASK;
        with(&TASK, |own| {
            pack_panels(w, first, k0, kc, nr, chunk, &mut own.rows);
        });
    };
    let chunk = PANELS_PER_PACK_TASK * kc * nr;
    if serial {
        panels.chunks_mut(chunk).enumerate().for_each(pack);
    } else {
        panels.par_chunks_mut(chunk).enumerate().for_each(pack);
    }
}

/// [`product_on`] with the fastest kernel this CPU has.
pub fn product<W: WeightRows>(
    a: MatRef<'_>,
    w: &W,
    out: &mut [f32],
    out_stride: usize,
    accumulate: bool,
) {
    product_on(Kernel::detect(), a, w, out, out_stride, accumulate);
}

/// Whether this CPU has the instructions `kernel` needs.
pub fn runs(kernel: Kernel) -> bool {
    match kernel {
        Kernel::Portable => true,
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => super::level::Level::Avx2.enabled(),
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512 => super::level::Level::Avx512.enabled(),
        #[cfg(not(target_arch = "x86_64"))]
        _ => false,
    }
}

/// The first of `candidates` that passes `check`, else the portable kernel; each one that fails
/// is logged (this is where that error is handled).
fn first_agreeing(
    candidates: impl IntoIterator<Item = Kernel>,
    check: impl Fn(Kernel) -> bool,
) -> Kernel {
    for kernel in candidates {
        if check(kernel) {
            return kernel;
        }
        tracing::error!(
            kernel = kernel.name(),
            "weight-product kernel gave other bits than the portable kernel on its self-check; \
             passing over it (a bug: please report it with this CPU's flags)"
        );
    }
    Kernel::Portable
}

/// Whether `kernel` gives the portable kernel's bits on a ragged product that crosses blocks of
/// `k`, with and without accumulating: about 10⁶ multiply-adds, a millisecond.
pub fn agrees_with_portable(kernel: Kernel) -> bool {
    let (m, n, k) = (2 * 12 + 5, 2 * 32 + 7, 2 * kernel.kc() + 9);
    let fill = |len: usize, seed: usize| -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 7919 + seed * 104_729) % 2003) as f32 / 1001.0 - 1.0)
            .collect()
    };
    let (a, w) = (fill(m * k, 1), fill(n * k, 2));
    let (a, w) = (MatRef::dense(&a, m, k), MatRef::dense(&w, n, k));
    let start = fill(m * n, 3);
    let [mut ours, mut portable] = [start.clone(), start];
    [false, true].into_iter().all(|accumulate| {
        product_on(kernel, a, &w, &mut ours, n, accumulate);
        product_on(Kernel::Portable, a, &w, &mut portable, n, accumulate);
        ours.iter()
            .zip(&portable)
            .all(|(x, y)| x.to_bits() == y.to_bits())
    })
}

/// One block of `k` of a product, as its tasks share it.
struct Block<'a> {
    kernel: Kernel,
    a: MatRef<'a>,
    /// Every panel of `w` for this block of `k`.
    panels: &'a [f32],
    n: usize,
    k0: usize,
    kc: usize,
    load: bool,
}

impl Block<'_> {
    /// Every task of `grid`, in parallel unless `serial`.
    fn run_all(&self, grid: Grid, out: Out, serial: bool) {
        let (_, nr) = self.kernel.block();
        let panel_count = self.n.div_ceil(nr);
        let run = |task: usize| {
            let (rows, panels) = grid.task(task, self.a.rows, panel_count);
            with(&TASK, |own| self.run(rows, panels, out, &mut own.strip));
        };
        let tasks = grid.tasks();
        if serial {
            (0..tasks).for_each(run);
        } else {
            (0..tasks).into_par_iter().for_each(run);
        }
    }

    /// One task: its `panels` in chunks of [`PANEL_CHUNK_BYTES`], and for each chunk, each
    /// strip of `mr` of its `rows` of `a` packed, then swept across the chunk. The strip stays
    /// in L1 and the chunk in L2; sweeping panel by panel instead (the strip in L2) wrote the
    /// output a column of tiles at a time and measured 10-15% slower on an AVX2 EPYC. Every
    /// cell is still one register block's chain over this block of `k`: the order of the
    /// sweep changes no bits.
    fn run(
        &self,
        rows: std::ops::Range<usize>,
        panels: std::ops::Range<usize>,
        out: Out,
        strip: &mut Vec<f32>,
    ) {
        let (mr, nr) = self.kernel.block();
        let kc = self.kc;
        let chunk = (PANEL_CHUNK_BYTES / (kc * nr * size_of::<f32>())).max(1);
        for first in panels.clone().step_by(chunk) {
            let chunk = first..(first + chunk).min(panels.end);
            for r in rows.clone().step_by(mr) {
                let height = mr.min(rows.end - r);
                pack_strip(self.a, r, height, self.k0, kc, mr, strip);
                self.sweep(strip, (r, height), chunk.clone(), out);
            }
        }
    }

    /// Strip `strip` (rows `r..r + height` of `a`, packed) across `panels`.
    fn sweep(
        &self,
        strip: &[f32],
        (r, height): (usize, usize),
        panels: std::ops::Range<usize>,
        out: Out,
    ) {
        let (mr, nr) = self.kernel.block();
        let kc = self.kc;
        for p in panels {
            let c = p * nr;
            let shape = (height, nr.min(self.n - c));
            // SAFETY: row `r` < m and column `c` < n, inside `out` (checked against its
            // length in `product_on`).
            let dst = unsafe { out.block((r, c), shape, self.load) };
            let operands = Operands {
                strip: &strip[..kc * mr],
                panel: &self.panels[p * kc * nr..(p + 1) * kc * nr],
                kc,
            };
            // SAFETY: `dst` is `height × width` cells of this task's own rows and panels of
            // `out`, which no other task touches; the kernel runs on this CPU (checked in
            // `product_on`).
            unsafe { run_block(self.kernel, operands, dst) }
        }
    }
}

/// What one register block reads.
struct Operands<'a> {
    /// One packed strip of `a`, `[kc][MR]`.
    strip: &'a [f32],
    /// One packed panel of `w`, `[kc][NR]`.
    panel: &'a [f32],
    kc: usize,
}

/// Cells past a strip that the vector packing may scribble on: it stores whole vectors, and the
/// lanes past a strip's rows land where a later column is written after (or here, for the last).
const STRIP_SLACK: usize = 16;

/// Packs columns `[k0, k0 + kc)` of `height` rows of `a` from row `first` on into one strip of
/// `mr` rows, `[kc][mr]`, zero past the last row: 8 × 8 blocks in AVX registers where the CPU
/// has them, else one by one.
fn pack_strip(
    a: MatRef<'_>,
    first: usize,
    height: usize,
    k0: usize,
    kc: usize,
    mr: usize,
    strip: &mut Vec<f32>,
) {
    strip.resize(kc * mr + STRIP_SLACK, 0.0);
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if mr <= x86::STRIP_ROWS_MOST && super::level::Level::Avx2.enabled() {
        done = kc - kc % 8;
        let source = x86::StripSource {
            data: a.data,
            stride: a.row_stride,
            first,
            height,
            k0,
        };
        // SAFETY: the level (at most the CPU's) includes AVX2, so AVX; the function indexes
        // slices only.
        unsafe { x86::pack_strip_blocks(source, mr, done, strip) };
    }
    for i in (0..mr).filter(|_| done < kc) {
        let cells = strip[done * mr + i..kc * mr].iter_mut().step_by(mr);
        if i < height {
            let src = &a.data[(first + i) * a.row_stride + k0..][done..kc];
            cells.zip(src).for_each(|(cell, &v)| *cell = v);
        } else {
            cells.for_each(|cell| *cell = 0.0);
        }
    }
}

/// Packs columns `[k0, k0 + kc)` of `w`'s rows from panel `first` on into `dst` (whole panels
/// of `nr` rows, `[panel][kc][nr]`, zero past the last row), widening them through `rows`.
fn pack_panels<W: WeightRows>(
    w: &W,
    first: usize,
    k0: usize,
    kc: usize,
    nr: usize,
    dst: &mut [f32],
    rows: &mut Vec<f32>,
) {
    for (p, panel) in dst.chunks_exact_mut(kc * nr).enumerate() {
        w.pack_panel((first + p) * nr, (k0, kc), nr, panel, rows);
    }
}

/// `panel[i][j] = rows[j][i]` for `nr` rows of `kc`: 8 × 8 blocks in AVX registers where the
/// CPU has them (the packing of a product over few tokens is mostly this), else one by one.
fn interleave(rows: &[f32], panel: &mut [f32], kc: usize, nr: usize) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if nr.is_multiple_of(8) && super::level::Level::Avx2.enabled() {
        done = kc - kc % 8;
        // SAFETY: the level (at most the CPU's) includes AVX2, so AVX; the function indexes
        // slices only.
        unsafe { x86::transpose_blocks(rows, panel, kc, nr, done) };
    }
    for i in done..kc {
        for (j, cell) in panel[i * nr..(i + 1) * nr].iter_mut().enumerate() {
            *cell = rows[j * kc + i];
        }
    }
}

/// Runs the block on `kernel`, monomorphised on its height.
///
/// # Safety
/// `dst` must describe `height × width` writable cells that no other thread touches, and this
/// CPU must run `kernel`.
unsafe fn run_block(kernel: Kernel, operands: Operands<'_>, dst: Dst) {
    match kernel {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: passed on from the caller.
        Kernel::Avx512 => unsafe { x86::avx512::block(operands, dst) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: passed on from the caller.
        Kernel::Avx2 => unsafe { x86::avx2::block(operands, dst) },
        // SAFETY: passed on from the caller.
        _ => unsafe { portable::block(operands, dst) },
    }
}

/// Calls `$block::<H>` for the block's height `H` in `1..=MR`.
macro_rules! by_height {
    ($block:ident, $operands:ident, $dst:ident; $($h:literal)*) => {
        match $dst.height {
            $($h => $block::<$h>($operands, $dst),)*
            _ => unreachable!("block height beyond MR. This is a bug."),
        }
    };
}

/// The scalar kernel: the same chains as the SIMD ones, so the same bits, on any CPU.
mod portable {
    use super::{Dst, Operands};

    pub const MR: usize = 4;
    pub const NR: usize = 8;

    /// # Safety
    /// See [`super::run_block`].
    pub(super) unsafe fn block(operands: Operands<'_>, dst: Dst) {
        // SAFETY: passed on from the caller.
        unsafe { by_height!(rows, operands, dst; 1 2 3 4) }
    }

    /// # Safety
    /// See [`super::run_block`].
    unsafe fn rows<const H: usize>(operands: Operands<'_>, dst: Dst) {
        let Operands { strip, panel, kc } = operands;
        let mut acc = [[0.0f32; NR]; H];
        for (i, row) in acc.iter_mut().enumerate() {
            for (j, cell) in row.iter_mut().enumerate().take(dst.width) {
                if dst.load {
                    // SAFETY: (i, j) lies inside the caller's `height × width` cells.
                    *cell = unsafe { *dst.ptr.add(i * dst.stride + j) };
                }
            }
        }
        let strips = strip[..kc * MR].chunks_exact(MR);
        for (column, group) in strips.zip(panel[..kc * NR].chunks_exact(NR)) {
            for (i, row) in acc.iter_mut().enumerate() {
                let x = column[i];
                for (cell, &b) in row.iter_mut().zip(group) {
                    *cell = x.mul_add(b, *cell);
                }
            }
        }
        for (i, row) in acc.iter().enumerate() {
            for (j, &v) in row.iter().enumerate().take(dst.width) {
                // SAFETY: as above.
                unsafe { *dst.ptr.add(i * dst.stride + j) = v };
            }
        }
    }
}

/// The AVX2 and AVX-512 register blocks: one source, two vector widths.
#[cfg(target_arch = "x86_64")]
mod x86 {
    /// A register block of `MR` rows × two vectors of columns for one vector ISA.
    macro_rules! register_block {
        (
            $isa:ident, $features:literal, $vector:ty, $lanes:literal, $mr:literal,
            zero: $zero:ident, load: $load:ident, store: $store:ident, splat: $splat:ident,
            fma: $fma:ident, heights: [$($h:literal)*]
        ) => {
            pub mod $isa {
                use std::arch::x86_64::*;

                use crate::backend::cpu::schedule::Dst;
                use crate::backend::cpu::sgemm::Operands;

                /// Rows of a register block.
                pub const MR: usize = $mr;
                /// Columns of a register block: two vectors.
                pub const NR: usize = 2 * $lanes;
                const LANES: usize = $lanes;

                /// # Safety
                /// See `sgemm::run_block`; this CPU must have the ISA's features.
                pub(in crate::backend::cpu::sgemm) unsafe fn block(
                    operands: Operands<'_>,
                    dst: Dst,
                ) {
                    // SAFETY: passed on from the caller.
                    unsafe { by_height!(rows, operands, dst; $($h)*) }
                }

                /// # Safety
                /// As [`block`].
                #[target_feature(enable = $features)]
                unsafe fn rows<const H: usize>(operands: Operands<'_>, dst: Dst) {
                    let Operands { strip, panel, kc } = operands;
                    let strip = &strip[..kc * MR];
                    let panel = &panel[..kc * NR];
                    let mut acc: [[$vector; 2]; H] = [[$zero(); 2]; H];
                    if dst.load {
                        for (i, row) in acc.iter_mut().enumerate() {
                            // SAFETY: row i < height, and `load_row` reads `width` cells.
                            *row = unsafe { load_row(dst.ptr.add(i * dst.stride), dst.width) };
                        }
                    }
                    let (a_ptr, b_ptr) = (strip.as_ptr(), panel.as_ptr());
                    for p in 0..kc {
                        // SAFETY: p < kc, so `p * NR + NR <= panel.len()` and, for every row
                        // i < H <= MR, `p * MR + i < strip.len()` (both sliced above).
                        unsafe {
                            let b0 = $load(b_ptr.add(p * NR));
                            let b1 = $load(b_ptr.add(p * NR + LANES));
                            for (i, row) in acc.iter_mut().enumerate() {
                                let x = $splat(*a_ptr.add(p * MR + i));
                                row[0] = $fma(x, b0, row[0]);
                                row[1] = $fma(x, b1, row[1]);
                            }
                        }
                    }
                    for (i, row) in acc.iter().enumerate() {
                        // SAFETY: as for the load.
                        unsafe { store_row(dst.ptr.add(i * dst.stride), dst.width, row) };
                    }
                }

                /// Two vectors from `width` cells at `ptr` (zero past them).
                ///
                /// # Safety
                /// `ptr` must have `width` readable cells.
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn load_row(ptr: *const f32, width: usize) -> [$vector; 2] {
                    let mut lanes = [0.0f32; NR];
                    // SAFETY: `width <= NR` cells are readable at `ptr` (the caller's contract).
                    unsafe {
                        if width == NR {
                            return [$load(ptr), $load(ptr.add(LANES))];
                        }
                        std::ptr::copy_nonoverlapping(ptr, lanes.as_mut_ptr(), width);
                        [$load(lanes.as_ptr()), $load(lanes.as_ptr().add(LANES))]
                    }
                }

                /// Writes the first `width` lanes of `row` to `ptr`.
                ///
                /// # Safety
                /// `ptr` must have `width` writable cells.
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn store_row(ptr: *mut f32, width: usize, row: &[$vector; 2]) {
                    let mut lanes = [0.0f32; NR];
                    // SAFETY: `width <= NR` cells are writable at `ptr` (the caller's contract);
                    // `lanes` holds NR.
                    unsafe {
                        if width == NR {
                            $store(ptr, row[0]);
                            $store(ptr.add(LANES), row[1]);
                            return;
                        }
                        $store(lanes.as_mut_ptr(), row[0]);
                        $store(lanes.as_mut_ptr().add(LANES), row[1]);
                        std::ptr::copy_nonoverlapping(lanes.as_ptr(), ptr, width);
                    }
                }
            }
        };
    }

    use std::arch::x86_64::{
        __m256, _mm256_loadu_ps, _mm256_permute2f128_ps, _mm256_setzero_ps, _mm256_shuffle_ps,
        _mm256_storeu_ps, _mm256_unpackhi_ps, _mm256_unpacklo_ps,
    };

    /// The 8 columns of the 8 × 8 block whose rows are `r`: 24 shuffles.
    #[inline]
    #[target_feature(enable = "avx")]
    fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        [
            _mm256_permute2f128_ps::<0x20>(s0, s4),
            _mm256_permute2f128_ps::<0x20>(s1, s5),
            _mm256_permute2f128_ps::<0x20>(s2, s6),
            _mm256_permute2f128_ps::<0x20>(s3, s7),
            _mm256_permute2f128_ps::<0x31>(s0, s4),
            _mm256_permute2f128_ps::<0x31>(s1, s5),
            _mm256_permute2f128_ps::<0x31>(s2, s6),
            _mm256_permute2f128_ps::<0x31>(s3, s7),
        ]
    }

    /// Rows of `a` one strip reads: `height` rows from `first` on, columns from `k0` on.
    pub(super) struct StripSource<'a> {
        pub data: &'a [f32],
        pub stride: usize,
        pub first: usize,
        pub height: usize,
        pub k0: usize,
    }

    /// Most rows a strip packed by [`pack_strip_blocks`] may have: two groups of 8.
    pub(super) const STRIP_ROWS_MOST: usize = 16;

    /// `strip[p * mr + i] = a[first + i][k0 + p]` for `p < columns` (a multiple of 8) and
    /// `i < mr`, zero for rows past `height`, one 8 × 8 block per group of 8 rows. Each store is
    /// a whole vector, so up to 8 cells past a column's `mr` are written too; columns go in
    /// increasing order, so the next column (or the caller, for the last) writes them after.
    #[target_feature(enable = "avx")]
    pub(super) fn pack_strip_blocks(
        source: StripSource<'_>,
        mr: usize,
        columns: usize,
        strip: &mut [f32],
    ) {
        let groups = mr.div_ceil(8);
        assert!(
            (1..=STRIP_ROWS_MOST).contains(&mr)
                && columns.is_multiple_of(8)
                && source.height <= mr
                && (columns == 0 || strip.len() >= (columns - 1) * mr + groups * 8),
            "strip packing shapes. This is a bug."
        );
        for i in (0..columns).step_by(8) {
            let mut blocks = [[_mm256_setzero_ps(); 8]; 2];
            for (g, block) in blocks.iter_mut().enumerate().take(groups) {
                let r: [__m256; 8] = std::array::from_fn(|t| {
                    let row = g * 8 + t;
                    if row >= source.height {
                        return _mm256_setzero_ps();
                    }
                    let start = (source.first + row) * source.stride + source.k0 + i;
                    let cells = &source.data[start..][..8];
                    // SAFETY: `cells` holds 8 f32, one 256-bit load.
                    unsafe { _mm256_loadu_ps(cells.as_ptr()) }
                });
                *block = transpose8(r);
            }
            for c in 0..8 {
                for (g, block) in blocks.iter().enumerate().take(groups) {
                    let cells = &mut strip[(i + c) * mr + g * 8..][..8];
                    // SAFETY: `cells` holds 8 f32, one 256-bit store.
                    unsafe { _mm256_storeu_ps(cells.as_mut_ptr(), block[c]) };
                }
            }
        }
    }

    /// `panel[i][j] = rows[j][i]` for `i < columns` (a multiple of 8) and every `j < nr` (a
    /// multiple of 8), one 8 × 8 block at a time: 8 loads, 24 shuffles, 8 stores.
    #[target_feature(enable = "avx")]
    pub(super) fn transpose_blocks(
        rows: &[f32],
        panel: &mut [f32],
        kc: usize,
        nr: usize,
        columns: usize,
    ) {
        assert!(
            nr.is_multiple_of(8)
                && columns.is_multiple_of(8)
                && columns <= kc
                && rows.len() >= nr * kc
                && panel.len() >= kc * nr,
            "transpose shapes. This is a bug."
        );
        for j in (0..nr).step_by(8) {
            for i in (0..columns).step_by(8) {
                let r: [__m256; 8] = std::array::from_fn(|t| {
                    let row = &rows[(j + t) * kc + i..][..8];
                    // SAFETY: `row` holds 8 f32, one 256-bit load.
                    unsafe { _mm256_loadu_ps(row.as_ptr()) }
                });
                let columns = transpose8(r);
                for (c, column) in columns.into_iter().enumerate() {
                    let cells = &mut panel[(i + c) * nr + j..][..8];
                    // SAFETY: `cells` holds 8 f32, one 256-bit store.
                    unsafe { _mm256_storeu_ps(cells.as_mut_ptr(), column) };
                }
            }
        }
    }

    register_block!(
        avx2, "avx2,fma", __m256, 8, 6,
        zero: _mm256_setzero_ps, load: _mm256_loadu_ps, store: _mm256_storeu_ps,
        splat: _mm256_set1_ps, fma: _mm256_fmadd_ps, heights: [1 2 3 4 5 6]
    );
    register_block!(
        avx512, "avx512f", __m512, 16, 12,
        zero: _mm512_setzero_ps, load: _mm512_loadu_ps, store: _mm512_storeu_ps,
        splat: _mm512_set1_ps, fma: _mm512_fmadd_ps, heights: [1 2 3 4 5 6 7 8 9 10 11 12]
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel this CPU runs.
    fn kernels() -> Vec<Kernel> {
        [Kernel::Portable, Kernel::Avx2, Kernel::Avx512]
            .into_iter()
            .filter(|&k| runs(k))
            .collect()
    }

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i * 7919 + seed * 104_729) % 2003) as f32 - 1001.0) / 317.0)
            .collect()
    }

    /// The defining chain: `fma` over `k` in order from `start`.
    fn chain(a: &[f32], b: &[f32], start: f32) -> f32 {
        a.iter()
            .zip(b)
            .fold(start, |acc, (&x, &y)| x.mul_add(y, acc))
    }

    #[test]
    fn every_kernel_gives_the_bits_of_one_fused_chain_per_output_for_ragged_shapes() {
        for kernel in kernels() {
            for (m, n, k) in [
                (1, 1, 1),
                (5, 7, 33),
                (13, 40, 300),
                (37, 33, 257),
                (70, 300, 31),
                (3, 17, 600),
            ] {
                let (a, b) = (values(m * k, 1), values(n * k, 2));
                let stride = n + 3;
                let mut out = values(m * stride, 3);
                let before = out.clone();
                let w = MatRef::dense(&b, n, k);
                product_on(kernel, MatRef::dense(&a, m, k), &w, &mut out, stride, true);
                for r in 0..m {
                    for c in 0..n {
                        let want = chain(
                            &a[r * k..(r + 1) * k],
                            &b[c * k..(c + 1) * k],
                            before[r * stride + c],
                        );
                        assert_eq!(
                            out[r * stride + c].to_bits(),
                            want.to_bits(),
                            "{} {m}x{n}x{k} [{r},{c}]",
                            kernel.name()
                        );
                    }
                    assert_eq!(
                        out[r * stride + n..(r + 1) * stride],
                        before[r * stride + n..(r + 1) * stride],
                        "columns past n are untouched"
                    );
                }
                product_on(kernel, MatRef::dense(&a, m, k), &w, &mut out, stride, false);
                let want = chain(&a[(m - 1) * k..], &b[(n - 1) * k..], 0.0);
                assert_eq!(out[(m - 1) * stride + n - 1].to_bits(), want.to_bits());
            }
        }
    }

    #[test]
    fn a_task_whose_panels_span_several_chunks_keeps_one_fused_chain_per_output() {
        for kernel in kernels() {
            let ((mr, nr), (m, n, k)) = (kernel.block(), (3, 8500usize, 1024usize));
            let kc = k.div_ceil(k.div_ceil(kernel.kc()));
            let grid = Grid::new(m, n.div_ceil(nr), mr, 1);
            let (_, first_task) = grid.task(0, m, n.div_ceil(nr));
            let chunk = PANEL_CHUNK_BYTES / (kc * nr * size_of::<f32>());
            assert!(first_task.len() > chunk, "{} panels", first_task.len());
            let (a, b) = (values(m * k, 4), values(n * k, 5));
            let mut out = vec![f32::NAN; m * n];
            let w = MatRef::dense(&b, n, k);
            let a = MatRef::dense(&a, m, k);
            product_threaded(kernel, a, &w, (&mut out, n), false, Threads::Caller);
            for (cell, got) in out.iter().enumerate() {
                let (r, c) = (cell / n, cell % n);
                let want = chain(&a.data[r * k..(r + 1) * k], &b[c * k..(c + 1) * k], 0.0);
                assert_eq!(got.to_bits(), want.to_bits(), "{} [{r},{c}]", kernel.name());
            }
        }
    }

    #[test]
    fn a_row_gives_the_same_bits_alone_as_in_any_batch_on_any_thread_count() {
        let (n, k) = (300, 700);
        let a = values(200 * k, 4);
        let b = values(n * k, 5);
        let w = MatRef::dense(&b, n, k);
        let run = |rows: std::ops::Range<usize>, threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut out = vec![0.0; rows.len() * n];
            let a = MatRef::dense(&a[rows.start * k..rows.end * k], rows.len(), k);
            pool.install(|| product(a, &w, &mut out, n, false));
            out
        };
        let all = run(0..200, 3);
        assert_eq!(run(0..200, 1), all);
        assert_eq!(run(117..118, 2), all[117 * n..118 * n]);
        assert_eq!(run(50..61, 4), all[50 * n..61 * n]);
    }

    #[test]
    fn packing_interleaves_rows_into_panels_whatever_the_width() {
        for (nr, kc) in [(8, 8), (16, 19), (32, 256), (16, 3)] {
            let rows = values(nr * kc, 8);
            let mut panel = vec![0.0; kc * nr];
            interleave(&rows, &mut panel, kc, nr);
            for i in 0..kc {
                for j in 0..nr {
                    assert_eq!(panel[i * nr + j], rows[j * kc + i], "{nr}x{kc} [{i},{j}]");
                }
            }
        }
    }

    #[test]
    fn every_kernel_this_cpu_runs_passes_the_self_check_and_detection_picks_the_widest() {
        for kernel in kernels() {
            assert!(agrees_with_portable(kernel), "{}", kernel.name());
        }
        let widest = [Kernel::Avx512, Kernel::Avx2, Kernel::Portable]
            .into_iter()
            .find(|&k| runs(k));
        assert_eq!(Some(Kernel::detect()), widest);
    }

    #[test]
    fn a_kernel_that_fails_its_self_check_is_passed_over() {
        let all = [Kernel::Avx512, Kernel::Avx2];
        assert_eq!(first_agreeing(all, |k| k != Kernel::Avx512), Kernel::Avx2);
        assert_eq!(first_agreeing(all, |_| false), Kernel::Portable);
        assert_eq!(first_agreeing(all, |_| true), Kernel::Avx512);
    }

    #[test]
    fn packing_lays_rows_of_a_into_a_strip_with_zeros_past_the_last_row() {
        let (m, k, stride) = (29, 37, 41);
        let data = values(m * stride, 9);
        let a = MatRef {
            data: &data,
            rows: m,
            cols: k,
            row_stride: stride,
        };
        // A poisoned buffer: every cell must be written.
        let mut strip = vec![f32::NAN; 4];
        for mr in [4, 6, 12] {
            for (first, height, k0, kc) in
                [(0, 4, 0, 37), (3, 6, 5, 16), (8, 1, 1, 24), (17, 12, 2, 7)]
            {
                let height = height.min(mr);
                strip.fill(f32::NAN);
                pack_strip(a, first, height, k0, kc, mr, &mut strip);
                for p in 0..kc {
                    for i in 0..mr {
                        let want = if i < height {
                            data[(first + i) * stride + k0 + p]
                        } else {
                            0.0
                        };
                        let got = strip[p * mr + i];
                        assert_eq!(got.to_bits(), want.to_bits(), "mr {mr} row {i} col {p}");
                    }
                }
            }
        }
    }

    #[test]
    fn an_empty_inner_dimension_writes_zeros_or_leaves_the_sums() {
        let mut out = vec![5.0; 6];
        let w = MatRef::dense(&[], 3, 0);
        product(MatRef::dense(&[], 2, 0), &w, &mut out, 3, true);
        assert_eq!(out, [5.0; 6]);
        product(MatRef::dense(&[], 2, 0), &w, &mut out, 3, false);
        assert_eq!(out, [0.0; 6]);
    }
}
