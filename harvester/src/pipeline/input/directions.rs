//! Projection directions from `.npy` or `.safetensors` files, `[n, hidden]` in f32, f16 or bf16
//! (f64 `.npy` too), decoded to f32 and then validated by [`Directions::new`].

use safetensors::{Dtype, SafeTensors};

use crate::dtype;
use crate::error::{Error, InputError, Result};
use crate::projection::Directions;

/// Decodes a directions file named `name` and validates it against a model of width `hidden`.
pub fn load_directions(name: &str, bytes: &[u8], hidden: usize) -> Result<Directions> {
    let (values, shape) = if name.to_ascii_lowercase().ends_with(".npy") {
        parse_npy(bytes)
    } else if name.to_ascii_lowercase().ends_with(".safetensors") {
        parse_safetensors(bytes)
    } else {
        Err("unknown format: give a .npy or .safetensors file holding one [n, hidden] array".into())
    }
    .map_err(|reason| {
        Error::Input(InputError::BadDirections {
            reason: format!("{name}: {reason}"),
        })
    })?;
    match shape.as_slice() {
        [n, h] => Directions::new(&values, *n, *h, hidden),
        other => Err(Error::Input(InputError::BadDirections {
            reason: format!("{name}: shape {other:?} is not [n_directions, hidden]"),
        })),
    }
}

type Decoded = std::result::Result<(Vec<f32>, Vec<usize>), String>;

fn parse_safetensors(bytes: &[u8]) -> Decoded {
    let st = SafeTensors::deserialize(bytes).map_err(|e| format!("not a safetensors file: {e}"))?;
    let names = st.names();
    let [name] = names.as_slice() else {
        return Err(format!(
            "holds {} tensors; it must hold exactly one [n, hidden] tensor",
            names.len()
        ));
    };
    let view = st.tensor(name).map_err(|e| e.to_string())?;
    let mut values = Vec::new();
    match view.dtype() {
        Dtype::F32 => dtype::extend_from_f32(&mut values, view.data()),
        Dtype::F16 => dtype::extend_from_f16(&mut values, view.data()),
        Dtype::BF16 => dtype::extend_from_bf16(&mut values, view.data()),
        other => {
            return Err(format!(
                "tensor {name} has dtype {other:?}; use float32, float16 or bfloat16"
            ));
        }
    }
    Ok((values, view.shape().to_vec()))
}

fn parse_npy(bytes: &[u8]) -> Decoded {
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err("not a .npy file (bad magic)".into());
    }
    let (header_len, header_start) = match bytes[6] {
        1 => (usize::from(u16::from_le_bytes([bytes[8], bytes[9]])), 10),
        2 | 3 if bytes.len() >= 12 => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
        v => return Err(format!(".npy version {v} is not supported")),
    };
    let header = bytes
        .get(header_start..header_start + header_len)
        .and_then(|h| std::str::from_utf8(h).ok())
        .ok_or("truncated .npy header")?;
    let field = |key: &str| -> Option<&str> {
        let start = header.find(&format!("'{key}':"))? + key.len() + 3;
        Some(header[start..].trim_start())
    };
    let descr = field("descr")
        .and_then(|d| d.strip_prefix('\''))
        .and_then(|d| d.split('\'').next())
        .ok_or("no descr")?;
    if field("fortran_order").is_some_and(|f| f.starts_with("True")) {
        return Err(
            "Fortran-ordered arrays are not supported: save with np.ascontiguousarray".into(),
        );
    }
    let shape_text = field("shape")
        .and_then(|s| s.strip_prefix('('))
        .and_then(|s| s.split(')').next())
        .ok_or("no shape")?;
    let shape = shape_text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<usize>()
                .map_err(|_| format!("bad shape ({shape_text})"))
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let data = &bytes[header_start + header_len..];
    let elements: usize = shape.iter().product();
    let mut values = Vec::with_capacity(elements);
    let width = match descr {
        "<f4" => 4,
        "<f2" => 2,
        "<f8" => 8,
        other => {
            return Err(format!(
                "dtype {other} is not supported; use float32, float16 or float64"
            ));
        }
    };
    if data.len() != elements * width {
        return Err(format!(
            "holds {} data bytes, but shape {shape:?} of {descr} needs {}",
            data.len(),
            elements * width
        ));
    }
    match descr {
        "<f4" => dtype::extend_from_f32(&mut values, data),
        "<f2" => dtype::extend_from_f16(&mut values, data),
        _ => {
            values.extend(data.chunks_exact(8).map(|b| {
                f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f32
            }));
        }
    }
    Ok((values, shape))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn npy(descr: &str, shape: &str, data: &[u8]) -> Vec<u8> {
        let mut header =
            format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': ({shape}), }}");
        while (10 + header.len() + 1) % 64 != 0 {
            header.push(' ');
        }
        header.push('\n');
        let mut out = b"\x93NUMPY\x01\x00".to_vec();
        out.extend((header.len() as u16).to_le_bytes());
        out.extend(header.as_bytes());
        out.extend(data);
        out
    }

    #[test]
    fn npy_f32_directions_load_and_normalise() {
        let data: Vec<u8> = [3.0f32, 4.0, 0.0, 2.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let d = load_directions("d.npy", &npy("<f4", "2, 2", &data), 2).unwrap();
        assert_eq!(d.unit_vectors(), &[0.6, 0.8, 0.0, 1.0]);
    }

    #[test]
    fn a_short_npy_buffer_gives_both_byte_counts() {
        let err = load_directions("d.npy", &npy("<f4", "2, 2", &[0; 12]), 2)
            .unwrap_err()
            .to_string();
        assert!(err.contains("12 data bytes") && err.contains("16"), "{err}");
    }

    #[test]
    fn a_one_dimensional_array_is_rejected() {
        let data: Vec<u8> = [1.0f32, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let err = load_directions("d.npy", &npy("<f4", "2,", &data), 2)
            .unwrap_err()
            .to_string();
        assert!(err.contains("[n_directions, hidden]"), "{err}");
    }

    #[test]
    fn safetensors_directions_of_the_wrong_width_are_rejected() {
        let data: Vec<u8> = [1.0f32; 6].iter().flat_map(|v| v.to_le_bytes()).collect();
        let view = safetensors::tensor::TensorView::new(Dtype::F32, vec![2, 3], &data).unwrap();
        let bytes = safetensors::serialize([("d", view)], None).unwrap();
        let err = load_directions("d.safetensors", &bytes, 576)
            .unwrap_err()
            .to_string();
        assert!(err.contains("width 3") && err.contains("576"), "{err}");
    }

    /// 0.1 has different bits in f16 and bf16: reading one as the other gives another number.
    fn f16_bytes(values: &[f32]) -> Vec<u8> {
        values
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect()
    }

    #[test]
    fn float16_directions_load_from_npy_and_safetensors_as_their_f32_values() {
        let values = [0.1f32, 0.2, 3.0, 4.0];
        let decoded: Vec<f64> = values
            .iter()
            .map(|v| f64::from(half::f16::from_f32(*v).to_f32()))
            .collect();
        let norm = decoded[0].hypot(decoded[1]);
        let expected = [decoded[0] / norm, decoded[1] / norm, 0.6, 0.8];
        let data = f16_bytes(&values);
        let view = safetensors::tensor::TensorView::new(Dtype::F16, vec![2, 2], &data).unwrap();
        let from_safetensors = safetensors::serialize([("d", view)], None).unwrap();
        for (name, bytes) in [
            ("d.npy", npy("<f2", "2, 2", &data)),
            ("d.safetensors", from_safetensors),
        ] {
            let loaded = load_directions(name, &bytes, 2).unwrap();
            for (got, want) in loaded.unit_vectors().iter().zip(expected) {
                assert!(
                    (f64::from(*got) - want).abs() < 1e-6,
                    "{name}: {got} vs {want}"
                );
            }
        }
    }
}
