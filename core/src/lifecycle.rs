//! The job lifecycle, one pure function: given a job's status and an event, what it becomes and
//! what it is charged. The embedded API and the Kubernetes operator apply the same table.
//!
//! ```text
//! pending ──started──► running ──succeeded──► done      (charged the tokens that ran)
//!    │                    ├──────failed─────► failed    (hold released: charged 0)
//!    └──failed / cancel──►┴──────cancel─────► cancelled (charged the reservation if it had started, else 0)
//! ```

use serde::{Deserialize, Serialize};

/// A job's status, as the API reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobStatus {
    /// Admitted, waiting for its worker.
    Pending,
    /// Its worker is running.
    Running,
    /// Finished; files are downloadable.
    Done,
    /// Ended with an error.
    Failed,
    /// Cancelled by its owner.
    Cancelled,
}

impl JobStatus {
    /// Whether the job has ended.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Done | Self::Failed | Self::Cancelled)
    }

    /// The lowercase wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Running => "running",
            Self::Done => "done",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }
}

/// Something that happened to a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobEvent {
    /// Its worker started running.
    Started,
    /// Its worker finished, having run `tokens` tokens.
    Succeeded {
        /// Tokens the engine read.
        tokens: u64,
    },
    /// Its worker failed, or could not be started.
    Failed,
    /// Its owner asked to cancel it.
    Cancel,
}

/// What an event does to a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// The job moves to `status`; when `charge` is set the job has ended and its hold settles at
    /// that many tokens; `stop_worker` asks for its worker to be stopped.
    To {
        /// The new status.
        status: JobStatus,
        /// Tokens to charge, for a job that ends with this transition.
        charge: Option<u64>,
        /// Whether a worker may be running and must be stopped.
        stop_worker: bool,
    },
    /// Nothing changes (a late report from a worker of an ended job, or a repeated cancel).
    Unchanged,
}

/// An event that is not allowed in the job's status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LifecycleError {
    /// Only pending and running jobs can be cancelled.
    #[error("the job is already {}; only pending or running jobs can be cancelled", status.as_str())]
    NotCancellable {
        /// The job's status.
        status: JobStatus,
    },
}

/// The lifecycle table. `reserved` is what the job holds.
pub fn next(
    status: JobStatus,
    reserved: u64,
    event: JobEvent,
) -> Result<Transition, LifecycleError> {
    use JobEvent as E;
    use JobStatus as S;
    let to = |status, charge, stop_worker| {
        Ok(Transition::To {
            status,
            charge,
            stop_worker,
        })
    };
    match (status, event) {
        (S::Pending, E::Started) => to(S::Running, None, false),
        // A worker that reports more than was reserved (a foreign or faulty report) is charged
        // the reservation: the hold is the most a job can cost.
        (S::Pending | S::Running, E::Succeeded { tokens }) => {
            to(S::Done, Some(tokens.min(reserved)), false)
        }
        (S::Pending | S::Running, E::Failed) => to(S::Failed, Some(0), false),
        (S::Pending, E::Cancel) => to(S::Cancelled, Some(0), true),
        (S::Running, E::Cancel) => to(S::Cancelled, Some(reserved), true),
        (S::Cancelled, E::Cancel) => Ok(Transition::Unchanged),
        (S::Done | S::Failed, E::Cancel) => Err(LifecycleError::NotCancellable { status }),
        (S::Running, E::Started) | (S::Done | S::Failed | S::Cancelled, _) => {
            Ok(Transition::Unchanged)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_that_runs_to_completion_is_charged_what_ran() {
        assert_eq!(
            next(JobStatus::Running, 100, JobEvent::Succeeded { tokens: 80 }),
            Ok(Transition::To {
                status: JobStatus::Done,
                charge: Some(80),
                stop_worker: false
            })
        );
    }

    #[test]
    fn a_failed_job_releases_its_hold() {
        for status in [JobStatus::Pending, JobStatus::Running] {
            assert_eq!(
                next(status, 100, JobEvent::Failed),
                Ok(Transition::To {
                    status: JobStatus::Failed,
                    charge: Some(0),
                    stop_worker: false
                })
            );
        }
    }

    #[test]
    fn cancelling_after_the_start_charges_the_reservation_and_before_costs_nothing() {
        assert_eq!(
            next(JobStatus::Running, 100, JobEvent::Cancel),
            Ok(Transition::To {
                status: JobStatus::Cancelled,
                charge: Some(100),
                stop_worker: true
            })
        );
        assert_eq!(
            next(JobStatus::Pending, 100, JobEvent::Cancel),
            Ok(Transition::To {
                status: JobStatus::Cancelled,
                charge: Some(0),
                stop_worker: true
            })
        );
    }

    #[test]
    fn a_second_cancel_changes_nothing_and_ended_jobs_cannot_be_cancelled() {
        assert_eq!(
            next(JobStatus::Cancelled, 100, JobEvent::Cancel),
            Ok(Transition::Unchanged)
        );
        let err = next(JobStatus::Done, 100, JobEvent::Cancel).unwrap_err();
        assert!(err.to_string().contains("already done"), "{err}");
        assert!(next(JobStatus::Failed, 100, JobEvent::Cancel).is_err());
    }

    #[test]
    fn a_late_worker_report_never_changes_an_ended_job() {
        for status in [JobStatus::Done, JobStatus::Failed, JobStatus::Cancelled] {
            assert_eq!(
                next(status, 1, JobEvent::Succeeded { tokens: 1 }),
                Ok(Transition::Unchanged)
            );
            assert_eq!(next(status, 1, JobEvent::Failed), Ok(Transition::Unchanged));
        }
    }
}
