//! Assembling and running the server: load the catalogue and the link secret, then one backend
//! (embedded: open the store, sync accounts from the configuration, requeue jobs a previous run
//! left unfinished; Kubernetes: start the watch caches), then serve until shutdown.

use std::sync::Arc;

use tokio::net::TcpListener;

use crate::app::{AppState, metrics_router, router_serving};
use crate::backend::JobBackend;
use crate::catalogue::Catalogue;
use crate::config::{KubernetesConfig, ServerConfig};
use crate::embedded::store::Store;
use crate::embedded::workers::{WorkerConfig, Workers};
use crate::embedded::{EmbeddedBackend, StoragePolicy};
pub use crate::error::StartupError;
use crate::kubernetes::KubeBackend;
use crate::paths::now;
use crate::signing::{Links, Signer};
use crate::storage::Storage;

/// Opens the store at the configured data directory (the database created readable by its
/// owner only) with its accounts as the configuration lists them: accounts no longer listed
/// are disabled, and their keys get 401.
pub fn open_store(config: &ServerConfig) -> Result<Arc<Store>, StartupError> {
    std::fs::create_dir_all(&config.data_dir)?;
    let path = config.data_dir.join("harvest.sqlite");
    crate::paths::create_private(&path)?;
    let store = Store::open(&path)?;
    let accounts: Vec<_> = config
        .accounts
        .iter()
        .map(|a| (a.name.clone(), a.limits.clone()))
        .collect();
    store.sync_accounts(&accounts, now())?;
    Ok(Arc::new(store))
}

/// Builds the application state: on Kubernetes, the watch-backed caches; embedded, the store,
/// with unfinished jobs requeued (their harvesters resume from the shards already written).
/// Must run inside a Tokio runtime.
pub async fn build(config: &ServerConfig) -> Result<Arc<AppState>, StartupError> {
    std::fs::create_dir_all(&config.data_dir)?;
    if crate::paths::readable_by_others(&config.data_dir) {
        tracing::warn!(
            data_dir = %config.data_dir.display(),
            "the data directory is readable by other users, and it holds every job's prompts and activations: chmod 700 it"
        );
    }
    let catalogue = Catalogue::load(&config.models)?;
    // Several replicas share one link secret, from the data directory (a Secret volume).
    let signer = Signer::load_or_create(&config.data_dir.join("link-secret"))?;
    let links = Links {
        signer: signer.clone(),
        public_url: config.public_url.clone(),
    };
    let backend: Arc<dyn JobBackend> = match &config.kubernetes {
        Some(kubernetes) => Arc::new(build_kubernetes(config, kubernetes, links).await?),
        None => {
            let gpus =
                crate::embedded::gpus::detect(&config.harvester, config.worker_gpus.as_deref())
                    .await;
            Arc::new(build_embedded(config, links, gpus)?)
        }
    };
    Ok(AppState::new(
        backend,
        catalogue,
        signer,
        config.url_ttl_seconds as i64,
        config.data_dir.clone(),
        std::time::Duration::from_secs_f64(config.count_timeout_seconds),
        config.rate_limit,
    ))
}

fn build_embedded(
    config: &ServerConfig,
    links: Links,
    gpus: Vec<u32>,
) -> Result<EmbeddedBackend, StartupError> {
    let store = open_store(config)?;
    let worker_config = WorkerConfig {
        harvester: config.harvester.clone(),
        data_dir: config.data_dir.clone(),
        threads: config.worker_threads,
        deadline: config
            .job_timeout_seconds
            .map(std::time::Duration::from_secs),
        attempts: config.worker_attempts,
        gpus,
        stages: config
            .models
            .iter()
            .filter(|model| model.devices > 1)
            .map(|model| (model.name.clone(), model.devices as usize))
            .collect(),
    };
    remove_orphan_files(&store, &config.data_dir)?;
    let pool = Workers::new(Arc::clone(&store), worker_config, config.max_workers);
    for job in store.unfinished_jobs()? {
        tracing::info!(job = %job.id, status = job.status.as_str(), "requeueing a job left unfinished");
        pool.stop_orphans(&job.id);
        pool.enqueue(job.id);
    }
    let storage = StoragePolicy {
        min_free_bytes: config.min_free_bytes,
        budgets: config
            .accounts
            .iter()
            .filter_map(|a| Some((a.name.clone(), a.storage_bytes?)))
            .collect(),
        retention: config
            .retention_days
            .map(|days| std::time::Duration::from_secs_f64(days * 86_400.0)),
        sweep_every: std::time::Duration::from_secs(config.sweep_interval_seconds),
    };
    let backend = EmbeddedBackend::new(
        store,
        pool,
        config.data_dir.clone(),
        links,
        std::time::Duration::from_secs(config.shutdown_grace_seconds),
        storage,
    );
    backend.start_sweeper();
    Ok(backend)
}

/// Deletes job folders without a job record: the inputs of a submit that a crash stopped before
/// its job was admitted. No file outlives its job.
fn remove_orphan_files(store: &Store, data_dir: &std::path::Path) -> Result<(), StartupError> {
    let Ok(entries) = std::fs::read_dir(data_dir.join("jobs")) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let Some(id) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        if store.job(&id)?.is_none() {
            tracing::warn!(job = %id, "deleting the files of a job that was never admitted");
            std::fs::remove_dir_all(entry.path())?;
        }
    }
    Ok(())
}

async fn build_kubernetes(
    config: &ServerConfig,
    kubernetes: &KubernetesConfig,
    links: Links,
) -> Result<KubeBackend, StartupError> {
    let storage = Storage::open(
        &kubernetes.storage,
        &config.data_dir,
        config.url_ttl_seconds,
        |name| std::env::var(name).ok(),
    )?;
    let client = kube::Client::try_default()
        .await
        .map_err(|e| StartupError::config(format!("kubernetes client: {e}")))?;
    Ok(KubeBackend::start(
        client,
        kubernetes.namespace.clone(),
        kubernetes.keys_namespace().to_owned(),
        storage,
        links,
        config.data_dir.clone(),
    ))
}

/// Longest a client may take to send a request's headers.
pub const HEADER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// Most connections served at once; more are closed at accept.
pub const MAX_CONNECTIONS: usize = 1024;
/// Longest the requests in flight may take to finish once the server stops.
pub const DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Serves until `shutdown` completes, each connection with a header timeout, at most
/// [`MAX_CONNECTIONS`] at once. Then it stops accepting, answers the open long-polls at once,
/// lets the requests in flight finish (within [`DRAIN_TIMEOUT`]), and stops the backend's
/// workers (their jobs resume at the next start).
pub async fn serve(
    state: Arc<AppState>,
    listener: TcpListener,
    metrics: Option<TcpListener>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), StartupError> {
    let app = router_serving(Arc::clone(&state), metrics.is_none());
    // `/metrics` on a port of its own, when given one: it lives as long as the server.
    let metrics = metrics.map(|listener| {
        let router = metrics_router(Arc::clone(&state));
        tokio::spawn(async move {
            if let Err(error) = axum::serve(listener, router).await {
                tracing::warn!(%error, "the metrics port stopped");
            }
        })
    });
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let connections = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(error) => {
                // Out of file descriptors, say: wait a moment rather than spin.
                tracing::warn!(%error, "accepting a connection failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = Arc::clone(&connections).try_acquire_owned() else {
            tracing::warn!(
                limit = MAX_CONNECTIONS,
                "too many connections; closing a new one"
            );
            continue;
        };
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(HEADER_TIMEOUT);
        let connection = builder.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            let _ = connection.await;
            drop(permit);
        });
    }
    drop(listener);
    state.begin_stop();
    if tokio::time::timeout(DRAIN_TIMEOUT, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("requests still open after the drain timeout; stopping anyway");
    }
    state.backend.shutdown().await;
    if let Some(task) = metrics {
        task.abort();
    }
    Ok(())
}
