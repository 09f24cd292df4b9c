//! The one seam between the REST handlers and where jobs live: [`JobBackend`]. The embedded
//! backend (`embedded`: SQLite and harvester child processes) and the Kubernetes backend
//! (`kubernetes`: HarvestJobs run by the operator) each implement it; handlers never ask which
//! one they have.

use std::time::Instant;

use tokio::sync::watch;

use crate::catalogue::CatalogueModel;
use crate::error::ApiError;
use crate::store::JobRecord;
use crate::wire::{JobResult, Submission};

/// The authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The account the key belongs to.
    pub account: String,
    /// The key's hash (never the key).
    pub key_hash: String,
}

/// Where jobs live and run.
#[async_trait::async_trait]
pub trait JobBackend: Send + Sync + std::fmt::Debug {
    /// The caller a bearer key stands for, or `None` for an unknown or revoked key.
    async fn authenticate(&self, key: &str) -> Result<Option<Caller>, ApiError>;

    /// Stores the job's inputs and queues it under its account's quota. A denial is
    /// [`ApiError::Denied`]; nothing of a refused job is left behind.
    async fn submit(
        &self,
        job: &JobRecord,
        submission: &Submission,
        model: &CatalogueModel,
    ) -> Result<(), ApiError>;

    /// A job by id, whoever owns it (the handlers check ownership).
    async fn get(&self, id: &str) -> Result<Option<JobRecord>, ApiError>;

    /// A receiver that ticks whenever any job may have changed.
    fn changes(&self) -> watch::Receiver<u64>;

    /// Job `id` once it is terminal, or as it is at `deadline`.
    async fn wait(&self, id: &str, deadline: Instant) -> Result<Option<JobRecord>, ApiError> {
        let mut changes = self.changes();
        loop {
            let job = self.get(id).await?;
            let Some(current) = &job else { return Ok(job) };
            if current.status.is_terminal() {
                return Ok(job);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || tokio::time::timeout(left, changes.changed()).await.is_err() {
                return self.get(id).await;
            }
        }
    }

    /// Cancels a pending or running job and answers it as it then is.
    async fn cancel(&self, id: &str) -> Result<JobRecord, ApiError>;

    /// A done job's result, or `None` when its files are gone.
    async fn result(&self, job: &JobRecord) -> Result<Option<JobResult>, ApiError>;

    /// Links to `files` of job `id` that work until `expires` (Unix seconds).
    async fn links(
        &self,
        id: &str,
        files: &[String],
        expires: i64,
    ) -> Result<Vec<String>, ApiError>;

    /// Whether the backend can take jobs (store open, caches listed, worker present).
    async fn ready(&self) -> bool;

    /// Jobs pending or running.
    async fn unfinished(&self) -> u64;
}
