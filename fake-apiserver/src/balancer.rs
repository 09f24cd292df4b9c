//! Service access on the real test tier, standing in for kube-proxy and a cloud load balancer:
//! each Service port gets a loopback listener that forwards each connection, in turn, to a
//! ready Pod the Service selects. Pods here have loopback addresses, which EndpointSlices may
//! not hold (the controller-manager's endpoint controller is refused), so the Pods are read
//! with the endpoint controller's rule: selected, Ready, not being deleted. The listener's
//! port is written to `DIR/NAMESPACE.SERVICE.PORT`, since a ClusterIP Service's status may
//! not carry a load balancer's address.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Pod, Service, ServicePort};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, ListParams};

/// How often Services are listed for new or removed ports.
const RESYNC: Duration = Duration::from_secs(1);

type PortKey = (String, String, i32);

/// The container port a Service port's `targetPort` names in this Pod.
fn target_port(pod: &Pod, port: &ServicePort) -> Option<i32> {
    match &port.target_port {
        None => Some(port.port),
        Some(IntOrString::Int(n)) => Some(*n),
        Some(IntOrString::String(name)) => pod
            .spec
            .iter()
            .flat_map(|s| &s.containers)
            .flat_map(|c| c.ports.iter().flatten())
            .find(|p| p.name.as_deref() == Some(name))
            .map(|p| p.container_port),
    }
}

fn is_ready(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none()
        && pod
            .status
            .iter()
            .flat_map(|s| s.conditions.iter().flatten())
            .any(|c| c.type_ == "Ready" && c.status == "True")
}

/// The endpoints of one Service port that are ready now, as `IP:PORT`.
async fn ready_endpoints(
    client: &kube::Client,
    ns: &str,
    selector: &str,
    port: &ServicePort,
) -> Vec<String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let Ok(list) = pods.list(&ListParams::default().labels(selector)).await else {
        return Vec::new();
    };
    list.items
        .iter()
        .filter(|pod| is_ready(pod))
        .filter_map(|pod| {
            let ip = pod.status.as_ref()?.pod_ip.as_deref()?;
            Some(format!("{ip}:{}", target_port(pod, port)?))
        })
        .collect()
}

async fn listen(
    client: kube::Client,
    key: PortKey,
    selector: String,
    port: ServicePort,
    dir: &Path,
) -> Option<tokio::task::JoinHandle<()>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.ok()?;
    let local = listener.local_addr().ok()?.port();
    let file = dir.join(format!("{}.{}.{}", key.0, key.1, key.2));
    std::fs::write(&file, format!("{local}\n")).ok()?;
    let turn = Arc::new(AtomicUsize::new(0));
    Some(tokio::spawn(async move {
        while let Ok((inbound, _)) = listener.accept().await {
            let endpoints = ready_endpoints(&client, &key.0, &selector, &port).await;
            crate::controllers::forward(inbound, &endpoints, &turn);
        }
    }))
}

/// Serves every Service's ports until the process ends.
pub async fn run(client: kube::Client, dir: PathBuf) -> std::io::Result<()> {
    std::fs::create_dir_all(&dir)?;
    let services: Api<Service> = Api::all(client.clone());
    let mut running: BTreeMap<PortKey, tokio::task::JoinHandle<()>> = BTreeMap::new();
    loop {
        if let Ok(list) = services.list(&ListParams::default()).await {
            let mut wanted = BTreeMap::new();
            for service in list.items {
                let ns = service.metadata.namespace.clone().unwrap_or_default();
                let name = service.metadata.name.clone().unwrap_or_default();
                let Some(spec) = service.spec else { continue };
                // A Service without a selector (the apiserver's own) has no Pods to reach.
                let Some(selector) = spec.selector.filter(|s| !s.is_empty()) else {
                    continue;
                };
                let selector = selector
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(",");
                for port in spec.ports.unwrap_or_default() {
                    let key = (ns.clone(), name.clone(), port.port);
                    let task = match running.remove(&key) {
                        Some(task) => task,
                        None => {
                            match listen(client.clone(), key.clone(), selector.clone(), port, &dir)
                                .await
                            {
                                Some(task) => task,
                                None => continue,
                            }
                        }
                    };
                    wanted.insert(key, task);
                }
            }
            for ((ns, name, port), task) in std::mem::replace(&mut running, wanted) {
                task.abort();
                let _ = std::fs::remove_file(dir.join(format!("{ns}.{name}.{port}")));
            }
        }
        tokio::time::sleep(RESYNC).await;
    }
}
