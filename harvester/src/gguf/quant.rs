//! Dequantisation of the GGML tensor types the importer accepts.

use half::f16;

/// GGML tensor types we can import, with their block layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// 16-bit float.
    F16,
    /// bfloat16.
    Bf16,
    /// 32 values: f16 scale, 32 × i8.
    Q8_0,
    /// 32 values: f16 scale, 16 bytes of 4-bit values offset by 8.
    Q4_0,
    /// 32 values: f16 scale, f16 minimum, 16 bytes of 4-bit values.
    Q4_1,
    /// 256 values in 8 sub-blocks of 32: f16 scale and minimum, 6-bit sub-block scales and
    /// minimums packed in 12 bytes, 128 bytes of 4-bit values.
    Q4K,
    /// As Q4_K with a fifth bit per value in 32 more bytes.
    Q5K,
    /// 256 values in 16 sub-blocks of 16: 4 low bits in 128 bytes, 2 high bits in 64, 16 signed
    /// 8-bit sub-block scales, then the f16 scale.
    Q6K,
}

/// Values per quantised block of the simple types.
const BLOCK: usize = 32;
/// Values per super-block of the K-quants (llama.cpp's `QK_K`).
const SUPER_BLOCK: usize = 256;

impl GgmlType {
    /// Maps a GGML type id, or returns a printable name of the unsupported type.
    pub fn from_id(id: u32) -> Result<Self, String> {
        Ok(match id {
            0 => Self::F32,
            1 => Self::F16,
            30 => Self::Bf16,
            8 => Self::Q8_0,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            other => {
                let name = match other {
                    6 => "Q5_0",
                    7 => "Q5_1",
                    9 => "Q8_1",
                    10 => "Q2_K",
                    11 => "Q3_K",
                    15 => "Q8_K",
                    16..=23 | 29 => "an IQ quantisation",
                    24 => "I8",
                    25 => "I16",
                    26 => "I32",
                    27 => "I64",
                    28 => "F64",
                    _ => "unknown",
                };
                return Err(format!("{name} (GGML type {other})"));
            }
        })
    }

    /// Bytes needed for `elements` values, or `None` if they do not fill whole blocks.
    pub fn byte_len(self, elements: usize) -> Option<usize> {
        let blocks_of = |values: usize, bytes_per_block: usize| {
            elements
                .is_multiple_of(values)
                .then_some(elements / values * bytes_per_block)
        };
        let blocks = |bytes_per_block: usize| blocks_of(BLOCK, bytes_per_block);
        match self {
            Self::F32 => Some(elements * 4),
            Self::F16 | Self::Bf16 => Some(elements * 2),
            Self::Q8_0 => blocks(34),
            Self::Q4_0 => blocks(18),
            Self::Q4_1 => blocks(20),
            Self::Q4K => blocks_of(SUPER_BLOCK, 144),
            Self::Q5K => blocks_of(SUPER_BLOCK, 176),
            Self::Q6K => blocks_of(SUPER_BLOCK, 210),
        }
    }

    /// Decodes `bytes` (exactly `byte_len` of them) into `out`.
    pub fn dequantize(self, bytes: &[u8], out: &mut Vec<f32>) {
        match self {
            Self::F32 => crate::dtype::extend_from_f32(out, bytes),
            Self::F16 => crate::dtype::extend_from_f16(out, bytes),
            Self::Bf16 => crate::dtype::extend_from_bf16(out, bytes),
            Self::Q8_0 => {
                for block in bytes.chunks_exact(34) {
                    let d = half(&block[0..2]);
                    out.extend(block[2..].iter().map(|&q| f32::from(q as i8) * d));
                }
            }
            Self::Q4_0 => {
                for block in bytes.chunks_exact(18) {
                    let d = half(&block[0..2]);
                    let qs = &block[2..];
                    out.extend(qs.iter().map(|&q| (f32::from(q & 0x0f) - 8.0) * d));
                    out.extend(qs.iter().map(|&q| (f32::from(q >> 4) - 8.0) * d));
                }
            }
            Self::Q4_1 => {
                for block in bytes.chunks_exact(20) {
                    let (d, m) = (half(&block[0..2]), half(&block[2..4]));
                    let qs = &block[4..];
                    out.extend(qs.iter().map(|&q| f32::from(q & 0x0f) * d + m));
                    out.extend(qs.iter().map(|&q| f32::from(q >> 4) * d + m));
                }
            }
            Self::Q4K => bytes
                .chunks_exact(144)
                .for_each(|b| q4_k(&b[..16], &b[16..], None, out)),
            Self::Q5K => bytes
                .chunks_exact(176)
                .for_each(|b| q4_k(&b[..16], &b[48..], Some(&b[16..48]), out)),
            Self::Q6K => bytes.chunks_exact(210).for_each(|b| q6_k(b, out)),
        }
    }
}

fn half(b: &[u8]) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

/// Sub-block `j`'s 6-bit scale and minimum from the 12 packed bytes (llama.cpp's
/// `get_scale_min_k4`): the first four in the low 6 bits of bytes 0-3 and 4-7, the last four in
/// the nibbles of bytes 8-11 with their top two bits in the top of bytes 0-7.
fn scale_min(j: usize, q: &[u8]) -> (f32, f32) {
    let (scale, min) = if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    };
    (f32::from(scale), f32::from(min))
}

/// One Q4_K super-block (`head`: `d`, `dmin` and 12 scale bytes; `qs`: 128 bytes of nibbles),
/// or a Q5_K one when `high` holds its 32 bytes of fifth bits. The order of operations is
/// llama.cpp's and gguf-py's (`d * scale`, then `d1 * q - dmin * min`, never fused), so the
/// values are bit-identical.
fn q4_k(head: &[u8], qs: &[u8], high: Option<&[u8]>, out: &mut Vec<f32>) {
    let (d, dmin) = (half(&head[0..2]), half(&head[2..4]));
    let scales = &head[4..16];
    for pair in 0..4 {
        let (sc1, m1) = scale_min(2 * pair, scales);
        let (sc2, m2) = scale_min(2 * pair + 1, scales);
        let (d1, min1, d2, min2) = (d * sc1, dmin * m1, d * sc2, dmin * m2);
        let q = &qs[32 * pair..32 * pair + 32];
        let fifth =
            |l: usize, bit: usize| high.map_or(0, |h| if h[l] & (1 << bit) != 0 { 16 } else { 0 });
        out.extend((0..32).map(|l| d1 * f32::from((q[l] & 0x0f) + fifth(l, 2 * pair)) - min1));
        out.extend((0..32).map(|l| d2 * f32::from((q[l] >> 4) + fifth(l, 2 * pair + 1)) - min2));
    }
}

/// One Q6_K super-block: value `v` is `d * scale[v / 16] * (q - 32)`, `q` its 4 low bits from
/// `ql` and 2 high bits from `qh`, in llama.cpp's interleaving (and its order of operations).
fn q6_k(block: &[u8], out: &mut Vec<f32>) {
    let (ql, qh, scales) = (&block[..128], &block[128..192], &block[192..208]);
    let d = half(&block[208..210]);
    let start = out.len();
    out.resize(start + SUPER_BLOCK, 0.0);
    let y = &mut out[start..];
    for half_block in 0..2 {
        let (ql, qh) = (&ql[64 * half_block..], &qh[32 * half_block..]);
        let y = &mut y[128 * half_block..];
        let sc = &scales[8 * half_block..];
        for l in 0..32 {
            let is = l / 16;
            let q =
                |low: u8, shift: u8| i32::from((low & 0x0f) | (((qh[l] >> shift) & 3) << 4)) - 32;
            let scale = |k: usize| f32::from(sc[is + k] as i8);
            y[l] = d * scale(0) * q(ql[l], 0) as f32;
            y[l + 32] = d * scale(2) * q(ql[l + 32], 2) as f32;
            y[l + 64] = d * scale(4) * q(ql[l] >> 4, 4) as f32;
            y[l + 96] = d * scale(6) * q(ql[l + 32] >> 4, 6) as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16_bytes(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_bits().to_le_bytes()
    }

    #[test]
    fn q4_0_puts_low_nibbles_first_and_centres_on_8() {
        let mut block = f16_bytes(0.5).to_vec();
        block.extend((0..16u8).map(|i| i | (15 - i) << 4));
        let mut out = Vec::new();
        GgmlType::Q4_0.dequantize(&block, &mut out);
        assert_eq!(out.len(), 32);
        assert_eq!(out[0], -4.0);
        assert_eq!(out[15], 3.5);
        assert_eq!(out[16], 3.5);
        assert_eq!(out[31], -4.0);
    }

    #[test]
    fn q4_1_adds_the_block_minimum() {
        let mut block = f16_bytes(2.0).to_vec();
        block.extend(f16_bytes(-1.0));
        block.extend([0x21u8; 16]);
        let mut out = Vec::new();
        GgmlType::Q4_1.dequantize(&block, &mut out);
        assert_eq!(out[0], 1.0, "low nibble 1");
        assert_eq!(out[16], 3.0, "high nibble 2");
    }

    #[test]
    fn q8_0_scales_signed_bytes() {
        let mut block = f16_bytes(0.25).to_vec();
        block.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let mut out = Vec::new();
        GgmlType::Q8_0.dequantize(&block, &mut out);
        assert_eq!(out[0], -4.0);
        assert_eq!(out[31], 3.75);
    }

    #[test]
    fn unsupported_types_are_named() {
        assert_eq!(GgmlType::from_id(11).unwrap_err(), "Q3_K (GGML type 11)");
        assert!(GgmlType::Q4K.byte_len(255).is_none());
        assert_eq!(GgmlType::Q6K.byte_len(512), Some(420));
        assert!(GgmlType::Q4_0.byte_len(33).is_none());
    }
}
