//! The controllers the manifests rely on: Deployments (Pods straight from the template, no
//! ReplicaSets; a template change rolls the Pods over once the new ones are Ready) and
//! Services (a loopback TCP proxy per port to Ready Pods, its address in
//! `status.loadBalancer.ingress`).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::{Value, json};

use crate::store::{ResourceKey, Store};

fn key(plural: &str) -> ResourceKey {
    if plural == "deployments" {
        ResourceKey::new("/apis/apps/v1", plural)
    } else {
        ResourceKey::new("/api/v1", plural)
    }
}

fn text<'a>(object: &'a Value, pointer: &str) -> &'a str {
    object
        .pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_default()
}

fn is_ready(pod: &Value) -> bool {
    pod["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == "Ready" && c["status"] == "True")
}

fn is_terminal(pod: &Value) -> bool {
    matches!(text(pod, "/status/phase"), "Succeeded" | "Failed")
        || pod["metadata"]["deletionTimestamp"].is_string()
}

fn selects(selector: &Value, pod: &Value) -> bool {
    selector
        .as_object()
        .is_some_and(|s| !s.is_empty() && s.iter().all(|(k, v)| pod["metadata"]["labels"][k] == *v))
}

/// FNV-1a of the template, as ten hex digits (the role of `pod-template-hash`).
fn template_hash(template: &Value) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in template.to_string().bytes() {
        hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("{:010x}", hash & 0xff_ffff_ffff)
}

/// Starts both controllers.
pub fn start(store: Arc<Store>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut wake = store.subscribe();
        let mut failures: HashMap<String, String> = HashMap::new();
        let mut proxies = Proxies::default();
        loop {
            let (_, deployments) = store.list_at(&key("deployments"), None);
            for deployment in &deployments {
                reconcile_deployment(&store, deployment, &mut failures);
            }
            proxies.reconcile(&store).await;
            if wake.changed().await.is_err() {
                return;
            }
        }
    })
}

fn pod_for(deployment: &Value, hash: &str) -> Value {
    let template = &deployment["spec"]["template"];
    let mut labels = template["metadata"]["labels"].clone();
    if !labels.is_object() {
        labels = json!({});
    }
    labels["pod-template-hash"] = json!(hash);
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": format!("{}-{hash}-", text(deployment, "/metadata/name")),
            "labels": labels, "annotations": template["metadata"]["annotations"],
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment",
                "name": deployment["metadata"]["name"], "uid": deployment["metadata"]["uid"],
                "controller": true, "blockOwnerDeletion": true}]},
        "spec": template["spec"]})
}

fn event(store: &Store, object: &Value, kind: &str, reason: &str, message: &str) {
    let ns = text(object, "/metadata/namespace");
    let _ = store.create(
        &key("events"),
        ns,
        json!({"metadata": {"generateName": format!("{}.", text(object, "/metadata/name"))},
            "involvedObject": {"kind": kind, "namespace": ns, "name": object["metadata"]["name"],
                "uid": object["metadata"]["uid"]},
            "reason": reason, "message": message, "type": "Warning", "count": 1,
            "source": {"component": "deployment-controller"}}),
    );
}

fn reconcile_deployment(store: &Store, deployment: &Value, failures: &mut HashMap<String, String>) {
    if deployment["metadata"]["deletionTimestamp"].is_string() {
        return;
    }
    let ns = text(deployment, "/metadata/namespace");
    let name = text(deployment, "/metadata/name");
    let uid = &deployment["metadata"]["uid"];
    let replicas = deployment["spec"]["replicas"].as_u64().unwrap_or(1) as usize;
    let hash = template_hash(&deployment["spec"]["template"]);
    let (_, all) = store.list_at(&key("pods"), Some(ns));
    let owned: Vec<&Value> = all
        .iter()
        .filter(|p| {
            p["metadata"]["ownerReferences"]
                .as_array()
                .is_some_and(|o| o.iter().any(|r| r["uid"] == *uid))
        })
        .collect();
    let live: Vec<&Value> = owned.iter().copied().filter(|p| !is_terminal(p)).collect();
    let current: Vec<&Value> = live
        .iter()
        .copied()
        .filter(|p| text(p, "/metadata/labels/pod-template-hash") == hash)
        .collect();
    let id = format!("{ns}/{name}");
    let mut failure = None;
    for _ in current.len()..replicas {
        if let Err(e) = store.create(&key("pods"), ns, pod_for(deployment, &hash)) {
            failure = Some(e.message);
            break;
        }
    }
    match &failure {
        Some(message) if failures.get(&id) != Some(message) => {
            event(store, deployment, "Deployment", "FailedCreate", message);
            failures.insert(id.clone(), message.clone());
        }
        Some(_) => {}
        None => {
            failures.remove(&id);
        }
    }
    for extra in current.iter().skip(replicas) {
        let _ = store.delete(&key("pods"), ns, text(extra, "/metadata/name"));
    }
    let ready_current = current.iter().filter(|p| is_ready(p)).count();
    if ready_current >= replicas {
        for old in live
            .iter()
            .filter(|p| text(p, "/metadata/labels/pod-template-hash") != hash)
        {
            let _ = store.delete(&key("pods"), ns, text(old, "/metadata/name"));
        }
    }
    let ready = live.iter().filter(|p| is_ready(p)).count();
    let updated = current.len().min(replicas);
    let complete = updated == replicas && ready_current >= replicas && live.len() <= replicas;
    let mut conditions = vec![
        json!({"type": "Available", "status": if ready >= replicas { "True" } else { "False" },
            "reason": if ready >= replicas { "MinimumReplicasAvailable" } else { "MinimumReplicasUnavailable" }}),
        json!({"type": "Progressing", "status": "True",
            "reason": if complete { "NewReplicaSetAvailable" } else { "ReplicaSetUpdated" }}),
    ];
    if let Some(message) = failure {
        conditions.push(json!({"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": message}));
    }
    let status = json!({"observedGeneration": deployment["metadata"]["generation"],
        "replicas": live.len(), "updatedReplicas": updated, "readyReplicas": ready,
        "availableReplicas": ready, "unavailableReplicas": replicas.saturating_sub(ready),
        "conditions": conditions});
    if deployment["status"] != status {
        store.set_status(&key("deployments"), ns, name, |s| *s = status);
    }
}

/// One listener per Service port.
#[derive(Default)]
struct Proxies {
    running: BTreeMap<(String, String, String), (u16, tokio::task::JoinHandle<()>)>,
}

fn target_port(pod: &Value, target: &Value) -> Option<u16> {
    if let Some(n) = target.as_u64() {
        return u16::try_from(n).ok();
    }
    let name = target.as_str()?;
    pod["spec"]["containers"]
        .as_array()?
        .iter()
        .flat_map(|c| c["ports"].as_array().into_iter().flatten())
        .find(|p| p["name"].as_str() == Some(name))
        .and_then(|p| p["containerPort"].as_u64())
        .and_then(|n| u16::try_from(n).ok())
}

impl Proxies {
    async fn reconcile(&mut self, store: &Arc<Store>) {
        let (_, services) = store.list_at(&key("services"), None);
        let mut wanted = BTreeMap::new();
        for service in &services {
            let ns = text(service, "/metadata/namespace").to_owned();
            let name = text(service, "/metadata/name").to_owned();
            let mut ingress_ports = Vec::new();
            for port in service["spec"]["ports"].as_array().into_iter().flatten() {
                let id = (ns.clone(), name.clone(), port["port"].to_string());
                let local = match self.running.remove(&id) {
                    Some(running) => running,
                    None => match self.listen(store, service, port).await {
                        Some(running) => running,
                        None => continue,
                    },
                };
                ingress_ports.push(json!({"port": local.0, "protocol": "TCP"}));
                wanted.insert(id, local);
            }
            let status =
                json!({"loadBalancer": {"ingress": [{"ip": "127.0.0.1", "ports": ingress_ports}]}});
            if service["status"] != status {
                store.set_status(&key("services"), &ns, &name, |s| *s = status);
            }
        }
        for (_, (_, task)) in std::mem::replace(&mut self.running, wanted) {
            task.abort();
        }
    }

    async fn listen(
        &self,
        store: &Arc<Store>,
        service: &Value,
        port: &Value,
    ) -> Option<(u16, tokio::task::JoinHandle<()>)> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.ok()?;
        let local = listener.local_addr().ok()?.port();
        let ns = text(service, "/metadata/namespace").to_owned();
        let selector = service["spec"]["selector"].clone();
        let target = if port["targetPort"].is_null() {
            port["port"].clone()
        } else {
            port["targetPort"].clone()
        };
        let store = store.clone();
        let turn = Arc::new(AtomicUsize::new(0));
        let task = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let (_, pods) = store.list_at(&key("pods"), Some(&ns));
                let endpoints: Vec<(String, u16)> = pods
                    .iter()
                    .filter(|p| selects(&selector, p) && is_ready(p) && !is_terminal(p))
                    .filter_map(|p| {
                        Some((
                            text(p, "/status/podIP").to_owned(),
                            target_port(p, &target)?,
                        ))
                    })
                    .collect();
                forward(inbound, &endpoints, &turn);
            }
        });
        Some((local, task))
    }
}

/// Forwards one accepted connection to the next of `endpoints` in turn; with none, the
/// connection is dropped (refused, as a Service without ready endpoints).
pub(crate) fn forward<A>(mut inbound: tokio::net::TcpStream, endpoints: &[A], turn: &AtomicUsize)
where
    A: tokio::net::ToSocketAddrs + Clone + Send + 'static,
{
    if endpoints.is_empty() {
        return;
    }
    let endpoint = endpoints[turn.fetch_add(1, Ordering::Relaxed) % endpoints.len()].clone();
    tokio::spawn(async move {
        if let Ok(mut outbound) = tokio::net::TcpStream::connect(endpoint).await {
            let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
        }
    });
}
