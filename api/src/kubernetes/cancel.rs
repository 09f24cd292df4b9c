//! A cancel that answers without the operator: the API writes the job's end into its status
//! and settles its hold in the account's books itself, by the same `core` rules the operator
//! applies, so the lane slot is free when the DELETE answers, even with the operator slow or
//! down. Both writes carry a resourceVersion precondition and are re-read and redone when the
//! operator wrote first; the hold is keyed by the job's UID, so whichever writer settles it
//! second changes nothing. The order is the operator's: the job says Finished with its charge
//! before the hold is settled, so a crash in between leaves the account controller to settle.

use std::collections::BTreeMap;

use harvest_core::lifecycle::JobEvent;
use harvest_crds::account::millis;
use harvest_crds::conditions::{self, FINISHED};
use harvest_crds::{ACCOUNT_LABEL, HarvestAccount, HarvestJob};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::{Api, ResourceExt};

use super::{KubeBackendError, MANAGER};

/// How often a write that lost a race to another writer is re-read and redone.
const WRITE_TRIES: usize = 8;

fn post_params() -> PostParams {
    PostParams {
        field_manager: Some(MANAGER.into()),
        ..PostParams::default()
    }
}

fn lost_race(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 409)
}

/// Ends `job` as cancelled in its status, unless it has ended meanwhile; the job as written
/// (or as it ended).
pub async fn end(
    jobs: &Api<HarvestJob>,
    mut job: HarvestJob,
) -> Result<HarvestJob, KubeBackendError> {
    let name = job.name_any();
    for _ in 0..WRITE_TRIES {
        let mut status = job.status_or_default();
        if conditions::is_true(&status.conditions, FINISHED) {
            return Ok(job);
        }
        status.finish(
            JobEvent::Cancel,
            conditions::CANCELLED,
            conditions::CANCELLED_MESSAGE.into(),
            job.metadata.generation,
            &Time(Timestamp::now()),
        );
        let mut updated = job.clone();
        updated.status = Some(status);
        match jobs.replace_status(&name, &post_params(), &updated).await {
            Ok(written) => return Ok(written),
            Err(error) if lost_race(&error) => job = jobs.get(&name).await?,
            Err(error) => return Err(error.into()),
        }
    }
    Err(KubeBackendError::Contended(format!("job {name}")))
}

/// Settles the hold of `job` (which has ended) at its charge, if its account still holds one.
/// Whether the books changed.
pub async fn settle(
    accounts: &Api<HarvestAccount>,
    job: &HarvestJob,
) -> Result<bool, KubeBackendError> {
    let status = job.status_or_default();
    // A job the operator admits in this very moment may hold a slot before its status names
    // the account: the label names it already.
    let account = status
        .account
        .clone()
        .or_else(|| job.labels().get(ACCOUNT_LABEL).cloned());
    let (Some(account), Some(uid)) = (account, job.uid()) else {
        return Ok(false);
    };
    let charged = status.tokens.and_then(|t| t.charged).unwrap_or(0);
    for _ in 0..WRITE_TRIES {
        let Some(found) = accounts.get_opt(&account).await? else {
            return Ok(false);
        };
        let now = millis(Timestamp::now());
        let mut books = found.status_or_default();
        let mut book = books.book(now);
        book.roll(now);
        if !book.settle(&uid, charged, now) {
            return Ok(false);
        }
        books.store(&book, &found.spec.limits(), &BTreeMap::new(), now);
        let mut updated = found;
        updated.status = Some(books);
        match accounts
            .replace_status(&account, &post_params(), &updated)
            .await
        {
            Ok(_) => {
                tracing::info!(job = %job.name_any(), %account, charged, "hold settled on cancel");
                return Ok(true);
            }
            Err(error) if lost_race(&error) => {}
            Err(error) => return Err(error.into()),
        }
    }
    Err(KubeBackendError::Contended(format!("account {account}")))
}
