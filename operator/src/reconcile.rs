//! The reconcile shell: observe (the job from the cache, its Pod from the apiserver, the lane
//! queue from the cache), call [`decide`], and apply the decision. With `leader`, `cleanup`
//! and the `metrics` endpoint, the only modules that talk to the outside.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use harvest_crds::conditions::{self, ADMITTED, FINISHED};
use harvest_crds::{HarvestAccount, HarvestJob, OutputRetention, SpecError};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, LogParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action as Requeue;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::Store;
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use tracing::{info, instrument, warn};

use crate::accounts::{self, Binding};
use crate::admission::{self, Admission, QueueEntry, QueueState};
use crate::config::OperatorConfig;
use crate::decide::{Action, Observed, decide};
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::pod::{PodState, observe, render, reported_progress};
use crate::{cleanup, ledger};

/// The finalizer that deletes a job's outputs when its retention is `Delete`.
pub const CLEANUP_FINALIZER: &str = "harvest.dev/output-cleanup";
/// The field manager of the operator's writes.
const MANAGER: &str = "harvest-operator";
/// Log lines read for the newest progress report (the worker writes one per batch).
const PROGRESS_LOG_LINES: i64 = 20;

/// What every reconcile shares.
pub struct Context {
    /// The apiserver.
    pub client: Client,
    /// The catalogue and limits.
    pub config: OperatorConfig,
    /// Event publisher.
    pub recorder: Recorder,
    /// Prometheus metrics.
    pub metrics: Metrics,
    /// The controller's cache of every job (the admission queue).
    pub jobs: Store<HarvestJob>,
    /// The cache of every HarvestAccount.
    pub accounts: Store<HarvestAccount>,
    /// Jobs admitted by this process that the cache may not show yet, so two concurrent
    /// reconciles never both take the last slot of a lane.
    pub admitting: Mutex<HashSet<String>>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Context {
    /// The spec check: the catalogue entry and the validated job, or why it cannot run.
    fn check(&self, job: &HarvestJob) -> Result<harvest_crds::ValidJob, SpecError> {
        let entry = self
            .config
            .model(&job.spec.model)
            .ok_or_else(|| SpecError::UnknownModel {
                model: job.spec.model.clone(),
                known: self.config.model_names(),
            })?;
        job.spec
            .validate(&entry.served(), std::path::Path::new(&entry.path))
    }

    /// The cluster queue's verdict for a waiting job; remembers an admission until the cache
    /// has it.
    fn admit(
        &self,
        job: &HarvestJob,
        lane: harvest_core::quota::Lane,
        account: &str,
        now: Timestamp,
    ) -> Admission {
        let key = key_of(job);
        let all_accounts = self.accounts.state();
        let api_namespace = self.config.api_namespace.as_deref();
        let mut admitting = self
            .admitting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut entries = Vec::new();
        for other in self.jobs.state() {
            let other_key = key_of(&other);
            let Some(entry) = self.config.model(&other.spec.model) else {
                continue;
            };
            let status = other.status_or_default();
            let state = if conditions::is_true(&status.conditions, FINISHED) {
                admitting.remove(&other_key);
                QueueState::Idle
            } else if conditions::is_true(&status.conditions, ADMITTED) {
                admitting.remove(&other_key);
                QueueState::Active
            } else if admitting.contains(&other_key) {
                QueueState::Active
            } else if other.spec.suspend {
                QueueState::Idle
            } else {
                QueueState::Waiting
            };
            let created = other
                .metadata
                .creation_timestamp
                .as_ref()
                .map_or(now, |t| t.0);
            let payer = accounts::bind(&other, &all_accounts, api_namespace)
                .map(|b| b.account)
                .unwrap_or_default();
            entries.push(QueueEntry {
                key: other_key,
                account: payer,
                blocked: accounts::blocked_by_account(&other),
                lane: entry.lane,
                created,
                state,
            });
        }
        let created = job
            .metadata
            .creation_timestamp
            .as_ref()
            .map_or(now, |t| t.0);
        let me = QueueEntry {
            key: key.clone(),
            account: account.to_owned(),
            blocked: false,
            lane,
            created,
            state: QueueState::Waiting,
        };
        let verdict = if admitting.contains(&key) {
            Admission::Admit
        } else {
            admission::verdict(&entries, &me, self.config.lanes.of(lane))
        };
        if verdict == Admission::Admit {
            admitting.insert(key);
        }
        verdict
    }

    /// Whether the apiserver's copy of `job` (same UID) still waits for admission.
    async fn still_waiting(&self, job: &HarvestJob) -> Result<bool> {
        let api: Api<HarvestJob> =
            Api::namespaced(self.client.clone(), &job.namespace().unwrap_or_default());
        Ok(match api.get_opt(&job.name_any()).await? {
            Some(fresh) if fresh.uid() == job.uid() => {
                let status = fresh.status_or_default();
                !conditions::is_true(&status.conditions, ADMITTED)
                    && !conditions::is_true(&status.conditions, FINISHED)
                    && !fresh.spec.suspend
                    && !fresh.spec.cancel
            }
            _ => false,
        })
    }

    fn forget_admission(&self, job: &HarvestJob) {
        self.admitting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&key_of(job));
    }

    /// Admission of a waiting job: the account that pays for it, the cluster queue, then a hold
    /// in the account's books.
    async fn admission(
        &self,
        job: &HarvestJob,
        lane: harvest_core::quota::Lane,
        tokens: u64,
        now: Timestamp,
    ) -> Result<(Admission, Option<String>)> {
        let all_accounts = self.accounts.state();
        let binding: Binding =
            match accounts::bind(job, &all_accounts, self.config.api_namespace.as_deref()) {
                Ok(binding) => binding,
                Err(unbound) => {
                    let wait = Admission::Wait {
                        reason: unbound.reason(),
                        message: unbound.to_string(),
                    };
                    return Ok((wait, None));
                }
            };
        let verdict = self.admit(job, lane, &binding.account, now);
        if verdict != Admission::Admit {
            return Ok((verdict, None));
        }
        // The cache may be behind: a job that has since been admitted, finished and settled
        // must not take a second hold. Its Admitted condition stays true once set, so the
        // apiserver's copy tells.
        if !self.still_waiting(job).await? {
            self.forget_admission(job);
            return Err(Error::StaleCache { job: key_of(job) });
        }
        let Some(account) = ledger::cached(self, &binding.account) else {
            // Deleted since it was bound a moment ago.
            self.forget_admission(job);
            let unbound = accounts::Unbound::UnknownAccount {
                account: binding.account,
            };
            let wait = Admission::Wait {
                reason: unbound.reason(),
                message: unbound.to_string(),
            };
            return Ok((wait, None));
        };
        match ledger::hold(self, job, &account, &binding, lane, tokens, now).await {
            Ok(None) => Ok((Admission::Admit, Some(binding.account))),
            Ok(Some(denial)) => {
                self.forget_admission(job);
                let wait = Admission::Wait {
                    reason: accounts::denial_reason(&denial),
                    message: format!("account {:?}: {denial}", binding.account),
                };
                Ok((wait, None))
            }
            Err(error) => {
                self.forget_admission(job);
                Err(error)
            }
        }
    }
}

fn key_of(job: &HarvestJob) -> String {
    format!("{}/{}", job.namespace().unwrap_or_default(), job.name_any())
}

/// One reconcile of one job.
#[instrument(skip_all, fields(job = %key_of(&job)))]
pub async fn reconcile(job: Arc<HarvestJob>, ctx: Arc<Context>) -> Result<Requeue> {
    let _timer = ctx.metrics.reconcile_started();
    let namespace = job.namespace().unwrap_or_default();
    let jobs: Api<HarvestJob> = Api::namespaced(ctx.client.clone(), &namespace);
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace);
    let name = job.name_any();
    let has_finalizer = job.finalizers().iter().any(|f| f == CLEANUP_FINALIZER);
    if job.metadata.deletion_timestamp.is_some() {
        if has_finalizer {
            return finalize(&job, &jobs, &ctx).await;
        }
        return Ok(Requeue::await_change());
    }
    if job.spec.output_retention == OutputRetention::Delete && !has_finalizer {
        let mut finalizers = job.finalizers().to_vec();
        finalizers.push(CLEANUP_FINALIZER.to_owned());
        let patch = json!({"metadata": {"finalizers": finalizers, "resourceVersion": job.resource_version()}});
        jobs.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        return Ok(Requeue::await_change());
    }

    let now = Timestamp::now();
    let checked = ctx.check(&job);
    let old = job.status_or_default();
    let pod = match &old.pod {
        Some(pod_name) => pods.get_opt(pod_name).await?.map(|p| observe(&p)),
        None => None,
    };
    let reported = match (&pod, &old.pod) {
        (Some(PodState::Running), Some(pod_name)) => worker_progress(&pods, pod_name).await,
        _ => None,
    };
    let waiting = !conditions::is_true(&old.conditions, ADMITTED)
        && !conditions::is_true(&old.conditions, FINISHED)
        && !job.spec.suspend
        && !job.spec.cancel;
    let lane = checked.as_ref().ok().map(|v| v.lane);
    let (admission, account) = match (waiting, &checked) {
        (true, Ok(valid)) => {
            ctx.admission(&job, valid.lane, valid.token_budget, now)
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
    let observed = Observed {
        job: &job,
        spec: checked
            .as_ref()
            .map(|v| v.token_budget)
            .map_err(Clone::clone),
        pod,
        reported,
        admission,
        account,
        lane: lane.map(|l| l.to_string()),
        now,
    };
    let decision = decide(&observed, &ctx.config.policy());

    for action in &decision.actions {
        match action {
            Action::DeletePod(pod_name) => delete_pod(&pods, pod_name).await?,
            Action::CreatePod {
                attempt,
                deadline_seconds,
            } => {
                let (Ok(valid), Some(entry)) = (&checked, ctx.config.model(&job.spec.model)) else {
                    continue;
                };
                let pod = render(&job, valid, entry, &ctx.config, *attempt, *deadline_seconds)?;
                match pods
                    .create(
                        &PostParams {
                            field_manager: Some(MANAGER.into()),
                            ..PostParams::default()
                        },
                        &pod,
                    )
                    .await
                {
                    Ok(_) => info!(attempt, "created the attempt's Pod"),
                    Err(kube::Error::Api(status)) if status.code == 409 => {}
                    Err(e) => return Err(e.into()),
                }
            }
            Action::Event { .. } | Action::DeleteJob => {}
        }
    }
    if decision.status != old {
        let mut updated = (*job).clone();
        updated.status = Some(decision.status.clone());
        let result = jobs
            .replace_status(
                &name,
                &PostParams {
                    field_manager: Some(MANAGER.into()),
                    ..PostParams::default()
                },
                &updated,
            )
            .await;
        if let Err(e) = result {
            if waiting {
                ctx.forget_admission(&job);
            }
            return Err(e.into());
        }
        if !conditions::is_true(&old.conditions, ADMITTED)
            && conditions::is_true(&decision.status.conditions, ADMITTED)
        {
            let created = job
                .metadata
                .creation_timestamp
                .as_ref()
                .map_or(now, |t| t.0);
            ctx.metrics
                .admitted(now.duration_since(created).as_secs_f64());
        }
        if decision.status.phase != old.phase {
            info!(phase = ?decision.status.phase, "job phase changed");
        }
    }
    for action in &decision.actions {
        match action {
            Action::Event {
                warning,
                reason,
                note,
            } => publish(&ctx, &job, *warning, reason, note).await,
            Action::DeleteJob if ledger::unsettled(&ctx, &job) => {
                return Ok(Requeue::requeue(Duration::from_secs(1)));
            }
            Action::DeleteJob => {
                info!("time to live after finishing ran out; deleting the job");
                match jobs.delete(&name, &DeleteParams::background()).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(status)) if status.code == 404 => {}
                    Err(e) => return Err(e.into()),
                }
            }
            Action::DeletePod(_) | Action::CreatePod { .. } => {}
        }
    }
    Ok(decision
        .requeue_after
        .map_or_else(Requeue::await_change, Requeue::requeue))
}

/// The running worker's last progress report, from the tail of its log. Best effort: a log
/// that cannot be read leaves the progress as it was.
async fn worker_progress(pods: &Api<Pod>, pod_name: &str) -> Option<(u32, u32, u64)> {
    let params = LogParams {
        tail_lines: Some(PROGRESS_LOG_LINES),
        ..LogParams::default()
    };
    match pods.logs(pod_name, &params).await {
        Ok(log) => reported_progress(&log),
        Err(error) => {
            tracing::debug!(%error, pod = pod_name, "could not read the worker's log");
            None
        }
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
async fn publish(ctx: &Context, job: &HarvestJob, warning: bool, reason: &str, note: &str) {
    let event = Event {
        type_: if warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: reason.to_owned(),
        note: Some(note.chars().take(1000).collect()),
        action: "Reconcile".into(),
        secondary: None,
    };
    if let Err(error) = ctx.recorder.publish(&event, &job.object_ref(&())).await {
        warn!(%error, reason, "could not record an event");
    }
}

/// Deletes a deleted job's outputs, then lets it go; gives up after the cleanup timeout so a
/// namespace never wedges on an unreachable store.
async fn finalize(job: &HarvestJob, jobs: &Api<HarvestJob>, ctx: &Context) -> Result<Requeue> {
    let deleted_at = job
        .metadata
        .deletion_timestamp
        .as_ref()
        .map_or_else(Timestamp::now, |t| t.0);
    let budget = Duration::from_secs(ctx.config.cleanup_timeout_seconds);
    let spent = Timestamp::now().duration_since(deleted_at).as_secs().max(0) as u64;
    let left = budget.saturating_sub(Duration::from_secs(spent));
    if let Some(pod) = &job.status_or_default().pod {
        delete_pod(
            &Api::namespaced(ctx.client.clone(), &job.namespace().unwrap_or_default()),
            pod,
        )
        .await?;
    }
    if !left.is_zero() {
        match cleanup::delete_prefix(&job.spec.output, left).await {
            Ok(deleted) => {
                publish(
                    ctx,
                    job,
                    false,
                    "OutputsDeleted",
                    &format!("deleted {deleted} objects under {}", job.spec.output),
                )
                .await;
            }
            Err(error)
                if Timestamp::now().duration_since(deleted_at).as_secs()
                    < budget.as_secs() as i64 =>
            {
                return Err(error);
            }
            Err(error) => {
                publish(
                    ctx,
                    job,
                    true,
                    "CleanupAbandoned",
                    &format!("{error}; the outputs are left in place"),
                )
                .await;
            }
        }
    } else {
        publish(
            ctx,
            job,
            true,
            "CleanupAbandoned",
            &format!(
                "cleanup of {} took longer than {} s; the outputs are left in place",
                job.spec.output,
                budget.as_secs()
            ),
        )
        .await;
    }
    let finalizers: Vec<_> = job
        .finalizers()
        .iter()
        .filter(|f| *f != CLEANUP_FINALIZER)
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

/// Transient errors are retried: a lost race at once, anything else after a pause.
pub fn error_policy(job: Arc<HarvestJob>, error: &Error, ctx: Arc<Context>) -> Requeue {
    ctx.metrics.reconcile_failed(error.metric_label());
    if error.is_conflict() {
        return Requeue::requeue(Duration::from_millis(200));
    }
    warn!(job = %key_of(&job), %error, "reconcile failed; retrying");
    Requeue::requeue(Duration::from_secs(5))
}
