//! The shipped manifests on the local test cluster, as applied by `scripts/cluster.sh up`: the
//! seed flow through the API Service, `kubectl apply` of the example job, an operator rollout
//! mid-job, a REST job in parts with a part Pod deleted, workers no node takes (waiting past
//! the start timeout until a node joins, or cancelled), a TTL'd job applied again by a GitOps
//! tool (recognised, not run or charged twice), a tenant's ResourceQuota holding its workers
//! in harvest-system, and schema refusals.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use harvest_e2e::{LocalCluster, Tier, WITHIN, eventually, repo};
use object_store::ObjectStoreExt;
use object_store::path::Path as StorePath;
use serde_json::{Value, json};

fn ready_replicas(cluster: &LocalCluster, deployment: &str) -> String {
    cluster.field(
        &["deployment", deployment, "-n", "harvest-system"],
        "{.status.readyReplicas}",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_seed_flow_runs_through_the_api_service_of_the_manifests_as_applied() {
    let cluster = LocalCluster::up();
    // Both replicas of each Deployment are Ready: the follower operator too. (Waited on: on a
    // loaded machine a readiness probe can miss its timeout once and drop a replica for a
    // moment.)
    for deployment in ["harvest-api", "harvest-operator"] {
        eventually(
            &format!("both replicas of {deployment} Ready"),
            WITHIN,
            || {
                let ready = ready_replicas(&cluster, deployment);
                (ready == "2").then_some(()).ok_or(ready)
            },
        )
        .await;
    }
    // RBAC holds the API's token to its key Secrets: the storage credentials beside them are
    // out of its reach.
    let api_pod = cluster.field(
        &[
            "pods",
            "-n",
            "harvest-system",
            "-l",
            "app.kubernetes.io/name=harvest-api",
        ],
        "{.items[0].metadata.name}",
    );
    let as_api = |path: &'static str| cluster.as_pod("harvest-system", &api_pod, path, None);
    let refused = as_api("/api/v1/namespaces/harvest-system/secrets/harvest-s3")
        .await
        .unwrap_err();
    assert!(
        refused.contains("system:serviceaccount:harvest-system:harvest-api")
            && refused.to_lowercase().contains("forbidden"),
        "{refused}"
    );
    as_api("/api/v1/namespaces/harvest-keys/secrets")
        .await
        .unwrap();
    // The key as docs/install.md makes it: the example account, then create-key in an API Pod.
    cluster.tenant("my-team");
    let key = cluster.create_key_in_api_pod("interp-team").unwrap();
    let http = reqwest::Client::new();
    let submitted = http
        .post(format!("{}/harvest", cluster.api))
        .bearer_auth(&key)
        .json(&json!({"model": "smollm2-135m", "prompts": ["The capital of France is", "Residual streams carry"], "layers": [3, 15]}))
        .send()
        .await
        .unwrap();
    assert_eq!(submitted.status(), 202);
    let job: Value = submitted.json().await.unwrap();
    let id = job["job_id"].as_str().unwrap().to_owned();
    // Long-polls until the job is done (each wait ends when the status changes).
    let deadline = tokio::time::Instant::now() + WITHIN;
    let done = loop {
        let answer = http
            .get(format!("{}/harvest/{id}?wait=60", cluster.api))
            .bearer_auth(&key)
            .send()
            .await
            .unwrap();
        // A lone long-poll takes its permit from the replicas' shared Lease (RBAC allows it).
        assert!(
            answer.headers().get("x-acs-longpoll").is_none(),
            "a lone long-poll was declined"
        );
        let view: Value = answer.json().await.unwrap();
        match view["status"].as_str() {
            Some("done") => break view,
            Some("pending" | "running") if tokio::time::Instant::now() < deadline => {}
            _ => panic!("the job did not finish: {view}"),
        }
    };
    assert_eq!(done["result"]["layer_indices"], json!([3, 15]));
    // The signed links download without a key.
    let manifest: Value = reqwest::get(done["result"]["manifest_url"].as_str().unwrap())
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(manifest["n_prompts"], json!(2), "{manifest}");
    let shard = reqwest::get(done["result"]["shard_urls"][0].as_str().unwrap())
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let header_len = u64::from_le_bytes(shard[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&shard[8..8 + header_len]).unwrap();
    assert_eq!(
        header["prompt_0"]["shape"][0],
        json!(2),
        "a prompt's activations hold the two layers: {header}"
    );
    let phase = cluster.field(
        &["harvestjob", &id, "-n", "harvest-system"],
        "{.status.phase}",
    );
    assert_eq!(phase, "Succeeded");
    cancel_then_resubmit_on_a_full_lane(&cluster, &cluster.create_key("acme")).await;
}

/// acme's small lane holds 2 jobs: with both taken, a cancel answered by one replica frees its
/// slot before it answers, so the resubmit right after is admitted by whichever replica the
/// Service picks. The API writes the job's end and settles the hold itself, with the rights
/// `manifests/base/rbac.yaml` gives it.
async fn cancel_then_resubmit_on_a_full_lane(cluster: &LocalCluster, key: &str) {
    let http = reqwest::Client::new();
    let long: Vec<String> = (0..24)
        .map(|i| format!("Prompt {i}: {}", "the residual stream ".repeat(30)))
        .collect();
    let submit = || {
        http.post(format!("{}/harvest", cluster.api))
            .bearer_auth(key)
            .json(&json!({"model": "smollm2-135m", "prompts": long, "layers": "all"}))
            .send()
    };
    let mut ids = Vec::new();
    for _ in 0..2 {
        let answer = submit().await.unwrap();
        assert_eq!(answer.status(), 202);
        let job: Value = answer.json().await.unwrap();
        ids.push(job["job_id"].as_str().unwrap().to_owned());
    }
    let full = submit().await.unwrap();
    assert_eq!(full.status(), 429, "{:?}", full.text().await);
    let cancelled: Value = http
        .delete(format!("{}/harvest/{}", cluster.api, ids[0]))
        .bearer_auth(key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(cancelled["status"], "cancelled", "{cancelled}");
    let again = submit().await.unwrap();
    assert_eq!(again.status(), 202, "{:?}", again.text().await);
    let job: Value = again.json().await.unwrap();
    ids.push(job["job_id"].as_str().unwrap().to_owned());
    for id in &ids[1..] {
        let status = http
            .delete(format!("{}/harvest/{id}", cluster.api))
            .bearer_auth(key)
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(status, 200);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_job_finishes_through_an_operator_rollout_and_is_charged_once() {
    let cluster = LocalCluster::up();
    cluster.tenant("my-team");
    cluster.upload_example_prompts(320, 60).await;
    cluster
        .kubectl(&[
            "apply",
            "--validate=false",
            "-f",
            "manifests/examples/harvestjob.yaml",
            "-n",
            "my-team",
        ])
        .unwrap();
    let job = ["harvestjob", "smollm2-quartiles", "-n", "my-team"];
    eventually("the example job running", WITHIN, || {
        let running = cluster.field(&job, "{.status.conditions[?(@.type==\"Running\")].reason}");
        (running == "PodRunning").then_some(()).ok_or(running)
    })
    .await;
    let leader_before = cluster.field(
        &["lease", "harvest-operator", "-n", "harvest-system"],
        "{.spec.holderIdentity}",
    );
    cluster
        .kubectl(&[
            "rollout",
            "restart",
            "deployment/harvest-operator",
            "-n",
            "harvest-system",
        ])
        .unwrap();
    assert_eq!(
        cluster.field(&job, "{.status.phase}"),
        "Running",
        "the rollout must start before the job ends (make the corpus larger)"
    );
    cluster
        .kubectl(&[
            "rollout",
            "status",
            "deployment/harvest-operator",
            "-n",
            "harvest-system",
            "--timeout=240s",
        ])
        .unwrap();
    cluster
        .kubectl(&[
            "wait",
            "--for=condition=Finished",
            "harvestjob/smollm2-quartiles",
            "-n",
            "my-team",
            "--timeout=240s",
        ])
        .unwrap();
    assert_eq!(
        cluster.field(&job, "{.status.phase}"),
        "Succeeded",
        "{}",
        json_status(&cluster, &job)
    );
    let tokens: u64 = cluster
        .field(&job, "{.status.result.tokens}")
        .parse()
        .unwrap();
    let charged: u64 = cluster
        .field(&job, "{.status.tokens.charged}")
        .parse()
        .unwrap();
    assert_eq!(charged, tokens);
    // The new replicas hold the Lease now; the account's book counts the job once.
    let leader_after = cluster.field(
        &["lease", "harvest-operator", "-n", "harvest-system"],
        "{.spec.holderIdentity}",
    );
    assert_ne!(leader_after, leader_before);
    eventually("the account charged once", WITHIN, || {
        let total = cluster.field(&["harvestaccount", "interp-team"], "{.status.tokensTotal}");
        (total == tokens.to_string()).then_some(()).ok_or(total)
    })
    .await;
    let manifest = cluster
        .bucket("harvest-outputs")
        .get(&StorePath::from("probing/smollm2-quartiles/manifest.json"))
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let manifest: Value = serde_json::from_slice(&manifest).unwrap();
    assert_eq!(manifest["n_prompts"], json!(320));
    // The workers ran in harvest-system, with credentials a tenant cannot reach: the tenant's
    // namespace holds no Secret and no Pod of harvest's.
    let pod = cluster.field(&job, "{.status.pod}");
    let worker = ["pod", pod.as_str(), "-n", "harvest-system"];
    assert_eq!(
        cluster.field(&worker, "{.metadata.labels.harvest\\.dev/job-uid}"),
        cluster.field(&job, "{.metadata.uid}")
    );
    for kind in ["secrets", "pods"] {
        let names = cluster.field(&[kind, "-n", "my-team"], "{.items[*].metadata.name}");
        assert_eq!(names, "", "{kind} in the tenant's namespace");
    }
    a_tenant_with_edit_rights_reaches_no_storage_credentials(&cluster).await;
}

/// The attack: a tenant with `edit` in my-team looks for the storage credentials in its own
/// namespace, then in harvest-system, and tries to run a Pod beside the workers. Its token is
/// a ServiceAccount's, mounted into a Pod it runs (RBAC applies to ServiceAccount tokens).
async fn a_tenant_with_edit_rights_reaches_no_storage_credentials(cluster: &LocalCluster) {
    let objects = "apiVersion: v1\nkind: ServiceAccount\nmetadata: {name: alice, namespace: my-team}\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata: {name: tenant-core, labels: {rbac.authorization.k8s.io/aggregate-to-edit: \"true\"}}\nrules: [{apiGroups: [\"\"], resources: [secrets, pods, configmaps], verbs: [\"*\"]}]\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata: {name: edit}\naggregationRule: {clusterRoleSelectors: [{matchLabels: {rbac.authorization.k8s.io/aggregate-to-edit: \"true\"}}]}\nrules: []\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {name: alice-edit, namespace: my-team}\nroleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: edit}\nsubjects: [{kind: ServiceAccount, name: alice, namespace: my-team}]\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: alice-shell, namespace: my-team}\nspec: {serviceAccountName: alice, restartPolicy: Never, containers: [{name: shell, image: \"ghcr.io/harvest-dev/harvester:0.1.0\", args: [\"--help\"]}]}\n";
    cluster
        .kubectl_with_input(&["apply", "--validate=false", "-f", "-"], Some(objects))
        .unwrap();
    let kubeconfig = cluster.pod_kubeconfig("my-team", "alice-shell");
    eventually("alice's Pod to get its token", WITHIN, || {
        std::fs::read_to_string(&kubeconfig).map_err(|e| e.to_string())
    })
    .await;
    let as_alice = |path: &'static str, post: Option<Value>| async move {
        cluster
            .as_pod("my-team", "alice-shell", path, post.as_ref())
            .await
    };
    let own: Value = serde_json::from_str(
        &as_alice("/api/v1/namespaces/my-team/secrets", None)
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        own["items"],
        json!([]),
        "alice may list her Secrets: there are none"
    );
    for path in [
        "/api/v1/namespaces/harvest-system/secrets/harvest-s3",
        "/api/v1/namespaces/harvest-system/pods",
    ] {
        let refused = as_alice(path, None).await.unwrap_err();
        assert!(
            refused.to_lowercase().contains("forbidden"),
            "{path}: {refused}"
        );
    }
    let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "beside-the-workers"},
        "spec": {"containers": [{"name": "shell", "image": "ghcr.io/harvest-dev/harvester:0.1.0",
                 "envFrom": [{"secretRef": {"name": "harvest-s3"}}]}]}});
    let refused = as_alice("/api/v1/namespaces/harvest-system/pods", Some(pod))
        .await
        .unwrap_err();
    assert!(refused.to_lowercase().contains("forbidden"), "{refused}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_no_node_takes_waits_past_the_start_timeout_and_runs_once_a_node_joins() {
    let cluster = LocalCluster::up();
    cluster.tenant("my-team");
    cluster.upload_example_prompts(4, 8).await;
    // One slot, and a start timeout a test can wait out many times over; SmolLM2 goes to a
    // pool no node is in yet. The operator reads its catalogue at start, so the change rolls
    // it out.
    cluster
        .kubectl(&[
            "patch",
            "harvestaccount",
            "interp-team",
            "--type=merge",
            "-p",
            r#"{"spec":{"lanes":{"small":1}}}"#,
        ])
        .unwrap();
    cluster.set_operator_config(|config| {
        let edited = config
            .replace("startTimeoutSeconds: 1200", "startTimeoutSeconds: 5")
            .replacen(
                "\n    device: cpu\n",
                "\n    device: cpu\n    startTimeoutSeconds: 5\n    nodeSelector: {harvest.dev/pool: late}\n",
                1,
            );
        assert!(edited.contains("harvest.dev/pool"), "{config}");
        edited
    });
    // The real tier's GPU nodes are cordoned (the fake has none).
    let gpu_nodes = cluster.field(
        &["nodes", "-l", "nvidia.com/gpu.present=true"],
        "{.items[*].metadata.name}",
    );
    for node in gpu_nodes.split_whitespace() {
        cluster.kubectl(&["cordon", node]).unwrap();
    }
    let example =
        std::fs::read_to_string(repo().join("manifests/examples/harvestjob.yaml")).unwrap();
    let gpu_job = example
        .replace("name: smollm2-quartiles", "name: needs-a-gpu")
        .replace("model: smollm2-135m", "model: llama-8b")
        .replace("smollm2-quartiles\n", "needs-a-gpu\n");
    let apply = |yaml: &str| {
        cluster
            .kubectl_with_input(
                &["apply", "--validate=false", "-n", "my-team", "-f", "-"],
                Some(yaml),
            )
            .unwrap()
    };
    apply(&gpu_job);
    let gpu = ["harvestjob", "needs-a-gpu", "-n", "my-team"];
    let running_reason =
        |job: &[&str]| cluster.field(job, "{.status.conditions[?(@.type==\"Running\")].reason}");
    eventually("the GPU job's Pod waiting as Unschedulable", WITHIN, || {
        let reason = running_reason(&gpu);
        (reason == "Unschedulable").then_some(()).ok_or(reason)
    })
    .await;
    // It waits as a batch Job's Pod would, three start timeouts and more, holding its slot.
    let seen = std::time::Instant::now();
    eventually("three start timeouts gone by", WITHIN, || {
        let finished = cluster.field(&gpu, "{.status.conditions[?(@.type==\"Finished\")].status}");
        assert_ne!(
            finished,
            "True",
            "the waiting job ended: {}",
            json_status(&cluster, &gpu)
        );
        (seen.elapsed() > std::time::Duration::from_secs(15))
            .then_some(())
            .ok_or(format!("{:?}", seen.elapsed()))
    })
    .await;
    let message = cluster.field(&gpu, "{.status.conditions[?(@.type==\"Running\")].message}");
    assert!(message.contains(" nodes are available"), "{message}");
    apply(&example);
    // Cancelled, it fails as a batch Job does: waiting for Failed returns on it, and it never
    // says Succeeded. Nothing ran, so nothing is charged, and its slot goes to the job behind.
    cluster
        .kubectl(&[
            "patch",
            "harvestjob",
            "needs-a-gpu",
            "-n",
            "my-team",
            "--type=merge",
            "-p",
            r#"{"spec":{"cancel":true}}"#,
        ])
        .unwrap();
    cluster
        .kubectl(&[
            "wait",
            "--for=condition=Failed",
            "harvestjob/needs-a-gpu",
            "-n",
            "my-team",
            "--timeout=60s",
        ])
        .unwrap();
    assert_eq!(
        cluster.field(&gpu, "{.status.conditions[?(@.type==\"Finished\")].reason}"),
        "Cancelled"
    );
    assert_eq!(
        cluster.field(
            &gpu,
            "{.status.conditions[?(@.type==\"Succeeded\")].status}"
        ),
        ""
    );
    assert_eq!(cluster.field(&gpu, "{.status.tokens.charged}"), "0");
    let smollm2 = ["harvestjob", "smollm2-quartiles", "-n", "my-team"];
    eventually("the SmolLM2 job's Pod waiting for its pool", WITHIN, || {
        let reason = running_reason(&smollm2);
        (reason == "Unschedulable").then_some(()).ok_or(reason)
    })
    .await;
    // A node joins the pool: a new Node on the fake, a labelled one on the real tier.
    match cluster.tier {
        Tier::Fake => {
            apply(
                "apiVersion: v1\nkind: Node\nmetadata: {name: late-node, labels: {harvest.dev/pool: late, kubernetes.io/hostname: late-node}}\n",
            );
        }
        Tier::Real => {
            cluster
                .kubectl(&["label", "node", "cpu-1", "harvest.dev/pool=late"])
                .unwrap();
        }
    }
    cluster
        .kubectl(&[
            "wait",
            "--for=condition=Finished",
            "harvestjob/smollm2-quartiles",
            "-n",
            "my-team",
            "--timeout=240s",
        ])
        .unwrap();
    assert_eq!(cluster.field(&smollm2, "{.status.phase}"), "Succeeded");
    // A field past its schema maximum never reaches the controller.
    let refused = cluster
        .kubectl_with_input(
            &["apply", "--validate=false", "-n", "my-team", "-f", "-"],
            Some(
                &example
                    .replace("shardSize: 32", "shardSize: 5000")
                    .replace("name: smollm2-quartiles", "name: too-big"),
            ),
        )
        .unwrap_err();
    assert!(
        refused.contains("spec.harvest.shardSize") && refused.contains("4096"),
        "{refused}"
    );
}

/// A job's status, for a failure's message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_its_ttl_deleted_applied_again_from_the_same_manifest_is_not_run_or_charged_again() {
    let cluster = LocalCluster::up();
    cluster.tenant("my-team");
    cluster.upload_example_prompts(6, 12).await;
    // What Argo CD's self-heal or Flux does after the TTL deleted the job: apply the manifest
    // in git again.
    let example = std::fs::read_to_string(repo().join("manifests/examples/harvestjob.yaml"))
        .unwrap()
        .replace("name: smollm2-quartiles", "name: from-git")
        .replace("smollm2-quartiles", "from-git")
        .replace(
            "ttlSecondsAfterFinished: 604800",
            "ttlSecondsAfterFinished: 1",
        );
    let apply = || {
        cluster
            .kubectl_with_input(
                &["apply", "--validate=false", "-f", "-", "-n", "my-team"],
                Some(&example),
            )
            .unwrap()
    };
    let job = ["harvestjob", "from-git", "-n", "my-team"];
    let account = ["harvestaccount", "interp-team"];
    apply();
    // The TTL of 1 s deletes the job soon after it ends: its UID is read while it runs.
    let first_uid = eventually("the job created", WITHIN, || {
        let uid = cluster.field(&job, "{.metadata.uid}");
        (!uid.is_empty()).then_some(uid).ok_or(String::new())
    })
    .await;
    eventually("the job's run settled and remembered", WITHIN, || {
        let ran = cluster.field(&account, "{.status.ran[*].uid}");
        ran.split(' ')
            .any(|r| r == first_uid)
            .then_some(())
            .ok_or(format!("ran {ran}, {}", json_status(&cluster, &job)))
    })
    .await;
    let charged = cluster.field(&account, "{.status.tokensTotal}");
    assert_ne!(charged, "0", "the first run was charged");
    eventually("the TTL deleted the job", WITHIN, || {
        let gone = cluster.kubectl(&["get", "harvestjob", "from-git", "-n", "my-team"]);
        gone.is_err().then_some(()).ok_or("still there".to_owned())
    })
    .await;
    apply();
    eventually("the copy ends as the run it copies", WITHIN, || {
        let reason = cluster.field(&job, "{.status.conditions[?(@.type==\"Finished\")].reason}");
        (reason == "AlreadySucceeded")
            .then_some(())
            .ok_or(json_status(&cluster, &job))
    })
    .await;
    assert_ne!(cluster.field(&job, "{.metadata.uid}"), first_uid);
    assert_eq!(cluster.field(&job, "{.status.phase}"), "Succeeded");
    assert_eq!(cluster.field(&job, "{.status.pod}"), "", "no worker ran");
    let message = cluster.field(
        &job,
        "{.status.conditions[?(@.type==\"Finished\")].message}",
    );
    assert!(message.contains(&first_uid), "{message}");
    // Its own TTL has run out, and a reconcile after that (the suspend edit bumps the
    // generation, which the status then records) leaves it be, or the tool would copy it again.
    cluster
        .kubectl(&[
            "patch",
            "harvestjob",
            "from-git",
            "-n",
            "my-team",
            "--type=merge",
            "-p",
            r#"{"spec":{"suspend":true}}"#,
        ])
        .unwrap();
    eventually("a reconcile after the copy's TTL ran out", WITHIN, || {
        let seen = cluster.field(&job, "{.status.observedGeneration}");
        let generation = cluster.field(&job, "{.metadata.generation}");
        (seen == generation)
            .then_some(())
            .ok_or(format!("{seen} of {generation}"))
    })
    .await;
    assert_eq!(cluster.field(&job, "{.status.phase}"), "Succeeded");
    assert_eq!(
        cluster.field(&account, "{.status.tokensTotal}"),
        charged,
        "charged once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_resourcequota_holds_its_workers_in_harvest_system_waiting_until_raised() {
    let cluster = LocalCluster::up();
    cluster.tenant("my-team");
    cluster.upload_example_prompts(6, 12).await;
    // The tenant's own quota: one CPU, where a SmolLM2 worker asks two. The worker would run
    // in harvest-system, which has no quota, so only the operator can hold it to this one.
    let quota = |cpu: &str| {
        format!(
            "apiVersion: v1\nkind: ResourceQuota\nmetadata: {{name: team-compute, namespace: my-team}}\nspec: {{hard: {{requests.cpu: \"{cpu}\"}}}}\n"
        )
    };
    cluster
        .kubectl_with_input(&["apply", "--validate=false", "-f", "-"], Some(&quota("1")))
        .unwrap();
    cluster
        .kubectl(&[
            "apply",
            "--validate=false",
            "-f",
            "manifests/examples/harvestjob.yaml",
            "-n",
            "my-team",
        ])
        .unwrap();
    let job = ["harvestjob", "smollm2-quartiles", "-n", "my-team"];
    let message = eventually("the job waiting for its namespace's quota", WITHIN, || {
        let reason = cluster.field(&job, "{.status.conditions[?(@.type==\"Running\")].reason}");
        let message = cluster.field(&job, "{.status.conditions[?(@.type==\"Running\")].message}");
        (reason == "WaitingForQuota")
            .then_some(message)
            .ok_or_else(|| json_status(&cluster, &job))
    })
    .await;
    assert!(
        message.contains(
            "namespace my-team's ResourceQuota \"team-compute\" limits requests.cpu to 1"
        ) && message.contains("this worker asks 2"),
        "{message}"
    );
    // No worker made, nothing counted against backoffLimit.
    assert_eq!(cluster.field(&job, "{.status.failures}"), "0");
    let workers = cluster.field(
        &[
            "pods",
            "-n",
            "harvest-system",
            "-l",
            "harvest.dev/tenant=my-team",
        ],
        "{.items[*].metadata.name}",
    );
    assert_eq!(workers, "", "a worker past the tenant's quota was made");
    cluster
        .kubectl_with_input(&["apply", "--validate=false", "-f", "-"], Some(&quota("4")))
        .unwrap();
    cluster
        .kubectl(
            &[
                &["wait", "--for=condition=Succeeded", "--timeout=240s"],
                &job[..],
            ]
            .concat(),
        )
        .unwrap_or_else(|e| panic!("{e}\n{}", json_status(&cluster, &job)));
    assert_eq!(cluster.field(&job, "{.status.failures}"), "0");
}

fn json_status(cluster: &LocalCluster, job: &[&str]) -> String {
    cluster.field(job, "{.status}")
}

/// A done job's files through its signed links: the manifest (less the job's id and uid, all
/// that two jobs of one plan may differ by), the statistics and every shard.
async fn downloaded(done: &Value) -> (Value, Vec<Vec<u8>>) {
    let result = &done["result"];
    let get = |url: &Value| {
        let url = url.as_str().unwrap().to_owned();
        async move {
            let answer = reqwest::get(&url).await.unwrap();
            assert_eq!(answer.status(), 200, "{url}");
            answer.bytes().await.unwrap().to_vec()
        }
    };
    let id = done["job_id"].as_str().unwrap();
    let manifest = String::from_utf8(get(&result["manifest_url"]).await).unwrap();
    let mut manifest: Value = serde_json::from_str(&manifest.replace(id, "JOB")).unwrap();
    manifest.as_object_mut().unwrap().remove("job_uid");
    let mut files = vec![get(&result["stats_url"]).await];
    for url in result["shard_urls"].as_array().unwrap() {
        files.push(get(url).await);
    }
    (manifest, files)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rest_job_in_two_parts_with_a_random_part_pod_deleted_downloads_the_bytes_of_one_worker()
{
    let cluster = LocalCluster::up();
    let key = cluster.create_key("acme");
    let http = reqwest::Client::new();
    // Long enough that a part still runs when its Pod is deleted: a part that finished
    // first would rightly not run again, and the test would prove nothing.
    let prompts: Vec<String> = (0..36)
        .map(|i| format!("Prompt {i}: {}", "a residual stream ".repeat(24 + i % 5)))
        .collect();
    let submit = |parallelism: Option<u32>| {
        let mut body = json!({"model": "smollm2-135m", "prompts": prompts, "layers": [4, 20], "shard_size": 4});
        if let Some(n) = parallelism {
            body["parallelism"] = json!(n);
        }
        let request = http
            .post(format!("{}/harvest", cluster.api))
            .bearer_auth(&key)
            .json(&body);
        async move {
            let answer = request.send().await.unwrap();
            assert_eq!(answer.status(), 202);
            let job: Value = answer.json().await.unwrap();
            job["job_id"].as_str().unwrap().to_owned()
        }
    };
    let parts = submit(Some(2)).await;
    let job = ["harvestjob", parts.as_str(), "-n", "harvest-system"];
    // A random part's Pod is deleted as soon as the status names it, usually before its
    // worker has loaded the model: that part alone runs again.
    let victim = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos()
        % 2;
    eprintln!("deleting part {victim}'s Pod");
    let part = |field: &str| format!("{{.status.parts[{victim}].{field}}}");
    let killed = eventually("the part's Pod", WITHIN, || {
        let pod = cluster.field(&job, &part("pod"));
        (!pod.is_empty())
            .then_some(pod)
            .ok_or_else(|| "no Pod yet".to_owned())
    })
    .await;
    cluster
        .kubectl(&[
            "delete",
            "pod",
            &killed,
            "-n",
            "harvest-system",
            "--wait=false",
        ])
        .unwrap();
    let one = submit(None).await;
    let done = |id: String| {
        let request = http
            .get(format!("{}/harvest/{id}?wait=30", cluster.api))
            .bearer_auth(&key);
        async move {
            let deadline = tokio::time::Instant::now() + WITHIN;
            loop {
                let view: Value = request
                    .try_clone()
                    .unwrap()
                    .send()
                    .await
                    .unwrap()
                    .json()
                    .await
                    .unwrap();
                match view["status"].as_str() {
                    Some("done") => break view,
                    Some("pending" | "running") if tokio::time::Instant::now() < deadline => {}
                    _ => panic!("the job did not finish: {view}"),
                }
            }
        }
    };
    let (parts_done, one_done) = (done(parts.clone()).await, done(one).await);
    assert_eq!(parts_done["tokens"], one_done["tokens"]);
    assert!(downloaded(&parts_done).await == downloaded(&one_done).await);
    let attempts = cluster.field(&job, &part("attempts"));
    assert!(
        attempts.parse::<u32>().unwrap() >= 2,
        "part {victim} ran {attempts} time(s) after its Pod {killed} was deleted; parts: {}",
        cluster.field(&job, "{.status.parts}")
    );
    // `kubectl get hj` shows the parts done out of all.
    let listed = cluster
        .kubectl(&["get", "hj", &parts, "-n", "harvest-system"])
        .unwrap();
    assert!(
        listed.contains("PARTS") && listed.contains("2/2"),
        "{listed}"
    );
}
