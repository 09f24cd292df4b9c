//! The resource kinds the fake server serves: a fixed set of built-ins plus whatever CRDs
//! register, and the legacy discovery documents built from them.

use serde_json::{Value, json};

/// One served resource.
#[derive(Debug, Clone, PartialEq)]
pub struct Kind {
    /// `""` for the core group.
    pub group: String,
    /// `v1`, `v1alpha1`, …
    pub version: String,
    /// Lowercase plural, the URL segment.
    pub plural: String,
    /// Lowercase singular.
    pub singular: String,
    /// CamelCase kind.
    pub kind: String,
    /// Namespaced or cluster-scoped.
    pub namespaced: bool,
    /// `kubectl get` short names.
    pub short_names: Vec<String>,
    /// Categories (`kubectl get harvest`).
    pub categories: Vec<String>,
    /// Whether `status` is a subresource (writes to the main resource ignore it).
    pub status_subresource: bool,
    /// CRD printer columns (`additionalPrinterColumns`).
    pub printer_columns: Vec<Value>,
    /// A CRD version's `openAPIV3Schema`, checked on every write (`schema`).
    pub schema: Option<Value>,
}

impl Kind {
    fn builtin(
        group: &str,
        version: &str,
        plural: &str,
        kind: &str,
        namespaced: bool,
        status: bool,
    ) -> Self {
        Self {
            group: group.into(),
            version: version.into(),
            plural: plural.into(),
            singular: kind.to_lowercase(),
            kind: kind.into(),
            namespaced,
            short_names: Vec::new(),
            categories: Vec::new(),
            status_subresource: status,
            printer_columns: Vec::new(),
            schema: None,
        }
    }

    /// `/api/v1` or `/apis/GROUP/VERSION`.
    pub fn api_path(&self) -> String {
        if self.group.is_empty() {
            format!("/api/{}", self.version)
        } else {
            format!("/apis/{}/{}", self.group, self.version)
        }
    }

    /// `v1` or `GROUP/VERSION`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }
}

/// The built-in kinds harvest's manifests, controller and tests use.
pub fn builtins() -> Vec<Kind> {
    let mut kinds = vec![
        Kind::builtin("", "v1", "namespaces", "Namespace", false, true),
        Kind::builtin("", "v1", "pods", "Pod", true, true),
        Kind::builtin("", "v1", "services", "Service", true, true),
        Kind::builtin("", "v1", "nodes", "Node", false, true),
        Kind::builtin(
            "",
            "v1",
            "persistentvolumeclaims",
            "PersistentVolumeClaim",
            true,
            true,
        ),
        Kind::builtin("", "v1", "serviceaccounts", "ServiceAccount", true, false),
        Kind::builtin("", "v1", "secrets", "Secret", true, false),
        Kind::builtin("", "v1", "configmaps", "ConfigMap", true, false),
        Kind::builtin("", "v1", "events", "Event", true, false),
        // Stored as written: the stand-in computes no status.used (DIVERGENCES.md).
        Kind::builtin("", "v1", "resourcequotas", "ResourceQuota", true, true),
        Kind::builtin("apps", "v1", "deployments", "Deployment", true, true),
        Kind::builtin(
            "policy",
            "v1",
            "poddisruptionbudgets",
            "PodDisruptionBudget",
            true,
            true,
        ),
        Kind::builtin(
            "networking.k8s.io",
            "v1",
            "networkpolicies",
            "NetworkPolicy",
            true,
            false,
        ),
        Kind::builtin(
            "scheduling.k8s.io",
            "v1",
            "priorityclasses",
            "PriorityClass",
            false,
            false,
        ),
        Kind::builtin("coordination.k8s.io", "v1", "leases", "Lease", true, false),
        Kind::builtin("events.k8s.io", "v1", "events", "Event", true, false),
        Kind::builtin(
            "rbac.authorization.k8s.io",
            "v1",
            "roles",
            "Role",
            true,
            false,
        ),
        Kind::builtin(
            "rbac.authorization.k8s.io",
            "v1",
            "rolebindings",
            "RoleBinding",
            true,
            false,
        ),
        Kind::builtin(
            "rbac.authorization.k8s.io",
            "v1",
            "clusterroles",
            "ClusterRole",
            false,
            false,
        ),
        Kind::builtin(
            "rbac.authorization.k8s.io",
            "v1",
            "clusterrolebindings",
            "ClusterRoleBinding",
            false,
            false,
        ),
        Kind::builtin(
            "apiextensions.k8s.io",
            "v1",
            "customresourcedefinitions",
            "CustomResourceDefinition",
            false,
            true,
        ),
        Kind::builtin(
            "admissionregistration.k8s.io",
            "v1",
            "validatingadmissionpolicies",
            "ValidatingAdmissionPolicy",
            false,
            true,
        ),
        Kind::builtin(
            "admissionregistration.k8s.io",
            "v1",
            "validatingadmissionpolicybindings",
            "ValidatingAdmissionPolicyBinding",
            false,
            false,
        ),
    ];
    for (plural, short) in [
        ("namespaces", "ns"),
        ("pods", "po"),
        ("services", "svc"),
        ("nodes", "no"),
        ("persistentvolumeclaims", "pvc"),
        ("serviceaccounts", "sa"),
        ("configmaps", "cm"),
        ("deployments", "deploy"),
        ("customresourcedefinitions", "crd"),
        ("poddisruptionbudgets", "pdb"),
        ("networkpolicies", "netpol"),
        ("priorityclasses", "pc"),
        ("resourcequotas", "quota"),
    ] {
        if let Some(kind) = kinds.iter_mut().find(|k| k.plural == plural) {
            kind.short_names.push(short.into());
        }
    }
    kinds
}

/// The kinds a CRD object declares (one per served version).
pub fn from_crd(crd: &Value) -> Vec<Kind> {
    let spec = &crd["spec"];
    let names = &spec["names"];
    let strings = |v: &Value| {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    spec["versions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|v| v["served"].as_bool().unwrap_or(true))
        .map(|v| Kind {
            group: spec["group"].as_str().unwrap_or_default().into(),
            version: v["name"].as_str().unwrap_or_default().into(),
            plural: names["plural"].as_str().unwrap_or_default().into(),
            singular: names["singular"].as_str().unwrap_or_default().into(),
            kind: names["kind"].as_str().unwrap_or_default().into(),
            namespaced: spec["scope"].as_str() == Some("Namespaced"),
            short_names: strings(&names["shortNames"]),
            categories: strings(&names["categories"]),
            status_subresource: v["subresources"]["status"].is_object(),
            printer_columns: v["additionalPrinterColumns"]
                .as_array()
                .cloned()
                .unwrap_or_default(),
            schema: v["schema"]["openAPIV3Schema"]
                .is_object()
                .then(|| v["schema"]["openAPIV3Schema"].clone()),
        })
        .collect()
}

/// `GET /api`.
pub fn core_versions() -> Value {
    json!({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]})
}

/// `GET /apis`.
pub fn group_list(kinds: &[Kind]) -> Value {
    let mut groups: Vec<(String, Vec<String>)> = Vec::new();
    for kind in kinds.iter().filter(|k| !k.group.is_empty()) {
        match groups.iter_mut().find(|(g, _)| *g == kind.group) {
            Some((_, versions)) if !versions.contains(&kind.version) => {
                versions.push(kind.version.clone());
            }
            Some(_) => {}
            None => groups.push((kind.group.clone(), vec![kind.version.clone()])),
        }
    }
    let groups: Vec<Value> = groups
        .into_iter()
        .map(|(name, versions)| {
            let versions: Vec<Value> = versions
                .iter()
                .map(|v| json!({"groupVersion": format!("{name}/{v}"), "version": v}))
                .collect();
            json!({"name": name, "versions": versions, "preferredVersion": versions[0]})
        })
        .collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

/// `GET /api/v1` or `GET /apis/GROUP/VERSION`, or `None` for an unknown group version.
pub fn resource_list(kinds: &[Kind], api_path: &str) -> Option<Value> {
    let served: Vec<&Kind> = kinds.iter().filter(|k| k.api_path() == api_path).collect();
    let first = served.first()?;
    let verbs = [
        "create",
        "delete",
        "deletecollection",
        "get",
        "list",
        "patch",
        "update",
        "watch",
    ];
    let mut resources = Vec::new();
    for kind in &served {
        resources.push(json!({
            "name": kind.plural, "singularName": kind.singular, "namespaced": kind.namespaced, "kind": kind.kind,
            "verbs": verbs, "shortNames": kind.short_names, "categories": kind.categories,
        }));
        if kind.status_subresource {
            resources.push(json!({"name": format!("{}/status", kind.plural), "singularName": "", "namespaced": kind.namespaced, "kind": kind.kind, "verbs": ["get", "patch", "update"]}));
        }
    }
    Some(
        json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": first.api_version(), "resources": resources}),
    )
}
