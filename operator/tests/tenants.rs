//! What a tenant with `edit` rights in its namespace might try against the operator, each as
//! the attack itself, on the fake apiserver running the real harvester: a Pod made under the
//! name the operator will use, a cleanup aimed at other jobs' outputs, a corpus past its
//! token budget.
#![allow(clippy::unwrap_used)]

mod common;

use common::Cluster;
use harvest_crds::HarvestJob;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;

fn finished(job: &HarvestJob) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
    harvest_crds::conditions::get(&job.status.as_ref().unwrap().conditions, "Finished")
        .unwrap()
        .clone()
}

async fn unsuspend(cluster: &Cluster, name: &str) {
    let patch = json!({"spec": {"suspend": false}});
    cluster
        .jobs()
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_made_beforehand_under_the_workers_name_is_never_read_as_the_result() {
    let cluster = Cluster::start(1).await;
    let prompts = cluster.prompts("squat", 4, 4);
    let job = cluster.submit("squat", prompts, |s| s.suspend = true).await;
    // The tenant reads the job's UID and makes the first attempt's Pod itself: it exits 0
    // at once, which would read as a harvest that ran no tokens.
    let name = harvest_operator::pod::pod_name("squat", job.metadata.uid.as_deref(), 1);
    let squatter: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "default",
                     "labels": {"app.kubernetes.io/managed-by": "harvest-operator", "harvest.dev/job": "squat"}},
        "spec": {"restartPolicy": "Never", "serviceAccountName": "harvest-worker",
                 "containers": [{"name": "harvester", "image": "harvest/harvester:test", "args": ["--help"]}]}
    }))
    .unwrap();
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), "default");
    pods.create(&PostParams::default(), &squatter)
        .await
        .unwrap();
    unsuspend(&cluster, "squat").await;
    let job = cluster.finished("squat").await;
    let condition = finished(&job);
    assert_eq!(condition.reason, "PodNameTaken", "{:?}", job.status);
    assert!(condition.message.contains(&name), "{}", condition.message);
    let status = job.status.unwrap();
    assert!(status.result.is_none(), "the squatter's exit is no result");
    assert_eq!(status.tokens.unwrap().charged, Some(0));
    assert!(
        pods.get_opt(&name).await.unwrap().is_some(),
        "the operator leaves a Pod it did not make alone"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_job_aimed_at_another_jobs_output_or_the_whole_store_deletes_none_of_it() {
    let cluster = Cluster::start(2).await;
    let prompts = cluster.prompts("victim", 4, 2);
    cluster.submit("victim", prompts.clone(), |_| {}).await;
    let victim = cluster.finished("victim").await;
    assert_eq!(finished(&victim).reason, "Succeeded");
    let output = cluster.output("victim");
    let files = |dir: &std::path::Path| {
        let mut names: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    };
    let before = files(&output);
    assert!(before.contains(&"manifest.json".to_owned()), "{before:?}");

    // One job writes over the victim's output (another plan, so the harvester refuses to
    // mix them), one names the top of the store and is deleted before it runs.
    let out = output.display().to_string();
    cluster
        .submit("into-victim", prompts.clone(), |s| {
            s.output = Some(out);
            s.harvest.layers = Some(vec![3]);
            s.output_retention = harvest_crds::OutputRetention::Delete;
        })
        .await;
    let store = output.parent().unwrap().display().to_string();
    cluster
        .submit("whole-store", prompts, |s| {
            s.output = Some(store);
            s.suspend = true;
            s.output_retention = harvest_crds::OutputRetention::Delete;
        })
        .await;
    cluster.finished("into-victim").await;
    for name in ["into-victim", "whole-store"] {
        cluster
            .wait(name, "its cleanup finalizer", |j| {
                j.metadata
                    .finalizers
                    .as_ref()
                    .is_some_and(|f| !f.is_empty())
            })
            .await;
        cluster
            .jobs()
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
        let deadline = tokio::time::Instant::now() + harvest_testkit::SETTLE_WITHIN;
        while cluster.jobs().get_opt(name).await.unwrap().is_some() {
            assert!(tokio::time::Instant::now() < deadline, "{name} not deleted");
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
    assert_eq!(files(&output), before, "the victim's files are all there");
    let events =
        Api::<k8s_openapi::api::events::v1::Event>::namespaced(cluster.client.clone(), "default")
            .list(&Default::default())
            .await
            .unwrap();
    let kept = events
        .items
        .iter()
        .filter(|e| e.reason.as_deref() == Some("OutputsKept"))
        .count();
    assert_eq!(kept, 2, "each deletion says why it kept the files");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corpus_past_its_token_budget_fails_naming_its_count_and_is_charged_nothing() {
    let cluster = Cluster::start(1).await;
    let prompts = cluster.prompts("greedy", 8, 20);
    cluster
        .submit("greedy", prompts, |s| s.token_budget = 1)
        .await;
    let job = cluster.finished("greedy").await;
    let condition = finished(&job);
    assert_eq!(condition.reason, "InvalidInput", "{:?}", job.status);
    assert!(
        condition.message.contains("token budget of 1"),
        "{}",
        condition.message
    );
    let status = job.status.unwrap();
    assert!(status.result.is_none());
    assert_eq!(status.tokens.unwrap().charged, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_aimed_outside_its_accounts_storage_prefix_is_refused_holding_nothing() {
    let cluster = Cluster::start(1).await;
    let root = cluster.dir.path().display().to_string();
    cluster
        .set_account(|spec| spec.storage_prefixes = vec![root.clone()])
        .await;
    let prompts = cluster.prompts("escape", 2, 2);
    let outside = cluster.dir.path().parent().unwrap().display().to_string();
    cluster
        .submit("escape", prompts.clone(), |s| {
            s.output = Some(outside.clone());
        })
        .await;
    let job = cluster.finished("escape").await;
    let condition = finished(&job);
    assert_eq!(
        condition.reason, "OutsideAccountStorage",
        "{:?}",
        job.status
    );
    assert!(
        condition.message.contains(&outside) && condition.message.contains(&root),
        "{}",
        condition.message
    );
    let status = job.status.unwrap();
    assert!(status.pod.is_none(), "no worker was started");
    assert!(status.tokens.is_none(), "no tokens were held");
    // Inside the prefix, the same corpus runs.
    cluster.submit("inside", prompts, |_| {}).await;
    assert_eq!(
        finished(&cluster.finished("inside").await).reason,
        "Succeeded"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_workers_in_the_operators_namespace_a_tenant_needs_no_credentials_and_its_forged_pod_is_ignored()
 {
    let mut cluster = Cluster::start(1).await;
    cluster.run_workers_in("harvest-workers").await;
    let prompts = cluster.prompts("remote", 4, 4);
    let job = cluster
        .submit("remote", prompts, |s| s.suspend = true)
        .await;
    let uid = job.metadata.uid.clone().unwrap();
    // The tenant forges the worker in its own namespace, with the job's UID label too: the
    // operator looks for workers only where tenants cannot write.
    let name = harvest_operator::pod::pod_name("remote", Some(&uid), 1);
    let forged: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "default",
                     "labels": {"app.kubernetes.io/managed-by": "harvest-operator", "harvest.dev/job-uid": uid}},
        "spec": {"restartPolicy": "Never", "serviceAccountName": "harvest-worker",
                 "containers": [{"name": "harvester", "image": "harvest/harvester:test", "args": ["--help"]}]}
    }))
    .unwrap();
    let tenant_pods: Api<Pod> = Api::namespaced(cluster.client.clone(), "default");
    tenant_pods
        .create(&PostParams::default(), &forged)
        .await
        .unwrap();
    // As an earlier release left it: the operator takes the old worker finalizer off.
    cluster
        .jobs()
        .patch(
            "remote",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"finalizers": ["harvest.dev/worker"]}})),
        )
        .await
        .unwrap();
    unsuspend(&cluster, "remote").await;
    let job = cluster.finished("remote").await;
    assert_eq!(finished(&job).reason, "Succeeded", "{:?}", job.status);
    let status = job.status.unwrap();
    let tokens = status.result.as_ref().unwrap().tokens;
    assert!(tokens > 0);
    assert_eq!(status.tokens.unwrap().charged, Some(tokens));
    let workers: Api<Pod> = Api::namespaced(cluster.client.clone(), "harvest-workers");
    let worker = workers.get(&status.pod.clone().unwrap()).await.unwrap();
    assert_eq!(worker.metadata.labels.unwrap()["harvest.dev/job-uid"], uid);
    assert!(worker.metadata.owner_references.is_none());
    let held = cluster.jobs().get("remote").await.unwrap();
    assert!(
        held.finalizers().is_empty(),
        "no finalizer waits on the operator at an uninstall: {:?}",
        held.finalizers()
    );
    // Deleting the job deletes its worker (no owner reference can), and leaves the tenant's
    // own Pod alone.
    cluster
        .jobs()
        .delete("remote", &DeleteParams::default())
        .await
        .unwrap();
    harvest_testkit::eventually(
        "the job and its worker gone",
        harvest_testkit::SETTLE_WITHIN,
        || async {
            let job = cluster.jobs().get_opt("remote").await.unwrap();
            let worker = workers.get_opt(&name).await.unwrap();
            match (job, worker) {
                (None, None) => Ok(()),
                (job, worker) => Err(format!(
                    "job {}, worker {}",
                    job.is_some(),
                    worker.is_some()
                )),
            }
        },
    )
    .await;
    assert!(tenant_pods.get_opt(&name).await.unwrap().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_puts_a_job_without_an_output_under_its_accounts_storage_and_reads_inputs_only_there()
 {
    let cluster = Cluster::start(2).await;
    // Without account storage there is nowhere to put it.
    let prompts = cluster.prompts("nowhere", 2, 2);
    cluster
        .submit("nowhere", prompts, |s| s.output = None)
        .await;
    let job = cluster.finished("nowhere").await;
    assert_eq!(finished(&job).reason, "NoOutput", "{:?}", job.status);
    let root = cluster.dir.path().join("acct");
    std::fs::create_dir_all(&root).unwrap();
    let prefix = root.display().to_string();
    cluster
        .set_account(|spec| {
            spec.storage = Some(harvest_crds::account::AccountStorage {
                prefix: prefix.clone(),
                credentials_secret: None,
            });
        })
        .await;
    let prompts = root.join("mine.jsonl");
    std::fs::copy(cluster.prompts("mine", 4, 2), &prompts).unwrap();
    let prompts = prompts.display().to_string();
    let job = cluster
        .submit("mine", prompts.clone(), |s| s.output = None)
        .await;
    let uid = job.metadata.uid.unwrap();
    let job = cluster.finished("mine").await;
    assert_eq!(finished(&job).reason, "Succeeded", "{:?}", job.status);
    let output = format!("{prefix}/default/mine-{uid}");
    assert_eq!(job.spec.output.as_deref(), Some(output.as_str()));
    assert!(
        std::path::Path::new(&output)
            .join("manifest.json")
            .is_file()
    );
    // Inputs outside the account's storage are refused, output or not.
    let outside = cluster.prompts("theirs", 4, 2);
    cluster.submit("theirs", outside, |s| s.output = None).await;
    let job = cluster.finished("theirs").await;
    let condition = finished(&job);
    assert_eq!(condition.reason, "OutsideAccountStorage", "{condition:?}");
    assert!(
        condition.message.contains("input.prompts"),
        "{}",
        condition.message
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_outputs_go_with_it_is_cleaned_up_on_s3_with_its_accounts_own_key() {
    use object_store::{ObjectStore, ObjectStoreExt};
    // It blocks until the server answers, so not on the test's runtime.
    let s3 = tokio::task::spawn_blocking(harvest_testkit::Seaweed::start)
        .await
        .unwrap();
    let cluster = Cluster::start(2).await;
    // The account's own key and endpoint, where its workers run (the job's namespace here).
    // The operator's own environment has none.
    let data = s3
        .worker_env()
        .into_iter()
        .map(|(k, v)| (k, k8s_openapi::ByteString(v.into_bytes())))
        .collect();
    let secret = k8s_openapi::api::core::v1::Secret {
        metadata: kube::api::ObjectMeta {
            name: Some("acct-s3".into()),
            ..Default::default()
        },
        data: Some(data),
        ..Default::default()
    };
    Api::namespaced(cluster.client.clone(), "default")
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    let prefix = format!("s3://{}/acct", harvest_testkit::BUCKET);
    cluster
        .set_account(|spec| {
            spec.storage = Some(harvest_crds::account::AccountStorage {
                prefix: prefix.clone(),
                credentials_secret: Some("acct-s3".into()),
            });
        })
        .await;
    let env: std::collections::HashMap<String, String> = s3.worker_env().into_iter().collect();
    let store = object_store::aws::AmazonS3Builder::new()
        .with_bucket_name(harvest_testkit::BUCKET)
        .with_region("us-east-1")
        .with_endpoint(&env["AWS_ENDPOINT_URL"])
        .with_access_key_id(harvest_testkit::ACCESS_KEY)
        .with_secret_access_key(harvest_testkit::SECRET_KEY)
        .with_allow_http(true)
        .build()
        .unwrap();
    let lines = std::fs::read(cluster.prompts("cleaned", 4, 2)).unwrap();
    store
        .put(&"acct/in/prompts.jsonl".into(), lines.into())
        .await
        .unwrap();
    let job = cluster
        .submit("cleaned", format!("{prefix}/in/prompts.jsonl"), |s| {
            s.output = None;
            s.output_retention = harvest_crds::OutputRetention::Delete;
        })
        .await;
    let uid = job.metadata.uid.unwrap();
    let job = cluster.finished("cleaned").await;
    assert_eq!(finished(&job).reason, "Succeeded", "{:?}", job.status);
    let written = object_store::path::Path::from(format!("acct/default/cleaned-{uid}"));
    let listed = |store: &object_store::aws::AmazonS3| {
        let prefix = written.clone();
        let store = store.clone();
        async move {
            futures::TryStreamExt::try_collect::<Vec<_>>(store.list(Some(&prefix)))
                .await
                .unwrap()
                .len()
        }
    };
    assert!(listed(&store).await > 2, "the job wrote its files to S3");
    cluster
        .jobs()
        .delete("cleaned", &DeleteParams::default())
        .await
        .unwrap();
    harvest_testkit::eventually("the job gone", harvest_testkit::SETTLE_WITHIN, || async {
        match cluster.jobs().get_opt("cleaned").await.unwrap() {
            None => Ok(()),
            Some(job) => Err(format!("{:?}", job.metadata.finalizers)),
        }
    })
    .await;
    assert_eq!(listed(&store).await, 0, "the outputs went with the job");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_jobs_outputs_on_the_workers_volume_are_deleted_by_a_pod_that_mounts_it() {
    let cluster = Cluster::start(2).await;
    let claim: k8s_openapi::api::core::v1::PersistentVolumeClaim = serde_json::from_value(
        serde_json::json!({"metadata": {"name": common::OUTPUTS_CLAIM}, "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}}),
    )
    .unwrap();
    Api::namespaced(cluster.client.clone(), "default")
        .create(&PostParams::default(), &claim)
        .await
        .unwrap();
    let prompts = cluster.prompts("on-volume", 4, 2);
    let output = format!("{}/on-volume", common::OUTPUTS_MOUNT);
    cluster
        .submit("on-volume", prompts, |s| {
            s.model = common::ON_VOLUME.into();
            s.output = Some(output.clone());
            s.output_retention = harvest_crds::OutputRetention::Delete;
        })
        .await;
    let job = cluster.finished("on-volume").await;
    assert_eq!(finished(&job).reason, "Succeeded", "{:?}", job.status);
    // The volume, as the test kubelet keeps it: the operator's own file system has no
    // /harvest-outputs at all.
    let root = cluster
        .output("x")
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_owned();
    let written = root
        .join("claims/default")
        .join(common::OUTPUTS_CLAIM)
        .join("on-volume");
    assert!(
        written.join("manifest.json").exists(),
        "the job wrote to the volume"
    );
    assert!(!std::path::Path::new(&output).exists());
    cluster
        .jobs()
        .delete("on-volume", &DeleteParams::default())
        .await
        .unwrap();
    harvest_testkit::eventually("the job gone", harvest_testkit::SETTLE_WITHIN, || async {
        match cluster.jobs().get_opt("on-volume").await.unwrap() {
            None => Ok(()),
            Some(job) => Err(format!("{:?}", job.metadata.finalizers)),
        }
    })
    .await;
    assert!(!written.exists(), "the outputs went with the job");
    // The cleanup Pod is gone too.
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), "default");
    let left = pods.list(&Default::default()).await.unwrap();
    let cleanup: Vec<_> = left
        .items
        .iter()
        .filter_map(|p| p.metadata.name.clone())
        .filter(|n| n.ends_with("-cleanup"))
        .collect();
    assert!(cleanup.is_empty(), "{cleanup:?}");
    let events =
        Api::<k8s_openapi::api::events::v1::Event>::namespaced(cluster.client.clone(), "default")
            .list(&Default::default())
            .await
            .unwrap();
    let deleted = events
        .items
        .iter()
        .find(|e| e.reason.as_deref() == Some("OutputsDeleted"))
        .and_then(|e| e.note.clone())
        .unwrap_or_default();
    assert!(deleted.contains(&output), "{deleted}");
}
