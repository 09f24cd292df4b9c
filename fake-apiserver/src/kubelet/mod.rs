//! The fake kubelet and scheduler: places each new Pod on a node ([`schedule`]), resolves its
//! first container's environment and volumes ([`crate::launch`]), runs it as a local process
//! on its own loopback address, runs its probes (`probe`), restarts it per its
//! `restartPolicy`, and reports phase, conditions, container state and termination message.
//! Tests can inject an OOM kill or an eviction.

mod probe;
pub mod remote;
mod run;
pub mod schedule;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::Value;
use tokio::sync::mpsc;

use crate::store::{ResourceKey, Store, rfc3339};

/// Commands queued for one Pod task (injected failures, deletion).
const COMMANDS: usize = 4;

/// How the kubelet runs containers.
#[derive(Debug, Clone, Default)]
pub struct KubeletConfig {
    /// Image name → local executable (or, with an [`Engine`], local image). A Pod whose image
    /// is not here waits in `ErrImagePull`.
    pub images: HashMap<String, PathBuf>,
    /// Extra environment for every container (a real cluster would mount or inject these).
    pub env: Vec<(String, String)>,
    /// Where container logs, termination messages and Pod directories go.
    pub work_dir: PathBuf,
    /// PersistentVolumeClaims backed by a given local directory, by `namespace/name`; other
    /// claims get an empty directory under `work_dir`.
    pub claims: BTreeMap<String, PathBuf>,
    /// When set, containers run in their images through this engine, and [`Self::images`]
    /// maps a Pod's image to a local image instead of an executable.
    pub engine: Option<Engine>,
}

/// A Docker engine that runs containers in their images, on the host's network (each Pod
/// binds its own loopback address, as a process does).
#[derive(Debug, Clone)]
pub struct Engine {
    /// The `docker` command.
    pub docker: PathBuf,
    /// `DOCKER_HOST` for it, when not the default socket.
    pub host: Option<String>,
}

impl KubeletConfig {
    /// From command-line pairs: `IMAGE=EXECUTABLE`, `NAME=VALUE` and `NAMESPACE/CLAIM=DIR`.
    pub fn from_flags(
        images: Vec<(String, String)>,
        env: Vec<(String, String)>,
        claims: Vec<(String, String)>,
        work_dir: PathBuf,
    ) -> Self {
        Self {
            images: images
                .into_iter()
                .map(|(k, v)| (k, PathBuf::from(v)))
                .collect(),
            env,
            work_dir,
            claims: claims
                .into_iter()
                .map(|(k, v)| (k, PathBuf::from(v)))
                .collect(),
            engine: None,
        }
    }
}

/// A `KEY=VALUE` command-line argument, split (clap's value parser for the pairs above).
pub fn key_value(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("{text:?} is not KEY=VALUE"))
}

/// A failure a test injects into a running Pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Injected {
    /// SIGKILL reported as `OOMKilled`, exit 137.
    OomKill,
    /// SIGKILL reported as a node-pressure eviction.
    Evict,
    /// The Pod was deleted: SIGTERM, then SIGKILL after a grace period; nothing is reported.
    Delete,
}

/// The cluster a kubelet serves: the fake's own store in this process, or an apiserver (a
/// real one, or the fake) reached over HTTP by a node agent.
#[derive(Debug, Clone)]
pub enum Link {
    /// The fake's store; the kubelet also schedules.
    Store(Arc<Store>),
    /// An apiserver whose scheduler binds Pods to this node.
    Remote(Arc<remote::Remote>),
}

/// Wakes a waiting Pod task when the cluster may have changed.
enum Wake {
    Store(tokio::sync::watch::Receiver<u64>),
    /// Nothing to subscribe to: the task's own one-second tick polls.
    Tick,
}

impl Wake {
    async fn changed(&mut self) {
        if let Self::Store(receiver) = self
            && receiver.changed().await.is_ok()
        {
            return;
        }
        std::future::pending::<()>().await;
    }
}

impl Link {
    fn set_status(&self, ns: &str, name: &str, status: Value) {
        match self {
            Self::Store(store) => {
                store.set_status(&pods(), ns, name, move |s| *s = status);
            }
            Self::Remote(remote) => remote.set_status(ns, name, status),
        }
    }

    fn wake(&self) -> Wake {
        match self {
            Self::Store(store) => Wake::Store(store.subscribe()),
            Self::Remote(_) => Wake::Tick,
        }
    }

    /// The ServiceAccount token the Pod's kube-api-access volume would hold, unless it opts
    /// out; why there is none yet as the error.
    async fn token(&self, pod: &Value) -> Result<Option<String>, String> {
        let ns = pod["metadata"]["namespace"].as_str().unwrap_or_default();
        let account = crate::admission::service_account(pod);
        let declared = pod["spec"]["automountServiceAccountToken"].as_bool();
        match self {
            Self::Store(store) => declared
                .or_else(|| {
                    store
                        .get(&ResourceKey::new("/api/v1", "serviceaccounts"), ns, account)
                        .and_then(|sa| sa["automountServiceAccountToken"].as_bool())
                })
                .unwrap_or(true)
                .then(|| store.issue_token(ns, account))
                .map_or(Ok(None), |token| Ok(Some(token))),
            Self::Remote(remote) => remote.token(pod, account, declared).await,
        }
    }
}

/// What every Pod's task shares.
#[derive(Debug)]
struct Node {
    link: Link,
    config: KubeletConfig,
    api: crate::launch::ApiAccess,
    /// GPUs held per node, by Pod key, while a Pod is placed and not finished.
    placed: Mutex<HashMap<String, (String, u64)>>,
    /// The second octet of this node's Pod addresses (127.B.C.D), so nodes and clusters on one
    /// machine do not collide.
    network: u8,
    /// Holds `network` for this node while it lives ([`claim_network`]).
    _claim: Option<std::net::TcpListener>,
    next_ip: AtomicU32,
}

/// The port a node binds on `127.B.0.1` to claim the octet `B` (no Pod is given `.0.1`).
const NETWORK_CLAIM_PORT: u16 = 64_999;

/// A second octet for a node's Pod addresses that no other node on this machine holds: a
/// random one whose claim (a listener on `127.B.0.1`) binds. Random alone let two clusters'
/// nodes pick the same octet (1 in 150 a pair), and their Pods' ports collided (found in CI:
/// an API replica in a crash loop on the address another cluster's operator held).
fn claim_network() -> (u8, Option<std::net::TcpListener>) {
    let random = || 100 + (uuid::Uuid::new_v4().as_bytes()[0] % 150);
    for _ in 0..64 {
        let network = random();
        let claim = std::net::TcpListener::bind((
            std::net::Ipv4Addr::new(127, network, 0, 1),
            NETWORK_CLAIM_PORT,
        ));
        if let Ok(claim) = claim {
            return (network, Some(claim));
        }
    }
    // Every try was taken (or loopback aliases do not bind here): unclaimed, as before.
    (random(), None)
}

impl Node {
    fn pod_ip(&self) -> String {
        let n = self.next_ip.fetch_add(1, Ordering::Relaxed);
        format!("127.{}.{}.{}", self.network, n / 250 % 256, n % 250 + 2)
    }
}

/// The kubelet.
#[derive(Debug)]
pub struct Kubelet {
    node: Arc<Node>,
    running: Mutex<HashMap<String, mpsc::Sender<Injected>>>,
    /// Each Pod task, until it ends.
    tasks: Mutex<HashMap<String, tokio::task::JoinHandle<()>>>,
    started: Arc<Mutex<HashMap<String, u32>>>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

fn pods() -> ResourceKey {
    ResourceKey::new("/api/v1", "pods")
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn stamp() -> String {
    rfc3339(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    )
}

impl Kubelet {
    /// Starts watching the store for Pods; `apiserver` is where Pods reach the API.
    pub fn start(store: Arc<Store>, config: KubeletConfig, apiserver: SocketAddr) -> Arc<Self> {
        let api = crate::launch::ApiAccess {
            addr: apiserver,
            scheme: "http",
            ca_file: None,
        };
        let kubelet = Self::new(Link::Store(store.clone()), config, api);
        let this = kubelet.clone();
        let task = tokio::spawn(async move {
            let mut wake = store.subscribe();
            let mut last = 0;
            loop {
                for change in store.changes_since(&pods(), last) {
                    last = change.rv;
                    this.observe(change.type_, &change.object);
                }
                if wake.changed().await.is_err() {
                    return;
                }
            }
        });
        *lock(&kubelet.task) = Some(task);
        kubelet
    }

    /// A kubelet whose Pods come from [`Kubelet::observe`].
    pub fn new(link: Link, config: KubeletConfig, api: crate::launch::ApiAccess) -> Arc<Self> {
        let (network, claim) = claim_network();
        Arc::new(Self {
            node: Arc::new(Node {
                link,
                config,
                api,
                placed: Mutex::default(),
                network,
                _claim: claim,
                next_ip: AtomicU32::new(0),
            }),
            running: Mutex::default(),
            tasks: Mutex::default(),
            started: Arc::default(),
            task: Mutex::default(),
        })
    }

    /// Acts on a Pod as a watch reported it (`ADDED`, `MODIFIED` or `DELETED`): starts a new
    /// one (an `ADDED` Pod always, a `MODIFIED` one if this kubelet has not seen it), and
    /// stops a deleted one.
    pub fn observe(&self, change: &str, pod: &Value) {
        let key = format!(
            "{}/{}",
            pod["metadata"]["namespace"].as_str().unwrap_or_default(),
            pod["metadata"]["name"].as_str().unwrap_or_default()
        );
        if change == "DELETED" || pod["metadata"]["deletionTimestamp"].is_string() {
            self.send(&key, Injected::Delete);
            lock(&self.running).remove(&key);
            return;
        }
        let finished = matches!(
            pod["status"]["phase"].as_str(),
            Some("Succeeded" | "Failed")
        );
        if change != "ADDED" && (finished || lock(&self.running).contains_key(&key)) {
            return;
        }
        let (tx, rx) = mpsc::channel(COMMANDS);
        lock(&self.running).insert(key.clone(), tx);
        let task = run::PodTask {
            node: self.node.clone(),
            pod: pod.clone(),
            key: key.clone(),
            started: self.started.clone(),
        };
        let mut tasks = lock(&self.tasks);
        tasks.retain(|_, task| !task.is_finished());
        tasks.insert(key, tokio::spawn(task.run(rx)));
    }

    /// Waits until the Pod's task has ended (at once if it has none).
    pub async fn finished(&self, namespace: &str, pod: &str) {
        let task = lock(&self.tasks).remove(&format!("{namespace}/{pod}"));
        if let Some(task) = task {
            let _ = task.await;
        }
    }

    fn send(&self, key: &str, what: Injected) -> bool {
        let sender = lock(&self.running).get(key).cloned();
        sender.is_some_and(|s| s.try_send(what).is_ok())
    }

    /// Injects a failure into a running Pod; false if it is not running.
    pub fn signal(&self, namespace: &str, pod: &str, what: Injected) -> bool {
        self.send(&format!("{namespace}/{pod}"), what)
    }

    /// Processes started, per `namespace/pod`.
    pub fn started(&self) -> HashMap<String, u32> {
        lock(&self.started).clone()
    }

    /// Stops watching and kills every running Pod.
    pub fn shutdown(&self) {
        if let Some(task) = lock(&self.task).take() {
            task.abort();
        }
        for sender in lock(&self.running).values() {
            let _ = sender.try_send(Injected::Delete);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::claim_network;

    #[test]
    fn nodes_on_one_machine_claim_different_address_octets() {
        // Twenty nodes at once: random octets alone would collide more often than not.
        let claims: Vec<_> = (0..20).map(|_| claim_network()).collect();
        assert!(claims.iter().all(|(_, claim)| claim.is_some()));
        let mut octets: Vec<u8> = claims.iter().map(|(octet, _)| *octet).collect();
        octets.sort_unstable();
        octets.dedup();
        assert_eq!(octets.len(), 20, "{octets:?}");
    }
}
