//! Little-endian element decoding shared by the safetensors loader and the GGUF importer.

use half::{bf16, f16};

/// Appends `bytes` (little-endian bf16) to `dst` as f32.
pub fn extend_from_bf16(dst: &mut Vec<f32>, bytes: &[u8]) {
    dst.extend(
        bytes
            .chunks_exact(2)
            .map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()),
    );
}

/// Appends `bytes` (little-endian f16) to `dst` as f32.
pub fn extend_from_f16(dst: &mut Vec<f32>, bytes: &[u8]) {
    dst.extend(
        bytes
            .chunks_exact(2)
            .map(|b| f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()),
    );
}

/// Appends `bytes` (little-endian f32) to `dst`.
pub fn extend_from_f32(dst: &mut Vec<f32>, bytes: &[u8]) {
    dst.extend(
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
    );
}

/// Rounds f32 values to bf16 (round to nearest even, as torch does) and returns the raw bytes.
pub fn to_bf16_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| bf16::from_f32(v).to_bits().to_le_bytes())
        .collect()
}

/// The raw little-endian bytes of f32 values.
pub fn to_f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Rounds one f32 through bf16 and back.
#[inline]
pub fn round_bf16(value: f32) -> f32 {
    f32::from_bits(bf16_rounded_bits(value))
}

/// The f32 bits of `value` rounded to the nearest bf16, ties to even, as `half` rounds (a NaN
/// stays a quiet NaN). Branch-free, so loops over it vectorise: the bf16 mode rounds every
/// activation it hands a product.
#[inline]
pub fn bf16_rounded_bits(value: f32) -> u32 {
    let bits = value.to_bits();
    let nan = bits & 0x7FFF_FFFF > 0x7F80_0000;
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1));
    (if nan { bits | 0x0040_0000 } else { rounded }) & 0xFFFF_0000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_branch_free_bf16_rounding_matches_half_on_every_kind_of_bit_pattern() {
        // A stride through all 2^32 patterns, plus the edges of every class: ties, the largest
        // finite values, infinities, NaNs, subnormals and signed zeros.
        let edges = [
            0x0000_0000u32,
            0x8000_0000,
            0x0000_8000,
            0x0001_8000,
            0x3F80_8000,
            0x3F81_8000,
            0x3F80_7FFF,
            0x7F7F_FFFF,
            0x7F7F_7FFF,
            0x7F80_0000,
            0xFF80_0000,
            0x7F80_0001,
            0x7FC0_0000,
            0xFFFF_FFFF,
            0x0000_0001,
            0x007F_FFFF,
        ];
        let stride = (0..=u32::MAX).step_by(65_521);
        for bits in edges.into_iter().chain(stride) {
            let value = f32::from_bits(bits);
            let expected = bf16::from_f32(value).to_f32();
            let got = round_bf16(value);
            if expected.is_nan() {
                assert!(got.is_nan(), "{bits:#010x}");
            } else {
                assert_eq!(got.to_bits(), expected.to_bits(), "{bits:#010x}");
            }
        }
    }

    #[test]
    fn bf16_round_trip_keeps_representable_values() {
        let values = [1.0f32, -2.5, 0.0, 3.140625];
        let mut back = Vec::new();
        extend_from_bf16(&mut back, &to_bf16_bytes(&values));
        assert_eq!(back, values);
    }

    #[test]
    fn bf16_rounding_is_to_nearest() {
        // 1 + 2^-8 lies exactly between two bf16 values; ties go to even (1.0).
        assert_eq!(round_bf16(1.0 + 1.0 / 256.0), 1.0);
        assert_eq!(round_bf16(1.0 + 3.0 / 256.0), 1.0 + 1.0 / 64.0);
    }
}
