//! Pods, both ways and both pure: [`render`] builds an attempt's Pod from the job and the
//! catalogue, and [`observe`] reads a Pod back into a [`PodState`] the lifecycle understands.

use std::collections::BTreeMap;

use harvest_core::worker::{ErrorKind, ExitStatus, ProgressEvent, RunResult, Termination};
use harvest_crds::{HarvestJob, ResultSummary, ValidJob};
use k8s_openapi::api::core::v1::{
    Container, EnvFromSource, EnvVar, Pod, PodSpec, ResourceRequirements, SecretEnvSource,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::{Resource, ResourceExt};

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
    let plan = serde_json::to_string(&valid.plan.to_raw()).map_err(|source| Error::Encode {
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
                .and_then(|m| match Termination::parse(&m) {
                    Some(Termination::Done(result)) => Some(summary(&result)),
                    _ => None,
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

/// The job status's summary of a worker's result.
fn summary(result: &RunResult) -> ResultSummary {
    let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    ResultSummary {
        n_shards: count(result.n_shards),
        prompts: count(result.n_prompts),
        tokens: result.tokens,
        bytes_written: result.bytes_written,
        layers: result.layer_indices.iter().map(|&l| count(l)).collect(),
        contents: result.contents.as_str().to_owned(),
        output: result.output.clone(),
    }
}

/// Maps the harvester's exit status (the worker protocol's [`ExitStatus`]) and the kubelet's
/// reason to who is to blame.
fn classify_exit(exit_code: i32, reason: Option<&str>, message: Option<&str>) -> Failure {
    let detail = message
        .map(|m| match Termination::parse(m) {
            Some(Termination::Failed(failure)) => failure.error,
            _ => m.trim().to_owned(),
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
    match ExitStatus::from_code(exit_code) {
        ExitStatus::Failed(ErrorKind::BadInput) => Failure {
            blame: Blame::Input,
            reason: "InvalidInput".into(),
            message: with_detail("the harvester refused its input".into()),
        },
        ExitStatus::Failed(ErrorKind::Infrastructure) => Failure {
            blame: Blame::Infrastructure,
            reason: "StorageUnavailable".into(),
            message: with_detail("the object store failed".into()),
        },
        status @ (ExitStatus::Success
        | ExitStatus::Failed(ErrorKind::Internal)
        | ExitStatus::Unexpected(_)) => Failure {
            blame: Blame::Job,
            reason: "WorkerFailed".into(),
            message: with_detail(format!(
                "the harvester exited with status {}",
                status.code()
            )),
        },
    }
}

#[cfg(test)]
#[path = "pod_tests.rs"]
mod tests;

/// What a running worker last reported on its log: `(prompts_done, prompts_total,
/// tokens_done)` from its newest progress line.
pub fn reported_progress(log: &str) -> Option<(u32, u32, u64)> {
    let event = ProgressEvent::latest_in(log)?;
    Some((
        u32::try_from(event.prompts_done).ok()?,
        u32::try_from(event.prompts_total).ok()?,
        event.tokens_done,
    ))
}
