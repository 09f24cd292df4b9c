//! Apply: a decision's actions, in order. The Pod actions come first (a create the apiserver
//! refuses for good, or that a ResourceQuota holds back, is handed to the decision's pure
//! bookkeeping, [`crate::decide::applied`]), then the status (conditional on the
//! resourceVersion read), then the Events and the TTL deletion.

use std::time::Duration;

use harvest_crds::SpecError;
use harvest_crds::conditions::{self, ADMITTED};
use k8s_openapi::api::core::v1::{Pod, ResourceQuota};
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action as Requeue;
use kube::{Api, ResourceExt};
use serde_json::json;
use tracing::{info, warn};

use crate::decide::applied::{Applied, already_waiting, what};
use crate::decide::{Action, Decision, FAILED_CREATE, WAITING_FOR_QUOTA};
use crate::error::Result;
use crate::ledger;
use crate::pod::render;
use crate::shell::{Shell, delete_pod, post_params, publish};

impl Shell<'_> {
    /// Applies `decision` in order: the Pod actions, the pure bookkeeping of what they came to
    /// ([`Applied::record`]), the status when it changed, then the Events and the TTL
    /// deletion. A status write that fails gives back a waiting job's admission.
    pub(crate) async fn apply(
        &self,
        mut decision: Decision,
        checked: &std::result::Result<harvest_crds::ValidJob, SpecError>,
        waiting: bool,
        now: Timestamp,
    ) -> Result<Requeue> {
        let old = self.job.status_or_default();
        let applied = self.apply_pods(&decision, checked).await?;
        let generation = self.job.metadata.generation;
        applied.record(&mut decision, &self.ctx.config, generation, now);
        if decision.status != old {
            if let Err(error) = self.write_status(&decision.status).await {
                if waiting {
                    self.ctx.forget_admission(self.job);
                }
                return Err(error);
            }
            self.record_transition(&old, &decision.status, now);
        }
        self.apply_after_status(&decision).await
    }

    /// A merge patch of the job, conditional on the resourceVersion this reconcile read.
    pub(crate) async fn patch_job(&self, mut patch: serde_json::Value) -> Result<()> {
        patch["metadata"]["resourceVersion"] = json!(self.job.resource_version());
        self.jobs
            .patch(
                &self.job.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await?;
        Ok(())
    }

    /// The Pod actions, which come before the status write. A create the apiserver refuses
    /// for good (no ServiceAccount, Pod Security, an invalid Pod) is published as a
    /// `FailedCreate` Event and returned, so that it fails the attempt instead of being
    /// retried every few seconds.
    async fn apply_pods(
        &self,
        decision: &Decision,
        checked: &std::result::Result<harvest_crds::ValidJob, SpecError>,
    ) -> Result<Applied> {
        let ctx = self.ctx;
        let mut applied = Applied::default();
        for action in &decision.actions {
            match action {
                Action::DeletePod(pod_name) => delete_pod(&self.pods, pod_name).await?,
                Action::CreatePod(attempt) => {
                    let (Ok(valid), Some(entry)) =
                        (checked, ctx.config.model(&self.job.spec.model))
                    else {
                        continue;
                    };
                    let account = ctx.paying_account(self.job);
                    let pod = render(
                        self.job,
                        valid,
                        entry,
                        &ctx.config,
                        attempt,
                        account.as_deref(),
                    )?;
                    let (role, number) = (what(attempt.role), attempt.number);
                    if let Some(why) = self.tenant_quota_refusal(&pod).await? {
                        info!(attempt = number, reason = %why, "the job's namespace's ResourceQuota would not take the attempt's Pod; waiting");
                        let message = format!("{role}attempt {number}: waiting for quota: {why}");
                        applied.waiting_for_quota.push((attempt.role, message));
                        continue;
                    }
                    ctx.grant_pod(self.job, attempt);
                    match self.pods.create(&post_params(), &pod).await {
                        Ok(_) => info!(
                            attempt = number,
                            role = role.trim(),
                            "created the attempt's Pod"
                        ),
                        Err(kube::Error::Api(status)) if status.code == 409 => {}
                        Err(kube::Error::Api(status)) if exceeds_quota(&status) => {
                            ctx.forget_pod(self.job, attempt);
                            let message = format!(
                                "{role}attempt {number}: waiting for quota: {}",
                                status.message
                            );
                            info!(attempt = number, error = %status.message, "a ResourceQuota refused the attempt's Pod; waiting");
                            applied.waiting_for_quota.push((attempt.role, message));
                        }
                        Err(kube::Error::Api(status))
                            if matches!(status.code, 400 | 403 | 404 | 422) =>
                        {
                            let message = format!(
                                "{role}attempt {number}: Error creating Pod: {}",
                                status.message
                            );
                            warn!(attempt = number, error = %status.message, "the apiserver refused the attempt's Pod");
                            publish(ctx, self.job, true, FAILED_CREATE, &message).await;
                            applied.refused = Some(message);
                            return Ok(applied);
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                Action::Event { .. } | Action::DeleteJob => {}
            }
        }
        for (role, message) in &applied.waiting_for_quota {
            if !already_waiting(&self.job.status_or_default(), *role) {
                publish(ctx, self.job, true, WAITING_FOR_QUOTA, message).await;
            }
        }
        Ok(applied)
    }

    /// Replaces the status, conditional on the resourceVersion the reconcile read.
    async fn write_status(&self, status: &harvest_crds::HarvestJobStatus) -> Result<()> {
        let mut updated = self.job.clone();
        updated.status = Some(status.clone());
        self.jobs
            .replace_status(&self.job.name_any(), &post_params(), &updated)
            .await?;
        Ok(())
    }

    /// Metrics and logs of a status change that was written.
    fn record_transition(
        &self,
        old: &harvest_crds::HarvestJobStatus,
        new: &harvest_crds::HarvestJobStatus,
        now: Timestamp,
    ) {
        if !conditions::is_true(&old.conditions, ADMITTED)
            && conditions::is_true(&new.conditions, ADMITTED)
        {
            let created = self
                .job
                .metadata
                .creation_timestamp
                .as_ref()
                .map_or(now, |t| t.0);
            self.ctx
                .metrics
                .admitted(now.duration_since(created).as_secs_f64());
        }
        if new.phase != old.phase {
            info!(phase = ?new.phase, "job phase changed");
        }
    }

    /// Events and the TTL deletion, which come after the status write.
    async fn apply_after_status(&self, decision: &Decision) -> Result<Requeue> {
        for action in &decision.actions {
            match action {
                Action::Event {
                    warning,
                    reason,
                    note,
                } => publish(self.ctx, self.job, *warning, reason, note).await,
                Action::DeleteJob if ledger::unsettled(self.ctx, self.job) => {
                    return Ok(Requeue::requeue(Duration::from_secs(1)));
                }
                Action::DeleteJob => {
                    info!("time to live after finishing ran out; deleting the job");
                    match self
                        .jobs
                        .delete(&self.job.name_any(), &DeleteParams::background())
                        .await
                    {
                        Ok(_) => {}
                        Err(kube::Error::Api(status)) if status.code == 404 => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                Action::DeletePod(_) | Action::CreatePod(_) => {}
            }
        }
        Ok(decision
            .requeue_after
            .map_or_else(Requeue::await_change, Requeue::requeue))
    }
}

impl Shell<'_> {
    /// Why the job's namespace's own ResourceQuotas would not take `pod`, which runs in the
    /// shared `workerNamespace` where the apiserver charges it to that namespace's instead
    /// (see [`crate::decide::tenant_quota`]); `None` for a Pod in the job's own namespace.
    async fn tenant_quota_refusal(&self, pod: &Pod) -> Result<Option<String>> {
        if !self.elsewhere {
            return Ok(None);
        }
        let tenant = self.job.namespace().unwrap_or_default();
        let quotas: Api<ResourceQuota> = Api::namespaced(self.ctx.client.clone(), &tenant);
        let quotas = match quotas.list(&ListParams::default()).await {
            Ok(list) => list.items,
            // An install whose RBAC predates this check: the apiserver's own quotas still hold.
            Err(kube::Error::Api(status)) if status.code == 403 => {
                warn!(namespace = %tenant, error = %status.message, "cannot read the job's namespace's ResourceQuotas (give the operator list on resourcequotas); its workers are not counted against them");
                return Ok(None);
            }
            Err(e) => return Err(e.into()),
        };
        if quotas.is_empty() {
            return Ok(None);
        }
        let selector = format!("{}={tenant}", crate::pod::TENANT_LABEL);
        let workers: Vec<Pod> = self
            .pods
            .list(&ListParams::default().labels(&selector))
            .await?
            .items
            .into_iter()
            .filter(|p| p.metadata.name != pod.metadata.name)
            .filter(|p| {
                let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
                !matches!(phase, Some("Succeeded" | "Failed"))
            })
            .collect();
        Ok(crate::decide::tenant_quota::refusal(
            &tenant, &quotas, &workers, pod,
        ))
    }
}

/// ResourceQuota's refusal: 403 `exceeded quota`. It clears when other Pods end, so the
/// attempt waits; every other 403 (Pod Security, a LimitRange) is for good.
fn exceeds_quota(status: &kube::core::Status) -> bool {
    status.code == 403 && status.message.contains("exceeded quota")
}
