//! The kubelet's client side when it serves a node of an apiserver over HTTP
//! ([`crate::agent`]): Pod status writes, bound ServiceAccount tokens, and the objects a Pod
//! reads, fetched for [`crate::launch::resolve`].

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tokio::sync::watch;

use crate::launch::Snapshot;

/// How long a Pod's token lasts (a projected token's default; Pods here outlive no test).
const TOKEN_SECONDS: i64 = 3607;

/// The agent's client side of the kubelet: status writes, tokens and the objects a Pod reads.
pub struct Remote {
    client: kube::Client,
    node: String,
    /// The latest status per Pod, each written in order by its own task, so a burst of
    /// updates costs one write and the last one always lands.
    statuses: Mutex<HashMap<String, watch::Sender<Value>>>,
}

impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Remote")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The status patch for a kubelet's whole status: fields it leaves out are cleared, and the
/// plural IP fields the apiserver validates against the singular ones are filled.
fn status_patch(mut status: Value) -> Value {
    for field in ["reason", "message", "startTime", "podIP", "hostIP"] {
        if status.get(field).is_none() {
            status[field] = Value::Null;
        }
    }
    status["podIPs"] = match status["podIP"].as_str() {
        Some(ip) => json!([{"ip": ip}]),
        None => Value::Null,
    };
    status["hostIPs"] = match status["hostIP"].as_str() {
        Some(ip) => json!([{"ip": ip}]),
        None => Value::Null,
    };
    json!({ "status": status })
}

impl Remote {
    /// The client side of node `node`, through `client` (the node's credentials).
    pub fn new(client: kube::Client, node: String) -> Self {
        Self {
            client,
            node,
            statuses: Mutex::default(),
        }
    }

    /// The node's client.
    pub fn client(&self) -> &kube::Client {
        &self.client
    }

    /// The node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Queues the Pod's whole status; the Pod's writer applies the latest.
    pub fn set_status(&self, ns: &str, name: &str, status: Value) {
        let key = format!("{ns}/{name}");
        let mut statuses = lock(&self.statuses);
        if let Some(sender) = statuses.get(&key)
            && sender.send(status.clone()).is_ok()
        {
            return;
        }
        let (sender, mut receiver) = watch::channel(status);
        statuses.insert(key, sender);
        let api: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let name = name.to_owned();
        tokio::spawn(async move {
            loop {
                let status = receiver.borrow_and_update().clone();
                let patch = status_patch(status);
                if let Err(error) = api
                    .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    tracing::warn!(pod = %name, %error, "writing the Pod's status");
                }
                if receiver.changed().await.is_err() {
                    return;
                }
            }
        });
    }

    /// Stops writing the Pod's status (it is gone).
    pub fn forget(&self, ns: &str, name: &str) {
        lock(&self.statuses).remove(&format!("{ns}/{name}"));
    }

    /// A token for the Pod's ServiceAccount, bound to the Pod (as Node authorization
    /// requires of a kubelet), unless the Pod or the account opts out of automounting; the
    /// apiserver's refusal as the error (Node authorization learns of a binding a moment
    /// after the kubelet does, so the caller retries).
    pub async fn token(
        &self,
        pod: &Value,
        account: &str,
        declared: Option<bool>,
    ) -> Result<Option<String>, String> {
        let ns = pod["metadata"]["namespace"].as_str().unwrap_or_default();
        let accounts: Api<ServiceAccount> = Api::namespaced(self.client.clone(), ns);
        let automount = match declared {
            Some(flag) => flag,
            None => accounts
                .get_opt(account)
                .await
                .ok()
                .flatten()
                .and_then(|sa| sa.automount_service_account_token)
                .unwrap_or(true),
        };
        if !automount {
            return Ok(None);
        }
        let request = TokenRequest {
            spec: TokenRequestSpec {
                audiences: Vec::new(),
                expiration_seconds: Some(TOKEN_SECONDS),
                bound_object_ref: Some(BoundObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Pod".into()),
                    name: pod["metadata"]["name"].as_str().map(str::to_owned),
                    uid: pod["metadata"]["uid"].as_str().map(str::to_owned),
                }),
            },
            ..TokenRequest::default()
        };
        match accounts
            .create_token_request(account, &PostParams::default(), &request)
            .await
        {
            Ok(made) => Ok(made.status.map(|s| s.token)),
            Err(error) => Err(format!(
                "requesting a token for ServiceAccount {ns}/{account}: {error}"
            )),
        }
    }

    /// The ConfigMaps, Secrets and claims the Pod reads, as they are now; absent ones are
    /// left out, and [`crate::launch::resolve`] reports them.
    pub async fn snapshot(&self, pod: &Value) -> Snapshot {
        let ns = pod["metadata"]["namespace"].as_str().unwrap_or_default();
        let mut objects = BTreeMap::new();
        for (plural, name) in crate::launch::references(pod) {
            let url = format!("/api/v1/namespaces/{ns}/{plural}/{name}");
            let request = http::Request::get(url).body(Vec::new());
            let Ok(request) = request else { continue };
            if let Ok(object) = self.client.request::<Value>(request).await {
                objects.insert((plural.to_owned(), name), object);
            }
        }
        Snapshot(objects)
    }
}
