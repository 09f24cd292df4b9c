//! Jobs run in parts on the test cluster (the fake apiserver, its kubelet running the real
//! harvester on SmolLM2): N parts write the bytes one Pod writes, with a part killed and the
//! operator restarted mid-job, and the model's `maxPods` holds over every job, first come
//! first served.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{CAPPED, Cluster};
use harvest_crds::{HarvestJob, JobPhase, PartPhase};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;

/// Every file under `dir`, by path relative to it.
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut found = BTreeMap::new();
    let mut pending = vec![dir.to_owned()];
    while let Some(next) = pending.pop() {
        for entry in std::fs::read_dir(&next).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
            } else {
                let name = path.strip_prefix(dir).unwrap().display().to_string();
                found.insert(name, std::fs::read(&path).unwrap());
            }
        }
    }
    found
}

/// `job`'s files with its own UID and output path written as `other`'s, which is all two
/// jobs of one plan may differ by.
fn files_as_if(
    cluster: &Cluster,
    job: &HarvestJob,
    other: &HarvestJob,
) -> BTreeMap<String, Vec<u8>> {
    let name = |j: &HarvestJob| j.metadata.name.clone().unwrap();
    let uid = |j: &HarvestJob| j.metadata.uid.clone().unwrap();
    let (from_out, to_out) = (
        cluster.output(&name(job)).display().to_string(),
        cluster.output(&name(other)).display().to_string(),
    );
    files(&cluster.output(&name(job)))
        .into_iter()
        .map(|(path, bytes)| match String::from_utf8(bytes.clone()) {
            Ok(text) => (
                path,
                text.replace(&uid(job), &uid(other))
                    .replace(&from_out, &to_out)
                    .into_bytes(),
            ),
            Err(_) => (path, bytes),
        })
        .collect()
}

fn succeeded(job: &HarvestJob) -> &harvest_crds::HarvestJobStatus {
    let status = job.status.as_ref().unwrap();
    assert_eq!(status.phase, Some(JobPhase::Succeeded), "{status:?}");
    status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_parts_with_one_killed_and_the_operator_restarted_write_the_bytes_of_one_pod() {
    let mut cluster = Cluster::start(2).await;
    // 36 prompts in shards of 4: 9 shards, 3 per part.
    let prompts = cluster.prompts("corpus", 36, 8);
    let one = cluster.submit("one", prompts.clone(), |_| {}).await;
    cluster
        .submit("three", prompts, |s| s.parallelism = Some(3))
        .await;
    let victim = (SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos()
        % 3) as usize;
    let running = cluster
        .wait("three", "the chosen part running", |j| {
            let pod = j
                .status
                .as_ref()
                .and_then(|s| s.parts.get(victim))
                .and_then(|p| p.pod.clone());
            pod.is_some_and(|pod| {
                cluster
                    .server
                    .get("/api/v1", "pods", "default", &pod)
                    .is_some_and(|p| p["status"]["phase"] == "Running")
            })
        })
        .await;
    let pod = running.status.unwrap().parts[victim].pod.clone().unwrap();
    assert!(
        cluster.server.oom_kill("default", &pod),
        "part {victim}'s Pod {pod} was running"
    );
    cluster.kill_operator().await;
    cluster.start_operator();
    let three = cluster.finished("three").await;
    let one_done = cluster.finished("one").await;
    let (status, one_status) = (succeeded(&three), succeeded(&one_done));
    assert_eq!(status.parts_summary.as_deref(), Some("3/3"));
    assert!(status.parts.iter().all(|p| p.phase == PartPhase::Succeeded));
    let killed = &status.parts[victim];
    assert_eq!(
        (killed.attempts, killed.failures),
        (2, 1),
        "part {victim}: {killed:?}"
    );
    let shards: Vec<_> = status
        .parts
        .iter()
        .map(|p| p.shards.clone().unwrap())
        .collect();
    assert_eq!(shards, [vec![0, 3], vec![3, 6], vec![6, 9]]);
    assert!(
        status.pod.as_deref().unwrap().ends_with("-finalize-1"),
        "{status:?}"
    );
    assert_eq!(status.result.as_ref().unwrap().n_shards, 9);
    let charged = |s: &harvest_crds::HarvestJobStatus| s.tokens.unwrap().charged.unwrap();
    assert_eq!(
        charged(status),
        charged(one_status),
        "charged as one Pod would be"
    );
    assert_eq!(charged(status), one_status.result.as_ref().unwrap().tokens);
    let (three_files, one_files) = (
        files_as_if(&cluster, &three, &one),
        files(&cluster.output("one")),
    );
    assert!(three_files.contains_key("manifest.json") && three_files.len() > 9);
    assert_eq!(
        three_files.keys().collect::<Vec<_>>(),
        one_files.keys().collect::<Vec<_>>()
    );
    for (path, bytes) in &one_files {
        if path == "result.json" {
            // A process's own summary: its timings and resumed shards are its own, and so is
            // why `--device auto` chose its device (finalize runs none, so chooses none).
            let summary = |bytes: &[u8]| {
                let mut value: serde_json::Value = serde_json::from_slice(bytes).unwrap();
                let fields = value.as_object_mut().unwrap();
                assert!(
                    fields.remove("timings").is_some() && fields.remove("resumed_shards").is_some()
                );
                fields.remove("device_reason");
                value
            };
            assert_eq!(summary(&three_files[path]), summary(bytes));
            continue;
        }
        assert!(three_files[path] == *bytes, "{path} differs");
    }
    let _ = one;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_pods_holds_over_every_job_of_the_model_and_queued_pods_start_first_come_first_served()
{
    let cluster = Cluster::start(2).await;
    let prompts = cluster.prompts("corpus", 24, 8);
    cluster
        .submit("wide", prompts.clone(), |s| {
            s.model = CAPPED.into();
            s.parallelism = Some(3);
        })
        .await;
    cluster
        .wait("wide", "admitted", |j| {
            j.status.as_ref().is_some_and(|s| s.parallelism == Some(3))
        })
        .await;
    cluster
        .submit("narrow", prompts, |s| s.model = CAPPED.into())
        .await;
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), "default");
    let (mut most, mut narrow_waited) = (0, false);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(240);
    loop {
        let listed = pods.list(&ListParams::default()).await.unwrap();
        let live = listed
            .items
            .iter()
            .filter(|p| {
                !p.metadata
                    .name
                    .as_deref()
                    .unwrap_or_default()
                    .contains("-finalize-")
            })
            .filter(|p| {
                let phase = p.status.as_ref().and_then(|s| s.phase.clone());
                !matches!(phase.as_deref(), Some("Succeeded" | "Failed"))
            })
            .count();
        most = most.max(live);
        let narrow = cluster.jobs().get("narrow").await.unwrap();
        let status = narrow.status.unwrap_or_default();
        narrow_waited |= harvest_crds::conditions::get(&status.conditions, "Running")
            .is_some_and(|c| c.reason == "WaitingForPodSlot");
        let wide = cluster
            .jobs()
            .get("wide")
            .await
            .unwrap()
            .status
            .unwrap_or_default();
        let finished = |s: &harvest_crds::HarvestJobStatus| {
            harvest_crds::conditions::is_true(&s.conditions, "Finished")
        };
        if finished(&status) && finished(&wide) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{wide:?}\n{status:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        most <= 2,
        "{most} worker Pods of the capped model ran at once"
    );
    assert!(narrow_waited, "the one-Pod job waited for a slot");
    let (wide, narrow) = (
        cluster.finished("wide").await,
        cluster.finished("narrow").await,
    );
    succeeded(&wide);
    succeeded(&narrow);
    // First come first served: the wide job's last part was created before the later job's Pod.
    let created = |name: &str| {
        cluster
            .server
            .get("/api/v1", "pods", "default", name)
            .unwrap()["metadata"]["creationTimestamp"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let last_part = wide.status.as_ref().unwrap().parts[2].pod.clone().unwrap();
    let narrow_pod = narrow.status.as_ref().unwrap().pod.clone().unwrap();
    assert!(created(&last_part) <= created(&narrow_pod));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallelism_of_zero_is_refused_by_the_schema_and_above_the_cap_fails_naming_it() {
    let cluster = Cluster::start(2).await;
    let prompts = cluster.prompts("corpus", 4, 2);
    let mut spec =
        harvest_crds::HarvestJobSpec::new("smollm2-135m", prompts.clone(), "/tmp/x", 1000);
    spec.parallelism = Some(0);
    let refused = cluster
        .jobs()
        .create(&Default::default(), &HarvestJob::new("zero", spec))
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("parallelism"), "{refused}");
    cluster
        .submit("wide", prompts, |s| s.parallelism = Some(5))
        .await;
    let job = cluster.finished("wide").await;
    let finished =
        harvest_crds::conditions::get(&job.status.as_ref().unwrap().conditions, "Finished")
            .unwrap();
    assert_eq!(finished.reason, "ParallelismAboveCap");
    assert!(
        finished.message.contains("maxParallelism 4"),
        "{}",
        finished.message
    );
}
