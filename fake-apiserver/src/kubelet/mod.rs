//! The fake kubelet and scheduler: places each new Pod on a node ([`schedule`]), resolves its
//! first container's environment and volumes ([`crate::launch`]), runs it as a local process
//! on its own loopback address, runs its probes (`probe`), restarts it per its
//! `restartPolicy`, and reports phase, conditions, container state and termination message.
//! Tests can inject an OOM kill or an eviction.

mod probe;
mod run;
pub mod schedule;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;

use crate::store::{ResourceKey, Store, rfc3339};

/// How the kubelet runs containers.
#[derive(Debug, Clone, Default)]
pub struct KubeletConfig {
    /// Image name → local executable. A Pod whose image is not here waits in `ErrImagePull`.
    pub images: HashMap<String, PathBuf>,
    /// Extra environment for every container (a real cluster would mount or inject these).
    pub env: Vec<(String, String)>,
    /// Where container logs, termination messages and Pod directories go.
    pub work_dir: PathBuf,
    /// PersistentVolumeClaims backed by a given local directory, by `namespace/name`; other
    /// claims get an empty directory under `work_dir`.
    pub claims: BTreeMap<String, PathBuf>,
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

/// What every Pod's task shares.
#[derive(Debug)]
struct Node {
    store: Arc<Store>,
    config: KubeletConfig,
    apiserver: SocketAddr,
    /// GPUs held per node, by Pod key, while a Pod is placed and not finished.
    placed: Mutex<HashMap<String, (String, u64)>>,
    /// The second octet of this cluster's Pod addresses (127.B.C.D), so clusters on one
    /// machine do not collide.
    network: u8,
    next_ip: AtomicU32,
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
    running: Mutex<HashMap<String, mpsc::Sender<Injected>>>,
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
        let kubelet = Arc::new(Self {
            running: Mutex::default(),
            started: Arc::default(),
            task: Mutex::default(),
        });
        let node = Arc::new(Node {
            store: store.clone(),
            config,
            apiserver,
            placed: Mutex::default(),
            network: 100 + (uuid::Uuid::new_v4().as_bytes()[0] % 150),
            next_ip: AtomicU32::new(0),
        });
        let this = kubelet.clone();
        let task = tokio::spawn(async move {
            let mut wake = store.subscribe();
            let mut last = 0;
            loop {
                for change in store.changes_since(&pods(), last) {
                    last = change.rv;
                    let pod = &change.object;
                    let key = format!(
                        "{}/{}",
                        pod["metadata"]["namespace"].as_str().unwrap_or_default(),
                        pod["metadata"]["name"].as_str().unwrap_or_default()
                    );
                    let gone = change.type_ == "DELETED"
                        || pod["metadata"]["deletionTimestamp"].is_string();
                    if gone {
                        this.send(&key, Injected::Delete);
                    } else if change.type_ == "ADDED" {
                        let (tx, rx) = mpsc::channel(4);
                        lock(&this.running).insert(key.clone(), tx);
                        let task = run::PodTask {
                            node: node.clone(),
                            pod: pod.clone(),
                            key,
                            started: this.started.clone(),
                        };
                        tokio::spawn(task.run(rx));
                    }
                }
                if wake.changed().await.is_err() {
                    return;
                }
            }
        });
        *lock(&kubelet.task) = Some(task);
        kubelet
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
