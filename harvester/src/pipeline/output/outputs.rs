//! The run's closing files: `stats.safetensors` (per-shard statistics merged in shard order) and
//! the manifest, both built from the shards' records.

use std::collections::BTreeMap;

use harvest_core::format::{
    self, Contents, FileDigest, Manifest, ModelInfo, ProjectionInfo, SelectionInfo, ShardEntry,
    SiteInfo, TokenizerInfo, TrainFile, TrainInfo,
};
use harvest_core::layout::Layout;
use harvest_core::plan::shard_file_name;
use harvest_core::selection::Dropped;
use harvest_core::{RunningStats, Site, Sites};

use crate::error::{Error, Result};
use crate::model::ModelConfig;
use crate::pipeline::Job;
use crate::pipeline::assembly::shard::ShardRecord;
use crate::pipeline::assembly::shuffle::TrainFiles;

/// The manifest and `stats.safetensors` from every shard's record.
pub(in crate::pipeline) fn build_outputs(
    job: &Job<'_>,
    config: &ModelConfig,
    records: &BTreeMap<usize, ShardRecord>,
    model_name: &str,
    max_tokens: usize,
    train: Option<&TrainFiles>,
) -> Result<(Manifest, Vec<u8>)> {
    if records.len() != job.n_shards {
        return Err(Error::ThreadLost { thread: "upload" });
    }
    let stats = merged_stats(job, records);
    let counts = records.values().flat_map(|r| &r.meta.token_counts);
    let total_tokens: u64 = counts.map(|&n| n as u64).sum();
    let sites = &job.plan.options.sites;
    let site_entries = site_entries(job, &stats);
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
            add_special_tokens: job.plan.options.add_special_tokens,
            bos_token_id: job.bos_id,
            bos: format::bos_treatment(job.plan.options.add_special_tokens, job.bos_id),
            max_tokens,
        },
        contents: job.contents,
        dtype: job.contents.dtype().to_owned(),
        layer_indices: job.plan.options.layers.as_slice().to_vec(),
        layer_convention: format::LAYER_CONVENTION.to_owned(),
        tensors: format::tensors_description(job.contents, sites),
        n_prompts: job.encoded.len(),
        shard_size: job.plan.options.shard_size.get(),
        total_tokens,
        shards: match train {
            None => records.values().map(|r| shard_entry(job, r)).collect(),
            Some(_) => Vec::new(),
        },
        truncated_prompts: records
            .values()
            .flat_map(|r| r.meta.truncations.clone())
            .collect(),
        projection: (job.contents == Contents::Projections).then_some(ProjectionInfo {
            n_directions: job.width,
            normalized: true,
        }),
        statistics: format::statistics_description(job.contents, sites),
        stats_tokens: stats.first().map_or(0, RunningStats::count),
        mean_token_norm: site_entries
            .iter()
            .find(|entry| entry.site == Site::ResidPost)
            .map_or_else(Vec::new, |entry| entry.mean_token_norm.clone()),
        stats_file: None,
        sites: site_entries,
        selection: selection_info(job, records),
        layout: job.plan.options.layout.name(),
        train: train.map(|t| train_info(job, t)),
        precision: job.plan.options.precision.unwrap_or_default(),
        job_uid: None,
        roles: job.conversations.then(format::RolesInfo::of_conversations),
        router: job.router.clone(),
    };
    let stats_bytes = stats_file(&stats, sites)?;
    let manifest = Manifest {
        stats_file: Some(FileDigest {
            file: crate::pipeline::STATS_FILE.to_owned(),
            bytes: stats_bytes.len() as u64,
            sha256: crate::pipeline::assembly::shard::sha256_hex(&stats_bytes),
        }),
        ..manifest
    };
    Ok((manifest, stats_bytes))
}

/// The manifest's selection block: the rules, the norm filter's layer, and what was kept and
/// dropped over every shard.
fn selection_info(job: &Job<'_>, records: &BTreeMap<usize, ShardRecord>) -> Option<SelectionInfo> {
    let rules = job.plan.options.selection;
    if rules.is_everything() {
        return None;
    }
    let mut dropped = Dropped::default();
    for record in records.values() {
        dropped.add(&record.meta.dropped);
    }
    Some(SelectionInfo {
        rules,
        norm_layer: rules
            .max_norm_multiple
            .map(|_| job.plan.options.layers.deepest()),
        kept_tokens: records
            .values()
            .flat_map(|r| &r.meta.kept_counts)
            .map(|&n| n as u64)
            .sum(),
        dropped,
    })
}

/// The manifest's training files block.
fn train_info(job: &Job<'_>, train: &TrainFiles) -> TrainInfo {
    let (rows_per_file, seed) = match job.plan.options.layout {
        Layout::Shuffled {
            rows_per_file,
            seed,
        } => (rows_per_file.get(), seed),
        Layout::ByPrompt => (0, 0),
    };
    TrainInfo {
        seed,
        rows_per_file,
        rows: train.rows.iter().map(|&n| n as u64).sum(),
        tensors: train.tensors.clone(),
        files: train
            .files
            .iter()
            .zip(&train.rows)
            .map(|(f, &rows)| TrainFile {
                file: f.file.clone(),
                rows,
                bytes: f.bytes,
                sha256: f.sha256.clone(),
            })
            .collect(),
    }
}

/// Every shard's statistics merged in shard order, slot by slot.
fn merged_stats(job: &Job<'_>, records: &BTreeMap<usize, ShardRecord>) -> Vec<RunningStats> {
    let mut stats: Vec<RunningStats> = (0..job.slots)
        .map(|_| RunningStats::new(job.width))
        .collect();
    for record in records.values() {
        for (total, part) in stats.iter_mut().zip(&record.stats) {
            total.merge(part);
        }
    }
    stats
}

/// The manifest's site entries. Slots are site-major: site `s` holds
/// `stats[s * layers..(s + 1) * layers]`.
fn site_entries(job: &Job<'_>, stats: &[RunningStats]) -> Vec<SiteInfo> {
    job.plan
        .options
        .sites
        .as_slice()
        .iter()
        .zip(stats.chunks(job.layers.max(1)))
        .map(|(&site, site_stats)| {
            SiteInfo::new(
                site,
                site_stats.iter().map(RunningStats::mean_norm).collect(),
            )
        })
        .collect()
}

/// A shard's manifest entry, from its record.
fn shard_entry(job: &Job<'_>, record: &ShardRecord) -> ShardEntry {
    let selecting = !job.plan.options.selection.is_everything();
    let (prompts, tensors) = ShardEntry::contents_of(
        record.meta.first_prompt,
        &record.meta.token_counts,
        selecting.then_some(record.meta.kept_counts.as_slice()),
        (job.contents, &job.plan.options.sites),
        (job.layers, job.width),
        (job.conversations, job.router.as_ref()),
    );
    ShardEntry {
        file: shard_file_name(record.meta.shard),
        first_prompt: record.meta.first_prompt,
        token_counts: record.meta.token_counts.clone(),
        kept_counts: record.meta.kept_counts.clone(),
        prompts,
        tensors,
        bytes: record.meta.bytes,
        sha256: record.meta.sha256.clone(),
    }
}

/// `stats.safetensors`: each site's mean and std as f32 `[layers, width]` (`mean` and `std` for
/// `resid_post`, [`format::stats_names`] for the others), `count` as i64 `[1]`. `stats` is
/// site-major, as [`Sites::as_slice`] orders the sites.
pub(in crate::pipeline) fn stats_file(stats: &[RunningStats], sites: &Sites) -> Result<Vec<u8>> {
    use safetensors::{Dtype, tensor::TensorView};
    let width = stats.first().map_or(0, |s| s.mean().len());
    let layers = stats.len() / sites.len().max(1);
    let f32_bytes = |values: &mut dyn Iterator<Item = f64>| -> Vec<u8> {
        values.flat_map(|v| (v as f32).to_le_bytes()).collect()
    };
    let mut tensors = Vec::with_capacity(2 * sites.len());
    for (&site, site_stats) in sites.as_slice().iter().zip(stats.chunks(layers.max(1))) {
        let (mean_name, std_name) = format::stats_names(site);
        let mean = f32_bytes(&mut site_stats.iter().flat_map(|s| s.mean().iter().copied()));
        let std = f32_bytes(&mut site_stats.iter().flat_map(RunningStats::std));
        tensors.push((mean_name, mean));
        tensors.push((std_name, std));
    }
    let count = (stats.first().map_or(0, RunningStats::count) as i64).to_le_bytes();
    let invalid = |e: safetensors::SafeTensorError| Error::InvalidBatch {
        reason: e.to_string(),
    };
    let mut views = Vec::with_capacity(tensors.len() + 1);
    for (name, bytes) in &tensors {
        let view = TensorView::new(Dtype::F32, vec![layers, width], bytes).map_err(invalid)?;
        views.push((name.clone(), view));
    }
    views.push((
        "count".to_owned(),
        TensorView::new(Dtype::I64, vec![1], &count).map_err(invalid)?,
    ));
    safetensors::serialize(
        views,
        Some(std::collections::HashMap::from([(
            "format".to_owned(),
            "pt".to_owned(),
        )])),
    )
    .map_err(invalid)
}
