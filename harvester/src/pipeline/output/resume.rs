//! Finding what an earlier run of the same plan left: a finished output (nothing to do) or
//! shards whose records and files check out (skipped).

use std::collections::BTreeMap;

use harvest_core::format::Manifest;
use harvest_core::plan::shard_file_name;

use crate::error::{Error, InputError, Result, StoreError};
use crate::pipeline::assembly::shard::{ShardRecord, sha256_hex};
use crate::pipeline::output::result::{RunResult, Timings};
use crate::pipeline::output::store::Store;
use crate::pipeline::{MANIFEST_FILE, RESULT_FILE};

/// The result of an earlier run of the same plan, if its manifest is there.
pub(in crate::pipeline) async fn finished_result(
    store: &Store,
    fingerprint: &str,
) -> Result<Option<RunResult>> {
    let Some(bytes) = store.get(MANIFEST_FILE).await? else {
        return Ok(None);
    };
    let manifest: Manifest = serde_json::from_slice(&bytes).map_err(|source| {
        Error::Store(StoreError::Json {
            path: MANIFEST_FILE.into(),
            source,
        })
    })?;
    if manifest.plan_fingerprint != fingerprint {
        return Err(Error::Input(InputError::ForeignOutput {
            location: store.location().to_string(),
            found: manifest.plan_fingerprint,
            expected: fingerprint.to_owned(),
        }));
    }
    if let Some(result) = store.get(RESULT_FILE).await?
        && let Ok(result) = serde_json::from_slice::<RunResult>(&result)
    {
        return Ok(Some(result));
    }
    let files: Vec<u64> = match &manifest.train {
        None => manifest.shards.iter().map(|s| s.bytes).collect(),
        Some(train) => train.files.iter().map(|f| f.bytes).collect(),
    };
    Ok(Some(RunResult {
        n_shards: files.len(),
        layout: manifest.layout,
        n_prompts: manifest.n_prompts,
        layer_indices: manifest.layer_indices,
        tokens: manifest.total_tokens,
        bytes_written: files.iter().sum(),
        contents: manifest.contents,
        timings: Timings::default(),
        output: store.location().to_string(),
        resumed_shards: manifest.shards.len(),
        device: None,
        device_reason: None,
    }))
}

/// Shards of an interrupted run of the same plan whose record and file both check out.
pub(in crate::pipeline) async fn resume_scan(
    store: &Store,
    fingerprint: &str,
    n_shards: usize,
) -> Result<BTreeMap<usize, ShardRecord>> {
    let mut done = BTreeMap::new();
    for name in store.list("partial").await? {
        let Some(bytes) = store.get(&name).await? else {
            continue;
        };
        let Some(record) = ShardRecord::from_bytes(&bytes) else {
            tracing::warn!(record = %name, "ignoring an unreadable partial record");
            continue;
        };
        if record.meta.fingerprint != fingerprint {
            return Err(Error::Input(InputError::ForeignOutput {
                location: store.location().to_string(),
                found: record.meta.fingerprint,
                expected: fingerprint.to_owned(),
            }));
        }
        if record.meta.shard >= n_shards || name != ShardRecord::file_name(record.meta.shard) {
            continue;
        }
        let Some(shard) = store.get(&shard_file_name(record.meta.shard)).await? else {
            continue;
        };
        if shard.len() as u64 == record.meta.bytes && sha256_hex(&shard) == record.meta.sha256 {
            done.insert(record.meta.shard, record);
        } else {
            tracing::warn!(
                shard = record.meta.shard,
                "shard does not match its record; recomputing it"
            );
        }
    }
    Ok(done)
}
