//! `tower_test` scenarios of the exact requests one reconcile makes, in order, answered by a
//! scripted apiserver (the controller-rs `fixtures.rs` pattern). The fake apiserver tests show
//! the whole life of a job; these pin down each call of a single reconcile.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use harvest_crds::{
    HarvestAccount, HarvestAccountSpec, HarvestJob, HarvestJobSpec, OutputRetention,
};
use http::{Method, Request, Response, StatusCode};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::client::Body;
use kube::runtime::events::{Recorder, Reporter};
use serde_json::{Value, json};

use crate::config::OperatorConfig;
use crate::finalize::CLEANUP_FINALIZER;
use crate::metrics::Metrics;
use crate::reconcile::{Context, reconcile};

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

/// Answers the reconcile's requests one by one, checking each is the one expected.
struct ApiServerVerifier(Handle);

impl ApiServerVerifier {
    /// Expects `method` on `path` (query ignored), answers `status` with `reply`, and returns
    /// the request's body.
    async fn expect(
        &mut self,
        method: Method,
        path: &str,
        status: StatusCode,
        reply: Value,
    ) -> Value {
        let (request, send) = tokio::time::timeout(Duration::from_secs(5), self.0.next_request())
            .await
            .unwrap_or_else(|_| panic!("no request came; expected {method} {path}"))
            .expect("the client hung up");
        assert_eq!((request.method(), request.uri().path()), (&method, path));
        let body = request.into_body().collect_bytes().await.unwrap();
        let body = if body.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&body).unwrap()
        };
        let response = Response::builder()
            .status(status)
            .body(Body::from(serde_json::to_vec(&reply).unwrap()))
            .unwrap();
        send.send_response(response);
        body
    }

    /// Expects the reconcile to record an Event, and returns it.
    async fn expect_event(&mut self) -> Value {
        self.expect(
            Method::POST,
            "/apis/events.k8s.io/v1/namespaces/team/events",
            StatusCode::CREATED,
            json!({}),
        )
        .await
    }

    /// Fails if the reconcile makes any further request.
    async fn expect_nothing_more(&mut self) {
        if let Ok(Some((request, _))) =
            tokio::time::timeout(Duration::from_millis(300), self.0.next_request()).await
        {
            panic!("unexpected request {} {}", request.method(), request.uri());
        }
    }
}

fn context(client: Client) -> Arc<Context> {
    let config = OperatorConfig::parse(
        "models:\n- {name: m, path: /models/m, numLayers: 30, hiddenSize: 576, lane: small, image: img:1}\nlanes: {small: 1, large: 1}\n",
    )
    .unwrap();
    let (jobs, _writer) = kube::runtime::reflector::store();
    let (accounts, mut account_writer) = kube::runtime::reflector::store();
    let mut account =
        HarvestAccount::new("team-acct", HarvestAccountSpec::for_namespaces(&["team"]));
    account.metadata.resource_version = Some("7".into());
    account_writer.apply_watcher_event(&kube::runtime::watcher::Event::Apply(account));
    let reporter = Reporter {
        controller: "harvest-operator".into(),
        instance: Some("test".into()),
    };
    Arc::new(Context {
        client: client.clone(),
        config,
        recorder: Recorder::new(client, reporter),
        metrics: Metrics::default(),
        jobs,
        accounts,
        admitting: Mutex::new(HashSet::new()),
        pod_grants: Mutex::new(crate::context::PodGrants::default()),
    })
}

fn job(model: &str, output: &str) -> HarvestJob {
    let mut job = HarvestJob::new(
        "j",
        HarvestJobSpec::new(model, "s3://in/p.jsonl", output, 700),
    );
    job.metadata.namespace = Some("team".into());
    job.metadata.uid = Some("uid-1".into());
    job.metadata.resource_version = Some("41".into());
    job.metadata.generation = Some(1);
    job.metadata.creation_timestamp = Some(Time(Timestamp::now()));
    job
}

/// Runs one reconcile against the scripted apiserver `script` and returns its outcome.
async fn try_scenario<F, Fut>(
    job: HarvestJob,
    script: F,
) -> crate::Result<kube::runtime::controller::Action>
where
    F: FnOnce(ApiServerVerifier) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let ctx = context(Client::new(service, "default"));
    let server = tokio::spawn(script(ApiServerVerifier(handle)));
    let outcome = reconcile(Arc::new(job), ctx).await;
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("the script did not finish")
        .expect("the script panicked");
    outcome
}

/// Runs one reconcile that must succeed.
async fn scenario<F, Fut>(job: HarvestJob, script: F) -> kube::runtime::controller::Action
where
    F: FnOnce(ApiServerVerifier) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    try_scenario(job, script)
        .await
        .expect("the reconcile failed")
}

const JOBS: &str = "/apis/harvest.dev/v1alpha1/namespaces/team/harvestjobs";

#[tokio::test]
async fn a_new_job_in_a_free_lane_takes_its_hold_then_creates_its_pod_then_writes_its_status_then_records_the_event()
 {
    let job = job("m", "s3://out/j");
    let reply = serde_json::to_value(&job).unwrap();
    let fresh = reply.clone();
    scenario(job, |mut api| async move {
        // The apiserver's copy confirms the job still waits before a hold is taken.
        api.expect(Method::GET, &format!("{JOBS}/j"), StatusCode::OK, fresh)
            .await;
        let account = api
            .expect(
                Method::PUT,
                "/apis/harvest.dev/v1alpha1/harvestaccounts/team-acct/status",
                StatusCode::OK,
                json!({"metadata": {"name": "team-acct"}, "spec": {}}),
            )
            .await;
        assert_eq!(
            account["metadata"]["resourceVersion"], "7",
            "the books are written only over the version read"
        );
        assert_eq!(account["status"]["holds"][0]["uid"], "uid-1");
        assert_eq!(account["status"]["holds"][0]["tokens"], 700);
        assert_eq!(account["status"]["tokensToday"], 700);
        assert_eq!(account["status"]["jobsByKey"]["namespace:team"], 1);
        let pod = api
            .expect(
                Method::POST,
                "/api/v1/namespaces/team/pods",
                StatusCode::CREATED,
                json!({"metadata": {"name": "j-uid1-1"}}),
            )
            .await;
        assert_eq!(pod["metadata"]["name"], "j-uid1-1");
        assert_eq!(pod["metadata"]["ownerReferences"][0]["uid"], "uid-1");
        let status = api
            .expect(
                Method::PUT,
                &format!("{JOBS}/j/status"),
                StatusCode::OK,
                reply,
            )
            .await;
        assert_eq!(
            status["metadata"]["resourceVersion"], "41",
            "the write is conditional on what was read"
        );
        assert_eq!(status["status"]["tokens"]["reserved"], 700);
        assert_eq!(status["status"]["pod"], "j-uid1-1");
        assert_eq!(status["status"]["account"], "team-acct");
        assert_eq!(status["status"]["phase"], "Running");
        let event = api.expect_event().await;
        assert_eq!(event["reason"], "Admitted");
        api.expect_nothing_more().await;
    })
    .await;
}

#[tokio::test]
async fn a_job_the_cache_shows_waiting_but_the_apiserver_shows_admitted_takes_no_second_hold() {
    let job = job("m", "s3://out/j");
    let mut fresh = serde_json::to_value(&job).unwrap();
    fresh["status"] = json!({"conditions": [{"type": "Admitted", "status": "True", "reason": "Admitted",
        "message": "", "lastTransitionTime": "2026-11-30T00:00:00Z"}]});
    let outcome = try_scenario(job, |mut api| async move {
        api.expect(Method::GET, &format!("{JOBS}/j"), StatusCode::OK, fresh)
            .await;
        api.expect_nothing_more().await;
    })
    .await;
    let error = outcome.unwrap_err();
    assert!(error.is_conflict(), "retried at once: {error}");
}

#[tokio::test]
async fn an_unknown_model_writes_a_failed_status_and_a_warning_and_creates_nothing() {
    let job = job("llama-9000", "s3://out/j");
    let reply = serde_json::to_value(&job).unwrap();
    let action = scenario(job, |mut api| async move {
        let status = api
            .expect(
                Method::PUT,
                &format!("{JOBS}/j/status"),
                StatusCode::OK,
                reply,
            )
            .await;
        assert_eq!(status["status"]["phase"], "Failed");
        let finished = status["status"]["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Finished")
            .unwrap()
            .clone();
        assert_eq!(finished["reason"], "UnknownModel");
        assert!(finished["message"].as_str().unwrap().contains("llama-9000"));
        let event = api.expect_event().await;
        assert_eq!(
            (event["type"].as_str(), event["reason"].as_str()),
            (Some("Warning"), Some("UnknownModel"))
        );
        api.expect_nothing_more().await;
    })
    .await;
    assert_eq!(
        action,
        kube::runtime::controller::Action::await_change(),
        "a permanent error is not requeued"
    );
}

fn deleted_job(output: &std::path::Path) -> HarvestJob {
    let mut job = job("m", &output.display().to_string());
    job.spec.output_retention = OutputRetention::Delete;
    job.metadata.finalizers = Some(vec![CLEANUP_FINALIZER.into(), "other/keep".into()]);
    job.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
    job
}

const CLEANUP_POD: &str = "/api/v1/namespaces/team/pods/j-uid1-cleanup";

#[tokio::test]
async fn a_deleted_job_gives_its_local_outputs_to_a_cleanup_pod_and_looks_again_soon() {
    let job = deleted_job(std::path::Path::new("/outputs/j"));
    let action = scenario(job, |mut api| async move {
        let gone = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404});
        api.expect(Method::GET, CLEANUP_POD, StatusCode::NOT_FOUND, gone)
            .await;
        let pod = api
            .expect(
                Method::POST,
                "/api/v1/namespaces/team/pods",
                StatusCode::CREATED,
                json!({}),
            )
            .await;
        assert_eq!(pod["metadata"]["name"], "j-uid1-cleanup");
        assert_eq!(
            pod["spec"]["containers"][0]["args"],
            json!(["cleanup", "--output", "/outputs/j", "--job-uid", "uid-1", "--termination-log", "/dev/termination-log"])
        );
        api.expect_nothing_more().await;
    })
    .await;
    assert_eq!(
        action,
        kube::runtime::controller::Action::requeue(Duration::from_secs(2))
    );
}

/// A cleanup Pod that ended answering `message`.
fn cleanup_pod(message: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "j-uid1-cleanup", "namespace": "team"},
        "status": {"phase": "Succeeded", "containerStatuses": [{"name": "harvester", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
            "state": {"terminated": {"exitCode": 0, "message": message}}}]}})
}

/// The finalizer's reconcile of deleted `job` once its cleanup Pod answered `answer`: one
/// event with `reason` naming `says`, the Pod deleted, then the patch that drops the finalizer
/// and keeps the other one.
async fn cleaned_by_pod(answer: &str, reason: &'static str, says: &'static str) {
    let job = deleted_job(std::path::Path::new("/outputs/j"));
    let (reply, pod) = (serde_json::to_value(&job).unwrap(), cleanup_pod(answer));
    scenario(job, move |mut api| async move {
        api.expect(Method::GET, CLEANUP_POD, StatusCode::OK, pod.clone())
            .await;
        let event = api.expect_event().await;
        assert_eq!(event["reason"], reason, "{event}");
        assert!(event["note"].as_str().unwrap().contains(says), "{event}");
        api.expect(Method::DELETE, CLEANUP_POD, StatusCode::OK, pod)
            .await;
        let patch = api
            .expect(Method::PATCH, &format!("{JOBS}/j"), StatusCode::OK, reply)
            .await;
        assert_eq!(patch["metadata"]["finalizers"], json!(["other/keep"]));
        assert_eq!(patch["metadata"]["resourceVersion"], "41");
        api.expect_nothing_more().await;
    })
    .await;
}

#[tokio::test]
async fn a_cleanup_pods_answer_becomes_the_jobs_event_then_the_pod_and_the_finalizer_go() {
    cleaned_by_pod(
        "{\"deleted\":5}",
        "OutputsDeleted",
        "deleted 5 objects under /outputs/j",
    )
    .await;
    cleaned_by_pod(
        "{\"kept\":\"the manifest under /outputs/j was written for another job\"}",
        "OutputsKept",
        "another job",
    )
    .await;
}
