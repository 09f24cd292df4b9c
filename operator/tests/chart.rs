//! The Helm chart (`charts/harvest`) as a platform team renders it, with the Helm CLI built
//! from its Go module (`scripts/helm.sh`): the same objects as the kustomize base and each
//! overlay, the values that set what an overlay sets, and values a platform mistypes refused
//! naming the key. Installing, upgrading and uninstalling it is the real tier's
//! (`e2e/tests/real.rs`).
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_yaml::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

/// The Helm binary `scripts/helm.sh` builds (once; cached after).
fn helm_binary() -> PathBuf {
    let output = Command::new(root().join("scripts/helm.sh"))
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "scripts/helm.sh failed (it builds Helm with Go):\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    PathBuf::from(String::from_utf8(output.stdout).unwrap().trim())
}

/// `helm ARGS` in the repository root: its stdout, or its stderr as the error.
fn helm(args: &[&str]) -> Result<String, String> {
    let output = Command::new(helm_binary())
        .args(args)
        .current_dir(root())
        .output()
        .unwrap();
    if output.status.success() {
        Ok(String::from_utf8(output.stdout).unwrap())
    } else {
        Err(String::from_utf8_lossy(&output.stderr).into_owned())
    }
}

fn documents(text: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|document| serde::Deserialize::deserialize(document).unwrap())
        .filter(|document: &Value| !document.is_null())
        .collect()
}

/// What `helm template harvest charts/harvest -n NAMESPACE EXTRA…` renders.
fn chart(namespace: &str, extra: &[&str]) -> Vec<Value> {
    let args = [
        &["template", "harvest", "charts/harvest", "-n", namespace],
        extra,
    ]
    .concat();
    documents(&helm(&args).unwrap_or_else(|e| panic!("helm {args:?}: {e}")))
}

/// What `kubectl kustomize TREE` renders (TREE relative to the repository root).
fn kustomize(tree: &str) -> Vec<Value> {
    let output = Command::new("kubectl")
        .args(["kustomize", tree])
        .current_dir(root())
        .output()
        .expect("kubectl is not on PATH: install it (see README, Kubernetes)");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    documents(&String::from_utf8(output.stdout).unwrap())
}

/// Labels Helm's conventions add and the kustomize base has no use for.
const HELM_LABELS: [&str; 3] = [
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/instance",
    "helm.sh/chart",
];

/// An object as compared: Helm's own labels dropped, and the two configuration files parsed,
/// so that their comments and key order do not count.
fn comparable(mut object: Value) -> Value {
    if let Some(labels) = object["metadata"]["labels"].as_mapping_mut() {
        for label in HELM_LABELS {
            labels.remove(label);
        }
    }
    if let Some(data) = object.get_mut("data").and_then(Value::as_mapping_mut) {
        for file in ["config.yaml", "api.json"] {
            if let Some(text) = data.get(file).and_then(Value::as_str) {
                let parsed: Value = serde_yaml::from_str(text).unwrap();
                data.insert(file.into(), parsed);
            }
        }
    }
    object
}

fn key(object: &Value) -> String {
    format!(
        "{} {}/{}",
        object["kind"].as_str().unwrap(),
        object["metadata"]["namespace"].as_str().unwrap_or(""),
        object["metadata"]["name"].as_str().unwrap()
    )
}

fn by_key(objects: Vec<Value>) -> std::collections::BTreeMap<String, Value> {
    objects
        .into_iter()
        .map(|o| (key(&o), comparable(o)))
        .collect()
}

fn object<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

/// The chart's rendering against a kustomize tree's: the same objects, field for field, but
/// the release's namespace, which Helm does not own (the install guide makes it).
fn assert_renders_the_same(tree: &str, extra: &[&str]) {
    let mut expected = by_key(kustomize(tree));
    let namespace = expected
        .remove("Namespace /harvest-system")
        .unwrap_or_else(|| panic!("{tree} renders no harvest-system"));
    assert_eq!(
        namespace["metadata"]["labels"]["app.kubernetes.io/part-of"],
        "harvest"
    );
    let rendered = by_key(chart("harvest-system", extra));
    let missing: Vec<&String> = expected
        .keys()
        .filter(|k| !rendered.contains_key(*k))
        .collect();
    let more: Vec<&String> = rendered
        .keys()
        .filter(|k| !expected.contains_key(*k))
        .collect();
    assert!(
        missing.is_empty() && more.is_empty(),
        "{tree} against the chart {extra:?}: only kustomize has {missing:?}, only the chart {more:?}"
    );
    for (name, object) in &expected {
        assert_eq!(
            &rendered[name], object,
            "{name}: the chart {extra:?} renders it otherwise than {tree}"
        );
    }
}

/// A kustomization in a scratch directory under the repository (kustomize takes relative
/// paths only) that adds `component` to the GPU overlay.
fn gpu_overlay_with(component: &str) -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix(".chart-test.")
        .tempdir_in(root().join("manifests"))
        .unwrap();
    std::fs::write(
        dir.path().join("kustomization.yaml"),
        format!("resources: [../overlays/gpu]\ncomponents: [../components/{component}]\n"),
    )
    .unwrap();
    dir
}

#[test]
fn the_chart_renders_the_objects_of_the_kustomize_base_and_of_each_overlay_and_component() {
    assert_renders_the_same("manifests/", &[]);
    assert_renders_the_same(
        "manifests/overlays/gpu",
        &["--set", "modelsClaim.storageClassName=shared-files"],
    );
    assert_renders_the_same(
        "manifests/overlays/cpu",
        &["-f", "charts/harvest/values-cpu.yaml"],
    );
    let egress = gpu_overlay_with("egress");
    let tree = format!(
        "manifests/{}",
        egress.path().file_name().unwrap().to_str().unwrap()
    );
    assert_renders_the_same(
        &tree,
        &[
            "--set",
            "modelsClaim.storageClassName=shared-files",
            "--set",
            "egress.enabled=true",
        ],
    );
    let prometheus = gpu_overlay_with("prometheus");
    let tree = format!(
        "manifests/{}",
        prometheus.path().file_name().unwrap().to_str().unwrap()
    );
    assert_renders_the_same(
        &tree,
        &[
            "--set",
            "modelsClaim.storageClassName=shared-files",
            "--set",
            "serviceMonitor.enabled=true",
        ],
    );
}

#[test]
fn the_charts_crds_are_the_kustomize_crds_marked_so_no_uninstall_or_prune_deletes_the_ledger() {
    let shipped =
        std::fs::read_to_string(root().join("charts/harvest/crds/harvest.dev.yaml")).unwrap();
    let shipped = documents(&shipped);
    assert_eq!(
        shipped,
        kustomize("manifests/crds"),
        "charts/harvest/crds/harvest.dev.yaml is stale: kubectl kustomize manifests/crds/ > charts/harvest/crds/harvest.dev.yaml"
    );
    for crd in &shipped {
        let annotations = &crd["metadata"]["annotations"];
        assert_eq!(annotations["helm.sh/resource-policy"], "keep");
        assert_eq!(
            annotations["argocd.argoproj.io/sync-options"],
            "Prune=false,Delete=false"
        );
    }
    // Helm installs crds/ before the templates and never upgrades or deletes them; `helm
    // template` leaves them out unless asked.
    let with_crds = chart("harvest-system", &["--include-crds"]);
    let kinds = with_crds
        .iter()
        .filter(|o| o["kind"] == "CustomResourceDefinition")
        .count();
    assert_eq!(kinds, 2);
    assert!(
        chart("harvest-system", &[])
            .iter()
            .all(|o| o["kind"] != "CustomResourceDefinition")
    );
}

#[test]
fn chart_values_set_the_images_storage_object_store_kueue_and_priority_each_in_one_place() {
    let objects = chart(
        "ml-platform",
        &[
            "--set",
            "images.api.repository=registry.example.org/api,images.api.tag=9",
            "--set",
            "images.operator.repository=registry.example.org/operator,images.operator.tag=9",
            "--set",
            "images.worker.repository=registry.example.org/harvester,images.worker.tag=9",
            "--set",
            "modelsClaim.storageClassName=team-files,modelsClaim.size=5Ti",
            "--set",
            "objectStore.endpoint=https://s3.example.org,objectStore.region=eu-west-1",
            "--set",
            "kueue.localQueue=gpu,kueue.workloadPriorityClass=batch",
            "--set",
            "priorityClass.value=50,keysNamespace=ml-keys,operator.scratchStorageClass=fast",
        ],
    );
    let rendered = serde_yaml::to_string(&objects).unwrap();
    assert!(
        !rendered.contains("ghcr.io/harvest-dev"),
        "an image kept the default"
    );
    assert!(
        !rendered.contains("harvest-system"),
        "a namespace is not the release's"
    );
    assert!(
        !rendered.contains("harvest-keys"),
        "a namespace is not keysNamespace"
    );
    let settings = object(&objects, "ConfigMap", "harvest-operator");
    assert_eq!(
        settings["data"]["workerImage"],
        "registry.example.org/harvester:9"
    );
    let config = harvest_operator::OperatorConfig::parse_with(
        settings["data"]["config.yaml"].as_str().unwrap(),
        settings["data"]["workerImage"].as_str().map(str::to_owned),
    )
    .unwrap();
    assert_eq!(config.api_namespace.as_deref(), Some("ml-platform"));
    assert_eq!(config.worker_namespace.as_deref(), Some("ml-platform"));
    assert_eq!(config.scratch_storage_class.as_deref(), Some("fast"));
    for model in &config.models {
        assert_eq!(model.image, "registry.example.org/harvester:9");
        // The queue and its priority on every GPU entry, none on the CPU one.
        let queued = model.gpus > 0;
        assert_eq!(model.local_queue.is_some(), queued, "{}", model.name);
        assert_eq!(
            model.workload_priority_class.as_deref(),
            queued.then_some("batch"),
            "{}",
            model.name
        );
    }
    let claim = object(&objects, "PersistentVolumeClaim", "harvest-models");
    assert_eq!(claim["spec"]["storageClassName"], "team-files");
    assert_eq!(claim["spec"]["resources"]["requests"]["storage"], "5Ti");
    let endpoint = object(&objects, "ConfigMap", "harvest-s3-endpoint");
    assert_eq!(
        endpoint["data"]["AWS_ENDPOINT_URL"],
        "https://s3.example.org"
    );
    assert_eq!(endpoint["data"]["AWS_REGION"], "eu-west-1");
    assert_eq!(
        object(&objects, "PriorityClass", "harvest-gpu")["value"],
        50
    );
    let operator = &object(&objects, "Deployment", "harvest-operator")["spec"]["template"]["spec"]
        ["containers"][0];
    assert_eq!(operator["image"], "registry.example.org/operator:9");
    let args: Vec<&str> = operator["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(
        args.windows(2)
            .any(|w| w == ["--lease-namespace", "ml-platform"]),
        "{args:?}"
    );
    let api = object(&objects, "ConfigMap", "harvest-api");
    let api: serde_json::Value =
        serde_json::from_str(api["data"]["api.json"].as_str().unwrap()).unwrap();
    assert_eq!(api["kubernetes"]["namespace"], "ml-platform");
    assert_eq!(api["kubernetes"]["keys_namespace"], "ml-keys");
    let keys = object(&objects, "RoleBinding", "harvest-api-keys");
    assert_eq!(keys["metadata"]["namespace"], "ml-keys");
    assert_eq!(keys["subjects"][0]["namespace"], "ml-platform");
}

#[test]
fn chart_values_a_platform_mistypes_are_refused_naming_the_value() {
    let refused =
        |set: &str| helm(&["template", "harvest", "charts/harvest", "--set", set]).expect_err(set);
    // A misspelt key is named, not ignored.
    let error = refused("image.tag=1");
    assert!(error.contains("'image' not allowed"), "{error}");
    let error = refused("models[0].lane=medium");
    assert!(
        error.contains("/models/0/lane") && error.contains("small"),
        "{error}"
    );
    let error = refused("api.urlTtlSeconds=9999999");
    assert!(error.contains("/api/urlTtlSeconds"), "{error}");
    let error = refused("objectStore.endpoint=s3.example.org");
    assert!(error.contains("/objectStore/endpoint"), "{error}");
}

#[test]
fn the_chart_lints_clean() {
    for values in [&[][..], &["-f", "charts/harvest/values-cpu.yaml"][..]] {
        let args = [&["lint", "--strict", "charts/harvest"], values].concat();
        helm(&args).unwrap_or_else(|e| panic!("helm {args:?}: {e}"));
    }
}
