//! Worker Pods in the operator's `workerNamespace` whose job is gone. Owner references cannot
//! cross namespaces, so no garbage collector deletes them; a finalizer on every tenant job
//! could, but it would hang an uninstall (the operator goes with the manifests, and the jobs it
//! no longer finalizes keep the CRD and their namespaces Terminating). The leader sweeps them
//! instead, every `workerSweepSeconds`.

use std::collections::HashSet;
use std::time::Duration;

use harvest_crds::HarvestJob;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, ListParams, Preconditions};
use kube::runtime::reflector::Store;
use kube::{Api, ResourceExt};
use tracing::{info, warn};

use crate::error::Result;
use crate::pod::{JOB_UID_LABEL, MANAGED_BY};

/// The Pods among `pods` whose job (by the UID label) is not among `live` jobs' UIDs, and that
/// are not already being deleted.
pub fn orphans<'a>(pods: &'a [Pod], live: &HashSet<String>) -> Vec<&'a Pod> {
    pods.iter()
        .filter(|pod| pod.metadata.deletion_timestamp.is_none())
        .filter(|pod| {
            pod.labels()
                .get(JOB_UID_LABEL)
                .is_some_and(|uid| !live.contains(uid))
        })
        .collect()
}

/// Deletes the worker Pods whose job is gone; returns how many.
pub async fn sweep_once(pods: &Api<Pod>, jobs: &Store<HarvestJob>) -> Result<usize> {
    let (key, value) = MANAGED_BY;
    let listed = pods
        .list(&ListParams::default().labels(&format!("{key}={value},{JOB_UID_LABEL}")))
        .await?;
    // The jobs are read after the Pods: a job made meanwhile has a Pod that was not listed.
    let live: HashSet<String> = jobs.state().iter().filter_map(|job| job.uid()).collect();
    let mut deleted = 0;
    for pod in orphans(&listed.items, &live) {
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: pod.uid(),
                resource_version: None,
            }),
            ..DeleteParams::background()
        };
        match pods.delete(&pod.name_any(), &params).await {
            Ok(_) => {
                info!(pod = %pod.name_any(), "deleted a worker whose job is gone");
                deleted += 1;
            }
            Err(kube::Error::Api(status)) if matches!(status.code, 404 | 409) => {}
            Err(error) => return Err(error.into()),
        }
    }
    Ok(deleted)
}

/// Sweeps every `every`, once the job cache has synced, until the future is dropped.
pub async fn sweep_forever(pods: Api<Pod>, jobs: Store<HarvestJob>, every: Duration) {
    if jobs.wait_until_ready().await.is_err() {
        return;
    }
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        if let Err(error) = sweep_once(&pods, &jobs).await {
            warn!(%error, "could not sweep the worker namespace");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(name: &str, uid: &str, deleting: bool) -> Pod {
        let mut pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "labels": {JOB_UID_LABEL: uid}}
        }))
        .unwrap();
        if deleting {
            pod.metadata.deletion_timestamp =
                Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
                ));
        }
        pod
    }

    #[test]
    fn only_workers_of_jobs_that_are_gone_and_not_yet_deleting_are_orphans() {
        let pods = [
            worker("live-1", "live", false),
            worker("gone-1", "gone", false),
            worker("gone-2", "gone", true),
            serde_json::from_value(serde_json::json!({"metadata": {"name": "unlabelled"}}))
                .unwrap(),
        ];
        let live = HashSet::from(["live".to_owned()]);
        let names: Vec<String> = orphans(&pods, &live).iter().map(|p| p.name_any()).collect();
        assert_eq!(names, ["gone-1"]);
    }
}
