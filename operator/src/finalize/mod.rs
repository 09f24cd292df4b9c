//! Finalize: what a job needs at its deletion and before it first runs. A deleted job's
//! workers and (with the cleanup finalizer) its outputs are deleted, on S3 from here
//! ([`cleanup`]) or through a cleanup Pod for a local output, within the cleanup timeout; a job
//! that keeps no finalizer it needs gets it, and one that names no output gets its paying
//! account's, before anything else is decided.

pub mod cleanup;

use std::collections::BTreeMap;
use std::time::Duration;

use harvest_crds::conditions::{self, FINISHED};
use harvest_crds::{HarvestJob, OutputRetention};
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action as Requeue;
use kube::{Api, ResourceExt};
use serde_json::json;
use tracing::info;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::pod::{PodState, observe_for_job};
use crate::shell::{Shell, delete_pod, post_params, publish};

/// The finalizer that deletes a job's outputs when its retention is `Delete`.
pub const CLEANUP_FINALIZER: &str = "harvest.dev/output-cleanup";
/// The finalizer earlier releases put on a job whose worker runs in the operator's worker
/// namespace. No longer added (the sweep deletes such workers); taken off when seen, and
/// honoured on a job deleted while it still carries it.
pub const WORKER_FINALIZER: &str = "harvest.dev/worker";
impl Shell<'_> {
    /// A deleted job's cleanup, or adding the finalizers it needs (output cleanup for a
    /// `Delete` retention, the worker's deletion for a worker elsewhere); `Some` when that was
    /// this reconcile's whole work.
    pub(crate) async fn finalizer(&self) -> Result<Option<Requeue>> {
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

    /// Sets `spec.output` of a job that names none, once, under its paying account's storage
    /// ([`accounts::chosen_output`]), conditional on the resourceVersion read; `Some` when that
    /// was this reconcile's whole work. Without account storage the spec check fails the job.
    pub(crate) async fn choose_output(&self) -> Result<Option<Requeue>> {
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

/// Deletes the Pod `name` only if it is the job's own (a tenant's Pod under that name is left
/// alone), conditional on the UID that was checked.
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
