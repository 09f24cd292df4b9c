//! Scheduling: which node a Pod may run on. The machine itself is node `fake-node` (no GPUs,
//! no taints); declared Node objects add nodes with their labels, taints and allocatable
//! extended resources (`nvidia.com/gpu`). A Pod that fits none stays Pending, Unschedulable.

use std::collections::HashMap;

use serde_json::Value;

use crate::store::{ResourceKey, Store};

/// The resource the scheduler counts.
pub const GPU: &str = "nvidia.com/gpu";

/// The node every fake cluster has: this machine.
pub const LOCAL_NODE: &str = "fake-node";

struct Node {
    name: String,
    labels: HashMap<String, String>,
    taints: Vec<Value>,
    gpus: u64,
}

fn nodes(store: &Store) -> Vec<Node> {
    let local = Node {
        name: LOCAL_NODE.into(),
        labels: HashMap::from([
            ("kubernetes.io/hostname".into(), LOCAL_NODE.into()),
            ("kubernetes.io/os".into(), "linux".into()),
        ]),
        taints: Vec::new(),
        gpus: 0,
    };
    let (_, declared) = store.list_at(&ResourceKey::new("/api/v1", "nodes"), None);
    let declared = declared.into_iter().map(|n| Node {
        name: n["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        labels: n["metadata"]["labels"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
            .collect(),
        taints: n["spec"]["taints"].as_array().cloned().unwrap_or_default(),
        gpus: quantity(&n["status"]["allocatable"][GPU])
            .or_else(|| quantity(&n["status"]["capacity"][GPU]))
            .unwrap_or(0),
    });
    std::iter::once(local).chain(declared).collect()
}

fn quantity(value: &Value) -> Option<u64> {
    value
        .as_u64()
        .or_else(|| value.as_str().and_then(|s| s.parse().ok()))
}

/// The GPUs a Pod asks for (limits, else requests, summed over its containers).
pub fn gpus_requested(pod: &Value) -> u64 {
    pod["spec"]["containers"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            quantity(&c["resources"]["limits"][GPU])
                .or_else(|| quantity(&c["resources"]["requests"][GPU]))
                .unwrap_or(0)
        })
        .sum()
}

fn tolerated(taint: &Value, tolerations: &[Value]) -> bool {
    let effect = taint["effect"].as_str().unwrap_or_default();
    if effect == "PreferNoSchedule" {
        return true;
    }
    tolerations.iter().any(|t| {
        let key_matches = t["key"]
            .as_str()
            .is_none_or(|k| k.is_empty() || Some(k) == taint["key"].as_str());
        let value_matches = t["operator"].as_str() == Some("Exists")
            || t["value"].as_str().unwrap_or_default()
                == taint["value"].as_str().unwrap_or_default();
        let effect_matches = t["effect"]
            .as_str()
            .is_none_or(|e| e.is_empty() || e == effect);
        key_matches && value_matches && effect_matches
    })
}

/// The node `pod` fits on, given the GPUs already taken per node, or the scheduler's message.
pub fn place(store: &Store, pod: &Value, taken: &HashMap<String, u64>) -> Result<String, String> {
    let nodes = nodes(store);
    let wanted = gpus_requested(pod);
    let selector = pod["spec"]["nodeSelector"].as_object();
    let tolerations = pod["spec"]["tolerations"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let (mut selector_misses, mut taint_misses, mut gpu_misses) = (0, 0, 0);
    for node in &nodes {
        let selected = selector
            .into_iter()
            .flatten()
            .all(|(k, v)| node.labels.get(k).map(String::as_str) == v.as_str());
        if !selected {
            selector_misses += 1;
        } else if !node.taints.iter().all(|t| tolerated(t, &tolerations)) {
            taint_misses += 1;
        } else if node.gpus < taken.get(&node.name).copied().unwrap_or(0) + wanted {
            gpu_misses += 1;
        } else {
            return Ok(node.name.clone());
        }
    }
    let mut reasons = Vec::new();
    if gpu_misses > 0 {
        reasons.push(format!("{gpu_misses} Insufficient {GPU}"));
    }
    if selector_misses > 0 {
        reasons.push(format!(
            "{selector_misses} node(s) didn't match Pod's node affinity/selector"
        ));
    }
    if taint_misses > 0 {
        reasons.push(format!("{taint_misses} node(s) had untolerated taint"));
    }
    Err(format!(
        "0/{} nodes are available: {}. preemption: 0/{} nodes are available: {} Preemption is not helpful for scheduling.",
        nodes.len(),
        reasons.join(", "),
        nodes.len(),
        nodes.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn gpu_pod() -> Value {
        json!({"spec": {"nodeSelector": {"nvidia.com/gpu.present": "true"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{"resources": {"limits": {"nvidia.com/gpu": "1"}}}]}})
    }

    #[test]
    fn a_gpu_pod_is_unschedulable_until_a_node_declares_free_gpus() {
        let store = Store::new();
        let message = place(&store, &gpu_pod(), &HashMap::new()).unwrap_err();
        assert!(
            message.starts_with("0/1 nodes are available: 1 node(s) didn't match"),
            "{message}"
        );
        assert_eq!(
            place(
                &store,
                &json!({"spec": {"containers": [{}]}}),
                &HashMap::new()
            )
            .unwrap(),
            LOCAL_NODE
        );
        store
            .create(
                &ResourceKey::new("/api/v1", "nodes"),
                "",
                json!({"metadata": {"name": "gpu-1",
                "labels": {"nvidia.com/gpu.present": "true"}},
                "spec": {"taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]},
                "status": {"allocatable": {"nvidia.com/gpu": "1"}}}),
            )
            .unwrap();
        assert_eq!(place(&store, &gpu_pod(), &HashMap::new()).unwrap(), "gpu-1");
        let full = HashMap::from([("gpu-1".to_owned(), 1)]);
        let message = place(&store, &gpu_pod(), &full).unwrap_err();
        assert!(
            message.contains("1 Insufficient nvidia.com/gpu"),
            "{message}"
        );
    }
}
