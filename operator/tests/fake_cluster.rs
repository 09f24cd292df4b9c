//! The real controller against the stateful fake apiserver, whose fake kubelet runs the real
//! `harvester` on SmolLM2: jobs end Finished with shards on disk, and cancel, an OOM kill, a
//! deadline, a TTL, bad input and an operator restart all end the way a user expects.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::time::Duration;

use common::Cluster;
use harvest_crds::{HarvestJob, JobPhase};
use kube::api::{Patch, PatchParams};
use serde_json::json;

fn finished_reason(job: &HarvestJob) -> String {
    harvest_crds::conditions::get(&job.status.as_ref().unwrap().conditions, "Finished")
        .unwrap()
        .reason
        .clone()
}

fn pod_phase(cluster: &Cluster, pod: &str) -> Option<String> {
    cluster
        .server
        .get("/api/v1", "pods", "default", pod)
        .map(|p| p["status"]["phase"].as_str().unwrap_or_default().to_owned())
}

/// The name of `job`'s attempt `attempt`'s Pod.
fn attempt_pod(job: &HarvestJob, attempt: u32) -> String {
    harvest_operator::pod::pod_name(
        job.metadata.name.as_deref().unwrap(),
        job.metadata.uid.as_deref(),
        attempt,
    )
}

fn manifest(output: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(output.join("manifest.json")).unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_queue_in_their_lane_and_finish_succeeded_with_shards_and_a_charge() {
    let cluster = Cluster::start(1).await;
    // The first job runs long enough (8 prompts of ~500 tokens: longer than the 5 s admission
    // poll here) that the second is certainly reconciled while the lane is full.
    let long = cluster.prompts("long", 8, 50);
    let prompts = cluster.prompts("seed", 6, 2);
    cluster.submit("first", long, |_| {}).await;
    cluster
        .submit("second", prompts, |s| s.harvest.layers = Some(vec![3, 29]))
        .await;
    let waiting = cluster
        .wait("second", "waiting for the lane", |j| {
            j.status.as_ref().is_some_and(|s| {
                harvest_crds::conditions::get(&s.conditions, "Admitted")
                    .is_some_and(|c| c.reason == "WaitingForLane")
            })
        })
        .await;
    assert_eq!(
        waiting.status.as_ref().unwrap().phase,
        Some(JobPhase::Pending)
    );
    for (name, shards, prompts) in [("first", 2, 8), ("second", 2, 6)] {
        let job = cluster.finished(name).await;
        let status = job.status.clone().unwrap();
        assert_eq!(finished_reason(&job), "Succeeded", "{status:?}");
        assert_eq!(status.phase, Some(JobPhase::Succeeded));
        let result = status.result.unwrap();
        assert_eq!((result.n_shards, result.prompts), (shards, prompts));
        assert_eq!(
            status.tokens.unwrap().charged,
            Some(result.tokens),
            "charged what ran"
        );
        assert_eq!(status.attempts, 1);
        let manifest = manifest(&cluster.output(name));
        assert_eq!(manifest["n_prompts"], prompts);
        assert_eq!(manifest["total_tokens"], result.tokens);
        assert!(
            status
                .conditions
                .iter()
                .all(|c| c.observed_generation == Some(1))
        );
    }
    assert_eq!(
        manifest(&cluster.output("second"))["layer_indices"],
        json!([3, 29])
    );
    let mut charged = 0;
    for name in ["first", "second"] {
        let job = cluster.jobs().get(name).await.unwrap();
        let status = job.status.unwrap();
        assert_eq!(status.account.as_deref(), Some(common::ACCOUNT));
        charged += status.tokens.unwrap().charged.unwrap();
    }
    let books = cluster.account_until(|s| s.holds.is_empty()).await;
    assert_eq!(
        (books.tokens_today, books.tokens_total),
        (charged, charged),
        "the account's books hold exactly the two charges"
    );
    assert_eq!(books.jobs_by_key.get("namespace:default"), Some(&2));
    assert_eq!(books.active.small, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_mid_run_stops_the_pod_and_charges_the_reservation() {
    let cluster = Cluster::start(2).await;
    let prompts = cluster.prompts("long", 96, 12);
    cluster.submit("cancelled", prompts, |_| {}).await;
    let pod = cluster.running_pod("cancelled").await;
    let patch = json!({"spec": {"cancel": true}});
    cluster
        .jobs()
        .patch("cancelled", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    let job = cluster.finished("cancelled").await;
    assert_eq!(finished_reason(&job), "Cancelled");
    let tokens = job.status.unwrap().tokens.unwrap();
    assert_eq!(
        tokens.charged,
        Some(tokens.reserved),
        "a started job that is cancelled is charged its reservation"
    );
    cluster
        .wait("cancelled", "the Pod deleted", |_| {
            pod_phase(&cluster, &pod).is_none()
        })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_while_the_pod_waits_for_its_image_charges_nothing_and_frees_the_slot() {
    let cluster = Cluster::start(1).await;
    let prompts = cluster.prompts("stuck", 2, 2);
    cluster
        .submit("stuck", prompts, |s| s.model = common::UNPULLABLE.into())
        .await;
    cluster
        .wait("stuck", "its Pod waiting for the image", |j| {
            j.status.as_ref().is_some_and(|s| {
                harvest_crds::conditions::get(&s.conditions, "Running")
                    .is_some_and(|c| c.reason == "ErrImagePull")
            })
        })
        .await;
    let patch = json!({"spec": {"cancel": true}});
    cluster
        .jobs()
        .patch("stuck", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    let job = cluster.finished("stuck").await;
    assert_eq!(finished_reason(&job), "Cancelled");
    let status = job.status.unwrap();
    assert!(status.running_since.is_none(), "{status:?}");
    assert_eq!(status.tokens.unwrap().charged, Some(0), "no harvester ran");
    // The lane's one slot is free for the next job.
    let next = cluster.prompts("after-stuck", 2, 2);
    cluster.submit("after-stuck", next, |_| {}).await;
    assert_eq!(
        finished_reason(&cluster.finished("after-stuck").await),
        "Succeeded"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oom_killed_attempt_is_retried_counted_and_then_succeeds() {
    let cluster = Cluster::start(2).await;
    let prompts = cluster.prompts("oom", 48, 8);
    cluster.submit("oom", prompts, |_| {}).await;
    let pod = cluster.running_pod("oom").await;
    assert!(cluster.server.oom_kill("default", &pod));
    let job = cluster.finished("oom").await;
    let status = job.status.clone().unwrap();
    assert_eq!(finished_reason(&job), "Succeeded", "{status:?}");
    assert_eq!(
        (status.attempts, status.failures),
        (2, 1),
        "the OOM kill counts against backoffLimit"
    );
    assert_eq!(pod_phase(&cluster, &pod).as_deref(), Some("Failed"));
    let started = cluster.server.started_pods();
    let attempt = |n| format!("default/{}", attempt_pod(&job, n));
    assert_eq!(
        (started.get(&attempt(1)), started.get(&attempt(2))),
        (Some(&1), Some(&1))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eviction_retries_without_using_up_the_backoff_limit() {
    let cluster = Cluster::start(2).await;
    let prompts = cluster.prompts("evict", 48, 8);
    cluster
        .submit("evicted", prompts, |s| s.backoff_limit = 0)
        .await;
    let pod = cluster.running_pod("evicted").await;
    assert!(cluster.server.evict("default", &pod));
    let job = cluster.finished("evicted").await;
    let status = job.status.clone().unwrap();
    assert_eq!(finished_reason(&job), "Succeeded", "{status:?}");
    assert_eq!((status.attempts, status.failures), (2, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_past_its_deadline_fails_and_its_pod_is_stopped() {
    let cluster = Cluster::start(2).await;
    let prompts = cluster.prompts("slow", 96, 12);
    cluster
        .submit("late", prompts, |s| s.active_deadline_seconds = Some(3))
        .await;
    let job = cluster.finished("late").await;
    assert_eq!(finished_reason(&job), "DeadlineExceeded");
    assert_eq!(job.status.unwrap().tokens.unwrap().charged, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_fails_with_a_reason_that_names_it_and_ttl_deletes_the_job() {
    let cluster = Cluster::start(2).await;
    let prompts = cluster.prompts("ok", 2, 1);
    cluster
        .submit("unknown-model", prompts.clone(), |s| {
            s.model = "llama-9000".into();
        })
        .await;
    cluster
        .submit("bad-layer", prompts.clone(), |s| {
            s.harvest.layers = Some(vec![30]);
        })
        .await;
    let missing = cluster
        .dir
        .path()
        .join("missing.jsonl")
        .display()
        .to_string();
    cluster
        .submit("missing-input", missing, |s| {
            s.ttl_seconds_after_finished = Some(4);
        })
        .await;
    let job = cluster.finished("missing-input").await;
    assert_eq!(finished_reason(&job), "InvalidInput", "{:?}", job.status);
    let message = harvest_crds::conditions::get(&job.status.unwrap().conditions, "Finished")
        .unwrap()
        .message
        .clone();
    assert!(message.contains("missing.jsonl"), "{message}");
    let job = cluster.finished("unknown-model").await;
    assert_eq!(finished_reason(&job), "UnknownModel");
    assert!(
        harvest_crds::conditions::get(&job.status.unwrap().conditions, "Finished")
            .unwrap()
            .message
            .contains("llama-9000")
    );
    let job = cluster.finished("bad-layer").await;
    let message =
        harvest_crds::conditions::get(&job.status.clone().unwrap().conditions, "Finished")
            .unwrap()
            .message
            .clone();
    assert_eq!(finished_reason(&job), "InvalidLayers");
    assert!(message.contains("layer 30"), "{message}");
    assert_eq!(
        job.status.unwrap().attempts,
        0,
        "an invalid spec never starts a Pod"
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while cluster
        .jobs()
        .get_opt("missing-input")
        .await
        .unwrap()
        .is_some()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the TTL did not delete the job"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_restart_mid_job_neither_reruns_nor_double_charges() {
    let mut cluster = Cluster::start(2).await;
    let prompts = cluster.prompts("restart", 48, 8);
    cluster.submit("restarted", prompts, |_| {}).await;
    let pod = cluster.running_pod("restarted").await;
    let reporting = cluster
        .wait("restarted", "progress read from the worker", |j| {
            j.status
                .as_ref()
                .and_then(|s| s.progress.as_ref())
                .is_some_and(|p| p.prompts_done > 0)
        })
        .await;
    let progress = reporting.status.unwrap().progress.unwrap();
    assert_eq!(progress.prompts_total, 48);
    assert_eq!(progress.shards_total, 12, "48 prompts in shards of 4");
    assert_eq!(progress.shards_done, progress.prompts_done / 4);
    cluster.kill_operator().await;
    cluster
        .wait(
            "restarted",
            "the Pod to finish while no operator runs",
            |_| pod_phase(&cluster, &pod).as_deref() == Some("Succeeded"),
        )
        .await;
    cluster.start_operator();
    let job = cluster.finished("restarted").await;
    let first = format!("default/{}", attempt_pod(&job, 1));
    let status = job.status.unwrap();
    assert_eq!(status.attempts, 1);
    assert_eq!(
        cluster.server.started_pods().get(&first),
        Some(&1),
        "the harvest ran once"
    );
    let charged = status.tokens.unwrap().charged.unwrap();
    assert_eq!(charged, status.result.unwrap().tokens);
    let books = cluster.account_until(|s| s.holds.is_empty()).await;
    assert_eq!(
        books.tokens_total, charged,
        "charged once across the restart"
    );
    assert_eq!(books.jobs_by_key.get("namespace:default"), Some(&1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_the_apiserver_refuses_is_a_failed_create_event_and_ends_the_job_after_its_backoff() {
    let cluster = Cluster::start(1).await;
    kube::Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(
        cluster.client.clone(),
        "default",
    )
    .delete("harvest-worker", &Default::default())
    .await
    .unwrap();
    let prompts = cluster.prompts("refused", 2, 2);
    cluster
        .submit("refused", prompts, |s| s.backoff_limit = 1)
        .await;
    let job = cluster.finished("refused").await;
    let status = job.status.clone().unwrap();
    let finished = harvest_crds::conditions::get(&status.conditions, "Finished").unwrap();
    assert_eq!(finished.reason, "BackoffLimitExceeded", "{status:?}");
    assert!(
        finished
            .message
            .contains("serviceaccount \"harvest-worker\" not found"),
        "{}",
        finished.message
    );
    assert_eq!(status.attempts, 2);
    assert_eq!(status.tokens.unwrap().charged, Some(0));
    // The account's slot is free again: the next job runs once the account is back.
    common::create_worker_account(&cluster.client, "default").await;
    let events = kube::Api::<k8s_openapi::api::events::v1::Event>::namespaced(
        cluster.client.clone(),
        "default",
    )
    .list(&Default::default())
    .await
    .unwrap();
    assert!(
        events
            .items
            .iter()
            .any(|e| e.reason.as_deref() == Some("FailedCreate")
                && e.note.as_deref().is_some_and(|n| n.contains("forbidden"))),
        "no FailedCreate event: {:?}",
        events.items.iter().map(|e| &e.reason).collect::<Vec<_>>()
    );
    let next = cluster.prompts("next", 2, 2);
    cluster.submit("next", next, |_| {}).await;
    assert_eq!(
        finished_reason(&cluster.finished("next").await),
        "Succeeded"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_a_resource_quota_refuses_waits_uncounted_and_runs_once_the_quota_frees() {
    let cluster = Cluster::start(1).await;
    // ResourceQuota's admission refusal, as kube-apiserver words it.
    let quota = harvest_fake_apiserver::store::ApiError::new(
        403,
        "Forbidden",
        "pods \"quota\" is forbidden: exceeded quota: gpu-quota, requested: requests.nvidia.com/gpu=1, used: requests.nvidia.com/gpu=1, limited: requests.nvidia.com/gpu=1".into(),
    );
    cluster
        .server
        .store
        .refuse_next("POST", "/namespaces/default/pods", 3, quota);
    let prompts = cluster.prompts("quota", 2, 2);
    cluster
        .submit("quota", prompts, |s| s.backoff_limit = 0)
        .await;
    let job = cluster.finished("quota").await;
    let status = job.status.clone().unwrap();
    assert_eq!(finished_reason(&job), "Succeeded", "{status:?}");
    assert_eq!(
        cluster.server.store.faults_pending(),
        0,
        "every refusal was met"
    );
    assert_eq!(
        (status.attempts, status.failures),
        (1, 0),
        "waiting for quota is neither a failure nor a new attempt"
    );
    let tokens = status.tokens.unwrap();
    assert_eq!(tokens.charged, status.result.map(|r| r.tokens));
    let events = kube::Api::<k8s_openapi::api::events::v1::Event>::namespaced(
        cluster.client.clone(),
        "default",
    )
    .list(&Default::default())
    .await
    .unwrap();
    let waits: Vec<_> = events
        .items
        .iter()
        .filter(|e| e.reason.as_deref() == Some("WaitingForQuota"))
        .collect();
    assert_eq!(waits.len(), 1, "one Event for the wait, not one per try");
    assert!(
        waits[0]
            .note
            .as_deref()
            .is_some_and(|n| n.contains("exceeded quota: gpu-quota")),
        "{:?}",
        waits[0].note
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_stuck_terminating_on_a_lost_node_is_retried_elsewhere_and_charged_once() {
    let cluster = Cluster::start(1).await;
    let prompts = cluster.prompts("lost", 48, 8);
    cluster
        .submit("lost", prompts, |s| s.backoff_limit = 0)
        .await;
    let pod = cluster.running_pod("lost").await;
    // A node that stops answering: the taint manager deletes its Pods, and with no kubelet to
    // confirm, they stay Terminating (a finalizer holds this one the same way).
    let pods =
        kube::Api::<k8s_openapi::api::core::v1::Pod>::namespaced(cluster.client.clone(), "default");
    let hold = serde_json::json!({"metadata": {"finalizers": ["test.harvest.dev/node-lost"]}});
    pods.patch(&pod, &Default::default(), &Patch::Merge(&hold))
        .await
        .unwrap();
    pods.delete(&pod, &Default::default()).await.unwrap();
    let job = cluster.finished("lost").await;
    let status = job.status.clone().unwrap();
    assert_eq!(finished_reason(&job), "Succeeded", "{status:?}");
    assert_eq!(
        (status.attempts, status.failures),
        (2, 0),
        "a lost node is the cluster's fault, not the job's"
    );
    assert_eq!(
        status.tokens.unwrap().charged,
        status.result.map(|r| r.tokens),
        "charged once, for the attempt that finished"
    );
    let stuck = pods.get(&pod).await.unwrap();
    assert!(
        stuck.metadata.deletion_timestamp.is_some(),
        "still Terminating"
    );
    let release = serde_json::json!({"metadata": {"finalizers": null}});
    pods.patch(&pod, &Default::default(), &Patch::Merge(&release))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_named_past_the_label_limit_runs_under_a_hashed_label() {
    let cluster = Cluster::start(1).await;
    // 70 characters: a valid object name, too long for a label value (the apiserver refuses a
    // Pod labelled with it).
    let name = format!("probe-{}", "x".repeat(64));
    let prompts = cluster.prompts("long-name", 2, 2);
    cluster.submit(&name, prompts, |_| {}).await;
    let job = cluster.finished(&name).await;
    assert_eq!(finished_reason(&job), "Succeeded", "{:?}", job.status);
    let pod = job.status.unwrap().pod.unwrap();
    let uid = job.metadata.uid.as_deref();
    assert_eq!(pod, harvest_operator::pod::pod_name(&name, uid, 1));
    assert!(pod.starts_with(&name), "{pod}");
}
