//! The decision table, one situation per test, built with a small job builder.

use super::*;
use harvest_crds::HarvestJobSpec;
use harvest_crds::conditions::{ADMITTED, FINISHED, get};

const POLICY: Policy = Policy {
    retry_base: Duration::from_secs(10),
    max_infrastructure_retries: 2,
    admission_poll: Duration::from_secs(5),
    progress_refresh: Duration::from_secs(5),
    pod_lost_after: Duration::from_secs(120),
};

/// Attempt `number` of a one-Pod job.
fn whole(number: u32, deadline_seconds: Option<i64>) -> Attempt {
    Attempt {
        role: Role::Whole,
        number,
        deadline_seconds,
    }
}

fn at(second: i64) -> Timestamp {
    Timestamp::from_second(second).unwrap()
}

fn job() -> HarvestJob {
    let mut job = HarvestJob::new(
        "j",
        HarvestJobSpec {
            backoff_limit: 1,
            ..HarvestJobSpec::new("m", "s3://in/p.jsonl", "s3://out/j", 500)
        },
    );
    job.metadata.generation = Some(1);
    job
}

fn step(job: &HarvestJob, pod: Option<PodState>, admission: Admission, now: i64) -> Decision {
    let observed = Observed {
        job,
        spec: Ok(job.spec.token_budget),
        pod,
        reported: None,
        admission,
        account: Some("acct".into()),
        lane: Some("small".into()),
        now: at(now),
        start_timeout: None,
        worker_image: Some("harvester:1".into()),
        workers: Workers::default(),
    };
    decide(&observed, &POLICY)
}

fn apply(job: &mut HarvestJob, decision: &Decision) {
    job.status = Some(decision.status.clone());
}

fn failed(blame: Blame, finished: i64) -> Option<PodState> {
    Some(PodState::Failed {
        failure: Failure {
            blame,
            reason: "OOMKilled".into(),
            message: "out of memory".into(),
        },
        finished_at: Some(Time(at(finished))),
    })
}

#[test]
fn an_admitted_job_reserves_its_budget_and_creates_attempt_one() {
    let decision = step(&job(), None, Admission::Admit, 0);
    assert!(
        decision
            .actions
            .contains(&Action::CreatePod(whole(1, None)))
    );
    assert_eq!(
        decision.status.tokens,
        Some(TokenUsage {
            reserved: 500,
            charged: None
        })
    );
    assert_eq!(decision.status.pod.as_deref(), Some("j-1"));
    assert_eq!(decision.status.phase, Some(JobPhase::Running));
}

#[test]
fn a_waiting_job_creates_nothing_and_polls_again() {
    let wait = Admission::Wait {
        reason: "WaitingForLane",
        message: "full".into(),
    };
    let decision = step(&job(), None, wait, 0);
    assert!(decision.actions.is_empty());
    assert_eq!(
        get(&decision.status.conditions, ADMITTED).unwrap().reason,
        "WaitingForLane"
    );
    assert_eq!(decision.requeue_after, Some(POLICY.admission_poll));
    assert_eq!(decision.status.phase, Some(JobPhase::Pending));
}

#[test]
fn a_counted_failure_waits_out_its_backoff_then_retries_and_the_next_one_fails_the_job() {
    let mut job = job();
    let admitted = step(&job, None, Admission::Admit, 0);
    apply(&mut job, &admitted);
    let waiting = step(&job, failed(Blame::Job, 100), Admission::Admit, 103);
    assert!(
        waiting.actions.is_empty(),
        "retried before the backoff ran out: {:?}",
        waiting.actions
    );
    assert_eq!(waiting.requeue_after, Some(Duration::from_secs(7)));
    let retry = step(&job, failed(Blame::Job, 100), Admission::Admit, 111);
    assert!(retry.actions.contains(&Action::CreatePod(whole(2, None))));
    assert_eq!(retry.status.failures, 1);
    apply(&mut job, &retry);
    let last = step(&job, failed(Blame::Job, 200), Admission::Admit, 300);
    assert_eq!(
        get(&last.status.conditions, FINISHED).unwrap().reason,
        "BackoffLimitExceeded"
    );
    assert_eq!(
        last.status.tokens.unwrap().charged,
        Some(0),
        "a failed job releases its hold"
    );
}

#[test]
fn infrastructure_failures_retry_at_once_without_counting_until_the_cap() {
    let mut job = job();
    let admitted = step(&job, None, Admission::Admit, 0);
    apply(&mut job, &admitted);
    for attempt in 2..=3 {
        let decision = step(
            &job,
            failed(Blame::Infrastructure, 10),
            Admission::Admit,
            10,
        );
        assert!(
            decision
                .actions
                .contains(&Action::CreatePod(whole(attempt, None)))
        );
        assert_eq!(decision.status.failures, 0);
        apply(&mut job, &decision);
    }
    let exhausted = step(
        &job,
        failed(Blame::Infrastructure, 10),
        Admission::Admit,
        10,
    );
    assert_eq!(
        get(&exhausted.status.conditions, FINISHED).unwrap().reason,
        "InfrastructureRetriesExhausted"
    );
}

#[test]
fn a_copy_of_a_job_that_ran_ends_in_its_phase_running_and_charging_nothing_and_outlives_its_ttl() {
    for (phase, ends) in [
        ("Succeeded", JobPhase::Succeeded),
        ("Failed", JobPhase::Failed),
        ("Cancelled", JobPhase::Cancelled),
    ] {
        let mut job = job();
        job.spec.ttl_seconds_after_finished = Some(0);
        let verdict = Admission::AlreadyRan {
            phase: phase.into(),
            message: "ran before".into(),
        };
        let done = step(&job, None, verdict, 0);
        assert_eq!(done.status.phase, Some(ends), "{phase}");
        let finished = get(&done.status.conditions, FINISHED).unwrap();
        assert_eq!(finished.reason, format!("Already{phase}"));
        assert!(done.status.tokens.is_none(), "no hold, no charge");
        assert!(
            done.actions
                .iter()
                .all(|a| matches!(a, Action::Event { .. })),
            "{:?}",
            done.actions
        );
        apply(&mut job, &done);
        let later = step(&job, None, Admission::Admit, 3600);
        assert!(!later.actions.contains(&Action::DeleteJob), "{phase}");
        assert_eq!(later.requeue_after, None);
    }
}

#[test]
fn success_charges_what_ran_and_a_ttl_deletes_the_job_once_it_expires() {
    let mut job = job();
    job.spec.ttl_seconds_after_finished = Some(60);
    let admitted = step(&job, None, Admission::Admit, 0);
    apply(&mut job, &admitted);
    let result = harvest_crds::ResultSummary {
        n_shards: 2,
        prompts: 40,
        tokens: 321,
        ..Default::default()
    };
    let done = step(
        &job,
        Some(PodState::Succeeded {
            result: Some(result),
            part: None,
        }),
        Admission::Admit,
        100,
    );
    assert_eq!(done.status.tokens.unwrap().charged, Some(321));
    assert_eq!(done.status.phase, Some(JobPhase::Succeeded));
    assert_eq!(done.requeue_after, Some(Duration::from_secs(60)));
    apply(&mut job, &done);
    assert!(
        !step(&job, None, Admission::Admit, 159)
            .actions
            .contains(&Action::DeleteJob)
    );
    assert!(
        step(&job, None, Admission::Admit, 160)
            .actions
            .contains(&Action::DeleteJob)
    );
}

#[test]
fn the_first_workers_image_is_the_jobs_and_a_later_catalogue_image_does_not_replace_it() {
    let mut job = job();
    let first = step(&job, None, Admission::Admit, 0);
    assert!(
        first
            .actions
            .iter()
            .any(|a| matches!(a, Action::CreatePod(_)))
    );
    assert_eq!(first.status.worker_image.as_deref(), Some("harvester:1"));
    apply(&mut job, &first);
    // The operator was upgraded: its catalogue names a new image; the attempt's Pod is gone.
    let observed = Observed {
        job: &job,
        spec: Ok(job.spec.token_budget),
        pod: None,
        reported: None,
        admission: Admission::Admit,
        account: Some("acct".into()),
        lane: Some("small".into()),
        now: at(60),
        start_timeout: None,
        worker_image: Some("harvester:2".into()),
        workers: Workers::default(),
    };
    let retried = decide(&observed, &POLICY);
    assert_eq!(retried.status.worker_image.as_deref(), Some("harvester:1"));
}

#[test]
fn cancel_stops_the_pod_and_suspend_releases_the_slot() {
    let mut job = job();
    let admitted = step(&job, None, Admission::Admit, 0);
    apply(&mut job, &admitted);
    let mut suspended = job.clone();
    suspended.spec.suspend = true;
    let decision = step(&suspended, Some(PodState::Running), Admission::Admit, 5);
    assert!(decision.actions.contains(&Action::DeletePod("j-1".into())));
    assert!(!conditions::is_true(&decision.status.conditions, ADMITTED));
    assert_eq!(decision.status.phase, Some(JobPhase::Suspended));
    job.spec.cancel = true;
    let cancelled = step(&job, Some(PodState::Running), Admission::Admit, 5);
    assert!(cancelled.actions.contains(&Action::DeletePod("j-1".into())));
    assert_eq!(cancelled.status.tokens.unwrap().charged, Some(500));
    assert_eq!(cancelled.status.phase, Some(JobPhase::Cancelled));
}

#[test]
fn an_invalid_spec_fails_at_once_without_a_pod_or_a_requeue() {
    let job = job();
    let observed = Observed {
        job: &job,
        spec: Err(SpecError::UnknownModel {
            model: "m".into(),
            known: vec!["a".into()],
        }),
        pod: None,
        reported: None,
        admission: Admission::Admit,
        account: None,
        lane: None,
        now: at(0),
        start_timeout: None,
        worker_image: None,
        workers: Workers::default(),
    };
    let decision = decide(&observed, &POLICY);
    assert!(
        !decision
            .actions
            .iter()
            .any(|a| matches!(a, Action::CreatePod(_)))
    );
    assert_eq!(
        get(&decision.status.conditions, FINISHED).unwrap().reason,
        "UnknownModel"
    );
    assert_eq!(decision.requeue_after, None);
}

#[test]
fn the_deadline_fails_a_running_job_and_the_pod_gets_what_is_left() {
    let mut job = job();
    job.spec.active_deadline_seconds = Some(100);
    let first = step(&job, None, Admission::Admit, 0);
    assert!(
        first
            .actions
            .contains(&Action::CreatePod(whole(1, Some(100))))
    );
    apply(&mut job, &first);
    let late = step(&job, Some(PodState::Running), Admission::Admit, 100);
    assert_eq!(
        get(&late.status.conditions, FINISHED).unwrap().reason,
        "DeadlineExceeded"
    );
    assert!(late.actions.contains(&Action::DeletePod("j-1".into())));
}

#[test]
fn a_running_job_takes_its_workers_report_as_progress_and_looks_again_soon() {
    let mut job = job();
    job.spec.harvest.shard_size = 4;
    let started = step(&job, None, Admission::Admit, 0);
    apply(&mut job, &started);
    let observed = Observed {
        job: &job,
        spec: Ok(job.spec.token_budget),
        pod: Some(PodState::Running),
        reported: harvest_core::worker::ProgressEvent::parse_line(
            r#"{"event":"progress","prompts_done":10,"prompts_total":48,"tokens_done":1234}"#,
        ),
        admission: Admission::Admit,
        account: Some("acct".into()),
        lane: Some("small".into()),
        now: at(3),
        start_timeout: None,
        worker_image: None,
        workers: Workers::default(),
    };
    let decision = decide(&observed, &POLICY);
    let progress = decision.status.progress.unwrap();
    assert_eq!(
        (
            progress.prompts_done,
            progress.shards_done,
            progress.shards_total,
            progress.tokens_done
        ),
        (10, 2, 12, 1_234)
    );
    assert_eq!(progress.summary, "2/12 shards");
    assert_eq!(progress.phase, None);
    assert_eq!(decision.requeue_after, Some(POLICY.progress_refresh));
}

#[test]
fn a_worker_reading_its_weights_shows_loading_with_its_bytes() {
    let mut job = job();
    job.spec.harvest.shard_size = 4;
    let started = step(&job, None, Admission::Admit, 0);
    apply(&mut job, &started);
    let line = r#"{"event":"progress","phase":"loading","bytes_loaded":3100000000,"bytes_total":16100000000,"prompts_done":8,"prompts_total":48,"tokens_done":0}"#;
    let observed = Observed {
        job: &job,
        spec: Ok(job.spec.token_budget),
        pod: Some(PodState::Running),
        reported: harvest_core::worker::ProgressEvent::parse_line(line),
        admission: Admission::Admit,
        account: Some("acct".into()),
        lane: Some("small".into()),
        now: at(3),
        start_timeout: None,
        worker_image: None,
        workers: Workers::default(),
    };
    let progress = decide(&observed, &POLICY).status.progress.unwrap();
    assert_eq!(progress.phase.as_deref(), Some("loading"));
    assert_eq!(
        (progress.bytes_loaded, progress.bytes_total),
        (Some(3_100_000_000), Some(16_100_000_000))
    );
    assert_eq!((progress.prompts_done, progress.shards_done), (8, 2));
    assert_eq!(progress.summary, "loading 3.1/16.1 GB");
}

#[test]
fn a_scheduled_pod_that_never_starts_fails_the_job_after_the_start_timeout_charging_nothing() {
    let mut job = job();
    let first = step(&job, None, Admission::Admit, 0);
    apply(&mut job, &first);
    let pulling = |now: i64| {
        let observed = Observed {
            job: &job,
            spec: Ok(job.spec.token_budget),
            pod: Some(PodState::Starting {
                waiting: Some((
                    "ImagePullBackOff".into(),
                    "Back-off pulling image \"registry.example.org/harvester:9\"".into(),
                )),
                since: Some(Time(at(0))),
            }),
            reported: None,
            admission: Admission::Admit,
            account: Some("acct".into()),
            lane: Some("small".into()),
            now: at(now),
            start_timeout: Some(Duration::from_secs(600)),
            worker_image: None,
            workers: Workers::default(),
        };
        decide(&observed, &POLICY)
    };
    let waiting = pulling(590);
    assert!(!conditions::is_true(&waiting.status.conditions, FINISHED));
    assert_eq!(waiting.requeue_after, Some(Duration::from_secs(10)));
    let late = pulling(600);
    let finished = get(&late.status.conditions, FINISHED).unwrap();
    assert_eq!(finished.reason, "PodStartTimeout");
    assert!(
        finished.message.contains("600 s") && finished.message.contains("ImagePullBackOff"),
        "{}",
        finished.message
    );
    assert!(late.actions.contains(&Action::DeletePod("j-1".into())));
    assert_eq!(late.status.tokens.unwrap().charged, Some(0));
}

#[test]
fn a_pod_no_node_takes_waits_past_the_start_timeout_keeping_its_slot_and_says_why() {
    let mut job = job();
    let first = step(&job, None, Admission::Admit, 0);
    apply(&mut job, &first);
    let observed = Observed {
        job: &job,
        spec: Ok(job.spec.token_budget),
        pod: Some(PodState::Starting {
            waiting: Some((
                "Unschedulable".into(),
                "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.".into(),
            )),
            since: None,
        }),
        reported: None,
        admission: Admission::Admit,
        account: Some("acct".into()),
        lane: Some("small".into()),
        now: at(6 * 3600),
        start_timeout: Some(Duration::from_secs(600)),
        worker_image: None,
        workers: Workers::default(),
    };
    let waiting = decide(&observed, &POLICY);
    assert!(!conditions::is_true(&waiting.status.conditions, FINISHED));
    assert!(waiting.actions.is_empty(), "{:?}", waiting.actions);
    let running = get(&waiting.status.conditions, RUNNING).unwrap();
    assert_eq!(running.reason, "Unschedulable");
    assert!(
        running.message.contains("Insufficient nvidia.com/gpu"),
        "{}",
        running.message
    );
}

#[test]
fn a_pod_queued_in_kueue_past_the_start_timeout_keeps_waiting_and_says_so() {
    let mut job = job();
    let first = step(&job, None, Admission::Admit, 0);
    apply(&mut job, &first);
    let observed = Observed {
        job: &job,
        spec: Ok(job.spec.token_budget),
        pod: Some(PodState::Starting {
            waiting: Some((
                "WaitingForQueue".into(),
                "Kueue's LocalQueue \"gpu\" has not admitted it yet".into(),
            )),
            since: None,
        }),
        reported: None,
        admission: Admission::Admit,
        account: Some("acct".into()),
        lane: Some("small".into()),
        now: at(6 * 3600),
        start_timeout: Some(Duration::from_secs(600)),
        worker_image: None,
        workers: Workers::default(),
    };
    let queued = decide(&observed, &POLICY);
    assert!(!conditions::is_true(&queued.status.conditions, FINISHED));
    assert!(queued.actions.is_empty(), "{:?}", queued.actions);
    let running = get(&queued.status.conditions, RUNNING).unwrap();
    assert_eq!(running.reason, "WaitingForQueue");
    assert!(running.message.contains("\"gpu\""), "{}", running.message);
}

#[test]
fn a_refused_pod_create_is_retried_with_backoff_then_fails_the_job_charging_nothing() {
    let mut job = job();
    let first = step(&job, None, Admission::Admit, 0);
    apply(&mut job, &first);
    let refuse = |job: &mut HarvestJob, now: i64| {
        let status = job.status.as_mut().unwrap();
        conditions::set(
            &mut status.conditions,
            ConditionUpdate {
                type_: RUNNING,
                status: false,
                reason: FAILED_CREATE,
                message:
                    "attempt 1: Error creating Pod: serviceaccount \"harvest-worker\" not found"
                        .into(),
            },
            Some(1),
            &Time(at(now)),
        );
    };
    refuse(&mut job, 0);
    let backoff = step(&job, None, Admission::Admit, 1);
    assert_eq!(backoff.requeue_after, Some(Duration::from_secs(9)));
    assert!(
        !backoff
            .actions
            .iter()
            .any(|a| matches!(a, Action::CreatePod(_)))
    );
    apply(&mut job, &backoff);
    let second = step(&job, None, Admission::Admit, 11);
    assert!(
        second
            .actions
            .iter()
            .any(|a| matches!(a, Action::CreatePod(Attempt { number: 2, .. })))
    );
    apply(&mut job, &second);
    refuse(&mut job, 11);
    let last = step(&job, None, Admission::Admit, 12);
    let finished = get(&last.status.conditions, FINISHED).unwrap();
    assert_eq!(finished.reason, "BackoffLimitExceeded");
    assert!(
        finished.message.contains("serviceaccount"),
        "{}",
        finished.message
    );
    assert_eq!(last.status.tokens.unwrap().charged, Some(0));
}

#[test]
fn a_pod_create_a_resource_quota_refuses_is_made_again_uncounted_until_the_quota_frees() {
    let mut job = job();
    let first = step(&job, None, Admission::Admit, 0);
    apply(&mut job, &first);
    let status = job.status.as_mut().unwrap();
    conditions::set(
        &mut status.conditions,
        ConditionUpdate {
            type_: RUNNING,
            status: false,
            reason: WAITING_FOR_QUOTA,
            message:
                "attempt 1: waiting for quota: pods \"j-1\" is forbidden: exceeded quota: gpus"
                    .into(),
        },
        Some(1),
        &Time(at(0)),
    );
    // Long past any backoff and any start timeout: the attempt still waits, never fails.
    for now in [1, 700, 5000] {
        let again = step(&job, None, Admission::Admit, now);
        assert_eq!(
            again.actions,
            [Action::CreatePod(whole(1, None))],
            "at {now}"
        );
        assert_eq!((again.status.attempts, again.status.failures), (1, 0));
        assert!(!conditions::is_true(&again.status.conditions, FINISHED));
        assert_eq!(again.requeue_after, Some(POLICY.admission_poll));
    }
    let created = step(
        &job,
        Some(PodState::Starting {
            waiting: None,
            since: Some(Time(at(5001))),
        }),
        Admission::Admit,
        5001,
    );
    let running = get(&created.status.conditions, RUNNING).unwrap();
    assert_eq!(running.reason, "PodStarting");
    assert!(created.actions.is_empty(), "{:?}", created.actions);
}

#[test]
fn a_pod_left_terminating_past_its_grace_is_lost_and_retried_uncounted() {
    let mut job = job();
    let first = step(&job, None, Admission::Admit, 0);
    apply(&mut job, &first);
    let evicted = || {
        Some(PodState::Terminating {
            since: Some(Time(at(100))),
            grace_seconds: 30,
        })
    };
    let waiting = step(&job, evicted(), Admission::Admit, 200);
    assert!(waiting.actions.is_empty(), "{:?}", waiting.actions);
    assert_eq!(waiting.requeue_after, Some(Duration::from_secs(50)));
    let lost = step(&job, evicted(), Admission::Admit, 250);
    assert!(lost.actions.contains(&Action::CreatePod(whole(2, None))));
    assert_eq!((lost.status.attempts, lost.status.failures), (2, 0));
    assert!(lost.actions.iter().any(|a| matches!(
        a,
        Action::Event { reason, note, .. } if reason == "PodLost" && note.contains("stayed Terminating 150 s")
    )));
}

#[test]
fn a_pod_the_operator_did_not_make_fails_the_job_unread_undeleted_and_uncharged() {
    let mut job = job();
    let admitted = step(&job, None, Admission::Admit, 0);
    apply(&mut job, &admitted);
    let foreign = Some(PodState::Foreign { controller: None });
    let decision = step(&job, foreign, Admission::Admit, 5);
    let finished = get(&decision.status.conditions, FINISHED).unwrap();
    assert_eq!(finished.reason, "PodNameTaken");
    assert!(finished.message.contains("j-1"), "{}", finished.message);
    assert_eq!(decision.status.tokens.unwrap().charged, Some(0));
    assert!(
        !decision
            .actions
            .iter()
            .any(|a| matches!(a, Action::DeletePod(_))),
        "{:?}",
        decision.actions
    );
}

#[test]
fn a_worker_reporting_more_tokens_than_were_reserved_is_charged_the_reservation() {
    let mut job = job();
    let admitted = step(&job, None, Admission::Admit, 0);
    apply(&mut job, &admitted);
    let result = harvest_crds::ResultSummary {
        tokens: 10_000,
        ..Default::default()
    };
    let succeeded = Some(PodState::Succeeded {
        result: Some(result),
        part: None,
    });
    let done = step(&job, succeeded, Admission::Admit, 9);
    assert_eq!(done.status.tokens.unwrap().charged, Some(500));
}

#[test]
fn a_job_recreated_under_its_old_name_gets_pods_of_another_name() {
    let mut first = job();
    first.metadata.uid = Some("aaaaaaaa-bbbb-cccc-dddd-00000a1b2c3d".into());
    let mut second = job();
    second.metadata.uid = Some("aaaaaaaa-bbbb-cccc-dddd-00009f8e7d6c".into());
    let name = |job: &HarvestJob| step(job, None, Admission::Admit, 0).status.pod.unwrap();
    assert_eq!(name(&first), "j-0a1b2c3d-1");
    assert_eq!(name(&second), "j-9f8e7d6c-1");
}

/// One reconcile of a job in parts: `parts` are the parts' Pods as observed, `slots` the
/// worker Pods `maxPods` leaves it, `pod` its finalize Pod.
fn step_parts(
    job: &HarvestJob,
    parts: Vec<Option<PodState>>,
    pod: Option<PodState>,
    slots: u32,
    now: i64,
) -> Decision {
    let observed = Observed {
        job,
        spec: Ok(job.spec.token_budget),
        pod,
        reported: None,
        admission: Admission::Admit,
        account: Some("acct".into()),
        lane: Some("small".into()),
        now: at(now),
        start_timeout: None,
        worker_image: None,
        workers: Workers {
            parallelism: 3,
            parts,
            reports: Vec::new(),
            pod_slots: slots,
        },
    };
    decide(&observed, &POLICY)
}

fn part_created(decision: &Decision, index: u32, number: u32) -> bool {
    decision.actions.iter().any(|a| {
        matches!(a, Action::CreatePod(Attempt { role: Role::Part { index: i, count: 3 }, number: n, .. }) if *i == index && *n == number)
    })
}

fn part_done(tokens: u64) -> Option<PodState> {
    Some(PodState::Succeeded {
        result: None,
        part: Some(harvest_core::worker::PartResult {
            part: "0/3".into(),
            shards: [0, 1],
            written: 1,
            resumed: 0,
            tokens,
        }),
    })
}

#[test]
fn a_part_whose_pod_a_resource_quota_refused_is_made_again_while_the_others_run() {
    let mut job = job();
    let admitted = step_parts(&job, Vec::new(), None, u32::MAX, 0);
    apply(&mut job, &admitted);
    let status = job.status.as_mut().unwrap();
    status.parts[1].message =
        format!("{WAITING_FOR_QUOTA}: part 1/3 attempt 1: waiting for quota: exceeded quota: gpus");
    let running = Some(PodState::Running);
    let again = step_parts(&job, vec![running.clone(), None, running], None, 0, 900);
    assert!(part_created(&again, 1, 1), "{:?}", again.actions);
    assert!(!part_created(&again, 0, 2) && !part_created(&again, 2, 2));
    let part = &again.status.parts[1];
    assert_eq!((part.attempts, part.failures), (1, 0));
    assert!(!conditions::is_true(&again.status.conditions, FINISHED));
    assert_eq!(again.requeue_after, Some(POLICY.admission_poll));
}

#[test]
fn a_job_in_three_parts_starts_each_part_then_finalizes_once_and_is_charged_its_result() {
    let mut job = job();
    let admitted = step_parts(&job, Vec::new(), None, u32::MAX, 0);
    assert!((0..3).all(|i| part_created(&admitted, i, 1)));
    assert_eq!(admitted.status.parallelism, Some(3));
    assert_eq!(admitted.status.parts_summary.as_deref(), Some("0/3"));
    assert_eq!(admitted.status.pod, None);
    apply(&mut job, &admitted);
    let running = vec![Some(PodState::Running); 3];
    let one_done = step_parts(
        &job,
        vec![part_done(40), running[1].clone(), running[2].clone()],
        None,
        u32::MAX,
        5,
    );
    assert_eq!(one_done.status.parts_summary.as_deref(), Some("1/3"));
    assert_eq!(one_done.status.parts[0].tokens, 40);
    assert!(
        !one_done
            .actions
            .iter()
            .any(|a| matches!(a, Action::CreatePod(_)))
    );
    apply(&mut job, &one_done);
    let all_done = step_parts(
        &job,
        vec![part_done(40), part_done(30), part_done(20)],
        None,
        u32::MAX,
        9,
    );
    let finalize = Attempt {
        role: Role::Finalize,
        number: 1,
        deadline_seconds: None,
    };
    assert!(all_done.actions.contains(&Action::CreatePod(finalize)));
    assert_eq!(all_done.status.pod.as_deref(), Some("j-finalize-1"));
    assert!(!conditions::is_true(&all_done.status.conditions, FINISHED));
    apply(&mut job, &all_done);
    let result = harvest_crds::ResultSummary {
        tokens: 90,
        ..Default::default()
    };
    let finished = step_parts(
        &job,
        vec![part_done(40), part_done(30), part_done(20)],
        Some(PodState::Succeeded {
            result: Some(result),
            part: None,
        }),
        u32::MAX,
        12,
    );
    assert_eq!(finished.status.phase, Some(JobPhase::Succeeded));
    assert_eq!(finished.status.tokens.unwrap().charged, Some(90));
    assert!(
        !finished
            .actions
            .iter()
            .any(|a| matches!(a, Action::CreatePod(_)))
    );
}

#[test]
fn a_failed_part_is_retried_alone_after_its_backoff_and_the_parts_share_the_backoff_limit() {
    let mut job = job();
    job.metadata.uid = None;
    let admitted = step_parts(&job, Vec::new(), None, u32::MAX, 0);
    apply(&mut job, &admitted);
    let run = || Some(PodState::Running);
    // Part 1 runs out of memory at second 5: counted, retried after the 10 s base delay.
    let failed_once = step_parts(&job, vec![run(), failed(Blame::Job, 5), run()], None, 0, 6);
    let part = &failed_once.status.parts[1];
    assert_eq!((part.failures, part.pod.as_deref()), (1, None));
    assert!(
        !failed_once
            .actions
            .iter()
            .any(|a| matches!(a, Action::CreatePod(_)))
    );
    assert_eq!(failed_once.requeue_after, Some(Duration::from_secs(9)));
    assert!(
        failed_once
            .actions
            .iter()
            .any(|a| matches!(a, Action::Event { reason, .. } if reason == "PartFailed"))
    );
    apply(&mut job, &failed_once);
    let retried = step_parts(&job, vec![run(), None, run()], None, 1, 15);
    assert!(part_created(&retried, 1, 2));
    assert!(!part_created(&retried, 0, 2) && !part_created(&retried, 2, 2));
    assert_eq!(retried.status.parts[1].pod.as_deref(), Some("j-p1-2"));
    apply(&mut job, &retried);
    // A second counted failure, of another part, passes backoffLimit 1: the job fails and
    // its live part Pods are stopped.
    let exhausted = step_parts(
        &job,
        vec![run(), run(), failed(Blame::Job, 20)],
        None,
        1,
        21,
    );
    assert_eq!(
        get(&exhausted.status.conditions, FINISHED).unwrap().reason,
        "BackoffLimitExceeded"
    );
    for pod in ["j-p0-1", "j-p1-2"] {
        assert!(
            exhausted.actions.contains(&Action::DeletePod(pod.into())),
            "{pod}"
        );
    }
}

#[test]
fn parts_past_the_models_pod_slots_wait_and_start_in_index_order_as_slots_free() {
    let mut job = job();
    job.metadata.uid = None;
    let admitted = step_parts(&job, Vec::new(), None, 1, 0);
    assert!(part_created(&admitted, 0, 1));
    assert!(!part_created(&admitted, 1, 1) && !part_created(&admitted, 2, 1));
    assert_eq!(
        admitted.status.parts[1].phase,
        harvest_crds::PartPhase::Waiting
    );
    apply(&mut job, &admitted);
    let none_free = step_parts(&job, vec![Some(PodState::Running), None, None], None, 0, 1);
    assert!(
        !none_free
            .actions
            .iter()
            .any(|a| matches!(a, Action::CreatePod(_)))
    );
    assert_eq!(none_free.requeue_after, Some(POLICY.admission_poll));
    apply(&mut job, &none_free);
    let one_free = step_parts(&job, vec![Some(PodState::Running), None, None], None, 1, 2);
    assert!(part_created(&one_free, 1, 1) && !part_created(&one_free, 2, 1));
}

#[test]
fn a_one_pod_job_without_a_pod_slot_stays_admitted_and_says_it_waits() {
    let observed = |job: &HarvestJob, slots: u32| {
        let observed = Observed {
            job,
            spec: Ok(job.spec.token_budget),
            pod: None,
            reported: None,
            admission: Admission::Admit,
            account: Some("acct".into()),
            lane: Some("small".into()),
            now: at(0),
            start_timeout: None,
            worker_image: None,
            workers: Workers {
                pod_slots: slots,
                ..Workers::default()
            },
        };
        decide(&observed, &POLICY)
    };
    let mut job = job();
    let waiting = observed(&job, 0);
    assert!(
        !waiting
            .actions
            .iter()
            .any(|a| matches!(a, Action::CreatePod(_)))
    );
    assert!(conditions::is_true(&waiting.status.conditions, ADMITTED));
    assert_eq!(
        get(&waiting.status.conditions, RUNNING).unwrap().reason,
        WAITING_FOR_POD_SLOT
    );
    apply(&mut job, &waiting);
    assert!(
        observed(&job, 1)
            .actions
            .contains(&Action::CreatePod(whole(1, None)))
    );
}

#[test]
fn suspending_a_job_in_parts_stops_its_parts_and_resuming_starts_only_the_unfinished() {
    let mut job = job();
    job.metadata.uid = None;
    let admitted = step_parts(&job, Vec::new(), None, u32::MAX, 0);
    apply(&mut job, &admitted);
    let one_done = step_parts(
        &job,
        vec![
            part_done(5),
            Some(PodState::Running),
            Some(PodState::Running),
        ],
        None,
        u32::MAX,
        3,
    );
    apply(&mut job, &one_done);
    job.spec.suspend = true;
    let live = vec![None, Some(PodState::Running), Some(PodState::Running)];
    let suspended = step_parts(&job, live, None, u32::MAX, 4);
    for pod in ["j-p1-1", "j-p2-1"] {
        assert!(
            suspended.actions.contains(&Action::DeletePod(pod.into())),
            "{pod}"
        );
    }
    apply(&mut job, &suspended);
    job.spec.suspend = false;
    let resumed = step_parts(&job, vec![None, None, None], None, u32::MAX, 5);
    assert!(part_created(&resumed, 1, 2) && part_created(&resumed, 2, 2));
    assert!(!resumed.actions.iter().any(|a| matches!(
        a,
        Action::CreatePod(Attempt {
            role: Role::Part { index: 0, .. },
            ..
        })
    )));
}

#[test]
fn the_configured_retry_base_doubles_per_counted_failure_up_to_five_minutes() {
    let config = OperatorConfig::parse(
        "models:\n  - {name: m, path: /m, numLayers: 2, hiddenSize: 8, lane: small, image: i, gpus: 1}\nlanes: {small: 1, large: 1}\n",
    )
    .unwrap();
    let policy = Policy::from(&config);
    assert_eq!(policy.retry_delay(1), Duration::from_secs(10));
    assert_eq!(policy.retry_delay(3), Duration::from_secs(40));
    assert_eq!(policy.retry_delay(30), Duration::from_secs(300));
}
