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
pub fn round_bf16(value: f32) -> f32 {
    bf16::from_f32(value).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;

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
