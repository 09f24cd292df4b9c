//! The real controller against the stateful fake apiserver, whose fake kubelet runs the real
//! `harvester` on SmolLM2: jobs end Finished with shards on disk, and cancel, an OOM kill, a
//! deadline, a TTL, bad input and an operator restart all end the way a user expects.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use harvest_crds::{
    HarvestJob, HarvestJobSpec, HarvestOptions, InputRef, JobPhase, OutputRetention,
};
use harvest_fake_apiserver::{FakeApiServer, KubeletConfig};
use harvest_operator::{OperatorConfig, Settings};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use tokio::sync::oneshot;

const IMAGE: &str = "harvest/harvester:test";

fn cache() -> PathBuf {
    std::env::var_os("HARVEST_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/harvest"))
}

fn smollm2() -> PathBuf {
    let dir = cache().join("models/smollm2-135m");
    assert!(
        dir.join("model.safetensors").exists(),
        "{} is missing: run scripts/fetch-model.sh",
        dir.display()
    );
    dir
}

/// The harvester binary built beside this test (`cargo test --workspace` builds it).
fn harvester() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe.parent().unwrap().parent().unwrap().join("harvester");
    assert!(
        path.exists(),
        "{} is missing: run cargo build -p harvester (scripts/test.sh does)",
        path.display()
    );
    path
}

#[allow(missing_debug_implementations)]
pub struct Cluster {
    pub server: FakeApiServer,
    pub client: Client,
    pub dir: tempfile::TempDir,
    #[allow(dead_code)]
    operator: Option<(
        oneshot::Sender<()>,
        tokio::task::JoinHandle<harvest_operator::Result<()>>,
    )>,
    lanes: u32,
}

impl Cluster {
    pub async fn start(small_lane: u32) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let kubelet = KubeletConfig {
            images: [(IMAGE.to_owned(), harvester())].into(),
            env: vec![("HARVEST_THREADS".into(), "1".into())],
            work_dir: dir.path().to_owned(),
        };
        let server = FakeApiServer::start(kubelet).await.unwrap();
        let client = Client::try_from(kube::Config::new(server.url().parse().unwrap())).unwrap();
        let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
        for crd in harvest_crds::all_crds() {
            crds.create(&PostParams::default(), &crd).await.unwrap();
        }
        let mut cluster = Self {
            server,
            client,
            dir,
            operator: None,
            lanes: small_lane,
        };
        cluster.start_operator();
        cluster
    }

    pub fn config(&self) -> OperatorConfig {
        OperatorConfig::parse(&format!(
            "models:\n- {{name: smollm2-135m, path: {}, numLayers: 30, lane: small, image: {IMAGE}}}\nlanes: {{small: {}, large: 1}}\nretryBaseSeconds: 1\nadmissionPollSeconds: 1\ncleanupTimeoutSeconds: 10\n",
            smollm2().display(),
            self.lanes
        ))
        .unwrap()
    }

    pub fn start_operator(&mut self) {
        let (tx, rx) = oneshot::channel();
        let settings = Settings {
            config: self.config(),
            metrics_addr: None,
            leader: None,
            instance: "test".into(),
        };
        let task = tokio::spawn(harvest_operator::run(
            self.client.clone(),
            settings,
            async {
                let _ = rx.await;
            },
        ));
        self.operator = Some((tx, task));
    }

    /// Stops the operator as a crash would: the task is dropped mid-flight.
    pub async fn kill_operator(&mut self) {
        if let Some((_, task)) = self.operator.take() {
            task.abort();
            let _ = task.await;
        }
    }

    pub fn jobs(&self) -> Api<HarvestJob> {
        Api::namespaced(self.client.clone(), "default")
    }

    pub fn prompts(&self, name: &str, count: usize, words: usize) -> String {
        let path = self.dir.path().join(format!("{name}.jsonl"));
        let text: String = (0..count)
            .map(|i| format!("{}\n", json!({"text": format!("Prompt {i}: {}", "the quick brown fox jumps over the lazy dog ".repeat(words))})))
            .collect();
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    }

    pub fn output(&self, name: &str) -> PathBuf {
        self.dir.path().join("out").join(name)
    }

    pub async fn submit(
        &self,
        name: &str,
        prompts: String,
        change: impl FnOnce(&mut HarvestJobSpec),
    ) -> HarvestJob {
        let mut spec = HarvestJobSpec {
            model: "smollm2-135m".into(),
            input: InputRef {
                prompts,
                directions: None,
            },
            harvest: HarvestOptions {
                shard_size: 4,
                ..HarvestOptions::default()
            },
            output: self.output(name).display().to_string(),
            token_budget: 100_000,
            suspend: false,
            cancel: false,
            active_deadline_seconds: None,
            backoff_limit: 3,
            ttl_seconds_after_finished: None,
            output_retention: OutputRetention::Retain,
        };
        change(&mut spec);
        self.jobs()
            .create(&PostParams::default(), &HarvestJob::new(name, spec))
            .await
            .unwrap()
    }

    pub async fn wait(
        &self,
        name: &str,
        what: &str,
        done: impl Fn(&HarvestJob) -> bool,
    ) -> HarvestJob {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(240);
        loop {
            if let Some(job) = self.jobs().get_opt(name).await.unwrap()
                && done(&job)
            {
                return job;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {name}: {what}; last: {:?}",
                self.jobs()
                    .get_opt(name)
                    .await
                    .unwrap()
                    .and_then(|j| j.status)
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    pub async fn finished(&self, name: &str) -> HarvestJob {
        self.wait(name, "Finished", |j| {
            j.status
                .as_ref()
                .is_some_and(|s| harvest_crds::conditions::is_true(&s.conditions, "Finished"))
        })
        .await
    }

    /// Waits until the job's current Pod runs, and returns its name.
    pub async fn running_pod(&self, name: &str) -> String {
        let job = self
            .wait(name, "its Pod running", |j| {
                j.status
                    .as_ref()
                    .and_then(|s| s.pod.clone())
                    .is_some_and(|pod| {
                        self.server
                            .get("/api/v1", "pods", "default", &pod)
                            .is_some_and(|p| p["status"]["phase"] == "Running")
                    })
            })
            .await;
        job.status.unwrap().pod.unwrap()
    }
}

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

fn manifest(output: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(output.join("manifest.json")).unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_queue_in_their_lane_and_finish_succeeded_with_shards_and_a_charge() {
    let cluster = Cluster::start(1).await;
    let prompts = cluster.prompts("seed", 6, 2);
    cluster.submit("first", prompts.clone(), |_| {}).await;
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
    for name in ["first", "second"] {
        let job = cluster.finished(name).await;
        let status = job.status.clone().unwrap();
        assert_eq!(finished_reason(&job), "Succeeded", "{status:?}");
        assert_eq!(status.phase, Some(JobPhase::Succeeded));
        let result = status.result.unwrap();
        assert_eq!((result.n_shards, result.prompts), (2, 6));
        assert_eq!(
            status.tokens.unwrap().charged,
            Some(result.tokens),
            "charged what ran"
        );
        assert_eq!(status.attempts, 1);
        let manifest = manifest(&cluster.output(name));
        assert_eq!(manifest["n_prompts"], 6);
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
    assert_eq!(
        (started.get("default/oom-1"), started.get("default/oom-2")),
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
    let status = job.status.unwrap();
    assert_eq!(status.attempts, 1);
    assert_eq!(
        cluster.server.started_pods().get("default/restarted-1"),
        Some(&1),
        "the harvest ran once"
    );
    assert_eq!(
        status.tokens.unwrap().charged,
        Some(status.result.unwrap().tokens)
    );
}
