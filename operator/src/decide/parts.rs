//! The decision for a job run in parts, pure: each part is started, watched and retried on its
//! own (a retry resumes from the part's records), under the model's `maxPods`, and the job's
//! failures count together against its `backoffLimit`. Once every part has succeeded,
//! `decide` drives the finalize Pod as a job's one Pod.

use std::time::Duration;

use harvest_crds::conditions::RUNNING;
use harvest_crds::{HarvestJobStatus, PartPhase, PartStatus, Progress};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::SignedDuration;
use kube::ResourceExt;

use super::{
    Action, Builder, FAILED_CREATE, Outcome, Policy, WAITING_FOR_POD_SLOT, WAITING_FOR_QUOTA,
};
use crate::pod::{Attempt, Blame, Failure, PodState, Role, role_pod_name};

/// What one part needs this reconcile.
enum Step {
    /// Nothing: it runs, starts, or is done.
    Stay,
    /// Start its next attempt.
    Start,
    /// Create its current attempt's Pod again: a ResourceQuota refused it.
    CreateAgain,
    /// Its last attempt failed, and it may start again after `wait`.
    Backoff { wait: SignedDuration },
    /// The job fails.
    Fail(Outcome),
}

impl Builder<'_> {
    /// Whether every part of `status` has succeeded.
    pub(super) fn parts_done(&self, status: &HarvestJobStatus) -> bool {
        let count = status.part_count() as usize;
        status.parts.len() == count
            && status
                .parts
                .iter()
                .all(|part| part.phase == PartPhase::Succeeded)
    }

    /// Starts, watches and retries each part; fails the job when a part cannot go on.
    pub(super) fn drive_parts(&mut self, policy: &Policy) {
        let count = self.status.part_count();
        let mut parts: Vec<PartStatus> = (0..count)
            .map(|index| {
                self.old
                    .parts
                    .iter()
                    .find(|p| p.index == index)
                    .cloned()
                    .unwrap_or(PartStatus {
                        index,
                        ..PartStatus::default()
                    })
            })
            .collect();
        let mut slots = self.observed.workers.pod_slots;
        let mut counted_failures: u32 = parts.iter().map(|p| p.failures).sum();
        let mut waiting_for_slot = false;
        for part in &mut parts {
            let before = part.failures;
            let step = self.part_step(part, counted_failures, policy);
            counted_failures += part.failures - before;
            match step {
                Step::Stay => {}
                Step::Fail(outcome) => {
                    self.status.parts = parts;
                    return self.finish(outcome);
                }
                Step::Backoff { wait } => {
                    let wait = Duration::try_from(wait).unwrap_or(policy.retry_base);
                    self.wake_within(wait.max(Duration::from_secs(1)));
                }
                Step::Start if slots == 0 => {
                    part.phase = PartPhase::Waiting;
                    part.message = "waiting for a Pod slot under the model's maxPods".into();
                    waiting_for_slot = true;
                }
                Step::Start => {
                    slots -= 1;
                    self.start_part(part, count);
                }
                Step::CreateAgain => {
                    self.actions.push(Action::CreatePod(Attempt {
                        role: Role::Part {
                            index: part.index,
                            count,
                        },
                        number: part.attempts,
                        deadline_seconds: self.deadline_left(),
                    }));
                    self.wake_within(policy.admission_poll);
                }
            }
        }
        self.status.parts = parts;
        self.summarise_parts(waiting_for_slot);
        if waiting_for_slot {
            self.wake_within(policy.admission_poll);
        }
        if self.parts_done(&self.status) {
            self.event(
                false,
                "PartsDone",
                format!("all {count} parts are done; finalizing"),
            );
        }
    }

    /// Why part `name`'s Pod is gone before it finished: a create the apiserver refused (the
    /// `FailedCreate` condition naming the part), or a Pod deleted under the job.
    fn part_vanished(&self, part: &PartStatus, name: &str) -> Failure {
        let refused = harvest_crds::conditions::get(&self.old.conditions, RUNNING)
            .filter(|c| c.reason == FAILED_CREATE && c.message.starts_with(&format!("{name} ")));
        super::vanished_failure(refused, part.pod.as_deref())
    }

    /// What part `part` needs, from its Pod as observed; updates its phase and counts.
    fn part_step(&mut self, part: &mut PartStatus, counted_failures: u32, policy: &Policy) -> Step {
        if part.phase == PartPhase::Succeeded {
            return Step::Stay;
        }
        let index = part.index as usize;
        let observed = self.observed.workers.parts.get(index).cloned().flatten();
        let count = self.status.part_count();
        let name = format!("part {}/{count}", part.index);
        match observed {
            None if part.pod.is_none() => self.retry_ready(part, policy),
            None if part.message.starts_with(WAITING_FOR_QUOTA) => Step::CreateAgain,
            None => {
                let failure = self.part_vanished(part, &name);
                self.part_failed(part, failure, None, counted_failures, policy)
            }
            Some(PodState::Starting { since, waiting }) => {
                part.phase = PartPhase::Running;
                part.message = waiting
                    .map(|(r, m)| format!("{r}: {m}"))
                    .unwrap_or_default();
                self.part_start_timeout(&name, since)
            }
            Some(PodState::Running) => {
                part.phase = PartPhase::Running;
                part.message.clear();
                if let Some(report) = self.observed.workers.reports.get(index).cloned().flatten() {
                    part.prompts_done = u32::try_from(report.prompts_done).unwrap_or(u32::MAX);
                    part.prompts_total = u32::try_from(report.prompts_total).unwrap_or(u32::MAX);
                }
                Step::Stay
            }
            Some(PodState::Terminating {
                since,
                grace_seconds,
            }) => {
                let pod = part.pod.clone().unwrap_or_default();
                match self.stuck(&pod, since, grace_seconds, policy) {
                    Some(failure) => {
                        self.part_failed(part, failure, None, counted_failures, policy)
                    }
                    None => Step::Stay,
                }
            }
            Some(PodState::Foreign { controller }) => {
                let pod = part.pod.clone().unwrap_or_default();
                Step::Fail(super::foreign_outcome(&pod, controller))
            }
            Some(PodState::Succeeded { part: result, .. }) => {
                part.phase = PartPhase::Succeeded;
                part.message.clear();
                part.prompts_done = part.prompts_total;
                if let Some(result) = result {
                    part.tokens = result.tokens;
                    part.shards = Some(
                        result
                            .shards
                            .iter()
                            .map(|&s| u32::try_from(s).unwrap_or(u32::MAX))
                            .collect(),
                    );
                }
                let note = format!(
                    "{name} succeeded after {} attempt(s), {} tokens",
                    part.attempts, part.tokens
                );
                self.event(false, "PartSucceeded", note);
                Step::Stay
            }
            Some(PodState::Failed {
                failure,
                finished_at,
            }) => self.part_failed(part, failure, finished_at, counted_failures, policy),
        }
    }

    /// A part without a Pod: start it, once its last counted failure's backoff delay has
    /// passed.
    fn retry_ready(&self, part: &PartStatus, policy: &Policy) -> Step {
        let Some(failed_at) = part.failed_at.as_ref().filter(|_| part.failures > 0) else {
            return Step::Start;
        };
        let delay = SignedDuration::try_from(policy.retry_delay(part.failures)).unwrap_or_default();
        let ready = failed_at.0 + delay;
        if self.observed.now < ready {
            return Step::Backoff {
                wait: self.observed.now.duration_until(ready),
            };
        }
        Step::Start
    }

    /// A part's attempt failed: the input fails the job; the cluster's fault retries it
    /// uncounted (up to the infrastructure retries, per part); the job's own fault counts
    /// against the job's `backoffLimit` and retries after the backoff delay. The failure is
    /// taken in once: the part lets go of its failed Pod and waits to start again.
    fn part_failed(
        &mut self,
        part: &mut PartStatus,
        failure: Failure,
        finished_at: Option<Time>,
        counted_failures: u32,
        policy: &Policy,
    ) -> Step {
        let name = format!("part {}/{}", part.index, self.status.part_count());
        let attempt = part.attempts;
        let infra_retries = part.attempts.saturating_sub(1 + part.failures);
        let backoff_limit = self.observed.job.spec.backoff_limit;
        let counted = match failure.blame {
            Blame::Input => {
                return Step::Fail(Outcome::Failed {
                    reason: failure.reason,
                    message: format!("{name}: {}", failure.message),
                });
            }
            Blame::Infrastructure if infra_retries >= policy.max_infrastructure_retries => {
                return Step::Fail(Outcome::Failed {
                    reason: "InfrastructureRetriesExhausted".into(),
                    message: format!(
                        "{name}: {}; {infra_retries} infrastructure retries used up",
                        failure.message
                    ),
                });
            }
            Blame::Job if i64::from(counted_failures) + 1 > i64::from(backoff_limit) => {
                return Step::Fail(Outcome::Failed {
                    reason: "BackoffLimitExceeded".into(),
                    message: format!(
                        "{name} attempt {attempt} failed ({}: {}); backoffLimit {backoff_limit} reached over the job's parts",
                        failure.reason, failure.message
                    ),
                });
            }
            Blame::Infrastructure => false,
            Blame::Job => true,
        };
        let note = match counted {
            true => format!(
                "{name} attempt {attempt} failed: {}; retrying it",
                failure.message
            ),
            false => format!(
                "{name} attempt {attempt}: {}; retrying it (not counted against backoffLimit)",
                failure.message
            ),
        };
        self.event(true, "PartFailed", note);
        part.failures += u32::from(counted);
        part.failed_at = counted.then(|| Time(finished_at.map_or(self.observed.now, |t| t.0)));
        part.pod = None;
        part.phase = PartPhase::Waiting;
        part.message = format!("attempt {attempt}: {}: {}", failure.reason, failure.message);
        self.retry_ready(part, policy)
    }

    /// A part's Pod that has not started within the model's `startTimeoutSeconds` fails the
    /// job, as a one-Pod job's does.
    fn part_start_timeout(&mut self, name: &str, since: Option<Time>) -> Step {
        let (Some(timeout), Some(since)) = (self.observed.start_timeout, since) else {
            return Step::Stay;
        };
        let waited = self.observed.now.duration_since(since.0);
        let left = SignedDuration::try_from(timeout).unwrap_or_default() - waited;
        if left <= SignedDuration::ZERO {
            return Step::Fail(Outcome::Failed {
                reason: "PodStartTimeout".into(),
                message: format!(
                    "{name}'s Pod did not start within startTimeoutSeconds ({} s)",
                    timeout.as_secs()
                ),
            });
        }
        self.wake_within(Duration::try_from(left).unwrap_or(timeout));
        Step::Stay
    }

    /// Creates part `part`'s next attempt.
    fn start_part(&mut self, part: &mut PartStatus, count: u32) {
        let job = self.observed.job;
        let role = Role::Part {
            index: part.index,
            count,
        };
        part.attempts += 1;
        part.pod = Some(role_pod_name(
            &job.name_any(),
            job.uid().as_deref(),
            role,
            part.attempts,
        ));
        part.phase = PartPhase::Running;
        part.failed_at = None;
        if self.status.start_time.is_none() {
            self.status.start_time = Some(self.now.clone());
        }
        self.actions.push(Action::CreatePod(Attempt {
            role,
            number: part.attempts,
            deadline_seconds: self.deadline_left(),
        }));
        let note = format!(
            "part {}/{count} attempt {} created",
            part.index, part.attempts
        );
        self.event(false, "PartStarted", note);
    }

    /// The job's progress, `Running` condition and `partsSummary` from its parts.
    fn summarise_parts(&mut self, waiting_for_slot: bool) {
        let parts = &self.status.parts;
        let count = parts.len();
        let done = parts
            .iter()
            .filter(|p| p.phase == PartPhase::Succeeded)
            .count();
        let running = parts
            .iter()
            .filter(|p| p.phase == PartPhase::Running)
            .count();
        let prompts_done = parts.iter().map(|p| p.prompts_done).sum();
        let known = parts.iter().all(|p| p.prompts_total > 0);
        let prompts_total = if known {
            parts.iter().map(|p| p.prompts_total).sum()
        } else {
            0
        };
        let tokens = parts.iter().map(|p| p.tokens).sum();
        let shard_size = self.observed.job.spec.harvest.shard_size;
        let mut progress = Progress::running(prompts_done, prompts_total, tokens, shard_size);
        if !known {
            progress.summary = format!("{done}/{count} parts");
        }
        self.status.progress = Some(progress);
        self.status.parts_summary = Some(format!("{done}/{count}"));
        if waiting_for_slot && running == 0 {
            let message = format!(
                "waiting for a Pod slot: model {} has its maxPods worker Pods running",
                self.observed.job.spec.model
            );
            self.set(RUNNING, false, WAITING_FOR_POD_SLOT, message);
        } else {
            let message = format!("{running} of {count} parts running, {done} done");
            self.set(RUNNING, true, "PartsRunning", message);
        }
    }

    /// A suspended job's parts: their Pods are stopped (the caller deletes them) and they
    /// start again, resuming from their records, when the job is resumed.
    pub(super) fn suspend_parts(&mut self) {
        for part in &mut self.status.parts {
            if part.phase != PartPhase::Succeeded {
                part.phase = PartPhase::Waiting;
                part.pod = None;
                part.message = "the job is suspended".into();
            }
        }
    }
}
