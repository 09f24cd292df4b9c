//! The reconcile decision, pure: what the job's status should say and what to do, given the job,
//! its spec check, its current Pod, the admission verdict and the time. Charges come from
//! `core::lifecycle::next`, the table the embedded backend applies too.
//!
//! ```text
//! finished? ── TTL ──► delete job
//! invalid spec / cancel / deadline ──► Finished (Failed / Cancelled), stop the Pod
//! suspended ──► release the slot, stop the Pod
//! not admitted ──► admission verdict: wait, or admit (reserve tokens)
//! admitted ──► no Pod: create attempt n+1 │ Pod running │ succeeded: Finished, charge tokens run
//!                                         │ failed: input → Failed; job → retry (counted, backoff);
//!                                         │         infrastructure → retry (not counted)
//! in parts ──► each part as above, on its own (`parts.rs`); all done ──► the finalize
//!              Pod, driven as the one Pod above
//! ```
//!
//! New worker Pods wait for a slot under the model's `maxPods` (`Workers::pod_slots`), which
//! the shell reckons first come first served over every job.

use std::time::Duration;

use harvest_core::lifecycle::JobEvent;
use harvest_crds::conditions::{self, ADMITTED, ConditionUpdate, FINISHED, RUNNING};
use harvest_crds::{HarvestJob, HarvestJobStatus, JobPhase, Progress, SpecError, TokenUsage};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, MicroTime, Time};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;

pub mod admission;
pub mod applied;
pub mod tenant_quota;

use self::admission::Admission;
use crate::config::OperatorConfig;
use crate::pod::{Attempt, Blame, Failure, PodState, Role, role_pod_name};

/// The limits `decide` applies, from the operator's configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// Base delay before retrying a counted failure (doubles per failure, capped at 300 s).
    pub retry_base: Duration,
    /// Infrastructure failures retried before the job fails.
    pub max_infrastructure_retries: u32,
    /// How often a waiting job checks for a slot again.
    pub admission_poll: Duration,
    /// How often a running job's progress is read from its worker's log.
    pub progress_refresh: Duration,
    /// How long past its grace period a Pod may stay Terminating before it is taken for lost
    /// (its node stopped answering, so no kubelet will ever remove it).
    pub pod_lost_after: Duration,
}

impl From<&OperatorConfig> for Policy {
    /// The limits the configuration sets.
    fn from(config: &OperatorConfig) -> Self {
        Self {
            retry_base: Duration::from_secs(config.retry_base_seconds),
            max_infrastructure_retries: config.max_infrastructure_retries,
            admission_poll: Duration::from_secs(config.admission_poll_seconds),
            progress_refresh: Duration::from_secs(config.progress_refresh_seconds),
            pod_lost_after: Duration::from_secs(config.pod_lost_after_seconds),
        }
    }
}

impl Policy {
    /// Delay before retrying after `failures` counted failures.
    pub fn retry_delay(&self, failures: u32) -> Duration {
        let factor = 1u32 << failures.saturating_sub(1).min(8);
        (self.retry_base * factor).min(Duration::from_secs(300))
    }
}

/// What the reconcile observed.
#[derive(Debug, Clone)]
pub struct Observed<'a> {
    /// The job.
    pub job: &'a HarvestJob,
    /// The spec check: `Ok` with the tokens to reserve, or why it cannot run.
    pub spec: Result<u64, SpecError>,
    /// The current attempt's Pod (`status.pod`), if it exists.
    pub pod: Option<PodState>,
    /// What the running worker last reported: its newest progress line.
    pub reported: Option<harvest_core::worker::ProgressEvent>,
    /// The admission verdict, consulted only while the job waits.
    pub admission: Admission,
    /// The account that holds the job's tokens, once admission took its hold.
    pub account: Option<String>,
    /// The lane the job would run in (`small` or `large`).
    pub lane: Option<String>,
    /// Now.
    pub now: Timestamp,
    /// How long the model's Pod may take to start (the catalogue's `startTimeoutSeconds`).
    pub start_timeout: Option<Duration>,
    /// The harvester image the catalogue gives the model now.
    pub worker_image: Option<String>,
    /// The job's workers: parts and Pod slots.
    pub workers: Workers,
}

/// What the reconcile observed of a job's parts, and the Pods it may start.
#[derive(Debug, Clone, PartialEq)]
pub struct Workers {
    /// The workers the spec check chose, which admission fixes in the status.
    pub parallelism: u32,
    /// Each part's current Pod (`status.parts[i].pod`), if it exists, by index.
    pub parts: Vec<Option<PodState>>,
    /// Each running part's last progress line, by index.
    pub reports: Vec<Option<harvest_core::worker::ProgressEvent>>,
    /// Worker Pods the job may create now under the model's `maxPods`.
    pub pod_slots: u32,
}

impl Default for Workers {
    /// One worker, no cap.
    fn default() -> Self {
        Self {
            parallelism: 1,
            parts: Vec::new(),
            reports: Vec::new(),
            pod_slots: u32::MAX,
        }
    }
}

/// The reason of the `Running` condition while a job's Pods wait for a slot under the model's
/// `maxPods`; the shell counts such jobs as queued.
pub const WAITING_FOR_POD_SLOT: &str = "WaitingForPodSlot";

/// The reason of a Pod create the apiserver refused, on its Event and on the Running
/// condition the shell sets, which the next decision reads as the attempt's failure.
pub const FAILED_CREATE: &str = "FailedCreate";

/// The reason of a Pod create that a ResourceQuota refused: the attempt stands, uncounted, and
/// its Pod is created again every `admissionPollSeconds` until the quota frees. On the Running
/// condition (a one-Pod job's or finalize Pod's) or a part's message, and on its Event.
pub const WAITING_FOR_QUOTA: &str = "WaitingForQuota";

/// Something the shell does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Create this attempt's Pod.
    CreatePod(Attempt),
    /// Delete this Pod.
    DeletePod(String),
    /// Delete the job (its TTL ran out).
    DeleteJob,
    /// Record an Event on the job.
    Event {
        /// Warning rather than Normal.
        warning: bool,
        /// CamelCase reason.
        reason: String,
        /// A sentence.
        note: String,
    },
}

/// The decision: the status to write (if it differs), actions in order, and when to look again.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The status the job should have.
    pub status: HarvestJobStatus,
    /// What to do, in order.
    pub actions: Vec<Action>,
    /// Reconcile again after this long even if nothing changes.
    pub requeue_after: Option<Duration>,
}

/// How a job ends.
enum Outcome {
    Succeeded(Option<harvest_crds::ResultSummary>),
    Failed {
        reason: String,
        message: String,
    },
    Cancelled,
    /// A copy of a job that ran before ([`Admission::AlreadyRan`]): no run, no charge; it
    /// ends in that run's phase.
    AlreadyRan {
        phase: String,
        message: String,
    },
}

struct Builder<'a> {
    observed: &'a Observed<'a>,
    now: Time,
    old: HarvestJobStatus,
    status: HarvestJobStatus,
    actions: Vec<Action>,
    requeue_after: Option<Duration>,
}

/// Decides one reconcile.
pub fn decide(observed: &Observed<'_>, policy: &Policy) -> Decision {
    let old = observed.job.status_or_default();
    let mut b = Builder {
        observed,
        now: Time(observed.now),
        status: HarvestJobStatus {
            observed_generation: observed.job.metadata.generation,
            ..old.clone()
        },
        old,
        actions: Vec::new(),
        requeue_after: None,
    };
    b.run(policy);
    // The first worker's image is the job's: every later attempt and part runs it, so that an
    // upgrade mid-job neither changes the bytes nor breaks a resume.
    let creates = b.actions.iter().any(|a| matches!(a, Action::CreatePod(_)));
    if creates && b.status.worker_image.is_none() {
        b.status.worker_image.clone_from(&observed.worker_image);
    }
    b.status.phase = Some(phase(&b.status, observed.job.spec.suspend));
    Decision {
        status: b.status,
        actions: b.actions,
        requeue_after: b.requeue_after,
    }
}

impl Builder<'_> {
    fn run(&mut self, policy: &Policy) {
        let job = self.observed.job;
        let spec = &job.spec;
        if conditions::is_true(&self.old.conditions, FINISHED) {
            return self.after_finish();
        }
        let reserved = match &self.observed.spec {
            Ok(tokens) => *tokens,
            Err(error) => {
                let outcome = Outcome::Failed {
                    reason: error.reason().into(),
                    message: error.to_string(),
                };
                return self.finish(outcome);
            }
        };
        if spec.cancel {
            return self.finish(Outcome::Cancelled);
        }
        if let Some(left) = self.deadline_left()
            && left <= 0
        {
            let limit = spec.active_deadline_seconds.unwrap_or_default();
            let message = format!("the job ran past activeDeadlineSeconds ({limit} s)");
            return self.finish(Outcome::Failed {
                reason: "DeadlineExceeded".into(),
                message,
            });
        }
        let admitted = conditions::is_true(&self.old.conditions, ADMITTED);
        if spec.suspend {
            return self.suspend(admitted);
        }
        if !admitted {
            match &self.observed.admission {
                Admission::Refuse { reason, message } => {
                    return self.finish(Outcome::Failed {
                        reason: (*reason).to_owned(),
                        message: message.clone(),
                    });
                }
                Admission::AlreadyRan { phase, message } => {
                    return self.finish(Outcome::AlreadyRan {
                        phase: phase.clone(),
                        message: message.clone(),
                    });
                }
                Admission::Wait { reason, message } => {
                    self.set(ADMITTED, false, reason, message.clone());
                    self.requeue_after = Some(policy.admission_poll);
                    return;
                }
                Admission::Admit => {
                    let lane = self.observed.lane.clone().unwrap_or_default();
                    self.set(
                        ADMITTED,
                        true,
                        "Admitted",
                        format!("admitted to the {lane} lane, holding {reserved} tokens"),
                    );
                    self.status.lane = self.observed.lane.clone();
                    self.status.admitted_at = Some(MicroTime(self.observed.now));
                    self.status.account = self.observed.account.clone();
                    self.status.tokens = Some(TokenUsage {
                        reserved,
                        charged: None,
                    });
                    let parallelism = self.observed.workers.parallelism;
                    self.status.parallelism = (parallelism > 1).then_some(parallelism);
                    self.event(false, "Admitted", format!("admitted to the {lane} lane"));
                }
            }
        }
        self.drive(policy);
    }

    /// An admitted job: start, watch or retry its Pod.
    fn drive(&mut self, policy: &Policy) {
        self.note_running();
        if self.status.part_count() > 1 && !self.parts_done(&self.old) {
            self.drive_parts(policy);
            if self.finished() || !self.parts_done(&self.status) {
                return self.wake_for_deadline();
            }
        }
        let attempts = self.old.attempts;
        let infra_retries = attempts.saturating_sub(1 + self.old.failures);
        match self.observed.pod.clone() {
            None if attempts == 0 || self.old.pod.is_none() => {
                if self.pod_slot_free(policy) {
                    self.start_attempt(0);
                }
            }
            None if conditions::get(&self.old.conditions, RUNNING)
                .is_some_and(|c| c.reason == WAITING_FOR_QUOTA) =>
            {
                self.create_again(policy);
            }
            None => self.vanished(infra_retries, policy),
            Some(PodState::Starting { waiting, since }) => self.starting(waiting, since),
            Some(PodState::Running) => {
                self.set(
                    RUNNING,
                    true,
                    "PodRunning",
                    format!("attempt {attempts} is running"),
                );
                let shard_size = self.observed.job.spec.harvest.shard_size;
                if let Some(progress) = self
                    .observed
                    .reported
                    .as_ref()
                    .and_then(|r| reported(r, shard_size))
                {
                    self.status.progress = Some(progress);
                }
                self.requeue_after = Some(policy.progress_refresh);
            }
            Some(PodState::Terminating {
                since,
                grace_seconds,
            }) => {
                let pod = self.old.pod.clone().unwrap_or_default();
                if let Some(failure) = self.stuck(&pod, since, grace_seconds, policy) {
                    self.retry(failure, None, infra_retries, policy);
                }
            }
            Some(PodState::Foreign { controller }) => self.foreign(controller),
            Some(PodState::Succeeded { result, .. }) => self.finish(Outcome::Succeeded(result)),
            Some(PodState::Failed {
                failure,
                finished_at,
            }) => self.retry(failure, finished_at, infra_retries, policy),
        }
        self.wake_for_deadline();
    }

    /// Looks again when the deadline runs out.
    fn wake_for_deadline(&mut self) {
        if let Some(left) = self.deadline_left()
            && !self.finished()
        {
            self.wake_within(Duration::from_secs(left.max(1) as u64));
        }
    }

    /// Reconciles again within `wake` at the latest.
    fn wake_within(&mut self, wake: Duration) {
        self.requeue_after = Some(self.requeue_after.map_or(wake, |r| r.min(wake)));
    }

    /// Records the first time a worker is seen to have run.
    fn note_running(&mut self) {
        let ran = |pod: &Option<PodState>| {
            matches!(
                pod,
                Some(PodState::Running | PodState::Succeeded { .. } | PodState::Failed { .. })
            )
        };
        let ran = ran(&self.observed.pod) || self.observed.workers.parts.iter().any(ran);
        if ran && self.status.running_since.is_none() {
            self.status.running_since = Some(self.now.clone());
        }
    }

    /// The attempt's Pod is gone before it finished: a create the apiserver refused (the
    /// `FailedCreate` condition the shell set), or a Pod deleted under the job.
    fn vanished(&mut self, infra_retries: u32, policy: &Policy) {
        let refused =
            conditions::get(&self.old.conditions, RUNNING).filter(|c| c.reason == FAILED_CREATE);
        // A refused create is retried with backoff and counted, so that a
        // missing ServiceAccount or a Pod Security refusal ends the job (and its
        // hold) after backoffLimit.
        let failed_at = refused.map(|c| c.last_transition_time.clone());
        let failure = vanished_failure(refused, self.old.pod.as_deref());
        self.retry(failure, failed_at, infra_retries, policy);
    }

    /// A Pod not yet running: reported as it waits, and, once a node has it, failed when it
    /// has waited out the model's `startTimeoutSeconds` from scheduling (the kubelet will not
    /// start it: an image that cannot be pulled, a volume that cannot be mounted; its slot is
    /// freed and nothing is charged). `since` is `None` while no node has it: that wait has
    /// no timeout of its own, as a batch Job's has none.
    fn starting(&mut self, waiting: Option<(String, String)>, since: Option<Time>) {
        let attempts = self.old.attempts;
        if let (Some(timeout), Some(since)) = (self.observed.start_timeout, since) {
            let waited = self.observed.now.duration_since(since.0);
            let left = SignedDuration::try_from(timeout).unwrap_or_default() - waited;
            if left <= SignedDuration::ZERO {
                let why = waiting.map_or_else(String::new, |(reason, message)| {
                    format!(": {reason}: {message}")
                });
                let message = format!(
                    "attempt {attempts}'s Pod did not start within startTimeoutSeconds ({} s){why}",
                    timeout.as_secs()
                );
                return self.finish(Outcome::Failed {
                    reason: "PodStartTimeout".into(),
                    message,
                });
            }
            let wake = Duration::try_from(left).unwrap_or(timeout);
            self.requeue_after = Some(self.requeue_after.map_or(wake, |r| r.min(wake)));
        }
        match waiting {
            Some((reason, message)) => self.set(RUNNING, false, &reason, message),
            None => self.set(
                RUNNING,
                true,
                "PodStarting",
                format!("attempt {attempts} is starting"),
            ),
        }
    }

    /// A Pod deleted (evicted, say) that is still there [`Policy::pod_lost_after`] past its
    /// grace period: its node stopped answering, and no kubelet will ever remove it. It is the
    /// attempt's failure, the cluster's fault; until then the job looks again when it is due.
    pub(super) fn stuck(
        &mut self,
        pod: &str,
        since: Option<Time>,
        grace_seconds: i64,
        policy: &Policy,
    ) -> Option<Failure> {
        let since = since?;
        let allowed = SignedDuration::from_secs(grace_seconds.max(0))
            + SignedDuration::try_from(policy.pod_lost_after).unwrap_or_default();
        let waited = self.observed.now.duration_since(since.0);
        if waited < allowed {
            let left = Duration::try_from(allowed - waited).unwrap_or(policy.pod_lost_after);
            self.wake_within(left.max(Duration::from_secs(1)));
            return None;
        }
        Some(Failure {
            blame: Blame::Infrastructure,
            reason: "PodLost".into(),
            message: format!(
                "Pod {pod} stayed Terminating {} s after it was deleted (its node stopped answering)",
                waited.as_secs()
            ),
        })
    }

    /// The attempt's name is taken by a Pod the operator did not make for this job: the job
    /// fails (charged only for what its own earlier attempts ran, which is nothing), and the
    /// Pod is left alone.
    fn foreign(&mut self, controller: Option<String>) {
        let pod = self.old.pod.clone().unwrap_or_default();
        self.finish(foreign_outcome(&pod, controller));
    }

    fn retry(
        &mut self,
        failure: Failure,
        finished_at: Option<Time>,
        infra_retries: u32,
        policy: &Policy,
    ) {
        let attempt = self.old.attempts;
        let spec = &self.observed.job.spec;
        match failure.blame {
            Blame::Input => self.finish(Outcome::Failed {
                reason: failure.reason,
                message: failure.message,
            }),
            Blame::Infrastructure if infra_retries >= policy.max_infrastructure_retries => {
                let message = format!(
                    "{}; {infra_retries} infrastructure retries used up",
                    failure.message
                );
                self.finish(Outcome::Failed {
                    reason: "InfrastructureRetriesExhausted".into(),
                    message,
                });
            }
            Blame::Infrastructure => {
                if !self.pod_slot_free(policy) {
                    return;
                }
                self.event(
                    true,
                    &failure.reason,
                    format!(
                        "attempt {attempt}: {}; retrying (not counted against backoffLimit)",
                        failure.message
                    ),
                );
                self.start_attempt(0);
            }
            Blame::Job if i64::from(self.old.failures) + 1 > i64::from(spec.backoff_limit) => {
                let message = format!(
                    "attempt {attempt} failed ({}: {}); backoffLimit {} reached",
                    failure.reason, failure.message, spec.backoff_limit
                );
                self.finish(Outcome::Failed {
                    reason: "BackoffLimitExceeded".into(),
                    message,
                });
            }
            Blame::Job => {
                let delay = policy.retry_delay(self.old.failures + 1);
                let failed_at = finished_at.map_or(self.observed.now, |t| t.0);
                let ready = failed_at + SignedDuration::try_from(delay).unwrap_or_default();
                if self.observed.now < ready {
                    let wait = self.observed.now.duration_until(ready);
                    let message = format!(
                        "attempt {attempt} failed: {}; retrying in {} s",
                        failure.message,
                        wait.as_secs()
                    );
                    self.set(RUNNING, false, &failure.reason, message);
                    self.requeue_after = Some(Duration::try_from(wait).unwrap_or(delay));
                } else if self.pod_slot_free(policy) {
                    self.event(
                        true,
                        &failure.reason,
                        format!("attempt {attempt} failed: {}; retrying", failure.message),
                    );
                    self.start_attempt(1);
                }
            }
        }
    }

    /// Whether the job's one worker Pod may start now under the model's `maxPods` (a finalize
    /// Pod always may); if not, the job says it waits and looks again.
    fn pod_slot_free(&mut self, policy: &Policy) -> bool {
        if self.status.part_count() > 1 || self.observed.workers.pod_slots > 0 {
            return true;
        }
        let message = format!(
            "waiting for a Pod slot: model {} has its maxPods worker Pods running",
            self.observed.job.spec.model
        );
        self.set(RUNNING, false, WAITING_FOR_POD_SLOT, message);
        self.wake_within(policy.admission_poll);
        false
    }

    /// Starts the next attempt; `counted` is 1 when the previous attempt's failure counts.
    /// Creates the current attempt's Pod again, after a ResourceQuota refused it: nothing is
    /// counted, and the condition stays until the Pod is seen.
    fn create_again(&mut self, policy: &Policy) {
        let role = match self.status.part_count() {
            1 => Role::Whole,
            _ => Role::Finalize,
        };
        self.actions.push(Action::CreatePod(Attempt {
            role,
            number: self.old.attempts,
            deadline_seconds: self.deadline_left(),
        }));
        self.wake_within(policy.admission_poll);
    }

    fn start_attempt(&mut self, counted: u32) {
        let attempt = self.old.attempts + 1;
        let role = match self.status.part_count() {
            1 => Role::Whole,
            _ => Role::Finalize,
        };
        self.status.attempts = attempt;
        self.status.failures = self.old.failures + counted;
        let job = self.observed.job;
        self.status.pod = Some(role_pod_name(
            &job.name_any(),
            job.uid().as_deref(),
            role,
            attempt,
        ));
        if self.status.start_time.is_none() {
            self.status.start_time = Some(self.now.clone());
        }
        if self.status.progress.is_none() {
            self.status.progress = Some(Progress::new(0, 0, 0));
        }
        self.set(
            RUNNING,
            true,
            "PodCreated",
            format!("attempt {attempt} created"),
        );
        self.actions.push(Action::CreatePod(Attempt {
            role,
            number: attempt,
            deadline_seconds: self.deadline_left(),
        }));
    }

    fn suspend(&mut self, admitted: bool) {
        for pod in self.live_pods() {
            self.actions.push(Action::DeletePod(pod));
        }
        self.suspend_parts();
        if admitted {
            self.event(
                false,
                "Suspended",
                "suspended: the Pod is stopped and the lane slot released".into(),
            );
            self.status.tokens = None;
            self.status.pod = None;
        }
        self.set(
            ADMITTED,
            false,
            "Suspended",
            "the job is suspended; set spec.suspend to false to queue it".into(),
        );
        if conditions::get(&self.status.conditions, RUNNING).is_some() {
            self.set(RUNNING, false, "Suspended", "the job is suspended".into());
        }
    }

    fn finish(&mut self, outcome: Outcome) {
        // A run is charged once a worker has run, not for Pods that never started.
        self.note_running();
        let reserved = self.old.tokens.map_or(0, |t| t.reserved);
        let (event, phase_reason, message, warning) = match &outcome {
            Outcome::Succeeded(result) => (
                JobEvent::Succeeded {
                    tokens: result.as_ref().map_or(reserved, |r| r.tokens),
                },
                "Succeeded".to_owned(),
                "the harvest finished; the manifest is written".to_owned(),
                false,
            ),
            Outcome::Failed { reason, message } => {
                (JobEvent::Failed, reason.clone(), message.clone(), true)
            }
            Outcome::Cancelled => (
                JobEvent::Cancel,
                conditions::CANCELLED.to_owned(),
                conditions::CANCELLED_MESSAGE.to_owned(),
                false,
            ),
            Outcome::AlreadyRan { phase, message } => {
                let event = match phase.as_str() {
                    "Succeeded" => JobEvent::Succeeded { tokens: 0 },
                    "Cancelled" => JobEvent::Cancel,
                    _ => JobEvent::Failed,
                };
                let reason = format!("{}{phase}", conditions::ALREADY);
                (event, reason, message.clone(), false)
            }
        };
        if let Outcome::Succeeded(Some(result)) = outcome {
            self.status.progress = Some(Progress::new(
                result.n_shards,
                result.n_shards,
                result.prompts,
            ));
            self.status.result = Some(result);
        }
        for pod in self.live_pods() {
            self.actions.push(Action::DeletePod(pod));
        }
        let generation = self.observed.job.metadata.generation;
        self.status
            .finish(event, &phase_reason, message.clone(), generation, &self.now);
        self.event(warning, &phase_reason, message);
        self.schedule_ttl();
    }

    fn after_finish(&mut self) {
        for pod in self.live_pods() {
            self.actions.push(Action::DeletePod(pod));
        }
        self.schedule_ttl();
    }

    fn schedule_ttl(&mut self) {
        // A copy of a job that ran before stays, or the GitOps tool would copy it again.
        let finished = conditions::get(&self.status.conditions, FINISHED);
        if finished.is_some_and(|c| c.reason.starts_with(conditions::ALREADY)) {
            return;
        }
        let (Some(ttl), Some(done)) = (
            self.observed.job.spec.ttl_seconds_after_finished,
            &self.status.completion_time,
        ) else {
            return;
        };
        let expires = done.0 + SignedDuration::from_secs(ttl);
        if self.observed.now >= expires {
            self.actions.push(Action::DeleteJob);
        } else {
            let wait = self.observed.now.duration_until(expires);
            self.requeue_after = Some(Duration::try_from(wait).unwrap_or(Duration::from_secs(1)));
        }
    }

    /// Seconds left of the deadline, counted from the first start; `None` without a deadline.
    fn deadline_left(&self) -> Option<i64> {
        let limit = self.observed.job.spec.active_deadline_seconds?;
        let start = self.status.start_time.as_ref()?;
        Some(limit - self.observed.now.duration_since(start.0).as_secs())
    }

    /// The job's Pods that are starting or running: its one Pod (or finalize Pod) and its
    /// parts'.
    fn live_pods(&self) -> Vec<String> {
        let live = |pod: &Option<PodState>| {
            matches!(pod, Some(PodState::Starting { .. } | PodState::Running))
        };
        let parts = self.old.parts.iter().filter_map(|part| {
            let observed = self.observed.workers.parts.get(part.index as usize)?;
            live(observed).then(|| part.pod.clone()).flatten()
        });
        let whole = live(&self.observed.pod)
            .then(|| self.old.pod.clone())
            .flatten();
        whole.into_iter().chain(parts).collect()
    }

    fn finished(&self) -> bool {
        conditions::is_true(&self.status.conditions, FINISHED)
    }

    fn set(&mut self, type_: &str, status: bool, reason: &str, message: String) {
        let update = ConditionUpdate {
            type_,
            status,
            reason,
            message,
        };
        conditions::set(
            &mut self.status.conditions,
            update,
            self.observed.job.metadata.generation,
            &self.now,
        );
    }

    fn event(&mut self, warning: bool, reason: &str, note: String) {
        self.actions.push(Action::Event {
            warning,
            reason: reason.to_owned(),
            note,
        });
    }
}

/// The failure of an attempt whose Pod is gone before it finished: the create the apiserver
/// refused (its `FailedCreate` condition, the job's fault), or else a Pod deleted under the job
/// (the cluster's).
pub(super) fn vanished_failure(refused: Option<&Condition>, pod: Option<&str>) -> Failure {
    match refused {
        Some(condition) => Failure {
            blame: Blame::Job,
            reason: condition.reason.clone(),
            message: condition.message.clone(),
        },
        None => Failure {
            blame: Blame::Infrastructure,
            reason: "PodLost".into(),
            message: format!(
                "Pod {} disappeared before it finished",
                pod.unwrap_or_default()
            ),
        },
    }
}

/// How a job ends whose Pod's name `pod` is taken by a Pod not made for it.
fn foreign_outcome(pod: &str, controller: Option<String>) -> Outcome {
    let owner = controller.map_or_else(
        || "it has no controller".to_owned(),
        |c| format!("its controller is {c}"),
    );
    let message = format!(
        "Pod {pod} exists but was not created by harvest-operator for this job ({owner}); nothing of it is read. Delete that Pod, or recreate the job"
    );
    Outcome::Failed {
        reason: "PodNameTaken".into(),
        message,
    }
}

/// The display phase, derived from the conditions.
pub fn phase(status: &HarvestJobStatus, suspend: bool) -> JobPhase {
    if let Some(finished) =
        conditions::get(&status.conditions, FINISHED).filter(|c| c.status == "True")
    {
        return JobPhase::finished(&finished.reason);
    }
    if suspend {
        JobPhase::Suspended
    } else if conditions::is_true(&status.conditions, ADMITTED) {
        JobPhase::Running
    } else {
        JobPhase::Pending
    }
}

mod parts;

#[cfg(test)]
mod tests;

/// A worker's progress line as the job's status shows it (`None` for counts past `u32`).
fn reported(event: &harvest_core::worker::ProgressEvent, shard_size: u32) -> Option<Progress> {
    let done = u32::try_from(event.prompts_done).ok()?;
    let total = u32::try_from(event.prompts_total).ok()?;
    Some(match (event.phase, event.bytes_loaded, event.bytes_total) {
        (harvest_core::worker::Phase::Loading, Some(loaded), Some(bytes)) => {
            Progress::loading((loaded, bytes), done, total, shard_size)
        }
        _ => Progress::running(done, total, event.tokens_done, shard_size),
    })
}
