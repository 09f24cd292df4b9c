//! A job as both backends record it: the seam type the handlers answer from, whatever holds
//! the job (the embedded store's rows, or HarvestJobs).

use harvest_core::JobOptions;
use harvest_core::clock::UnixMillis;
use harvest_core::lifecycle::JobStatus;
use harvest_core::quota::Lane;
use serde::{Deserialize, Serialize};

use crate::wire::{JobResult, Progress};

/// How to (re)start a job's worker; everything else lives in the job's input folder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobSpec {
    /// What the job keeps and how it is cut (its fields at the top level of a stored row, as
    /// rows have always had them).
    #[serde(flatten)]
    pub options: JobOptions,
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
        // The first release wrote no precision or estimates; a row written back names the
        // estimates, and still no precision (the device's own).
        expected["estimated_bytes"] = 0.into();
        expected["estimated_ms"] = serde_json::Value::Null;
        assert_eq!(written, expected);
        assert!(spec.options.selection.is_everything() && spec.options.layout.is_by_prompt());
        assert_eq!(spec.parallelism, 1);
        assert_eq!(spec.options.precision, None);
    }
}
