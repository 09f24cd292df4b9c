//! The real tier only (`scripts/cluster.sh up --real`): what a real control plane does that
//! the fake apiserver does not, each shown on the shipped manifests as a platform team applies
//! them. CRD defaults, pruning and CEL; uninstall and namespace deletion with jobs in flight;
//! a node that stops heartbeating; a ResourceQuota that refuses a worker; a watch answered
//! 410 Gone after an etcd compaction; Kueue (a job queued in a full ClusterQueue, a worker
//! it evicts); the Helm chart installed, upgraded with a job in flight and uninstalled.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use harvest_e2e::{Install, LocalCluster, Tier, WITHIN, eventually};
use serde_json::Value;

/// How long an uninstall or a namespace deletion may take (issue 36: within a minute).
const DELETION: Duration = Duration::from_secs(60);

fn json(cluster: &LocalCluster, args: &[&str]) -> Value {
    let mut all = vec!["get"];
    all.extend_from_slice(args);
    all.extend(["-o", "json"]);
    serde_json::from_str(&cluster.kubectl(&all).unwrap()).unwrap()
}

/// `kubectl apply` of the example job in `namespace`.
fn apply_example_job(cluster: &LocalCluster, namespace: &str) {
    cluster
        .kubectl(&[
            "apply",
            "-f",
            "manifests/examples/harvestjob.yaml",
            "-n",
            namespace,
        ])
        .unwrap();
}

/// The example job, in `namespace`, with a corpus large enough to still run when a test acts.
async fn example_job_running(cluster: &LocalCluster, namespace: &str) -> [String; 4] {
    cluster.tenant(namespace);
    cluster.upload_example_prompts(320, 60).await;
    apply_example_job(cluster, namespace);
    let job = [
        "harvestjob".to_owned(),
        "smollm2-quartiles".to_owned(),
        "-n".to_owned(),
        namespace.to_owned(),
    ];
    let args: Vec<&str> = job.iter().map(String::as_str).collect();
    eventually("the example job running", WITHIN, || {
        let running = cluster.field(&args, "{.status.conditions[?(@.type==\"Running\")].reason}");
        (running == "PodRunning").then_some(()).ok_or(running)
    })
    .await;
    job
}

/// `kubectl delete WHAT`, which waits until it is gone: within [`DELETION`].
fn delete_within_a_minute(cluster: &LocalCluster, what: &[&str]) {
    let started = std::time::Instant::now();
    let timeout = format!("--timeout={}s", DELETION.as_secs());
    cluster
        .kubectl(&[&["delete"], what, &[timeout.as_str()]].concat())
        .unwrap();
    assert!(
        started.elapsed() <= DELETION,
        "took {:?}",
        started.elapsed()
    );
}

/// Names of objects of `kind` (all namespaces) that are being deleted.
fn terminating(cluster: &LocalCluster, kind: &str) -> Vec<String> {
    let list = json(cluster, &[kind, "-A"]);
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o["metadata"]["deletionTimestamp"].is_string())
        .map(|o| {
            format!(
                "{} {}/{}",
                kind,
                o["metadata"]["namespace"].as_str().unwrap_or_default(),
                o["metadata"]["name"].as_str().unwrap_or_default()
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_crds_apply_without_warnings_and_their_defaults_pruning_and_cel_rules_act() {
    let cluster = LocalCluster::up_on(Tier::Real);
    let warnings: Vec<&str> = cluster
        .setup_log
        .lines()
        .filter(|l| l.starts_with("Warning:"))
        .collect();
    assert!(warnings.is_empty(), "kubectl apply -k warned: {warnings:?}");
    cluster
        .kubectl(&["create", "namespace", "crd-check"])
        .unwrap();
    let job = "apiVersion: harvest.dev/v1alpha1\nkind: HarvestJob\nmetadata: {name: bare, namespace: crd-check}\nspec:\n  model: smollm2-135m\n  input: {prompts: s3://harvest-inputs/p.jsonl}\n  output: s3://harvest-outputs/bare\n  tokenBudget: 1000\n  notAField: 1\n";
    // kubectl's default field validation is the server's, strict: the unknown field is named.
    let refused = cluster
        .kubectl_with_input(&["apply", "-f", "-"], Some(job))
        .unwrap_err();
    assert!(refused.contains("notAField"), "{refused}");
    // Told to ignore it, the apiserver prunes it; the schema's defaults fill what was omitted.
    cluster
        .kubectl_with_input(&["apply", "--validate=false", "-f", "-"], Some(job))
        .unwrap();
    let stored = json(&cluster, &["harvestjob", "bare", "-n", "crd-check"]);
    let spec = &stored["spec"];
    assert!(spec.get("notAField").is_none(), "not pruned: {spec}");
    assert_eq!(spec["backoffLimit"], 3, "{spec}");
    assert_eq!(spec["cancel"], false, "{spec}");
    assert_eq!(spec["harvest"]["addSpecialTokens"], true, "{spec}");
    // CEL: a cancel cannot be taken back.
    let patch = |cancel: bool| {
        cluster.kubectl(&[
            "patch",
            "harvestjob",
            "bare",
            "-n",
            "crd-check",
            "--type=merge",
            "-p",
            &format!(r#"{{"spec":{{"cancel":{cancel}}}}}"#),
        ])
    };
    patch(true).unwrap();
    let refused = patch(false).unwrap_err();
    assert!(refused.contains("cancel cannot be undone"), "{refused}");
    // And an account's storage prefix must be a bucket URL or an absolute path.
    let account = "apiVersion: harvest.dev/v1alpha1\nkind: HarvestAccount\nmetadata: {name: crooked}\nspec:\n  storage: {prefix: bucket/without/scheme}\n";
    let refused = cluster
        .kubectl_with_input(&["apply", "-f", "-"], Some(account))
        .unwrap_err();
    assert!(
        refused.contains("prefix must be s3://bucket/prefix or an absolute path"),
        "{refused}"
    );
    // So must each of the prefixes its jobs may name, and its LocalQueue must be a name.
    let account = "apiVersion: harvest.dev/v1alpha1\nkind: HarvestAccount\nmetadata: {name: crooked}\nspec:\n  storagePrefixes: [s3://fine/team, relative/dir]\n  localQueue: GPU_Queue\n";
    let refused = cluster
        .kubectl_with_input(&["apply", "-f", "-"], Some(account))
        .unwrap_err();
    assert!(
        refused
            .contains("each storagePrefixes item must be s3://bucket/prefix or an absolute path"),
        "{refused}"
    );
    assert!(refused.contains("spec.localQueue"), "{refused}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_tenant_namespace_with_a_job_in_flight_while_the_operator_is_down_finishes_within_a_minute()
 {
    let cluster = LocalCluster::up_on(Tier::Real);
    let job = example_job_running(&cluster, "my-team").await;
    let worker = cluster.field(&job.each_ref().map(String::as_str), "{.status.pod}");
    assert!(!worker.is_empty());
    // The operator is down (an upgrade, a bad rollout): nothing of the tenant's may wait on it.
    let ns = ["-n", "harvest-system"];
    let run = |args: &[&str]| cluster.kubectl(&[args, &ns[..]].concat()).unwrap();
    run(&["scale", "deployment/harvest-operator", "--replicas=0"]);
    eventually("no operator Pod left", WITHIN, || {
        let pods = cluster.field(
            &[
                "pods",
                "-n",
                "harvest-system",
                "-l",
                "app.kubernetes.io/name=harvest-operator",
            ],
            "{.items[*].metadata.name}",
        );
        pods.is_empty().then_some(()).ok_or(pods)
    })
    .await;
    delete_within_a_minute(&cluster, &["namespace", "my-team"]);
    // Back up, the operator sweeps the orphaned worker; nothing is left being deleted.
    run(&["scale", "deployment/harvest-operator", "--replicas=2"]);
    eventually("the worker Pod gone", WITHIN, || {
        let pods = cluster.field(
            &["pods", "-n", "harvest-system"],
            "{.items[*].metadata.name}",
        );
        (!pods.split_whitespace().any(|p| p == worker))
            .then_some(())
            .ok_or(pods)
    })
    .await;
    for kind in ["namespaces", "pods", "harvestjobs"] {
        assert_eq!(terminating(&cluster, kind), Vec::<String>::new());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_delete_of_the_manifests_mid_job_ends_within_a_minute_and_keeps_the_ledger() {
    let cluster = LocalCluster::up_on(Tier::Real);
    let job = example_job_running(&cluster, "my-team").await;
    let job: Vec<&str> = job.iter().map(String::as_str).collect();
    delete_within_a_minute(&cluster, &["-k", "manifests/"]);
    // The CRDs are not part of it (manifests/crds/ is applied on its own), so the accounts,
    // whose status is the token ledger, and the tenant's job are still there.
    let crds = cluster.field(&["crd"], "{.items[*].metadata.name}");
    for crd in ["harvestaccounts.harvest.dev", "harvestjobs.harvest.dev"] {
        assert!(crds.split_whitespace().any(|c| c == crd), "{crds}");
    }
    let account = json(&cluster, &["harvestaccount", "interp-team"]);
    assert!(account["status"].is_object(), "{account}");
    assert_eq!(
        json(&cluster, &job)["metadata"]["name"],
        "smollm2-quartiles"
    );
    assert_eq!(terminating(&cluster, "namespaces"), Vec::<String>::new());
    assert_eq!(terminating(&cluster, "harvestjobs"), Vec::<String>::new());
    eventually("no harvest Pod left", DELETION, || {
        let pods = cluster.field(&["pods", "-A"], "{.items[*].metadata.name}");
        pods.is_empty().then_some(()).ok_or(pods)
    })
    .await;
    // Removing them on purpose, as docs/install.md says, takes the jobs with them.
    delete_within_a_minute(&cluster, &["-k", "manifests/crds/"]);
    let crds = cluster.field(&["crd"], "{.items[*].metadata.name}");
    assert!(!crds.contains("harvest.dev"), "{crds}");
}

/// The images the harvest-system Deployments run, by Deployment name.
fn deployment_images(cluster: &LocalCluster) -> String {
    cluster.field(
        &["deployments", "-n", "harvest-system"],
        "{range .items[*]}{.metadata.name}={.spec.template.spec.containers[0].image} {end}",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_installs_the_chart_upgrades_it_with_a_job_in_flight_and_uninstalls_it_keeping_the_ledger_weights_and_keys()
 {
    // docs/install.md's Helm install: the namespace, the chart (its crds/ first).
    let cluster = LocalCluster::up_installing(Tier::Real, Install::Helm);
    let releases = cluster
        .helm(&["list", "-n", "harvest-system", "-o", "json"])
        .unwrap();
    let releases: Value = serde_json::from_str(&releases).unwrap();
    assert_eq!(releases[0]["name"], "harvest", "{releases}");
    assert_eq!(releases[0]["status"], "deployed", "{releases}");
    let job = example_job_running(&cluster, "my-team").await;
    let job: Vec<&str> = job.iter().map(String::as_str).collect();
    let first_worker = cluster.field(&job, "{.status.workerImage}");
    assert_eq!(first_worker, "ghcr.io/harvest-dev/harvester:0.1.0");
    // The next release, every image, while the job runs.
    cluster
        .helm(&[
            "upgrade",
            "harvest",
            "charts/harvest",
            "-n",
            "harvest-system",
            "--set-string",
            "images.api.tag=0.1.1,images.operator.tag=0.1.1,images.worker.tag=0.1.1",
        ])
        .unwrap();
    cluster
        .kubectl(&[
            "rollout",
            "status",
            "-n",
            "harvest-system",
            "deployment/harvest-operator",
            "deployment/harvest-api",
            "--timeout=240s",
        ])
        .unwrap();
    let images = deployment_images(&cluster);
    assert!(
        images.contains("harvest-api=ghcr.io/harvest-dev/harvest-api:0.1.1")
            && images.contains("harvest-operator=ghcr.io/harvest-dev/harvest-operator:0.1.1"),
        "{images}"
    );
    // The new operator finishes the job on the harvester it started with, charged once.
    let stored = succeeded_and_charged_once(&cluster, &job).await;
    assert_eq!(stored["status"]["workerImage"], first_worker);
    // The upgraded API serves: a key made as the install guide makes it lists the models.
    let key = cluster.create_key_in_api_pod("interp-team").unwrap();
    let models: Value = reqwest::Client::new()
        .get(format!("{}/models", cluster.api))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(models.to_string().contains("smollm2-135m"), "{models}");
    // Uninstall: what the templates made goes but the data: the models claim and the keys'
    // namespace (helm.sh/resource-policy: keep), and the CRDs (crds/, which Helm never
    // deletes) with the account's ledger and the job.
    cluster
        .helm(&["uninstall", "harvest", "-n", "harvest-system"])
        .unwrap();
    let crds = cluster.field(&["crd"], "{.items[*].metadata.name}");
    for crd in ["harvestaccounts.harvest.dev", "harvestjobs.harvest.dev"] {
        assert!(crds.split_whitespace().any(|c| c == crd), "{crds}");
    }
    let account = json(&cluster, &["harvestaccount", "interp-team"]);
    assert_eq!(
        account["status"]["tokensTotal"], stored["status"]["tokens"]["charged"],
        "{account}"
    );
    assert_eq!(json(&cluster, &job)["status"]["phase"], "Succeeded");
    eventually("no Deployment, API or operator Pod left", DELETION, || {
        let left = cluster.field(
            &[
                "deployments,pods",
                "-n",
                "harvest-system",
                "-l",
                "app.kubernetes.io/name in (harvest-api,harvest-operator)",
            ],
            "{.items[*].metadata.name}",
        );
        left.is_empty().then_some(()).ok_or(left)
    })
    .await;
    let roles = cluster.field(&["clusterroles"], "{.items[*].metadata.name}");
    assert!(!roles.contains("harvest-"), "{roles}");
    let claim = json(&cluster, &["pvc", "harvest-models", "-n", "harvest-system"]);
    assert!(claim["metadata"]["deletionTimestamp"].is_null(), "{claim}");
    assert_eq!(claim["status"]["phase"], "Bound");
    assert_eq!(terminating(&cluster, "namespaces"), Vec::<String>::new());
    // A later install picks up where this one was: the same key still opens the API.
    cluster
        .helm(&[
            "install",
            "harvest",
            "charts/harvest",
            "-n",
            "harvest-system",
        ])
        .unwrap();
    cluster
        .kubectl(&[
            "rollout",
            "status",
            "-n",
            "harvest-system",
            "deployment/harvest-api",
            "--timeout=240s",
        ])
        .unwrap();
    let service = cluster
        .state_dir()
        .join("agents/services/harvest-system.harvest-api.80");
    let deadline = tokio::time::Instant::now() + WITHIN;
    loop {
        let answer = match std::fs::read_to_string(&service) {
            Ok(port) => reqwest::Client::new()
                .get(format!("http://127.0.0.1:{}/v1/models", port.trim()))
                .bearer_auth(&key)
                .send()
                .await
                .map(|r| r.status().to_string())
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if answer.as_deref() == Ok("200 OK") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the reinstalled API did not take the old key: {answer:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The job's record as it ends: Succeeded, charged exactly its tokens, and the account's lane
/// slot and hold released with the account's book counting it once.
async fn succeeded_and_charged_once(cluster: &LocalCluster, job: &[&str]) -> Value {
    if let Err(error) =
        cluster.kubectl(&[&["wait", "--for=condition=Finished", "--timeout=240s"], job].concat())
    {
        let pods = cluster
            .kubectl(&["get", "pods", "-A", "-o", "wide"])
            .unwrap_or_else(|e| e);
        panic!(
            "{error}\nthe job: {}\nthe Pods:\n{pods}",
            json(cluster, job)["status"]
        );
    }
    let stored = json(cluster, job);
    let status = &stored["status"];
    assert_eq!(status["phase"], "Succeeded", "{status}");
    let tokens = status["result"]["tokens"].as_u64().unwrap();
    assert_eq!(status["tokens"]["charged"], tokens, "{status}");
    eventually(
        "the account charged once, its slot and hold released",
        WITHIN,
        || {
            let account = json(cluster, &["harvestaccount", "interp-team"]);
            let book = &account["status"];
            let settled = book["tokensTotal"] == tokens
                && book["active"]["small"] == 0
                && book["holds"].as_array().is_none_or(Vec::is_empty);
            settled.then_some(()).ok_or_else(|| book.to_string())
        },
    )
    .await;
    stored
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_stops_heartbeating_loses_its_worker_and_the_job_retries_elsewhere_charged_once()
 {
    let cluster = LocalCluster::up_on(Tier::Real);
    // A lost Pod is given up 5 s past its grace period (the default, 120 s, is for clusters).
    cluster.set_operator_config(|config| {
        config.replacen("apiNamespace:", "podLostAfterSeconds: 5\napiNamespace:", 1)
    });
    let job = example_job_running(&cluster, "my-team").await;
    let job = job.each_ref().map(String::as_str);
    let first = cluster.field(&job, "{.status.pod}");
    let node = cluster.field(&["pod", &first, "-n", "harvest-system"], "{.spec.nodeName}");
    // The node hangs: no heartbeats, and its processes (the worker's too) stop.
    cluster.signal_node(&node, "STOP");
    eventually("the node marked unreachable", WITHIN, || {
        let taints = cluster.field(&["node", &node], "{.spec.taints[*].key}");
        taints
            .contains("node.kubernetes.io/unreachable")
            .then_some(())
            .ok_or(taints)
    })
    .await;
    let stored = succeeded_and_charged_once(&cluster, &job).await;
    cluster.signal_node(&node, "CONT");
    let status = &stored["status"];
    // The lost attempt was the cluster's fault: retried, not counted against backoffLimit.
    assert_eq!(status["attempts"], 2, "{status}");
    assert_eq!(status["failures"], 0, "{status}");
    let second = status["pod"].as_str().unwrap();
    assert_ne!(second, first);
    let events = cluster.field(
        &[
            "events",
            "-n",
            "my-team",
            "--field-selector",
            "involvedObject.name=smollm2-quartiles",
        ],
        "{.items[*].reason}",
    );
    assert!(events.contains("PodLost"), "{events}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resourcequota_that_refuses_the_worker_holds_the_job_waiting_until_it_frees() {
    let cluster = LocalCluster::up_on(Tier::Real);
    // Room for what runs in harvest-system now, not for a worker's 2 CPUs.
    let quota = |cpu: &str| {
        format!(
            "apiVersion: v1\nkind: ResourceQuota\nmetadata: {{name: workers, namespace: harvest-system}}\nspec: {{hard: {{requests.cpu: \"{cpu}\"}}}}\n"
        )
    };
    cluster
        .kubectl_with_input(&["apply", "-f", "-"], Some(&quota("1")))
        .unwrap();
    cluster.tenant("my-team");
    cluster.upload_example_prompts(8, 20).await;
    apply_example_job(&cluster, "my-team");
    let job = ["harvestjob", "smollm2-quartiles", "-n", "my-team"];
    let waiting = eventually("the job waiting for quota", WITHIN, || {
        let running = json(&cluster, &job)["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["type"] == "Running")
            .cloned()
            .unwrap_or_default();
        (running["reason"] == "WaitingForQuota")
            .then_some(running.clone())
            .ok_or_else(|| running.to_string())
    })
    .await;
    assert!(
        waiting["message"]
            .as_str()
            .unwrap()
            .contains("exceeded quota"),
        "{waiting}"
    );
    // Waiting is not failing: nothing counted against backoffLimit while the quota holds.
    let stored = json(&cluster, &job);
    assert_eq!(stored["status"]["phase"], "Running", "{stored}");
    assert_eq!(stored["status"]["failures"], 0, "{stored}");
    cluster
        .kubectl_with_input(&["apply", "-f", "-"], Some(&quota("20")))
        .unwrap();
    let stored = succeeded_and_charged_once(&cluster, &job).await;
    assert_eq!(stored["status"]["failures"], 0, "{stored}");
    // The worker's log, through the apiserver from its node's kubelet API: its result.
    let pod = stored["status"]["pod"].as_str().unwrap();
    let log = cluster
        .kubectl(&["logs", "-n", "harvest-system", pod])
        .unwrap();
    assert!(log.contains("layer_indices"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_answered_410_after_an_etcd_compaction_lists_again_and_the_operator_runs_jobs() {
    let cluster = LocalCluster::up_on(Tier::Real);
    // A Lease that outlasts the restart below: the leader keeps leading, and its watches
    // (not a fresh process's) must recover.
    let ns = ["-n", "harvest-system"];
    let run = |args: &[&str]| cluster.kubectl(&[args, &ns[..]].concat()).unwrap();
    run(&[
        "set",
        "env",
        "deployment/harvest-operator",
        "HARVEST_LEASE_SECONDS=120",
    ]);
    run(&[
        "rollout",
        "status",
        "deployment/harvest-operator",
        "--timeout=240s",
    ]);
    // A replica of the new template leads (it writes its Lease's duration).
    eventually("a 120 s Lease held", WITHIN, || {
        let lease = &["lease", "harvest-operator", "-n", "harvest-system"];
        let seconds = cluster.field(lease, "{.spec.leaseDurationSeconds}");
        (seconds == "120").then_some(()).ok_or(seconds)
    })
    .await;
    cluster.tenant("my-team");
    cluster.upload_example_prompts(8, 20).await;
    let list: Value = serde_json::from_str(
        &cluster
            .kubectl(&["get", "--raw", "/apis/harvest.dev/v1alpha1/harvestjobs"])
            .unwrap(),
    )
    .unwrap();
    let before = list["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_owned();
    // Changes past the operator's last resourceVersion, a compaction past them all, then an
    // apiserver restart (as an upgrade does): each watch comes back with a resourceVersion
    // older than the new watch cache and than etcd's history.
    for i in 0..20 {
        let name = format!("churn-{i}");
        cluster
            .kubectl(&["create", "configmap", &name, "-n", "my-team"])
            .unwrap();
    }
    let revision = cluster.compact_etcd();
    assert!(revision > before.trim().parse::<u64>().unwrap());
    cluster.restart_apiserver().await;
    // The server's side: a watch from before is refused, 410 Gone.
    let refused = cluster
        .kubectl(&[
            "get",
            "--raw",
            &format!(
                "/apis/harvest.dev/v1alpha1/harvestjobs?watch=1&resourceVersion={}&timeoutSeconds=1",
                before.trim()
            ),
        ])
        .unwrap_or_else(|e| e);
    assert!(
        refused.contains("410") && refused.contains("too old resource version"),
        "{refused}"
    );
    // The operator's watches, cut by the restart, were answered 410 and listed again: a job
    // applied now runs to the end, charged once.
    apply_example_job(&cluster, "my-team");
    succeeded_and_charged_once(
        &cluster,
        &["harvestjob", "smollm2-quartiles", "-n", "my-team"],
    )
    .await;
    // Every operator Pod's log, replaced ones included: the one that saw the 410 may have
    // been rescheduled since.
    let logs = cluster.pod_logs_ever("harvest-system", "harvest-operator-");
    assert!(
        logs.contains("a watch failed") && logs.contains("too old resource version"),
        "no operator saw the 410:\n{logs}"
    );
}

/// Kueue's queues for the workers: a ClusterQueue with room for one worker (2 CPUs) and its
/// LocalQueue `harvest` in the workers' namespace.
const QUEUES: &str = "apiVersion: kueue.x-k8s.io/v1beta2
kind: ResourceFlavor
metadata: {name: default}
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: ClusterQueue
metadata: {name: workers}
spec:
  namespaceSelector: {}
  resourceGroups:
  - coveredResources: [cpu, memory]
    flavors:
    - name: default
      resources:
      - {name: cpu, nominalQuota: \"2\"}
      - {name: memory, nominalQuota: 16Gi}
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: LocalQueue
metadata: {name: harvest, namespace: harvest-system}
spec: {clusterQueue: workers}
";

/// Another team's workload that fills the ClusterQueue: admitted, then left waiting for a
/// node that never comes, so it holds the quota until it is deleted.
const BLOCKER: &str = "apiVersion: v1
kind: Pod
metadata:
  name: other-team-training
  namespace: harvest-system
  labels: {kueue.x-k8s.io/queue-name: harvest}
spec:
  nodeSelector: {harvest.dev/no-such-node: \"true\"}
  securityContext: {runAsNonRoot: true, runAsUser: 1000, seccompProfile: {type: RuntimeDefault}}
  containers:
  - name: train
    image: registry.example/train:1
    resources: {requests: {cpu: \"2\", memory: 1Gi}}
    securityContext: {allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}}
";

/// The test model's workers queue in Kueue's LocalQueue `harvest`; `more` is one more line of
/// its catalogue entry.
fn queue_the_test_model(cluster: &LocalCluster, more: &str) {
    cluster.set_operator_config(|config| {
        let line = config
            .lines()
            .find(|l| l.trim() == "path: /models/smollm2-135m")
            .unwrap()
            .to_owned();
        let indent = &line[..line.len() - line.trim_start().len()];
        config.replacen(
            &line,
            &format!("{line}\n{indent}localQueue: harvest\n{indent}{more}"),
            1,
        )
    });
}

/// The Kueue Workloads of a worker Pod.
fn workloads_of(cluster: &LocalCluster, pod: &str) -> Vec<Value> {
    let workloads = json(cluster, &["workloads", "-n", "harvest-system"]);
    workloads["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|w| w["metadata"]["ownerReferences"][0]["name"] == pod)
        .cloned()
        .collect()
}

/// The scheduling gates on a Pod, space-separated ("" when none or when it is gone).
fn gates(cluster: &LocalCluster, pod: &str) -> String {
    cluster.field(
        &["pod", pod, "-n", "harvest-system"],
        "{.spec.schedulingGates[*].name}",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_queued_in_a_full_kueue_cluster_queue_waits_past_its_start_timeout_then_runs_charged_once()
 {
    let cluster = LocalCluster::up_on(Tier::Real);
    let _kueue = cluster.start_kueue().await;
    cluster
        .kubectl_with_input(&["apply", "-f", "-"], Some(QUEUES))
        .unwrap();
    cluster
        .kubectl_with_input(&["apply", "-f", "-"], Some(BLOCKER))
        .unwrap();
    eventually("the other team's workload admitted", WITHIN, || {
        let gates = gates(&cluster, "other-team-training");
        gates.is_empty().then_some(()).ok_or(gates)
    })
    .await;
    // A worker that waits for a node fails its job after 5 s: a queued worker must not.
    const START_TIMEOUT: u64 = 5;
    queue_the_test_model(&cluster, &format!("startTimeoutSeconds: {START_TIMEOUT}"));
    cluster.tenant("my-team");
    cluster.upload_example_prompts(8, 20).await;
    apply_example_job(&cluster, "my-team");
    let job = ["harvestjob", "smollm2-quartiles", "-n", "my-team"];
    let running = || {
        json(&cluster, &job)["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["type"] == "Running")
            .cloned()
            .unwrap_or_default()
    };
    let waiting = eventually("the job waiting for its queue", WITHIN, || {
        let running = running();
        (running["reason"] == "WaitingForQueue")
            .then_some(running.clone())
            .ok_or_else(|| running.to_string())
    })
    .await;
    assert!(
        waiting["message"].as_str().unwrap().contains("\"harvest\""),
        "{waiting}"
    );
    let worker = cluster.field(&job, "{.status.pod}");
    let held = gates(&cluster, &worker);
    assert!(held.contains("kueue.x-k8s.io/admission"), "{held}");
    // Held well past its start timeout: the job keeps waiting all along, nothing failed.
    let queued_since = std::time::Instant::now();
    while queued_since.elapsed() < Duration::from_secs(3 * START_TIMEOUT) {
        let phase = cluster.field(&job, "{.status.phase}");
        assert_eq!(phase, "Running", "{}", json(&cluster, &job));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let stored = json(&cluster, &job);
    assert_eq!(stored["status"]["phase"], "Running", "{stored}");
    assert_eq!(stored["status"]["failures"], 0, "{stored}");
    assert_eq!(running()["reason"], "WaitingForQueue");
    // The other team's workload ends; the queue frees and admits the worker.
    cluster
        .kubectl(&[
            "delete",
            "pod",
            "other-team-training",
            "-n",
            "harvest-system",
        ])
        .unwrap();
    let stored = succeeded_and_charged_once(&cluster, &job).await;
    let status = &stored["status"];
    assert_eq!(
        (status["attempts"].clone(), status["failures"].clone()),
        (1.into(), 0.into()),
        "{status}"
    );
    assert_eq!(status["pod"], worker.as_str());
    // Kueue saw one workload for the worker, and admitted it once.
    let ours = workloads_of(&cluster, &worker);
    assert_eq!(ours.len(), 1, "{ours:?}");
    assert!(
        ours[0]["status"]["admission"]["clusterQueue"] == "workers",
        "{}",
        ours[0]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_kueue_evicts_is_retried_uncounted_and_the_job_is_charged_once() {
    let cluster = LocalCluster::up_on(Tier::Real);
    let _kueue = cluster.start_kueue().await;
    cluster
        .kubectl_with_input(&["apply", "-f", "-"], Some(QUEUES))
        .unwrap();
    queue_the_test_model(&cluster, "startTimeoutSeconds: 600");
    let job = example_job_running(&cluster, "my-team").await;
    let job = job.each_ref().map(String::as_str);
    let first = cluster.field(&job, "{.status.pod}");
    let workload = workloads_of(&cluster, &first)
        .first()
        .map(|w| w["metadata"]["name"].as_str().unwrap().to_owned())
        .expect("Kueue made a Workload of the running worker");
    // The cluster's administrator deactivates it (as a preemption would evict it): Kueue
    // stops the worker mid-run.
    cluster
        .kubectl(&[
            "patch",
            "workload",
            &workload,
            "-n",
            "harvest-system",
            "--type=merge",
            "-p",
            r#"{"spec":{"active":false}}"#,
        ])
        .unwrap();
    let stored = succeeded_and_charged_once(&cluster, &job).await;
    let status = &stored["status"];
    // The eviction was the cluster's doing: a second attempt, queued and admitted anew, and
    // nothing counted against backoffLimit.
    assert_eq!(status["attempts"], 2, "{status}");
    assert_eq!(status["failures"], 0, "{status}");
    let second = status["pod"].as_str().unwrap();
    assert_ne!(second, first);
    assert_eq!(workloads_of(&cluster, second).len(), 1);
}
