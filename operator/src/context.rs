//! What every reconcile shares ([`Context`]: clients, caches, the catalogue, metrics), and the
//! decisions it takes from them before any write: the spec check and the admission of a
//! waiting job into its account's books and the cluster's lanes.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use harvest_crds::conditions::{self, ADMITTED, FINISHED};
use harvest_crds::{HarvestAccount, HarvestJob, SpecError};
use k8s_openapi::jiff::Timestamp;
use kube::runtime::events::Recorder;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, ResourceExt};

use crate::accounts::{self, Binding};
use crate::config::OperatorConfig;
use crate::decide::admission::{self, Admission, QueueEntry, QueueState};
use crate::error::{Error, Result};
use crate::holds;
use crate::metrics::Metrics;
use crate::slots;

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
    /// Worker Pods granted under the models' `maxPods` that the cache may not show yet.
    pub pod_grants: Mutex<PodGrants>,
}

/// Pods granted under `maxPods` by this process, until the jobs' statuses show them.
#[derive(Debug, Default)]
pub struct PodGrants {
    /// By job key, part (`None` for a one-Pod job) and attempt: when granted.
    created: HashMap<(String, Option<u32>, u32), Instant>,
    /// Slots a reconcile in flight may still take, by job key.
    reserved: HashMap<String, (u32, Instant)>,
}

/// How long a grant is counted at most: a status write that failed leaves none for longer.
const GRANT_TTL: Duration = Duration::from_secs(30);

/// Frees a reconcile's unused `maxPods` reservation however it ends.
pub(crate) struct SlotRelease<'a>(pub &'a Context, pub String);

impl Drop for SlotRelease<'_> {
    fn drop(&mut self) {
        lock(&self.0.pod_grants).reserved.remove(&self.1);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

pub(crate) use crate::accounts::key_of;

impl Context {
    /// The cached HarvestAccount `name`.
    pub fn account(&self, name: &str) -> Option<Arc<HarvestAccount>> {
        self.accounts.get(&ObjectRef::new(name))
    }

    /// The account that pays for `job`, from the cache.
    pub(crate) fn paying_account(&self, job: &HarvestJob) -> Option<Arc<HarvestAccount>> {
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
        let mut valid = job
            .spec
            .validate(&entry.served(), std::path::Path::new(&entry.path))?;
        valid.parallelism = entry.parallelism(&job.spec)?;
        Ok(valid)
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

    /// Worker Pods `job` may start now under its model's `maxPods` (no cap: `u32::MAX`),
    /// first come first served over every job of the model in the cache, less the Pods
    /// granted or reserved a moment ago; reserved for this reconcile until its
    /// [`SlotRelease`] drops.
    pub(crate) fn pod_slots(&self, job: &HarvestJob) -> u32 {
        let Some(max_pods) = self.config.model(&job.spec.model).and_then(|m| m.max_pods) else {
            return u32::MAX;
        };
        let key = key_of(job);
        let cached: Vec<_> = self
            .jobs
            .state()
            .into_iter()
            .filter(|other| other.spec.model == job.spec.model)
            .collect();
        let jobs: Vec<slots::JobPods> = cached
            .iter()
            .filter(|other| key_of(other) != key)
            .filter_map(|other| slots::job_pods(other, key_of(other)))
            .collect();
        let status = job.status_or_default();
        let me = slots::job_pods(job, key.clone()).unwrap_or(slots::JobPods {
            key: key.clone(),
            queued_since: Timestamp::now(),
            occupying: 0,
            waiting: status.part_count(),
        });
        let mut grants = lock(&self.pod_grants);
        let now = Instant::now();
        grants.created.retain(|(owner, part, attempt), at| {
            let shown = cached.iter().find(|j| &key_of(j) == owner).is_none_or(|j| {
                let status = j.status_or_default();
                let attempts = match part {
                    None => status.attempts,
                    Some(index) => status
                        .parts
                        .iter()
                        .find(|p| p.index == *index)
                        .map_or(0, |p| p.attempts),
                };
                attempts >= *attempt || conditions::is_true(&status.conditions, FINISHED)
            });
            !shown && now.duration_since(*at) < GRANT_TTL
        });
        grants
            .reserved
            .retain(|_, (_, at)| now.duration_since(*at) < GRANT_TTL);
        let held = u32::try_from(grants.created.len()).unwrap_or(u32::MAX)
            + grants
                .reserved
                .iter()
                .filter(|(owner, _)| **owner != key)
                .map(|(_, (n, _))| *n)
                .sum::<u32>();
        let free = slots::free_for(&jobs, &me, max_pods, held);
        grants.reserved.insert(key, (free, now));
        free
    }

    /// Records a worker Pod created under the model's `maxPods`, out of the reconcile's
    /// reservation. Finalize Pods take no slot.
    pub(crate) fn grant_pod(&self, job: &HarvestJob, attempt: &crate::pod::Attempt) {
        let part = match attempt.role {
            crate::pod::Role::Whole => None,
            crate::pod::Role::Part { index, .. } => Some(index),
            crate::pod::Role::Finalize => return,
        };
        if self
            .config
            .model(&job.spec.model)
            .and_then(|m| m.max_pods)
            .is_none()
        {
            return;
        }
        let key = key_of(job);
        let mut grants = lock(&self.pod_grants);
        if let Some((left, _)) = grants.reserved.get_mut(&key) {
            *left = left.saturating_sub(1);
        }
        grants
            .created
            .insert((key, part, attempt.number), Instant::now());
    }

    /// Gives back the slot [`Self::grant_pod`] took for a Pod the apiserver did not create
    /// (a ResourceQuota refused it).
    pub(crate) fn forget_pod(&self, job: &HarvestJob, attempt: &crate::pod::Attempt) {
        let part = match attempt.role {
            crate::pod::Role::Whole => None,
            crate::pod::Role::Part { index, .. } => Some(index),
            crate::pod::Role::Finalize => return,
        };
        lock(&self.pod_grants)
            .created
            .remove(&(key_of(job), part, attempt.number));
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
        if let Some(ran) = accounts::already_ran(job, &all_accounts, &binding.account) {
            return Ok((ran, None));
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
        let Some(account) = self.account(&binding.account) else {
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
        match holds::hold(&self.client, job, &account, &binding, lane, tokens, now).await {
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
