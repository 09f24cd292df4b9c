//! The operator binary: parse flags, set up tracing, run the controller.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use harvest_operator::{LeaderElection, OperatorConfig, Settings};

/// Runs HarvestJobs on Kubernetes.
#[derive(Debug, Parser)]
struct Cli {
    /// The catalogue and limits (YAML or JSON).
    #[arg(long, env = "HARVEST_OPERATOR_CONFIG")]
    config: PathBuf,
    /// Where to serve /metrics and /healthz.
    #[arg(long, env = "HARVEST_METRICS_ADDR", default_value = "0.0.0.0:9090")]
    metrics_addr: SocketAddr,
    /// The namespace of the leader Lease; without it the operator runs without election.
    #[arg(long, env = "HARVEST_LEASE_NAMESPACE")]
    lease_namespace: Option<String>,
    /// The harvester image of every catalogue entry that names none (the manifests set it from
    /// the ConfigMap key `workerImage`, which kustomize's `images:` retags).
    #[arg(long, env = "HARVEST_WORKER_IMAGE")]
    worker_image: Option<String>,
    /// How long the leader Lease lasts without renewal; the leader gives up after two thirds
    /// of it without a successful renewal. Longer rides out a longer apiserver outage (an
    /// upgrade); shorter hands over sooner when the leader's node is lost.
    #[arg(long, env = "HARVEST_LEASE_SECONDS", default_value_t = 15, value_parser = clap::value_parser!(u64).range(3..=3600))]
    lease_seconds: u64,
    /// This replica's identity (its Pod name).
    #[arg(long, env = "POD_NAME", default_value = "harvest-operator")]
    identity: String,
}

/// How often the configuration file is read again for changes.
const CONFIG_POLL: Duration = Duration::from_secs(10);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        // Colour only for a person at a terminal, not in log files or a Pod's log.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .init();
    let cli = Cli::parse();
    // The configuration, and beside it the ConfigMap's `workerImage` key (mounted from the same
    // ConfigMap), which reaches this process as HARVEST_WORKER_IMAGE at container start.
    let watched: Vec<(PathBuf, Vec<u8>)> = [
        Some(cli.config.clone()),
        cli.config.parent().map(|dir| dir.join("workerImage")),
    ]
    .into_iter()
    .flatten()
    .filter_map(|path| Some((path.clone(), std::fs::read(&path).ok()?)))
    .collect();
    let config = OperatorConfig::load(&cli.config, cli.worker_image.clone())?;
    if !config.unknown_keys.is_empty() {
        tracing::warn!(
            keys = ?config.unknown_keys,
            path = %cli.config.display(),
            "the configuration has keys this release does not know (a newer release's, or misspelt); they are ignored"
        );
    }
    let client = kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API (in-cluster or KUBECONFIG)")?;
    let settings = Settings {
        config,
        metrics_addr: Some(cli.metrics_addr),
        leader: cli.lease_namespace.map(|namespace| LeaderElection {
            namespace,
            lease: "harvest-operator".into(),
            identity: cli.identity.clone(),
            duration: Duration::from_secs(cli.lease_seconds),
        }),
        instance: cli.identity,
    };
    // SIGTERM is how Kubernetes stops the Pod; SIGINT a person at a terminal.
    let config_path = cli.config.clone();
    let shutdown = async move {
        let terminate = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut signal) => {
                    signal.recv().await;
                }
                Err(error) => {
                    tracing::warn!(%error, "cannot watch for SIGTERM; only SIGINT stops the operator");
                    std::future::pending::<()>().await;
                }
            }
        };
        // An edited ConfigMap reaches the mounted file, not this process: stop, and the
        // kubelet starts the container again on the new configuration.
        let edited = harvest_operator::config::changed(watched, CONFIG_POLL);
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            () = terminate => {}
            () = edited => tracing::info!(
                path = %config_path.display(),
                "the configuration changed; stopping so that the container restarts with it"
            ),
        }
        tracing::info!("stopping: finishing the reconciles in flight, then releasing the Lease");
    };
    harvest_operator::run(client, settings, shutdown).await?;
    Ok(())
}
