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
}

/// Values per quantised block.
const BLOCK: usize = 32;

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
            other => {
                let name = match other {
                    6 => "Q5_0",
                    7 => "Q5_1",
                    9 => "Q8_1",
                    10 => "Q2_K",
                    11 => "Q3_K",
                    12 => "Q4_K",
                    13 => "Q5_K",
                    14 => "Q6_K",
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
        let blocks = |bytes_per_block: usize| {
            elements
                .is_multiple_of(BLOCK)
                .then_some(elements / BLOCK * bytes_per_block)
        };
        match self {
            Self::F32 => Some(elements * 4),
            Self::F16 | Self::Bf16 => Some(elements * 2),
            Self::Q8_0 => blocks(34),
            Self::Q4_0 => blocks(18),
            Self::Q4_1 => blocks(20),
        }
    }

    /// Decodes `bytes` (exactly `byte_len` of them) into `out`.
    pub fn dequantize(self, bytes: &[u8], out: &mut Vec<f32>) {
        let half = |b: &[u8]| f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
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
        assert_eq!(GgmlType::from_id(12).unwrap_err(), "Q4_K (GGML type 12)");
        assert!(GgmlType::Q4_0.byte_len(33).is_none());
    }
}
