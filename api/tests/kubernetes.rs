//! The same black-box REST suite against the Kubernetes backend: the `harvest-api` binary
//! talks to the fake apiserver, the real operator admits and runs each HarvestJob as a Pod,
//! whose fake kubelet runs the real `harvester` on SmolLM2. Storage is `local` (a directory
//! shared by the API and the workers), so links are signed and served by the API.
//! Also: two API replicas at once, one killed mid-job; budget exhaustion that gives REST a 429
//! and makes a job applied with kubectl wait.

#![allow(clippy::unwrap_used)]

mod suite;

use harvest_testkit::SETTLE_WITHIN;
use std::path::{Path, PathBuf};
use std::time::Duration;

use harvest_crds::conditions::{self, ADMITTED};
use harvest_crds::{HarvestAccount, HarvestAccountSpec, HarvestJob, HarvestJobSpec};
use harvest_fake_apiserver::{FakeApiServer, KubeletConfig};
use harvest_operator::{OperatorConfig, Settings};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use serde_json::json;
use suite::*;

const IMAGE: &str = "harvest/harvester:test";
const API_NAMESPACE: &str = "harvest-api";

struct Cluster {
    server: FakeApiServer,
    client: Client,
    kubeconfig: PathBuf,
    config: PathBuf,
    api_env: Vec<(String, String)>,
    operator: tokio::task::JoinHandle<harvest_operator::Result<()>>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.operator.abort();
    }
}

impl Cluster {
    fn env(&self) -> Vec<(&str, &str)> {
        let mut env = vec![("KUBECONFIG", self.kubeconfig.to_str().unwrap())];
        env.extend(self.api_env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        env
    }

    fn api(&self, port: u16) -> Server {
        start_with(&self.config, port, &self.env())
    }

    /// HarvestJob `id` of the API's namespace, as the apiserver has it.
    fn job(&self, id: &str) -> serde_json::Value {
        self.server
            .get(
                "/apis/harvest.dev/v1alpha1",
                "harvestjobs",
                API_NAMESPACE,
                id,
            )
            .unwrap()
    }

    fn key(&self, account: &str) -> String {
        create_key_with(&self.config, account, &self.env())
    }
}

async fn create_namespace(client: &Client, name: &str) {
    let namespace = Namespace {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    };
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .unwrap();
    // The worker ServiceAccount the operator's Pods name (admission refuses Pods without it).
    let account: k8s_openapi::api::core::v1::ServiceAccount = serde_json::from_value(json!({
        "metadata": {"name": "harvest-worker", "namespace": name}}))
    .unwrap();
    Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(client.clone(), name)
        .create(&PostParams::default(), &account)
        .await
        .unwrap();
}

/// The fake cluster with CRDs, two accounts (acme also pays for namespace `research`), the
/// operator, and an API configuration for the Kubernetes backend with local storage.
fn cluster(dir: &Path, port: u16) -> Cluster {
    cluster_with(dir, port, json!({"kind": "local"}), Vec::new(), Vec::new())
}

/// The same with other storage, extra worker environment and extra API environment.
fn cluster_with(
    dir: &Path,
    port: u16,
    storage: serde_json::Value,
    worker_env: Vec<(String, String)>,
    api_env: Vec<(String, String)>,
) -> Cluster {
    reqwest::runtime().block_on(async {
        let mut env = vec![("HARVEST_THREADS".to_owned(), "1".to_owned())];
        env.extend(worker_env);
        let kubelet = KubeletConfig {
            images: [(IMAGE.to_owned(), harvester())].into(),
            env,
            work_dir: dir.to_owned(),
            ..KubeletConfig::default()
        };
        let server = FakeApiServer::start(kubelet).await.unwrap();
        let client = Client::try_from(kube::Config::new(server.url().parse().unwrap())).unwrap();
        let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
        for crd in harvest_crds::all_crds() {
            crds.create(&PostParams::default(), &crd).await.unwrap();
        }
        create_namespace(&client, API_NAMESPACE).await;
        create_namespace(&client, "research").await;
        create_namespace(&client, "poor").await;
        let accounts: Api<HarvestAccount> = Api::all(client.clone());
        for (name, namespaces) in [
            ("acme", vec!["research"]),
            ("other", vec![]),
            ("broke", vec!["poor"]),
        ] {
            let mut spec = HarvestAccountSpec::for_namespaces(&namespaces);
            if name == "broke" {
                spec.daily_tokens = Some(10);
            }
            accounts
                .create(&PostParams::default(), &HarvestAccount::new(name, spec))
                .await
                .unwrap();
        }
        let config = OperatorConfig::parse(&format!(
            "models:\n- {{name: smollm2-135m, path: {}, numLayers: 30, hiddenSize: 576, lane: small, image: {IMAGE}, maxParallelism: 3}}\nlanes: {{small: 4, large: 1}}\napiNamespace: {API_NAMESPACE}\nretryBaseSeconds: 1\nadmissionPollSeconds: 1\nprogressRefreshSeconds: 1\n",
            smollm2().display()
        ))
        .unwrap();
        let settings = Settings {
            config,
            metrics_addr: None,
            leader: None,
            instance: "test".into(),
        };
        let operator = tokio::spawn(harvest_operator::run(
            client.clone(),
            settings,
            std::future::pending(),
        ));
        let kubeconfig = server.write_kubeconfig(dir).unwrap();
        let api_config = json!({
            "data_dir": dir.join("data"),
            "public_url": format!("http://127.0.0.1:{port}"),
            "models": [{"name": "smollm2-135m", "path": smollm2(), "lane": "small", "max_parallelism": 3}],
            "kubernetes": {"namespace": API_NAMESPACE, "storage": storage},
        });
        let config = dir.join("api.json");
        std::fs::write(&config, api_config.to_string()).unwrap();
        Cluster {
            server,
            client,
            kubeconfig,
            config,
            api_env,
            operator,
        }
    })
}

#[test]
fn the_seed_flow_on_kubernetes_long_polls_and_downloads_the_bytes_of_a_direct_run() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let cluster = cluster(dir.path(), port);
    let server = cluster.api(port);
    let key = cluster.key("acme");
    seed_flow(&server, &key, dir.path());
    let job: HarvestJob = reqwest::runtime().block_on(async {
        let jobs: Api<HarvestJob> = Api::namespaced(cluster.client.clone(), API_NAMESPACE);
        jobs.list(&Default::default())
            .await
            .unwrap()
            .items
            .remove(0)
    });
    assert_eq!(
        job.status.unwrap().account.as_deref(),
        Some("acme"),
        "charged to the key's account"
    );
}

#[test]
fn a_job_sent_in_parts_runs_as_part_pods_and_a_finalize_pod_and_downloads_the_bytes_of_one() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let cluster = cluster(dir.path(), port);
    let server = cluster.api(port);
    let key = cluster.key("acme");
    parts_flow(&server, &key, 3);
    let jobs: Vec<HarvestJob> = reqwest::runtime().block_on(async {
        let jobs: Api<HarvestJob> = Api::namespaced(cluster.client.clone(), API_NAMESPACE);
        jobs.list(&Default::default()).await.unwrap().items
    });
    assert!(
        jobs.iter()
            .all(|j| j.spec.harvest.max_prompt_tokens == Some(9)),
        "the option reaches the HarvestJob: {jobs:?}"
    );
    let parts: Vec<_> = jobs
        .iter()
        .filter_map(|j| j.status.clone())
        .filter(|s| s.parallelism == Some(3))
        .collect();
    assert_eq!(parts.len(), 1, "{jobs:?}");
    assert_eq!(parts[0].parts_summary.as_deref(), Some("3/3"));
    assert!(parts[0].pod.as_deref().unwrap().contains("-finalize-"));
}

#[test]
fn keys_unknown_jobs_the_account_lane_the_job_list_and_revocation_answer_on_kubernetes_as_the_contract_says()
 {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let cluster = cluster(dir.path(), port);
    let server = cluster.api(port);
    let key = cluster.key("other");
    lane_flow(&server, &key);
    list_flow(&server, &key, &cluster.key("acme"));
    revoke_flow(&server, &key, &cluster.env());
}

#[test]
fn the_key_commands_import_list_and_revoke_by_label_on_kubernetes() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let cluster = cluster(dir.path(), port);
    let server = cluster.api(port);
    key_admin_flow(&server, &cluster.env());
}

#[test]
fn with_s3_storage_the_files_download_through_presigned_urls_that_s3_verifies() {
    let s3 = harvest_testkit::Seaweed::start();
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let storage = json!({"kind": "s3", "bucket": harvest_testkit::BUCKET, "prefix": "api",
        "endpoint": s3.endpoint, "allow_http": true});
    let signing = vec![
        (
            "HARVEST_S3_ACCESS_KEY_ID".to_owned(),
            harvest_testkit::ACCESS_KEY.to_owned(),
        ),
        (
            "HARVEST_S3_SECRET_ACCESS_KEY".to_owned(),
            harvest_testkit::SECRET_KEY.to_owned(),
        ),
    ];
    let cluster = cluster_with(dir.path(), port, storage, s3.worker_env(), signing);
    let server = cluster.api(port);
    let key = cluster.key("acme");
    // Submit, long-poll, and download every file with a plain client: S3 checks each signature.
    let done = seed_flow(&server, &key, dir.path());
    let shard = done["result"]["shard_urls"][0].as_str().unwrap();
    assert!(
        shard.starts_with(&format!("{}/harvest/api/jobs/", s3.endpoint)),
        "{shard}"
    );
    assert!(shard.contains("X-Amz-Expires=604800"), "{shard}");
    let tampered = shard.replace("X-Amz-Signature=", "X-Amz-Signature=0");
    let refused = reqwest::runtime().block_on(async { ::reqwest::get(&tampered).await.unwrap() });
    assert_eq!(refused.status().as_u16(), 403, "a tampered link is refused");
    // A running job's finished shards, read from the bucket's records and presigned.
    let body = json!({"model": "smollm2-135m", "prompts": long_prompts(), "layers": "all", "shard_size": 4});
    let early = partial_flow(&server, &key, body);
    eprintln!("{early} of 6 shards read before the end");
    partial_refusals(&server, &key, done["job_id"].as_str().unwrap());
}

#[test]
fn a_submit_the_apiserver_refuses_is_a_503_with_a_failed_job_id_and_leaves_no_inputs_behind() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let cluster = cluster(dir.path(), port);
    let server = cluster.api(port);
    let key = cluster.key("acme");
    cluster.server.store.fail_next(
        "POST",
        &format!("/namespaces/{API_NAMESPACE}/harvestjobs"),
        1,
    );
    let (status, body) = request(
        "POST",
        &format!("{}/v1/harvest", server.base),
        &key,
        Some(json!({"model": "smollm2-135m", "prompts": SEED})),
    );
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (503, Some("harvest_unavailable")),
        "{body}"
    );
    assert_eq!(cluster.server.store.faults_pending(), 0);
    // The 503 quotes a job id, and the job reads as failed, charged nothing.
    let id = body["error"]["job_id"].as_str().unwrap();
    let (status, job) = request(
        "GET",
        &format!("{}/v1/harvest/{id}", server.base),
        &key,
        None,
    );
    assert_eq!(
        (status, job["status"].as_str()),
        (200, Some("failed")),
        "{job}"
    );
    let jobs = dir.path().join("data/jobs");
    let left: Vec<_> = std::fs::read_dir(&jobs)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "inputs left behind: {left:?}");
    // The next submit goes through.
    let (status, _) = request(
        "POST",
        &format!("{}/v1/harvest", server.base),
        &key,
        Some(json!({"model": "smollm2-135m", "prompts": SEED})),
    );
    assert_eq!(status, 202);
}

#[test]
fn cancelling_a_running_job_on_kubernetes_charges_the_reservation() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let cluster = cluster(dir.path(), port);
    let server = cluster.api(port);
    let key = cluster.key("acme");
    let other = cluster.key("other");
    let id = cancel_flow(&server, &key, &other, |_| true);
    let job = cluster.job(&id);
    let pod = job["status"]["pod"].as_str().unwrap().to_owned();
    assert_eq!(
        cluster
            .server
            .started_pods()
            .get(&format!("{API_NAMESPACE}/{pod}")),
        Some(&1),
        "the job's Pod {pod} ran"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while cluster
        .server
        .get("/api/v1", "pods", API_NAMESPACE, &pod)
        .is_some_and(|p| p["status"]["phase"] == "Running")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the cancelled job's Pod still runs"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn two_replicas_serve_one_queue_and_a_replica_killed_mid_job_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (port_a, port_b) = (free_port(), free_port());
    let cluster = cluster(dir.path(), port_a);
    let mut a = cluster.api(port_a);
    let b = cluster.api(port_b);
    let key = cluster.key("acme");
    let id = long_job(&a, &key);
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    // The worker's progress reaches the REST answer through the job's status.
    let running = wait_for(&b, &key, &id, |j| {
        j["status"] == "running" && j["progress"]["prompts_done"].as_u64().unwrap_or(0) > 0
    });
    assert_eq!(running["progress"]["prompts_total"], 24, "{running}");
    let (status, _) = request(
        "GET",
        &format!("{}/v1/harvest/{id}", b.base),
        "sk-hv-wrong",
        None,
    );
    assert_eq!(status, 401);
    let url = format!("{}/v1/harvest/{id}?wait=60", b.base);
    let mut done = json!(null);
    for _ in 0..5 {
        let (_, answer) = request("GET", &url, &key, None);
        if answer["status"] == "done" {
            done = answer;
            break;
        }
    }
    assert_eq!(done["status"], "done", "{done}");
    assert_eq!(done["result"]["n_shards"], 6);
    // The link was signed by replica B with the shared secret; the data came from the worker.
    let shard = reqwest::blocking_get(done["result"]["shard_urls"][5].as_str().unwrap());
    assert!(shard.is_err(), "replica A is gone, so its base URL is dead");
    let rebased = done["result"]["shard_urls"][5]
        .as_str()
        .unwrap()
        .replace(&a.base, &b.base);
    assert!(!reqwest::blocking_get(&rebased).unwrap().is_empty());
    let account = reqwest::runtime().block_on(async {
        let accounts: Api<HarvestAccount> = Api::all(cluster.client.clone());
        harvest_testkit::eventually("the hold to settle", SETTLE_WITHIN, || async {
            let account = accounts.get("acme").await.unwrap();
            if account.status.as_ref().is_some_and(|s| s.holds.is_empty()) {
                Ok(account)
            } else {
                Err(format!("{:?}", account.status))
            }
        })
        .await
    });
    let books = account.status.unwrap();
    assert_eq!(books.tokens_total, done["tokens"].as_u64().unwrap());
    drop(a);
}

#[test]
fn an_exhausted_budget_gives_rest_a_429_and_keeps_a_kubectl_job_waiting() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let cluster = cluster(dir.path(), port);
    let server = cluster.api(port);
    // The account "broke" has 10 tokens a day and pays for namespace "poor".
    let key = cluster.key("broke");
    let (status, denied) = request(
        "POST",
        &format!("{}/v1/harvest", server.base),
        &key,
        Some(json!({"model": "smollm2-135m", "prompts": SEED})),
    );
    assert_eq!(
        (status, denied["error"]["code"].as_str()),
        (429, Some("budget_exceeded")),
        "{denied}"
    );
    let job = reqwest::runtime().block_on(async {
        let jobs: Api<HarvestJob> = Api::namespaced(cluster.client.clone(), "poor");
        let spec = HarvestJobSpec::new("smollm2-135m", "/nowhere/p.jsonl", "/nowhere/out", 1_000);
        jobs.create(&PostParams::default(), &HarvestJob::new("gitops", spec))
            .await
            .unwrap();
        harvest_testkit::eventually("the operator to look at the job", SETTLE_WITHIN, || async {
            let job = jobs.get("gitops").await.unwrap();
            if job.status.is_some() {
                Ok(job)
            } else {
                Err("no status yet".to_owned())
            }
        })
        .await
    });
    let admitted = conditions::get(&job.status.unwrap().conditions, ADMITTED).cloned();
    assert_eq!(
        admitted.map(|c| c.reason),
        Some("DailyBudgetExhausted".to_owned())
    );
}

#[test]
fn junk_keys_and_unknown_job_ids_cost_the_apiserver_next_to_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let cluster = cluster(dir.path(), port);
    // The per-key rate limit would turn most of these into 429s before any lookup.
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&cluster.config).unwrap()).unwrap();
    config["rate_limit"] = serde_json::Value::Null;
    std::fs::write(&cluster.config, config.to_string()).unwrap();
    let server = cluster.api(port);
    let key = cluster.key("acme");
    let store = &cluster.server.store;
    let (secrets, jobs) = (
        store.requests("GET", "/secrets/"),
        store.requests("GET", "/harvestjobs/"),
    );
    let started = std::time::Instant::now();
    let unknown = |i: usize| format!("00000000-0000-4000-8000-{i:012x}");
    let url = |id: &str| format!("{}/v1/harvest/{id}", server.base);
    // A thousand distinct junk keys, then one junk key a thousand times.
    for i in 0..2000 {
        let junk = format!("sk-hv-junk{}", i.min(1000));
        let (status, _) = request("GET", &url(&unknown(0)), &junk, None);
        assert_eq!(status, 401);
    }
    // A real key asking for five hundred jobs that do not exist.
    for i in 0..500 {
        let (status, _) = request("GET", &url(&unknown(i)), &key, None);
        assert_eq!(status, 404);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let budget =
        (harvest_api::kubernetes::lookups::LIVE_LOOKUPS_PER_SECOND * (1.0 + elapsed)).ceil() as u64;
    let secret_gets = store.requests("GET", "/secrets/") - secrets;
    let job_gets = store.requests("GET", "/harvestjobs/") - jobs;
    println!(
        "{secret_gets} Secret and {job_gets} job lookups for 2,500 requests in {elapsed:.1} s"
    );
    assert!(
        secret_gets <= budget && job_gets <= budget,
        "{secret_gets} Secret and {job_gets} job lookups in {elapsed:.1} s (budget {budget})"
    );
    // The real key still works.
    let (status, _) = request("GET", &format!("{}/v1/harvest", server.base), &key, None);
    assert_eq!(status, 200);
}

/// The charge the contract gives a cancelled job: its reservation once a harvester had run,
/// nothing before.
fn cancel_charge(job: &serde_json::Value) -> u64 {
    if job["status"]["runningSince"].is_string() {
        job["status"]["tokens"]["reserved"].as_u64().unwrap()
    } else {
        0
    }
}

#[test]
fn fifty_submit_then_cancel_cycles_over_two_replicas_release_every_hold_and_charge_by_the_contract()
{
    let dir = tempfile::tempdir().unwrap();
    let (port_a, port_b) = (free_port(), free_port());
    let cluster = cluster(dir.path(), port_a);
    let a = cluster.api(port_a);
    let b = cluster.api(port_b);
    let key = cluster.key("acme");
    let body = json!({"model": "smollm2-135m", "prompts": SEED, "layers": [1]});
    let mut cancelled = Vec::new();
    for cycle in 0..50 {
        // Each job is submitted on one replica and cancelled on the other, and the next
        // submit follows at once: the account's small lane (3 slots) stays full unless every
        // cancel frees its slot before it answers.
        let (on, off) = if cycle % 2 == 0 { (&a, &b) } else { (&b, &a) };
        let id = submit_ok(on, &key, body.clone());
        let job = cancel_ok(off, &key, &id);
        cancelled.push((id, job["tokens"].as_u64().unwrap()));
    }
    let account = reqwest::runtime().block_on(async {
        let accounts: Api<HarvestAccount> = Api::all(cluster.client.clone());
        harvest_testkit::eventually("every hold to be released", SETTLE_WITHIN, || async {
            let account = accounts.get("acme").await.unwrap();
            match account.status.as_ref() {
                Some(s) if s.holds.is_empty() => Ok(account),
                other => Err(format!("{other:?}")),
            }
        })
        .await
    });
    let mut charged_total = 0;
    for (id, answered) in &cancelled {
        let job = cluster.job(id);
        let charged = job["status"]["tokens"]["charged"].as_u64().unwrap_or(0);
        assert_eq!(charged, cancel_charge(&job), "{job}");
        assert_eq!(
            *answered, charged,
            "the DELETE answered the charge that stuck: {job}"
        );
        assert_eq!(job["status"]["phase"], "Cancelled", "{job}");
        charged_total += charged;
    }
    let books = account.status.unwrap();
    assert_eq!(books.tokens_total, charged_total, "one charge per job");
    assert_eq!((books.active.small, books.active.large), (0, 0));
}

#[test]
fn with_the_operator_down_a_cancel_still_answers_cancelled_and_frees_the_slot_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let cluster = cluster(dir.path(), port);
    cluster.operator.abort();
    let server = cluster.api(port);
    let key = cluster.key("acme");
    let body = json!({"model": "smollm2-135m", "prompts": SEED, "layers": [1]});
    let url = format!("{}/v1/harvest", server.base);
    let ids: Vec<String> = (0..3)
        .map(|_| submit_ok(&server, &key, body.clone()))
        .collect();
    let (status, full) = request("POST", &url, &key, Some(body.clone()));
    assert_eq!(
        (status, full["error"]["code"].as_str()),
        (429, Some("harvest_concurrency_exceeded")),
        "{full}"
    );
    let (status, job) = request("DELETE", &format!("{url}/{}", ids[0]), &key, None);
    assert_eq!(
        (status, job["status"].as_str(), job["tokens"].as_u64()),
        (200, Some("cancelled"), Some(0)),
        "{job}"
    );
    submit_ok(&server, &key, body);
}

/// Sends every `(replica, key)` long-poll on job `id` at once; how many were declined.
fn declined_long_polls(waits: &[(&Server, &str)], id: &str) -> usize {
    std::thread::scope(|scope| {
        let polls: Vec<_> = waits
            .iter()
            .map(|(server, key)| {
                let url = format!("{}/v1/harvest/{id}?wait=10", server.base);
                scope.spawn(move || request_with_headers("GET", &url, key, None))
            })
            .collect();
        polls
            .into_iter()
            .map(|poll| poll.join().unwrap())
            .inspect(|(status, job, _)| assert_eq!(*status, 200, "{job}"))
            .filter(|(_, _, retry_after)| retry_after.is_some())
            .count()
    })
}

#[test]
fn nine_long_polls_spread_over_two_replicas_hold_the_limits_of_one_server() {
    let dir = tempfile::tempdir().unwrap();
    let (port_a, port_b) = (free_port(), free_port());
    let cluster = cluster(dir.path(), port_a);
    // With no operator the job stays pending, so every long-poll lasts its whole wait.
    cluster.operator.abort();
    let a = cluster.api(port_a);
    let b = cluster.api(port_b);
    let keys: Vec<String> = (0..3).map(|_| cluster.key("acme")).collect();
    let body = json!({"model": "smollm2-135m", "prompts": SEED, "layers": [1]});
    let id = submit_ok(&a, &keys[0], body);
    // Three keys, three long-polls each, alternating replicas: one past the eight overall.
    let spread: Vec<(&Server, &str)> = (0..9)
        .map(|i| (if i % 2 == 0 { &a } else { &b }, keys[i % 3].as_str()))
        .collect();
    assert_eq!(declined_long_polls(&spread, &id), 1);
    let lease = || {
        cluster.server.get(
            "/apis/coordination.k8s.io/v1",
            "leases",
            API_NAMESPACE,
            "harvest-api-limits",
        )
    };
    reqwest::runtime().block_on(harvest_testkit::eventually(
        "every permit to be given back",
        SETTLE_WITHIN,
        || async {
            let lease = lease().unwrap();
            let permits = &lease["metadata"]["annotations"]["harvest.dev/permits"];
            if permits == "{}" {
                Ok(())
            } else {
                Err(permits.to_string())
            }
        },
    ));
    // One key, five long-polls over both replicas: one past its four.
    let one_key: Vec<(&Server, &str)> = (0..5)
        .map(|i| (if i % 2 == 0 { &a } else { &b }, keys[0].as_str()))
        .collect();
    assert_eq!(declined_long_polls(&one_key, &id), 1);
}
