//! What every reconcile shares ([`Context`]: clients, caches, the catalogue, metrics), and the
//! decisions it takes from them before any write: the spec check and the admission of a
//! waiting job into its account's books and the cluster's lanes.

use std::collections::HashSet;
use std::sync::Mutex;

use harvest_crds::conditions::{self, ADMITTED, FINISHED};
use harvest_crds::{HarvestAccount, HarvestJob, SpecError};
use k8s_openapi::jiff::Timestamp;
use kube::runtime::events::Recorder;
use kube::runtime::reflector::Store;
use kube::{Api, Client, ResourceExt};

use crate::accounts::{self, Binding};
use crate::admission::{self, Admission, QueueEntry, QueueState};
use crate::config::OperatorConfig;
use crate::error::{Error, Result};
use crate::ledger;
use crate::metrics::Metrics;
use crate::reconcile::key_of;

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
    /// The account that pays for `job`, from the cache.
    pub(crate) fn paying_account(
        &self,
        job: &HarvestJob,
    ) -> Option<std::sync::Arc<HarvestAccount>> {
        let all_accounts = self.accounts.state();
        let binding =
            accounts::bind(job, &all_accounts, self.config.api_namespace.as_deref()).ok()?;
        all_accounts
            .into_iter()
            .find(|a| a.name_any() == binding.account)
    }

    /// The spec check: the catalogue entry and the validated job, or why it cannot run.
    pub(crate) fn check(&self, job: &HarvestJob) -> Result<harvest_crds::ValidJob, SpecError> {
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
    pub(crate) fn admit(
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
    pub(crate) async fn still_waiting(&self, job: &HarvestJob) -> Result<bool> {
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

    pub(crate) fn forget_admission(&self, job: &HarvestJob) {
        self.admitting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&key_of(job));
    }

    /// Admission of a waiting job: the account that pays for it, the cluster queue, then a hold
    /// in the account's books.
    pub(crate) async fn admission(
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
        // Before any hold: a refused job holds nothing. A stale cache cannot let a job through
        // for long, as the hold is written over the account's resourceVersion. The REST API's
        // jobs (only it may create jobs in its namespace) use the API's own storage.
        let from_api = job.namespace().as_deref() == self.config.api_namespace.as_deref();
        if let Some(refusal) =
            accounts::storage_refusal(job, &all_accounts, &binding.account).filter(|_| !from_api)
        {
            return Ok((refusal, None));
        }
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
