//! `harvest-operator`: the Kubernetes controller that runs `HarvestJob`s.
//!
//! Each reconcile ([`reconcile`]) runs four steps, one folder each: [`finalize`] (a deleted
//! job's workers and outputs; the finalizers and output a job needs first), [`observe`] (reads
//! only: the job's Pods, progress, the admission verdict), [`decide`] (pure: the status, the
//! actions, and the bookkeeping of what applying them came to) and [`apply`] (the actions in
//! order). Jobs are admitted into lanes in creation order, one Pod per attempt, the result read
//! from the Pod's termination message, what the infrastructure broke retried, and what a TTL
//! or a finalizer says deleted. It never depends on axum or cudarc.
//!
//! ```text
//! watch HarvestJobs + owned Pods ─► finalize ─► observe ─► decide (pure) ─► apply: Pods,
//!        ▲                             (reads)    admission (pure queue)    status (resourceVersion),
//!        └──── status, Events ◄──────────────────────────────────────────── Events, TTL delete
//! ```
#![forbid(unsafe_code)]

pub mod accounts;
pub mod apply;
pub mod config;
pub mod context;
pub mod decide;
pub mod error;
pub mod finalize;
#[cfg(test)]
mod fixtures;
pub mod holds;
pub mod leader;
pub mod ledger;
pub mod metrics;
pub mod observe;
pub mod pod;
pub mod reconcile;
mod shell;
pub mod slots;
pub mod sweep;

use std::collections::HashSet;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use harvest_crds::{HarvestAccount, HarvestJob};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::Controller;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Api, Client};
use tracing::{info, warn};

pub use config::OperatorConfig;
pub use error::{Error, Result};

/// Where the leader Lease lives and who this replica is.
#[derive(Debug, Clone)]
pub struct LeaderElection {
    /// The Lease's namespace.
    pub namespace: String,
    /// The Lease's name.
    pub lease: String,
    /// This replica (its Pod name).
    pub identity: String,
    /// How long a hold lasts unless renewed.
    pub duration: Duration,
}

/// Everything `run` needs besides the client.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Catalogue and limits.
    pub config: OperatorConfig,
    /// Where to serve `/metrics` and `/healthz`.
    pub metrics_addr: Option<SocketAddr>,
    /// Leader election; `None` runs without (one replica only).
    pub leader: Option<LeaderElection>,
    /// The reporter name on Events.
    pub instance: String,
}

/// How long a stopping replica waits for the reconciles in flight before it stops without
/// them, well inside the Pod's 30 s termination grace so it still releases its Lease.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(15);

/// Runs the controller until `shutdown` resolves or leadership is lost.
pub async fn run(
    client: Client,
    settings: Settings,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) -> Result<()> {
    let controller = job_controller(&client, settings.config.worker_namespace.as_deref());
    let jobs = controller.store();
    let account_controller = account_controller(&client, settings.config.api_namespace.clone());
    let metrics = metrics::Metrics::default();
    let election = settings
        .leader
        .as_ref()
        .map_or_else(leader::Election::alone, |l| {
            leader::Election::new(l.duration)
        });
    // Health and metrics come up before the election, so a follower is Ready too.
    let metrics_task = match settings.metrics_addr {
        Some(addr) => Some(serve_metrics(addr, &metrics, &jobs, &election).await?),
        None => None,
    };
    let leadership = elect(&client, settings.leader.as_ref(), election).await;
    let context = Arc::new(reconcile::Context {
        client: client.clone(),
        config: settings.config,
        recorder: recorder(&client, &settings.instance),
        metrics,
        jobs,
        accounts: account_controller.store(),
        admitting: Mutex::new(HashSet::new()),
        pod_grants: Mutex::new(context::PodGrants::default()),
    });
    info!("controller started");
    let sweeping = worker_sweep(&client, &context);
    let shutdown = futures::FutureExt::shared(Box::pin(shutdown));
    let jobs_running = controller
        .graceful_shutdown_on(shutdown.clone())
        .run(
            reconcile::reconcile,
            reconcile::error_policy,
            Arc::clone(&context),
        )
        .for_each(log_watch_failure);
    let accounts_running = account_controller
        .graceful_shutdown_on(shutdown.clone())
        .run(
            ledger::reconcile_account,
            ledger::account_error_policy,
            context,
        )
        .for_each(log_watch_failure);
    let running = drain_within_grace(
        async {
            futures::join!(jobs_running, accounts_running);
        },
        sweeping,
        shutdown,
    );
    let outcome = match leadership {
        Some(leadership) => {
            tokio::select! {
                () = running => {
                    leadership.release().await;
                    Ok(())
                }
                lost = leadership.keep() => Err(lost),
            }
        }
        None => {
            running.await;
            Ok(())
        }
    };
    if let Some(task) = metrics_task {
        task.abort();
    }
    outcome
}

/// Logs a watch's failure, once, where the controller hands it over (reconcile errors are
/// logged by their error policies). A watch answered 410 Gone lists again on its own.
fn log_watch_failure<K, E>(
    result: Result<K, kube::runtime::controller::Error<E, watcher::Error>>,
) -> futures::future::Ready<()>
where
    E: std::error::Error + 'static,
{
    if let Err(kube::runtime::controller::Error::QueueError(error)) = result {
        warn!(%error, "a watch failed; it starts again from a fresh list");
    }
    futures::future::ready(())
}

/// Events as this replica (`instance`) of the operator publishes them.
fn recorder(client: &Client, instance: &str) -> Recorder {
    let reporter = Reporter {
        controller: "harvest-operator".into(),
        instance: Some(instance.to_owned()),
    };
    Recorder::new(client.clone(), reporter)
}

/// The sweep of the worker namespace for workers whose job is gone; pending forever without a
/// worker namespace (owner references then let the garbage collector do it).
fn worker_sweep(client: &Client, context: &reconcile::Context) -> impl Future<Output = ()> + use<> {
    let jobs = context.jobs.clone();
    let every = Duration::from_secs(context.config.worker_sweep_seconds);
    let workers = context
        .config
        .worker_namespace
        .as_deref()
        .map(|namespace| Api::<Pod>::namespaced(client.clone(), namespace));
    async move {
        match workers {
            Some(pods) => sweep::sweep_forever(pods, jobs, every).await,
            None => std::future::pending().await,
        }
    }
}

/// Runs `controllers` (and `background`, which never ends, beside them) until they have
/// drained after `shutdown`, or for [`SHUTDOWN_GRACE`] past it, whichever comes first.
async fn drain_within_grace(
    controllers: impl Future<Output = ()>,
    background: impl Future<Output = ()>,
    shutdown: impl Future<Output = ()>,
) {
    let overdue = async {
        shutdown.await;
        tokio::time::sleep(SHUTDOWN_GRACE).await;
    };
    tokio::select! {
        () = controllers => {}
        () = background => {}
        () = overdue => warn!(
            grace_seconds = SHUTDOWN_GRACE.as_secs(),
            "reconciles still running past the shutdown grace; stopping without them"
        ),
    }
}

/// Waits for the Lease when replicas elect a leader; `None` when they do not.
async fn elect(
    client: &Client,
    leader: Option<&LeaderElection>,
    election: leader::Election,
) -> Option<leader::Leadership> {
    let leader = leader?;
    let api = Api::<Lease>::namespaced(client.clone(), &leader.namespace);
    Some(
        leader::Leadership::acquire(
            api,
            &leader.lease,
            &leader.identity,
            leader.duration,
            election,
        )
        .await,
    )
}

/// The job controller: every HarvestJob, and the worker Pods this operator labels as its own:
/// those in `worker_namespace` (found by the job they name), or else everywhere (found by
/// their owner reference).
fn job_controller(client: &Client, worker_namespace: Option<&str>) -> Controller<HarvestJob> {
    let (managed_key, managed_value) = pod::MANAGED_BY;
    let managed = watcher::Config::default().labels(&format!("{managed_key}={managed_value}"));
    let controller = Controller::new(
        Api::<HarvestJob>::all(client.clone()),
        watcher::Config::default().any_semantic(),
    );
    let Some(namespace) = worker_namespace else {
        return controller.owns(Api::<Pod>::all(client.clone()), managed);
    };
    controller.watches(
        Api::<Pod>::namespaced(client.clone(), namespace),
        managed,
        |pod: Pod| {
            let annotations = pod.metadata.annotations.unwrap_or_default();
            let namespace = annotations.get(pod::JOB_NAMESPACE_ANNOTATION)?;
            let name = annotations.get(pod::JOB_NAME_ANNOTATION)?;
            Some(ObjectRef::new(name).within(namespace))
        },
    )
}

/// The account controller: every HarvestAccount, woken by a change of any job it pays for
/// (one that finished, or started waiting).
fn account_controller(
    client: &Client,
    api_namespace: Option<String>,
) -> Controller<HarvestAccount> {
    let controller = Controller::new(
        Api::<HarvestAccount>::all(client.clone()),
        watcher::Config::default().any_semantic(),
    );
    let accounts = controller.store();
    controller.watches(
        Api::<HarvestJob>::all(client.clone()),
        watcher::Config::default().any_semantic(),
        move |job: HarvestJob| {
            let charged = job.status.as_ref().and_then(|s| s.account.clone());
            let payer = charged.or_else(|| {
                accounts::bind(&job, &accounts.state(), api_namespace.as_deref())
                    .ok()
                    .map(|b| b.account)
            });
            payer.map(|name| ObjectRef::new(&name))
        },
    )
}

/// Serves `/metrics` on `addr` in a task of its own.
async fn serve_metrics(
    addr: SocketAddr,
    metrics: &metrics::Metrics,
    jobs: &kube::runtime::reflector::Store<HarvestJob>,
    election: &leader::Election,
) -> Result<tokio::task::JoinHandle<()>> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| Error::Config {
            path: "--metrics-addr".into(),
            reason: format!("cannot listen on {addr}: {e}"),
        })?;
    Ok(tokio::spawn(metrics::serve(
        listener,
        metrics.clone(),
        jobs.clone(),
        election.clone(),
    )))
}
