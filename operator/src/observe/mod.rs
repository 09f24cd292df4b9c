//! Observe: what [`crate::decide`] needs of one job, read from the cache and the apiserver: the
//! attempt's Pod, the parts' Pods, the running workers' progress (from their log tails) and,
//! for a waiting job, the admission verdict. It writes nothing to the cluster; the verdict's
//! account hold is taken in the operator's own memory (`Context::admission`),
//! under the lock that orders admissions, so that two jobs of one account are never both
//! admitted on the same tokens.

use std::time::Duration;

use harvest_core::worker::ProgressEvent;
use harvest_crds::SpecError;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::ResourceExt;
use kube::api::LogParams;

use crate::decide::admission::Admission;
use crate::decide::{Observed, Workers};
use crate::error::Result;
use crate::pod::{PodState, observe_for_job, reported_progress};
use crate::shell::Shell;

/// Log lines read for the newest progress report (the worker writes one per batch).
const PROGRESS_LOG_LINES: i64 = 20;
/// How long a reconcile waits for a worker's log tail before it goes on without it.
const PROGRESS_READ_WITHIN: Duration = Duration::from_secs(3);

impl Shell<'_> {
    /// What `decide` needs: the spec check, the attempt's Pod and its worker's progress, and,
    /// for a waiting job, the admission verdict (which may take the account's hold).
    pub(crate) async fn observe(
        &self,
        checked: &std::result::Result<harvest_crds::ValidJob, SpecError>,
        waiting: bool,
        now: Timestamp,
    ) -> Result<Observed<'_>> {
        let job = self.job;
        let old = job.status_or_default();
        let uid = job.uid().unwrap_or_default();
        let pod = match &old.pod {
            Some(pod_name) => self
                .pods
                .get_opt(pod_name)
                .await?
                .map(|p| observe_for_job(&p, &uid, self.elsewhere)),
            None => None,
        };
        let reported = match (&pod, &old.pod) {
            (Some(PodState::Running), Some(pod_name)) => {
                worker_progress(&self.pods, pod_name).await
            }
            _ => None,
        };
        let workers = self.observe_workers(checked, &old, &uid).await?;
        let (admission, account) = match (waiting, checked) {
            (true, Ok(valid)) => {
                self.ctx
                    .admission(job, valid.lane, valid.token_budget, now)
                    .await?
            }
            _ => (
                Admission::Wait {
                    reason: "NotWaiting",
                    message: String::new(),
                },
                None,
            ),
        };
        Ok(Observed {
            job,
            spec: checked
                .as_ref()
                .map(|v| v.token_budget)
                .map_err(Clone::clone),
            pod,
            reported,
            admission,
            account,
            lane: checked.as_ref().ok().map(|v| v.lane.to_string()),
            now,
            start_timeout: self
                .ctx
                .config
                .model(&job.spec.model)
                .map(|m| Duration::from_secs(m.start_timeout_seconds)),
            worker_image: self
                .ctx
                .config
                .model(&job.spec.model)
                .map(|m| m.image.clone()),
            workers,
        })
    }

    /// The job's parts' Pods and progress, and the worker Pods it may start under the model's
    /// `maxPods`.
    async fn observe_workers(
        &self,
        checked: &std::result::Result<harvest_crds::ValidJob, SpecError>,
        old: &harvest_crds::HarvestJobStatus,
        uid: &str,
    ) -> Result<Workers> {
        let mut parts = Vec::new();
        let mut reports = Vec::new();
        for index in 0..old.part_count() {
            let name = old
                .parts
                .iter()
                .find(|p| p.index == index)
                .and_then(|p| p.pod.clone());
            let pod = match &name {
                Some(name) => self
                    .pods
                    .get_opt(name)
                    .await?
                    .map(|p| observe_for_job(&p, uid, self.elsewhere)),
                None => None,
            };
            let report = match (&pod, &name) {
                (Some(PodState::Running), Some(name)) => worker_progress(&self.pods, name).await,
                _ => None,
            };
            parts.push(pod);
            reports.push(report);
        }
        if old.part_count() <= 1 {
            parts.clear();
            reports.clear();
        }
        Ok(Workers {
            parallelism: checked.as_ref().map_or(1, |v| v.parallelism),
            parts,
            reports,
            pod_slots: self.ctx.pod_slots(self.job),
        })
    }
}

/// The running worker's last progress report, from the tail of its log. Best effort, and
/// bounded by [`PROGRESS_READ_WITHIN`]: the apiserver proxies the read to the Pod's kubelet,
/// and a hung node's kubelet never answers (found on the real tier: each reconcile of a job
/// on a lost node then waited minutes, and the Pod was never given up). A log that cannot be
/// read in time leaves the progress as it was.
async fn worker_progress(pods: &Api<Pod>, pod_name: &str) -> Option<ProgressEvent> {
    let params = LogParams {
        tail_lines: Some(PROGRESS_LOG_LINES),
        ..LogParams::default()
    };
    match tokio::time::timeout(PROGRESS_READ_WITHIN, pods.logs(pod_name, &params)).await {
        Ok(Ok(log)) => reported_progress(&log),
        Ok(Err(error)) => {
            tracing::debug!(%error, pod = pod_name, "could not read the worker's log");
            None
        }
        Err(_) => {
            tracing::debug!(pod = pod_name, "the worker's log did not come in time");
            None
        }
    }
}
