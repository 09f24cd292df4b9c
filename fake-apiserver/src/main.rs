//! `harvest-test-cluster`: the fake apiserver, kubelet and controllers as a process on
//! loopback, for `scripts/cluster.sh`. It writes `DIR/kubeconfig` once it serves, and runs
//! until SIGTERM or SIGINT.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;
use harvest_fake_apiserver::kubelet::key_value;
use harvest_fake_apiserver::{FakeApiServer, KubeletConfig};

/// A Kubernetes stand-in on this machine: Pods run as local processes.
#[derive(Debug, Parser)]
struct Cli {
    /// Where the kubeconfig, Pod directories and logs go.
    #[arg(long)]
    dir: PathBuf,
    /// The apiserver's address.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: std::net::SocketAddr,
    /// `IMAGE=EXECUTABLE`: what the kubelet runs for an image (repeatable).
    #[arg(long = "image", value_parser = key_value)]
    images: Vec<(String, String)>,
    /// `NAMESPACE/CLAIM=DIRECTORY`: a PersistentVolumeClaim's backing directory; `*` for every
    /// namespace (repeatable).
    #[arg(long = "claim", value_parser = key_value)]
    claims: Vec<(String, String)>,
    /// `NAME=VALUE` added to every container's environment (repeatable).
    #[arg(long = "env", value_parser = key_value)]
    env: Vec<(String, String)>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    std::fs::create_dir_all(&cli.dir).with_context(|| format!("creating {}", cli.dir.display()))?;
    let config = KubeletConfig::from_flags(cli.images, cli.env, cli.claims, cli.dir.clone());
    let server = FakeApiServer::start_on(config, cli.listen)
        .await
        .with_context(|| format!("listening on {}", cli.listen))?;
    // Written last, so that its presence means the server answers.
    let kubeconfig = server.write_kubeconfig(&cli.dir)?;
    let line = format!(
        "serving {} (KUBECONFIG={})\n",
        server.url(),
        kubeconfig.display()
    );
    std::io::Write::write_all(&mut std::io::stdout(), line.as_bytes())?;
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
    drop(server);
    // The Pods' processes get SIGTERM and a grace period.
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    Ok(())
}
