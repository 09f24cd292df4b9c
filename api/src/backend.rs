//! The one seam between the REST handlers and where jobs live: [`JobBackend`]. The embedded
//! backend (`embedded`: SQLite and harvester child processes) and the Kubernetes backend
//! (`kubernetes`: HarvestJobs run by the operator) each implement it; handlers never ask which
//! one they have.

use tokio::sync::watch;
use tokio::time::Instant;

use crate::catalogue::CatalogueModel;
use crate::error::ApiError;
use crate::job::JobRecord;
use crate::listing::{JobFilter, JobPage, Usage};
use crate::wire::{JobResult, Submission};
use harvest_core::lifecycle::JobStatus;

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

    /// A page of `account`'s jobs, newest first (`GET /v1/harvest`).
    async fn list(&self, account: &str, filter: &JobFilter) -> Result<JobPage, ApiError>;

    /// The caller's account: its lanes, budgets and storage against their limits.
    async fn usage(&self, caller: &Caller) -> Result<Usage, ApiError>;

    /// Tokens per second of `model`'s most recent done job, start to end, if any ran.
    async fn throughput(&self, _model: &str) -> Result<Option<f64>, ApiError> {
        Ok(None)
    }

    /// A receiver that ticks whenever any job may have changed.
    fn changes(&self) -> watch::Receiver<u64>;

    /// Job `id` once its status is no longer `seen` (what the caller last saw), or as it is
    /// at `deadline`.
    async fn wait(
        &self,
        id: &str,
        seen: JobStatus,
        deadline: Instant,
    ) -> Result<Option<JobRecord>, ApiError> {
        let mut changes = self.changes();
        loop {
            let job = self.get(id).await?;
            let Some(current) = &job else { return Ok(job) };
            if current.status != seen || current.status.is_terminal() {
                return Ok(job);
            }
            if tokio::time::timeout_at(deadline, changes.changed())
                .await
                .is_err()
            {
                return self.get(id).await;
            }
        }
    }

    /// Cancels a pending or running job and answers it as it then is.
    async fn cancel(&self, id: &str) -> Result<JobRecord, ApiError>;

    /// A done job's result, or `None` when its files are gone.
    async fn result(&self, job: &JobRecord) -> Result<Option<JobResult>, ApiError>;

    /// Where job outputs are stored: what a running job has ready is read from there.
    fn outputs(&self) -> crate::storage::Storage;

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

    /// Stops what the backend runs in this process, for a server that is exiting.
    async fn shutdown(&self) {}

    /// Where the server-wide limits are shared with other replicas; `None` when this process
    /// is the only server, and its own counters are the whole truth.
    fn shared_limits(&self) -> Option<std::sync::Arc<dyn crate::permits::SharedLimits>> {
        None
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use harvest_core::lifecycle::JobStatus;

    use super::*;

    /// One job whose status the test sets; only what `wait` uses is implemented.
    #[derive(Debug)]
    struct OneJob {
        job: Mutex<JobRecord>,
        changes: watch::Sender<u64>,
    }

    impl OneJob {
        fn new(status: JobStatus) -> Self {
            let job = JobRecord {
                id: "j".into(),
                run_id: "r".into(),
                account: "a".into(),
                key_hash: "k".into(),
                model: "m".into(),
                status,
                n_prompts: 1,
                reserved: 2,
                tokens: None,
                created_at: harvest_core::clock::UnixMillis(0),
                started_at: None,
                completed_at: None,
                result: None,
                error: None,
                progress: None,
                spec: crate::job::JobSpec {
                    options: harvest_core::JobOptions {
                        layers: vec![0].into(),
                        shard_size: std::num::NonZeroUsize::new(1).unwrap(),
                        ..Default::default()
                    },
                    has_directions: false,
                    lane: harvest_core::quota::Lane::Small,
                    estimated_bytes: 0,
                    estimated_ms: None,
                    parallelism: 1,
                },
            };
            Self {
                job: Mutex::new(job),
                changes: watch::channel(0).0,
            }
        }

        fn set(&self, status: JobStatus) {
            self.job.lock().unwrap().status = status;
            self.changes.send_modify(|n| *n += 1);
        }
    }

    #[async_trait::async_trait]
    impl JobBackend for OneJob {
        async fn authenticate(&self, _: &str) -> Result<Option<Caller>, ApiError> {
            Ok(None)
        }
        async fn submit(
            &self,
            _: &JobRecord,
            _: &Submission,
            _: &CatalogueModel,
        ) -> Result<(), ApiError> {
            Ok(())
        }
        async fn get(&self, _: &str) -> Result<Option<JobRecord>, ApiError> {
            Ok(Some(self.job.lock().unwrap().clone()))
        }
        async fn list(&self, _: &str, _: &JobFilter) -> Result<JobPage, ApiError> {
            Err(ApiError::NotFound)
        }
        async fn usage(&self, _: &Caller) -> Result<Usage, ApiError> {
            Err(ApiError::NotFound)
        }
        fn changes(&self) -> watch::Receiver<u64> {
            self.changes.subscribe()
        }
        async fn cancel(&self, _: &str) -> Result<JobRecord, ApiError> {
            Err(ApiError::NotFound)
        }
        async fn result(&self, _: &JobRecord) -> Result<Option<JobResult>, ApiError> {
            Ok(None)
        }
        fn outputs(&self) -> crate::storage::Storage {
            crate::storage::Storage::Local {
                root: std::path::PathBuf::new(),
            }
        }
        async fn links(&self, _: &str, _: &[String], _: i64) -> Result<Vec<String>, ApiError> {
            Ok(Vec::new())
        }
        async fn ready(&self) -> bool {
            true
        }
        async fn unfinished(&self) -> u64 {
            1
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_on_a_job_that_never_changes_answers_it_as_it_is_at_the_deadline() {
        let backend = OneJob::new(JobStatus::Running);
        let start = Instant::now();
        let job = backend
            .wait("j", JobStatus::Running, start + Duration::from_secs(60))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(job.status, JobStatus::Running);
        assert_eq!(start.elapsed(), Duration::from_secs(60));
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_ends_when_the_status_changes_and_not_on_a_change_that_leaves_it() {
        let backend = std::sync::Arc::new(OneJob::new(JobStatus::Pending));
        let changer = std::sync::Arc::clone(&backend);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            changer.set(JobStatus::Pending);
            tokio::time::sleep(Duration::from_secs(1)).await;
            changer.set(JobStatus::Running);
            tokio::time::sleep(Duration::from_secs(3)).await;
            changer.set(JobStatus::Done);
        });
        let start = Instant::now();
        let deadline = start + Duration::from_secs(60);
        let job = backend.wait("j", JobStatus::Pending, deadline).await;
        assert_eq!(job.unwrap().unwrap().status, JobStatus::Running);
        assert_eq!(start.elapsed(), Duration::from_secs(2));
        let job = backend.wait("j", JobStatus::Running, deadline).await;
        assert_eq!(job.unwrap().unwrap().status, JobStatus::Done);
        assert_eq!(start.elapsed(), Duration::from_secs(5));
        // A caller that saw an older status is answered at once.
        let job = backend.wait("j", JobStatus::Pending, deadline).await;
        assert_eq!(job.unwrap().unwrap().status, JobStatus::Done);
        assert_eq!(start.elapsed(), Duration::from_secs(5));
    }
}
