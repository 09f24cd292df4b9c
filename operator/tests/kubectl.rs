//! kubectl against the fake apiserver: the platform team's install (`kubectl apply -k
//! manifests/crds/`, then `-k manifests/`), a job applied from YAML, `kubectl get hj` and
//! `kubectl wait`, with the real operator and harvester behind them.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;

use common::Cluster;

/// kubectl run with `stdin` (if any): its output, whether it succeeded or not.
fn run_kubectl(
    kubeconfig: &std::path::Path,
    args: &[&str],
    stdin: Option<&str>,
) -> std::process::Output {
    use std::io::Write;
    let mut child = Command::new("kubectl")
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kubectl is not on PATH: install it (see README, Kubernetes)");
    if let Some(text) = stdin {
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
    }
    drop(child.stdin.take());
    child.wait_with_output().unwrap()
}

/// kubectl, which must succeed: its stdout.
fn kubectl(kubeconfig: &std::path::Path, args: &[&str], stdin: Option<&str>) -> String {
    let output = run_kubectl(kubeconfig, args, stdin);
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "kubectl {args:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_installs_the_manifests_applies_a_job_lists_it_and_waits_for_it() {
    let cluster = Cluster::start(1).await;
    let kubeconfig = cluster.server.write_kubeconfig(cluster.dir.path()).unwrap();
    let manifests = concat!(env!("CARGO_MANIFEST_DIR"), "/../manifests");
    let crds = concat!(env!("CARGO_MANIFEST_DIR"), "/../manifests/crds");
    let prompts = cluster.prompts("kubectl", 4, 1);
    let output = cluster.output("from-kubectl");
    let job = format!(
        "apiVersion: harvest.dev/v1alpha1\nkind: HarvestJob\nmetadata:\n  name: from-kubectl\nspec:\n  model: smollm2-135m\n  input: {{prompts: {prompts}}}\n  harvest: {{layers: [1, 2], shardSize: 2}}\n  output: {}\n  tokenBudget: 10000\n  parallelism: 2\n",
        output.display()
    );
    let (config, job) = (kubeconfig.clone(), job.clone());
    let listed = tokio::task::spawn_blocking(move || {
        let definitions = kubectl(&config, &["apply", "--validate=false", "-k", crds], None);
        assert!(
            definitions
                .contains("customresourcedefinition.apiextensions.k8s.io/harvestjobs.harvest.dev"),
            "{definitions}"
        );
        let applied = kubectl(
            &config,
            &["apply", "--validate=false", "-k", manifests],
            None,
        );
        assert!(
            applied.contains("deployment.apps/harvest-operator created"),
            "{applied}"
        );
        assert!(
            !applied.contains("customresourcedefinition"),
            "the CRDs are applied on their own: {applied}"
        );
        // The short names a platform team types, for the availability objects.
        let budgets = kubectl(
            &config,
            &["-n", "harvest-system", "get", "pdb,netpol", "-o", "name"],
            None,
        );
        assert!(
            budgets.contains("poddisruptionbudget.policy/harvest-api")
                && budgets.contains("networkpolicy.networking.k8s.io/harvest-workers"),
            "{budgets}"
        );
        kubectl(
            &config,
            &["apply", "--validate=false", "-f", "-"],
            Some(&job),
        );
        kubectl(
            &config,
            &[
                "wait",
                "--for=condition=Finished",
                "hj/from-kubectl",
                "--timeout=180s",
            ],
            None,
        );
        kubectl(&config, &["get", "harvest"], None)
    })
    .await
    .unwrap();
    // `harvest` is the category of both kinds: the accounts' table, then the jobs'.
    let header = listed
        .lines()
        .find(|l| l.starts_with("NAME") && l.contains("PHASE"))
        .unwrap();
    for column in [
        "NAME", "PHASE", "MODEL", "PROMPTS", "TOKENS", "PROGRESS", "PARTS", "AGE",
    ] {
        assert!(header.contains(column), "{listed}");
    }
    let row = listed
        .lines()
        .find(|l| {
            l.contains("harvestjob.harvest.dev/from-kubectl") || l.starts_with("from-kubectl")
        })
        .unwrap();
    let account_header = listed
        .lines()
        .find(|l| l.starts_with("NAME") && l.contains("PENDING"))
        .unwrap();
    for column in ["SMALL", "LARGE", "TODAY", "MONTH", "JOBS"] {
        assert!(account_header.contains(column), "{listed}");
    }
    let account = listed.lines().find(|l| l.contains("default-acct")).unwrap();
    assert!(
        account.contains("/8"),
        "the account lane and its limit: {listed}"
    );
    assert!(
        row.contains("Succeeded") && row.contains("smollm2-135m") && row.contains("2/2 shards"),
        "{listed}"
    );
    // Run as two parts, one shard each: done out of total.
    let parts = header.find("PARTS").unwrap();
    assert!(row[parts..].starts_with("2/2 "), "{listed}");
    assert!(output.join("manifest.json").exists());
}

/// kubectl run for its failure: (succeeded, stderr).
fn kubectl_err(kubeconfig: &std::path::Path, args: &[&str], stdin: &str) -> (bool, String) {
    let output = run_kubectl(kubeconfig, args, Some(stdin));
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_with_a_field_past_its_schema_maximum_is_refused_with_422_naming_the_field() {
    let cluster = Cluster::start(1).await;
    let kubeconfig = cluster.server.write_kubeconfig(cluster.dir.path()).unwrap();
    let job = |harvest: &str| {
        format!(
            "apiVersion: harvest.dev/v1alpha1\nkind: HarvestJob\nmetadata:\n  name: too-big\nspec:\n  model: smollm2-135m\n  input: {{prompts: /in.jsonl}}\n  harvest: {harvest}\n  output: /out\n  tokenBudget: 10000\n"
        )
    };
    let (config, past_max, past_u32) = (
        kubeconfig.clone(),
        job("{layers: [1], shardSize: 5000}"),
        job("{layers: [4294967296]}"),
    );
    let (refused, too_wide) = tokio::task::spawn_blocking(move || {
        let apply = ["apply", "--validate=false", "-f", "-"];
        (
            kubectl_err(&config, &apply, &past_max),
            kubectl_err(&config, &apply, &past_u32),
        )
    })
    .await
    .unwrap();
    assert!(!refused.0, "applied: {}", refused.1);
    assert!(
        refused.1.contains("spec.harvest.shardSize")
            && refused.1.contains("less than or equal to 4096"),
        "{}",
        refused.1
    );
    assert!(!too_wide.0, "applied: {}", too_wide.1);
    assert!(
        too_wide.1.contains("spec.harvest.layers[0]") && too_wide.1.contains("4294967295"),
        "{}",
        too_wide.1
    );
    // The apiserver's 422 shape, with a cause per field, as clients read it.
    let jobs: kube::Api<kube::api::DynamicObject> = kube::Api::namespaced_with(
        cluster.client.clone(),
        "default",
        &kube::discovery::ApiResource::erase::<harvest_crds::HarvestJob>(&()),
    );
    let mut object: kube::api::DynamicObject =
        serde_yaml::from_str(&job("{shardSize: 0}")).unwrap();
    object.metadata.namespace = Some("default".into());
    let error = jobs.create(&Default::default(), &object).await.unwrap_err();
    let kube::Error::Api(status) = error else {
        panic!("not a Status: {error}")
    };
    assert_eq!((status.code, status.reason.as_str()), (422, "Invalid"));
    assert!(
        status
            .message
            .contains("HarvestJob.harvest.dev \"too-big\" is invalid"),
        "{}",
        status.message
    );
    assert!(
        jobs.get_opt("too-big").await.unwrap().is_none(),
        "nothing was stored"
    );
}

/// The objects `kubectl kustomize dir` renders.
fn kustomize(dir: &std::path::Path) -> Vec<serde_yaml::Value> {
    let output = Command::new("kubectl")
        .arg("kustomize")
        .arg(dir)
        .output()
        .expect("kubectl is not on PATH: install it (see README, Kubernetes)");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8(output.stdout).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|document| serde::Deserialize::deserialize(document).unwrap())
        .collect()
}

fn object<'a>(objects: &'a [serde_yaml::Value], kind: &str, name: &str) -> &'a serde_yaml::Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

#[test]
fn an_overlay_sets_the_images_the_models_storage_and_the_object_store_each_in_one_place() {
    let manifests = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests");
    for overlay in ["gpu", "cpu"] {
        // What a platform team writes: one images list, one storage class, one endpoint.
        let dir = tempfile::tempdir().unwrap();
        let overlay_dir = manifests
            .join("overlays")
            .join(overlay)
            .canonicalize()
            .unwrap();
        // Kustomize takes a relative path only: up from the scratch directory to the root.
        let depth = dir.path().canonicalize().unwrap().components().count() - 1;
        let base = format!(
            "{}{}",
            "../".repeat(depth),
            overlay_dir.strip_prefix("/").unwrap().display()
        );
        std::fs::write(
            dir.path().join("kustomization.yaml"),
            format!(
                "resources: [{base}]\nimages:\n- {{name: ghcr.io/harvest-dev/harvest-api, newName: registry.example.org/api, newTag: '9'}}\n- {{name: ghcr.io/harvest-dev/harvest-operator, newName: registry.example.org/operator, newTag: '9'}}\n- {{name: ghcr.io/harvest-dev/harvester, newName: registry.example.org/harvester, newTag: '9'}}\npatches:\n- target: {{kind: PersistentVolumeClaim, name: harvest-models}}\n  patch: '[{{\"op\": \"add\", \"path\": \"/spec/storageClassName\", \"value\": \"team-files\"}}]'\nconfigMapGenerator:\n- {{name: harvest-s3-endpoint, namespace: harvest-system, behavior: merge, options: {{disableNameSuffixHash: true}}, literals: [AWS_ENDPOINT_URL=https://s3.example.org]}}\n"
            ),
        )
        .unwrap();
        let objects = kustomize(dir.path());
        let rendered = serde_yaml::to_string(&objects).unwrap();
        assert!(
            !rendered.contains("ghcr.io/harvest-dev"),
            "{overlay}: an image was not retagged"
        );
        let settings = object(&objects, "ConfigMap", "harvest-operator");
        assert_eq!(
            settings["data"]["workerImage"], "registry.example.org/harvester:9",
            "{overlay}"
        );
        let config = harvest_operator::OperatorConfig::parse_with(
            settings["data"]["config.yaml"].as_str().unwrap(),
            settings["data"]["workerImage"].as_str().map(str::to_owned),
        )
        .unwrap();
        assert!(
            config
                .models
                .iter()
                .all(|m| m.image == "registry.example.org/harvester:9")
        );
        assert_eq!(
            config.worker_env_config_map.as_deref(),
            Some("harvest-s3-endpoint")
        );
        let claim = object(&objects, "PersistentVolumeClaim", "harvest-models");
        assert_eq!(claim["spec"]["storageClassName"], "team-files", "{overlay}");
        let endpoint = object(&objects, "ConfigMap", "harvest-s3-endpoint");
        assert_eq!(
            endpoint["data"]["AWS_ENDPOINT_URL"],
            "https://s3.example.org"
        );
        // The API and the operator read that one ConfigMap, as the workers do.
        for deployment in ["harvest-api", "harvest-operator"] {
            let container = &object(&objects, "Deployment", deployment)["spec"]["template"]["spec"]
                ["containers"][0];
            let sources = container["envFrom"].as_sequence().unwrap();
            assert!(
                sources
                    .iter()
                    .any(|s| s["configMapRef"]["name"] == "harvest-s3-endpoint"),
                "{overlay}: {deployment}"
            );
        }
    }
}

#[test]
fn the_crds_are_applied_on_their_own_and_marked_so_no_prune_or_uninstall_deletes_the_ledger() {
    let manifests = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests");
    let definitions = kustomize(&manifests.join("crds"));
    let names: Vec<&str> = definitions
        .iter()
        .map(|o| o["metadata"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["harvestaccounts.harvest.dev", "harvestjobs.harvest.dev"]
    );
    for crd in &definitions {
        let annotations = &crd["metadata"]["annotations"];
        assert_eq!(
            annotations["argocd.argoproj.io/sync-options"],
            "Prune=false,Delete=false"
        );
        assert_eq!(annotations["kustomize.toolkit.fluxcd.io/prune"], "disabled");
        assert_eq!(annotations["helm.sh/resource-policy"], "keep");
    }
    // What `kubectl delete -k` of the base or an overlay deletes holds no CRD.
    for tree in ["", "base", "overlays/gpu", "overlays/cpu"] {
        let objects = kustomize(&manifests.join(tree));
        assert!(
            objects
                .iter()
                .all(|o| o["kind"] != "CustomResourceDefinition"),
            "manifests/{tree} renders a CRD"
        );
    }
}

#[test]
fn the_base_keeps_a_replica_of_each_deployment_through_a_drain_and_lets_nothing_reach_a_worker() {
    let manifests = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests");
    let objects = kustomize(&manifests);
    for deployment in ["harvest-api", "harvest-operator"] {
        let budget = object(&objects, "PodDisruptionBudget", deployment);
        assert_eq!(budget["spec"]["minAvailable"], 1, "{deployment}");
        let selects = &budget["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"];
        assert_eq!(selects, deployment);
        let spec = &object(&objects, "Deployment", deployment)["spec"]["template"]["spec"];
        let spread = &spec["topologySpreadConstraints"][0];
        assert_eq!(
            spread["topologyKey"], "kubernetes.io/hostname",
            "{deployment}"
        );
        let requests = &spec["containers"][0]["resources"]["requests"];
        assert!(
            requests["cpu"].is_string() && requests["memory"].is_string(),
            "{deployment}"
        );
    }
    // The policy selects workers by the label the operator puts on every worker Pod.
    let (key, value) = harvest_operator::pod::MANAGED_BY;
    let workers = object(&objects, "NetworkPolicy", "harvest-workers");
    assert_eq!(workers["spec"]["podSelector"]["matchLabels"][key], value);
    assert_eq!(workers["spec"]["policyTypes"][0], "Ingress");
    assert_eq!(
        workers["spec"]["ingress"].as_sequence().map(Vec::len),
        Some(0)
    );
    let settings = object(&objects, "ConfigMap", "harvest-operator");
    let config = harvest_operator::OperatorConfig::parse_with(
        settings["data"]["config.yaml"].as_str().unwrap(),
        settings["data"]["workerImage"].as_str().map(str::to_owned),
    )
    .unwrap();
    let priority = object(&objects, "PriorityClass", "harvest-gpu");
    assert_eq!(priority["preemptionPolicy"], "Never");
    for model in config.models.iter().filter(|m| m.gpus > 0) {
        assert_eq!(
            model.priority_class_name.as_deref(),
            Some("harvest-gpu"),
            "{}",
            model.name
        );
    }
}

/// The objects of the GPU overlay with `component` added, as a platform's overlay adds it.
fn gpu_overlay_with(component: &str) -> Vec<serde_yaml::Value> {
    let manifests = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../manifests")
        .canonicalize()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let up = "../".repeat(dir.path().canonicalize().unwrap().components().count() - 1);
    let root = manifests.strip_prefix("/").unwrap().display().to_string();
    std::fs::write(
        dir.path().join("kustomization.yaml"),
        format!(
            "resources: [{up}{root}/overlays/gpu]\ncomponents: [{up}{root}/components/{component}]\n"
        ),
    )
    .unwrap();
    kustomize(dir.path())
}

#[test]
fn the_egress_component_lets_every_harvest_pod_resolve_names_and_reach_https_past_a_deny() {
    let objects = gpu_overlay_with("egress");
    let policy = object(&objects, "NetworkPolicy", "harvest-egress");
    assert_eq!(policy["metadata"]["namespace"], "harvest-system");
    // Every Pod there: the API, the operator and the workers.
    assert_eq!(
        policy["spec"]["podSelector"],
        serde_yaml::Value::Mapping(Default::default())
    );
    assert_eq!(policy["spec"]["policyTypes"][0], "Egress");
    let rules = policy["spec"]["egress"].as_sequence().unwrap();
    let allows = |protocol: &str, port: u64| {
        rules.iter().any(|rule| {
            rule["ports"]
                .as_sequence()
                .unwrap()
                .iter()
                .any(|p| p["protocol"] == protocol && p["port"] == port)
        })
    };
    assert!(allows("UDP", 53) && allows("TCP", 53) && allows("TCP", 443) && allows("TCP", 6443));
    let dns = rules.iter().find(|r| r["ports"][0]["port"] == 53).unwrap();
    assert_eq!(
        dns["to"][0]["podSelector"]["matchLabels"]["k8s-app"],
        "kube-dns"
    );
}

#[test]
fn the_prometheus_component_scrapes_both_metrics_ports_and_the_public_service_exposes_none() {
    let objects = gpu_overlay_with("prometheus");
    let monitor = object(&objects, "ServiceMonitor", "harvest");
    let selector = &monitor["spec"]["selector"]["matchLabels"];
    let scraped: Vec<&serde_yaml::Value> = objects
        .iter()
        .filter(|o| o["kind"] == "Service")
        .filter(|s| {
            selector
                .as_mapping()
                .unwrap()
                .iter()
                .all(|(k, v)| &s["metadata"]["labels"][k] == v)
        })
        .collect();
    let names: Vec<&str> = scraped
        .iter()
        .map(|s| s["metadata"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    for service in scraped {
        assert_eq!(service["spec"]["ports"][0]["name"], "metrics");
        assert_eq!(service["spec"]["ports"][0]["port"], 9090);
    }
    let public = object(&objects, "Service", "harvest-api");
    let ports = public["spec"]["ports"].as_sequence().unwrap();
    assert!(ports.iter().all(|p| p["name"] != "metrics"), "{ports:?}");
    let api =
        &object(&objects, "Deployment", "harvest-api")["spec"]["template"]["spec"]["containers"][0];
    let args: Vec<&str> = api["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    assert!(
        args.windows(2)
            .any(|w| w == ["--metrics-listen", "0.0.0.0:9090"]),
        "{args:?}"
    );
}
