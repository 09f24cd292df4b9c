//! The test cluster: the fake apiserver with its kubelet running the real harvester on
//! SmolLM2, the CRDs, an account paying for namespace `default`, and the operator as a task that can be killed and restarted.
#![allow(clippy::unwrap_used, dead_code)]

use harvest_testkit::SETTLE_WITHIN;
use std::path::PathBuf;
use std::time::Duration;

use harvest_crds::{
    HarvestAccount, HarvestAccountSpec, HarvestAccountStatus, HarvestJob, HarvestJobSpec,
    HarvestOptions,
};
use harvest_fake_apiserver::{FakeApiServer, KubeletConfig};
use harvest_operator::{OperatorConfig, Settings};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use tokio::sync::oneshot;

const IMAGE: &str = "harvest/harvester:test";
/// The HarvestAccount that pays for namespace `default`.
pub const ACCOUNT: &str = "default-acct";
/// A model whose image the kubelet cannot pull: its Pods wait in `ErrImagePull`.
pub const UNPULLABLE: &str = "unpullable";
/// SmolLM2 again, with at most 2 worker Pods at once over every job (`maxPods`).
pub const CAPPED: &str = "smollm2-capped";
/// SmolLM2 again, its workers mounting the PersistentVolumeClaim [`OUTPUTS_CLAIM`] at
/// [`OUTPUTS_MOUNT`]: outputs there are on a volume the operator does not mount.
pub const ON_VOLUME: &str = "smollm2-on-volume";
/// See [`ON_VOLUME`].
pub const OUTPUTS_CLAIM: &str = "harvest-outputs";
/// See [`ON_VOLUME`]: a path that exists only inside the workers.
pub const OUTPUTS_MOUNT: &str = "/harvest-outputs";
/// Where the REST API creates its jobs.
pub const API_NAMESPACE: &str = "harvest-api";

use harvest_testkit::{harvester, smollm2};

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
    /// The operator's `workerNamespace`, if set.
    worker_namespace: Option<String>,
}

impl Cluster {
    pub async fn start(small_lane: u32) -> Self {
        // The operator's log, shown with a failing test's output (HARVEST_TEST_LOG filters it).
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_env("HARVEST_TEST_LOG")
                    .unwrap_or_else(|_| "harvest_operator=info".into()),
            )
            .with_test_writer()
            .try_init();
        let dir = tempfile::tempdir().unwrap();
        let kubelet = KubeletConfig {
            images: [(IMAGE.to_owned(), harvester())].into(),
            env: vec![("HARVEST_THREADS".into(), "1".into())],
            work_dir: dir.path().to_owned(),
            ..KubeletConfig::default()
        };
        let server = FakeApiServer::start(kubelet).await.unwrap();
        let client = Client::try_from(kube::Config::new(server.url().parse().unwrap())).unwrap();
        let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
        for crd in harvest_crds::all_crds() {
            crds.create(&PostParams::default(), &crd).await.unwrap();
        }
        create_worker_account(&client, "default").await;
        // Generous account lanes: the cluster lane is what these tests exercise.
        let mut spec = HarvestAccountSpec::for_namespaces(&["default"]);
        spec.lanes.small = 8;
        Api::<HarvestAccount>::all(client.clone())
            .create(&PostParams::default(), &HarvestAccount::new(ACCOUNT, spec))
            .await
            .unwrap();
        let mut cluster = Self {
            server,
            client,
            dir,
            operator: None,
            lanes: small_lane,
            worker_namespace: None,
        };
        cluster.start_operator();
        cluster
    }

    /// Restarts the operator with every worker in namespace `namespace`, which gets the
    /// worker ServiceAccount (and nothing is added to the tenants' namespaces).
    pub async fn run_workers_in(&mut self, namespace: &str) {
        self.kill_operator().await;
        let object: k8s_openapi::api::core::v1::Namespace =
            serde_json::from_value(json!({"metadata": {"name": namespace}})).unwrap();
        Api::<k8s_openapi::api::core::v1::Namespace>::all(self.client.clone())
            .create(&PostParams::default(), &object)
            .await
            .unwrap();
        create_worker_account(&self.client, namespace).await;
        self.worker_namespace = Some(namespace.to_owned());
        self.start_operator();
    }

    pub fn config(&self) -> OperatorConfig {
        let workers = self
            .worker_namespace
            .as_ref()
            .map(|ns| format!("workerNamespace: {ns}\n"))
            .unwrap_or_default();
        OperatorConfig::parse(&format!(
            "models:\n- {{name: smollm2-135m, path: {}, numLayers: 30, hiddenSize: 576, lane: small, image: {IMAGE}, maxParallelism: 4}}\n- {{name: {CAPPED}, path: {}, numLayers: 30, hiddenSize: 576, lane: small, image: {IMAGE}, maxParallelism: 4, maxPods: 2}}\n- {{name: {UNPULLABLE}, path: {}, numLayers: 30, hiddenSize: 576, lane: small, image: harvest/harvester:absent}}\n- {{name: {ON_VOLUME}, path: {}, numLayers: 30, hiddenSize: 576, lane: small, image: {IMAGE}, volumes: [{{name: outputs, persistentVolumeClaim: {{claimName: {OUTPUTS_CLAIM}}}}}], volumeMounts: [{{name: outputs, mountPath: {OUTPUTS_MOUNT}}}]}}\nlanes: {{small: {}, large: 1}}\napiNamespace: {API_NAMESPACE}\nretryBaseSeconds: 1\nadmissionPollSeconds: 1\nprogressRefreshSeconds: 1\ncleanupTimeoutSeconds: 10\nworkerSweepSeconds: 1\npodLostAfterSeconds: 2\n{workers}",
            smollm2().display(),
            smollm2().display(),
            smollm2().display(),
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

    /// Starts a replica that elects a leader through the Lease `default/harvest-operator`
    /// (held 2 s unless renewed) before it does anything.
    pub fn spawn_replica(
        &self,
        identity: &str,
    ) -> tokio::task::JoinHandle<harvest_operator::Result<()>> {
        self.spawn_replica_until(identity, std::future::pending())
    }

    /// A replica that stops cleanly once `shutdown` resolves.
    pub fn spawn_replica_until(
        &self,
        identity: &str,
        shutdown: impl Future<Output = ()> + Send + Sync + 'static,
    ) -> tokio::task::JoinHandle<harvest_operator::Result<()>> {
        self.spawn_replica_serving(identity, None, shutdown)
    }

    /// A replica serving its health and metrics on `metrics_addr`.
    pub fn spawn_replica_serving(
        &self,
        identity: &str,
        metrics_addr: Option<std::net::SocketAddr>,
        shutdown: impl Future<Output = ()> + Send + Sync + 'static,
    ) -> tokio::task::JoinHandle<harvest_operator::Result<()>> {
        let settings = Settings {
            config: self.config(),
            metrics_addr,
            leader: Some(harvest_operator::LeaderElection {
                namespace: "default".into(),
                lease: "harvest-operator".into(),
                identity: identity.into(),
                duration: Duration::from_secs(2),
            }),
            instance: identity.into(),
        };
        tokio::spawn(harvest_operator::run(
            self.client.clone(),
            settings,
            shutdown,
        ))
    }

    /// The identity holding the operator's Lease.
    pub fn leader(&self) -> Option<String> {
        self.server
            .get(
                "/apis/coordination.k8s.io/v1",
                "leases",
                "default",
                "harvest-operator",
            )
            .and_then(|l| l["spec"]["holderIdentity"].as_str().map(str::to_owned))
    }

    /// Stops the operator as a crash would: the task is dropped mid-flight.
    pub async fn kill_operator(&mut self) {
        if let Some((_, task)) = self.operator.take() {
            task.abort();
            let _ = task.await;
        }
    }

    /// The account that pays for namespace `default`.
    pub async fn account(&self) -> HarvestAccount {
        Api::<HarvestAccount>::all(self.client.clone())
            .get(ACCOUNT)
            .await
            .unwrap()
    }

    /// Waits until the account's books satisfy `done` (they settle just after jobs finish).
    pub async fn account_until(
        &self,
        done: impl Fn(&HarvestAccountStatus) -> bool,
    ) -> HarvestAccountStatus {
        harvest_testkit::eventually("the account's books", SETTLE_WITHIN, || async {
            // An operator that died (a panic in a reconcile) can settle nothing: say so at once.
            if let Some((_, task)) = &self.operator {
                assert!(
                    !task.is_finished(),
                    "the operator stopped while the books were awaited"
                );
            }
            let status = self.account().await.status_or_default();
            if done(&status) {
                Ok(status)
            } else {
                Err(format!("{status:?}"))
            }
        })
        .await
    }

    pub fn jobs(&self) -> Api<HarvestJob> {
        Api::namespaced(self.client.clone(), "default")
    }

    /// Changes the account's limits (a merge patch of the spec, as `kubectl patch` does, so the
    /// operator's concurrent status writes cannot make it conflict), and waits until the
    /// operator says it has read them: a job submitted sooner could be judged by the old ones.
    pub async fn set_account(&self, change: impl FnOnce(&mut HarvestAccountSpec)) {
        let api = Api::<HarvestAccount>::all(self.client.clone());
        let mut spec = api.get(ACCOUNT).await.unwrap().spec;
        change(&mut spec);
        let patch = json!({ "spec": spec });
        let patched = api
            .patch(ACCOUNT, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
        if self.operator.is_some() {
            let generation = patched.metadata.generation;
            self.account_until(|status| status.observed_generation >= generation)
                .await;
        }
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
            harvest: HarvestOptions {
                shard_size: 4,
                ..HarvestOptions::default()
            },
            ..HarvestJobSpec::new(
                "smollm2-135m",
                prompts,
                self.output(name).display().to_string(),
                100_000,
            )
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

/// The worker ServiceAccount the operator's Pods name (admission refuses Pods without it).
pub async fn create_worker_account(client: &Client, namespace: &str) {
    let account: k8s_openapi::api::core::v1::ServiceAccount = serde_json::from_value(json!({
        "metadata": {"name": "harvest-worker", "namespace": namespace}}))
    .unwrap();
    Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &account)
        .await
        .unwrap();
}
