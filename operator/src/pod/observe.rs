//! Reading a Pod back: its phase, the worker's exit status and termination message (the
//! worker protocol's types), and the kubelet's reasons, into a [`PodState`].

use harvest_core::worker::{ErrorKind, ExitStatus, ProgressEvent, RunResult, Termination};
use harvest_crds::ResultSummary;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::{
    Blame, CONTAINER, Failure, JOB_UID_LABEL, KUEUE_MANAGED_LABEL, KUEUE_QUEUE_LABEL, PodState,
};

/// Pod reasons that mean the node or the scheduler took the Pod away.
const INFRASTRUCTURE_REASONS: [&str; 6] = [
    "Evicted",
    "NodeLost",
    "Preempting",
    "Shutdown",
    "Terminated",
    "UnexpectedAdmissionError",
];

/// Reads the Pod of a job whose UID is `job_uid`: [`PodState::Foreign`] unless the Pod's
/// controller reference names that UID, so that a Pod a tenant made under the expected name
/// is never taken for the job's worker, nor its termination message for a result. In the
/// operator's worker namespace (`worker_namespace`), where tenants cannot create Pods and
/// owner references cannot reach the job, the job's UID label is enough.
pub fn observe_for_job(pod: &Pod, job_uid: &str, worker_namespace: bool) -> PodState {
    let controller = pod
        .metadata
        .owner_references
        .iter()
        .flatten()
        .find(|owner| owner.controller == Some(true));
    let labelled = worker_namespace
        && pod
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(JOB_UID_LABEL))
            .is_some_and(|uid| uid == job_uid);
    if labelled && !job_uid.is_empty() {
        return observe(pod);
    }
    match controller {
        Some(owner) if owner.uid == job_uid && !job_uid.is_empty() => observe(pod),
        other => PodState::Foreign {
            controller: other.map(|owner| format!("{}/{}", owner.kind, owner.name)),
        },
    }
}

/// Reads a Pod.
pub fn observe(pod: &Pod) -> PodState {
    if let Some(since) = &pod.metadata.deletion_timestamp {
        return PodState::Terminating {
            since: Some(since.clone()),
            grace_seconds: pod.metadata.deletion_grace_period_seconds.unwrap_or(0),
        };
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
        Some("Succeeded") => {
            let termination = terminated
                .and_then(|t| t.message)
                .and_then(|m| Termination::parse(&m));
            match termination {
                Some(Termination::Done(result)) => PodState::Succeeded {
                    result: Some(summary(&result)),
                    part: None,
                },
                Some(Termination::Part(part)) => PodState::Succeeded {
                    result: None,
                    part: Some(part),
                },
                _ => PodState::Succeeded {
                    result: None,
                    part: None,
                },
            }
        }
        Some("Failed") => PodState::Failed {
            finished_at: terminated.as_ref().and_then(|t| t.finished_at.clone()),
            failure: failure(&status, terminated),
        },
        _ => match kueue_queue(pod) {
            // Held by Kueue's gate: queued, not starting; only the job's deadline bounds it.
            Some(queue) if gated(pod) => PodState::Starting {
                waiting: Some((
                    "WaitingForQueue".into(),
                    format!(
                        "Kueue's LocalQueue {queue:?} has not admitted it yet (its ClusterQueue has no room)"
                    ),
                )),
                since: None,
            },
            // The start timeout counts from scheduling only: until a node takes the Pod it
            // waits as a batch Job's Pod does, bounded by the job's activeDeadlineSeconds (a
            // GPU pool scaling up from zero, a busy pool, a preemption). Under Kueue, the wait
            // for a node after admission is Kueue's (its waitForPodsReady).
            _ => PodState::Starting {
                waiting: container
                    .and_then(|s| s.waiting)
                    .and_then(|w| {
                        w.reason
                            .map(|reason| (reason, w.message.unwrap_or_default()))
                    })
                    .or_else(|| unschedulable(&status)),
                since: scheduled_at(&status),
            },
        },
    }
}

/// A cleanup Pod (`harvester cleanup`), as the deleted job's finalizer sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodCleanup {
    /// Not finished yet.
    Pending,
    /// It answered.
    Done(crate::finalize::cleanup::Cleanup),
    /// It failed: why.
    Failed(String),
}

/// Reads a cleanup Pod: its answer from the termination message once it has ended.
pub fn observe_cleanup(pod: &Pod) -> PodCleanup {
    let status = pod.status.clone().unwrap_or_default();
    let terminated = status
        .container_statuses
        .iter()
        .flatten()
        .find(|c| c.name == CONTAINER)
        .and_then(|c| c.state.as_ref()?.terminated.clone());
    let message = terminated
        .as_ref()
        .and_then(|t| t.message.clone())
        .unwrap_or_default();
    match status.phase.as_deref() {
        Some("Succeeded") => serde_json::from_str(message.trim()).map_or_else(
            |_| PodCleanup::Failed(format!("the cleanup Pod answered {message:?}")),
            PodCleanup::Done,
        ),
        Some("Failed") => {
            let why = serde_json::from_str::<serde_json::Value>(message.trim())
                .ok()
                .and_then(|v| v["failed"].as_str().map(str::to_owned))
                .unwrap_or_else(|| failure(&status, terminated).message);
            PodCleanup::Failed(format!("the cleanup Pod failed: {why}"))
        }
        _ => PodCleanup::Pending,
    }
}

/// The Kueue LocalQueue of a Pod that Kueue's webhook took in (a Pod with the queue label
/// that Kueue does not manage, where its webhook does not reach, is an ordinary Pod).
fn kueue_queue(pod: &Pod) -> Option<&str> {
    let labels = pod.metadata.labels.as_ref()?;
    labels.get(KUEUE_MANAGED_LABEL).filter(|v| *v == "true")?;
    labels.get(KUEUE_QUEUE_LABEL).map(String::as_str)
}

/// Whether a scheduling gate still holds the Pod back from the scheduler.
fn gated(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .is_some_and(|gates| !gates.is_empty())
}

/// When the scheduler bound the Pod: the start of its second wait (the image pull, volumes),
/// so that a GPU node's scale-up and a large image's pull each get the whole start timeout.
fn scheduled_at(status: &k8s_openapi::api::core::v1::PodStatus) -> Option<Time> {
    status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "PodScheduled" && c.status == "True")?
        .last_transition_time
        .clone()
}

/// The scheduler's reason, while the Pod has no node.
fn unschedulable(status: &k8s_openapi::api::core::v1::PodStatus) -> Option<(String, String)> {
    let condition = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False")?;
    Some((
        condition
            .reason
            .clone()
            .unwrap_or_else(|| "Unschedulable".into()),
        condition.message.clone().unwrap_or_default(),
    ))
}

/// Why a failed Pod failed: a disruption or a node problem (the cluster's fault), the job's
/// deadline, or else the worker's own exit status.
fn failure(
    status: &k8s_openapi::api::core::v1::PodStatus,
    terminated: Option<k8s_openapi::api::core::v1::ContainerStateTerminated>,
) -> Failure {
    let disrupted = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "DisruptionTarget" && c.status == "True");
    let pod_reason = status.reason.clone().unwrap_or_default();
    if let Some(condition) = disrupted {
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
                .clone()
                .unwrap_or_else(|| "the Pod failed before its container ran".into()),
        }
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
    let blame = Blame::of_exit(Some(exit_code));
    match ExitStatus::from_code(exit_code) {
        ExitStatus::Failed(ErrorKind::BadInput) => Failure {
            blame,
            reason: "InvalidInput".into(),
            message: with_detail("the harvester refused its input".into()),
        },
        ExitStatus::Failed(ErrorKind::Infrastructure) => Failure {
            blame,
            reason: "StorageUnavailable".into(),
            message: with_detail("the object store failed".into()),
        },
        status @ (ExitStatus::Success
        | ExitStatus::Failed(ErrorKind::Internal)
        | ExitStatus::Unexpected(_)) => Failure {
            blame,
            reason: "WorkerFailed".into(),
            message: with_detail(format!(
                "the harvester exited with status {}",
                status.code()
            )),
        },
    }
}

/// What a running worker last reported on its log: its newest progress line.
pub fn reported_progress(log: &str) -> Option<ProgressEvent> {
    ProgressEvent::latest_in(log)
}
