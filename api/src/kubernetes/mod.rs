//! The Kubernetes backend: jobs are HarvestJobs in one namespace, keys are hashed in Secrets,
//! accounts are HarvestAccounts, and inputs and outputs live in [`Storage`].
//!
//! Answers come from watch-backed caches (reflectors), and every watch event wakes the
//! long-polls, so nothing polls the apiserver. The REST-side quota checks here are pre-checks
//! that give the contract's fast 429s; the operator's admission stays the authority. All state
//! is in the apiserver, so any number of API replicas can serve at once.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use harvest_core::clock::UnixMillis;
use harvest_core::lifecycle::{self, JobEvent, JobStatus};
use harvest_core::quota::{AccountLimits, Book, Lane};
use harvest_core::worker::{RESULT_FILE, RunResult};
use harvest_core::{JobOptions, LayerSelection, Layers};
use harvest_crds::account::millis;
use harvest_crds::conditions::{self, FINISHED};
use harvest_crds::{
    ACCOUNT_LABEL, HarvestAccount, HarvestJob, HarvestJobSpec, HarvestOptions, InputRef, JobPhase,
    KEY_LABEL,
};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tokio::sync::watch;

use self::lookups::Lookups;
use crate::backend::{Caller, JobBackend};
use crate::catalogue::CatalogueModel;
use crate::error::ApiError;
use crate::job::{JobRecord, JobSpec};
use crate::listing::{self, JobFilter, JobPage, Usage};
use crate::paths::{JobPaths, now};
use crate::signing::Links;
use crate::storage::Storage;
use crate::wire::{JobResult, Progress, Submission};

/// Label on the Secrets that hold API keys.
pub const KEY_SECRET_LABEL: &str = "harvest.dev/api-key";
const RUN_ID: &str = "harvest.dev/run-id";
const PROMPTS: &str = "harvest.dev/prompts";
const KEY_HASH: &str = "harvest.dev/key-hash";
const MODEL_LANE: &str = "harvest.dev/lane";
/// The job's predicted output bytes and duration (milliseconds), for its REST status.
const ESTIMATED_BYTES: &str = "harvest.dev/estimated-bytes";
const ESTIMATED_MS: &str = "harvest.dev/estimated-ms";
/// How long a submit waits for the caches' first list after start.
const CACHE_WAIT: Duration = Duration::from_secs(5);
/// How long a submit waits for its own job to reach this replica's cache.
const READ_YOUR_WRITE: Duration = Duration::from_secs(2);
const MANAGER: &str = "harvest-api";

mod cancel;
pub mod limits;
pub mod lookups;

/// Why a Kubernetes call failed.
#[derive(Debug, thiserror::Error)]
pub enum KubeBackendError {
    /// The apiserver refused or was unreachable.
    #[error("kubernetes api: {0}")]
    Kube(#[from] kube::Error),
    /// The account does not exist.
    #[error("no HarvestAccount named {0:?}: create it first (kubectl get harvestaccounts)")]
    NoAccount(String),
    /// A key to import is not of a known format.
    #[error("{0}")]
    BadKey(String),
    /// Other writers kept changing an object this replica had to update.
    #[error("{0} kept changing under this write; try again")]
    Contended(String),
}

impl From<KubeBackendError> for ApiError {
    fn from(error: KubeBackendError) -> Self {
        Self::Internal {
            detail: error.to_string(),
        }
    }
}

/// The backend's caches and clients.
#[derive(Clone)]
pub struct KubeBackend {
    client: Client,
    namespace: String,
    jobs: Cache<HarvestJob>,
    accounts: Cache<HarvestAccount>,
    keys: Cache<Secret>,
    /// Where the key Secrets are.
    keys_namespace: String,
    changes: Arc<watch::Sender<u64>>,
    /// Inputs and outputs.
    pub storage: Storage,
    /// Links this server signs, for local storage.
    links: Links,
    /// The data directory, where local storage keeps outputs.
    data_dir: PathBuf,
    /// When a key the cache lacks may be looked up live.
    key_lookups: Arc<Mutex<Lookups>>,
    /// When a job id the cache lacks may be looked up live.
    job_lookups: Arc<Mutex<Lookups>>,
    /// Jobs whose HarvestJob could not be created, recorded as failed here (the apiserver
    /// would not take them), newest last, at most [`UNAVAILABLE_KEPT`].
    unavailable: Arc<Mutex<std::collections::VecDeque<JobRecord>>>,
    /// The long-poll and counting permits every replica shares.
    limits: Arc<dyn crate::permits::SharedLimits>,
}

/// Failed submits a replica remembers, so that the job id in their 503 answers a GET.
pub const UNAVAILABLE_KEPT: usize = 1024;

impl std::fmt::Debug for KubeBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeBackend")
            .field("namespace", &self.namespace)
            .field("storage", &self.storage)
            .finish_non_exhaustive()
    }
}

/// The Secret name of a key with this hash (derived, so a lookup needs no list).
pub fn key_secret_name(hash: &str) -> String {
    format!("harvest-key-{}", &hash[..hash.len().min(20)])
}

/// The id of a key on its jobs' label (label values are at most 63 characters).
fn key_id(hash: &str) -> String {
    hash[..hash.len().min(20)].to_owned()
}

/// A watch-backed cache and whether it has listed once. Readiness is our own flag, not the
/// store's `wait_until_ready`, which wakes only the last of several concurrent waiters.
#[derive(Clone)]
struct Cache<K: kube::Resource<DynamicType = ()> + Clone + 'static> {
    store: Store<K>,
    listed: Arc<AtomicBool>,
}

impl<K: kube::Resource<DynamicType = ()> + Clone + 'static> Cache<K> {
    fn is_listed(&self) -> bool {
        self.listed.load(Ordering::Acquire)
    }
}

fn reflect<K>(api: Api<K>, config: watcher::Config, changes: Arc<watch::Sender<u64>>) -> Cache<K>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let (reader, writer) = reflector::store();
    let listed = Arc::new(AtomicBool::new(false));
    let stream = watcher(api, config).default_backoff().reflect(writer);
    let flag = Arc::clone(&listed);
    tokio::spawn(async move {
        futures::pin_mut!(stream);
        while let Some(event) = stream.next().await {
            match event {
                Ok(watcher::Event::InitDone) => flag.store(true, Ordering::Release),
                Ok(_) => {}
                Err(error) => tracing::warn!(%error, "watch interrupted; resuming"),
            }
            changes.send_modify(|n| *n += 1);
        }
    });
    Cache {
        store: reader,
        listed,
    }
}

impl KubeBackend {
    /// Starts the caches. Must run inside a Tokio runtime.
    pub fn start(
        client: Client,
        namespace: String,
        keys_namespace: String,
        storage: Storage,
        links: Links,
        data_dir: PathBuf,
    ) -> Self {
        let changes = Arc::new(watch::channel(0).0);
        let jobs = reflect(
            Api::<HarvestJob>::namespaced(client.clone(), &namespace),
            watcher::Config::default(),
            Arc::clone(&changes),
        );
        let accounts = reflect(
            Api::<HarvestAccount>::all(client.clone()),
            watcher::Config::default(),
            Arc::clone(&changes),
        );
        let keys = reflect(
            Api::<Secret>::namespaced(client.clone(), &keys_namespace),
            watcher::Config::default().labels(&format!("{KEY_SECRET_LABEL}=true")),
            Arc::clone(&changes),
        );
        let limits = Arc::new(limits::LeaseLimits::new(client.clone(), &namespace));
        Self {
            limits,
            client,
            namespace,
            keys_namespace,
            jobs,
            accounts,
            keys,
            changes,
            storage,
            links,
            data_dir,
            key_lookups: Arc::default(),
            job_lookups: Arc::default(),
            unavailable: Arc::default(),
        }
    }

    /// `name` from the apiserver, for a cache that lacks it: `None` without asking when the
    /// name was found missing moments ago or the live-lookup budget is spent.
    async fn look_up<K>(
        &self,
        api: Api<K>,
        name: &str,
        lookups: &Mutex<Lookups>,
    ) -> Result<Option<K>, ApiError>
    where
        K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        let allowed = lock(lookups).may_look_up(name, std::time::Instant::now());
        if !allowed {
            return Ok(None);
        }
        let found = api.get_opt(name).await.map_err(KubeBackendError::from)?;
        if found.is_none() {
            lock(lookups).missing(name, std::time::Instant::now());
        }
        Ok(found)
    }
}

/// The lock, even if a panicking holder poisoned it (what it guards stays consistent).
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl KubeBackend {
    /// Records `job` as failed because the cluster would not take it, and answers the 503
    /// that quotes it.
    fn unavailable(&self, job: &JobRecord, why: &str) -> ApiError {
        tracing::error!(job = %job.id, reason = why, "the job could not be handed to the cluster");
        let failed = JobRecord {
            status: JobStatus::Failed,
            tokens: Some(0),
            completed_at: Some(now()),
            error: Some(format!(
                "the cluster did not take the job ({why}); submit it again"
            )),
            ..job.clone()
        };
        let mut kept = lock(&self.unavailable);
        if kept.len() >= UNAVAILABLE_KEPT {
            kept.pop_front();
        }
        kept.push_back(failed);
        ApiError::Unavailable {
            job_id: job.id.clone(),
        }
    }

    /// A job recorded by [`Self::unavailable`].
    fn recorded_unavailable(&self, id: &str) -> Option<JobRecord> {
        lock(&self.unavailable).iter().find(|j| j.id == id).cloned()
    }
}

#[async_trait::async_trait]
impl JobBackend for KubeBackend {
    /// Every replica's permits, on a Lease.
    fn shared_limits(&self) -> Option<Arc<dyn crate::permits::SharedLimits>> {
        Some(Arc::clone(&self.limits))
    }

    /// Whether every cache has listed once.
    async fn ready(&self) -> bool {
        self.jobs.is_listed() && self.accounts.is_listed() && self.keys.is_listed()
    }

    /// Wakes on every watch event.
    fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// The account and key hash of a valid key.
    async fn authenticate(&self, key: &str) -> Result<Option<Caller>, ApiError> {
        let hash = &crate::keys::key_hash(key);
        let name = key_secret_name(hash);
        let secret = match self
            .keys
            .store
            .get(&ObjectRef::new(&name).within(&self.keys_namespace))
        {
            Some(secret) => Some((*secret).clone()),
            // A key made moments ago may not have reached this replica's cache yet.
            None => {
                let secrets = Api::<Secret>::namespaced(self.client.clone(), &self.keys_namespace);
                self.look_up(secrets, &name, &self.key_lookups).await?
            }
        };
        let field = |secret: &Secret, key: &str| {
            secret
                .data
                .as_ref()
                .and_then(|d| d.get(key))
                .and_then(|v| String::from_utf8(v.0.clone()).ok())
        };
        Ok(secret.and_then(|s| {
            (field(&s, "hash").as_deref() == Some(hash))
                .then(|| field(&s, "account"))
                .flatten()
                .map(|account| Caller {
                    account,
                    key_hash: hash.to_owned(),
                })
        }))
    }

    /// Stores the inputs and creates the HarvestJob.
    async fn submit(
        &self,
        job: &JobRecord,
        submission: &Submission,
        _model: &CatalogueModel,
    ) -> Result<(), ApiError> {
        // Just after start the caches may not have listed yet; the pre-check needs them.
        let mut changes = self.changes();
        let deadline = tokio::time::Instant::now() + CACHE_WAIT;
        while !(self.accounts.is_listed() && self.jobs.is_listed())
            && tokio::time::timeout_at(deadline, changes.changed())
                .await
                .is_ok_and(|r| r.is_ok())
        {}
        if !(self.accounts.is_listed() && self.jobs.is_listed()) {
            return Err(self.unavailable(job, "its accounts and jobs are not loaded yet"));
        }
        self.precheck(job).await?;
        let input = self.store_inputs(&job.id, submission).await?;
        let resource = self.resource(job, input);
        let mut changes = self.changes();
        let created = Api::<HarvestJob>::namespaced(self.client.clone(), &self.namespace)
            .create(
                &PostParams {
                    field_manager: Some(MANAGER.into()),
                    ..PostParams::default()
                },
                &resource,
            )
            .await;
        if let Err(error) = created {
            // No job will ever read these inputs.
            if let Err(cleanup) = self.storage.delete_inputs(&job.id).await {
                tracing::warn!(job = %job.id, error = %cleanup, "could not delete the inputs of a job that was not created");
            }
            return Err(self.unavailable(job, &error.to_string()));
        }
        // Answer once this replica's cache has the job, so the client's next call, and the
        // next submit's pre-check, see it.
        let seen = ObjectRef::new(&job.id).within(&self.namespace);
        let deadline = tokio::time::Instant::now() + READ_YOUR_WRITE;
        while self.jobs.store.get(&seen).is_none()
            && tokio::time::timeout_at(deadline, changes.changed())
                .await
                .is_ok_and(|r| r.is_ok())
        {}
        Ok(())
    }

    /// A job by id, from the cache (or the apiserver, for a job this replica has not seen yet).
    async fn get(&self, id: &str) -> Result<Option<JobRecord>, ApiError> {
        let cached = self
            .jobs
            .store
            .get(&ObjectRef::new(id).within(&self.namespace));
        if cached.is_none()
            && let Some(failed) = self.recorded_unavailable(id)
        {
            return Ok(Some(failed));
        }
        let job = match cached {
            Some(job) => Some((*job).clone()),
            None => {
                let jobs = Api::<HarvestJob>::namespaced(self.client.clone(), &self.namespace);
                self.look_up(jobs, id, &self.job_lookups).await?
            }
        };
        Ok(job.map(|j| record(&j)))
    }

    /// The account's jobs from the cache, paged by the same rule as the embedded backend.
    async fn list(&self, account: &str, filter: &JobFilter) -> Result<JobPage, ApiError> {
        let jobs = self
            .jobs
            .store
            .state()
            .iter()
            .filter(|j| j.labels().get(ACCOUNT_LABEL).map(String::as_str) == Some(account))
            .map(|j| record(j))
            .chain(
                lock(&self.unavailable)
                    .iter()
                    .filter(|j| j.account == account)
                    .cloned(),
            )
            .collect();
        listing::page(jobs, filter)
    }

    /// The model's most recent done API job in the cache, start to end. Status times are whole
    /// seconds, so a job that started and ended within one counts as one second (a
    /// conservative rate).
    async fn throughput(&self, model: &str) -> Result<Option<f64>, ApiError> {
        let latest = self
            .jobs
            .store
            .state()
            .iter()
            .filter(|j| j.spec.model == model)
            .map(|j| record(j))
            .filter(|j| j.status == JobStatus::Done)
            .filter_map(|j| {
                let (start, end) = (j.started_at?, j.completed_at?);
                let tokens = j.tokens.filter(|&t| t > 0)?;
                let millis = (end.0 - start.0).max(1000);
                Some((end, tokens as f64 / (millis as f64 / 1000.0)))
            })
            .max_by_key(|(end, _)| end.0);
        Ok(latest.map(|(_, rate)| rate))
    }

    /// The account's books as the pre-check sees them (so the key's job count is what its
    /// quota is checked against: admitted jobs and those waiting for admission). Storage is not
    /// budgeted on Kubernetes.
    async fn usage(&self, caller: &Caller) -> Result<Usage, ApiError> {
        let at = now();
        let (book, limits) = self.cached_books(&caller.account, &caller.key_hash, at)?;
        let key_jobs = book.jobs_of(&key_ref(&caller.key_hash), at);
        Ok(Usage::new(
            &caller.account,
            &limits,
            book.ledger,
            key_jobs,
            None,
            at,
        ))
    }

    /// Cancels the job and frees its slot before answering: sets `spec.cancel` (the operator
    /// stops the Pod), writes the end into the job's status and settles its hold
    /// (`kubernetes/cancel.rs`), then waits until this replica's caches show both.
    async fn cancel(&self, id: &str) -> Result<JobRecord, ApiError> {
        let job = self.get(id).await?.ok_or(ApiError::NotFound)?;
        if let Err(error) = lifecycle::next(job.status, job.reserved, JobEvent::Cancel) {
            return Err(ApiError::NotCancellable {
                message: error.to_string(),
            });
        }
        if job.status.is_terminal() {
            return Ok(job);
        }
        let mut changes = self.changes();
        let jobs = Api::<HarvestJob>::namespaced(self.client.clone(), &self.namespace);
        let patched = jobs
            .patch(
                id,
                &PatchParams::apply(MANAGER),
                &Patch::Merge(json!({"spec": {"cancel": true}})),
            )
            .await
            .map_err(KubeBackendError::from)?;
        let ended = cancel::end(&jobs, patched).await?;
        cancel::settle(&Api::all(self.client.clone()), &ended).await?;
        let seen = ObjectRef::new(id).within(&self.namespace);
        let uid = ended.uid().unwrap_or_default();
        let account = ended.status_or_default().account;
        let caught_up = || {
            let job_ended =
                self.jobs.store.get(&seen).is_some_and(|j| {
                    conditions::is_true(&j.status_or_default().conditions, FINISHED)
                });
            let released = account.as_ref().is_none_or(|a| {
                self.accounts
                    .store
                    .get(&ObjectRef::new(a))
                    .is_none_or(|a| a.status_or_default().holds.iter().all(|h| h.uid != uid))
            });
            job_ended && released
        };
        let deadline = tokio::time::Instant::now() + READ_YOUR_WRITE;
        while !caught_up()
            && tokio::time::timeout_at(deadline, changes.changed())
                .await
                .is_ok_and(|r| r.is_ok())
        {}
        Ok(record(&ended))
    }

    /// A done job's result (its `result.json`, read from storage on every answer, so files
    /// deleted since show as `urls_expired`), or `None` when its files are gone.
    async fn result(&self, job: &JobRecord) -> Result<Option<JobResult>, ApiError> {
        let internal = |detail: String| ApiError::Internal { detail };
        let Some(bytes) = self
            .storage
            .read_output(&job.id, RESULT_FILE)
            .await
            .map_err(internal)?
        else {
            return Ok(None);
        };
        let run: RunResult = serde_json::from_slice(&bytes)
            .map_err(|e| internal(format!("{RESULT_FILE} of job {}: {e}", job.id)))?;
        if let Storage::Local { .. } = self.storage {
            let out = JobPaths::new(&self.data_dir, &job.id).output();
            if !out.join("manifest.json").is_file() {
                return Ok(None);
            }
        }
        Ok(Some(JobResult::from_run(&run)))
    }

    fn outputs(&self) -> Storage {
        self.storage.clone()
    }

    /// Presigned S3 links, or links this server signs for local storage.
    async fn links(
        &self,
        id: &str,
        files: &[String],
        expires: i64,
    ) -> Result<Vec<String>, ApiError> {
        let ttl = Duration::from_secs((expires - now().0 / 1000).max(1) as u64);
        let mut urls = Vec::with_capacity(files.len());
        for file in files {
            let presigned = self
                .storage
                .presign(id, file, ttl)
                .await
                .map_err(|detail| ApiError::Internal { detail })?;
            urls.push(presigned.unwrap_or_else(|| self.links.url(id, file, expires)));
        }
        Ok(urls)
    }

    /// Jobs not finished.
    async fn unfinished(&self) -> u64 {
        self.jobs
            .store
            .state()
            .iter()
            .filter(|j| !record(j).status.is_terminal())
            .count() as u64
    }
}

impl KubeBackend {
    /// Writes a job's prompts (and directions) to storage; where the HarvestJob finds them.
    async fn store_inputs(&self, id: &str, submission: &Submission) -> Result<InputRef, ApiError> {
        let internal = |detail: String| ApiError::Internal { detail };
        let lines = submission.inputs_jsonl();
        self.storage
            .put_input(id, "prompts.jsonl", lines.into_bytes())
            .await
            .map_err(internal)?;
        let directions = match &submission.directions {
            Some((n, values)) => {
                let npy = harvest_core::npy::f32_matrix(*n, values.len() / n, values);
                self.storage
                    .put_input(id, "directions.npy", npy)
                    .await
                    .map_err(internal)?;
                Some(self.storage.input_location(id, "directions.npy"))
            }
            None => None,
        };
        Ok(InputRef {
            prompts: self.storage.input_location(id, "prompts.jsonl"),
            directions,
        })
    }

    /// The HarvestJob of a REST job: its resolved layers listed, its account and key on labels,
    /// what the REST answers need on annotations.
    fn resource(&self, job: &JobRecord, input: InputRef) -> HarvestJob {
        let spec = HarvestJobSpec {
            input,
            harvest: HarvestOptions::from(&job.spec.options),
            ..HarvestJobSpec::new(
                job.model.clone(),
                String::new(),
                self.storage.output_location(&job.id),
                job.reserved.max(1),
            )
        };
        let spec = HarvestJobSpec {
            parallelism: (job.spec.parallelism > 1)
                .then(|| u32::try_from(job.spec.parallelism).unwrap_or(u32::MAX)),
            ..spec
        };
        let mut annotations = BTreeMap::from([
            (RUN_ID.to_owned(), job.run_id.clone()),
            (PROMPTS.to_owned(), job.n_prompts.to_string()),
            (KEY_HASH.to_owned(), job.key_hash.clone()),
            (MODEL_LANE.to_owned(), job.spec.lane.to_string()),
            (
                ESTIMATED_BYTES.to_owned(),
                job.spec.estimated_bytes.to_string(),
            ),
        ]);
        if let Some(ms) = job.spec.estimated_ms {
            annotations.insert(ESTIMATED_MS.to_owned(), ms.to_string());
        }
        HarvestJob {
            metadata: ObjectMeta {
                name: Some(job.id.clone()),
                namespace: Some(self.namespace.clone()),
                labels: Some(BTreeMap::from([
                    (ACCOUNT_LABEL.to_owned(), job.account.clone()),
                    (KEY_LABEL.to_owned(), key_id(&job.key_hash)),
                ])),
                annotations: Some(annotations),
                ..ObjectMeta::default()
            },
            spec,
            status: None,
        }
    }

    /// The account's books and limits as this replica's caches show them ([`books`]).
    fn cached_books(
        &self,
        account: &str,
        key_hash: &str,
        now: UnixMillis,
    ) -> Result<(Book, AccountLimits), ApiError> {
        let Some(cached) = self.accounts.store.get(&ObjectRef::new(account)) else {
            return Err(ApiError::Internal {
                detail: KubeBackendError::NoAccount(account.into()).to_string(),
            });
        };
        let jobs = self.jobs.store.state();
        Ok(books(
            &cached,
            jobs.iter().map(AsRef::as_ref),
            key_hash,
            now,
        ))
    }

    /// The REST pre-check of `job`: the account's books as the caches show them, checked by
    /// the same `core` rules; a refusal is checked again against the apiserver's own state
    /// (the account and its jobs, two reads), because a slot another replica freed a moment
    /// ago (a cancel it answered) may not have reached this replica's caches yet.
    async fn precheck(&self, job: &JobRecord) -> Result<(), ApiError> {
        let check = |(book, limits): (Book, AccountLimits)| {
            book.check(
                &limits,
                &key_ref(&job.key_hash),
                job.spec.lane,
                job.reserved,
                now(),
            )
            .map_err(ApiError::Denied)
        };
        if check(self.cached_books(&job.account, &job.key_hash, now())?).is_ok() {
            return Ok(());
        }
        let account = Api::<HarvestAccount>::all(self.client.clone())
            .get(&job.account)
            .await
            .map_err(KubeBackendError::from)?;
        let listed = Api::<HarvestJob>::namespaced(self.client.clone(), &self.namespace)
            .list(&ListParams::default().labels(&format!("{ACCOUNT_LABEL}={}", job.account)))
            .await
            .map_err(KubeBackendError::from)?;
        check(books(&account, listed.items.iter(), &job.key_hash, now()))
    }
}

/// `account`'s books with its unfinished API jobs among `jobs` counted, and its limits. Each
/// lane counts every unfinished API job of the account in it (whether or not the account's
/// status shows its hold yet), or the books' count if that is higher; jobs that wait for
/// admission add their reservations and count against the key's monthly jobs.
fn books<'a>(
    account: &HarvestAccount,
    jobs: impl IntoIterator<Item = &'a HarvestJob>,
    key_hash: &str,
    now: UnixMillis,
) -> (Book, AccountLimits) {
    let name = account.name_any();
    let mut book = account.status_or_default().book(now);
    book.roll(now);
    let mut waiting_jobs = 0;
    let (mut unfinished_small, mut unfinished_large) = (0, 0);
    for job in jobs {
        let s = job.status_or_default();
        let mine = job.labels().get(ACCOUNT_LABEL) == Some(&name);
        if !mine || conditions::is_true(&s.conditions, FINISHED) {
            continue;
        }
        match job_lane(job) {
            Lane::Small => unfinished_small += 1,
            Lane::Large => unfinished_large += 1,
        }
        if s.account.is_some() {
            continue;
        }
        book.ledger.tokens_today += job.spec.token_budget;
        book.ledger.tokens_month += job.spec.token_budget;
        book.ledger.tokens_total += job.spec.token_budget;
        if job.labels().get(KEY_LABEL) == Some(&key_id(key_hash)) {
            waiting_jobs += 1;
        }
    }
    *book.key_jobs.entry(key_ref(key_hash)).or_default() += waiting_jobs;
    book.ledger.active_small = book.ledger.active_small.max(unfinished_small);
    book.ledger.active_large = book.ledger.active_large.max(unfinished_large);
    (book, account.spec.limits())
}

/// A key's entry in an account's books.
fn key_ref(key_hash: &str) -> String {
    format!("key:{}", key_id(key_hash))
}

fn job_lane(job: &HarvestJob) -> Lane {
    match job.annotations().get(MODEL_LANE).map(String::as_str) {
        Some("large") => Lane::Large,
        _ => Lane::Small,
    }
}

/// A HarvestJob as the REST API sees it.
pub fn record(job: &HarvestJob) -> JobRecord {
    let status = job.status_or_default();
    let annotation = |key: &str| job.annotations().get(key).cloned().unwrap_or_default();
    let finished = conditions::get(&status.conditions, FINISHED).filter(|c| c.status == "True");
    let rest_status = match status.phase {
        // Admitted, but no harvester has run yet (the Pod is scheduled, its image pulled):
        // still pending, as the contract charges a cancel only once a run has started.
        Some(JobPhase::Running) if status.running_since.is_none() => JobStatus::Pending,
        Some(JobPhase::Running) => JobStatus::Running,
        Some(JobPhase::Succeeded) => JobStatus::Done,
        Some(JobPhase::Failed) => JobStatus::Failed,
        Some(JobPhase::Cancelled) => JobStatus::Cancelled,
        Some(JobPhase::Pending | JobPhase::Suspended) | None => JobStatus::Pending,
    };
    let time = |t: &Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>| {
        t.as_ref().map(|t| millis(t.0))
    };
    let (spec, invalid) = recorded_spec(job);
    JobRecord {
        id: job.name_any(),
        run_id: annotation(RUN_ID),
        account: job.labels().get(ACCOUNT_LABEL).cloned().unwrap_or_default(),
        key_hash: annotation(KEY_HASH),
        model: job.spec.model.clone(),
        status: rest_status,
        n_prompts: annotation(PROMPTS).parse().unwrap_or(0),
        reserved: job.spec.token_budget,
        tokens: rest_status
            .is_terminal()
            .then(|| status.tokens.and_then(|t| t.charged).unwrap_or(0)),
        created_at: time(&job.metadata.creation_timestamp).unwrap_or_default(),
        started_at: time(&status.start_time),
        completed_at: time(&status.completion_time),
        result: None,
        error: (rest_status == JobStatus::Failed)
            .then(|| finished.map(|c| c.message.clone()))
            .flatten()
            .or_else(|| invalid.map(|why| format!("spec.harvest cannot run: {why}"))),
        progress: status.progress.map(|p| Progress {
            phase: p
                .phase
                .unwrap_or_else(|| harvest_core::worker::Phase::Running.as_str().to_owned()),
            bytes_loaded: p.bytes_loaded,
            bytes_total: p.bytes_total,
            prompts_done: p.prompts_done as usize,
            prompts_total: p.prompts_total as usize,
            tokens_done: p.tokens_done,
        }),
        spec,
    }
}

/// How a HarvestJob runs, as a job record says it, and why its options cannot run when they
/// cannot. The operator refuses such a job (a HarvestJob written by hand); its record shows the
/// defaults beside that reason, so the error is never silent.
fn recorded_spec(job: &HarvestJob) -> (JobSpec, Option<String>) {
    let annotation = |key: &str| job.annotations().get(key).cloned().unwrap_or_default();
    let projecting = job.spec.input.directions.is_some();
    // The API lists the layers it resolved; a HarvestJob written by hand may name quartiles or
    // all, which only the model's depth resolves, so its record lists none.
    let listed = |selection: LayerSelection| match selection {
        LayerSelection::Explicit(list) => Layers::from(
            list.into_iter()
                .filter_map(|l| usize::try_from(l).ok())
                .collect::<Vec<_>>(),
        ),
        LayerSelection::Quartiles | LayerSelection::All => Layers::default(),
    };
    let (options, invalid) = match job.spec.harvest.to_options(projecting) {
        Ok(options) => (options.map_layers(listed), None),
        Err(why) => (JobOptions::default(), Some(why.to_string())),
    };
    let spec = JobSpec {
        options,
        has_directions: projecting,
        lane: job_lane(job),
        estimated_bytes: annotation(ESTIMATED_BYTES).parse().unwrap_or(0),
        estimated_ms: annotation(ESTIMATED_MS).parse().ok(),
        parallelism: job.spec.parallelism.map_or(1, |n| n as usize),
    };
    (spec, invalid)
}

/// Creates a key for `account` as a Secret holding only its hash (and the few characters
/// `list-keys` shows), or stores `import`ed, a key made elsewhere; returns the key.
pub async fn create_key(
    client: Client,
    namespace: &str,
    account: &str,
    label: &str,
    import: Option<&str>,
) -> Result<String, KubeBackendError> {
    if Api::<HarvestAccount>::all(client.clone())
        .get_opt(account)
        .await?
        .is_none()
    {
        return Err(KubeBackendError::NoAccount(account.into()));
    }
    let key = match import {
        Some(key) => {
            crate::keys::check_key_format(key)
                .map_err(|e| KubeBackendError::BadKey(e.to_string()))?;
            key.to_owned()
        }
        None => crate::keys::new_key(),
    };
    let hash = crate::keys::key_hash(&key);
    let data = BTreeMap::from([
        ("hash".to_owned(), ByteString(hash.clone().into_bytes())),
        (
            "account".to_owned(),
            ByteString(account.as_bytes().to_vec()),
        ),
        ("label".to_owned(), ByteString(label.as_bytes().to_vec())),
        (
            "prefix".to_owned(),
            ByteString(crate::keys::shown_prefix(&key).into_bytes()),
        ),
    ]);
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(key_secret_name(&hash)),
            labels: Some(BTreeMap::from([
                (KEY_SECRET_LABEL.to_owned(), "true".to_owned()),
                (ACCOUNT_LABEL.to_owned(), account.to_owned()),
            ])),
            ..ObjectMeta::default()
        },
        data: Some(data),
        type_: Some("Opaque".into()),
        ..Secret::default()
    };
    Api::<Secret>::namespaced(client, namespace)
        .create(&PostParams::default(), &secret)
        .await?;
    Ok(key)
}

/// Revokes a key by deleting its Secret; returns whether it existed.
pub async fn revoke_key(
    client: Client,
    namespace: &str,
    key: &str,
) -> Result<bool, KubeBackendError> {
    let name = key_secret_name(&crate::keys::key_hash(key));
    match Api::<Secret>::namespaced(client, namespace)
        .delete(&name, &Default::default())
        .await
    {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(false),
        Err(error) => Err(error.into()),
    }
}

/// Every key Secret, as `list-keys` shows it (a Secret records no last use).
pub async fn list_keys(
    client: Client,
    namespace: &str,
    account: Option<&str>,
) -> Result<Vec<crate::keys::KeyInfo>, KubeBackendError> {
    let secrets = Api::<Secret>::namespaced(client, namespace)
        .list(&ListParams::default().labels(&format!("{KEY_SECRET_LABEL}=true")))
        .await?;
    let field = |secret: &Secret, key: &str| {
        secret
            .data
            .as_ref()
            .and_then(|d| d.get(key))
            .map(|v| String::from_utf8_lossy(&v.0).into_owned())
            .unwrap_or_default()
    };
    let mut keys: Vec<crate::keys::KeyInfo> = secrets
        .items
        .iter()
        .map(|s| crate::keys::KeyInfo {
            account: field(s, "account"),
            label: field(s, "label"),
            prefix: field(s, "prefix"),
            created_at: s
                .metadata
                .creation_timestamp
                .as_ref()
                .map(|t| millis(t.0))
                .unwrap_or_default(),
            last_used: None,
            revoked_at: None,
        })
        .filter(|k| account.is_none_or(|a| a == k.account))
        .collect();
    keys.sort_by_key(|k| std::cmp::Reverse(k.created_at));
    Ok(keys)
}

/// Revokes every key Secret labelled `label` (of `account`, when given); returns how many.
pub async fn revoke_label(
    client: Client,
    namespace: &str,
    label: &str,
    account: Option<&str>,
) -> Result<usize, KubeBackendError> {
    let api = Api::<Secret>::namespaced(client, namespace);
    let secrets = api
        .list(&ListParams::default().labels(&format!("{KEY_SECRET_LABEL}=true")))
        .await?;
    let data = |secret: &Secret, key: &str| {
        secret
            .data
            .as_ref()
            .and_then(|d| d.get(key))
            .map(|v| String::from_utf8_lossy(&v.0).into_owned())
    };
    let matching: Vec<&Secret> = secrets
        .items
        .iter()
        .filter(|s| data(s, "label").as_deref() == Some(label))
        .filter(|s| account.is_none_or(|a| data(s, "account").as_deref() == Some(a)))
        .collect();
    let mut accounts: Vec<String> = matching.iter().filter_map(|s| data(s, "account")).collect();
    accounts.sort();
    accounts.dedup();
    if accounts.len() > 1 {
        return Err(KubeBackendError::BadKey(crate::keys::ambiguous_label(
            label, &accounts,
        )));
    }
    for secret in &matching {
        api.delete(&secret.name_any(), &Default::default()).await?;
    }
    Ok(matching.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_admitted_job_reads_as_running_only_once_its_harvester_has_run() {
        let mut job = HarvestJob::new("j", HarvestJobSpec::new("m", "s3://b/in", "s3://b/out", 10));
        job.status = Some(harvest_crds::HarvestJobStatus {
            phase: Some(JobPhase::Running),
            ..Default::default()
        });
        assert_eq!(
            record(&job).status,
            JobStatus::Pending,
            "its Pod has not started"
        );
        let started = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::now(),
        );
        job.status.as_mut().unwrap().running_since = Some(started);
        assert_eq!(record(&job).status, JobStatus::Running);
    }

    #[test]
    fn a_hand_written_job_with_invalid_options_reads_with_the_reason_not_silent_defaults() {
        let mut job = HarvestJob::new("j", HarvestJobSpec::new("m", "s3://b/in", "s3://b/out", 10));
        job.spec.harvest.seed = Some(7);
        let recorded = record(&job);
        let error = recorded.error.expect("the reason is recorded");
        assert!(
            error.starts_with("spec.harvest cannot run: ") && error.contains("seed"),
            "{error}"
        );
        job.spec.harvest.seed = None;
        job.spec.harvest.sites = Some(vec![harvest_core::Site::MlpOut, harvest_core::Site::MlpOut]);
        assert!(record(&job).error.unwrap().contains("mlp_out"));
        job.spec.harvest.sites = Some(vec![harvest_core::Site::MlpOut]);
        let valid = record(&job);
        assert_eq!(valid.error, None);
        assert_eq!(valid.spec.options.sites.names(), ["mlp_out"]);
    }
}
