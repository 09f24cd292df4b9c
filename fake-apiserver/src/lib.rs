//! A stateful fake Kubernetes API server with a fake kubelet, on loopback, for tests only.
//!
//! It implements what harvest relies on: discovery (legacy, not aggregated); get, list and watch
//! with resourceVersion; create, replace, delete; merge, JSON, strategic (as merge) and apply
//! patches; the status subresource and generation bumps; 409 on a stale resourceVersion;
//! deletionTimestamp with finalizers and ownerReference garbage collection; CRDs that register
//! their kinds (short names, categories, printer columns served as `Table`s for kubectl);
//! admission of Pods (ServiceAccounts, Pod Security "restricted"), RBAC for ServiceAccount
//! tokens, and metadata validation. A scheduler and kubelet run each Pod as a local process
//! with its env, volumes and probes; controllers run Deployments and Services. What it
//! enforces and where it differs from a real cluster is in `DIVERGENCES.md`; the
//! `harvest-test-cluster` binary is what `scripts/cluster.sh` starts.
//!
//! ```text
//! kube client / kubectl ──HTTP──► http (axum) ─ rbac ─► store (objects, history, rv)
//!                                                  admission ┘   │ events
//!                          ┌─────────────────────────────────────┤
//!                          ▼                                     ▼
//!  controllers: Deployment → Pods, Service → proxy    kubelet: schedule → launch → probe
//! ```

pub mod admission;
pub mod agent;
pub mod balancer;
pub mod controllers;
pub mod error;
pub mod http;
pub mod kinds;
pub mod kubelet;
pub mod launch;
pub mod node_api;
pub mod rbac;
pub mod schema;
pub mod store;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

pub use kubelet::KubeletConfig;
pub use store::Store;

/// A running fake apiserver.
#[derive(Debug)]
pub struct FakeApiServer {
    /// Its address.
    pub addr: SocketAddr,
    /// Its state.
    pub store: Arc<Store>,
    kubelet: Arc<kubelet::Kubelet>,
    server: tokio::task::JoinHandle<()>,
    controllers: tokio::task::JoinHandle<()>,
}

impl FakeApiServer {
    /// Starts a server on a free loopback port, with a kubelet that runs Pods per `kubelet`.
    pub async fn start(kubelet: KubeletConfig) -> std::io::Result<Self> {
        Self::start_on(kubelet, "127.0.0.1:0".parse().expect("a literal address")).await
    }

    /// Starts a server on `addr`.
    pub async fn start_on(kubelet: KubeletConfig, addr: SocketAddr) -> std::io::Result<Self> {
        let store = Arc::new(Store::new());
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let app = http::router(store.clone(), kubelet.work_dir.clone());
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        let kubelet = kubelet::Kubelet::start(store.clone(), kubelet, addr);
        let controllers = controllers::start(store.clone());
        Ok(Self {
            addr,
            store,
            kubelet,
            server,
            controllers,
        })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Writes a kubeconfig for this server (for kubectl) and returns its path.
    pub fn write_kubeconfig(&self, dir: &Path) -> std::io::Result<PathBuf> {
        let path = dir.join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: default\ncurrent-context: fake\nusers:\n- name: fake\n  user:\n    token: fake\n",
            self.url()
        );
        std::fs::write(&path, text)?;
        Ok(path)
    }

    /// Kills a running Pod's process as the kernel's OOM killer would (exit 137, `OOMKilled`).
    pub fn oom_kill(&self, namespace: &str, pod: &str) -> bool {
        self.kubelet
            .signal(namespace, pod, kubelet::Injected::OomKill)
    }

    /// Evicts a running Pod as node-pressure eviction would (phase Failed, reason `Evicted`).
    pub fn evict(&self, namespace: &str, pod: &str) -> bool {
        self.kubelet
            .signal(namespace, pod, kubelet::Injected::Evict)
    }

    /// One object, by API path prefix (`/apis/harvest.dev/v1alpha1`), plural, namespace, name.
    pub fn get(&self, api: &str, plural: &str, namespace: &str, name: &str) -> Option<Value> {
        self.store
            .get(&store::ResourceKey::new(api, plural), namespace, name)
    }

    /// How many processes the kubelet has started, per Pod name.
    pub fn started_pods(&self) -> HashMap<String, u32> {
        self.kubelet.started()
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.server.abort();
        self.controllers.abort();
        self.kubelet.shutdown();
    }
}
