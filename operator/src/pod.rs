//! Pods, both ways and both pure: [`render`] builds an attempt's Pod from the job and the
//! catalogue, and [`observe`] reads a Pod back into a [`PodState`] the lifecycle understands.

use std::collections::BTreeMap;

use harvest_crds::{HarvestJob, ResultSummary, ValidJob};
use k8s_openapi::api::core::v1::{
    Container, EnvFromSource, EnvVar, Pod, PodSpec, ResourceRequirements, SecretEnvSource,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::{Resource, ResourceExt};
use serde::Deserialize;

use crate::config::{CatalogueEntry, OperatorConfig};
use crate::error::{Error, Result};

/// Label on every Pod the operator creates (the controller watches only these).
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "harvest-operator");
/// Label naming a Pod's job.
pub const JOB_LABEL: &str = "harvest.dev/job";
/// Where the harvester writes its summary; the kubelet turns it into the termination message.
pub const TERMINATION_LOG: &str = "/dev/termination-log";
/// The worker container's name.
pub const CONTAINER: &str = "harvester";

/// The Pod name of a job's attempt `attempt` (1-based): deterministic, so a repeated create
/// after a lost write finds the same Pod instead of starting a second one.
pub fn pod_name(job: &str, attempt: u32) -> String {
    format!("{job}-{attempt}")
}

/// Builds attempt `attempt`'s Pod. `deadline_seconds` is what is left of the job's deadline.
pub fn render(
    job: &HarvestJob,
    valid: &ValidJob,
    model: &CatalogueEntry,
    config: &OperatorConfig,
    attempt: u32,
    deadline_seconds: Option<i64>,
) -> Result<Pod> {
    let plan = serde_json::to_string(&valid.plan).map_err(|source| Error::Encode {
        what: "the harvester plan",
        source,
    })?;
    let mut args = vec![
        "run".to_owned(),
        "--plan-json".to_owned(),
        plan,
        "--model-name".to_owned(),
        model.name.clone(),
        "--termination-log".to_owned(),
        TERMINATION_LOG.to_owned(),
        "--progress".to_owned(),
        "json".to_owned(),
    ];
    args.extend(config.worker_extra_args.iter().cloned());
    let mut resources = model.resources.clone();
    if model.gpus > 0 {
        let gpus = Quantity(model.gpus.to_string());
        resources
            .limits
            .get_or_insert_with(BTreeMap::new)
            .insert("nvidia.com/gpu".into(), gpus.clone());
        resources
            .requests
            .get_or_insert_with(BTreeMap::new)
            .insert("nvidia.com/gpu".into(), gpus);
    }
    let env = vec![
        EnvVar {
            name: "HARVEST_JOB_NAME".into(),
            value: Some(job.name_any()),
            ..EnvVar::default()
        },
        EnvVar {
            name: "HARVEST_JOB_NAMESPACE".into(),
            value: job.namespace(),
            ..EnvVar::default()
        },
    ];
    let env_from = config.worker_env_secret.as_ref().map(|name| {
        vec![EnvFromSource {
            secret_ref: Some(SecretEnvSource {
                name: name.clone(),
                optional: Some(false),
            }),
            ..EnvFromSource::default()
        }]
    });
    let owner = job
        .controller_owner_ref(&())
        .ok_or_else(|| Error::MissingUid {
            job: job.name_any(),
        })?;
    let labels = BTreeMap::from([
        (MANAGED_BY.0.to_owned(), MANAGED_BY.1.to_owned()),
        (JOB_LABEL.to_owned(), job.name_any()),
        ("harvest.dev/attempt".to_owned(), attempt.to_string()),
    ]);
    Ok(Pod {
        metadata: ObjectMeta {
            name: Some(pod_name(&job.name_any(), attempt)),
            namespace: job.namespace(),
            labels: Some(labels),
            owner_references: Some(vec![owner]),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            restart_policy: Some("Never".into()),
            service_account_name: Some(config.worker_service_account.clone()),
            // The worker talks to storage only; its progress is read from its log.
            automount_service_account_token: Some(false),
            active_deadline_seconds: deadline_seconds,
            node_selector: (!model.node_selector.is_empty()).then(|| model.node_selector.clone()),
            tolerations: (!model.tolerations.is_empty()).then(|| model.tolerations.clone()),
            containers: vec![Container {
                name: CONTAINER.into(),
                image: Some(model.image.clone()),
                args: Some(args),
                env: Some(env),
                env_from,
                resources: (resources != ResourceRequirements::default()).then_some(resources),
                termination_message_path: Some(TERMINATION_LOG.into()),
                termination_message_policy: Some("FallbackToLogsOnError".into()),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        status: None,
    })
}

/// Who is to blame for a failed attempt, which decides whether it is retried and counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blame {
    /// The job (out of memory, a crash): retried, counted against `backoffLimit`.
    Job,
    /// The cluster (eviction, lost node, storage down): retried without counting.
    Infrastructure,
    /// The input: retrying cannot help, so the job fails now.
    Input,
}

/// A failed attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// Who is to blame.
    pub blame: Blame,
    /// CamelCase reason for the condition.
    pub reason: String,
    /// What happened, for the condition and the Event.
    pub message: String,
}

/// An attempt's Pod, as the lifecycle sees it.
#[derive(Debug, Clone, PartialEq)]
pub enum PodState {
    /// Scheduled or not, not yet running; `waiting` is the container's waiting reason (image
    /// pull errors, say) and message.
    Starting {
        /// Why it waits, if the kubelet says.
        waiting: Option<(String, String)>,
    },
    /// The harvester runs.
    Running,
    /// The harvester finished; `result` is its summary when the message could be read.
    Succeeded {
        /// The summary from the termination message.
        result: Option<ResultSummary>,
    },
    /// The attempt failed; `finished_at` starts the retry delay.
    Failed {
        /// What went wrong.
        failure: Failure,
        /// When.
        finished_at: Option<Time>,
    },
    /// Being deleted.
    Terminating,
}

/// The termination message of a successful run (a subset of `result.json`).
#[derive(Deserialize)]
struct RunSummary {
    n_shards: u32,
    #[serde(default)]
    n_prompts: u32,
    layer_indices: Vec<u32>,
    tokens: u64,
    bytes_written: u64,
    contents: String,
    output: String,
}

/// The termination message of a failed run.
#[derive(Deserialize)]
struct RunError {
    error: String,
}

/// Pod reasons that mean the node or the scheduler took the Pod away.
const INFRASTRUCTURE_REASONS: [&str; 6] = [
    "Evicted",
    "NodeLost",
    "Preempting",
    "Shutdown",
    "Terminated",
    "UnexpectedAdmissionError",
];

/// Reads a Pod.
pub fn observe(pod: &Pod) -> PodState {
    if pod.metadata.deletion_timestamp.is_some() {
        return PodState::Terminating;
    }
    let status = pod.status.clone().unwrap_or_default();
    let container = status
        .container_statuses
        .as_ref()
        .and_then(|all| all.iter().find(|c| c.name == CONTAINER))
        .and_then(|c| c.state.clone());
    let terminated = container.as_ref().and_then(|s| s.terminated.clone());
    match status.phase.as_deref() {
        Some("Running") => PodState::Running,
        Some("Succeeded") => PodState::Succeeded {
            result: terminated
                .and_then(|t| t.message)
                .and_then(|m| serde_json::from_str::<RunSummary>(&m).ok())
                .map(|r| ResultSummary {
                    n_shards: r.n_shards,
                    prompts: r.n_prompts,
                    tokens: r.tokens,
                    bytes_written: r.bytes_written,
                    layers: r.layer_indices,
                    contents: r.contents,
                    output: r.output,
                }),
        },
        Some("Failed") => {
            let disrupted = status
                .conditions
                .iter()
                .flatten()
                .find(|c| c.type_ == "DisruptionTarget" && c.status == "True");
            let pod_reason = status.reason.clone().unwrap_or_default();
            let finished_at = terminated.as_ref().and_then(|t| t.finished_at.clone());
            let failure = if let Some(condition) = disrupted {
                Failure {
                    blame: Blame::Infrastructure,
                    reason: condition
                        .reason
                        .clone()
                        .unwrap_or_else(|| "DisruptionTarget".into()),
                    message: condition
                        .message
                        .clone()
                        .unwrap_or_else(|| "the Pod was disrupted".into()),
                }
            } else if INFRASTRUCTURE_REASONS.contains(&pod_reason.as_str()) {
                Failure {
                    blame: Blame::Infrastructure,
                    message: status
                        .message
                        .clone()
                        .unwrap_or_else(|| format!("the Pod failed: {pod_reason}")),
                    reason: pod_reason,
                }
            } else if pod_reason == "DeadlineExceeded" {
                Failure {
                    blame: Blame::Input,
                    reason: pod_reason,
                    message: "the job ran past activeDeadlineSeconds".into(),
                }
            } else if let Some(terminated) = terminated {
                classify_exit(
                    terminated.exit_code,
                    terminated.reason.as_deref(),
                    terminated.message.as_deref(),
                )
            } else {
                Failure {
                    blame: Blame::Infrastructure,
                    reason: if pod_reason.is_empty() {
                        "PodFailed".into()
                    } else {
                        pod_reason
                    },
                    message: status
                        .message
                        .unwrap_or_else(|| "the Pod failed before its container ran".into()),
                }
            };
            PodState::Failed {
                failure,
                finished_at,
            }
        }
        _ => PodState::Starting {
            waiting: container.and_then(|s| s.waiting).and_then(|w| {
                w.reason
                    .map(|reason| (reason, w.message.unwrap_or_default()))
            }),
        },
    }
}

/// Maps the harvester's exit status (0 done, 2 bad input, 3 storage, 70 internal) and the
/// kubelet's reason to who is to blame.
fn classify_exit(exit_code: i32, reason: Option<&str>, message: Option<&str>) -> Failure {
    let detail = message
        .map(|m| {
            serde_json::from_str::<RunError>(m)
                .map(|e| e.error)
                .unwrap_or_else(|_| m.trim().to_owned())
        })
        .filter(|m| !m.is_empty());
    let with_detail = |what: String| match &detail {
        Some(detail) => format!("{what}: {detail}"),
        None => what,
    };
    if reason == Some("OOMKilled") {
        return Failure {
            blame: Blame::Job,
            reason: "OOMKilled".into(),
            message: format!(
                "the harvester ran out of memory (exit {exit_code}); raise the model's memory limit or lower batch tokens"
            ),
        };
    }
    match exit_code {
        2 => Failure {
            blame: Blame::Input,
            reason: "InvalidInput".into(),
            message: with_detail("the harvester refused its input".into()),
        },
        3 => Failure {
            blame: Blame::Infrastructure,
            reason: "StorageUnavailable".into(),
            message: with_detail("the object store failed".into()),
        },
        code => Failure {
            blame: Blame::Job,
            reason: "WorkerFailed".into(),
            message: with_detail(format!("the harvester exited with status {code}")),
        },
    }
}

#[cfg(test)]
#[path = "pod_tests.rs"]
mod tests;

/// What a running worker last reported on its log: `(prompts_done, prompts_total,
/// tokens_done)` from its newest `{"event":"progress",...}` line.
pub fn reported_progress(log: &str) -> Option<(u32, u32, u64)> {
    log.lines().rev().find_map(|line| {
        let value: serde_json::Value = serde_json::from_str(line.trim()).ok()?;
        if value["event"] != "progress" {
            return None;
        }
        let count = |key: &str| value[key].as_u64();
        Some((
            u32::try_from(count("prompts_done")?).ok()?,
            u32::try_from(count("prompts_total")?).ok()?,
            count("tokens_done")?,
        ))
    })
}
