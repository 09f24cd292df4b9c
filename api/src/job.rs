//! A job as both backends record it: the seam type the handlers answer from, whatever holds
//! the job (the embedded store's rows, or HarvestJobs).

use harvest_core::Sites;
use harvest_core::clock::UnixMillis;
use harvest_core::layout::Layout;
use harvest_core::lifecycle::JobStatus;
use harvest_core::quota::Lane;
use harvest_core::selection::TokenSelection;
use serde::{Deserialize, Serialize};

use crate::wire::{JobResult, Progress};

/// How to (re)start a job's worker; everything else lives in the job's input folder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobSpec {
    /// Kept layers.
    pub layers: Vec<usize>,
    /// Kept hook sites (`resid_post` alone for jobs stored before sites were).
    #[serde(default, skip_serializing_if = "Sites::is_default")]
    pub sites: Sites,
    /// Which tokens are kept (every token for jobs stored before selections were).
    #[serde(default, skip_serializing_if = "TokenSelection::is_everything")]
    pub selection: TokenSelection,
    /// How the files are laid out (by prompt for jobs stored before layouts were).
    #[serde(default, skip_serializing_if = "Layout::is_by_prompt")]
    pub layout: Layout,
    /// The engine's arithmetic (f32 for jobs stored before it was chosen).
    #[serde(default)]
    pub precision: harvest_core::plan::Precision,
    /// Prompts per shard.
    pub shard_size: usize,
    /// Whether special tokens are added.
    pub add_special_tokens: bool,
    /// Whether `directions.npy` was sent.
    pub has_directions: bool,
    /// The model's lane.
    pub lane: Lane,
    /// The bytes its files will take, as predicted at submit (0 for jobs stored before
    /// estimates were).
    #[serde(default)]
    pub estimated_bytes: u64,
    /// How long it should take, in milliseconds, from the last measured throughput of its model
    /// (none when nothing was measured yet).
    #[serde(default)]
    pub estimated_ms: Option<u64>,
    /// Harvester processes the job runs in (1 for jobs stored before parallelism was).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub parallelism: usize,
}

/// A job row.
#[derive(Debug, Clone, PartialEq)]
pub struct JobRecord {
    /// Job id.
    pub id: String,
    /// Run id.
    pub run_id: String,
    /// Owning account.
    pub account: String,
    /// The key that submitted it (hash).
    pub key_hash: String,
    /// Catalogue model name.
    pub model: String,
    /// Status.
    pub status: JobStatus,
    /// Prompts.
    pub n_prompts: usize,
    /// Reserved tokens.
    pub reserved: u64,
    /// Charged tokens, once ended.
    pub tokens: Option<u64>,
    /// Creation time.
    pub created_at: UnixMillis,
    /// Start of its run.
    pub started_at: Option<UnixMillis>,
    /// End.
    pub completed_at: Option<UnixMillis>,
    /// The harvester's result summary, for a done job.
    pub result: Option<StoredResult>,
    /// Why it failed.
    pub error: Option<String>,
    /// Latest progress.
    pub progress: Option<Progress>,
    /// How to run it.
    pub spec: JobSpec,
}

fn one() -> usize {
    1
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

/// What the harvester reported for a done job (its result.json, less the links).
pub type StoredResult = JobResult;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_with_every_option_reads_and_writes_back_byte_for_byte() {
        let stored = include_str!("../tests/fixtures/job-spec-every-option.json").trim_end();
        let spec: JobSpec = serde_json::from_str(stored).unwrap();
        assert_eq!(serde_json::to_string(&spec).unwrap(), stored);
    }

    #[test]
    fn a_row_of_the_first_release_reads_with_its_defaults() {
        let stored = include_str!("../tests/fixtures/job-spec-first-release.json");
        let spec: JobSpec = serde_json::from_str(stored).unwrap();
        let written: serde_json::Value = serde_json::to_value(&spec).unwrap();
        let mut expected: serde_json::Value = serde_json::from_str(stored).unwrap();
        // The first release wrote no precision or estimates; a row written back names them.
        expected["precision"] = "f32".into();
        expected["estimated_bytes"] = 0.into();
        expected["estimated_ms"] = serde_json::Value::Null;
        assert_eq!(written, expected);
        assert!(spec.selection.is_everything() && spec.layout.is_by_prompt());
        assert_eq!(spec.parallelism, 1);
    }
}
