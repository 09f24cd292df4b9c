//! Taking a job's hold in its HarvestAccount's status at admission: a status replace with a
//! resourceVersion precondition, so two writers cannot both spend the same budget; holds are
//! keyed by job UID, so a repeated admission changes nothing. The account controller that
//! settles holds is in `ledger`.

use std::collections::BTreeMap;

use harvest_core::quota::{Admitted, Denial, Lane};
use harvest_crds::{HarvestAccount, HarvestJob, account::millis};
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::{Api, Client, ResourceExt};
use tracing::info;

use crate::accounts::Binding;
use crate::error::{Error, Result};

/// The field manager of the operator's writes.
const MANAGER: &str = "harvest-operator";

/// The parameters of the operator's status writes.
pub(crate) fn post_params() -> PostParams {
    PostParams {
        field_manager: Some(MANAGER.into()),
        ..PostParams::default()
    }
}

/// Takes `job`'s hold in `account`'s books (from the cache), unless it holds one already.
/// `Ok(Some(denial))` when the account's limits say wait.
pub async fn hold(
    client: &Client,
    job: &HarvestJob,
    account: &HarvestAccount,
    binding: &Binding,
    lane: Lane,
    tokens: u64,
    now: Timestamp,
) -> Result<Option<Denial>> {
    let uid = job.uid().ok_or_else(|| Error::MissingUid {
        job: job.name_any(),
    })?;
    let now = millis(now);
    let mut status = account.status_or_default();
    let mut book = status.book(now);
    book.roll(now);
    let limits = account.spec.limits();
    match book.admit(&uid, &binding.key, &limits, lane, tokens, now) {
        Err(denial) => Ok(Some(denial)),
        Ok(Admitted::AlreadyHeld) => Ok(None),
        Ok(Admitted::New) => {
            let names = BTreeMap::from([(
                uid,
                format!("{}/{}", job.namespace().unwrap_or_default(), job.name_any()),
            )]);
            status.store(&book, &limits, &names, now);
            let mut updated = account.clone();
            updated.status = Some(status);
            let accounts: Api<HarvestAccount> = Api::all(client.clone());
            accounts
                .replace_status(&account.name_any(), &post_params(), &updated)
                .await?;
            info!(account = %binding.account, tokens, %lane, "hold taken");
            Ok(None)
        }
    }
}
