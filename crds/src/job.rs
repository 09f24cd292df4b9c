//! The `HarvestJob` custom resource: one harvest, declared by a user, GitOps or the API.
//!
//! Only `suspend`, `cancel` (one way), `activeDeadlineSeconds`, `backoffLimit` and
//! `ttlSecondsAfterFinished` may change after creation; the CEL rules in the schema say so and
//! the apiserver enforces them.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, MicroTime, Time};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::options::HarvestOptions;

/// Failures caused by the job itself that are retried before it is marked failed.
pub const DEFAULT_BACKOFF_LIMIT: i32 = 3;

/// What to harvest, from where, into where, and within which limits.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "harvest.dev",
    version = "v1alpha1",
    kind = "HarvestJob",
    namespaced,
    shortname = "hj",
    category = "harvest",
    status = "HarvestJobStatus",
    printcolumn = r#"{"name": "Phase", "type": "string", "jsonPath": ".status.phase"}"#,
    printcolumn = r#"{"name": "Reason", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"Finished\")].reason"}"#,
    printcolumn = r#"{"name": "Account", "type": "string", "jsonPath": ".status.account"}"#,
    printcolumn = r#"{"name": "Model", "type": "string", "jsonPath": ".spec.model"}"#,
    printcolumn = r#"{"name": "Prompts", "type": "integer", "jsonPath": ".status.progress.promptsTotal"}"#,
    printcolumn = r#"{"name": "Tokens", "type": "integer", "jsonPath": ".status.tokens.charged"}"#,
    printcolumn = r#"{"name": "Progress", "type": "string", "jsonPath": ".status.progress.summary"}"#,
    printcolumn = r#"{"name": "Parts", "type": "string", "jsonPath": ".status.partsSummary"}"#,
    printcolumn = r#"{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct HarvestJobSpec {
    /// A model name from the operator's catalogue.
    #[x_kube(validation = Rule::new("self == oldSelf").message("model is immutable"))]
    #[schemars(length(min = 1))]
    pub model: String,
    /// Where the prompts (and optional directions) are.
    #[x_kube(validation = Rule::new("self == oldSelf").message("input is immutable"))]
    pub input: InputRef,
    /// Layers, sharding and tokenizer options.
    #[serde(default)]
    #[x_kube(validation = Rule::new("self == oldSelf").message("harvest is immutable"))]
    pub harvest: HarvestOptions,
    /// Output prefix: `s3://bucket/prefix`, or an absolute path on the worker's volume. Left
    /// out, the operator sets it once, under the paying account's `storage.prefix`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(
        validation = Rule::new("self == oldSelf").message("output is immutable"),
        validation = Rule::new("self.startsWith('s3://') || self.startsWith('/')")
            .message("output must be s3://bucket/prefix or an absolute path")
    )]
    pub output: Option<String>,
    /// Most tokens the job may run; reserved against the lane's budget at admission.
    #[x_kube(validation = Rule::new("self == oldSelf").message("tokenBudget is immutable"))]
    #[schemars(range(min = 1))]
    pub token_budget: u64,
    /// While true, the job is not started (and a running attempt is stopped).
    #[serde(default)]
    pub suspend: bool,
    /// Set to true to cancel the job. It cannot be set back.
    #[serde(default)]
    #[x_kube(validation = Rule::new("!oldSelf || self").message("cancel cannot be undone"))]
    pub cancel: bool,
    /// Seconds the job may run, counted from its first start, before it fails.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub active_deadline_seconds: Option<i64>,
    /// Failures caused by the job (not by the infrastructure) retried before it fails.
    #[serde(default = "default_backoff_limit")]
    #[schemars(range(min = 0, max = 100))]
    pub backoff_limit: i32,
    /// Seconds after it finishes before the job is deleted. Unset keeps it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub ttl_seconds_after_finished: Option<i64>,
    /// What happens to the output files when the job is deleted.
    #[serde(default)]
    #[x_kube(validation = Rule::new("self == oldSelf").message("outputRetention is immutable"))]
    pub output_retention: OutputRetention,
    /// Workers the job is split over: contiguous, shard-aligned ranges of its prompts, one
    /// Pod each, then one finalize step; the output is byte for byte that of one worker. At
    /// most the model's `maxParallelism` in the catalogue. Left out, the operator chooses it
    /// from the token budget and the catalogue's `tokensPerPart`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self == oldSelf").message("parallelism is immutable"))]
    #[schemars(range(min = 1, max = 256))]
    pub parallelism: Option<u32>,
}

fn default_backoff_limit() -> i32 {
    DEFAULT_BACKOFF_LIMIT
}

/// Where a job's inputs are.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct InputRef {
    /// Prompts file: `.jsonl`, `.json` or `.txt`, as `s3://bucket/key` or an absolute path.
    #[x_kube(
        validation = Rule::new("self.startsWith('s3://') || self.startsWith('/')")
            .message("prompts must be s3://bucket/key or an absolute path")
    )]
    pub prompts: String,
    /// Optional projection directions, `[n, hidden]` in `.safetensors` or `.npy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub directions: Option<String>,
}

/// What happens to a job's output files when the job is deleted.
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
pub enum OutputRetention {
    /// Files stay (the default): deleting the job never loses data.
    #[default]
    Retain,
    /// Files are deleted with the job, by a finalizer.
    Delete,
}

/// A job's phase, derived from its conditions for display.
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobPhase {
    /// Waiting for admission.
    Pending,
    /// Suspended by its owner.
    Suspended,
    /// Admitted; its Pod is starting or running.
    Running,
    /// Finished with files.
    Succeeded,
    /// Finished with an error.
    Failed,
    /// Cancelled by its owner.
    Cancelled,
}

/// A phase this release does not know (a newer release's) reads as none: the phase is for
/// display only, and a list of jobs must still decode.
fn lenient_phase<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<JobPhase>, D::Error> {
    let phase = Option::<serde_json::Value>::deserialize(deserializer)?;
    Ok(phase.and_then(|p| serde_json::from_value(p).ok()))
}

fn lenient_part_phase<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<PartPhase, D::Error> {
    let phase = serde_json::Value::deserialize(deserializer)?;
    Ok(serde_json::from_value(phase).unwrap_or_default())
}

impl JobPhase {
    /// The name as written in status.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "Pending",
            Self::Suspended => "Suspended",
            Self::Running => "Running",
            Self::Succeeded => "Succeeded",
            Self::Failed => "Failed",
            Self::Cancelled => "Cancelled",
        }
    }
}

/// Observed state, written only by the operator (and progress by the job's own worker).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HarvestJobStatus {
    /// Derived from the conditions, for display.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient_phase"
    )]
    pub phase: Option<JobPhase>,
    /// `Admitted`, `Running` and `Finished`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// When the job was last admitted, to the microsecond: its place in its model's `maxPods`
    /// queue (condition times keep only seconds, which would order same-second jobs by name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admitted_at: Option<MicroTime>,
    /// When the first attempt started (the deadline counts from here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<Time>,
    /// When a worker was first seen running; a job is charged only once one has run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running_since: Option<Time>,
    /// When the job finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<Time>,
    /// Pods created so far.
    #[serde(default)]
    pub attempts: u32,
    /// Failures that count against `backoffLimit`.
    #[serde(default)]
    pub failures: u32,
    /// The HarvestAccount the job was admitted under and charged to (set by the operator).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub account: Option<String>,
    /// The lane the job was admitted to: `small` or `large`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lane: Option<String>,
    /// Tokens held and charged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<TokenUsage>,
    /// How far the run is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<Progress>,
    /// The current attempt's Pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// What a successful run produced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<ResultSummary>,
    /// Workers the job runs in, fixed at admission (absent: one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallelism: Option<u32>,
    /// Each part of a job run in parts, by index. `attempts` and `pod` above then describe
    /// the finalize step, which runs once every part has succeeded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parts: Vec<PartStatus>,
    /// Parts done out of all, like `2/3`, for `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parts_summary: Option<String>,
    /// The harvester image the job's first worker ran. Every later attempt and part runs it
    /// too, so that an operator upgrade mid-job changes neither the bytes nor a resume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_image: Option<String>,
    /// What a newer release wrote that this one does not know, kept as it is: status is
    /// written back whole, and after a rollback the older operator must not drop it.
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(skip)]
    pub newer: BTreeMap<String, serde_json::Value>,
}

/// Where a part of a job stands.
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
pub enum PartPhase {
    /// No Pod yet: waiting for a Pod slot (`maxPods`) or a retry's delay.
    #[default]
    Waiting,
    /// Its Pod is starting or running.
    Running,
    /// Its shards and their records are written.
    Succeeded,
}

/// One part of a job run in parts.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PartStatus {
    /// The part's index, from 0.
    pub index: u32,
    /// Where it stands. A phase this release does not know (a newer release's) reads as
    /// `Waiting`, which the next decision corrects from the part's Pod, so that a list of
    /// jobs still decodes after a rollback.
    #[serde(deserialize_with = "lenient_part_phase")]
    pub phase: PartPhase,
    /// Pods created for it so far.
    #[serde(default)]
    pub attempts: u32,
    /// Its failures that count against the job's `backoffLimit` (summed over the parts).
    #[serde(default)]
    pub failures: u32,
    /// Its current Pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// Prompts of its range run, as its worker last reported.
    #[serde(default)]
    pub prompts_done: u32,
    /// Prompts in its range (0 until its worker reports).
    #[serde(default)]
    pub prompts_total: u32,
    /// Tokens its successful attempt ran (shards resumed from earlier attempts excluded).
    #[serde(default)]
    pub tokens: u64,
    /// Its shards, `[first, end)`, once it succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shards: Option<Vec<u32>>,
    /// When its last attempt failed, which starts the retry delay.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_at: Option<Time>,
    /// Why it waits or why its last attempt failed.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

impl HarvestJobStatus {
    /// The workers the job runs in: 1 unless admission chose more.
    pub fn part_count(&self) -> u32 {
        self.parallelism.unwrap_or(1).max(1)
    }
}

/// Tokens reserved at admission and charged when the job ended. A set `charged` means the job
/// has been settled, so a restarted operator never charges it twice.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct TokenUsage {
    /// Held while the job is admitted.
    pub reserved: u64,
    /// Settled once, when the job ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub charged: Option<u64>,
}

/// Progress, in shards and prompts.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Progress {
    /// Prompts run, as the worker last reported (shards of an earlier attempt included).
    #[serde(default)]
    pub prompts_done: u32,
    /// Tokens run by the current attempt.
    #[serde(default)]
    pub tokens_done: u64,
    /// Shards written.
    pub shards_done: u32,
    /// Shards in the job (0 until known).
    pub shards_total: u32,
    /// Prompts in the job (0 until known).
    pub prompts_total: u32,
    /// A short line for `kubectl get`, like `3/8 shards`.
    pub summary: String,
    /// `loading` while the worker reads the model's weights (absent once it runs batches).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// Weight bytes read so far, while loading.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_loaded: Option<u64>,
    /// Weight bytes to read, while loading.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_total: Option<u64>,
}

impl Progress {
    /// Progress of `done` of `total` shards of a job with `prompts` prompts.
    pub fn new(done: u32, total: u32, prompts: u32) -> Self {
        Self {
            prompts_done: if done == total { prompts } else { 0 },
            tokens_done: 0,
            shards_done: done,
            shards_total: total,
            prompts_total: prompts,
            summary: format!("{done}/{total} shards"),
            phase: None,
            bytes_loaded: None,
            bytes_total: None,
        }
    }
}

/// The summary of a successful run, from the worker's termination message.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ResultSummary {
    /// Shards written.
    pub n_shards: u32,
    /// Prompts harvested.
    pub prompts: u32,
    /// Tokens run.
    pub tokens: u64,
    /// Bytes of shards, statistics and manifest.
    pub bytes_written: u64,
    /// Kept layers.
    pub layers: Vec<u32>,
    /// `activations` or `projections`.
    pub contents: String,
    /// Where the files are (the manifest is `manifest.json` under it).
    pub output: String,
}

impl Progress {
    /// A running job's progress from its worker's report: `prompts_done` of `prompts_total`,
    /// in shards of `shard_size` prompts.
    pub fn running(
        prompts_done: u32,
        prompts_total: u32,
        tokens_done: u64,
        shard_size: u32,
    ) -> Self {
        let shard_size = shard_size.max(1);
        let mut progress = Self::new(
            prompts_done / shard_size,
            prompts_total.div_ceil(shard_size),
            prompts_total,
        );
        progress.prompts_done = prompts_done;
        progress.tokens_done = tokens_done;
        progress
    }

    /// A worker still reading its weights: `loaded` of `total` bytes, before any batch, with the
    /// shards an earlier attempt finished (`prompts_done`).
    pub fn loading(
        (loaded, total): (u64, u64),
        prompts_done: u32,
        prompts_total: u32,
        shard_size: u32,
    ) -> Self {
        let mut progress = Self::running(prompts_done, prompts_total, 0, shard_size);
        const GB: f64 = 1e9;
        progress.summary = format!(
            "loading {:.1}/{:.1} GB",
            loaded as f64 / GB,
            total as f64 / GB
        );
        progress.phase = Some("loading".into());
        progress.bytes_loaded = Some(loaded);
        progress.bytes_total = Some(total);
        progress
    }
}

impl HarvestJobSpec {
    /// A digest of what the job asks for (hex sha256 of the spec's JSON, `suspend` and
    /// `cancel` left out): the same manifest applied again, by a GitOps tool after the TTL
    /// deleted the job, has the same digest.
    pub fn digest(&self) -> String {
        use sha2::{Digest, Sha256};
        let asked = Self {
            suspend: false,
            cancel: false,
            ..self.clone()
        };
        let bytes = serde_json::to_vec(&asked).unwrap_or_default();
        Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// A spec with every optional field at its default: quartile layers, no deadline, no TTL,
    /// outputs retained, `backoffLimit` [`DEFAULT_BACKOFF_LIMIT`].
    pub fn new(
        model: impl Into<String>,
        prompts: impl Into<String>,
        output: impl Into<String>,
        token_budget: u64,
    ) -> Self {
        Self {
            model: model.into(),
            input: InputRef {
                prompts: prompts.into(),
                directions: None,
            },
            harvest: HarvestOptions::default(),
            output: Some(output.into()),
            token_budget,
            suspend: false,
            cancel: false,
            active_deadline_seconds: None,
            backoff_limit: DEFAULT_BACKOFF_LIMIT,
            ttl_seconds_after_finished: None,
            output_retention: OutputRetention::Retain,
            parallelism: None,
        }
    }
}

impl JobPhase {
    /// The phase of a job whose `Finished` condition is true with `reason` (a copy of a job
    /// that ran before, `Already<phase>`, takes that run's phase).
    pub fn finished(reason: &str) -> Self {
        match reason
            .strip_prefix(crate::conditions::ALREADY)
            .unwrap_or(reason)
        {
            "Succeeded" => Self::Succeeded,
            "Cancelled" => Self::Cancelled,
            _ => Self::Failed,
        }
    }
}

impl HarvestJobStatus {
    /// Ends the job at `now`: `Finished` true with `reason` and `message`, `Running` false, the
    /// completion time, and the charge `core::lifecycle` gives `event`, which is returned. The
    /// reservation counts as run once `runningSince` is set, so a job whose Pod never started
    /// is charged nothing. The operator ends every job with it; the API ends a cancelled one
    /// with it too, so that a DELETE frees the slot without waiting for the operator.
    pub fn finish(
        &mut self,
        event: harvest_core::lifecycle::JobEvent,
        reason: &str,
        message: String,
        generation: Option<i64>,
        now: &Time,
    ) -> u64 {
        use harvest_core::lifecycle::{self, JobStatus, Transition};
        let reserved = self.tokens.map_or(0, |t| t.reserved);
        let from = if self.running_since.is_some() {
            JobStatus::Running
        } else {
            JobStatus::Pending
        };
        let charge = match lifecycle::next(from, reserved, event) {
            Ok(Transition::To { charge, .. }) => charge.unwrap_or(0),
            Ok(Transition::Unchanged) | Err(_) => 0,
        };
        if let Some(tokens) = &mut self.tokens {
            tokens.charged = Some(charge);
        }
        self.completion_time = Some(now.clone());
        let had_running =
            crate::conditions::get(&self.conditions, crate::conditions::RUNNING).is_some();
        let mut set = |type_, status, reason, message| {
            let update = crate::conditions::ConditionUpdate {
                type_,
                status,
                reason,
                message,
            };
            crate::conditions::set(&mut self.conditions, update, generation, now);
        };
        if had_running {
            set(
                crate::conditions::RUNNING,
                false,
                "Finished",
                "the job has finished".into(),
            );
        }
        let phase = JobPhase::finished(reason);
        let outcome = match phase {
            JobPhase::Succeeded => crate::conditions::SUCCEEDED,
            _ => crate::conditions::FAILED,
        };
        set(outcome, true, reason, message.clone());
        set(crate::conditions::FINISHED, true, reason, message);
        self.phase = Some(phase);
        charge
    }
}

impl HarvestJob {
    /// The job's status, or an empty one.
    pub fn status_or_default(&self) -> HarvestJobStatus {
        self.status.clone().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conditions::{self, FINISHED, RUNNING};
    use harvest_core::lifecycle::JobEvent;
    use k8s_openapi::jiff::Timestamp;

    #[test]
    fn a_newer_releases_status_fields_and_phase_survive_this_releases_read_and_write_back() {
        let written_by_newer = serde_json::json!({
            "phase": "Draining",
            "attempts": 2,
            "account": "acme",
            "routerStats": {"experts": 64},
            "parts": [],
        });
        let read: HarvestJobStatus = serde_json::from_value(written_by_newer).unwrap();
        // The phase is for display: one this release does not know reads as none, so a list
        // of jobs still decodes.
        assert_eq!(read.phase, None);
        assert_eq!((read.attempts, read.account.as_deref()), (2, Some("acme")));
        let written_back = serde_json::to_value(&read).unwrap();
        assert_eq!(
            written_back["routerStats"],
            serde_json::json!({"experts": 64}),
            "a rolled-back operator's full write keeps what it does not know"
        );
        // This release's own fields are not kept twice.
        assert!(!read.newer.contains_key("attempts"), "{:?}", read.newer);
    }

    fn admitted(ran: bool) -> HarvestJobStatus {
        let now = Time(Timestamp::UNIX_EPOCH);
        let mut status = HarvestJobStatus {
            tokens: Some(TokenUsage {
                reserved: 500,
                charged: None,
            }),
            running_since: ran.then(|| now.clone()),
            ..HarvestJobStatus::default()
        };
        let update = conditions::ConditionUpdate {
            type_: RUNNING,
            status: true,
            reason: "PodRunning",
            message: "attempt 1 is running".into(),
        };
        conditions::set(&mut status.conditions, update, Some(1), &now);
        status
    }

    #[test]
    fn a_cancel_charges_the_reservation_only_once_a_worker_has_run() {
        let now = Time(Timestamp::from_second(60).unwrap());
        for (ran, charge) in [(true, 500), (false, 0)] {
            let mut status = admitted(ran);
            let charged = status.finish(
                JobEvent::Cancel,
                conditions::CANCELLED,
                conditions::CANCELLED_MESSAGE.into(),
                Some(2),
                &now,
            );
            assert_eq!(charged, charge);
            assert_eq!(status.tokens.unwrap().charged, Some(charge));
            assert_eq!(status.phase, Some(JobPhase::Cancelled));
            assert_eq!(status.completion_time, Some(now.clone()));
            assert!(conditions::is_true(&status.conditions, FINISHED));
            assert!(!conditions::is_true(&status.conditions, RUNNING));
        }
    }

    #[test]
    fn a_success_is_charged_what_ran_never_past_the_reservation() {
        let now = Time(Timestamp::from_second(60).unwrap());
        for (ran, charge) in [(120, 120), (900, 500)] {
            let mut status = admitted(true);
            let event = JobEvent::Succeeded { tokens: ran };
            assert_eq!(
                status.finish(event, "Succeeded", "done".into(), None, &now),
                charge
            );
            assert_eq!(status.phase, Some(JobPhase::Succeeded));
        }
    }

    #[test]
    fn an_ended_job_says_succeeded_or_failed_as_a_batch_job_does_so_kubectl_wait_returns() {
        let now = Time(Timestamp::from_second(60).unwrap());
        let ended = |event, reason: &str| {
            let mut status = admitted(true);
            status.finish(event, reason, "why".into(), None, &now);
            status.conditions
        };
        let done = ended(JobEvent::Succeeded { tokens: 1 }, "Succeeded");
        assert!(conditions::is_true(&done, conditions::SUCCEEDED));
        assert!(conditions::get(&done, conditions::FAILED).is_none());
        for (event, reason) in [
            (JobEvent::Failed, "InvalidInput"),
            (JobEvent::Cancel, conditions::CANCELLED),
        ] {
            let failed = ended(event, reason);
            let condition = conditions::get(&failed, conditions::FAILED).unwrap();
            assert_eq!(
                (condition.status.as_str(), condition.reason.as_str()),
                ("True", reason)
            );
            assert!(conditions::get(&failed, conditions::SUCCEEDED).is_none());
        }
    }

    #[test]
    fn a_part_phase_of_a_newer_release_reads_as_waiting_and_the_known_ones_as_themselves() {
        let parts = serde_json::json!([
            {"index": 0, "phase": "Draining"},
            {"index": 1, "phase": "Succeeded"},
        ]);
        let read: Vec<PartStatus> = serde_json::from_value(parts).unwrap();
        assert_eq!(read[0].phase, PartPhase::Waiting);
        assert_eq!(read[1].phase, PartPhase::Succeeded);
    }

    #[test]
    fn the_spec_digest_ignores_suspend_and_cancel_and_changes_with_what_is_asked() {
        let spec = HarvestJobSpec::new("m", "s3://in/p.jsonl", "s3://out/j", 500);
        let paused = HarvestJobSpec {
            suspend: true,
            cancel: true,
            ..spec.clone()
        };
        assert_eq!(spec.digest(), paused.digest());
        assert_eq!(spec.digest().len(), 64);
        let elsewhere = HarvestJobSpec::new("m", "s3://in/p.jsonl", "s3://out/k", 500);
        assert_ne!(spec.digest(), elsewhere.digest());
        assert_eq!(JobPhase::finished("AlreadySucceeded"), JobPhase::Succeeded);
        assert_eq!(JobPhase::finished("AlreadyCancelled"), JobPhase::Cancelled);
        assert_eq!(JobPhase::finished("AlreadyFailed"), JobPhase::Failed);
    }
}
