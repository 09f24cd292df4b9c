//! Admission of Pods, as the apiserver's ServiceAccount and PodSecurity plugins do it: a Pod
//! naming a ServiceAccount that does not exist is refused, and in a namespace labelled
//! `pod-security.kubernetes.io/enforce: restricted` a Pod must meet the "restricted" profile.

use serde_json::Value;

use crate::error::ApiError;

/// Looks an object up by plural (core group), namespace and name.
pub type Lookup<'a> = dyn Fn(&str, &str, &str) -> Option<&'a Value> + 'a;

/// Admits `pod` into namespace `ns`, or says why not with the apiserver's 403.
pub fn pod(lookup: &Lookup<'_>, ns: &str, pod: &Value) -> Result<(), ApiError> {
    let name = pod["metadata"]["name"].as_str().unwrap_or_default();
    let account = service_account(pod);
    // Kubernetes' ServiceAccount controller makes `default` in every namespace.
    if account != "default" && lookup("serviceaccounts", ns, account).is_none() {
        return Err(ApiError::new(
            403,
            "Forbidden",
            format!(
                "pods \"{name}\" is forbidden: error looking up service account {ns}/{account}: serviceaccount \"{account}\" not found"
            ),
        ));
    }
    let enforced = lookup("namespaces", "", ns)
        .and_then(|n| n["metadata"]["labels"]["pod-security.kubernetes.io/enforce"].as_str());
    if enforced == Some("restricted") {
        let problems = restricted_violations(pod);
        if !problems.is_empty() {
            return Err(ApiError::new(
                403,
                "Forbidden",
                format!(
                    "pods \"{name}\" is forbidden: violates PodSecurity \"restricted:latest\": {}",
                    problems.join(", ")
                ),
            ));
        }
    }
    Ok(())
}

const RESTRICTED_VOLUMES: [&str; 8] = [
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
];

/// What breaks the "restricted" Pod Security Standard, in the admission plugin's words.
pub fn restricted_violations(pod: &Value) -> Vec<String> {
    let spec = &pod["spec"];
    let pod_security = &spec["securityContext"];
    let mut problems = Vec::new();
    for flag in ["hostNetwork", "hostPID", "hostIPC"] {
        if spec[flag].as_bool() == Some(true) {
            problems.push(format!("host namespaces ({flag}=true)"));
        }
    }
    let bad_volumes: Vec<String> = spec["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|v| {
            v.as_object().is_some_and(|o| {
                o.keys()
                    .any(|k| k != "name" && !RESTRICTED_VOLUMES.contains(&k.as_str()))
            })
        })
        .map(|v| format!("{:?}", v["name"].as_str().unwrap_or_default()))
        .collect();
    if !bad_volumes.is_empty() {
        problems.push(format!(
            "restricted volume types (volumes {} use a type outside the restricted list)",
            bad_volumes.join(", ")
        ));
    }
    let containers = spec["containers"]
        .as_array()
        .into_iter()
        .flatten()
        .chain(spec["initContainers"].as_array().into_iter().flatten());
    for container in containers {
        let name = container["name"].as_str().unwrap_or_default();
        let security = &container["securityContext"];
        if security["privileged"].as_bool() == Some(true) {
            problems.push(format!(
                "privileged (container \"{name}\" must not set securityContext.privileged=true)"
            ));
        }
        if security["allowPrivilegeEscalation"].as_bool() != Some(false) {
            problems.push(format!("allowPrivilegeEscalation != false (container \"{name}\" must set securityContext.allowPrivilegeEscalation=false)"));
        }
        let drops_all = security["capabilities"]["drop"]
            .as_array()
            .is_some_and(|d| d.iter().any(|c| c == "ALL"));
        if !drops_all {
            problems.push(format!("unrestricted capabilities (container \"{name}\" must set securityContext.capabilities.drop=[\"ALL\"])"));
        }
        let non_root = security["runAsNonRoot"]
            .as_bool()
            .or_else(|| pod_security["runAsNonRoot"].as_bool());
        if non_root != Some(true) {
            problems.push(format!("runAsNonRoot != true (pod or container \"{name}\" must set securityContext.runAsNonRoot=true)"));
        }
        let seccomp = security["seccompProfile"]["type"]
            .as_str()
            .or_else(|| pod_security["seccompProfile"]["type"].as_str());
        if !matches!(seccomp, Some("RuntimeDefault" | "Localhost")) {
            problems.push(format!("seccompProfile (pod or container \"{name}\" must set securityContext.seccompProfile.type to \"RuntimeDefault\" or \"Localhost\")"));
        }
    }
    problems
}

/// The Pod's ServiceAccount (`default` when unnamed).
pub fn service_account(pod: &Value) -> &str {
    pod["spec"]["serviceAccountName"]
        .as_str()
        .filter(|s| !s.is_empty())
        .unwrap_or("default")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_restricted_namespace_refuses_a_pod_without_a_security_context_naming_each_rule() {
        let pod = json!({"metadata": {"name": "w"}, "spec": {"containers": [{"name": "c"}],
            "volumes": [{"name": "host", "hostPath": {"path": "/"}}]}});
        let problems = restricted_violations(&pod).join("\n");
        for rule in [
            "allowPrivilegeEscalation",
            "capabilities.drop",
            "runAsNonRoot",
            "seccompProfile",
            "volumes \"host\"",
        ] {
            assert!(problems.contains(rule), "{rule} missing from {problems}");
        }
        let good = json!({"spec": {"securityContext": {"runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}}}],
            "volumes": [{"name": "m", "persistentVolumeClaim": {"claimName": "x"}}]}});
        assert_eq!(restricted_violations(&good), Vec::<String>::new());
    }
}
