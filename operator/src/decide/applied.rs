//! What applying a decision's Pod actions came to, written into the status about to be
//! written: pure bookkeeping, the last step of the decision.

use std::time::Duration;

use harvest_crds::conditions;
use k8s_openapi::jiff::Timestamp;

use super::{Decision, FAILED_CREATE, WAITING_FOR_QUOTA};

/// What the Pod actions came to, beyond the Pods made.
#[derive(Debug, Default)]
pub(crate) struct Applied {
    /// A create the apiserver refused for good: the attempt's failure.
    pub(crate) refused: Option<String>,
    /// Creates a ResourceQuota refused, by role: each attempt waits, uncounted.
    pub(crate) waiting_for_quota: Vec<(crate::pod::Role, String)>,
}

impl Applied {
    /// Writes what the next decision reads into the status about to be written: a refused
    /// create as the Running condition `FailedCreate` (the attempt's failure), a create
    /// waiting for quota as `WaitingForQuota` on the condition or on its part's message (the
    /// attempt stands and its Pod is created again).
    pub(crate) fn record(
        &self,
        decision: &mut Decision,
        config: &crate::config::OperatorConfig,
        generation: Option<i64>,
        now: Timestamp,
    ) {
        let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(now);
        let mut running = |reason: &'static str, message: &str| {
            conditions::set(
                &mut decision.status.conditions,
                conditions::ConditionUpdate {
                    type_: conditions::RUNNING,
                    status: false,
                    reason,
                    message: message.to_owned(),
                },
                generation,
                &now,
            );
        };
        if let Some(refusal) = &self.refused {
            running(FAILED_CREATE, refusal);
        }
        for (role, message) in &self.waiting_for_quota {
            match role {
                crate::pod::Role::Part { index, .. } => {
                    if let Some(part) = decision.status.parts.iter_mut().find(|p| p.index == *index)
                    {
                        part.message = format!("{WAITING_FOR_QUOTA}: {message}");
                    }
                }
                crate::pod::Role::Whole | crate::pod::Role::Finalize => {
                    running(WAITING_FOR_QUOTA, message);
                }
            }
        }
        if !self.waiting_for_quota.is_empty() {
            let poll = Duration::from_secs(config.admission_poll_seconds);
            decision.requeue_after = Some(decision.requeue_after.map_or(poll, |r| r.min(poll)));
        }
    }
}

/// Whether the job's status already says this role waits for quota (its Event was published).
pub(crate) fn already_waiting(
    status: &harvest_crds::HarvestJobStatus,
    role: crate::pod::Role,
) -> bool {
    match role {
        crate::pod::Role::Part { index, .. } => status
            .parts
            .iter()
            .any(|p| p.index == index && p.message.starts_with(WAITING_FOR_QUOTA)),
        crate::pod::Role::Whole | crate::pod::Role::Finalize => {
            conditions::get(&status.conditions, conditions::RUNNING)
                .is_some_and(|c| c.reason == WAITING_FOR_QUOTA)
        }
    }
}

/// A Pod's role as its messages begin: nothing for a one-Pod job, `part I/N ` (which the
/// part's retry reads back from a refused create's condition) or `finalize `.
pub(crate) fn what(role: crate::pod::Role) -> String {
    match role {
        crate::pod::Role::Whole => String::new(),
        crate::pod::Role::Part { index, count } => format!("part {index}/{count} "),
        crate::pod::Role::Finalize => "finalize ".to_owned(),
    }
}
