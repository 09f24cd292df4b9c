//! The `harvest-api` binary: serve the REST API (embedded or Kubernetes backend, as the
//! configuration says), and create, import, list and revoke API keys (`harvest_api::admin`).

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use harvest_api::config::ServerConfig;
use harvest_api::{admin, server};

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
        /// Serve /metrics on this address instead of on --listen (a port that only the
        /// cluster's scraper reaches, not the public API's).
        #[arg(long, env = "HARVEST_METRICS_LISTEN")]
        metrics_listen: Option<String>,
    },
    /// Create an API key for an account; the key is printed once and stored hashed.
    CreateKey {
        /// The account (from the configuration).
        #[arg(long)]
        account: String,
        /// A label to recognise the key by.
        #[arg(long, default_value = "")]
        label: String,
        /// Store this key instead of making one: a key of the hosted service (`sk-acs-…`), of
        /// its old platform (`acs-bm-…`) or of another harvest server (`sk-hv-…`). `-` reads it
        /// from standard input, which keeps it out of the process list.
        #[arg(long, value_name = "KEY")]
        import: Option<String>,
    },
    /// List the keys: account, label, first characters, when made and last used, state.
    ListKeys {
        /// Only this account's.
        #[arg(long)]
        account: Option<String>,
    },
    /// Revoke an API key, or every key with a label.
    RevokeKey {
        /// The key.
        #[arg(required_unless_present = "label", conflicts_with = "label")]
        key: Option<String>,
        /// Revoke every active key with this label instead.
        #[arg(long)]
        label: Option<String>,
        /// With --label: only this account's keys.
        #[arg(long, requires = "label")]
        account: Option<String>,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        // Colour only for a person at a terminal, not in log files or a Pod's log.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    let config = ServerConfig::from_file(&cli.config)
        .with_context(|| format!("reading {}", cli.config.display()))?;
    if !config.unknown_keys.is_empty() {
        tracing::warn!(
            keys = ?config.unknown_keys,
            path = %cli.config.display(),
            "the configuration has keys this release does not know (a newer release's, or misspelt); they are ignored"
        );
    }
    match cli.command {
        Command::Serve {
            listen,
            metrics_listen,
        } => {
            let state = server::build(&config).await?;
            let listener = tokio::net::TcpListener::bind(&listen)
                .await
                .with_context(|| format!("listening on {listen}"))?;
            let metrics = match &metrics_listen {
                Some(address) => Some(
                    tokio::net::TcpListener::bind(address)
                        .await
                        .with_context(|| format!("listening for /metrics on {address}"))?,
                ),
                None => None,
            };
            tracing::info!(address = %listener.local_addr()?, metrics = ?metrics_listen, "serving");
            server::serve(state, listener, metrics, stop_requested()).await?;
        }
        Command::CreateKey {
            account,
            label,
            import,
        } => {
            let import = match import.as_deref() {
                Some("-") => Some(std::io::read_to_string(std::io::stdin())?.trim().to_owned()),
                other => other.map(str::to_owned),
            };
            let key = admin::create_key(&config, &account, &label, import.as_deref())
                .await
                .with_context(|| format!("account {account}"))?;
            if import.is_none() {
                print_out(&format!("{key}\n"))?;
            }
        }
        Command::ListKeys { account } => {
            print_out(&admin::list_keys(&config, account.as_deref()).await?)?;
        }
        Command::RevokeKey {
            key,
            label,
            account,
        } => {
            let what = match (key, label) {
                (_, Some(label)) => admin::Revoke::Label { label, account },
                (Some(key), None) => admin::Revoke::Key(key),
                (None, None) => anyhow::bail!("give the key, or --label"),
            };
            let revoked = admin::revoke(&config, &what).await?;
            tracing::info!(revoked, "revoked");
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

fn print_out(text: &str) -> std::io::Result<()> {
    use std::io::Write;
    std::io::stdout().write_all(text.as_bytes())
}
