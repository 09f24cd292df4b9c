//! Pods, both ways and both pure: [`render`] builds an attempt's Pod from the job and the
//! catalogue, and [`observe`] reads a Pod back into a [`PodState`] the lifecycle understands.

mod observe;
mod render;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

pub use self::observe::{observe, reported_progress};
pub use self::render::render;
use harvest_crds::ResultSummary;

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

#[cfg(test)]
mod tests;
