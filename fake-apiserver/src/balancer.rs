//! Service access on the real test tier, standing in for kube-proxy and a cloud load balancer:
//! each Service port gets a loopback listener that forwards each connection, in turn, to a
//! ready endpoint of the Service's EndpointSlices (which the real controller-manager keeps).
//! The listener's port is written to `DIR/NAMESPACE.SERVICE.PORT`, since a ClusterIP
//! Service's status may not carry a load balancer's address.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Service, ServicePort};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams};

/// How often Services are listed for new or removed ports.
const RESYNC: Duration = Duration::from_secs(1);

type PortKey = (String, String, i32);

/// The endpoints of one Service port that are ready now, as `IP:PORT`.
async fn ready_endpoints(
    client: &kube::Client,
    ns: &str,
    service: &str,
    port: &ServicePort,
) -> Vec<String> {
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), ns);
    let selector = format!("kubernetes.io/service-name={service}");
    let Ok(list) = slices.list(&ListParams::default().labels(&selector)).await else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for slice in list.items {
        let target = slice
            .ports
            .iter()
            .flatten()
            .find(|p| p.name == port.name)
            .and_then(|p| p.port);
        let Some(target) = target else { continue };
        for endpoint in slice.endpoints {
            let ready = endpoint.conditions.as_ref().and_then(|c| c.ready) != Some(false);
            if ready {
                found.extend(endpoint.addresses.iter().map(|ip| format!("{ip}:{target}")));
            }
        }
    }
    found
}

async fn listen(
    client: kube::Client,
    key: PortKey,
    port: ServicePort,
    dir: &Path,
) -> Option<tokio::task::JoinHandle<()>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.ok()?;
    let local = listener.local_addr().ok()?.port();
    let file = dir.join(format!("{}.{}.{}", key.0, key.1, key.2));
    std::fs::write(&file, format!("{local}\n")).ok()?;
    let turn = Arc::new(AtomicUsize::new(0));
    Some(tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            let endpoints = ready_endpoints(&client, &key.0, &key.1, &port).await;
            if endpoints.is_empty() {
                continue;
            }
            let endpoint =
                endpoints[turn.fetch_add(1, Ordering::Relaxed) % endpoints.len()].clone();
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(endpoint).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
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
                for port in service
                    .spec
                    .into_iter()
                    .flat_map(|s| s.ports.unwrap_or_default())
                {
                    let key = (ns.clone(), name.clone(), port.port);
                    let task = match running.remove(&key) {
                        Some(task) => task,
                        None => match listen(client.clone(), key.clone(), port, &dir).await {
                            Some(task) => task,
                            None => continue,
                        },
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
