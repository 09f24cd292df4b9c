//! The `harvest-api` binary: serve the REST API (embedded or Kubernetes backend, as the
//! configuration says), and create and revoke API keys.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use harvest_api::config::ServerConfig;
use harvest_api::server;

#[derive(Debug, Parser)]
#[command(version, about = "The harvest REST API")]
struct Cli {
    /// The configuration file (models, accounts, data directory).
    #[arg(long, env = "HARVEST_CONFIG")]
    config: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the API.
    Serve {
        /// Address to listen on.
        #[arg(long, env = "HARVEST_LISTEN", default_value = "127.0.0.1:8080")]
        listen: String,
    },
    /// Create an API key for an account; the key is printed once and stored hashed.
    CreateKey {
        /// The account (from the configuration).
        #[arg(long)]
        account: String,
        /// A label to recognise the key by.
        #[arg(long, default_value = "")]
        label: String,
    },
    /// Revoke an API key.
    RevokeKey {
        /// The key.
        key: String,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let config = ServerConfig::from_file(&cli.config)
        .with_context(|| format!("reading {}", cli.config.display()))?;
    match cli.command {
        Command::Serve { listen } => {
            let state = server::build(&config).await?;
            let listener = tokio::net::TcpListener::bind(&listen)
                .await
                .with_context(|| format!("listening on {listen}"))?;
            tracing::info!(address = %listener.local_addr()?, "serving");
            server::serve(state, listener, stop_requested()).await?;
        }
        Command::CreateKey { account, label } if let Some(kubernetes) = &config.kubernetes => {
            let client = kube_client().await?;
            let key = harvest_api::kubernetes::create_key(
                client,
                &kubernetes.namespace,
                &account,
                &label,
            )
            .await?;
            use std::io::Write;
            writeln!(std::io::stdout(), "{key}")?;
        }
        Command::RevokeKey { key } if let Some(kubernetes) = &config.kubernetes => {
            let client = kube_client().await?;
            if !harvest_api::kubernetes::revoke_key(client, &kubernetes.namespace, &key).await? {
                anyhow::bail!("no such active key");
            }
        }
        Command::CreateKey { account, label } => {
            let store = server::open_store(&config)?;
            let now = harvest_api::paths::now();
            for a in &config.accounts {
                store.upsert_account(&a.name, &a.limits, now)?;
            }
            let key = store
                .create_key(&account, &label, now)
                .with_context(|| format!("account {account}"))?;
            use std::io::Write;
            writeln!(std::io::stdout(), "{key}")?;
        }
        Command::RevokeKey { key } => {
            let store = server::open_store(&config)?;
            if !store.revoke_key(&key, harvest_api::paths::now())? {
                anyhow::bail!("no such active key");
            }
        }
    }
    Ok(())
}

/// Resolves on SIGINT or SIGTERM (what Kubernetes and systemd send to stop a process).
async fn stop_requested() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(error) => {
                tracing::warn!(%error, "cannot watch for SIGTERM; only SIGINT stops the server");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = terminate => {}
    }
    tracing::info!("stopping: finishing open requests");
}

/// The cluster client from the kubeconfig or the Pod's service account.
async fn kube_client() -> anyhow::Result<kube::Client> {
    kube::Client::try_default()
        .await
        .context("kubernetes client")
}
