//! Writing `.npy` arrays: the format projection directions travel in between the API and the
//! harvester (and the one researchers save with `np.save`).

/// A little-endian f32 `.npy` (format 1.0) of shape `[rows, cols]` holding `values`.
pub fn f32_matrix(rows: usize, cols: usize, values: &[f32]) -> Vec<u8> {
    let mut header =
        format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {cols}), }}");
    // The header, with its 10-byte preamble and trailing newline, is padded to 64 bytes.
    while !(10 + header.len() + 1).is_multiple_of(64) {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((header.len() as u16).to_le_bytes());
    out.extend(header.as_bytes());
    out.extend(values.iter().flat_map(|v| v.to_le_bytes()));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_is_aligned_and_the_data_follows_it() {
        let bytes = f32_matrix(1, 2, &[1.0, -2.0]);
        let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
        assert_eq!((10 + header_len) % 64, 0);
        assert!(
            std::str::from_utf8(&bytes[10..10 + header_len])
                .unwrap()
                .contains("'shape': (1, 2)")
        );
        assert_eq!(
            &bytes[10 + header_len..],
            [1.0f32.to_le_bytes(), (-2.0f32).to_le_bytes()].concat()
        );
    }
}
