//! The reconcile shell: observe (the job from the cache, its Pod from the apiserver, the lane
//! queue from the cache), call [`decide`], and apply the decision. With `leader`, `cleanup`
//! and the `metrics` endpoint, the only modules that talk to the outside.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use harvest_crds::conditions::{self, ADMITTED, FINISHED};
use harvest_crds::{HarvestJob, OutputRetention, SpecError};
use k8s_openapi::api::core::v1::{Pod, ResourceQuota, Secret};
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, ListParams, LogParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action as Requeue;
use kube::runtime::events::{Event, EventType};
use kube::{Api, Resource, ResourceExt};
use serde_json::json;
use tracing::{info, instrument, warn};

use crate::admission::Admission;
pub use crate::context::Context;
pub(crate) use crate::context::key_of;
use crate::decide::{
    Action, Decision, FAILED_CREATE, Observed, Policy, WAITING_FOR_QUOTA, Workers, decide,
};
use crate::error::{Error, Result};
use crate::pod::{PodState, observe_for_job, render, reported_progress};
use crate::{cleanup, ledger};
use harvest_core::worker::ProgressEvent;

/// The finalizer that deletes a job's outputs when its retention is `Delete`.
pub const CLEANUP_FINALIZER: &str = "harvest.dev/output-cleanup";
/// The finalizer earlier releases put on a job whose worker runs in the operator's worker
/// namespace. No longer added (the sweep deletes such workers); taken off when seen, and
/// honoured on a job deleted while it still carries it.
pub const WORKER_FINALIZER: &str = "harvest.dev/worker";
/// The field manager of the operator's writes.
const MANAGER: &str = "harvest-operator";
/// Log lines read for the newest progress report (the worker writes one per batch).
const PROGRESS_LOG_LINES: i64 = 20;
/// How long a reconcile waits for a worker's log tail before it goes on without it.
const PROGRESS_READ_WITHIN: Duration = Duration::from_secs(3);

/// One reconcile of one job: observe, decide (pure, in `decide`), then apply.
#[instrument(skip_all, fields(job = %key_of(&job)))]
pub async fn reconcile(job: Arc<HarvestJob>, ctx: Arc<Context>) -> Result<Requeue> {
    let _timer = ctx.metrics.reconcile_started();
    let _slots = crate::context::SlotRelease(&ctx, key_of(&job));
    let namespace = job.namespace().unwrap_or_default();
    let pod_namespace = ctx.config.pod_namespace(&job);
    let shell = Shell {
        ctx: &ctx,
        job: &job,
        jobs: Api::namespaced(ctx.client.clone(), &namespace),
        pods: Api::namespaced(ctx.client.clone(), &pod_namespace),
        elsewhere: pod_namespace != namespace,
    };
    if let Some(requeue) = shell.finalizer().await? {
        return Ok(requeue);
    }
    if let Some(requeue) = shell.choose_output().await? {
        return Ok(requeue);
    }
    let now = Timestamp::now();
    let checked = ctx.check(&job);
    let old = job.status_or_default();
    let waiting = !conditions::is_true(&old.conditions, ADMITTED)
        && !conditions::is_true(&old.conditions, FINISHED)
        && !job.spec.suspend
        && !job.spec.cancel;
    let observed = shell.observe(&checked, waiting, now).await?;
    let decision = decide(&observed, &Policy::from(&ctx.config));
    let mut decision = decision;
    let applied = shell.apply_pods(&decision, &checked).await?;
    applied.record(&mut decision, &ctx.config, job.metadata.generation, now);
    if decision.status != old {
        if let Err(error) = shell.write_status(&decision.status).await {
            if waiting {
                ctx.forget_admission(&job);
            }
            return Err(error);
        }
        shell.record_transition(&old, &decision.status, now);
    }
    shell.apply_after_status(&decision).await
}

/// The I/O of one reconcile: the job and the clients its actions go through.
struct Shell<'a> {
    ctx: &'a Context,
    job: &'a HarvestJob,
    jobs: Api<HarvestJob>,
    /// In the namespace the job's Pods run in.
    pods: Api<Pod>,
    /// Whether that is the operator's worker namespace, not the job's own.
    elsewhere: bool,
}

impl Shell<'_> {
    /// A deleted job's cleanup, or adding the finalizers it needs (output cleanup for a
    /// `Delete` retention, the worker's deletion for a worker elsewhere); `Some` when that was
    /// this reconcile's whole work.
    async fn finalizer(&self) -> Result<Option<Requeue>> {
        let job = self.job;
        let has = |name: &str| job.finalizers().iter().any(|f| f == name);
        if job.metadata.deletion_timestamp.is_some() {
            if has(CLEANUP_FINALIZER) || has(WORKER_FINALIZER) {
                return finalize(job, &self.jobs, &self.pods, self.ctx)
                    .await
                    .map(Some);
            }
            return Ok(Some(Requeue::await_change()));
        }
        // Only a job whose outputs go with it needs the operator at its deletion. A worker
        // elsewhere is swept once its job is gone (`sweep`); the finalizer jobs once carried
        // for it is taken off, so that an uninstall never waits on a stopped operator.
        let wanted = (job.spec.output_retention == OutputRetention::Delete
            && !has(CLEANUP_FINALIZER))
        .then_some(CLEANUP_FINALIZER);
        if wanted.is_some() || has(WORKER_FINALIZER) {
            let mut finalizers: Vec<String> = job
                .finalizers()
                .iter()
                .filter(|f| *f != WORKER_FINALIZER)
                .cloned()
                .collect();
            finalizers.extend(wanted.map(str::to_owned));
            self.patch_job(json!({"metadata": {"finalizers": finalizers}}))
                .await?;
            return Ok(Some(Requeue::await_change()));
        }
        Ok(None)
    }

    /// A merge patch of the job, conditional on the resourceVersion this reconcile read.
    async fn patch_job(&self, mut patch: serde_json::Value) -> Result<()> {
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

    /// Sets `spec.output` of a job that names none, once, under its paying account's storage
    /// ([`accounts::chosen_output`]), conditional on the resourceVersion read; `Some` when that
    /// was this reconcile's whole work. Without account storage the spec check fails the job.
    async fn choose_output(&self) -> Result<Option<Requeue>> {
        let job = self.job;
        if job.spec.output.is_some()
            || conditions::is_true(&job.status_or_default().conditions, FINISHED)
        {
            return Ok(None);
        }
        let Some(output) = self
            .ctx
            .paying_account(job)
            .and_then(|account| crate::accounts::chosen_output(job, &account))
        else {
            return Ok(None);
        };
        self.patch_job(json!({"spec": {"output": output}})).await?;
        info!(%output, "output chosen under the account's storage");
        publish(
            self.ctx,
            job,
            false,
            "OutputChosen",
            &format!("the outputs go to {output}"),
        )
        .await;
        Ok(Some(Requeue::await_change()))
    }

    /// What `decide` needs: the spec check, the attempt's Pod and its worker's progress, and,
    /// for a waiting job, the admission verdict (which may take the account's hold).
    async fn observe(
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
    /// (see [`crate::tenant_quota`]); `None` for a Pod in the job's own namespace.
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
        Ok(crate::tenant_quota::refusal(
            &tenant, &quotas, &workers, pod,
        ))
    }
}

/// What the Pod actions came to, beyond the Pods made.
#[derive(Debug, Default)]
struct Applied {
    /// A create the apiserver refused for good: the attempt's failure.
    refused: Option<String>,
    /// Creates a ResourceQuota refused, by role: each attempt waits, uncounted.
    waiting_for_quota: Vec<(crate::pod::Role, String)>,
}

impl Applied {
    /// Writes what the next decision reads into the status about to be written: a refused
    /// create as the Running condition `FailedCreate` (the attempt's failure), a create
    /// waiting for quota as `WaitingForQuota` on the condition or on its part's message (the
    /// attempt stands and its Pod is created again).
    fn record(
        &self,
        decision: &mut Decision,
        config: &crate::config::OperatorConfig,
        generation: Option<i64>,
        now: Timestamp,
    ) {
        let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(now);
        let mut running = |reason: &'static str, message: &str| {
            conditions::set(
                &mut decision.status.conditions,
                conditions::ConditionUpdate {
                    type_: conditions::RUNNING,
                    status: false,
                    reason,
                    message: message.to_owned(),
                },
                generation,
                &now,
            );
        };
        if let Some(refusal) = &self.refused {
            running(FAILED_CREATE, refusal);
        }
        for (role, message) in &self.waiting_for_quota {
            match role {
                crate::pod::Role::Part { index, .. } => {
                    if let Some(part) = decision.status.parts.iter_mut().find(|p| p.index == *index)
                    {
                        part.message = format!("{WAITING_FOR_QUOTA}: {message}");
                    }
                }
                crate::pod::Role::Whole | crate::pod::Role::Finalize => {
                    running(WAITING_FOR_QUOTA, message);
                }
            }
        }
        if !self.waiting_for_quota.is_empty() {
            let poll = Duration::from_secs(config.admission_poll_seconds);
            decision.requeue_after = Some(decision.requeue_after.map_or(poll, |r| r.min(poll)));
        }
    }
}

/// ResourceQuota's refusal: 403 `exceeded quota`. It clears when other Pods end, so the
/// attempt waits; every other 403 (Pod Security, a LimitRange) is for good.
fn exceeds_quota(status: &kube::core::Status) -> bool {
    status.code == 403 && status.message.contains("exceeded quota")
}

/// Whether the job's status already says this role waits for quota (its Event was published).
fn already_waiting(status: &harvest_crds::HarvestJobStatus, role: crate::pod::Role) -> bool {
    match role {
        crate::pod::Role::Part { index, .. } => status
            .parts
            .iter()
            .any(|p| p.index == index && p.message.starts_with(WAITING_FOR_QUOTA)),
        crate::pod::Role::Whole | crate::pod::Role::Finalize => {
            conditions::get(&status.conditions, conditions::RUNNING)
                .is_some_and(|c| c.reason == WAITING_FOR_QUOTA)
        }
    }
}

/// A Pod's role as its messages begin: nothing for a one-Pod job, `part I/N ` (which the
/// part's retry reads back from a refused create's condition) or `finalize `.
fn what(role: crate::pod::Role) -> String {
    match role {
        crate::pod::Role::Whole => String::new(),
        crate::pod::Role::Part { index, count } => format!("part {index}/{count} "),
        crate::pod::Role::Finalize => "finalize ".to_owned(),
    }
}

fn post_params() -> PostParams {
    PostParams {
        field_manager: Some(MANAGER.into()),
        ..PostParams::default()
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

/// Deletes the Pod `name` only if it is the job's own (a tenant's Pod under that name is left
/// alone), conditional on the UID that was checked.
/// Deletes a deleted job's worker Pods: the current attempt's and parts', and, in the
/// operator's worker namespace, every Pod labelled with the job's UID (the failed ones too: no
/// garbage collector will).
async fn delete_workers(job: &HarvestJob, pods: &Api<Pod>, uid: &str) -> Result<()> {
    let elsewhere = pods.namespace() != job.namespace().as_deref();
    let status = job.status_or_default();
    let mut names: Vec<String> = status.pod.iter().cloned().collect();
    names.extend(status.parts.iter().filter_map(|p| p.pod.clone()));
    if elsewhere && !uid.is_empty() {
        let selector = format!("{}={uid}", crate::pod::JOB_UID_LABEL);
        let listed = pods.list(&ListParams::default().labels(&selector)).await?;
        names.extend(listed.items.iter().map(ResourceExt::name_any));
    }
    // The cleanup Pod is the finalizer's own, deleted once it has answered.
    let cleanup = crate::pod::cleanup_pod_name(&job.name_any(), Some(uid));
    names.retain(|name| *name != cleanup);
    names.sort();
    names.dedup();
    for pod in &names {
        delete_own_pod(pods, pod, uid, elsewhere).await?;
    }
    Ok(())
}

/// The storage credentials of the job's paying account: the `AWS_*` keys of its
/// `credentialsSecret` (in the namespace its workers run in), or none when it names none, so
/// that the operator's own environment serves.
async fn account_credentials(ctx: &Context, job: &HarvestJob) -> Result<BTreeMap<String, String>> {
    let Some(name) = ctx
        .paying_account(job)
        .and_then(|a| a.spec.storage.as_ref()?.credentials_secret.clone())
    else {
        return Ok(BTreeMap::new());
    };
    let namespace = ctx.config.pod_namespace(job);
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &namespace);
    let Some(secret) = secrets.get_opt(&name).await? else {
        return Err(Error::Cleanup {
            output: job.spec.output.clone().unwrap_or_default(),
            reason: format!(
                "the paying account's credentialsSecret {name:?} is not in namespace {namespace:?}: create it there"
            ),
        });
    };
    Ok(secret
        .data
        .unwrap_or_default()
        .into_iter()
        .filter(|(key, _)| key.starts_with("AWS_"))
        .map(|(key, value)| (key, String::from_utf8_lossy(&value.0).into_owned()))
        .collect())
}

async fn delete_own_pod(
    pods: &Api<Pod>,
    name: &str,
    job_uid: &str,
    worker_namespace: bool,
) -> Result<()> {
    let Some(pod) = pods.get_opt(name).await? else {
        return Ok(());
    };
    if matches!(
        observe_for_job(&pod, job_uid, worker_namespace),
        PodState::Foreign { .. }
    ) {
        return Ok(());
    }
    let params = DeleteParams {
        preconditions: Some(kube::api::Preconditions {
            uid: pod.uid(),
            resource_version: None,
        }),
        ..DeleteParams::background()
    };
    match pods.delete(name, &params).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if matches!(status.code, 404 | 409) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

async fn delete_pod(pods: &Api<Pod>, name: &str) -> Result<()> {
    match pods.delete(name, &DeleteParams::background()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Events are best effort: a failure to record one is logged, never fails the reconcile.
/// The most bytes of an Event's note the apiserver takes (events.k8s.io/v1 validation counts
/// bytes, not characters).
const NOTE_LIMIT_BYTES: usize = 1024;

/// `note` cut to [`NOTE_LIMIT_BYTES`] at a character boundary, so a long message in any script
/// still makes an Event instead of a 422.
fn event_note(note: &str) -> &str {
    let mut end = note.len().min(NOTE_LIMIT_BYTES);
    while !note.is_char_boundary(end) {
        end -= 1;
    }
    &note[..end]
}

async fn publish(ctx: &Context, job: &HarvestJob, warning: bool, reason: &str, note: &str) {
    let event = Event {
        type_: if warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: reason.to_owned(),
        note: Some(event_note(note).to_owned()),
        action: "Reconcile".into(),
        secondary: None,
    };
    if let Err(error) = ctx.recorder.publish(&event, &job.object_ref(&())).await {
        warn!(%error, reason, "could not record an event");
    }
}

/// Deletes a deleted job's worker Pod and (with the cleanup finalizer) its outputs, then lets
/// it go; gives up on the outputs after the cleanup timeout so a namespace never wedges on an
/// unreachable store.
async fn finalize(
    job: &HarvestJob,
    jobs: &Api<HarvestJob>,
    pods: &Api<Pod>,
    ctx: &Context,
) -> Result<Requeue> {
    let deleted_at = job
        .metadata
        .deletion_timestamp
        .as_ref()
        .map_or_else(Timestamp::now, |t| t.0);
    let budget = Duration::from_secs(ctx.config.cleanup_timeout_seconds);
    let spent = Timestamp::now().duration_since(deleted_at).as_secs().max(0) as u64;
    let left = budget.saturating_sub(Duration::from_secs(spent));
    let uid = job.uid().unwrap_or_default();
    delete_workers(job, pods, &uid).await?;
    // Without the cleanup finalizer (only the worker's) the outputs stay.
    let clean = job.finalizers().iter().any(|f| f == CLEANUP_FINALIZER);
    // A job that never had an output has nothing to clean.
    let output = job.spec.output.as_deref().unwrap_or_default();
    let clean = clean && !output.is_empty();
    let cleanup_pod = crate::pod::cleanup_pod_name(&job.name_any(), Some(&uid));
    if clean && !left.is_zero() {
        let outcome = match delete_outputs(job, pods, ctx, &cleanup_pod, left).await {
            Ok(None) => return Ok(Requeue::requeue(CLEANUP_POLL)),
            Ok(Some(done)) => Ok(done),
            Err(error) => Err(error),
        };
        match outcome {
            Ok(cleanup::Cleanup::Deleted(deleted)) => {
                let note = format!("deleted {deleted} objects under {output}");
                publish(ctx, job, false, "OutputsDeleted", &note).await;
            }
            Ok(cleanup::Cleanup::Kept(why)) => {
                info!(reason = %why, "outputs left in place");
                publish(ctx, job, false, "OutputsKept", &why).await;
            }
            Err(error)
                if Timestamp::now().duration_since(deleted_at).as_secs()
                    < budget.as_secs() as i64 =>
            {
                return Err(error);
            }
            Err(error) => {
                let note = format!("{error}; the outputs are left in place");
                publish(ctx, job, true, "CleanupAbandoned", &note).await;
            }
        }
    } else if clean {
        let note = format!(
            "cleanup of {output} took longer than {} s; the outputs are left in place",
            budget.as_secs()
        );
        publish(ctx, job, true, "CleanupAbandoned", &note).await;
    }
    if clean && output.starts_with('/') {
        delete_pod(pods, &cleanup_pod).await?;
    }
    let finalizers: Vec<_> = job
        .finalizers()
        .iter()
        .filter(|f| *f != CLEANUP_FINALIZER && *f != WORKER_FINALIZER)
        .cloned()
        .collect();
    let patch =
        json!({"metadata": {"finalizers": finalizers, "resourceVersion": job.resource_version()}});
    jobs.patch(
        &job.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await?;
    Ok(Requeue::await_change())
}

/// Deletes the deleted job's outputs within `left`: on S3 from here; a local directory, on
/// the workers' volumes, which the operator does not mount, through the cleanup Pod named
/// `cleanup_pod` (`None` while it runs).
async fn delete_outputs(
    job: &HarvestJob,
    pods: &Api<Pod>,
    ctx: &Context,
    cleanup_pod: &str,
    left: Duration,
) -> Result<Option<cleanup::Cleanup>> {
    let output = job.spec.output.as_deref().unwrap_or_default();
    if output.starts_with('/') {
        return cleanup_by_pod(job, pods, ctx, output, cleanup_pod).await;
    }
    let credentials = account_credentials(ctx, job).await?;
    let uid = job.uid().unwrap_or_default();
    cleanup::delete_outputs(output, &uid, left, &credentials)
        .await
        .map(Some)
}

/// How often a deleted job looks at its cleanup Pod (its Pod's changes wake it sooner).
const CLEANUP_POLL: Duration = Duration::from_secs(2);

/// The deleted job's local outputs, deleted by its cleanup Pod (`harvester cleanup`, with the
/// model's volumes): the answer once it has one, `None` while it runs. A failed Pod is deleted
/// and its failure returned, so that the next try (within the cleanup timeout) starts afresh.
async fn cleanup_by_pod(
    job: &HarvestJob,
    pods: &Api<Pod>,
    ctx: &Context,
    output: &str,
    name: &str,
) -> Result<Option<cleanup::Cleanup>> {
    let fail = |reason: String| Error::Cleanup {
        output: output.to_owned(),
        reason,
    };
    let Some(pod) = pods.get_opt(name).await? else {
        let Some(model) = ctx.config.model(&job.spec.model) else {
            return Ok(Some(cleanup::Cleanup::Kept(format!(
                "model {:?} is no longer in the catalogue, so no Pod can mount {output}",
                job.spec.model
            ))));
        };
        let pod = crate::pod::render_cleanup(job, output, model, &ctx.config)?;
        match pods.create(&post_params(), &pod).await {
            Ok(_) => info!(pod = name, "created the cleanup Pod"),
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            Err(kube::Error::Api(status)) => return Err(fail(status.message)),
            Err(error) => return Err(error.into()),
        }
        return Ok(None);
    };
    match crate::pod::observe_cleanup(&pod) {
        crate::pod::PodCleanup::Pending => Ok(None),
        crate::pod::PodCleanup::Done(done) => Ok(Some(done)),
        crate::pod::PodCleanup::Failed(why) => {
            delete_pod(pods, name).await?;
            Err(fail(why))
        }
    }
}

/// Transient errors are retried: a lost race at once, anything else after a pause.
pub fn error_policy(job: Arc<HarvestJob>, error: &Error, ctx: Arc<Context>) -> Requeue {
    ctx.metrics.reconcile_failed(error.metric_label());
    if error.is_conflict() {
        return Requeue::requeue(Duration::from_millis(200));
    }
    warn!(job = %key_of(&job), %error, "reconcile failed; retrying");
    Requeue::requeue(Duration::from_secs(5))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_note_is_cut_to_1024_bytes_at_a_character_boundary() {
        assert_eq!(event_note("short"), "short");
        let ascii = "x".repeat(2000);
        assert_eq!(event_note(&ascii).len(), 1024);
        // 600 three-byte characters are 1,800 bytes: 1,000 characters would be refused.
        let wide = "\u{4e2d}".repeat(600);
        let cut = event_note(&wide);
        assert_eq!((cut.len(), cut.chars().count()), (1023, 341));
    }
}
