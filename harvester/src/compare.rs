//! `harvester compare A B`: two harvests of the same plan agree — the same token ids for every
//! prompt, and every token's captured row within a relative error (`‖a − b‖ / ‖a‖`). This is
//! how a new backend is checked against the CPU reference (the GPU window, `scripts/gpu/run.sh`).

use std::path::Path;

use safetensors::{Dtype, SafeTensors};
use serde::Serialize;

use crate::dtype;
use crate::error::{Error, ModelError, Result};

/// What the comparison found.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Comparison {
    /// Prompts compared.
    pub prompts: usize,
    /// Token rows compared (tokens × kept layers).
    pub rows: usize,
    /// Prompts whose token ids differ.
    pub token_mismatches: usize,
    /// Rows holding a NaN or infinity on either side (never counted as agreeing).
    pub non_finite_rows: usize,
    /// The largest per-row relative error.
    pub max_relative_error: f64,
    /// The mean per-row relative error.
    pub mean_relative_error: f64,
    /// Tokens' expert choices compared (tokens × kept MoE layers), for a job that kept the
    /// router.
    pub routed_tokens: usize,
    /// Of those, the tokens sent to other experts or ranked otherwise: where two keys sat
    /// within the engines' rounding (information: a bf16 run reroutes a few, docs/engine.md).
    pub routed_differently: usize,
}

impl Comparison {
    /// Why the candidate fails the check, if it does: other token ids, non-finite rows, or an
    /// error above `max_relative_error`.
    pub fn failure(&self, max_relative_error: f64) -> Option<String> {
        if self.prompts == 0 {
            return Some("the reference holds no shards to compare".into());
        }
        (self.token_mismatches > 0
            || self.non_finite_rows > 0
            || self.max_relative_error > max_relative_error)
            .then(|| {
                format!(
                    "the harvests differ: {} tensor(s) of token ids, kept positions or roles that differ, {} row(s) with NaN or infinity, largest relative error {:.3e} (allowed {max_relative_error:.0e})",
                    self.token_mismatches, self.non_finite_rows, self.max_relative_error
                )
            })
    }
}

fn values(view: &safetensors::tensor::TensorView<'_>, out: &mut Vec<f32>) -> Result<()> {
    out.clear();
    match view.dtype() {
        Dtype::BF16 => dtype::extend_from_bf16(out, view.data()),
        Dtype::F32 => dtype::extend_from_f32(out, view.data()),
        other => {
            return Err(Error::InvalidBatch {
                reason: format!("a captured tensor has dtype {other:?}, not bf16 or f32"),
            });
        }
    }
    Ok(())
}

fn read(dir: &Path, name: &str) -> Result<Vec<u8>> {
    let path = dir.join(name);
    std::fs::read(&path).map_err(|e| Error::io("reading", path, e))
}

fn parse<'a>(bytes: &'a [u8], dir: &Path, name: &str) -> Result<SafeTensors<'a>> {
    SafeTensors::deserialize(bytes).map_err(|e| {
        Error::Model(ModelError::CorruptSafetensors {
            path: dir.join(name),
            reason: e.to_string(),
        })
    })
}

/// Compares the shards of two local output directories.
pub fn compare(a: &Path, b: &Path) -> Result<Comparison> {
    let mut names: Vec<String> = std::fs::read_dir(a)
        .map_err(|e| Error::io("listing", a, e))?
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("shard_") && n.ends_with(".safetensors"))
        .collect();
    names.sort();
    let mut report = Comparison::default();
    let (mut left, mut right) = (Vec::new(), Vec::new());
    let mut error_sum = 0.0;
    for name in &names {
        let (bytes_a, bytes_b) = (read(a, name)?, read(b, name)?);
        let (shard_a, shard_b) = (parse(&bytes_a, a, name)?, parse(&bytes_b, b, name)?);
        for (tensor, view_a) in shard_a.tensors() {
            let view_b = shard_b.tensor(&tensor).map_err(|_| {
                Error::Model(ModelError::MissingTensor {
                    name: format!("{tensor} of {name}"),
                    dir: b.to_owned(),
                })
            })?;
            // Expert choices: counted per token; their weights and logits follow the choices,
            // so they are not rows of the residual stream to judge.
            if tensor.starts_with("router_") {
                if tensor.starts_with("router_ids_") {
                    compare_routes(&view_a, &view_b, &mut report);
                }
                continue;
            }
            // Ids, kept positions, roles and turns: integers, equal or not.
            if !matches!(view_a.dtype(), Dtype::BF16 | Dtype::F32) {
                report.prompts += usize::from(tensor.starts_with("tokens_"));
                if view_a.data() != view_b.data() || view_a.dtype() != view_b.dtype() {
                    report.token_mismatches += 1;
                }
                continue;
            }
            values(&view_a, &mut left)?;
            values(&view_b, &mut right)?;
            let width = view_a.shape().last().copied().unwrap_or(1).max(1);
            if left.len() != right.len() {
                report.token_mismatches += 1;
                continue;
            }
            for (row_a, row_b) in left.chunks(width).zip(right.chunks(width)) {
                let (mut diff, mut norm) = (0.0f64, 0.0f64);
                for (&x, &y) in row_a.iter().zip(row_b) {
                    diff += f64::from(x - y).powi(2);
                    norm += f64::from(x).powi(2);
                }
                let error = diff.sqrt() / norm.sqrt().max(1e-12);
                report.rows += 1;
                if !error.is_finite() || !row_b.iter().all(|v| v.is_finite()) {
                    report.non_finite_rows += 1;
                    continue;
                }
                report.max_relative_error = report.max_relative_error.max(error);
                error_sum += error;
            }
        }
    }
    if report.rows > 0 {
        report.mean_relative_error = error_sum / report.rows as f64;
    }
    Ok(report)
}

/// Counts the tokens of two `router_ids_i` (`[layers, tokens, k]`) whose choices differ; a
/// shape that differs counts every token.
fn compare_routes(
    a: &safetensors::tensor::TensorView<'_>,
    b: &safetensors::tensor::TensorView<'_>,
    report: &mut Comparison,
) {
    let k = a.shape().last().copied().unwrap_or(1).max(1) * 4;
    let tokens = a.data().len() / k;
    report.routed_tokens += tokens;
    report.routed_differently += if a.shape() == b.shape() {
        let pairs = a.data().chunks(k).zip(b.data().chunks(k));
        pairs.filter(|(x, y)| x != y).count()
    } else {
        tokens
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    fn shard(dir: &Path, rows: &[f32], tokens: &[i32]) {
        std::fs::create_dir_all(dir).unwrap();
        let data: Vec<u8> = rows.iter().flat_map(|v| v.to_le_bytes()).collect();
        let ids: Vec<u8> = tokens.iter().flat_map(|v| v.to_le_bytes()).collect();
        let prompt = TensorView::new(Dtype::F32, vec![1, tokens.len(), 2], &data).unwrap();
        let ids = TensorView::new(Dtype::I32, vec![tokens.len()], &ids).unwrap();
        let bytes =
            safetensors::serialize([("prompt_0", prompt), ("tokens_0", ids)], None).unwrap();
        std::fs::write(dir.join("shard_00000.safetensors"), bytes).unwrap();
    }

    #[test]
    fn identical_harvests_agree_and_a_changed_row_or_token_is_found() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b, c) = (
            dir.path().join("a"),
            dir.path().join("b"),
            dir.path().join("c"),
        );
        shard(&a, &[3.0, 4.0, 1.0, 0.0], &[1, 2]);
        shard(&b, &[3.0, 4.0, 1.0, 0.0], &[1, 2]);
        shard(&c, &[3.0, 4.5, 1.0, 0.0], &[1, 3]);
        let d = dir.path().join("d");
        shard(&d, &[3.0, f32::NAN, 1.0, 0.0], &[1, 2]);
        assert_eq!(
            compare(&a, &d).unwrap().non_finite_rows,
            1,
            "a NaN never agrees"
        );
        let same = compare(&a, &b).unwrap();
        assert_eq!((same.prompts, same.rows, same.token_mismatches), (1, 2, 0));
        assert_eq!(same.max_relative_error, 0.0);
        let differs = compare(&a, &c).unwrap();
        assert_eq!(differs.token_mismatches, 1);
        // Row [3, 4] against [3, 4.5]: 0.5 / 5.
        assert!(
            (differs.max_relative_error - 0.1).abs() < 1e-9,
            "{differs:?}"
        );
    }

    #[test]
    fn a_conversations_roles_are_compared_as_ids_not_as_values() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, roles: &[u8]| {
            let path = dir.path().join(name);
            std::fs::create_dir_all(&path).unwrap();
            let rows: Vec<u8> = [1.0f32, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
            let ids: Vec<u8> = [5i32].iter().flat_map(|v| v.to_le_bytes()).collect();
            let tensors = [
                (
                    "prompt_0",
                    TensorView::new(Dtype::F32, vec![1, 1, 2], &rows).unwrap(),
                ),
                (
                    "tokens_0",
                    TensorView::new(Dtype::I32, vec![1], &ids).unwrap(),
                ),
                (
                    "roles_0",
                    TensorView::new(Dtype::U8, vec![1], roles).unwrap(),
                ),
            ];
            let bytes = safetensors::serialize(tensors, None).unwrap();
            std::fs::write(path.join("shard_00000.safetensors"), bytes).unwrap();
            path
        };
        let (a, b, c) = (write("a", &[3]), write("b", &[3]), write("c", &[2]));
        let same = compare(&a, &b).unwrap();
        assert_eq!((same.prompts, same.rows, same.token_mismatches), (1, 1, 0));
        assert_eq!(compare(&a, &c).unwrap().token_mismatches, 1);
    }

    #[test]
    fn expert_choices_are_counted_per_token_and_their_weights_left_out_of_the_row_errors() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, ids: &[i32], weight: f32| {
            let path = dir.path().join(name);
            std::fs::create_dir_all(&path).unwrap();
            let rows: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            let tokens: Vec<u8> = [5i32, 6].iter().flat_map(|v| v.to_le_bytes()).collect();
            let ids: Vec<u8> = ids.iter().flat_map(|v| v.to_le_bytes()).collect();
            let weights: Vec<u8> = [weight; 4].iter().flat_map(|v| v.to_le_bytes()).collect();
            let tensors = [
                ("prompt_0", Dtype::F32, vec![1, 2, 2], &rows),
                ("tokens_0", Dtype::I32, vec![2], &tokens),
                ("router_ids_0", Dtype::I32, vec![1, 2, 2], &ids),
                ("router_weights_0", Dtype::F32, vec![1, 2, 2], &weights),
            ]
            .map(|(n, d, shape, data)| (n, TensorView::new(d, shape, data).unwrap()));
            let bytes = safetensors::serialize(tensors, None).unwrap();
            std::fs::write(path.join("shard_00000.safetensors"), bytes).unwrap();
            path
        };
        let a = write("a", &[1, 0, 3, 2], 0.5);
        let b = write("b", &[1, 0, 2, 3], 0.7);
        let report = compare(&a, &b).unwrap();
        assert_eq!((report.routed_tokens, report.routed_differently), (2, 1));
        assert_eq!((report.rows, report.token_mismatches), (2, 0));
        assert_eq!(report.max_relative_error, 0.0, "the weights are not rows");
        assert!(
            report.failure(1e-3).is_none(),
            "rerouting alone is information"
        );
    }
}
