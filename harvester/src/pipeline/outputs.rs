//! The run's closing files: `stats.safetensors` (per-shard statistics merged in shard order) and
//! the manifest, both built from the shards' records.

use std::collections::BTreeMap;

use harvest_core::RunningStats;
use harvest_core::format::{
    self, Contents, FileDigest, Manifest, ModelInfo, ProjectionInfo, ShardEntry, TokenizerInfo,
};
use harvest_core::plan::shard_file_name;

use super::Job;
use super::shard::ShardRecord;
use crate::error::{Error, Result};
use crate::model::ModelConfig;

/// The manifest and `stats.safetensors` from every shard's record.
pub(super) fn build_outputs(
    job: &Job<'_>,
    config: &ModelConfig,
    records: &BTreeMap<usize, ShardRecord>,
    model_name: &str,
    max_tokens: usize,
) -> Result<(Manifest, Vec<u8>)> {
    if records.len() != job.n_shards {
        return Err(Error::StageLost { stage: "upload" });
    }
    let mut stats: Vec<RunningStats> = (0..job.layers)
        .map(|_| RunningStats::new(job.width))
        .collect();
    for record in records.values() {
        for (total, part) in stats.iter_mut().zip(&record.stats) {
            total.merge(part);
        }
    }
    let total_tokens: u64 = records
        .values()
        .flat_map(|r| &r.token_counts)
        .map(|&n| n as u64)
        .sum();
    let manifest = Manifest {
        format_version: format::FORMAT_VERSION,
        plan_fingerprint: job.fingerprint.to_owned(),
        model: ModelInfo {
            name: model_name.to_owned(),
            architecture: config.architecture.hf_name().to_owned(),
            num_layers: config.num_layers,
            hidden_size: config.hidden_size,
        },
        tokenizer: TokenizerInfo {
            add_special_tokens: job.plan.add_special_tokens,
            bos_token_id: job.bos_id,
            bos: format::bos_treatment(job.plan.add_special_tokens, job.bos_id),
            max_tokens,
        },
        contents: job.contents,
        dtype: job.contents.dtype().to_owned(),
        layer_indices: job.plan.layers.as_slice().to_vec(),
        layer_convention: format::LAYER_CONVENTION.to_owned(),
        tensors: format::tensors_description(job.contents).to_owned(),
        n_prompts: job.encoded.len(),
        shard_size: job.plan.shard_size.get(),
        total_tokens,
        shards: records.values().map(|r| shard_entry(job, r)).collect(),
        truncated_prompts: records
            .values()
            .flat_map(|r| r.truncations.clone())
            .collect(),
        projection: (job.contents == Contents::Projections).then_some(ProjectionInfo {
            n_directions: job.width,
            normalized: true,
        }),
        statistics: job.contents.statistics().to_owned(),
        stats_tokens: stats.first().map_or(0, RunningStats::count),
        mean_token_norm: stats.iter().map(RunningStats::mean_norm).collect(),
        stats_file: None,
    };
    let stats_bytes = stats_file(&stats)?;
    let manifest = Manifest {
        stats_file: Some(FileDigest {
            file: super::STATS_FILE.to_owned(),
            bytes: stats_bytes.len() as u64,
            sha256: super::shard::sha256_hex(&stats_bytes),
        }),
        ..manifest
    };
    Ok((manifest, stats_bytes))
}

/// A shard's manifest entry, from its record.
fn shard_entry(job: &Job<'_>, record: &ShardRecord) -> ShardEntry {
    let (prompts, tensors) = ShardEntry::contents_of(
        record.first_prompt,
        &record.token_counts,
        job.contents,
        job.layers,
        job.width,
    );
    ShardEntry {
        file: shard_file_name(record.shard),
        first_prompt: record.first_prompt,
        token_counts: record.token_counts.clone(),
        prompts,
        tensors,
        bytes: record.bytes,
        sha256: record.sha256.clone(),
    }
}

/// `stats.safetensors`: `mean` and `std` as f32 `[layers, width]`, `count` as i64 `[1]`.
pub(super) fn stats_file(stats: &[RunningStats]) -> Result<Vec<u8>> {
    use safetensors::{Dtype, tensor::TensorView};
    let width = stats.first().map_or(0, |s| s.mean().len());
    let mean: Vec<u8> = stats
        .iter()
        .flat_map(|s| {
            s.mean()
                .iter()
                .flat_map(|&v| (v as f32).to_le_bytes())
                .collect::<Vec<_>>()
        })
        .collect();
    let std: Vec<u8> = stats
        .iter()
        .flat_map(|s| s.std().into_iter().flat_map(|v| (v as f32).to_le_bytes()))
        .collect();
    let count = (stats.first().map_or(0, RunningStats::count) as i64).to_le_bytes();
    let invalid = |e: safetensors::SafeTensorError| Error::InvalidBatch {
        reason: e.to_string(),
    };
    let views = vec![
        (
            "mean",
            TensorView::new(Dtype::F32, vec![stats.len(), width], &mean).map_err(invalid)?,
        ),
        (
            "std",
            TensorView::new(Dtype::F32, vec![stats.len(), width], &std).map_err(invalid)?,
        ),
        (
            "count",
            TensorView::new(Dtype::I64, vec![1], &count).map_err(invalid)?,
        ),
    ];
    safetensors::serialize(
        views,
        Some(std::collections::HashMap::from([(
            "format".to_owned(),
            "pt".to_owned(),
        )])),
    )
    .map_err(invalid)
}
