//! Assembling and running the embedded server: open the store, load the catalogue, sync accounts
//! from the configuration, requeue jobs a previous run left unfinished, then serve.

use std::sync::Arc;

use tokio::net::TcpListener;

use crate::app::{AppState, Backend, router};
use crate::catalogue::Catalogue;
use crate::config::{KubernetesConfig, ServerConfig};
use crate::kubernetes::KubeBackend;
use crate::signing::Signer;
use crate::storage::Storage;
use crate::store::Store;
use crate::workers::{self, WorkerConfig, Workers};

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    /// The configuration or a model of the catalogue is unusable.
    #[error("{0}")]
    Config(String),
    /// The store could not be opened.
    #[error("store: {0}")]
    Store(#[from] crate::store::StoreError),
    /// A file or socket failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl StartupError {
    /// Shorthand for [`StartupError::Config`].
    pub fn config(message: impl Into<String>) -> Self {
        Self::Config(message.into())
    }
}

/// Opens the store at the configured data directory.
pub fn open_store(config: &ServerConfig) -> Result<Arc<Store>, StartupError> {
    std::fs::create_dir_all(&config.data_dir)?;
    Ok(Arc::new(Store::open(
        &config.data_dir.join("harvest.sqlite"),
    )?))
}

/// Builds the application state: on Kubernetes, the watch-backed caches; embedded, the store,
/// with unfinished jobs requeued (their harvesters resume from the shards already written).
/// Must run inside a Tokio runtime.
pub async fn build(config: &ServerConfig) -> Result<Arc<AppState>, StartupError> {
    if let Some(kubernetes) = &config.kubernetes {
        return build_kubernetes(config, kubernetes).await;
    }
    let store = open_store(config)?;
    let now = workers::now();
    for account in &config.accounts {
        store.upsert_account(&account.name, &account.limits, now)?;
    }
    let catalogue =
        Catalogue::load(&config.models).map_err(|e| StartupError::Config(e.to_string()))?;
    let signer = Signer::load_or_create(&config.data_dir.join("link-secret"))?;
    let worker_config = WorkerConfig {
        harvester: config.harvester.clone(),
        data_dir: config.data_dir.clone(),
        threads: config.worker_threads,
    };
    let pool = Workers::new(Arc::clone(&store), worker_config, config.max_workers);
    for job in store.unfinished_jobs()? {
        tracing::info!(job = %job.id, status = job.status.as_str(), "requeueing a job left unfinished");
        pool.stop_orphans(&job.id);
        pool.enqueue(job.id);
    }
    Ok(AppState::new(
        store,
        catalogue,
        pool,
        signer,
        config.public_url.clone(),
        config.url_ttl_seconds as i64,
        config.data_dir.clone(),
    ))
}

async fn build_kubernetes(
    config: &ServerConfig,
    kubernetes: &KubernetesConfig,
) -> Result<Arc<AppState>, StartupError> {
    std::fs::create_dir_all(&config.data_dir)?;
    let catalogue =
        Catalogue::load(&config.models).map_err(|e| StartupError::Config(e.to_string()))?;
    let storage = Storage::open(
        &kubernetes.storage,
        &config.data_dir,
        config.url_ttl_seconds,
        |name| std::env::var(name).ok(),
    )?;
    let client = kube::Client::try_default()
        .await
        .map_err(|e| StartupError::config(format!("kubernetes client: {e}")))?;
    let backend = KubeBackend::start(client, kubernetes.namespace.clone(), storage);
    // Several replicas share one link secret, from the data directory (a Secret volume).
    let signer = Signer::load_or_create(&config.data_dir.join("link-secret"))?;
    Ok(AppState::with_backend(
        Backend::Kubernetes(Box::new(backend)),
        catalogue,
        signer,
        config.public_url.clone(),
        config.url_ttl_seconds as i64,
        config.data_dir.clone(),
    ))
}

/// Serves until the listener fails or the process is stopped.
pub async fn serve(state: Arc<AppState>, listener: TcpListener) -> Result<(), StartupError> {
    axum::serve(listener, router(state)).await?;
    Ok(())
}
