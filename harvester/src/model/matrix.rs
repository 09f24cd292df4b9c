//! A weight matrix as the checkpoint stores it. An f32 checkpoint is decoded into memory; a bf16
//! or f16 one stays in the mapped file, in half the bytes, and is widened to f32 (exactly) by
//! whoever computes with it, as it is used. So an 8B model in bf16 is resident in 16 GB, not 32,
//! and only the pages of the blocks a plan keeps are ever read.
//!
//! A matrix may span several row blocks of the file (Q|K|V and gate|up are fused by listing their
//! tensors in order), so no fused copy is ever made.

use std::sync::Arc;

use half::f16;
use memmap2::Mmap;

/// A half-precision storage format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Half {
    /// bfloat16.
    Bf16,
    /// IEEE binary16.
    F16,
}

impl Half {
    /// The safetensors name of the format.
    pub fn name(self) -> &'static str {
        match self {
            Self::Bf16 => "bfloat16",
            Self::F16 => "float16",
        }
    }
}

/// A file mapped read-only and shared: the one kind of mapping a [`Matrix`] reads, which is
/// what makes handing its pages back ([`Matrix::release_pages`]) safe.
#[derive(Debug)]
pub(crate) struct FileMap(Mmap);

impl FileMap {
    /// Maps `file` read-only (`MAP_SHARED`: its pages are the file's own, in the page cache).
    pub(crate) fn open(file: &std::fs::File) -> std::io::Result<Self> {
        // SAFETY: the mapping is read-only. Like every loader of memory-mapped weights we rely
        // on nobody truncating or rewriting the file while it is loaded; the bounds of every
        // read are checked against its header by the caller.
        #[allow(unsafe_code)]
        let map = unsafe { Mmap::map(file) }?;
        Ok(Self(map))
    }
}

impl std::ops::Deref for FileMap {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

/// Rows `[first, first + rows)` of a matrix that live contiguously in one mapped file.
#[derive(Debug, Clone)]
struct Part {
    map: Arc<FileMap>,
    /// Byte offset of the part's first element in the mapping.
    offset: usize,
    rows: usize,
}

#[derive(Debug, Clone)]
enum Data {
    F32(Vec<f32>),
    Mapped { format: Half, parts: Vec<Part> },
}

/// A row-major `[rows, cols]` weight matrix.
#[derive(Debug, Clone)]
pub struct Matrix {
    rows: usize,
    cols: usize,
    data: Data,
}

impl Matrix {
    /// A matrix decoded to f32 (`values.len()` must be `rows * cols`).
    ///
    /// # Panics
    /// If the length is wrong: a bug in the caller.
    pub fn from_f32(rows: usize, cols: usize, values: Vec<f32>) -> Self {
        assert_eq!(values.len(), rows * cols, "matrix size. This is a bug.");
        Self {
            rows,
            cols,
            data: Data::F32(values),
        }
    }

    /// An empty half-precision matrix of `cols` columns, to which row blocks are appended.
    pub(crate) fn mapped(format: Half, cols: usize) -> Self {
        Self {
            rows: 0,
            cols,
            data: Data::Mapped {
                format,
                parts: Vec::new(),
            },
        }
    }

    /// Appends `rows` rows stored at byte `offset` of `map` (the caller has checked that
    /// `rows * cols` elements of this matrix's format fit there).
    pub(crate) fn push_rows(&mut self, map: &Arc<FileMap>, offset: usize, rows: usize) {
        if let Data::Mapped { parts, .. } = &mut self.data {
            parts.push(Part {
                map: Arc::clone(map),
                offset,
                rows,
            });
            self.rows += rows;
        }
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes it takes in memory (decoded, or mapped).
    pub fn resident_bytes(&self) -> u64 {
        let width = match self.data {
            Data::F32(_) => 4,
            Data::Mapped { .. } => 2,
        };
        (self.len() * width) as u64
    }

    /// The values, when they are held as f32.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match &self.data {
            Data::F32(values) => Some(values),
            Data::Mapped { .. } => None,
        }
    }

    /// The storage format, when it is half precision.
    pub fn half(&self) -> Option<Half> {
        match &self.data {
            Data::F32(_) => None,
            Data::Mapped { format, .. } => Some(*format),
        }
    }

    /// The little-endian half-precision bytes of each row block in order, when mapped (what a
    /// device upload copies, with no f32 round trip).
    pub fn half_bytes(&self) -> Vec<&[u8]> {
        match &self.data {
            Data::F32(_) => Vec::new(),
            Data::Mapped { parts, .. } => parts
                .iter()
                .map(|p| &p.map[p.offset..p.offset + p.rows * self.cols * 2])
                .collect(),
        }
    }

    /// Rows `[first, first + dst.len() / cols)` as f32, into `dst`. Exact: bf16 and f16 widen to
    /// f32 without rounding.
    ///
    /// # Panics
    /// If the rows are out of range or `dst` is not a whole number of rows: a bug in the caller.
    pub fn decode_rows(&self, first: usize, dst: &mut [f32]) {
        let cols = self.cols;
        assert!(
            cols > 0 && dst.len().is_multiple_of(cols) && first + dst.len() / cols <= self.rows,
            "matrix rows out of range. This is a bug."
        );
        match &self.data {
            Data::F32(values) => {
                dst.copy_from_slice(&values[first * cols..first * cols + dst.len()]);
            }
            Data::Mapped { format, parts } => {
                let (mut row, mut done) = (first, 0);
                let mut part_start = 0;
                for part in parts {
                    let part_end = part_start + part.rows;
                    if row < part_end && done < dst.len() {
                        let take = (part_end - row).min((dst.len() - done) / cols);
                        let from = part.offset + (row - part_start) * cols * 2;
                        let bytes = &part.map[from..from + take * cols * 2];
                        widen(*format, bytes, &mut dst[done..done + take * cols]);
                        row += take;
                        done += take * cols;
                    }
                    part_start = part_end;
                }
            }
        }
    }

    /// Columns `[start, start + dst.len())` of row `row`, widened exactly to f32 into `dst`: what
    /// a matrix product packs, a block of columns at a time.
    ///
    /// # Panics
    /// If the segment is out of range: a bug in the caller.
    pub fn decode_segment(&self, row: usize, start: usize, dst: &mut [f32]) {
        let cols = self.cols;
        assert!(
            row < self.rows && start + dst.len() <= cols,
            "matrix segment out of range. This is a bug."
        );
        match &self.data {
            Data::F32(values) => {
                let from = row * cols + start;
                dst.copy_from_slice(&values[from..from + dst.len()]);
            }
            Data::Mapped { format, parts } => {
                let mut first = 0;
                for part in parts {
                    if row < first + part.rows {
                        let from = part.offset + ((row - first) * cols + start) * 2;
                        widen(*format, &part.map[from..from + dst.len() * 2], dst);
                        return;
                    }
                    first += part.rows;
                }
            }
        }
    }

    /// Reads one byte of every page of a mapped matrix, so its pages are resident (what a
    /// benchmark's load time must include; a run lets its first pass fault them in).
    pub fn touch(&self) -> u8 {
        let Data::Mapped { parts, .. } = &self.data else {
            return 0;
        };
        let mut sum = 0u8;
        for part in parts {
            let bytes = &part.map[part.offset..part.offset + part.rows * self.cols * 2];
            for page in bytes.iter().step_by(4096) {
                sum = sum.wrapping_add(*page);
            }
        }
        std::hint::black_box(sum)
    }

    /// Hands a mapped matrix's resident pages back to the OS (`MADV_DONTNEED`), for a matrix
    /// whose values now live in another form (the CPU's packed bf16 panels), so the weight is
    /// held once. Its bytes stay readable: a later read faults them in again from the file.
    /// Advice only: where the OS declines it, the pages just stay.
    pub fn release_pages(&self) {
        let Data::Mapped { parts, .. } = &self.data else {
            return;
        };
        for part in parts {
            let len = part.rows * self.cols * 2;
            // SAFETY: `part.map` is a read-only shared mapping of a file (`FileMap`). For such
            // a mapping MADV_DONTNEED only drops this process's page-table entries: every later
            // read faults in the file's same bytes, so no borrow of the mapping sees a change
            // (it would zero an anonymous or private mapping's pages; a `FileMap` is neither).
            #[allow(unsafe_code)]
            let _ = unsafe {
                let advice = memmap2::UncheckedAdvice::DontNeed;
                part.map.0.unchecked_advise_range(advice, part.offset, len)
            };
        }
    }

    /// Every value as f32 (tests and tools; the forward pass decodes blocks of rows instead).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len()];
        if !out.is_empty() {
            self.decode_rows(0, &mut out);
        }
        out
    }
}

/// Widens little-endian half-precision `bytes` into `dst` (one value per two bytes).
fn widen(format: Half, bytes: &[u8], dst: &mut [f32]) {
    let pairs = bytes.chunks_exact(2).zip(dst.iter_mut());
    match format {
        // bf16 is the top half of an f32: a shift, which the compiler vectorises.
        Half::Bf16 => pairs.for_each(|(b, d)| {
            *d = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
        }),
        Half::F16 => pairs.for_each(|(b, d)| {
            *d = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `bytes` in a file of their own, mapped as a checkpoint is.
    fn mapped(bytes: &[u8]) -> Arc<FileMap> {
        let mut file = tempfile::tempfile().unwrap();
        std::io::Write::write_all(&mut file, bytes).unwrap();
        Arc::new(FileMap::open(&file).unwrap())
    }

    #[test]
    fn rows_decode_across_fused_parts_exactly_as_the_whole_would() {
        let values: Vec<f32> = (0..24).map(|i| i as f32 * 0.5 - 3.0).collect();
        let bytes = crate::dtype::to_bf16_bytes(&values);
        let map = mapped(&bytes);
        // Rows 0-1 from the front of the file, rows 2-5 from further on: 6 rows of 4.
        let mut m = Matrix::mapped(Half::Bf16, 4);
        m.push_rows(&map, 0, 2);
        m.push_rows(&map, 8 * 2, 4);
        assert_eq!((m.rows(), m.cols(), m.resident_bytes()), (6, 4, 48));
        assert_eq!(m.to_f32_vec(), values);
        let mut three = vec![0.0; 12];
        m.decode_rows(1, &mut three);
        assert_eq!(three, values[4..16]);
        assert_eq!(m.half_bytes().concat(), bytes);
    }

    #[test]
    fn f16_widens_exactly() {
        let values = [1.0f32, -0.5, 65504.0, 0.000_061_035_156];
        let bytes: Vec<u8> = values
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_bits().to_le_bytes())
            .collect();
        let mut m = Matrix::mapped(Half::F16, 2);
        m.push_rows(&mapped(&bytes), 0, 2);
        assert_eq!(m.to_f32_vec(), values);
    }

    /// KiB of `map` resident in this process, from its line in `/proc/self/smaps`.
    #[cfg(target_os = "linux")]
    fn resident_kib(map: &FileMap) -> u64 {
        let address = map.as_ptr() as usize;
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            let range = line
                .split_whitespace()
                .next()
                .and_then(|r| r.split_once('-'));
            let bounds = range.and_then(|(from, to)| {
                let parse = |h| usize::from_str_radix(h, 16).ok();
                parse(from).zip(parse(to))
            });
            if let Some((from, to)) = bounds.filter(|_| !line.ends_with(':')) {
                inside = (from..to).contains(&address);
            } else if let (true, Some(kib)) = (inside, line.strip_prefix("Rss:")) {
                return kib.trim().trim_end_matches(" kB").parse().unwrap();
            }
        }
        panic!("the mapping at {address:#x} is not in /proc/self/smaps");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn released_pages_leave_the_process_and_read_back_as_the_same_values() {
        let (rows, cols) = (512, 2048); // 2 MiB of bf16
        let values: Vec<f32> = (0..rows * cols).map(|i| (i % 251) as f32 - 125.0).collect();
        let map = mapped(&crate::dtype::to_bf16_bytes(&values));
        let mut m = Matrix::mapped(Half::Bf16, cols);
        m.push_rows(&map, 0, rows);
        m.touch();
        let touched = resident_kib(&map);
        assert!(touched >= 2048, "touched: {touched} KiB resident");
        m.release_pages();
        let released = resident_kib(&map);
        assert!(released < 64, "released: {released} KiB still resident");
        assert_eq!(m.to_f32_vec(), values, "the bytes read back from the file");
    }
}
