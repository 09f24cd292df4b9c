//! The images as the cluster runs them (read-only root, user 65532, no capabilities): the
//! operator image, pointed at the test cluster by a kubeconfig, answers its health endpoint,
//! follows while the cluster's own operator leads and takes the Lease once that one is scaled
//! away; and the real tier with every Pod run in its image (`scripts/cluster.sh up --real
//! --images`) serves the seed flow. `scripts/test.sh` builds the images (scripts/images.sh) and
//! names their tag; elsewhere these tests say they are skipped.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use harvest_e2e::{LocalCluster, WITHIN, eventually};
use harvest_testkit::free_port;
use harvest_testkit::images::{Container, Images, RESTRICTED};

fn get(url: &str) -> Result<String, String> {
    let answer = std::process::Command::new("curl")
        .args(["-sS", "--max-time", "5", "-w", "\n%{http_code}", url])
        .output()
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&answer.stdout).into_owned();
    match text.rsplit_once('\n') {
        Some((body, "200")) => Ok(body.to_owned()),
        _ => Err(format!("{text}{}", String::from_utf8_lossy(&answer.stderr))),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_image_answers_its_health_endpoint_and_leads_the_test_cluster_once_alone() {
    let Some(images) = Images::built("operator image") else {
        return;
    };
    let image = images.name("harvest-operator");
    images.assert_runs_unprivileged(&image);
    let cluster = LocalCluster::up();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    let shipped = cluster
        .kubectl(&[
            "get",
            "configmap",
            "harvest-operator",
            "-n",
            "harvest-system",
            "-o",
            "jsonpath={.data.config\\.yaml}",
        ])
        .unwrap();
    std::fs::write(&config, shipped).unwrap();
    // What the Deployment passes it from the same ConfigMap.
    let worker_image = cluster.field(
        &["configmap", "harvest-operator", "-n", "harvest-system"],
        "{.data.workerImage}",
    );
    let kubeconfig = cluster.kubeconfig.to_str().unwrap().to_owned();
    let port = free_port();
    let (config_mount, kubeconfig_mount, metrics, identity) = (
        format!("{0}:{0}:ro", config.display()),
        format!("{kubeconfig}:{kubeconfig}:ro"),
        format!("127.0.0.1:{port}"),
        format!("harvest-operator-image-{}", std::process::id()),
    );
    let (kubeconfig_env, identity_env, worker_env) = (
        format!("KUBECONFIG={kubeconfig}"),
        format!("POD_NAME={identity}"),
        format!("HARVEST_WORKER_IMAGE={worker_image}"),
    );
    let mut args = RESTRICTED.to_vec();
    args.extend([
        "--network",
        "host",
        "-e",
        &kubeconfig_env,
        "-e",
        &identity_env,
        "-e",
        &worker_env,
        "-v",
        &config_mount,
        "-v",
        &kubeconfig_mount,
        &image,
        "--config",
        config.to_str().unwrap(),
        "--lease-namespace",
        "harvest-system",
        "--metrics-addr",
        &metrics,
    ]);
    let container = Container::start(&identity, &args);
    let base = format!("http://127.0.0.1:{port}");
    eventually("the operator image's /healthz", WITHIN, || {
        if !container.running() {
            panic!("the operator container exited:\n{}", container.logs());
        }
        get(&format!("{base}/healthz"))
    })
    .await;
    // The cluster's operator leads; with it scaled away, the image's replica takes the Lease,
    // which it can only do by talking to the apiserver through the kubeconfig.
    cluster
        .kubectl(&[
            "patch",
            "deployment",
            "harvest-operator",
            "-n",
            "harvest-system",
            "--type=merge",
            "-p",
            r#"{"spec": {"replicas": 0}}"#,
        ])
        .unwrap();
    eventually("the operator image leading", WITHIN, || {
        let holder = cluster.field(
            &["lease", "harvest-operator", "-n", "harvest-system"],
            "{.spec.holderIdentity}",
        );
        let metrics = get(&format!("{base}/metrics"))?;
        (holder == identity && metrics.contains("harvest_operator_leader 1"))
            .then_some(())
            .ok_or_else(|| format!("holder {holder}; {}", container.logs()))
    })
    .await;
    get(&format!("{base}/healthz")).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_seed_flow_runs_on_the_real_tier_with_every_pod_in_its_image() {
    let Some(_images) = Images::built("real tier in images") else {
        return;
    };
    let cluster = LocalCluster::up_in_images();
    // The API and operator replicas are containers of their images, started by the nodes.
    let state = cluster.state_dir();
    let listed = harvest_testkit::images::docker_ok(&[
        "ps",
        "--format",
        "{{.Image}} {{.Label \"harvest.dev/kubelet-dir\"}}",
    ]);
    for image in ["harvest-api", "harvest-operator"] {
        let running = listed
            .lines()
            .filter(|line| {
                line.contains(&format!("/{image}:")) && line.contains(&*state.to_string_lossy())
            })
            .count();
        assert_eq!(running, 2, "{image} replicas in containers:\n{listed}");
    }
    cluster.tenant("my-team");
    let key = cluster.create_key_in_api_pod("interp-team").unwrap();
    let http = reqwest::Client::new();
    let submitted = http
        .post(format!("{}/harvest", cluster.api))
        .bearer_auth(&key)
        .json(&serde_json::json!({"model": "smollm2-135m", "prompts": ["The capital of France is", "Residual streams carry"], "layers": [3, 15]}))
        .send()
        .await
        .unwrap();
    assert_eq!(submitted.status(), 202);
    let job: serde_json::Value = submitted.json().await.unwrap();
    let id = job["job_id"].as_str().unwrap().to_owned();
    let deadline = tokio::time::Instant::now() + WITHIN;
    let done = loop {
        let view: serde_json::Value = http
            .get(format!("{}/harvest/{id}?wait=60", cluster.api))
            .bearer_auth(&key)
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
    };
    // The worker image wrote it (the nodes map every image to an image, none to a binary).
    let manifest: serde_json::Value =
        reqwest::get(done["result"]["manifest_url"].as_str().unwrap())
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
    assert_eq!(manifest["n_prompts"], serde_json::json!(2), "{manifest}");
    assert_eq!(manifest["layer_indices"], serde_json::json!([3, 15]));
    let phase = cluster.field(
        &["harvestjob", &id, "-n", "harvest-system"],
        "{.status.phase}",
    );
    assert_eq!(phase, "Succeeded");
}
