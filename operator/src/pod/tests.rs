//! Rendering and observing Pods.

use super::*;
use crate::config::OperatorConfig;
use harvest_crds::{HarvestJob, HarvestJobSpec};
use k8s_openapi::api::core::v1::Pod;
use serde_json::json;

fn config() -> OperatorConfig {
    OperatorConfig::parse(
        "models:\n- {name: m, path: /models/m, numLayers: 30, hiddenSize: 576, lane: small, image: img:1, gpus: 2, nodeSelector: {gpu: h200}}\nlanes: {small: 1, large: 1}\nworkerEnvSecret: s3\n",
    )
    .unwrap()
}

fn job() -> HarvestJob {
    let mut job = HarvestJob::new(
        "j",
        HarvestJobSpec {
            backoff_limit: 1,
            ..HarvestJobSpec::new("m", "s3://in/p.jsonl", "s3://out/j", 5)
        },
    );
    job.metadata.namespace = Some("team".into());
    job.metadata.uid = Some("uid-1".into());
    job
}

fn pod_with(status: serde_json::Value) -> Pod {
    serde_json::from_value(json!({"metadata": {"name": "j-1"}, "status": status})).unwrap()
}

#[test]
fn the_pod_carries_the_plan_the_gpus_the_owner_and_the_catalogue_placement() {
    let config = config();
    let entry = config.model("m").unwrap();
    let valid = job()
        .spec
        .validate(&entry.served(), std::path::Path::new(&entry.path))
        .unwrap();
    let pod = render(
        &job(),
        &valid,
        entry,
        &config,
        &Attempt {
            role: Role::Whole,
            number: 2,
            deadline_seconds: Some(60),
        },
        None,
    )
    .unwrap();
    assert_eq!(pod.metadata.name.as_deref(), Some("j-uid1-2"));
    let owner = &pod.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.uid.as_str(), owner.controller),
        ("uid-1", Some(true))
    );
    let spec = pod.spec.unwrap();
    assert_eq!(spec.active_deadline_seconds, Some(60));
    assert_eq!(spec.node_selector.unwrap()["gpu"], "h200");
    let container = &spec.containers[0];
    let limits = container
        .resources
        .as_ref()
        .unwrap()
        .limits
        .as_ref()
        .unwrap();
    assert_eq!(limits["nvidia.com/gpu"].0, "2");
    let args = container.args.as_ref().unwrap();
    let plan: harvest_core::RawPlan =
        serde_json::from_str(&args[args.iter().position(|a| a == "--plan-json").unwrap() + 1])
            .unwrap();
    assert_eq!(plan.model, "/models/m");
    let after = |flag: &str| &args[args.iter().position(|a| a == flag).unwrap() + 1];
    assert_eq!(after("--token-budget"), "5");
    assert_eq!(after("--job-uid"), "uid-1");
    assert_eq!(after("--pipeline-stages"), "2", "one stage a GPU");
    assert_eq!(plan.output, "s3://out/j");
    assert_eq!(
        container.env_from.as_ref().unwrap()[0]
            .secret_ref
            .as_ref()
            .unwrap()
            .name,
        "s3"
    );
}

#[test]
fn exit_codes_and_kubelet_reasons_decide_who_is_to_blame() {
    let terminated = |code: i32, reason: &str, message: &str| {
        pod_with(
            json!({"phase": "Failed", "containerStatuses": [{"name": "harvester", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
            "state": {"terminated": {"exitCode": code, "reason": reason, "message": message}}}]}),
        )
    };
    let blame = |pod: &Pod| match observe(pod) {
        PodState::Failed { failure, .. } => (failure.blame, failure.reason),
        other => panic!("not failed: {other:?}"),
    };
    assert_eq!(
        blame(&terminated(137, "OOMKilled", "")),
        (Blame::Job, "OOMKilled".into())
    );
    assert_eq!(
        blame(&terminated(
            2,
            "Error",
            r#"{"error": "no such file p.jsonl", "exit_code": 2}"#
        )),
        (Blame::Input, "InvalidInput".into())
    );
    assert_eq!(
        blame(&terminated(3, "Error", "")),
        (Blame::Infrastructure, "StorageUnavailable".into())
    );
    assert_eq!(
        blame(&terminated(70, "Error", "")),
        (Blame::Job, "WorkerFailed".into())
    );
    assert_eq!(
        blame(&pod_with(json!({"phase": "Failed", "reason": "Evicted"}))),
        (Blame::Infrastructure, "Evicted".into())
    );
    let PodState::Failed { failure, .. } = observe(&terminated(
        2,
        "Error",
        r#"{"error": "no such file p.jsonl", "exit_code": 2}"#,
    )) else {
        unreachable!()
    };
    assert!(
        failure.message.contains("no such file p.jsonl"),
        "{}",
        failure.message
    );
}

#[test]
fn a_succeeded_pod_yields_the_run_summary_and_a_pull_error_is_a_waiting_reason() {
    let message = r#"{"n_shards": 2, "n_prompts": 40, "layer_indices": [7], "tokens": 900, "bytes_written": 10, "contents": "activations", "output": "s3://o", "timings": {}}"#;
    let pod = pod_with(
        json!({"phase": "Succeeded", "containerStatuses": [{"name": "harvester", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
        "state": {"terminated": {"exitCode": 0, "message": message}}}]}),
    );
    let PodState::Succeeded {
        result: Some(result),
        part: None,
    } = observe(&pod)
    else {
        panic!("no result")
    };
    assert_eq!(
        (result.n_shards, result.prompts, result.tokens),
        (2, 40, 900)
    );
    let pulling = pod_with(
        json!({"phase": "Pending", "containerStatuses": [{"name": "harvester", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
        "state": {"waiting": {"reason": "ImagePullBackOff", "message": "back-off pulling img:1"}}}]}),
    );
    assert_eq!(
        observe(&pulling),
        PodState::Starting {
            waiting: Some(("ImagePullBackOff".into(), "back-off pulling img:1".into())),
            since: None,
        }
    );
}

#[test]
fn the_start_timeout_counts_from_scheduling_and_not_while_no_node_takes_the_pod() {
    let created = "2026-01-01T00:00:00Z";
    let scheduled = "2026-01-01T00:14:00Z";
    let mut unscheduled = pod_with(
        json!({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
        "reason": "Unschedulable", "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.", "lastTransitionTime": created}]}),
    );
    unscheduled.metadata.creation_timestamp = Some(Time(created.parse().unwrap()));
    let since = |pod: &Pod| match observe(pod) {
        PodState::Starting { since, .. } => since.map(|t| t.0.to_string()),
        other => panic!("{other:?}"),
    };
    assert_eq!(since(&unscheduled), None, "waiting for a node is not timed");
    // A GPU node came up after 14 minutes; the image pull starts a wait of its own.
    let mut pulling = pod_with(
        json!({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": scheduled}],
        "containerStatuses": [{"name": "harvester", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
        "state": {"waiting": {"reason": "ContainerCreating"}}}]}),
    );
    pulling.metadata.creation_timestamp = Some(Time(created.parse().unwrap()));
    assert_eq!(since(&pulling).as_deref(), Some(scheduled));
}

#[test]
fn an_unscheduled_pod_waits_with_the_schedulers_reason() {
    let pending = pod_with(
        json!({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
        "reason": "Unschedulable", "message": "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."}]}),
    );
    let PodState::Starting { waiting, .. } = observe(&pending) else {
        panic!("not starting")
    };
    assert_eq!(
        waiting,
        Some((
            "Unschedulable".into(),
            "0/1 nodes are available: 1 Insufficient nvidia.com/gpu.".into()
        ))
    );
}

#[test]
fn the_newest_progress_line_of_the_log_is_the_report_and_other_lines_are_skipped() {
    let log = concat!(
        "{\"event\":\"progress\",\"prompts_done\":8,\"prompts_total\":48,\"tokens_done\":400}\n",
        "INFO loading shard\n",
        "{\"event\":\"progress\",\"prompts_done\":16,\"prompts_total\":48,\"tokens_done\":800,\"tokens_per_s\":9.5}\n",
        "{\"event\":\"other\"}\n",
    );
    let report = reported_progress(log).unwrap();
    assert_eq!(
        (
            report.prompts_done,
            report.prompts_total,
            report.tokens_done
        ),
        (16, 48, 800)
    );
    assert!(reported_progress("no json here\n").is_none());
}

#[test]
fn a_job_name_past_the_label_limit_gets_a_hashed_label_and_a_valid_pod_name() {
    let long = format!("{}-z", "a".repeat(250));
    assert_eq!(job_label("short"), "short");
    let label = job_label(&long);
    assert_eq!(label.len(), 63);
    assert_ne!(label, job_label(&format!("{}-y", "a".repeat(250))));
    let pod = pod_name(&long, Some("0A1B2C3D-ffff"), 12);
    assert!(pod.len() <= 253 && pod.ends_with("-2c3dffff-12"), "{pod}");
    assert_eq!(pod_name("j", None, 1), "j-1");
}

#[test]
fn only_a_pod_whose_controller_is_the_job_is_read_as_its_worker() {
    let running = |owners: serde_json::Value| -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "j-1", "ownerReferences": owners},
            "status": {"phase": "Running"}
        }))
        .unwrap()
    };
    let owner = |uid: &str, controller: bool| json!({"apiVersion": "harvest.dev/v1alpha1", "kind": "HarvestJob", "name": "j", "uid": uid, "controller": controller});
    assert_eq!(
        observe_for_job(&running(json!([owner("uid-1", true)])), "uid-1", false),
        PodState::Running
    );
    assert_eq!(
        observe_for_job(&running(json!([owner("uid-0", true)])), "uid-1", false),
        PodState::Foreign {
            controller: Some("HarvestJob/j".into())
        }
    );
    // An owner reference that is not the controller proves nothing.
    assert_eq!(
        observe_for_job(&running(json!([owner("uid-1", false)])), "uid-1", false),
        PodState::Foreign { controller: None }
    );
    assert_eq!(
        observe_for_job(&running(json!([])), "uid-1", false),
        PodState::Foreign { controller: None }
    );
}

#[test]
fn a_job_keeps_running_the_image_its_first_worker_ran_after_the_catalogue_changes() {
    let config = config();
    let entry = config.model("m").unwrap();
    let mut job = job();
    let valid = job
        .spec
        .validate(&entry.served(), std::path::Path::new(&entry.path))
        .unwrap();
    let attempt = Attempt {
        role: Role::Whole,
        number: 2,
        deadline_seconds: None,
    };
    let image = |job: &HarvestJob| {
        render(job, &valid, entry, &config, &attempt, None)
            .unwrap()
            .spec
            .unwrap()
            .containers[0]
            .image
            .clone()
    };
    assert_eq!(image(&job).as_deref(), Some("img:1"));
    job.status = Some(harvest_crds::HarvestJobStatus {
        worker_image: Some("img:0".into()),
        ..Default::default()
    });
    assert_eq!(image(&job).as_deref(), Some("img:0"));
}

#[test]
fn a_uid_label_makes_a_pod_the_jobs_only_in_the_operators_worker_namespace() {
    let labelled: Pod = serde_json::from_value(json!({
        "metadata": {"name": "j-1", "labels": {"harvest.dev/job-uid": "uid-1"}},
        "status": {"phase": "Running"}
    }))
    .unwrap();
    assert_eq!(observe_for_job(&labelled, "uid-1", true), PodState::Running);
    assert_eq!(
        observe_for_job(&labelled, "uid-2", true),
        PodState::Foreign { controller: None }
    );
    // In a tenant's namespace anyone with edit rights can set labels.
    assert_eq!(
        observe_for_job(&labelled, "uid-1", false),
        PodState::Foreign { controller: None }
    );
}

#[test]
fn a_worker_in_the_operators_namespace_names_its_job_tenant_and_account_and_has_no_owner() {
    let mut config = config();
    config.worker_namespace = Some("harvest-system".into());
    let job = job();
    let entry = config.model("m").unwrap();
    let valid = job
        .spec
        .validate(&entry.served(), std::path::Path::new(&entry.path))
        .unwrap();
    let account = harvest_crds::HarvestAccount::new(
        "acme",
        serde_json::from_value(
            json!({"storage": {"prefix": "/acme", "credentialsSecret": "acme-s3"}}),
        )
        .unwrap(),
    );
    let pod = render(
        &job,
        &valid,
        entry,
        &config,
        &Attempt {
            role: Role::Whole,
            number: 1,
            deadline_seconds: None,
        },
        Some(&account),
    )
    .unwrap();
    assert_eq!(pod.metadata.namespace.as_deref(), Some("harvest-system"));
    assert_eq!(pod.metadata.owner_references, None);
    let labels = pod.metadata.labels.unwrap();
    assert_eq!(labels["harvest.dev/job-uid"], "uid-1");
    // What chargeback and namespace dashboards group workers by, in the shared namespace.
    assert_eq!(labels["harvest.dev/tenant"], "team");
    assert_eq!(labels["harvest.dev/account"], "acme");
    let annotations = pod.metadata.annotations.unwrap();
    assert_eq!(annotations["harvest.dev/job-namespace"], "team");
    assert_eq!(annotations["harvest.dev/job-name"], "j");
    // The paying account's own credentials, not the catalogue's shared Secret.
    let env_from = pod.spec.unwrap().containers[0].env_from.clone().unwrap();
    assert_eq!(env_from[0].secret_ref.as_ref().unwrap().name, "acme-s3");
}

#[test]
fn a_finalize_pod_asks_for_cpu_and_the_memory_its_plan_holds_not_the_models_gpu_nodes() {
    let config = OperatorConfig::parse(
        "models:\n- {name: m, path: /models/m, numLayers: 30, hiddenSize: 576, lane: small, image: img:1, gpus: 2, nodeSelector: {gpu: h200}, runtimeClassName: nvidia, tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}], resources: {requests: {memory: 200Gi}}}\nlanes: {small: 1, large: 1}\n",
    )
    .unwrap();
    let entry = config.model("m").unwrap();
    let mut job = job();
    job.spec.harvest.layers = Some(vec![3, 7]);
    job.spec.harvest.sites = Some(vec![
        harvest_core::Site::MlpOut,
        harvest_core::Site::ResidPost,
    ]);
    job.spec.harvest.layout = Some(harvest_core::layout::LayoutName::Shuffled);
    job.spec.harvest.rows_per_file = Some(1000);
    let valid = job
        .spec
        .validate(&entry.served(), std::path::Path::new(&entry.path))
        .unwrap();
    let spec_of = |role: Role| {
        let attempt = Attempt {
            role,
            number: 1,
            deadline_seconds: None,
        };
        render(&job, &valid, entry, &config, &attempt, None)
            .unwrap()
            .spec
            .unwrap()
    };
    let part = spec_of(Role::Part { index: 0, count: 2 });
    assert_eq!(part.node_selector.unwrap()["gpu"], "h200");
    assert_eq!(part.runtime_class_name.as_deref(), Some("nvidia"));
    assert_eq!(part.tolerations.unwrap().len(), 1);
    let part_requests = part.containers[0]
        .resources
        .clone()
        .unwrap()
        .requests
        .unwrap();
    assert_eq!(part_requests["nvidia.com/gpu"].0, "2");
    assert_eq!(part_requests["memory"].0, "200Gi");
    let finalize = spec_of(Role::Finalize);
    assert_eq!(finalize.node_selector, None);
    assert_eq!(finalize.tolerations, None);
    assert_eq!(finalize.runtime_class_name, None);
    let resources = finalize.containers[0].resources.clone().unwrap();
    let requests = resources.requests.unwrap();
    assert!(!requests.contains_key("nvidia.com/gpu"));
    assert_eq!(requests["cpu"].0, "1");
    // The base, one spill bucket, and one training file of 1,000 rows of 2 layers x 2 sites of
    // 576 bf16 values, plus their (prompt, position) index.
    let memory = (1u64 << 30) + (256 << 20) + 1000 * (2 * 2 * 576 * 2 + 8);
    assert_eq!(requests["memory"].0, memory.to_string());
    assert_eq!(resources.limits.unwrap()["memory"].0, memory.to_string());
}

#[test]
fn the_pod_that_writes_training_files_spills_into_an_empty_dir_it_asks_for_up_front() {
    let config = config();
    let entry = config.model("m").unwrap();
    let mut job = job();
    job.spec.token_budget = 10_000;
    job.spec.harvest.layers = Some(vec![3, 7]);
    let render_for = |job: &HarvestJob, role: Role| {
        let valid = job
            .spec
            .validate(&entry.served(), std::path::Path::new(&entry.path))
            .unwrap();
        let attempt = Attempt {
            role,
            number: 1,
            deadline_seconds: None,
        };
        render(job, &valid, entry, &config, &attempt, None)
            .unwrap()
            .spec
            .unwrap()
    };
    let scratch = |spec: &k8s_openapi::api::core::v1::PodSpec| {
        spec.volumes
            .iter()
            .flatten()
            .find(|v| v.name == "harvest-scratch")
            .and_then(|v| v.empty_dir.clone()?.size_limit)
            .map(|q| q.0)
    };
    let by_prompt = render_for(&job, Role::Whole);
    assert_eq!(scratch(&by_prompt), None);
    assert!(
        !by_prompt.containers[0]
            .args
            .clone()
            .unwrap()
            .contains(&"--spill-dir".to_owned())
    );
    job.spec.harvest.layout = Some(harvest_core::layout::LayoutName::Shuffled);
    // Every token of the budget: a 16-byte record head and 2 layers of 576 bf16 values,
    // and one bucket more.
    let bytes = (10_000u64 * (16 + 2 * 576 * 2) + (256 << 20)).to_string();
    for role in [Role::Whole, Role::Finalize] {
        let spec = render_for(&job, role);
        assert_eq!(scratch(&spec).as_deref(), Some(bytes.as_str()), "{role:?}");
        let container = &spec.containers[0];
        let args = container.args.clone().unwrap();
        let at = args.iter().position(|a| a == "--spill-dir").unwrap();
        assert_eq!(args[at + 1], "/scratch");
        let mount = container
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.name == "harvest-scratch");
        assert_eq!(mount.map(|m| m.mount_path.as_str()), Some("/scratch"));
        let requests = container.resources.clone().unwrap().requests.unwrap();
        assert_eq!(requests["ephemeral-storage"].0, bytes, "{role:?}");
    }
    assert_eq!(
        scratch(&render_for(&job, Role::Part { index: 0, count: 2 })),
        None
    );
}

#[test]
fn with_a_scratch_storage_class_a_large_spill_is_a_claim_made_for_the_pod_not_node_disk() {
    let mut config = config();
    config.scratch_storage_class = Some("fast-scratch".into());
    let entry = config.model("m").unwrap();
    let mut job = job();
    // 100M tokens at 2 layers of 576 bf16 values: about 233 GB, more than a node's disk.
    job.spec.token_budget = 100_000_000;
    job.spec.harvest.layers = Some(vec![3, 7]);
    job.spec.harvest.layout = Some(harvest_core::layout::LayoutName::Shuffled);
    let valid = job
        .spec
        .validate(&entry.served(), std::path::Path::new(&entry.path))
        .unwrap();
    let attempt = Attempt {
        role: Role::Finalize,
        number: 1,
        deadline_seconds: None,
    };
    let spec = render(&job, &valid, entry, &config, &attempt, None)
        .unwrap()
        .spec
        .unwrap();
    let volume = spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "harvest-scratch")
        .unwrap();
    assert!(volume.empty_dir.is_none());
    let claim = &volume
        .ephemeral
        .as_ref()
        .unwrap()
        .volume_claim_template
        .as_ref()
        .unwrap()
        .spec;
    assert_eq!(claim.storage_class_name.as_deref(), Some("fast-scratch"));
    let bytes = 100_000_000u64 * (16 + 2 * 576 * 2) + (256 << 20);
    let storage = &claim.resources.as_ref().unwrap().requests.as_ref().unwrap()["storage"];
    assert_eq!(storage.0, bytes.to_string());
    // The node's own disk is not asked for.
    let requests = spec.containers[0]
        .resources
        .clone()
        .unwrap()
        .requests
        .unwrap();
    assert!(!requests.contains_key("ephemeral-storage"), "{requests:?}");
}

#[test]
fn a_worker_reads_the_storage_settings_config_map_and_then_the_credentials_secret() {
    let config = OperatorConfig::parse(
        "models:\n- {name: m, path: /models/m, numLayers: 30, hiddenSize: 576, lane: small, image: img:1}\nlanes: {small: 1, large: 1}\nworkerEnvSecret: harvest-s3\nworkerEnvConfigMap: harvest-s3-endpoint\n",
    )
    .unwrap();
    let entry = config.model("m").unwrap();
    let job = job();
    let valid = job
        .spec
        .validate(&entry.served(), std::path::Path::new(&entry.path))
        .unwrap();
    let attempt = Attempt {
        role: Role::Whole,
        number: 1,
        deadline_seconds: None,
    };
    let pod = render(&job, &valid, entry, &config, &attempt, None).unwrap();
    let sources = pod.spec.unwrap().containers[0].env_from.clone().unwrap();
    let settings = sources[0].config_map_ref.clone().unwrap();
    assert_eq!(
        (settings.name.as_str(), settings.optional),
        ("harvest-s3-endpoint", Some(true))
    );
    assert_eq!(sources[1].secret_ref.clone().unwrap().name, "harvest-s3");
}

/// The `kueue.x-k8s.io/queue-name` label of `role`'s Pod, under `account`.
fn queue_of(
    config: &OperatorConfig,
    role: Role,
    account: Option<&harvest_crds::HarvestAccount>,
) -> Option<String> {
    let entry = config.model("m").unwrap();
    let valid = job()
        .spec
        .validate(&entry.served(), std::path::Path::new(&entry.path))
        .unwrap();
    let attempt = Attempt {
        role,
        number: 1,
        deadline_seconds: None,
    };
    let pod = render(&job(), &valid, entry, config, &attempt, account).unwrap();
    pod.metadata.labels.unwrap().get(KUEUE_QUEUE_LABEL).cloned()
}

#[test]
fn a_queued_pod_leaves_its_priority_to_kueue_and_names_the_entrys_workload_priority_class() {
    let entry = |extra: &str| {
        OperatorConfig::parse(&format!(
            "models:\n- {{name: m, path: /models/m, numLayers: 30, hiddenSize: 576, lane: small, image: img:1, gpus: 2, priorityClassName: harvest-gpu{extra}}}\nlanes: {{small: 1, large: 1}}\n"
        ))
        .unwrap()
    };
    let pod = |config: &OperatorConfig, role| {
        let entry = config.model("m").unwrap();
        let valid = job()
            .spec
            .validate(&entry.served(), std::path::Path::new(&entry.path))
            .unwrap();
        let attempt = Attempt {
            role,
            number: 1,
            deadline_seconds: None,
        };
        let pod = render(&job(), &valid, entry, config, &attempt, None).unwrap();
        let labels = pod.metadata.labels.unwrap();
        (
            pod.spec.unwrap().priority_class_name,
            labels.get(KUEUE_PRIORITY_LABEL).cloned(),
        )
    };
    let queued = entry(", localQueue: gpu, workloadPriorityClass: harvest-batch");
    assert_eq!(
        pod(&queued, Role::Whole),
        (None, Some("harvest-batch".into())),
        "Kueue would take the PriorityClass's 1000 as the Workload's priority"
    );
    // The finalize Pod does not queue: the scheduler's PriorityClass stands.
    assert_eq!(
        pod(&queued, Role::Finalize),
        (Some("harvest-gpu".into()), None)
    );
    assert_eq!(
        pod(&entry(""), Role::Whole),
        (Some("harvest-gpu".into()), None)
    );
    let refused = OperatorConfig::parse(
        "models:\n- {name: m, path: /models/m, numLayers: 30, hiddenSize: 576, lane: small, image: img:1, workloadPriorityClass: 'Not A Label!'}\nlanes: {small: 1, large: 1}\n",
    )
    .unwrap_err()
    .to_string();
    assert!(
        refused.contains("workloadPriorityClass \"Not A Label!\""),
        "{refused}"
    );
}

#[test]
fn the_pods_that_run_the_model_name_the_entrys_local_queue_and_an_accounts_queue_wins() {
    let config = OperatorConfig::parse(
        "models:\n- {name: m, path: /models/m, numLayers: 30, hiddenSize: 576, lane: small, image: img:1, gpus: 2, localQueue: gpu-queue}\nlanes: {small: 1, large: 1}\n",
    )
    .unwrap();
    let part = Role::Part { index: 1, count: 3 };
    assert_eq!(
        queue_of(&config, Role::Whole, None).as_deref(),
        Some("gpu-queue")
    );
    assert_eq!(queue_of(&config, part, None).as_deref(), Some("gpu-queue"));
    // The finalize step takes no GPU: it does not queue.
    assert_eq!(queue_of(&config, Role::Finalize, None), None);
    let account = harvest_crds::HarvestAccount::new(
        "team-a",
        serde_json::from_value(json!({"localQueue": "team-a"})).unwrap(),
    );
    assert_eq!(
        queue_of(&config, part, Some(&account)).as_deref(),
        Some("team-a")
    );
    // Neither names one: an ordinary Pod.
    assert_eq!(
        queue_of(&self::config(), Role::Whole, Some(&account)).as_deref(),
        Some("team-a")
    );
    assert_eq!(queue_of(&self::config(), Role::Whole, None), None);
}

#[test]
fn a_local_queue_that_cannot_be_a_label_value_is_refused_by_name() {
    let error = OperatorConfig::parse(
        "models:\n- {name: m, path: /models/m, numLayers: 30, hiddenSize: 576, lane: small, image: img:1, localQueue: GPU_Queue}\nlanes: {small: 1, large: 1}\n",
    )
    .unwrap_err();
    assert!(error.contains("\"GPU_Queue\""), "{error}");
    assert!(error.contains("lowercase"), "{error}");
}

/// A Pod Kueue's webhook took in for LocalQueue `q`, created at `created`.
fn kueue_pod(gated: bool, status: serde_json::Value, created: &str) -> Pod {
    let mut pod = pod_with(status);
    pod.metadata.labels = Some(
        [
            (KUEUE_QUEUE_LABEL.to_owned(), "q".to_owned()),
            (KUEUE_MANAGED_LABEL.to_owned(), "true".to_owned()),
        ]
        .into(),
    );
    pod.metadata.creation_timestamp = Some(Time(created.parse().unwrap()));
    let spec = pod.spec.get_or_insert_with(Default::default);
    if gated {
        spec.scheduling_gates = Some(vec![k8s_openapi::api::core::v1::PodSchedulingGate {
            name: "kueue.x-k8s.io/admission".into(),
        }]);
    }
    pod
}

#[test]
fn a_pod_kueue_holds_is_waiting_for_its_queue_with_no_start_timeout_running() {
    let created = "2026-01-01T00:00:00Z";
    let gated = kueue_pod(
        true,
        json!({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
        "reason": "SchedulingGated", "message": "Scheduling is blocked due to non-empty scheduling gates", "lastTransitionTime": created}]}),
        created,
    );
    let PodState::Starting { waiting, since } = observe(&gated) else {
        panic!("not starting")
    };
    let (reason, message) = waiting.unwrap();
    assert_eq!(reason, "WaitingForQueue");
    assert!(message.contains("\"q\""), "{message}");
    assert_eq!(since, None);
    // Admitted (the gate lifted) but no node yet: Kueue's own wait, still no start timeout.
    let admitted = kueue_pod(
        false,
        json!({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
        "reason": "Unschedulable", "message": "0/3 nodes are available", "lastTransitionTime": created}]}),
        created,
    );
    assert!(matches!(
        observe(&admitted),
        PodState::Starting { since: None, waiting: Some((reason, _)) } if reason == "Unschedulable"
    ));
    // Scheduled: the image pull's wait is the start timeout's again.
    let scheduled = "2026-01-01T02:00:00Z";
    let pulling = kueue_pod(
        false,
        json!({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": scheduled}]}),
        created,
    );
    let PodState::Starting { since, .. } = observe(&pulling) else {
        panic!("not starting")
    };
    assert_eq!(since.map(|t| t.0.to_string()).as_deref(), Some(scheduled));
}

#[test]
fn a_pod_with_a_queue_label_that_kueue_did_not_take_in_is_an_ordinary_pod() {
    let created = "2026-01-01T00:00:00Z";
    // Gated by something else, with the queue label but no sign of Kueue's webhook: not
    // reported as waiting for a queue; the scheduler's words stand.
    let mut pod = kueue_pod(
        true,
        json!({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
        "reason": "SchedulingGated", "message": "Scheduling is blocked due to non-empty scheduling gates", "lastTransitionTime": created}]}),
        created,
    );
    pod.metadata
        .labels
        .as_mut()
        .unwrap()
        .remove(KUEUE_MANAGED_LABEL);
    let PodState::Starting { since, waiting } = observe(&pod) else {
        panic!("not starting")
    };
    assert_eq!(since, None);
    assert_eq!(waiting.unwrap().0, "SchedulingGated");
}

#[test]
fn the_cleanup_pod_mounts_the_models_volumes_takes_no_gpu_and_names_the_job() {
    let mut config = OperatorConfig::parse(
        "models:\n- {name: m, path: /models/m, numLayers: 30, hiddenSize: 576, lane: small, image: img:1, gpus: 2, nodeSelector: {gpu: h200}, localQueue: gpu, volumes: [{name: out, persistentVolumeClaim: {claimName: outputs}}], volumeMounts: [{name: out, mountPath: /out}]}\nlanes: {small: 1, large: 1}\n",
    )
    .unwrap();
    config.worker_namespace = Some("harvest-system".into());
    let pod = render_cleanup(&job(), "/out/j", config.model("m").unwrap(), &config).unwrap();
    assert_eq!(pod.metadata.name.as_deref(), Some("j-uid1-cleanup"));
    assert_eq!(pod.metadata.namespace.as_deref(), Some("harvest-system"));
    let labels = pod.metadata.labels.unwrap();
    assert_eq!(labels[JOB_UID_LABEL], "uid-1");
    assert!(!labels.contains_key(KUEUE_QUEUE_LABEL), "{labels:?}");
    let spec = pod.spec.unwrap();
    assert_eq!(spec.node_selector, None);
    assert_eq!(spec.volumes.unwrap()[0].name, "out");
    let container = &spec.containers[0];
    assert_eq!(
        container.args.as_deref().unwrap()[..5],
        ["cleanup", "--output", "/out/j", "--job-uid", "uid-1"]
    );
    assert_eq!(
        container.volume_mounts.as_ref().unwrap()[0].mount_path,
        "/out"
    );
    let resources = container.resources.as_ref().unwrap();
    assert!(
        !resources
            .limits
            .as_ref()
            .unwrap()
            .contains_key("nvidia.com/gpu")
    );
}

#[test]
fn a_cleanup_pods_answer_is_read_from_its_termination_message() {
    let ended = |phase: &str, code: i32, message: &str| {
        pod_with(
            json!({"phase": phase, "containerStatuses": [{"name": "harvester", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
            "state": {"terminated": {"exitCode": code, "message": message}}}]}),
        )
    };
    assert_eq!(
        observe_cleanup(&ended("Succeeded", 0, "{\"deleted\":5}\n")),
        PodCleanup::Done(crate::finalize::cleanup::Cleanup::Deleted(5))
    );
    assert_eq!(
        observe_cleanup(&ended(
            "Succeeded",
            0,
            "{\"kept\":\"/out/j does not exist\"}"
        )),
        PodCleanup::Done(crate::finalize::cleanup::Cleanup::Kept(
            "/out/j does not exist".into()
        ))
    );
    let PodCleanup::Failed(why) = observe_cleanup(&ended(
        "Failed",
        3,
        "{\"failed\":\"store /out/j: disk gone\"}",
    )) else {
        panic!("not failed")
    };
    assert!(why.contains("disk gone"), "{why}");
    assert_eq!(
        observe_cleanup(&pod_with(json!({"phase": "Running"}))),
        PodCleanup::Pending
    );
}
