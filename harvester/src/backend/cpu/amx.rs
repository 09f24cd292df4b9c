//! Intel AMX tiles for the bf16 product: `tdpbf16ps` sums 16 pairs of `k` for a 16 × 16 block
//! of `out` in one instruction, where `vdpbf16ps` sums one pair for 16 cells.
//!
//! [`block`] runs a 32 × 32 block of `out` (four C tiles) over whole steps of 16 pairs, from
//! `a` packed 32 rows at a time and `b`'s panels as the `vdpbf16ps` kernel packs them
//! (`[pairs][PANEL]` pairs of bf16 in one `u32`, which is the layout a B tile reads). It is
//! written once against [`Tiles`], which [`Hardware`] runs with the instructions and
//! [`Emulated`] runs in plain Rust, to Intel's definition of each instruction (the shapes in
//! the tile configuration, zeroing past them, DAZ inputs, FTZ, round to nearest even). Every
//! CPU's tests run the kernel on the emulator; an AMX CPU's also on the tiles, against it.
//!
//! Linux hands a process the tiles' 8 KiB of register state only when asked
//! ([`request_permission`], once, before the first tile instruction); the level check asks.
#![allow(unsafe_code)]

/// Rows of one tile.
pub const TILE_ROWS: usize = 16;
/// Bytes of one tile row: 32 bf16, or 16 f32.
pub const TILE_ROW_BYTES: usize = 64;
/// Pairs of `k` one `tdpbf16ps` sums: a row of an A tile, the rows of a B tile.
pub const STEP_PAIRS: usize = 16;
/// Rows of `a` in one block: two A tiles.
pub const ROWS: usize = 2 * TILE_ROWS;
/// Columns of `out` in one block: two B tiles, one panel.
pub const COLS: usize = 32;

/// A tile register, as [`block`] uses them: four C tiles of sums, two A tiles (rows 0-15 and
/// 16-31 of `a`), two B tiles (columns 0-15 and 16-31 of the panel).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tile {
    C00 = 0,
    C01 = 1,
    C10 = 2,
    C11 = 3,
    A0 = 4,
    A1 = 5,
    B0 = 6,
    B1 = 7,
}

/// One `tdpbf16ps` of [`block`]: which C tile takes which A tile against which B tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dot {
    /// C00 += A0 · B0
    Top0,
    /// C01 += A0 · B1
    Top1,
    /// C10 += A1 · B0
    Bottom0,
    /// C11 += A1 · B1
    Bottom1,
}

impl Dot {
    /// The four, in the order [`block`] issues them.
    pub const ALL: [Self; 4] = [Self::Top0, Self::Top1, Self::Bottom0, Self::Bottom1];

    /// Its C, A and B tiles.
    pub fn tiles(self) -> (Tile, Tile, Tile) {
        match self {
            Self::Top0 => (Tile::C00, Tile::A0, Tile::B0),
            Self::Top1 => (Tile::C01, Tile::A0, Tile::B1),
            Self::Bottom0 => (Tile::C10, Tile::A1, Tile::B0),
            Self::Bottom1 => (Tile::C11, Tile::A1, Tile::B1),
        }
    }
}

/// The 64 bytes `ldtilecfg` reads (palette 1): byte 0 the palette, bytes 16 + 2t the bytes per
/// row of tile `t`, byte 48 + t its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C, align(64))]
pub struct Config(pub [u8; 64]);

impl Config {
    /// Every tile [`block`] uses at 16 rows of 64 bytes (the largest palette 1 allows).
    pub fn full() -> Self {
        let mut bytes = [0u8; 64];
        bytes[0] = 1;
        for t in 0..8 {
            let colsb = (TILE_ROW_BYTES as u16).to_le_bytes();
            bytes[16 + 2 * t..18 + 2 * t].copy_from_slice(&colsb);
            bytes[48 + t] = TILE_ROWS as u8;
        }
        Self(bytes)
    }

    /// Tile `t`'s rows and bytes per row.
    pub fn shape(&self, t: usize) -> (usize, usize) {
        let colsb = u16::from_le_bytes([self.0[16 + 2 * t], self.0[17 + 2 * t]]);
        (usize::from(self.0[48 + t]), usize::from(colsb))
    }
}

/// The tile instructions [`block`] issues.
pub trait Tiles {
    /// `ldtilecfg`: shapes every tile and zeroes them.
    ///
    /// # Safety
    /// [`Hardware`]: the CPU has AMX-TILE and the process may use the tiles.
    unsafe fn configure(&mut self, config: &Config);
    /// `tileloadd`: the tile's rows from `ptr`, `stride` bytes apart.
    ///
    /// # Safety
    /// As [`Tiles::configure`], after it; the tile's rows × bytes per row lie inside one
    /// allocation from `ptr`.
    unsafe fn load(&mut self, tile: Tile, ptr: *const u8, stride: usize);
    /// `tilestored`: the tile's rows to `ptr`, `stride` bytes apart.
    ///
    /// # Safety
    /// As [`Tiles::load`], writable.
    unsafe fn store(&mut self, tile: Tile, ptr: *mut u8, stride: usize);
    /// `tilezero`: every byte of the tile zero.
    ///
    /// # Safety
    /// As [`Tiles::configure`], after it.
    unsafe fn zero(&mut self, tile: Tile);
    /// `tdpbf16ps`.
    ///
    /// # Safety
    /// As [`Tiles::configure`], after it.
    unsafe fn dot(&mut self, dot: Dot);
    /// `tilerelease`: the tiles back to their initial state.
    ///
    /// # Safety
    /// As [`Tiles::configure`].
    unsafe fn release(&mut self);
}

/// Where a block's sums start and end: `ROWS` rows of `COLS` f32 cells, `stride` apart from
/// `ptr`, started from zero or from the cells.
#[derive(Debug, Clone, Copy)]
pub struct Sums {
    pub ptr: *mut f32,
    pub stride: usize,
    pub from_zero: bool,
}

/// `c (+)= a · b` for one block of [`ROWS`] × [`COLS`] over `steps` × [`STEP_PAIRS`] pairs of
/// `k`: `a` holds `ROWS` rows of at least `2 × STEP_PAIRS × steps` bf16, `a_stride` apart;
/// `panel` is `[steps × STEP_PAIRS][COLS]` pairs; `sums` the block's cells. Each cell's sum
/// runs pair after pair in order of `k`, one row of `a` against one column of `b`: no other
/// row or column changes its bits.
///
/// # Safety
/// As [`Tiles::configure`], with every tile configured as [`Config::full`]; `sums` names
/// `ROWS × COLS` cells that nothing else reads or writes meanwhile.
///
/// # Panics
/// If an operand is shorter than its shape: a bug in the caller.
pub unsafe fn block<T: Tiles>(
    tiles: &mut T,
    (a, a_stride): (&[u16], usize),
    panel: &[u32],
    steps: usize,
    sums: Sums,
) {
    let pairs = steps * STEP_PAIRS;
    assert!(
        a_stride >= 2 * pairs
            && a.len() >= (ROWS - 1) * a_stride + 2 * pairs
            && panel.len() >= pairs * COLS
            && sums.stride >= COLS,
        "AMX block shapes. This is a bug."
    );
    let (a_row, b_row, c_row) = (a_stride * 2, COLS * 4, sums.stride * 4);
    let c_tiles = [
        (Tile::C00, 0),
        (Tile::C01, TILE_ROWS),
        (Tile::C10, TILE_ROWS * sums.stride),
        (Tile::C11, TILE_ROWS * sums.stride + TILE_ROWS),
    ];
    // SAFETY: every tile access below reads or writes 16 rows of 64 bytes inside what it
    // names: C tiles 16 rows × 16 f32 of the 32 × 32 cells of `sums` (the caller's contract);
    // A tiles 32 bf16 of 16 rows of `a` from column 32 s < 2 × pairs; B tiles 16 pairs of 16
    // columns of panel rows 16 s..16 s + 16 <= pairs (all asserted above).
    unsafe {
        for (tile, at) in c_tiles {
            if sums.from_zero {
                tiles.zero(tile);
            } else {
                tiles.load(tile, sums.ptr.add(at).cast_const().cast(), c_row);
            }
        }
        for s in 0..steps {
            let a_at = a.as_ptr().add(2 * STEP_PAIRS * s);
            tiles.load(Tile::A0, a_at.cast(), a_row);
            tiles.load(Tile::A1, a_at.add(TILE_ROWS * a_stride).cast(), a_row);
            let b_at = panel.as_ptr().add(STEP_PAIRS * s * COLS);
            tiles.load(Tile::B0, b_at.cast(), b_row);
            tiles.load(Tile::B1, b_at.add(TILE_ROWS).cast(), b_row);
            for dot in Dot::ALL {
                tiles.dot(dot);
            }
        }
        for (tile, at) in c_tiles {
            tiles.store(tile, sums.ptr.add(at).cast(), c_row);
        }
    }
}

/// The tile instructions themselves.
#[derive(Debug, Default, Clone, Copy)]
pub struct Hardware;

#[cfg(target_arch = "x86_64")]
impl Tiles for Hardware {
    unsafe fn configure(&mut self, config: &Config) {
        // SAFETY: the caller's contract; `config` is 64 readable bytes.
        unsafe {
            std::arch::asm!("ldtilecfg [{0}]", in(reg) config.0.as_ptr(), options(nostack, preserves_flags, readonly));
        }
    }

    unsafe fn load(&mut self, tile: Tile, ptr: *const u8, stride: usize) {
        macro_rules! load {
            ($tmm:literal) => {
                // SAFETY: the caller's contract.
                unsafe {
                    std::arch::asm!(
                        concat!("tileloadd ", $tmm, ", [{p} + {s}*1]"),
                        p = in(reg) ptr,
                        s = in(reg) stride,
                        options(nostack, preserves_flags, readonly)
                    )
                }
            };
        }
        match tile {
            Tile::C00 => load!("tmm0"),
            Tile::C01 => load!("tmm1"),
            Tile::C10 => load!("tmm2"),
            Tile::C11 => load!("tmm3"),
            Tile::A0 => load!("tmm4"),
            Tile::A1 => load!("tmm5"),
            Tile::B0 => load!("tmm6"),
            Tile::B1 => load!("tmm7"),
        }
    }

    unsafe fn store(&mut self, tile: Tile, ptr: *mut u8, stride: usize) {
        macro_rules! store {
            ($tmm:literal) => {
                // SAFETY: the caller's contract.
                unsafe {
                    std::arch::asm!(
                        concat!("tilestored [{p} + {s}*1], ", $tmm),
                        p = in(reg) ptr,
                        s = in(reg) stride,
                        options(nostack, preserves_flags)
                    )
                }
            };
        }
        match tile {
            Tile::C00 => store!("tmm0"),
            Tile::C01 => store!("tmm1"),
            Tile::C10 => store!("tmm2"),
            Tile::C11 => store!("tmm3"),
            Tile::A0 => store!("tmm4"),
            Tile::A1 => store!("tmm5"),
            Tile::B0 => store!("tmm6"),
            Tile::B1 => store!("tmm7"),
        }
    }

    unsafe fn zero(&mut self, tile: Tile) {
        macro_rules! zero {
            ($tmm:literal) => {
                // SAFETY: the caller's contract; tiles only, no memory.
                unsafe {
                    std::arch::asm!(
                        concat!("tilezero ", $tmm),
                        options(nostack, preserves_flags, nomem)
                    )
                }
            };
        }
        match tile {
            Tile::C00 => zero!("tmm0"),
            Tile::C01 => zero!("tmm1"),
            Tile::C10 => zero!("tmm2"),
            Tile::C11 => zero!("tmm3"),
            Tile::A0 => zero!("tmm4"),
            Tile::A1 => zero!("tmm5"),
            Tile::B0 => zero!("tmm6"),
            Tile::B1 => zero!("tmm7"),
        }
    }

    unsafe fn dot(&mut self, dot: Dot) {
        macro_rules! dot {
            ($operands:literal) => {
                // SAFETY: the caller's contract; tiles only, no memory.
                unsafe {
                    std::arch::asm!(
                        concat!("tdpbf16ps ", $operands),
                        options(nostack, preserves_flags, nomem)
                    )
                }
            };
        }
        match dot {
            Dot::Top0 => dot!("tmm0, tmm4, tmm6"),
            Dot::Top1 => dot!("tmm1, tmm4, tmm7"),
            Dot::Bottom0 => dot!("tmm2, tmm5, tmm6"),
            Dot::Bottom1 => dot!("tmm3, tmm5, tmm7"),
        }
    }

    unsafe fn release(&mut self) {
        // SAFETY: the caller's contract.
        unsafe { std::arch::asm!("tilerelease", options(nostack, preserves_flags, nomem)) }
    }
}

#[cfg(not(target_arch = "x86_64"))]
impl Tiles for Hardware {
    unsafe fn configure(&mut self, _: &Config) {
        unreachable!("AMX runs only on x86-64; the level check refuses it elsewhere")
    }
    unsafe fn load(&mut self, _: Tile, _: *const u8, _: usize) {}
    unsafe fn store(&mut self, _: Tile, _: *mut u8, _: usize) {}
    unsafe fn zero(&mut self, _: Tile) {}
    unsafe fn dot(&mut self, _: Dot) {}
    unsafe fn release(&mut self) {}
}

/// The tile instructions in plain Rust, to Intel's definition: a tile holds its configured
/// rows of its configured bytes, zero past them; `tdpbf16ps` checks the three shapes agree
/// (where the CPU raises #UD, this panics) and sums each cell pair by pair, in order of `k`,
/// with bf16 subnormal inputs read as zero and subnormal sums flushed to zero.
#[derive(Debug, Clone)]
pub struct Emulated {
    config: Option<Config>,
    tiles: [[u8; TILE_ROWS * TILE_ROW_BYTES]; 8],
}

impl Default for Emulated {
    fn default() -> Self {
        Self {
            config: None,
            tiles: [[0; TILE_ROWS * TILE_ROW_BYTES]; 8],
        }
    }
}

impl Emulated {
    fn shape(&self, tile: Tile) -> (usize, usize) {
        let config = self.config.as_ref();
        let config = config.expect("a tile instruction before ldtilecfg raises #UD");
        let (rows, colsb) = config.shape(tile as usize);
        assert!(
            rows > 0 && rows <= TILE_ROWS && colsb > 0 && colsb <= TILE_ROW_BYTES,
            "tile {tile:?} is not configured ({rows} rows of {colsb} bytes): #UD"
        );
        (rows, colsb)
    }

    fn word(&self, tile: Tile, row: usize, word: usize) -> u32 {
        let at = row * TILE_ROW_BYTES + 4 * word;
        let bytes = &self.tiles[tile as usize][at..at + 4];
        u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
    }
}

/// A bf16 as f32, a subnormal read as zero of its sign.
fn daz(bits: u16) -> f32 {
    let bits = if bits & 0x7F80 == 0 {
        bits & 0x8000
    } else {
        bits
    };
    f32::from_bits(u32::from(bits) << 16)
}

/// A subnormal f32 flushed to zero of its sign.
fn ftz(value: f32) -> f32 {
    if value.is_subnormal() {
        f32::from_bits(value.to_bits() & 0x8000_0000)
    } else {
        value
    }
}

impl Tiles for Emulated {
    unsafe fn configure(&mut self, config: &Config) {
        assert_eq!(
            config.0[0], 1,
            "palette {} is not palette 1: #GP",
            config.0[0]
        );
        self.config = Some(*config);
        self.tiles = [[0; TILE_ROWS * TILE_ROW_BYTES]; 8];
    }

    unsafe fn load(&mut self, tile: Tile, ptr: *const u8, stride: usize) {
        let (rows, colsb) = self.shape(tile);
        let dst = &mut self.tiles[tile as usize];
        dst.fill(0);
        for row in 0..rows {
            // SAFETY: the caller's contract: each configured row lies inside one allocation.
            let src = unsafe { std::slice::from_raw_parts(ptr.add(row * stride), colsb) };
            dst[row * TILE_ROW_BYTES..row * TILE_ROW_BYTES + colsb].copy_from_slice(src);
        }
    }

    unsafe fn store(&mut self, tile: Tile, ptr: *mut u8, stride: usize) {
        let (rows, colsb) = self.shape(tile);
        let src = &self.tiles[tile as usize];
        for row in 0..rows {
            // SAFETY: the caller's contract, as for `load`.
            let dst = unsafe { std::slice::from_raw_parts_mut(ptr.add(row * stride), colsb) };
            dst.copy_from_slice(&src[row * TILE_ROW_BYTES..row * TILE_ROW_BYTES + colsb]);
        }
    }

    unsafe fn zero(&mut self, tile: Tile) {
        self.shape(tile);
        self.tiles[tile as usize].fill(0);
    }

    unsafe fn dot(&mut self, dot: Dot) {
        let (c, a, b) = dot.tiles();
        let ((c_rows, c_colsb), (a_rows, a_colsb), (b_rows, b_colsb)) =
            (self.shape(c), self.shape(a), self.shape(b));
        assert!(
            c_rows == a_rows && c_colsb == b_colsb && a_colsb / 4 == b_rows,
            "tdpbf16ps shapes do not agree: #UD"
        );
        let mut sums = self.tiles[c as usize];
        for m in 0..c_rows {
            for n in 0..c_colsb / 4 {
                let at = m * TILE_ROW_BYTES + 4 * n;
                let cell = &mut sums[at..at + 4];
                let mut sum = f32::from_le_bytes([cell[0], cell[1], cell[2], cell[3]]);
                for q in 0..a_colsb / 4 {
                    let (x, y) = (self.word(a, m, q), self.word(b, q, n));
                    for half in [0, 16] {
                        let product = daz((x >> half) as u16) * daz((y >> half) as u16);
                        sum = ftz(sum + product);
                    }
                }
                cell.copy_from_slice(&sum.to_le_bytes());
            }
        }
        self.tiles[c as usize] = sums;
    }

    unsafe fn release(&mut self) {
        *self = Self::default();
    }
}

/// `value`'s bf16 bits, rounded to nearest even.
fn bf16_of(value: f32) -> u16 {
    half::bf16::from_f32(value).to_bits()
}

/// Whether the CPU has AMX-TILE and AMX-BF16 (CPUID leaf 7, EDX bits 24 and 22).
pub fn cpu_has_tiles() -> (bool, bool) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__cpuid, __cpuid_count};
        // SAFETY: CPUID exists on every x86-64 CPU; leaf 7 is read only where leaf 0 lists it.
        #[allow(unused_unsafe)]
        let edx = unsafe {
            if __cpuid(0).eax < 7 {
                return (false, false);
            }
            __cpuid_count(7, 0).edx
        };
        (edx & (1 << 24) != 0, edx & (1 << 22) != 0)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        (false, false)
    }
}

/// Asks Linux for the tiles' register state (`arch_prctl(ARCH_REQ_XCOMP_PERM,
/// XFEATURE_XTILEDATA)`), once for the process, where the OS has enabled it: without it the
/// first tile instruction kills the process. The error says why it was refused.
pub fn request_permission() -> Result<(), String> {
    static GRANTED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    GRANTED
        .get_or_init(|| {
            #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
            {
                if !os_enabled_tiles() {
                    return Err(
                        "the OS has not enabled the AMX tile state (XCR0 bits 17 and 18 clear: a kernel or hypervisor without AMX support)"
                            .to_owned(),
                    );
                }
                const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
                const XFEATURE_XTILEDATA: libc::c_long = 18;
                // SAFETY: arch_prctl with these arguments only changes the process's
                // permissions; it reads and writes no memory of ours.
                let rc = unsafe {
                    libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
                };
                if rc == 0 {
                    Ok(())
                } else {
                    Err(format!(
                        "Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: {}; it needs Linux 5.16 or later)",
                        std::io::Error::last_os_error()
                    ))
                }
            }
            #[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
            {
                Err("AMX tiles are used only on Linux on x86-64".to_owned())
            }
        })
        .clone()
}

/// Whether the OS saves and restores the tiles (XCR0's XTILECFG and XTILEDATA bits, read only
/// where CPUID says the OS uses XSAVE): Linux sets them when it supports AMX, and then hands
/// the state out on request.
#[cfg(target_arch = "x86_64")]
fn os_enabled_tiles() -> bool {
    use std::arch::x86_64::{__cpuid, _xgetbv};
    const OSXSAVE: u32 = 1 << 27;
    const TILE_STATE: u64 = (1 << 17) | (1 << 18);
    // SAFETY: CPUID exists on every x86-64 CPU.
    #[allow(unused_unsafe)]
    let os_xsave = unsafe { __cpuid(1).ecx } & OSXSAVE != 0;
    /// # Safety
    /// The CPU has XSAVE and the OS enabled it (CPUID.1:ECX.OSXSAVE).
    #[target_feature(enable = "xsave")]
    unsafe fn xcr0() -> u64 {
        // SAFETY: the caller's contract.
        unsafe { _xgetbv(0) }
    }
    // SAFETY: `xgetbv` runs only where OSXSAVE is set (checked first).
    os_xsave && unsafe { xcr0() } & TILE_STATE == TILE_STATE
}

/// Runs [`block`] on the tiles on small integers, whose sums are exact in any order, and
/// compares every cell with the emulator's: a check, before any work, that this CPU and kernel
/// run the tile kernel as its tests do. The error names what the CPU lacks, or the first cell
/// that differs.
pub fn self_check() -> Result<(), String> {
    match cpu_has_tiles() {
        (true, true) => request_permission()?,
        (tile, bf16) => {
            return Err(format!(
                "this CPU lacks AMX (amx_tile {tile}, amx_bf16 {bf16})"
            ));
        }
    }
    let steps = 2;
    let a_stride = 2 * steps * STEP_PAIRS + 6;
    let small = |i: usize, modulus: usize| (i * 7 % modulus) as f32 - (modulus / 2) as f32;
    let a: Vec<u16> = (0..ROWS * a_stride)
        .map(|i| bf16_of(small(i, 13)))
        .collect();
    let panel: Vec<u32> = (0..steps * STEP_PAIRS * COLS)
        .map(|i| {
            let low = bf16_of(small(2 * i, 11));
            let high = bf16_of(small(2 * i + 1, 9));
            u32::from(low) | (u32::from(high) << 16)
        })
        .collect();
    // Sums from the cells and from zero, in a block whose rows are wider than its 32 cells.
    let stride = COLS + 3;
    let start: Vec<f32> = (0..ROWS * stride).map(|i| small(i, 17)).collect();
    let config = Config::full();
    for from_zero in [false, true] {
        let run = |tiles: &mut dyn FnMut(Sums)| {
            let mut c = start.clone();
            let ptr = c.as_mut_ptr();
            tiles(Sums {
                ptr,
                stride,
                from_zero,
            });
            c
        };
        // SAFETY: the CPU has AMX-TILE and AMX-BF16 and Linux granted the tiles (just above);
        // the emulator needs neither; `c` holds the 32 rows of `stride` cells.
        let (hardware, emulated) = unsafe {
            (
                run(&mut |c| {
                    let mut tiles = Hardware;
                    tiles.configure(&config);
                    block(&mut tiles, (&a, a_stride), &panel, steps, c);
                    tiles.release();
                }),
                run(&mut |c| {
                    let mut tiles = Emulated::default();
                    tiles.configure(&config);
                    block(&mut tiles, (&a, a_stride), &panel, steps, c);
                }),
            )
        };
        if let Some(i) =
            (0..hardware.len()).find(|&i| hardware[i].to_bits() != emulated[i].to_bits())
        {
            return Err(format!(
                "the AMX tile kernel's self-check (sums from {}) gave {} at row {}, column {} where {} is exact",
                if from_zero { "zero" } else { "the cells" },
                hardware[i],
                i / stride,
                i % stride,
                emulated[i]
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tile_configuration_gives_every_tile_sixteen_rows_of_sixty_four_bytes_in_palette_one() {
        let config = Config::full();
        assert_eq!(config.0[0], 1, "palette 1");
        for t in 0..8 {
            assert_eq!(config.shape(t), (16, 64), "tile {t}");
        }
        assert!(
            config.0[1..16].iter().all(|&b| b == 0),
            "start row and reserved bytes"
        );
        assert!(
            config.0[32..48].iter().all(|&b| b == 0),
            "tiles 8-15 have no bytes"
        );
        assert!(
            config.0[56..].iter().all(|&b| b == 0),
            "tiles 8-15 have no rows"
        );
        assert_eq!(align_of::<Config>(), 64);
    }

    fn pair(low: f32, high: f32) -> u32 {
        u32::from(bf16_of(low)) | (u32::from(bf16_of(high)) << 16)
    }

    #[test]
    fn an_emulated_tile_product_sums_each_cell_pair_by_pair_from_its_start() {
        // One step: c[m][n] = start + Σ_q a[m][q] · b[q][n] over 16 pairs.
        let a: Vec<u16> = (0..ROWS * 32)
            .map(|i| bf16_of((i % 5) as f32 - 2.0))
            .collect();
        let panel: Vec<u32> = (0..STEP_PAIRS * COLS)
            .map(|i| pair((i % 3) as f32, (i % 7) as f32 - 3.0))
            .collect();
        let mut c: Vec<f32> = (0..ROWS * COLS).map(|i| i as f32 * 0.5).collect();
        let start = c.clone();
        let mut tiles = Emulated::default();
        // SAFETY: the emulator reads and writes only the slices `block` checks.
        unsafe {
            tiles.configure(&Config::full());
            let sums = Sums {
                ptr: c.as_mut_ptr(),
                stride: COLS,
                from_zero: false,
            };
            block(&mut tiles, (&a, 32), &panel, 1, sums);
        }
        let value = |bits: u16| f32::from_bits(u32::from(bits) << 16);
        for m in 0..ROWS {
            for n in 0..COLS {
                let mut want = start[m * COLS + n];
                for q in 0..STEP_PAIRS {
                    let word = panel[q * COLS + n];
                    want += value(a[m * 32 + 2 * q]) * value(word as u16);
                    want += value(a[m * 32 + 2 * q + 1]) * value((word >> 16) as u16);
                }
                assert_eq!(c[m * COLS + n], want, "[{m}, {n}]");
            }
        }
    }

    #[test]
    fn the_emulator_reads_subnormal_inputs_as_zero_and_flushes_subnormal_sums() {
        assert_eq!(daz(0x0001), 0.0);
        assert_eq!(daz(0x8001).to_bits(), (-0.0f32).to_bits());
        assert_eq!(daz(0x3F80), 1.0);
        assert_eq!(ftz(f32::MIN_POSITIVE / 2.0), 0.0);
        assert_eq!(ftz(f32::MIN_POSITIVE), f32::MIN_POSITIVE);
    }

    #[test]
    fn the_emulator_refuses_what_the_cpu_refuses() {
        let mut tiles = Emulated::default();
        let unconfigured = std::panic::catch_unwind(move || {
            // SAFETY: the emulator touches no memory for a product.
            unsafe { tiles.dot(Dot::Top0) }
        });
        assert!(unconfigured.is_err(), "a product before ldtilecfg");
        let mut tiles = Emulated::default();
        let mut narrow = Config::full();
        narrow.0[48 + Tile::B0 as usize] = 8;
        let mismatched = std::panic::catch_unwind(move || {
            // SAFETY: as above.
            unsafe {
                tiles.configure(&narrow);
                tiles.dot(Dot::Top0);
            }
        });
        assert!(mismatched.is_err(), "B with 8 rows against A's 16 pairs");
    }

    #[test]
    fn a_cpu_without_tiles_is_refused_the_tile_state_before_linux_is_asked() {
        if cpu_has_tiles().0 {
            eprintln!("skipped: this CPU has AMX-TILE");
            return;
        }
        assert!(!os_enabled_tiles(), "XCR0 cannot enable what the CPU lacks");
        let refusal = request_permission().unwrap_err();
        assert!(refusal.contains("XCR0"), "{refusal}");
        assert!(self_check().unwrap_err().contains("lacks AMX"));
    }

    #[test]
    fn the_tile_kernel_on_this_cpu_gives_the_emulators_bits_or_is_named_as_skipped() {
        let (tile, bf16) = cpu_has_tiles();
        if !(tile && bf16) {
            eprintln!("skipped: this CPU lacks amx_tile or amx_bf16 (tile {tile}, bf16 {bf16})");
            return;
        }
        self_check().expect("the tiles agree with the emulator");
    }
}
