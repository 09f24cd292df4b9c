//! Status conditions in the Kubernetes API conventions: one entry per type, whose
//! `lastTransitionTime` moves only when its status flips.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// The job holds a lane slot and its token reservation.
pub const ADMITTED: &str = "Admitted";
/// An attempt's Pod is starting or running.
pub const RUNNING: &str = "Running";
/// The job has ended, whatever the outcome (`reason` says which): wait on this one.
pub const FINISHED: &str = "Finished";
/// The job ended with its files written (`kubectl wait --for=condition=Succeeded`), as a
/// batch Job's `Complete`.
pub const SUCCEEDED: &str = "Succeeded";
/// The job ended without its files: failed or cancelled (`reason` says which), as a batch
/// Job's `Failed`. `kubectl wait --for=condition=Failed` returns on it.
pub const FAILED: &str = "Failed";
/// The `Finished` reason of a cancelled job.
pub const CANCELLED: &str = "Cancelled";
/// The `Finished` message of a cancelled job.
pub const CANCELLED_MESSAGE: &str = "cancelled by its owner";
/// The prefix of the `Finished` reason of a copy of a job that ran before under the same
/// name and spec (`AlreadySucceeded`, `AlreadyFailed`, `AlreadyCancelled`): a GitOps tool
/// applied the manifest again after the TTL deleted the job. It runs nothing and is charged
/// nothing, and its TTL does not delete it.
pub const ALREADY: &str = "Already";

/// What a condition should now say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConditionUpdate<'a> {
    /// `Admitted`, `Running` or `Finished`.
    pub type_: &'a str,
    /// True or false.
    pub status: bool,
    /// A CamelCase reason.
    pub reason: &'a str,
    /// A human sentence.
    pub message: String,
}

/// Sets one condition in `conditions`, keeping its transition time if its status is unchanged.
pub fn set(
    conditions: &mut Vec<Condition>,
    update: ConditionUpdate<'_>,
    generation: Option<i64>,
    now: &Time,
) {
    let status = if update.status { "True" } else { "False" }.to_owned();
    match conditions.iter_mut().find(|c| c.type_ == update.type_) {
        Some(existing) => {
            if existing.status != status {
                existing.last_transition_time = now.clone();
            }
            existing.status = status;
            existing.reason = update.reason.to_owned();
            existing.message = update.message;
            existing.observed_generation = generation;
        }
        None => conditions.push(Condition {
            type_: update.type_.to_owned(),
            status,
            reason: update.reason.to_owned(),
            message: update.message,
            observed_generation: generation,
            last_transition_time: now.clone(),
        }),
    }
}

/// The condition of `type_`, if present.
pub fn get<'c>(conditions: &'c [Condition], type_: &str) -> Option<&'c Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// Whether the condition of `type_` is present and true.
pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    get(conditions, type_).is_some_and(|c| c.status == "True")
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    fn at(seconds: i64) -> Time {
        Time(Timestamp::from_second(seconds).unwrap())
    }

    fn update(status: bool, reason: &str) -> ConditionUpdate<'_> {
        ConditionUpdate {
            type_: ADMITTED,
            status,
            reason,
            message: reason.to_owned(),
        }
    }

    #[test]
    fn the_transition_time_moves_only_when_the_status_flips() {
        let mut conditions = Vec::new();
        set(
            &mut conditions,
            update(false, "WaitingForLane"),
            Some(1),
            &at(10),
        );
        set(
            &mut conditions,
            update(false, "StillWaiting"),
            Some(1),
            &at(20),
        );
        assert_eq!(conditions.len(), 1);
        assert_eq!(conditions[0].last_transition_time, at(10));
        assert_eq!(conditions[0].reason, "StillWaiting");
        set(&mut conditions, update(true, "Admitted"), Some(2), &at(30));
        assert_eq!(conditions[0].last_transition_time, at(30));
        assert_eq!(conditions[0].observed_generation, Some(2));
        assert!(is_true(&conditions, ADMITTED));
        assert!(!is_true(&conditions, FINISHED));
    }
}
