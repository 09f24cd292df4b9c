//! Closing a job: training files for the shuffled layout, statistics, the manifest (the commit
//! point), `result.json`, and the partial records removed.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use bytes::Bytes;
use harvest_core::format::Manifest;
use harvest_core::layout::Layout;
use harvest_core::plan::shard_file_name;

use crate::error::{Error, InputError, Result, StoreError};
use crate::model::ModelConfig;
use crate::pipeline::assembly::shard::ShardRecord;
use crate::pipeline::assembly::shuffle;
use crate::pipeline::output::outputs;
use crate::pipeline::output::result::{RESULT_FILE, RunResult, Timings};
use crate::pipeline::output::store::Store;
use crate::pipeline::{Job, MANIFEST_FILE, STATS_FILE};

/// What the closing files are made of.
pub(in crate::pipeline) struct Closing<'a> {
    pub(in crate::pipeline) job: &'a Job<'a>,
    pub(in crate::pipeline) config: &'a ModelConfig,
    pub(in crate::pipeline) records: &'a BTreeMap<usize, ShardRecord>,
    pub(in crate::pipeline) model_name: String,
    pub(in crate::pipeline) max_tokens: usize,
    pub(in crate::pipeline) timings: Timings,
    pub(in crate::pipeline) resumed_shards: usize,
    pub(in crate::pipeline) spill_dir: Option<std::path::PathBuf>,
    pub(in crate::pipeline) temp_dir: Option<std::path::PathBuf>,
    pub(in crate::pipeline) job_uid: Option<String>,
    /// Where the forward pass ran, and why `auto` chose it.
    pub(in crate::pipeline) device: crate::backend::cuda::DeviceChoice,
    pub(in crate::pipeline) device_reason: Option<String>,
}

/// Writes the statistics, then the manifest (the commit point), then `result.json`, and
/// removes the partial records.
pub(in crate::pipeline) fn commit(
    closing: &Closing<'_>,
    store: &Store,
    runtime: &tokio::runtime::Runtime,
) -> Result<RunResult> {
    let Closing { job, records, .. } = closing;
    let finish_start = Instant::now();
    let spill = (closing.spill_dir.as_deref(), closing.temp_dir.as_deref());
    let train = train_files(job, records, store, runtime, spill)?;
    let (manifest, stats_bytes) = outputs::build_outputs(
        job,
        closing.config,
        records,
        &closing.model_name,
        closing.max_tokens,
        train.as_ref(),
    )?;
    let manifest = Manifest {
        job_uid: closing.job_uid.clone(),
        ..manifest
    };
    let manifest_bytes = serde_json::to_vec_pretty(&manifest).map_err(|source| {
        Error::Store(StoreError::Json {
            path: MANIFEST_FILE.into(),
            source,
        })
    })?;
    let save_s = closing.timings.save_s + finish_start.elapsed().as_secs_f64();
    let shard_bytes: u64 = match &train {
        None => records.values().map(|r| r.meta.bytes).sum(),
        Some(train) => train.files.iter().map(|f| f.bytes).sum(),
    };
    let bytes_written = shard_bytes + (stats_bytes.len() + manifest_bytes.len()) as u64;
    let upload_start = Instant::now();
    runtime.block_on(async {
        store.put(STATS_FILE, Bytes::from(stats_bytes)).await?;
        store.put(MANIFEST_FILE, Bytes::from(manifest_bytes)).await
    })?;
    let result = RunResult {
        n_shards: train.as_ref().map_or(job.n_shards, |t| t.files.len()),
        layout: job.plan.options.layout.name(),
        n_prompts: manifest.n_prompts,
        layer_indices: job.plan.options.layers.as_slice().to_vec(),
        tokens: manifest.total_tokens,
        bytes_written,
        contents: job.contents,
        timings: Timings {
            save_s,
            upload_s: closing.timings.upload_s + upload_start.elapsed().as_secs_f64(),
            ..closing.timings.clone()
        },
        output: job.plan.output.to_string(),
        resumed_shards: closing.resumed_shards,
        device: Some(closing.device.to_string()),
        device_reason: closing.device_reason.clone(),
    };
    let result_bytes = serde_json::to_vec_pretty(&result).map_err(|source| {
        Error::Store(StoreError::Json {
            path: RESULT_FILE.into(),
            source,
        })
    })?;
    runtime.block_on(async {
        store.put(RESULT_FILE, Bytes::from(result_bytes)).await?;
        for shard in 0..job.n_shards {
            if let Err(e) = store.delete(&ShardRecord::file_name(shard)).await {
                tracing::warn!(error = %e, shard, "could not remove a partial record");
            }
            // The shuffled layout's shards were only the first phase.
            if train.is_some()
                && let Err(e) = store.delete(&shard_file_name(shard)).await
            {
                tracing::warn!(error = %e, shard, "could not remove a staged shard");
            }
        }
        Ok::<_, Error>(())
    })?;
    Ok(result)
}

/// The shuffled layout's training files, made from the shards; none for the by-prompt layout.
fn train_files(
    job: &Job<'_>,
    records: &BTreeMap<usize, ShardRecord>,
    store: &Store,
    runtime: &tokio::runtime::Runtime,
    (spill_dir_given, temp_dir): (Option<&Path>, Option<&Path>),
) -> Result<Option<shuffle::TrainFiles>> {
    match job.plan.options.layout {
        Layout::ByPrompt => Ok(None),
        Layout::Shuffled {
            rows_per_file,
            seed,
        } => {
            let spill = match spill_dir_given {
                // A directory the operator named may be shared: only our own subdirectory goes.
                Some(dir) => shuffle::SpillDir {
                    path: dir.to_owned(),
                    owned: false,
                },
                None => spill_dir(&job.plan.output, temp_dir)?,
            };
            let files = shuffle::write_train_files(
                job,
                records,
                store,
                runtime,
                rows_per_file,
                seed,
                &spill,
            )?;
            Ok(Some(files))
        }
    }
}

/// Where the shuffle spills its buckets when no directory was named: `.shuffle/` in a local
/// output (the job's own, so what a killed run left there is cleared first), else the system's
/// temp dir (`temp_dir`, which `main` reads).
pub(in crate::pipeline) fn spill_dir(
    output: &harvest_core::Location,
    temp_dir: Option<&Path>,
) -> Result<shuffle::SpillDir> {
    match (output, temp_dir) {
        (harvest_core::Location::Local(dir), _) => Ok(shuffle::SpillDir {
            path: dir.join(".shuffle"),
            owned: true,
        }),
        (harvest_core::Location::S3 { .. }, Some(temp)) => Ok(shuffle::SpillDir {
            path: temp.to_owned(),
            owned: false,
        }),
        (harvest_core::Location::S3 { .. }, None) => Err(Error::Input(InputError::NoSpillDir {
            output: output.to_string(),
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_s3_job_spills_in_the_temp_dir_it_is_given_and_is_refused_without_one() {
        let s3 = harvest_core::Location::parse("s3://bucket/job", "output").unwrap();
        let spill = spill_dir(&s3, Some(Path::new("/scratch"))).unwrap();
        assert_eq!(
            (spill.path.as_path(), spill.owned),
            (Path::new("/scratch"), false)
        );
        let error = spill_dir(&s3, None).err().unwrap().to_string();
        assert!(
            error.contains("s3://bucket/job") && error.contains("--spill-dir"),
            "{error}"
        );
        let local = harvest_core::Location::parse("/out", "output").unwrap();
        let spill = spill_dir(&local, None).unwrap();
        assert_eq!(
            (spill.path.as_path(), spill.owned),
            (Path::new("/out/.shuffle"), true)
        );
    }
}
