//! How a product on the CPU is cut and run, whatever its element type: tasks of row blocks ×
//! runs of panels (`Grid`), where each task writes (`Out`, `Dst`), whether it runs on the pool
//! (`Threads`), and each thread's reusable buffers (`with`). The f32 product (`sgemm`) and the
//! bf16 product (`bf16`) both build on it.
#![allow(unsafe_code)]

use std::cell::RefCell;

/// Strips of `MR` rows of `a` per task (96 rows with AVX2, 192 with AVX-512): several tasks per
/// thread at a thousand tokens, few enough that each sweeps the panels many times.
pub(super) const STRIPS_PER_BLOCK: usize = 16;
/// Bytes of panels a task's strips sweep before moving on to the next panels: they stay in the
/// caches while every strip of the task passes over them. A task that swept all its panels
/// with each strip read them from memory once a strip where they outgrow the caches:
/// llama-8b's gate and up, 28,672 columns, are 58.7 MB of panels per block of `k` (the f32
/// product 0.65-0.78× the `gemm` crate on a Zen 4 EPYC with `sgemm_bench`, 1.01× at 2 MiB). 512 KiB, re-reading
/// each task's rows of `a` once a chunk, lost 5-10% on the other shapes; 16 MiB did not help.
pub(super) const PANEL_CHUNK_BYTES: usize = 2 << 20;
/// Tasks per thread to aim for, so that uneven tasks still balance.
const TASKS_PER_THREAD: usize = 4;
/// Multiply-adds below which a product runs on the calling thread alone: waking the pool
/// costs more than it saves.
pub(super) const SERIAL_BELOW: usize = 1 << 22;

/// Where a product runs its tasks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Threads {
    /// On the rayon pool when the product is big enough to repay waking it.
    Pool,
    /// On the calling thread: the caller is already one of many parallel tasks.
    Caller,
}

/// Runs `f` on this thread's `buffers`, or on fresh ones if they are in use further up this
/// thread's stack (a thread that waits on rayon may run another product's work meanwhile).
pub(super) fn with<T: Default + 'static, R>(
    buffers: &'static std::thread::LocalKey<RefCell<T>>,
    f: impl FnOnce(&mut T) -> R,
) -> R {
    buffers.with(|cell| match cell.try_borrow_mut() {
        Ok(mut held) => f(&mut held),
        Err(_) => f(&mut T::default()),
    })
}

/// The output as the tasks share it: each task writes only its own rows × columns.
#[derive(Clone, Copy)]
pub(super) struct Out {
    pub(super) ptr: *mut f32,
    pub(super) stride: usize,
}

// SAFETY: `product_on` hands each task a disjoint block of rows × columns of `out`, and nothing
// else reads or writes `out` while the tasks run (it is borrowed mutably for the whole call).
unsafe impl Send for Out {}
// SAFETY: as above.
unsafe impl Sync for Out {}

impl Out {
    /// The `height × width` cells of the register block whose first cell is row `r`, column
    /// `c`; `load` starts its sums from them.
    ///
    /// # Safety
    /// Row `r` and column `c` must lie inside the output this was made from.
    pub(super) unsafe fn block(
        self,
        (r, c): (usize, usize),
        (height, width): (usize, usize),
        load: bool,
    ) -> Dst {
        Dst {
            // SAFETY: (r, c) lies inside the output (the caller's contract).
            ptr: unsafe { self.ptr.add(r * self.stride + c) },
            stride: self.stride,
            height,
            width,
            load,
        }
    }
}

/// How a product is cut into tasks: blocks of rows × runs of panels.
#[derive(Debug, Clone, Copy)]
pub(super) struct Grid {
    rows_per_block: usize,
    row_blocks: usize,
    panels_per_block: usize,
    column_blocks: usize,
}

impl Grid {
    /// Task `task`'s rows of `a` and panels of `w`.
    pub(super) fn task(
        &self,
        task: usize,
        m: usize,
        panel_count: usize,
    ) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        let (rows, panels) = (task / self.column_blocks, task % self.column_blocks);
        let first_row = rows * self.rows_per_block;
        let first_panel = panels * self.panels_per_block;
        (
            first_row..(first_row + self.rows_per_block).min(m),
            first_panel..(first_panel + self.panels_per_block).min(panel_count),
        )
    }

    /// How many tasks there are.
    pub(super) fn tasks(&self) -> usize {
        self.row_blocks * self.column_blocks
    }

    /// Row blocks of `STRIPS_PER_BLOCK × mr`, and the panels split further only when there are
    /// too few row blocks to keep every thread busy (few tokens).
    pub(super) fn new(m: usize, panel_count: usize, mr: usize, threads: usize) -> Self {
        let rows_per_block = STRIPS_PER_BLOCK * mr;
        let row_blocks = m.div_ceil(rows_per_block);
        let wanted = (TASKS_PER_THREAD * threads).div_ceil(row_blocks);
        let panels_per_block = panel_count.div_ceil(wanted.clamp(1, panel_count));
        Self {
            rows_per_block,
            row_blocks,
            panels_per_block,
            column_blocks: panel_count.div_ceil(panels_per_block),
        }
    }
}

/// Where one register block's sums go.
pub(super) struct Dst {
    pub(super) ptr: *mut f32,
    pub(super) stride: usize,
    /// Rows that exist (at most MR).
    pub(super) height: usize,
    /// Columns that exist (at most NR).
    pub(super) width: usize,
    /// Start each chain from the cell's value rather than zero.
    pub(super) load: bool,
}
