//! Embedded workers: each job runs as a `harvester run` child process, at most `max_workers` at
//! once machine-wide. The worker reads the harvester's JSON progress lines, and on exit applies
//! the job's ending through the store (and so through the core lifecycle and quota rules).
//! Cancel terminates the process (SIGTERM, then SIGKILL after a grace period).

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use harvest_core::lifecycle::{JobEvent, JobStatus};
use harvest_core::worker::{ProgressEvent, RESULT_FILE, RunResult, Termination};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;
use tokio::sync::{Semaphore, oneshot, watch};

use crate::paths::{JobPaths, now};
use crate::store::{Outcome, Store};
use crate::wire::{JobResult, Progress};

/// Why a worker could not run its job.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    /// Spawning or reading the harvester failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// A store call on a blocking thread was lost.
    #[error("a store call was lost: {0}")]
    Lost(#[from] tokio::task::JoinError),
    /// The harvester's result.json is unreadable.
    #[error("result.json: {0}")]
    Result(#[from] serde_json::Error),
}

/// How long a cancelled worker has to exit after SIGTERM before it is killed.
pub const CANCEL_GRACE: Duration = Duration::from_secs(5);

/// Settings of the worker pool.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// The harvester binary.
    pub harvester: PathBuf,
    /// The data directory.
    pub data_dir: PathBuf,
    /// Threads per harvester (None: all cores).
    pub threads: Option<usize>,
}

/// The worker pool.
#[derive(Debug)]
pub struct Workers {
    store: Arc<Store>,
    config: WorkerConfig,
    slots: Arc<Semaphore>,
    running: Mutex<HashMap<String, oneshot::Sender<()>>>,
    changes: watch::Sender<u64>,
}

impl Workers {
    /// A pool running at most `max_workers` harvesters at once.
    pub fn new(store: Arc<Store>, config: WorkerConfig, max_workers: usize) -> Arc<Self> {
        let (changes, _) = watch::channel(0);
        Arc::new(Self {
            store,
            config,
            slots: Arc::new(Semaphore::new(max_workers)),
            running: Mutex::default(),
            changes,
        })
    }

    /// A receiver that ticks whenever any job changes (for long-polls).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Signals a job change to long-polls.
    pub fn notify(&self) {
        self.changes.send_modify(|n| *n += 1);
    }

    /// Whether the harvester binary is present.
    pub fn available(&self) -> bool {
        self.config.harvester.is_file()
    }

    /// Stops harvesters that a previous server process left running for job `id` (a server that
    /// was killed cannot stop its children), so a requeued job never runs twice at once. Linux
    /// only: it scans /proc for the job's plan path.
    pub fn stop_orphans(&self, id: &str) {
        let plan = JobPaths::new(&self.config.data_dir, id)
            .input()
            .join("plan.json");
        let plan = plan.to_string_lossy().into_owned();
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return;
        };
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<i32>().ok())
            else {
                continue;
            };
            let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
                continue;
            };
            let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
            if args.contains(&plan.as_bytes()) && args.iter().any(|a| *a == b"run") {
                tracing::warn!(job = %id, pid, "stopping a harvester left by a previous server");
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
    }

    /// Queues job `id`; it starts when a slot is free and if it is still pending then.
    pub fn enqueue(self: &Arc<Self>, id: String) {
        let pool = Arc::clone(self);
        tokio::spawn(async move {
            let Ok(_permit) = Arc::clone(&pool.slots).acquire_owned().await else {
                return;
            };
            if let Err(error) = pool.run(&id).await {
                tracing::error!(job = %id, %error, "worker failed");
                let outcome = Outcome {
                    result: None,
                    error: Some(format!("worker error: {error}")),
                };
                let failed = id.clone();
                let _ = pool
                    .store_call(move |s| s.apply(&failed, JobEvent::Failed, outcome, now()))
                    .await;
            }
            pool.notify();
        });
    }

    /// Stops the worker of job `id`, if one is running.
    pub fn cancel(&self, id: &str) {
        if let Some(stop) = self
            .running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(id)
        {
            let _ = stop.send(());
        }
    }

    async fn run(&self, id: &str) -> Result<(), WorkerError> {
        let owned = id.to_owned();
        let Some(job) = self.store_call(move |s| s.job(&owned)).await? else {
            return Ok(());
        };
        if job.status != JobStatus::Pending && job.status != JobStatus::Running {
            return Ok(());
        }
        if job.status == JobStatus::Pending {
            let owned = id.to_owned();
            self.store_call(move |s| s.apply(&owned, JobEvent::Started, Outcome::default(), now()))
                .await?;
            self.notify();
        }
        let paths = JobPaths::new(&self.config.data_dir, id);
        let mut child = self.command(&job.model, &paths).spawn()?;
        let (stop_tx, stop_rx) = oneshot::channel();
        self.running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(id.to_owned(), stop_tx);
        tracing::info!(job = %id, pid = child.id(), "worker started");
        let reader = tokio::spawn(read_progress(
            child.stderr.take(),
            Arc::clone(&self.store),
            id.to_owned(),
        ));
        let status = tokio::select! {
            status = child.wait() => Some(status?),
            _ = stop_rx => None,
        };
        self.running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(id);
        let Some(status) = status else {
            terminate(&mut child).await;
            reader.abort();
            tracing::info!(job = %id, "worker stopped on cancel");
            return Ok(());
        };
        let _ = reader.await;
        self.finish(id, &paths, status).await
    }

    /// The `harvester run` of a job, its progress on stderr as JSON lines.
    fn command(&self, model: &str, paths: &JobPaths) -> Command {
        let mut command = Command::new(&self.config.harvester);
        command
            .arg("run")
            .arg("--plan")
            .arg(paths.input().join("plan.json"))
            .args(["--progress", "json", "--model-name", model])
            .arg("--termination-log")
            .arg(termination_log(paths))
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if let Some(threads) = self.config.threads {
            command.env("HARVEST_THREADS", threads.to_string());
        }
        command
    }

    /// Records how the harvester ended: done with its result, or failed with its message.
    async fn finish(
        &self,
        id: &str,
        paths: &JobPaths,
        status: std::process::ExitStatus,
    ) -> Result<(), WorkerError> {
        let (event, outcome) = if status.success() {
            let result = read_result(paths)?;
            tracing::info!(job = %id, tokens = result.tokens, "job done");
            let event = JobEvent::Succeeded {
                tokens: result.tokens,
            };
            (
                event,
                Outcome {
                    result: Some(result),
                    error: None,
                },
            )
        } else {
            let message = match std::fs::read_to_string(termination_log(paths))
                .ok()
                .as_deref()
                .and_then(Termination::parse)
            {
                Some(Termination::Failed(failure)) => failure.error,
                _ => format!("the harvester exited with {status}"),
            };
            tracing::info!(job = %id, %status, "job failed");
            (
                JobEvent::Failed,
                Outcome {
                    result: None,
                    error: Some(message),
                },
            )
        };
        let owned = id.to_owned();
        self.store_call(move |s| s.apply(&owned, event, outcome, now()))
            .await?;
        Ok(())
    }

    /// Runs a store call on a blocking thread, off the async workers.
    async fn store_call<T: Send + 'static>(
        &self,
        call: impl FnOnce(&Store) -> Result<T, crate::store::StoreError> + Send + 'static,
    ) -> Result<T, WorkerError> {
        let store = Arc::clone(&self.store);
        Ok(tokio::task::spawn_blocking(move || call(&store)).await??)
    }
}

/// Where a job's harvester writes its termination message.
fn termination_log(paths: &JobPaths) -> PathBuf {
    paths.root.join("termination.log")
}

/// Records each progress line of a harvester's stderr in the store.
async fn read_progress(stderr: Option<tokio::process::ChildStderr>, store: Arc<Store>, id: String) {
    let Some(stderr) = stderr else { return };
    let mut lines = BufReader::new(stderr).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if let Some(event) = ProgressEvent::parse_line(&line) {
            let (store, id) = (Arc::clone(&store), id.clone());
            let progress = Progress::from(&event);
            let _ = tokio::task::spawn_blocking(move || store.set_progress(&id, &progress)).await;
        }
    }
}

/// SIGTERM, then SIGKILL after [`CANCEL_GRACE`].
async fn terminate(child: &mut tokio::process::Child) {
    if let Some(pid) = child.id() {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        if tokio::time::timeout(CANCEL_GRACE, child.wait())
            .await
            .is_ok()
        {
            return;
        }
    }
    let _ = child.kill().await;
}

fn read_result(paths: &JobPaths) -> Result<JobResult, WorkerError> {
    let text = std::fs::read_to_string(paths.output().join(RESULT_FILE))?;
    let run: RunResult = serde_json::from_str(&text)?;
    Ok(JobResult::from_run(&run))
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_worker_that_ignores_sigterm_is_killed_after_the_grace_period() {
        let mut child = Command::new("sh")
            .args(["-c", "trap '' TERM; sleep 30"])
            .spawn()
            .unwrap();
        // Let the shell install its trap before the signal comes.
        std::thread::sleep(Duration::from_millis(200));
        let start = tokio::time::Instant::now();
        terminate(&mut child).await;
        let status = child.wait().await.unwrap();
        assert_eq!(status.signal(), Some(9), "{status:?}");
        assert_eq!(start.elapsed(), CANCEL_GRACE);
    }
}
