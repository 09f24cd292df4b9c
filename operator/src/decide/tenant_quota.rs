//! A tenant's ResourceQuotas over the workers harvest runs on its behalf. Workers run in the
//! shared `workerNamespace`, where the apiserver charges them to that namespace's quotas only;
//! so before it creates a worker for a job of namespace N, the operator asks whether N's own
//! ResourceQuotas would take it, counting what N already uses and harvest's live workers for
//! N (the `harvest.dev/tenant` label). A worker that would not fit waits as one a quota of
//! `workerNamespace` refuses does (`WaitingForQuota`, uncounted, tried again). Pure: the
//! reconcile shell lists the quotas and the workers.
//!
//! The quota's compute keys are counted as the apiserver counts them (`pods`, `cpu`,
//! `memory`, `ephemeral-storage` and their `requests.`/`limits.` forms, and `requests.` of an
//! extended resource such as `requests.nvidia.com/gpu`); object counts and quotas with
//! scopes or a scope selector are left to the apiserver, as they do not apply to a Pod that
//! is not in N.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Pod, ResourceQuota};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// A quantity in thousandths (`500m` is 500, `2Gi` is 2,147,483,648,000), rounded up as the
/// apiserver rounds what it charges; `None` when it is not a quantity.
pub fn milli(quantity: &Quantity) -> Option<i128> {
    let text = quantity.0.trim();
    let end = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(end);
    let (scale, power): (i128, i32) = match suffix {
        "" => (1, 0),
        "n" => (1, -9),
        "u" => (1, -6),
        "m" => (1, -3),
        "k" => (1, 3),
        "M" => (1, 6),
        "G" => (1, 9),
        "T" => (1, 12),
        "P" => (1, 15),
        "E" => (1, 18),
        "Ki" => (1 << 10, 0),
        "Mi" => (1 << 20, 0),
        "Gi" => (1 << 30, 0),
        "Ti" => (1 << 40, 0),
        "Pi" => (1 << 50, 0),
        "Ei" => (1 << 60, 0),
        exponent => (1, exponent.strip_prefix(['e', 'E'])?.parse().ok()?),
    };
    let negative = number.starts_with('-');
    let number = number.trim_start_matches(['+', '-']);
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() {
        return None;
    }
    // digits × 10^(power + 3 − fraction digits) × scale, in thousandths.
    let digits: i128 = format!("{whole}{fraction}").parse().ok()?;
    let shift = power + 3 - i32::try_from(fraction.len()).ok()?;
    let value = if shift >= 0 {
        digits.checked_mul(10_i128.checked_pow(shift.unsigned_abs())?)?
    } else {
        let divisor = 10_i128.checked_pow(shift.unsigned_abs())?;
        (digits + divisor - 1) / divisor
    }
    .checked_mul(scale)?;
    Some(if negative { -value } else { value })
}

/// The quota keys one Pod counts against, in thousandths, as the apiserver computes a Pod's
/// usage: the sum over its containers, or its largest init container where that is more.
pub fn usage(pod: &Pod) -> BTreeMap<String, i128> {
    let mut usage = BTreeMap::from([("pods".to_owned(), 1000)]);
    let Some(spec) = &pod.spec else {
        return usage;
    };
    let mut sums: BTreeMap<String, i128> = BTreeMap::new();
    for container in &spec.containers {
        for (key, value) in container_usage(container) {
            *sums.entry(key).or_default() += value;
        }
    }
    for init in spec.init_containers.iter().flatten() {
        for (key, value) in container_usage(init) {
            let sum = sums.entry(key).or_default();
            *sum = (*sum).max(value);
        }
    }
    for (key, value) in sums {
        // The bare names are the requests' (`cpu` is `requests.cpu`).
        if let Some(bare) = key.strip_prefix("requests.")
            && matches!(bare, "cpu" | "memory" | "ephemeral-storage")
        {
            usage.insert(bare.to_owned(), value);
        }
        usage.insert(key, value);
    }
    usage
}

fn container_usage(container: &Container) -> Vec<(String, i128)> {
    let Some(resources) = &container.resources else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for (prefix, map) in [
        ("requests", &resources.requests),
        ("limits", &resources.limits),
    ] {
        for (name, quantity) in map.iter().flatten() {
            if let Some(value) = milli(quantity) {
                found.push((format!("{prefix}.{name}"), value));
            }
        }
    }
    // A limit without a request requests the limit.
    for (name, quantity) in resources.limits.iter().flatten() {
        let requested = resources
            .requests
            .as_ref()
            .is_some_and(|r| r.contains_key(name));
        if !requested && let Some(value) = milli(quantity) {
            found.push((format!("requests.{name}"), value));
        }
    }
    found
}

/// Whether `key` is one this module counts (see the module docs).
fn counted(key: &str) -> bool {
    matches!(key, "pods" | "cpu" | "memory" | "ephemeral-storage")
        || key.starts_with("requests.")
        || matches!(
            key,
            "limits.cpu" | "limits.memory" | "limits.ephemeral-storage"
        )
}

/// Why `tenant`'s quotas would not take `pod`, or `None` when they would. `workers` are
/// harvest's live workers for `tenant` (not yet ended, `pod` itself not among them).
pub fn refusal(
    tenant: &str,
    quotas: &[ResourceQuota],
    workers: &[Pod],
    pod: &Pod,
) -> Option<String> {
    let asked = usage(pod);
    let mut charged: BTreeMap<String, i128> = BTreeMap::new();
    for worker in workers {
        for (key, value) in usage(worker) {
            *charged.entry(key).or_default() += value;
        }
    }
    for quota in quotas {
        let Some(spec) = &quota.spec else { continue };
        if spec.scopes.as_ref().is_some_and(|s| !s.is_empty()) || spec.scope_selector.is_some() {
            continue;
        }
        let used = quota.status.as_ref().and_then(|s| s.used.as_ref());
        for (key, hard) in spec.hard.iter().flatten() {
            let (Some(hard), true) = (milli(hard), counted(key)) else {
                continue;
            };
            let wants = asked.get(key).copied().unwrap_or(0);
            if wants == 0 {
                continue;
            }
            let in_namespace = used.and_then(|u| u.get(key)).and_then(milli).unwrap_or(0);
            let by_harvest = charged.get(key).copied().unwrap_or(0);
            if in_namespace + by_harvest + wants > hard {
                return Some(format!(
                    "namespace {tenant}'s ResourceQuota {name:?} limits {key} to {hard}: its own Pods use {in_namespace}, harvest's workers for it {by_harvest}, and this worker asks {wants}",
                    name = quota.metadata.name.as_deref().unwrap_or_default(),
                    hard = shown(hard),
                    in_namespace = shown(in_namespace),
                    by_harvest = shown(by_harvest),
                    wants = shown(wants),
                ));
            }
        }
    }
    None
}

/// Thousandths back as a quantity's text: whole units where exact, else `m`.
fn shown(milli: i128) -> String {
    if milli % 1000 == 0 {
        (milli / 1000).to_string()
    } else {
        format!("{milli}m")
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use k8s_openapi::api::core::v1::{
        PodSpec, ResourceQuotaSpec, ResourceQuotaStatus, ResourceRequirements, ScopeSelector,
    };

    use super::*;

    fn q(text: &str) -> Quantity {
        Quantity(text.to_owned())
    }

    #[test]
    fn quantities_read_as_thousandths_with_every_suffix_the_apiserver_takes() {
        for (text, expected) in [
            ("1", 1000),
            ("500m", 500),
            ("0.5", 500),
            ("2k", 2_000_000),
            ("1Gi", 1_073_741_824_000),
            ("1.5Gi", 1_610_612_736_000),
            ("2e3", 2_000_000),
            ("1E", 1_000_000_000_000_000_000_000),
            ("100n", 1),
            ("-1", -1000),
        ] {
            assert_eq!(milli(&q(text)), Some(expected), "{text}");
        }
        for text in ["", "Gi", "1x", "1.2.3", "e3"] {
            assert_eq!(milli(&q(text)), None, "{text}");
        }
    }

    fn worker(cpu: &str, memory: &str, gpus: Option<&str>) -> Pod {
        let mut requests =
            BTreeMap::from([("cpu".to_owned(), q(cpu)), ("memory".to_owned(), q(memory))]);
        let mut limits = BTreeMap::from([("memory".to_owned(), q(memory))]);
        if let Some(gpus) = gpus {
            requests.insert("nvidia.com/gpu".to_owned(), q(gpus));
            limits.insert("nvidia.com/gpu".to_owned(), q(gpus));
        }
        Pod {
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "harvester".into(),
                    resources: Some(ResourceRequirements {
                        requests: Some(requests),
                        limits: Some(limits),
                        ..ResourceRequirements::default()
                    }),
                    ..Container::default()
                }],
                ..PodSpec::default()
            }),
            ..Pod::default()
        }
    }

    fn quota(name: &str, hard: &[(&str, &str)], used: &[(&str, &str)]) -> ResourceQuota {
        let map = |pairs: &[(&str, &str)]| {
            Some(
                pairs
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), q(v)))
                    .collect::<BTreeMap<_, _>>(),
            )
        };
        ResourceQuota {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            spec: Some(ResourceQuotaSpec {
                hard: map(hard),
                ..ResourceQuotaSpec::default()
            }),
            status: Some(ResourceQuotaStatus {
                used: map(used),
                ..ResourceQuotaStatus::default()
            }),
        }
    }

    #[test]
    fn a_pods_usage_counts_requests_limits_their_bare_names_and_one_pod() {
        let usage = usage(&worker("8", "32Gi", Some("1")));
        assert_eq!(usage["pods"], 1000);
        assert_eq!(usage["cpu"], 8000);
        assert_eq!(usage["requests.cpu"], 8000);
        assert_eq!(usage["memory"], 32 * 1_073_741_824_000);
        assert_eq!(usage["limits.memory"], 32 * 1_073_741_824_000);
        assert_eq!(usage["requests.nvidia.com/gpu"], 1000);
        assert!(!usage.contains_key("limits.cpu"));
    }

    #[test]
    fn a_worker_that_fits_the_tenants_quota_beside_its_pods_and_other_workers_is_taken() {
        let gpus = quota("gpus", &[("requests.nvidia.com/gpu", "4")], &[]);
        let running = [worker("8", "32Gi", Some("2"))];
        let pod = worker("8", "32Gi", Some("2"));
        assert_eq!(refusal("my-team", &[gpus], &running, &pod), None);
    }

    #[test]
    fn a_worker_past_the_tenants_quota_is_refused_naming_the_quota_the_key_and_every_share() {
        let gpus = quota(
            "gpus",
            &[("requests.nvidia.com/gpu", "4")],
            &[("requests.nvidia.com/gpu", "1")],
        );
        let running = [worker("8", "32Gi", Some("2"))];
        let pod = worker("8", "32Gi", Some("2"));
        let why = refusal("my-team", &[gpus], &running, &pod).unwrap();
        assert_eq!(
            why,
            "namespace my-team's ResourceQuota \"gpus\" limits requests.nvidia.com/gpu to 4: its own Pods use 1, harvest's workers for it 2, and this worker asks 2"
        );
        // The bare name counts the requests, as the apiserver's does.
        let cpu = quota("cpu", &[("cpu", "10")], &[("cpu", "500m")]);
        let why = refusal("my-team", &[cpu], &[], &worker("10", "1Gi", None)).unwrap();
        assert!(why.contains("own Pods use 500m"), "{why}");
        let pods = quota("pods", &[("pods", "1")], &[]);
        let why = refusal("my-team", &[pods], &running, &pod).unwrap();
        assert!(why.contains("limits pods to 1"), "{why}");
    }

    #[test]
    fn scoped_quotas_object_counts_and_keys_the_worker_does_not_ask_for_are_left_alone() {
        let mut scoped = quota("scoped", &[("requests.nvidia.com/gpu", "0")], &[]);
        if let Some(spec) = scoped.spec.as_mut() {
            spec.scope_selector = Some(ScopeSelector::default());
        }
        let counts = quota("counts", &[("count/pods", "0"), ("services", "0")], &[]);
        let gpus = quota("gpus", &[("requests.nvidia.com/gpu", "0")], &[]);
        let cpu_pod = worker("2", "2Gi", None);
        assert_eq!(refusal("t", &[scoped, counts, gpus], &[], &cpu_pod), None);
    }
}
