//! The node agent: the fake's kubelet serving a node of any apiserver over HTTPS (its client
//! side is [`crate::kubelet::remote`]), a real
//! kube-apiserver in the real test tier. It registers its Node (GPUs, taints, labels), renews
//! the node's Lease and Ready condition, runs the Pods the scheduler binds to it with the fake
//! kubelet ([`crate::kubelet`]), reports their status, and finishes their graceful deletion.
//! With `services`, it is also the cluster's load balancer: each Service port gets a loopback
//! listener that forwards to the ready endpoints of its EndpointSlices.
//!
//! It authenticates as `system:node:NAME`, so Node authorization and NodeRestriction hold it
//! to what a real kubelet may do. Stopping it (SIGSTOP) stops its heartbeats, as a node lost
//! from the network would, while its Pods' processes run on.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::watcher;
use serde_json::{Value, json};

use crate::kubelet::remote::Remote;
use crate::kubelet::{Kubelet, KubeletConfig, Link};
use crate::launch::ApiAccess;

/// How often the node renews its Lease; the node lifecycle controller marks it NotReady after
/// its grace period without one.
const LEASE_RENEW: Duration = Duration::from_secs(2);
/// How long a Lease lasts without renewal (a real kubelet's default).
const LEASE_SECONDS: i32 = 40;
/// How often the Ready condition's heartbeat is written.
const STATUS_HEARTBEAT: Duration = Duration::from_secs(5);
/// The version the node reports (the control plane's release).
const KUBELET_VERSION: &str = "v1.34.4";

/// Why the agent stopped.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The kubeconfig could not be read or used.
    #[error("kubeconfig {path}: {message}")]
    Kubeconfig {
        /// Its path.
        path: PathBuf,
        /// What was wrong.
        message: String,
    },
    /// The kubelet API could not be served.
    #[error(transparent)]
    Serve(#[from] crate::node_api::ServeError),
    /// The apiserver refused or failed a request the agent cannot do without.
    #[error("{what}: {source}")]
    Api {
        /// What the agent was doing.
        what: String,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
}

/// One node: who it is and what it offers.
#[derive(Debug, Clone)]
pub struct NodeSpec {
    /// The Node's name (its credentials are `system:node:NAME`).
    pub name: String,
    /// `nvidia.com/gpu` it advertises; with any, it is labelled and tainted as a GPU node.
    pub gpus: u64,
    /// CPU cores it advertises.
    pub cpus: u64,
    /// Memory it advertises, in GiB.
    pub memory_gib: u64,
    /// The serving certificate and key of its kubelet API ([`crate::node_api`]); without
    /// them `pods/log` of its Pods cannot be served.
    pub serving: Option<(PathBuf, PathBuf)>,
}

/// RFC 3339 UTC, to the second, as Kubernetes writes times.
fn now() -> String {
    crate::store::rfc3339(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    )
}

/// Reads a kubeconfig into a client.
pub async fn client(path: &std::path::Path) -> Result<kube::Client, AgentError> {
    let fail = |message: String| AgentError::Kubeconfig {
        path: path.to_owned(),
        message,
    };
    let kubeconfig = kube::config::Kubeconfig::read_from(path).map_err(|e| fail(e.to_string()))?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .map_err(|e| fail(e.to_string()))?;
    kube::Client::try_from(config).map_err(|e| fail(e.to_string()))
}

fn api_error(what: impl Into<String>) -> impl FnOnce(kube::Error) -> AgentError {
    let what = what.into();
    move |source| AgentError::Api { what, source }
}

/// How a Pod on this node reaches the apiserver the agent's kubeconfig names.
pub fn api_access(path: &std::path::Path) -> Result<ApiAccess, AgentError> {
    let fail = |message: String| AgentError::Kubeconfig {
        path: path.to_owned(),
        message,
    };
    let kubeconfig = kube::config::Kubeconfig::read_from(path).map_err(|e| fail(e.to_string()))?;
    let cluster = kubeconfig
        .clusters
        .first()
        .and_then(|c| c.cluster.clone())
        .ok_or_else(|| fail("names no cluster".into()))?;
    let server = cluster.server.unwrap_or_default();
    let (scheme, rest) = server
        .split_once("://")
        .ok_or_else(|| fail(format!("server {server:?} is not a URL")))?;
    let addr = rest
        .trim_end_matches('/')
        .parse()
        .map_err(|e| fail(format!("server {server:?} is not IP:PORT: {e}")))?;
    Ok(ApiAccess {
        addr,
        scheme: if scheme == "https" { "https" } else { "http" },
        ca_file: cluster.certificate_authority.map(PathBuf::from),
    })
}

fn node_object(spec: &NodeSpec) -> Value {
    let mut labels = json!({"kubernetes.io/hostname": spec.name, "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64"});
    let mut taints = json!([]);
    if spec.gpus > 0 {
        labels["nvidia.com/gpu.present"] = json!("true");
        taints = json!([{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]);
    }
    json!({"apiVersion": "v1", "kind": "Node",
        "metadata": {"name": spec.name, "labels": labels},
        "spec": {"taints": taints}})
}

/// The port the kubelet API listens on where it serves none (the kubelet's default).
const KUBELET_PORT: u16 = 10250;

fn node_status(spec: &NodeSpec, kubelet_port: u16) -> Value {
    let stamp = now();
    let resources = json!({"cpu": spec.cpus.to_string(), "memory": format!("{}Gi", spec.memory_gib),
        "pods": "110", "ephemeral-storage": "100Gi", "nvidia.com/gpu": spec.gpus.to_string()});
    let condition = |kind: &str, status: &str, reason: &str| {
        json!({"type": kind, "status": status, "reason": reason, "message": reason,
            "lastHeartbeatTime": stamp, "lastTransitionTime": stamp})
    };
    json!({"status": {
        "capacity": resources, "allocatable": resources,
        "conditions": [
            condition("Ready", "True", "KubeletReady"),
            condition("MemoryPressure", "False", "KubeletHasSufficientMemory"),
            condition("DiskPressure", "False", "KubeletHasNoDiskPressure"),
            condition("PIDPressure", "False", "KubeletHasSufficientPID"),
        ],
        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
            {"type": "Hostname", "address": spec.name}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}},
        "nodeInfo": {"machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": "",
            "osImage": "harvest node agent", "containerRuntimeVersion": "process://1",
            "kubeletVersion": KUBELET_VERSION, "kubeProxyVersion": "",
            "operatingSystem": "linux", "architecture": "amd64"},
    }})
}

/// Creates the Node (or takes over an existing one of that name) and writes its status.
async fn register(
    client: &kube::Client,
    spec: &NodeSpec,
    kubelet_port: u16,
) -> Result<(), AgentError> {
    let nodes: Api<Node> = Api::all(client.clone());
    let object: Node =
        serde_json::from_value(node_object(spec)).map_err(|e| AgentError::Kubeconfig {
            path: PathBuf::new(),
            message: format!("building the Node: {e}"),
        })?;
    match nodes.create(&PostParams::default(), &object).await {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 409 => {}
        Err(e) => return Err(api_error(format!("registering node {}", spec.name))(e)),
    }
    nodes
        .patch_status(
            &spec.name,
            &PatchParams::default(),
            &Patch::Merge(&node_status(spec, kubelet_port)),
        )
        .await
        .map_err(api_error(format!("writing node {}'s status", spec.name)))?;
    Ok(())
}

/// Renews the Lease often and the Ready heartbeat now and then, for as long as it runs.
async fn heartbeat(client: kube::Client, spec: NodeSpec, kubelet_port: u16) {
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-node-lease");
    let nodes: Api<Node> = Api::all(client);
    let mut last_status = tokio::time::Instant::now();
    loop {
        let now = now();
        let lease = json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": spec.name, "namespace": "kube-node-lease"},
            "spec": {"holderIdentity": spec.name, "leaseDurationSeconds": LEASE_SECONDS,
                "renewTime": now.replace('Z', ".000000Z")}});
        let params = PatchParams::apply("harvest-node-agent").force();
        if let Err(error) = leases
            .patch(&spec.name, &params, &Patch::Apply(&lease))
            .await
        {
            tracing::warn!(node = %spec.name, %error, "renewing the node's Lease");
        }
        if last_status.elapsed() >= STATUS_HEARTBEAT {
            last_status = tokio::time::Instant::now();
            if let Err(error) = nodes
                .patch_status(
                    &spec.name,
                    &PatchParams::default(),
                    &Patch::Merge(&node_status(&spec, kubelet_port)),
                )
                .await
            {
                tracing::warn!(node = %spec.name, %error, "writing the node's heartbeat");
            }
        }
        tokio::time::sleep(LEASE_RENEW).await;
    }
}

/// Ends a deleted Pod's graceful deletion once its process has stopped, as a kubelet does.
async fn finish_deletion(kubelet: Arc<Kubelet>, remote: Arc<Remote>, pod: Value) {
    let ns = pod["metadata"]["namespace"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let name = pod["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    kubelet.finished(&ns, &name).await;
    remote.forget(&ns, &name);
    let pods: Api<Pod> = Api::namespaced(remote.client().clone(), &ns);
    let params = DeleteParams {
        grace_period_seconds: Some(0),
        preconditions: Some(Preconditions {
            uid: pod["metadata"]["uid"].as_str().map(str::to_owned),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match pods.delete(&name, &params).await {
        Ok(_) | Err(kube::Error::Api(_)) => {}
        Err(error) => tracing::warn!(pod = %name, %error, "finishing the Pod's deletion"),
    }
}

/// Runs the node until the process ends; errors only if it cannot register.
pub async fn run(
    kubeconfig: &std::path::Path,
    spec: NodeSpec,
    kubelet: KubeletConfig,
) -> Result<(), AgentError> {
    let client = client(kubeconfig).await?;
    let kubelet_port = match &spec.serving {
        Some((cert, key)) => crate::node_api::serve(cert, key, kubelet.work_dir.clone()).await?,
        None => KUBELET_PORT,
    };
    register(&client, &spec, kubelet_port).await?;
    tokio::spawn(heartbeat(client.clone(), spec.clone(), kubelet_port));
    let remote = Arc::new(Remote::new(client.clone(), spec.name.clone()));
    let kubelet = Kubelet::new(
        Link::Remote(remote.clone()),
        kubelet,
        api_access(kubeconfig)?,
    );
    let pods: Api<Pod> = Api::all(client);
    let config = watcher::Config::default().fields(&format!("spec.nodeName={}", remote.node()));
    let mut events = std::pin::pin!(watcher(pods, config));
    let mut finishing = std::collections::HashSet::new();
    while let Some(event) = events.next().await {
        let (change, pod) = match event {
            Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) => ("MODIFIED", pod),
            Ok(watcher::Event::Delete(pod)) => ("DELETED", pod),
            Ok(_) => continue,
            Err(error) => {
                tracing::warn!(node = %spec.name, %error, "watching the node's Pods");
                continue;
            }
        };
        let Ok(pod) = serde_json::to_value(&pod) else {
            continue;
        };
        kubelet.observe(change, &pod);
        let uid = pod["metadata"]["uid"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        if change == "MODIFIED"
            && pod["metadata"]["deletionTimestamp"].is_string()
            && finishing.insert(uid)
        {
            tokio::spawn(finish_deletion(
                kubelet.clone(),
                remote.clone(),
                pod.clone(),
            ));
        }
    }
    Ok(())
}
