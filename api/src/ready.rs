//! The shards of a job that are ready before it ends (`GET /v1/harvest/{id}?partial=true`):
//! read from the records its workers leave under `partial/`, on either backend's storage.
//! Which records make a shard ready is decided in `harvest_core::partial`; this module only
//! reads the listings and the records' headers, and remembers headers it has read.

use std::collections::HashMap;
use std::sync::Mutex;

use harvest_core::partial::{
    self, PARTIAL_DIR, ReadyShard, RecordHeaderError, RecordMeta, record_shard,
};

use crate::storage::Storage;

/// Record headers remembered, all jobs together; past it the memory starts over. A record's
/// header is a few kilobytes (its prompts' token counts), so this bounds the cache near 100 MB
/// at worst.
pub const RECORD_CACHE_ENTRIES: usize = 20_000;

/// Bytes read first from a record: its whole header unless its shard holds thousands of
/// prompts, when a second read fetches the rest.
const FIRST_READ_BYTES: u64 = 16 * 1024;

/// What a running job has ready.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ready {
    /// The ready shards, in shard order.
    pub shards: Vec<ReadyShard>,
    /// The tokenizer's BOS id the worker used, from its records (`None` before any record, or
    /// for a model without one).
    pub bos_token_id: Option<u32>,
}

/// Record headers already read, by job and record file name, with the record's size: a
/// record rewritten at another size is read again.
#[derive(Debug, Default)]
pub struct RecordCache {
    headers: Mutex<HashMap<(String, String), (u64, RecordMeta)>>,
}

impl RecordCache {
    fn get(&self, id: &str, name: &str, size: u64) -> Option<RecordMeta> {
        let headers = self.headers.lock().unwrap_or_else(|e| e.into_inner());
        headers
            .get(&(id.to_owned(), name.to_owned()))
            .filter(|(at, _)| *at == size)
            .map(|(_, meta)| meta.clone())
    }

    fn put(&self, id: &str, name: &str, size: u64, meta: RecordMeta) {
        let mut headers = self.headers.lock().unwrap_or_else(|e| e.into_inner());
        if headers.len() >= RECORD_CACHE_ENTRIES {
            headers.clear();
        }
        headers.insert((id.to_owned(), name.to_owned()), (size, meta));
    }

    /// Forgets job `id`'s records (it ended: its records are gone).
    pub fn forget(&self, id: &str) {
        let mut headers = self.headers.lock().unwrap_or_else(|e| e.into_inner());
        headers.retain(|(job, _), _| job != id);
    }
}

/// What job `id` has ready in `storage`. An unreadable record is left out (it is being
/// written, or it is not ours), never an error: the next answer lists it once it reads.
pub async fn scan(storage: &Storage, id: &str, cache: &RecordCache) -> Result<Ready, String> {
    let records = storage.list_output(id, PARTIAL_DIR).await?;
    let files = storage.list_output(id, "").await?;
    let mut metas = Vec::with_capacity(records.len());
    for (name, &size) in &records {
        if record_shard(name).is_none() {
            continue;
        }
        if let Some(meta) = cache.get(id, name, size) {
            metas.push(meta);
            continue;
        }
        if let Some(meta) = read_header(storage, id, name, size).await? {
            cache.put(id, name, size, meta.clone());
            metas.push(meta);
        }
    }
    Ok(Ready {
        bos_token_id: metas.iter().find_map(|m| m.bos_token_id),
        shards: partial::ready_shards(&files, &metas),
    })
}

/// A record's header, in one read or two; `None` when the record is gone or unreadable.
async fn read_header(
    storage: &Storage,
    id: &str,
    name: &str,
    size: u64,
) -> Result<Option<RecordMeta>, String> {
    let mut want = FIRST_READ_BYTES.min(size);
    loop {
        let Some(head) = storage.read_output_head(id, name, want).await? else {
            return Ok(None);
        };
        match partial::record_meta(&head) {
            Ok(meta) => return Ok(Some(meta)),
            Err(RecordHeaderError::Short { needed })
                if (needed as u64) > want && (needed as u64) <= size =>
            {
                want = needed as u64;
            }
            Err(error) => {
                tracing::debug!(job = %id, record = %name, %error, "record not readable yet");
                return Ok(None);
            }
        }
    }
}

/// The files of `ready` by name, for link signing.
pub fn file_names(ready: &Ready) -> Vec<String> {
    ready.shards.iter().map(|s| s.file.clone()).collect()
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use harvest_core::plan::shard_file_name;
    use harvest_core::selection::Dropped;

    use super::*;
    use crate::paths::JobPaths;

    const JOB: &str = "0b0e4d1c-3f1a-4c6e-9d7b-2a1f0e9c8b7a";

    fn meta(shard: usize, bytes: u64, prompts: usize) -> RecordMeta {
        RecordMeta {
            shard,
            first_prompt: shard * prompts,
            token_counts: vec![3; prompts],
            truncations: vec![],
            sha256: "ab".repeat(32),
            bytes,
            counts: vec![1],
            fingerprint: "fp".into(),
            kept_counts: vec![],
            dropped: Dropped::default(),
            bos_token_id: Some(1),
        }
    }

    /// Writes a record as the worker does: header first, then (here, stand-in) tensor bytes.
    fn write_record(out: &Path, meta: &RecordMeta) {
        let header = serde_json::json!({
            "__metadata__": {"record": serde_json::to_string(meta).unwrap()},
            "mean": {"dtype": "F64", "shape": [1, 1], "data_offsets": [0, 8]},
        })
        .to_string();
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend(header.as_bytes());
        bytes.extend([0; 8]);
        std::fs::create_dir_all(out.join(PARTIAL_DIR)).unwrap();
        std::fs::write(out.join(partial::record_file_name(meta.shard)), bytes).unwrap();
    }

    #[tokio::test]
    async fn a_local_output_lists_the_shards_whose_records_and_files_agree() {
        let root = tempfile::tempdir().unwrap();
        let storage = Storage::Local {
            root: root.path().to_owned(),
        };
        let cache = RecordCache::default();
        assert_eq!(scan(&storage, JOB, &cache).await.unwrap(), Ready::default());
        let out = JobPaths::new(root.path(), JOB).output();
        std::fs::create_dir_all(&out).unwrap();
        std::fs::write(out.join(shard_file_name(0)), [7; 10]).unwrap();
        std::fs::write(out.join(shard_file_name(1)), [7; 4]).unwrap();
        write_record(&out, &meta(0, 10, 2));
        write_record(&out, &meta(1, 10, 2));
        std::fs::write(out.join("partial/shard_00002.record.safetensors"), b"half").unwrap();
        let ready = scan(&storage, JOB, &cache).await.unwrap();
        assert_eq!(ready.bos_token_id, Some(1));
        assert_eq!(file_names(&ready), ["shard_00000.safetensors"]);
        assert_eq!(ready.shards[0].prompts, [0, 1]);
        // Shard 1's file finishes: it is listed from the remembered header.
        std::fs::write(out.join(shard_file_name(1)), [7; 10]).unwrap();
        let ready = scan(&storage, JOB, &cache).await.unwrap();
        assert_eq!(ready.shards.len(), 2);
    }

    #[tokio::test]
    async fn a_header_larger_than_the_first_read_is_read_in_full() {
        let root = tempfile::tempdir().unwrap();
        let storage = Storage::Local {
            root: root.path().to_owned(),
        };
        let out = JobPaths::new(root.path(), JOB).output();
        std::fs::create_dir_all(&out).unwrap();
        let big = meta(0, 5, 10_000);
        std::fs::write(out.join(shard_file_name(0)), [1; 5]).unwrap();
        write_record(&out, &big);
        let ready = scan(&storage, JOB, &RecordCache::default()).await.unwrap();
        assert_eq!(ready.shards[0].prompts, [0, 9_999]);
    }
}
