//! Pods, both ways and both pure: [`render`] builds an attempt's Pod from the job and the
//! catalogue, and [`observe`] reads a Pod back into a [`PodState`] the lifecycle understands.

mod observe;
mod render;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

pub use self::observe::{PodCleanup, observe, observe_cleanup, observe_for_job, reported_progress};
pub use self::render::{render, render_cleanup};
use harvest_crds::ResultSummary;

/// Label on every Pod the operator creates (the controller watches only these).
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "harvest-operator");
/// Label naming a Pod's job.
pub const JOB_LABEL: &str = "harvest.dev/job";
/// Label with the UID of a Pod's job: in the operator's worker namespace, where tenants cannot
/// create Pods, it is what makes a Pod the job's own.
pub const JOB_UID_LABEL: &str = "harvest.dev/job-uid";
/// Label with the namespace of a Pod's job, and one with the account that pays for it (once
/// admitted): workers run in the operator's namespace, so these are what chargeback tools
/// (OpenCost, Kubecost) and a platform's dashboards group them by.
pub const TENANT_LABEL: &str = "harvest.dev/tenant";
/// See [`TENANT_LABEL`].
pub const ACCOUNT_LABEL: &str = "harvest.dev/account";
/// Annotations naming a Pod's job in full, to find the job from a Pod in another namespace.
pub const JOB_NAMESPACE_ANNOTATION: &str = "harvest.dev/job-namespace";
/// See [`JOB_NAMESPACE_ANNOTATION`].
pub const JOB_NAME_ANNOTATION: &str = "harvest.dev/job-name";
/// Where the harvester writes its summary; the kubelet turns it into the termination message.
pub const TERMINATION_LOG: &str = "/dev/termination-log";
/// The worker container's name.
pub const CONTAINER: &str = "harvester";

/// The Pod name of attempt `attempt` (1-based) of the job `job` with UID `uid`:
/// deterministic, so a repeated create after a lost write finds the same Pod instead of
/// starting a second one, and different for a job recreated under the same name, whose old
/// Pod may still be terminating. A job name too long for the suffix (names may have 253
/// characters) is shortened with a hash of itself.
pub fn pod_name(job: &str, uid: Option<&str>, attempt: u32) -> String {
    role_pod_name(job, uid, Role::Whole, attempt)
}

/// What a worker Pod does for its job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Runs the whole job.
    Whole,
    /// Runs part `index` of `count` (`harvester run --part`, the part in `HARVEST_PART`).
    Part {
        /// From 0.
        index: u32,
        /// Parts in the job.
        count: u32,
    },
    /// Closes a job whose parts have all run (`harvester finalize`); takes no GPU.
    Finalize,
}

/// Kueue's label naming the LocalQueue that admits a Pod: Kueue's webhook then holds the Pod
/// behind its scheduling gate, and its controller lifts the gate once the ClusterQueue has
/// room (Kueue's plain-Pod integration, one Workload per Pod).
pub const KUEUE_QUEUE_LABEL: &str = "kueue.x-k8s.io/queue-name";
/// Label naming the Kueue WorkloadPriorityClass of a queued Pod's Workload.
pub const KUEUE_PRIORITY_LABEL: &str = "kueue.x-k8s.io/priority-class";
/// The label Kueue's webhook puts on each Pod it took in: from then on Kueue, not the start
/// timeout, decides how long the Pod waits for a node.
pub const KUEUE_MANAGED_LABEL: &str = "kueue.x-k8s.io/managed";

/// Label with a part's index, on the Pods of a job run in parts.
pub const PART_LABEL: &str = "harvest.dev/part";
/// The environment variable a part's worker reads its `INDEX/COUNT` from, as an Indexed Job's
/// Pods read `JOB_COMPLETION_INDEX`.
pub const PART_ENV: &str = "HARVEST_PART";

/// A Pod to create: what it does, its 1-based attempt (per part, for parts), and what is left
/// of the job's deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attempt {
    /// What it does.
    pub role: Role,
    /// The attempt, from 1.
    pub number: u32,
    /// Seconds left, for the Pod's own `activeDeadlineSeconds`.
    pub deadline_seconds: Option<i64>,
}

/// The Pod name of attempt `attempt` of `role` for the job `job` with UID `uid`: `-N` for a
/// whole run, `-pI-N` for part I, `-finalize-N` for the finalize step (see [`pod_name`]).
pub fn role_pod_name(job: &str, uid: Option<&str>, role: Role, attempt: u32) -> String {
    let role = match role {
        Role::Whole => String::new(),
        Role::Part { index, .. } => format!("p{index}-"),
        Role::Finalize => "finalize-".to_owned(),
    };
    job_pod_name(job, uid, &format!("{role}{attempt}"))
}

/// `<job>-<uid>-<tail>`: the job's name (shortened if need be) and the end of its UID.
fn job_pod_name(job: &str, uid: Option<&str>, tail: &str) -> String {
    let alphanumeric: Vec<char> = uid
        .unwrap_or_default()
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .map(|c| c.to_ascii_lowercase())
        .collect();
    let uid: String = alphanumeric[alphanumeric.len().saturating_sub(UID_IN_NAME)..]
        .iter()
        .collect();
    let suffix = match uid.is_empty() {
        true => format!("-{tail}"),
        false => format!("-{uid}-{tail}"),
    };
    format!("{}{suffix}", shortened(job, 253 - suffix.len()))
}

/// The name of the Pod that deletes the local outputs of the deleted job `job` with UID `uid`
/// (`harvester cleanup`): one per job, so a repeated create finds it.
pub fn cleanup_pod_name(job: &str, uid: Option<&str>) -> String {
    job_pod_name(job, uid, "cleanup")
}

/// Characters of the job's UID in its Pods' names: its last ones, random in an apiserver's
/// UIDs (and distinct in the test cluster's sequential ones).
const UID_IN_NAME: usize = 8;

/// `name` if it has at most `max` characters, else a prefix of it and a hash of the whole,
/// `max` characters in all: distinct for distinct names, and still a valid name or label.
pub fn shortened(name: &str, max: usize) -> String {
    if name.len() <= max {
        return name.to_owned();
    }
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in name.bytes() {
        hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
    }
    let prefix = name[..max - 17].trim_end_matches(['-', '.']);
    format!("{prefix}-{hash:016x}")
}

/// The job label's value: label values have at most 63 characters.
pub fn job_label(job: &str) -> String {
    shortened(job, 63)
}

/// Who is to blame for a failed attempt, which decides whether it is retried and counted: the
/// rule the embedded backend retries by too.
pub use harvest_core::worker::Blame;

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
        /// Why it waits, if the kubelet or the scheduler says.
        waiting: Option<(String, String)>,
        /// When its current wait began, which starts its `startTimeoutSeconds`: its creation
        /// while it waits for a node, then the time it was scheduled.
        since: Option<Time>,
    },
    /// The harvester runs.
    Running,
    /// The harvester finished; `result` is its summary when the message could be read.
    Succeeded {
        /// The summary from the termination message.
        result: Option<ResultSummary>,
        /// A part's summary from it, for a part's Pod.
        part: Option<harvest_core::worker::PartResult>,
    },
    /// The attempt failed; `finished_at` starts the retry delay.
    Failed {
        /// What went wrong.
        failure: Failure,
        /// When.
        finished_at: Option<Time>,
    },
    /// Being deleted: since `since`, with `grace_seconds` for its containers to stop. A Pod
    /// still there long past that is on a node that stopped answering.
    Terminating {
        /// Its deletion timestamp.
        since: Option<Time>,
        /// Its deletion grace period.
        grace_seconds: i64,
    },
    /// A Pod of that name exists but the operator did not create it for this job (no
    /// controller reference with the job's UID, nor, in the worker namespace, the job's UID
    /// label): nothing of it is read or deleted.
    Foreign {
        /// Who controls it, if anyone: `Kind/name`.
        controller: Option<String>,
    },
}

#[cfg(test)]
mod tests;
