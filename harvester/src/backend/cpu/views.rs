//! Matrix views: the leaf types the products, their kernels and the bf16 path all read, kept
//! below them so that none of those imports another through them.

/// A row-major matrix view with an arbitrary row stride (unit column stride).
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a> {
    /// The elements; row `r` starts at `r * row_stride`.
    pub data: &'a [f32],
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// Distance between row starts.
    pub row_stride: usize,
}

impl<'a> MatRef<'a> {
    /// A dense `[rows, cols]` matrix.
    pub fn dense(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self {
            data,
            rows,
            cols,
            row_stride: cols,
        }
    }

    pub(super) fn fits(&self) -> bool {
        self.rows == 0
            || self.cols == 0
            || (self.rows - 1) * self.row_stride + self.cols <= self.data.len()
    }
}

/// Whether `rows × cols` outputs with rows `out_stride` apart lie inside `len` values.
pub(super) fn output_fits(len: usize, (rows, cols): (usize, usize), out_stride: usize) -> bool {
    cols <= out_stride && (rows == 0 || (rows - 1) * out_stride + cols <= len)
}
