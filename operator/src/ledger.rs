//! The accounts' books on the cluster: the account controller that settles holds, rolls the
//! UTC windows and counts pending jobs (a job's hold is taken at admission, in `holds`). Every write is a status replace with a resourceVersion precondition, so two
//! writers (two reconciles, or a restarted leader) cannot both spend the same budget; holds are
//! keyed by job UID, so a repeated admission or settlement changes nothing.
//!
//! The order of writes makes restarts safe: the hold is written before the job says Admitted
//! (a crash in between finds the hold and admits without taking another), and the job says
//! Finished with its charge before the hold is settled (a crash in between settles it later).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use harvest_crds::account::{RanEntry, millis};
use harvest_crds::{HarvestAccount, HarvestJob};
use k8s_openapi::jiff::Timestamp;
use kube::runtime::controller::Action as Requeue;
use kube::{Api, ResourceExt};
use tracing::{info, instrument};

use crate::accounts;
use crate::context::Context;
use crate::error::{Error, Result};
use crate::holds::post_params;
use crate::metrics::AccountUsage;

/// How often an account is looked at with nothing changing (window roll-over, stale holds).
const ACCOUNT_RESYNC: Duration = Duration::from_secs(60);
/// How often an account with open holds is looked at: the job cache this controller reads can
/// lag the job watch that woke it, so a job that just finished may not look finished yet.
const HOLDS_RESYNC: Duration = Duration::from_secs(2);

/// The cached account `name`.
pub fn cached(ctx: &Context, name: &str) -> Option<Arc<HarvestAccount>> {
    ctx.account(name)
}

/// Whether `job` still holds tokens in its account (it may not be deleted by TTL until settled).
pub fn unsettled(ctx: &Context, job: &HarvestJob) -> bool {
    let (Some(account), Some(uid)) = (job.status_or_default().account, job.uid()) else {
        return false;
    };
    cached(ctx, &account).is_some_and(|a| a.status_or_default().holds.iter().any(|h| h.uid == uid))
}

/// One reconcile of one account: roll its windows, settle the holds of jobs that ended, count
/// its pending jobs, and write the status if it changed.
#[instrument(skip_all, fields(account = %account.name_any()))]
pub async fn reconcile_account(account: Arc<HarvestAccount>, ctx: Arc<Context>) -> Result<Requeue> {
    // No wait on the job cache's readiness here: kube-runtime's store readiness wakes only the
    // last of several concurrent waiters, and the job controller's own runner is one of them,
    // so such a wait could hang this reconcile (or that runner) for good. A held job missing
    // from the cache is looked up instead (`confirm_deleted`).
    let now_ts = Timestamp::now();
    let now = millis(now_ts);
    let name = account.name_any();
    let jobs = ctx.jobs.state();
    let accounts = ctx.accounts.state();
    let api_namespace = ctx.config.api_namespace.as_deref();
    let mine: Vec<&HarvestJob> = jobs
        .iter()
        .map(AsRef::as_ref)
        .filter(|job| {
            accounts::bind(job, &accounts, api_namespace).is_ok_and(|b| b.account == name)
        })
        .collect();
    let by_uid: BTreeMap<String, &HarvestJob> = jobs
        .iter()
        .filter_map(|j| j.uid().map(|uid| (uid, j.as_ref())))
        .collect();
    let old = account.status_or_default();
    let mut status = old.clone();
    let mut book = status.book(now);
    book.roll(now);
    let due = due_settlements(&ctx, &old, &book, &by_uid).await?;
    tracing::debug!(
        holds = book.holds.len(),
        due = due.len(),
        jobs_cached = jobs.len(),
        resource_version = account.resource_version().unwrap_or_default(),
        "account looked at"
    );
    for (uid, charged) in &due {
        book.settle(uid, *charged, now);
    }
    let limits = account.spec.limits();
    status.store(&book, &limits, &BTreeMap::new(), now);
    for entry in due
        .iter()
        .filter_map(|(uid, charged)| ran(by_uid.get(uid)?, *charged, now_ts))
    {
        status.remember_ran(entry);
    }
    let status_pending = mine.iter().filter(|j| accounts::is_pending(j)).count() as u32;
    status.pending_jobs = status_pending;
    status.observed_generation = account.metadata.generation;
    if status != old {
        let mut updated = (*account).clone();
        updated.status = Some(status);
        let api: Api<HarvestAccount> = Api::all(ctx.client.clone());
        api.replace_status(&name, &post_params(), &updated).await?;
        tracing::debug!(settled = due.len(), "account written");
        for (uid, charged) in &due {
            info!(job = %uid, charged, "hold settled");
        }
    }
    ctx.metrics.account(
        &name,
        AccountUsage {
            tokens: [
                book.ledger.tokens_today,
                book.ledger.tokens_month,
                book.ledger.tokens_total,
            ],
            active: [book.ledger.active_small, book.ledger.active_large],
            pending: status_pending,
        },
    );
    Ok(Requeue::requeue(next_look(&book, now_ts)))
}

/// What the account remembers of a settled job with a TTL, so that the same manifest applied
/// again after the TTL deleted it does not run again (`accounts::already_ran`); none for a job
/// without a TTL, which stays until someone deletes it.
fn ran(job: &HarvestJob, charged: u64, now: Timestamp) -> Option<RanEntry> {
    job.spec.ttl_seconds_after_finished?;
    let phase = job.status_or_default().phase?;
    Some(RanEntry {
        uid: job.uid()?,
        job: crate::context::key_of(job),
        spec_digest: job.spec.digest(),
        phase: phase.as_str().to_owned(),
        charged,
        settled_at: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(now),
    })
}

/// When to look at the account again: at its UTC midnight, and every resync (sooner while
/// holds are open).
fn next_look(book: &harvest_core::quota::Book, now: Timestamp) -> Duration {
    let until_midnight =
        now.duration_until(Timestamp::from_millisecond(book.ledger.day.end().0).unwrap_or(now));
    let resync = if book.holds.is_empty() {
        ACCOUNT_RESYNC
    } else {
        HOLDS_RESYNC
    };
    Duration::try_from(until_midnight)
        .unwrap_or(resync)
        .min(resync)
        .max(Duration::from_secs(1))
}

/// The holds to settle now, with their charges: those of jobs the cache shows ended, and of
/// held jobs the apiserver confirms are gone.
async fn due_settlements(
    ctx: &Context,
    status: &harvest_crds::HarvestAccountStatus,
    book: &harvest_core::quota::Book,
    by_uid: &BTreeMap<String, &HarvestJob>,
) -> Result<Vec<(String, u64)>> {
    let missing: Vec<&harvest_crds::account::HoldEntry> = status
        .holds
        .iter()
        .filter(|h| !by_uid.contains_key(&h.uid))
        .collect();
    let deleted = confirm_deleted(ctx, &missing).await?;
    Ok(accounts::settlements(
        book.holds
            .iter()
            .filter(|(uid, _)| by_uid.contains_key(*uid) || deleted.contains(*uid))
            .map(|(uid, h)| (uid, h.tokens)),
        by_uid,
    ))
}

/// Of the held jobs the cache does not show, those the apiserver confirms are gone (no job by
/// that name, or one with another UID): a cache still listing, or lagging, never makes a live
/// job look deleted and charged its whole hold.
async fn confirm_deleted(
    ctx: &Context,
    missing: &[&harvest_crds::account::HoldEntry],
) -> Result<std::collections::BTreeSet<String>> {
    let mut deleted = std::collections::BTreeSet::new();
    for hold in missing {
        let Some((namespace, name)) = hold.job.split_once('/') else {
            continue;
        };
        let found = Api::<HarvestJob>::namespaced(ctx.client.clone(), namespace)
            .get_opt(name)
            .await?;
        if found.is_none_or(|job| job.uid().as_deref() != Some(hold.uid.as_str())) {
            deleted.insert(hold.uid.clone());
        }
    }
    Ok(deleted)
}

/// Transient account errors are retried: a lost race at once, anything else after a pause.
pub fn account_error_policy(
    account: Arc<HarvestAccount>,
    error: &Error,
    ctx: Arc<Context>,
) -> Requeue {
    ctx.metrics.reconcile_failed(error.metric_label());
    if error.is_conflict() {
        tracing::debug!(account = %account.name_any(), "account write lost a race; retrying");
        return Requeue::requeue(Duration::from_millis(200));
    }
    tracing::warn!(account = %account.name_any(), %error, "account reconcile failed; retrying");
    Requeue::requeue(Duration::from_secs(5))
}
