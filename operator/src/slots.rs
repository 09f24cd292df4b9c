//! The model's `maxPods`, pure: how many worker Pods a job may start now, when the Pods of
//! every job of the model together may not pass the cap and queued Pods start first come
//! first served (by admission time to the microsecond, then by job).

use harvest_crds::conditions::{self, ADMITTED, FINISHED, RUNNING};
use harvest_crds::{HarvestJob, PartPhase};
use k8s_openapi::jiff::Timestamp;

use crate::decide::WAITING_FOR_POD_SLOT;

/// One job's worker Pods, as its status tells.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobPods {
    /// `namespace/name`.
    pub key: String,
    /// When it was admitted: its place in the queue.
    pub queued_since: Timestamp,
    /// Worker Pods it has starting or running.
    pub occupying: u32,
    /// Worker Pods it waits to start.
    pub waiting: u32,
}

/// A job's worker Pods, or `None` for a job that has none and wants none (not admitted,
/// finished, suspended, or finalizing its parts).
pub fn job_pods(job: &HarvestJob, key: String) -> Option<JobPods> {
    let status = job.status.as_ref()?;
    let admitted = conditions::get(&status.conditions, ADMITTED).filter(|c| c.status == "True")?;
    if conditions::is_true(&status.conditions, FINISHED) || job.spec.suspend || job.spec.cancel {
        return None;
    }
    let (occupying, waiting) = if status.part_count() > 1 {
        let count = status.part_count();
        let listed = u32::try_from(status.parts.len()).unwrap_or(count);
        let phase = |phase: PartPhase| {
            let n = status.parts.iter().filter(|p| p.phase == phase).count();
            u32::try_from(n).unwrap_or(u32::MAX)
        };
        (
            phase(PartPhase::Running),
            phase(PartPhase::Waiting) + count.saturating_sub(listed),
        )
    } else {
        let slot_wait = conditions::get(&status.conditions, RUNNING)
            .is_some_and(|c| c.reason == WAITING_FOR_POD_SLOT);
        match (status.pod.is_some(), slot_wait) {
            (true, false) => (1, 0),
            _ => (0, 1),
        }
    };
    Some(JobPods {
        key,
        queued_since: status
            .admitted_at
            .as_ref()
            .map_or(admitted.last_transition_time.0, |at| at.0),
        occupying,
        waiting,
    })
}

/// The Pods the job `me` may start under `max_pods`: what the cap leaves after every
/// occupied Pod (and `held`, Pods granted a moment ago that the statuses do not show yet) and
/// every Pod queued before its own, at most the `wanted` it waits to start.
pub fn free_for(jobs: &[JobPods], me: &JobPods, max_pods: u32, held: u32) -> u32 {
    let occupied: u32 = jobs
        .iter()
        .filter(|j| j.key != me.key)
        .map(|j| j.occupying)
        .sum::<u32>()
        + me.occupying
        + held;
    let ahead: u32 = jobs
        .iter()
        .filter(|j| j.key != me.key && (j.queued_since, &j.key) < (me.queued_since, &me.key))
        .map(|j| j.waiting)
        .sum();
    max_pods
        .saturating_sub(occupied.saturating_add(ahead))
        .min(me.waiting)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(key: &str, since: i64, occupying: u32, waiting: u32) -> JobPods {
        JobPods {
            key: key.into(),
            queued_since: Timestamp::from_second(since).unwrap(),
            occupying,
            waiting,
        }
    }

    #[test]
    fn a_job_gets_what_the_cap_leaves_after_running_pods_and_earlier_queued_ones() {
        let early = job("ns/early", 1, 2, 1);
        let me = job("ns/me", 2, 0, 3);
        let late = job("ns/late", 3, 1, 4);
        let jobs = [early.clone(), me.clone(), late.clone()];
        // 2 + 1 running, 1 queued ahead: 2 of the cap of 6 are left.
        assert_eq!(free_for(&jobs, &me, 6, 0), 2);
        // The earlier job takes its one before anyone else.
        assert_eq!(free_for(&jobs, &early, 6, 0), 1);
        // The later job waits behind both.
        assert_eq!(free_for(&jobs, &late, 6, 0), 0);
        // Pods just granted count, and the cap never goes negative.
        assert_eq!(free_for(&jobs, &me, 6, 2), 0);
        assert_eq!(free_for(&jobs, &me, 2, 0), 0);
        // Never more than the job waits to start.
        assert_eq!(free_for(&jobs, &me, 100, 0), 3);
    }

    fn admitted_job(name: &str, micros: i64) -> HarvestJob {
        use harvest_crds::{HarvestJobSpec, HarvestJobStatus};
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, MicroTime, Time};
        let at = Timestamp::from_microsecond(5_000_000 + micros).unwrap();
        let mut job = HarvestJob::new(name, HarvestJobSpec::new("m", "/p", "/o", 10));
        job.status = Some(HarvestJobStatus {
            conditions: vec![Condition {
                type_: ADMITTED.into(),
                status: "True".into(),
                reason: "Admitted".into(),
                message: String::new(),
                // What the apiserver keeps of a condition's time: whole seconds.
                last_transition_time: Time(Timestamp::from_second(5).unwrap()),
                observed_generation: None,
            }],
            admitted_at: Some(MicroTime(at)),
            ..Default::default()
        });
        job
    }

    #[test]
    fn jobs_admitted_in_the_same_second_queue_by_their_admission_microsecond_not_by_name() {
        let first = job_pods(&admitted_job("wide", 100), "ns/wide".into()).unwrap();
        let second = job_pods(&admitted_job("narrow", 900), "ns/narrow".into()).unwrap();
        assert_eq!((first.occupying, first.waiting), (0, 1));
        let jobs = [first.clone(), second.clone()];
        assert_eq!(free_for(&jobs, &first, 1, 0), 1);
        assert_eq!(free_for(&jobs, &second, 1, 0), 0);
    }

    #[test]
    fn jobs_admitted_in_the_same_second_queue_by_name() {
        let a = job("ns/a", 5, 0, 1);
        let b = job("ns/b", 5, 0, 1);
        let jobs = [a.clone(), b.clone()];
        assert_eq!(free_for(&jobs, &a, 1, 0), 1);
        assert_eq!(free_for(&jobs, &b, 1, 0), 0);
    }
}
