//! `harvest-node-agent`: one node of a real (or any) apiserver, whose Pods run as local
//! processes (or, with `--engine`, in their images through a Docker engine); with `--services-kubeconfig`, also the cluster's Service load balancer. Runs
//! until SIGTERM or SIGINT. `scripts/cluster.sh up --real` starts one per node.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;
use harvest_fake_apiserver::KubeletConfig;
use harvest_fake_apiserver::agent::{self, NodeSpec};
use harvest_fake_apiserver::kubelet::key_value;

/// A node whose Pods run as local processes.
#[derive(Debug, Parser)]
struct Cli {
    /// Credentials for `system:node:NAME`.
    #[arg(long, requires = "node")]
    kubeconfig: Option<PathBuf>,
    /// The node's name; without one the agent only serves Services.
    #[arg(long, requires = "kubeconfig")]
    node: Option<String>,
    /// `nvidia.com/gpu` the node advertises (a GPU node is labelled and tainted).
    #[arg(long, default_value_t = 0)]
    gpus: u64,
    /// CPU cores the node advertises.
    #[arg(long, default_value_t = 16)]
    cpus: u64,
    /// Memory the node advertises, in GiB.
    #[arg(long, default_value_t = 64)]
    memory_gib: u64,
    /// Where Pod directories and logs go.
    #[arg(long)]
    dir: PathBuf,
    /// Run containers in their images with this `docker` command (`DOCKER_HOST` names the
    /// engine); `--image` then maps a Pod's image to a local image.
    #[arg(long)]
    engine: Option<PathBuf>,
    /// `IMAGE=EXECUTABLE` (or `IMAGE=LOCAL_IMAGE` with `--engine`): what runs for an image
    /// (repeatable).
    #[arg(long = "image", value_parser = key_value)]
    images: Vec<(String, String)>,
    /// `NAMESPACE/CLAIM=DIRECTORY` backing a PersistentVolumeClaim; `*` for every namespace.
    #[arg(long = "claim", value_parser = key_value)]
    claims: Vec<(String, String)>,
    /// `NAME=VALUE` added to every container's environment (repeatable).
    #[arg(long = "env", value_parser = key_value)]
    env: Vec<(String, String)>,
    /// The node's kubelet API serving certificate (PEM), so the apiserver can proxy
    /// `pods/log` to it.
    #[arg(long, requires = "serving_key")]
    serving_cert: Option<PathBuf>,
    /// Its key (PEM).
    #[arg(long, requires = "serving_cert")]
    serving_key: Option<PathBuf>,
    /// Serve Services too, with these (admin) credentials; ports are written under --dir/services.
    #[arg(long)]
    services_kubeconfig: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    std::fs::create_dir_all(&cli.dir).with_context(|| format!("creating {}", cli.dir.display()))?;
    let mut kubelet = KubeletConfig::from_flags(cli.images, cli.env, cli.claims, cli.dir.clone());
    kubelet.engine = cli
        .engine
        .map(|docker| harvest_fake_apiserver::kubelet::Engine {
            docker,
            host: std::env::var("DOCKER_HOST").ok(),
        });
    let balancer = async {
        match &cli.services_kubeconfig {
            Some(path) => {
                let client = agent::client(path).await?;
                harvest_fake_apiserver::balancer::run(client, cli.dir.join("services")).await?;
                Ok(())
            }
            None => std::future::pending::<anyhow::Result<()>>().await,
        }
    };
    let node = async {
        match (&cli.kubeconfig, cli.node.clone()) {
            (Some(kubeconfig), Some(name)) => {
                let spec = NodeSpec {
                    name,
                    gpus: cli.gpus,
                    cpus: cli.cpus,
                    memory_gib: cli.memory_gib,
                    serving: cli.serving_cert.clone().zip(cli.serving_key.clone()),
                };
                agent::run(kubeconfig, spec, kubelet).await?;
                Ok(())
            }
            _ => std::future::pending::<anyhow::Result<()>>().await,
        }
    };
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        ran = balancer => ran.context("serving Services")?,
        ran = node => ran.context("running the node")?,
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
    Ok(())
}
