//! The embedded backend: jobs, accounts and keys in the SQLite [`Store`], each job run by a
//! `harvester` child process of the [`Workers`] pool, outputs in the data directory, and links
//! this server signs and serves itself (`gpus` hands its devices to workers). Store calls run on Tokio's blocking threads, so a slow
//! disk never stalls the async workers.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use harvest_core::lifecycle::{JobEvent, Transition};
use harvest_core::plan::DEFAULT_BATCH_TOKENS;
use harvest_core::{Location, ResolvedPlan};
use tokio::sync::watch;

pub mod gpus;
pub mod store;
pub mod workers;

use self::store::{Outcome, Store, StoreError};
use self::workers::Workers;
use crate::backend::{Caller, JobBackend};
use crate::catalogue::CatalogueModel;
use crate::error::ApiError;
use crate::job::JobRecord;
use crate::listing::{self, JobFilter, JobPage, Measure, Usage};
use crate::paths::{JobPaths, now};
use crate::signing::Links;
use crate::wire::{JobResult, Submission};

/// How the embedded backend keeps its disk from filling.
#[derive(Debug, Clone, Default)]
pub struct StoragePolicy {
    /// Free bytes the data directory keeps; a job that would eat into them is refused.
    pub min_free_bytes: u64,
    /// Per account, the bytes its kept files may take.
    pub budgets: HashMap<String, u64>,
    /// How long an ended job's files are kept (`None`: for ever).
    pub retention: Option<Duration>,
    /// How often the sweeper runs.
    pub sweep_every: Duration,
}

/// The embedded backend.
#[derive(Debug)]
pub struct EmbeddedBackend {
    store: Arc<Store>,
    workers: Arc<Workers>,
    data_dir: PathBuf,
    links: Links,
    shutdown_grace: Duration,
    storage: StoragePolicy,
}

impl EmbeddedBackend {
    /// The backend over an open store and its worker pool; on shutdown workers get
    /// `shutdown_grace` to stop.
    pub fn new(
        store: Arc<Store>,
        workers: Arc<Workers>,
        data_dir: PathBuf,
        links: Links,
        shutdown_grace: Duration,
        storage: StoragePolicy,
    ) -> Self {
        Self {
            store,
            workers,
            data_dir,
            links,
            shutdown_grace,
            storage,
        }
    }

    /// Starts the retention sweeper: every `sweep_every`, the files (inputs and outputs) of
    /// jobs that ended longer than `retention` ago are deleted, and their records say so.
    pub fn start_sweeper(&self) {
        let Some(retention) = self.storage.retention else {
            return;
        };
        let (store, data_dir, every) = (
            Arc::clone(&self.store),
            self.data_dir.clone(),
            self.storage.sweep_every,
        );
        tokio::spawn(async move {
            loop {
                let (store, data_dir) = (Arc::clone(&store), data_dir.clone());
                let swept =
                    tokio::task::spawn_blocking(move || sweep(&store, &data_dir, retention)).await;
                match swept {
                    Ok(Ok(0)) => {}
                    Ok(Ok(n)) => {
                        tracing::info!(jobs = n, "deleted the files of jobs past their retention");
                    }
                    Ok(Err(error)) => {
                        tracing::warn!(%error, "the retention sweep failed; trying again later");
                    }
                    Err(error) => tracing::warn!(%error, "the retention sweep was lost"),
                }
                tokio::time::sleep(every).await;
            }
        });
    }

    /// Refuses a job whose estimated files would not fit the disk's free space (less the kept
    /// reserve) or its account's storage budget.
    async fn check_storage(&self, job: &JobRecord) -> Result<(), ApiError> {
        let needed = job.spec.estimated_bytes;
        let free = nix::sys::statvfs::statvfs(&self.data_dir)
            .map(|s| s.blocks_available().saturating_mul(s.fragment_size()))
            .map_err(|e| ApiError::Internal {
                detail: format!("free space of {}: {e}", self.data_dir.display()),
            })?;
        let reserve = self.storage.min_free_bytes;
        if needed.saturating_add(reserve) > free {
            return Err(ApiError::InsufficientStorage {
                message: format!(
                    "the job's files need about {needed} bytes, and the server has {free} bytes free of which it keeps {reserve} (min_free_bytes): split the corpus, keep fewer layers, or ask the operator to free space"
                ),
            });
        }
        if let Some(&budget) = self.storage.budgets.get(&job.account) {
            let account = job.account.clone();
            let used = self.store(move |s| s.stored_bytes(&account)).await?;
            if used.saturating_add(needed) > budget {
                return Err(ApiError::InsufficientStorage {
                    message: format!(
                        "account {:?} keeps {used} bytes of files and this job needs about {needed} more, past its storage budget of {budget} bytes: wait for old jobs' retention, or keep fewer layers",
                        job.account
                    ),
                });
            }
        }
        Ok(())
    }

    /// Runs a store call on a blocking thread.
    async fn store<T: Send + 'static>(
        &self,
        call: impl FnOnce(&Store) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let store = Arc::clone(&self.store);
        tokio::task::spawn_blocking(move || call(&store))
            .await
            .map_err(|e| ApiError::Internal {
                detail: format!("a store call was lost: {e}"),
            })?
            .map_err(ApiError::from)
    }
}

#[async_trait::async_trait]
impl JobBackend for EmbeddedBackend {
    async fn authenticate(&self, key: &str) -> Result<Option<Caller>, ApiError> {
        let key = key.to_owned();
        let found = self.store(move |s| s.authenticate(&key)).await?;
        Ok(found.map(|(account, key_hash)| Caller { account, key_hash }))
    }

    async fn submit(
        &self,
        job: &JobRecord,
        submission: &Submission,
        model: &CatalogueModel,
    ) -> Result<(), ApiError> {
        self.check_storage(job).await?;
        let paths = JobPaths::new(&self.data_dir, &job.id);
        write_inputs(&paths, &model.path, submission).map_err(|e| ApiError::Internal {
            detail: format!("writing the inputs of job {}: {e}", job.id),
        })?;
        let admitted = job.clone();
        if let Err(error) = self.store(move |s| s.admit(&admitted, now())).await {
            let _ = std::fs::remove_dir_all(&paths.root);
            return Err(error);
        }
        if !self.workers.available() {
            let id = job.id.clone();
            let outcome = Outcome {
                result: None,
                error: Some("the harvest worker is not installed on this server".into()),
            };
            self.store(move |s| s.apply(&id, JobEvent::Failed, outcome, now()))
                .await?;
            return Err(ApiError::Unavailable {
                job_id: job.id.clone(),
            });
        }
        self.workers.enqueue(job.id.clone());
        Ok(())
    }

    async fn get(&self, id: &str) -> Result<Option<JobRecord>, ApiError> {
        let id = id.to_owned();
        self.store(move |s| s.job(&id)).await
    }

    async fn list(&self, account: &str, filter: &JobFilter) -> Result<JobPage, ApiError> {
        let (account, query) = (account.to_owned(), filter.clone());
        let page = self
            .store(move |s| {
                let filter = query;
                let cursor = match &filter.after {
                    Some(after) => match s.job(after)? {
                        Some(job) if job.account == account => Some((job.created_at, job.id)),
                        _ => return Ok(None),
                    },
                    None => None,
                };
                let cursor = cursor.as_ref().map(|(at, id)| (*at, id.as_str()));
                let mut jobs = s.jobs_page(&account, filter.status, cursor, filter.limit + 1)?;
                let has_more = jobs.len() > filter.limit;
                jobs.truncate(filter.limit);
                Ok(Some(JobPage { jobs, has_more }))
            })
            .await?;
        page.ok_or_else(|| listing::unknown_cursor(filter.after.as_deref().unwrap_or_default()))
    }

    async fn throughput(&self, model: &str) -> Result<Option<f64>, ApiError> {
        let model = model.to_owned();
        self.store(move |s| s.throughput(&model)).await
    }

    async fn usage(&self, caller: &Caller) -> Result<Usage, ApiError> {
        let caller = caller.clone();
        let budget = self.storage.budgets.get(&caller.account).copied();
        self.store(move |s| {
            let at = now();
            let (limits, ledger) = s.account(&caller.account)?;
            let key_jobs = s.key_jobs_since(&caller.key_hash, at.month().start())?;
            let stored = s.stored_bytes(&caller.account)?;
            let storage = Some(Measure {
                used: stored,
                limit: budget,
            });
            Ok(Usage::new(
                &caller.account,
                &limits,
                ledger,
                key_jobs,
                storage,
                at,
            ))
        })
        .await
    }

    fn changes(&self) -> watch::Receiver<u64> {
        self.workers.subscribe()
    }

    async fn cancel(&self, id: &str) -> Result<JobRecord, ApiError> {
        let owned = id.to_owned();
        let (job, transition) = self
            .store(move |s| s.apply(&owned, JobEvent::Cancel, Outcome::default(), now()))
            .await?;
        if let Transition::To { .. } = transition {
            // Also a job whose worker is about to start it: its stop handle is registered
            // before it marks the job started.
            self.workers.cancel(id);
            self.workers.notify();
        }
        Ok(job)
    }

    async fn result(&self, job: &JobRecord) -> Result<Option<JobResult>, ApiError> {
        let out = JobPaths::new(&self.data_dir, &job.id).output();
        Ok(job
            .result
            .clone()
            .filter(|_| out.join("manifest.json").is_file()))
    }

    fn outputs(&self) -> crate::storage::Storage {
        crate::storage::Storage::Local {
            root: self.data_dir.clone(),
        }
    }

    async fn links(
        &self,
        id: &str,
        files: &[String],
        expires: i64,
    ) -> Result<Vec<String>, ApiError> {
        Ok(files
            .iter()
            .map(|file| self.links.url(id, file, expires))
            .collect())
    }

    async fn ready(&self) -> bool {
        self.store(|s| s.unfinished_count()).await.is_ok() && self.workers.available()
    }

    async fn unfinished(&self) -> u64 {
        self.store(|s| s.unfinished_count()).await.unwrap_or(0)
    }

    async fn shutdown(&self) {
        self.workers.shutdown(self.shutdown_grace).await;
    }
}

/// Deletes the files of the jobs that ended more than `retention` ago; returns how many.
fn sweep(store: &Store, data_dir: &Path, retention: Duration) -> Result<usize, StoreError> {
    let cutoff = harvest_core::clock::UnixMillis(now().0 - retention.as_millis() as i64);
    let expired = store.expired_jobs(cutoff)?;
    for id in &expired {
        let root = JobPaths::new(data_dir, id).root;
        match std::fs::remove_dir_all(&root) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => {
                tracing::warn!(job = %id, %error, "could not delete an expired job's files");
                continue;
            }
        }
        store.mark_files_deleted(id, now())?;
    }
    // A reserve given up on a full disk comes back once there is room.
    store.refill_reserve();
    Ok(expired.len())
}

/// Writes prompts, directions and the resolved plan into the job's input folder.
fn write_inputs(paths: &JobPaths, model: &Path, submission: &Submission) -> std::io::Result<()> {
    let input = paths.input();
    std::fs::create_dir_all(&input)?;
    let prompts = input.join("prompts.jsonl");
    std::fs::write(&prompts, submission.inputs_jsonl())?;
    let project_onto = match &submission.directions {
        Some((n, values)) => {
            let path = input.join("directions.npy");
            std::fs::write(
                &path,
                harvest_core::npy::f32_matrix(*n, values.len() / n, values),
            )?;
            Some(Location::Local(path))
        }
        None => None,
    };
    let plan = ResolvedPlan {
        model: model.to_owned(),
        prompts: Location::Local(prompts),
        project_onto,
        output: Location::Local(paths.output()),
        batch_tokens: NonZeroUsize::new(DEFAULT_BATCH_TOKENS).unwrap_or(NonZeroUsize::MIN),
        options: submission.options.clone(),
    };
    std::fs::write(
        input.join("plan.json"),
        serde_json::to_vec_pretty(&plan.to_raw())?,
    )
}
