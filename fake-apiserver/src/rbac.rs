//! RBAC authorization of requests that carry a ServiceAccount token, as the apiserver's RBAC
//! authorizer decides them: Roles and ClusterRoles (aggregated ones included) bound by
//! RoleBindings and ClusterRoleBindings. Discovery is open to every identity, as
//! `system:discovery` makes it.

use serde_json::Value;

use crate::store::{Identity, ResourceKey, Store};

/// One request, as the authorizer sees it.
#[derive(Debug, Clone)]
pub struct Attributes<'a> {
    /// `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`, `deletecollection`.
    pub verb: &'a str,
    /// The API group (`""` for the core group).
    pub group: &'a str,
    /// The plural, with `/subresource` when there is one.
    pub resource: &'a str,
    /// The namespace (`""` for cluster-scoped requests).
    pub namespace: &'a str,
    /// The object's name, when the path names one.
    pub name: Option<&'a str>,
}

fn rbac(plural: &str) -> ResourceKey {
    ResourceKey::new("/apis/rbac.authorization.k8s.io/v1", plural)
}

fn contains(list: &Value, wanted: &str) -> bool {
    list.as_array()
        .is_some_and(|l| l.iter().any(|v| v == "*" || v == wanted))
}

fn rule_allows(rule: &Value, request: &Attributes<'_>) -> bool {
    let names = rule["resourceNames"].as_array().filter(|n| !n.is_empty());
    contains(&rule["verbs"], request.verb)
        && contains(&rule["apiGroups"], request.group)
        && contains(&rule["resources"], request.resource)
        && names.is_none_or(|names| {
            request
                .name
                .is_some_and(|name| names.iter().any(|n| n == name))
        })
}

fn labels_match(selector: &Value, object: &Value) -> bool {
    selector["matchLabels"]
        .as_object()
        .is_some_and(|m| m.iter().all(|(k, v)| object["metadata"]["labels"][k] == *v))
}

/// A role's rules; an aggregated ClusterRole has the rules of every ClusterRole it selects.
fn rules(store: &Store, role_ref: &Value, namespace: &str) -> Vec<Value> {
    let name = role_ref["name"].as_str().unwrap_or_default();
    let role = if role_ref["kind"] == "Role" {
        store.get(&rbac("roles"), namespace, name)
    } else {
        store.get(&rbac("clusterroles"), "", name)
    };
    let Some(role) = role else {
        return Vec::new();
    };
    let mut rules = role["rules"].as_array().cloned().unwrap_or_default();
    let selectors = role["aggregationRule"]["clusterRoleSelectors"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    if !selectors.is_empty() {
        let (_, all) = store.list_at(&rbac("clusterroles"), None);
        for other in all
            .iter()
            .filter(|r| selectors.iter().any(|s| labels_match(s, r)))
        {
            rules.extend(other["rules"].as_array().cloned().unwrap_or_default());
        }
    }
    rules
}

fn binds(binding: &Value, namespace: &str, name: &str) -> bool {
    binding["subjects"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|s| match s["kind"].as_str() {
            Some("ServiceAccount") => s["name"] == name && s["namespace"] == namespace,
            Some("Group") => {
                matches!(
                    s["name"].as_str(),
                    Some("system:serviceaccounts" | "system:authenticated")
                ) || s["name"].as_str() == Some(&format!("system:serviceaccounts:{namespace}"))
            }
            _ => false,
        })
}

/// Whether `identity` may make `request`.
pub fn allowed(store: &Store, identity: &Identity, request: &Attributes<'_>) -> bool {
    let Identity::ServiceAccount { namespace, name } = identity else {
        return true;
    };
    let (_, cluster_bindings) = store.list_at(&rbac("clusterrolebindings"), None);
    let cluster_wide = cluster_bindings
        .iter()
        .filter(|b| binds(b, namespace, name))
        .any(|b| {
            rules(store, &b["roleRef"], "")
                .iter()
                .any(|r| rule_allows(r, request))
        });
    if cluster_wide {
        return true;
    }
    if request.namespace.is_empty() {
        return false;
    }
    let (_, bindings) = store.list_at(&rbac("rolebindings"), Some(request.namespace));
    bindings
        .iter()
        .filter(|b| binds(b, namespace, name))
        .any(|b| {
            rules(store, &b["roleRef"], request.namespace)
                .iter()
                .any(|r| rule_allows(r, request))
        })
}

/// The apiserver's refusal message.
pub fn refusal(identity: &Identity, request: &Attributes<'_>) -> String {
    let user = match identity {
        Identity::ServiceAccount { namespace, name } => {
            format!("system:serviceaccount:{namespace}:{name}")
        }
        Identity::Admin => "admin".into(),
    };
    let plural = request.resource.split('/').next().unwrap_or_default();
    let subject = match request.name {
        Some(name) => format!("{plural} \"{name}\""),
        None if request.group.is_empty() => plural.to_owned(),
        None => format!("{plural}.{}", request.group),
    };
    let scope = if request.namespace.is_empty() {
        "at the cluster scope".to_owned()
    } else {
        format!("in the namespace \"{}\"", request.namespace)
    };
    format!(
        "{subject} is forbidden: User \"{user}\" cannot {} resource \"{}\" in API group \"{}\" {scope}",
        request.verb, request.resource, request.group
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_role_with_resource_names_allows_only_those_names_and_never_create() {
        let store = Store::new();
        store
            .create(
                &rbac("roles"),
                "default",
                json!({"metadata": {"name": "lease"},
                "rules": [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                    "verbs": ["get", "update", "create"], "resourceNames": ["harvest-operator"]}]}),
            )
            .unwrap();
        store
            .create(&rbac("rolebindings"), "default", json!({"metadata": {"name": "lease"},
                "roleRef": {"kind": "Role", "name": "lease", "apiGroup": "rbac.authorization.k8s.io"},
                "subjects": [{"kind": "ServiceAccount", "name": "op", "namespace": "default"}]}))
            .unwrap();
        let op = Identity::ServiceAccount {
            namespace: "default".into(),
            name: "op".into(),
        };
        let request = |verb, name| Attributes {
            verb,
            group: "coordination.k8s.io",
            resource: "leases",
            namespace: "default",
            name,
        };
        assert!(allowed(
            &store,
            &op,
            &request("get", Some("harvest-operator"))
        ));
        assert!(!allowed(&store, &op, &request("get", Some("other"))));
        assert!(!allowed(&store, &op, &request("create", None)));
        assert!(!allowed(&store, &op, &request("list", None)));
        let other = Identity::ServiceAccount {
            namespace: "default".into(),
            name: "x".into(),
        };
        assert!(!allowed(
            &store,
            &other,
            &request("get", Some("harvest-operator"))
        ));
        assert_eq!(
            refusal(&other, &request("get", Some("harvest-operator"))),
            "leases \"harvest-operator\" is forbidden: User \"system:serviceaccount:default:x\" cannot get resource \"leases\" in API group \"coordination.k8s.io\" in the namespace \"default\""
        );
    }
}
