//! A run in progress: the per-shard records a worker leaves under `partial/`, and which shards
//! they make ready to read before the job ends.
//!
//! A worker stores a shard's file first and its record second, so a record whose shard file is
//! there at the recorded size marks a shard that will never change: resume keeps it, and
//! finalize neither moves nor rewrites it. The API lists exactly those (`?partial=true`).
//! Everything here is pure; the record's bytes come from whoever reads the store.

use serde::{Deserialize, Serialize};

use crate::format::Truncation;
use crate::plan::shard_file_name;
use crate::selection::Dropped;

/// The folder under a job's output that holds its shard records while it runs.
pub const PARTIAL_DIR: &str = "partial";

/// The safetensors metadata key that holds a record's [`RecordMeta`] as JSON.
pub const RECORD_KEY: &str = "record";

/// Bytes of a safetensors file's length prefix.
pub const HEADER_PREFIX_BYTES: usize = 8;

/// The file name of shard `shard`'s record, under the output prefix.
pub fn record_file_name(shard: usize) -> String {
    format!("{PARTIAL_DIR}/shard_{shard:05}.record.safetensors")
}

/// The shard a record file name stands for (`partial/shard_00003.record.safetensors` is 3).
pub fn record_shard(name: &str) -> Option<usize> {
    let digits = name
        .strip_prefix(PARTIAL_DIR)?
        .strip_prefix('/')?
        .strip_prefix("shard_")?
        .strip_suffix(".record.safetensors")?;
    (digits.len() == 5 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

/// What a shard record says of its shard, besides the exact partial statistics (which are its
/// tensors).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordMeta {
    /// Shard number.
    pub shard: usize,
    /// Global index of its first prompt.
    pub first_prompt: usize,
    /// Tokens per prompt.
    pub token_counts: Vec<usize>,
    /// Prompts cut to the context window.
    pub truncations: Vec<Truncation>,
    /// Hex sha256 of the shard file.
    pub sha256: String,
    /// Shard file size.
    pub bytes: u64,
    /// Tokens counted in the statistics, per slot.
    pub counts: Vec<u64>,
    /// The plan that produced it.
    pub fingerprint: String,
    /// Tokens kept per prompt, when the job selects tokens.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kept_counts: Vec<usize>,
    /// What the selection dropped.
    #[serde(default)]
    pub dropped: Dropped,
    /// The tokenizer's BOS id: a reader drops a prompt's leading BOS by the statistics' rule
    /// before the manifest exists (absent in records written before it was kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bos_token_id: Option<u32>,
}

/// Why a record's header could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordHeaderError {
    /// The first `needed` bytes hold the whole header; fewer were given.
    #[error("the header needs the first {needed} bytes")]
    Short {
        /// Bytes to read from the start of the file.
        needed: usize,
    },
    /// Not a shard record.
    #[error("not a shard record: {reason}")]
    Invalid {
        /// What is wrong.
        reason: String,
    },
}

/// The [`RecordMeta`] of a record file, from its first bytes: all of the header, which comes
/// before the statistics' tensors, so a reader never has to fetch those.
pub fn record_meta(head: &[u8]) -> Result<RecordMeta, RecordHeaderError> {
    let invalid = |reason: String| RecordHeaderError::Invalid { reason };
    let prefix: [u8; HEADER_PREFIX_BYTES] = head
        .get(..HEADER_PREFIX_BYTES)
        .and_then(|p| p.try_into().ok())
        .ok_or(RecordHeaderError::Short {
            needed: HEADER_PREFIX_BYTES,
        })?;
    let len = usize::try_from(u64::from_le_bytes(prefix))
        .map_err(|_| invalid("header length overflows".into()))?;
    let needed = HEADER_PREFIX_BYTES
        .checked_add(len)
        .ok_or_else(|| invalid("header length overflows".into()))?;
    let header = head
        .get(HEADER_PREFIX_BYTES..needed)
        .ok_or(RecordHeaderError::Short { needed })?;
    #[derive(Deserialize)]
    struct Header {
        #[serde(rename = "__metadata__")]
        metadata: std::collections::BTreeMap<String, String>,
    }
    let header: Header =
        serde_json::from_slice(header).map_err(|e| invalid(format!("header: {e}")))?;
    let meta = header
        .metadata
        .get(RECORD_KEY)
        .ok_or_else(|| invalid(format!("no `{RECORD_KEY}` in the metadata")))?;
    serde_json::from_str(meta).map_err(|e| invalid(format!("record: {e}")))
}

/// A shard that will not change before the job ends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReadyShard {
    /// Shard number.
    pub shard: usize,
    /// Its file name under the output prefix.
    pub file: String,
    /// Its first and last prompt (global indices, inclusive).
    pub prompts: [usize; 2],
    /// Its size.
    pub bytes: u64,
    /// Its hex sha256.
    pub sha256: String,
}

/// The ready shards, in shard order: those with a readable record whose shard file is listed
/// at the recorded size. `files` are the output's top-level files with their sizes, `records`
/// the parsed records (one per record file).
pub fn ready_shards<'a>(
    files: &std::collections::BTreeMap<String, u64>,
    records: impl IntoIterator<Item = &'a RecordMeta>,
) -> Vec<ReadyShard> {
    let mut ready: Vec<ReadyShard> = records
        .into_iter()
        .filter(|r| !r.token_counts.is_empty())
        .filter_map(|record| {
            let file = shard_file_name(record.shard);
            (files.get(&file) == Some(&record.bytes)).then(|| ReadyShard {
                shard: record.shard,
                prompts: [
                    record.first_prompt,
                    record.first_prompt + record.token_counts.len() - 1,
                ],
                file,
                bytes: record.bytes,
                sha256: record.sha256.clone(),
            })
        })
        .collect();
    ready.sort_by_key(|r| r.shard);
    ready.dedup_by_key(|r| r.shard);
    ready
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn meta(shard: usize, bytes: u64) -> RecordMeta {
        RecordMeta {
            shard,
            first_prompt: shard * 2,
            token_counts: vec![5, 7],
            truncations: vec![],
            sha256: format!("{shard:064}"),
            bytes,
            counts: vec![10],
            fingerprint: "fp".into(),
            kept_counts: vec![],
            dropped: Dropped::default(),
            bos_token_id: Some(1),
        }
    }

    /// A record file as a worker writes one: length, JSON header, then the tensors' bytes.
    fn record_file(meta: &RecordMeta) -> Vec<u8> {
        let header = serde_json::json!({
            "__metadata__": {RECORD_KEY: serde_json::to_string(meta).unwrap()},
            "mean": {"dtype": "F64", "shape": [1, 1], "data_offsets": [0, 8]},
        })
        .to_string();
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend(header.as_bytes());
        bytes.extend(0f64.to_le_bytes());
        bytes
    }

    #[test]
    fn a_record_header_reads_back_from_the_first_bytes_alone() {
        let file = record_file(&meta(3, 100));
        let needed = match record_meta(&file[..4]) {
            Err(RecordHeaderError::Short { needed }) => needed,
            other => panic!("{other:?}"),
        };
        assert_eq!(needed, HEADER_PREFIX_BYTES);
        let needed = match record_meta(&file[..needed]) {
            Err(RecordHeaderError::Short { needed }) => needed,
            other => panic!("{other:?}"),
        };
        assert_eq!(needed, file.len() - 8, "everything but the tensor bytes");
        assert_eq!(record_meta(&file[..needed]).unwrap(), meta(3, 100));
    }

    #[test]
    fn a_file_that_is_not_a_record_is_invalid_not_short() {
        let mut file = record_file(&meta(0, 1));
        file[8] = b'x';
        assert!(matches!(
            record_meta(&file),
            Err(RecordHeaderError::Invalid { .. })
        ));
    }

    #[test]
    fn a_shard_is_ready_only_when_its_file_is_there_at_the_recorded_size() {
        let files = BTreeMap::from([
            (shard_file_name(0), 100),
            (shard_file_name(1), 99),
            (shard_file_name(3), 100),
        ]);
        let records = [meta(3, 100), meta(0, 100), meta(1, 100), meta(2, 100)];
        let ready = ready_shards(&files, &records);
        let shards: Vec<usize> = ready.iter().map(|r| r.shard).collect();
        assert_eq!(shards, [0, 3], "1 is still being written, 2 has no file");
        assert_eq!(ready[1].prompts, [6, 7]);
        assert_eq!(ready[1].file, "shard_00003.safetensors");
    }

    #[test]
    fn record_file_names_name_their_shard_and_nothing_else_does() {
        assert_eq!(record_shard(&record_file_name(42)), Some(42));
        for other in [
            "partial/shard_42.record.safetensors",
            "shard_00042.safetensors",
            "partial/shard_0004x.record.safetensors",
        ] {
            assert_eq!(record_shard(other), None, "{other}");
        }
    }
}
