//! Projection directions: validated once, L2-normalised, then used by every backend.

use crate::error::{Error, InputError, Result};

/// Most directions a job may project onto.
pub use harvest_core::plan::MAX_DIRECTIONS;

/// Unit-length directions, row-major `[count, hidden]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Directions {
    count: usize,
    hidden: usize,
    unit: Vec<f32>,
}

impl Directions {
    /// Validates `values` as `[count, hidden]` for a model of width `model_hidden` and normalises
    /// each row. Rows are normalised in f64, so tiny or huge inputs lose nothing.
    pub fn new(values: &[f32], count: usize, hidden: usize, model_hidden: usize) -> Result<Self> {
        let bad = |reason: String| Err(Error::Input(InputError::BadDirections { reason }));
        if count == 0 || count > MAX_DIRECTIONS {
            return bad(format!(
                "{count} directions given; send between 1 and {MAX_DIRECTIONS}"
            ));
        }
        if hidden != model_hidden {
            return bad(format!(
                "directions have width {hidden}, but the model's hidden size is {model_hidden}"
            ));
        }
        if values.len() != count * hidden {
            return bad(format!(
                "{} values given for shape [{count}, {hidden}], which needs {}",
                values.len(),
                count * hidden
            ));
        }
        let mut unit = Vec::with_capacity(values.len());
        for (row, chunk) in values.chunks_exact(hidden).enumerate() {
            if let Some(col) = chunk.iter().position(|v| !v.is_finite()) {
                return bad(format!(
                    "direction {row} has a non-finite value {} at index {col}",
                    chunk[col]
                ));
            }
            let norm = chunk
                .iter()
                .map(|&v| f64::from(v) * f64::from(v))
                .sum::<f64>()
                .sqrt();
            if norm == 0.0 {
                return bad(format!("direction {row} is all zeros and has no direction"));
            }
            unit.extend(chunk.iter().map(|&v| (f64::from(v) / norm) as f32));
        }
        Ok(Self {
            count,
            hidden,
            unit,
        })
    }

    /// How many directions.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Their width.
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// The unit vectors, `[count, hidden]`.
    pub fn unit_vectors(&self) -> &[f32] {
        &self.unit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_come_out_with_unit_length() {
        let d = Directions::new(&[3.0, 4.0, 0.0, 2.0], 2, 2, 2).unwrap();
        assert_eq!(d.unit_vectors(), &[0.6, 0.8, 0.0, 1.0]);
    }

    #[test]
    fn a_wrong_hidden_size_names_both_sizes() {
        let err = Directions::new(&[1.0; 8], 2, 4, 576)
            .unwrap_err()
            .to_string();
        assert!(err.contains("width 4") && err.contains("576"), "{err}");
    }

    #[test]
    fn nan_is_rejected_with_its_position() {
        let err = Directions::new(&[1.0, f32::NAN], 1, 2, 2)
            .unwrap_err()
            .to_string();
        assert!(err.contains("NaN") && err.contains("index 1"), "{err}");
    }

    #[test]
    fn more_than_64_directions_are_rejected() {
        assert!(Directions::new(&vec![1.0; 65], 65, 1, 1).is_err());
    }

    #[test]
    fn a_zero_direction_is_rejected() {
        assert!(Directions::new(&[0.0, 0.0], 1, 2, 2).is_err());
    }
}
