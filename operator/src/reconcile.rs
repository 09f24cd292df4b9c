//! One reconcile of one job, as four steps in their own folders: `finalize` (a deleted job, and
//! the finalizers and output a job needs before it runs), [`crate::observe`] (reads only: the
//! job's Pods, its workers' progress, the admission verdict), [`crate::decide`] (pure: the
//! status and the actions, and the bookkeeping of what applying them came to) and
//! [`crate::apply`] (the actions in order: Pods, the status, Events, the TTL deletion).

use std::sync::Arc;
use std::time::Duration;

use harvest_crds::HarvestJob;
use harvest_crds::conditions::{self, ADMITTED, FINISHED};
use k8s_openapi::jiff::Timestamp;
use kube::runtime::controller::Action as Requeue;
use kube::{Api, ResourceExt};
use tracing::{instrument, warn};

pub use crate::context::Context;
pub(crate) use crate::context::key_of;
use crate::decide::{Policy, decide};
use crate::error::{Error, Result};
use crate::shell::Shell;

/// One reconcile of one job: finalize, observe, decide (pure), apply.
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
    shell.apply(decision, &checked, waiting, now).await
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
