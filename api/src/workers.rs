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
                let _ = pool.store.apply(&id, JobEvent::Failed, outcome, now());
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
        let Some(job) = self.store.job(id)? else {
            return Ok(());
        };
        if job.status != JobStatus::Pending && job.status != JobStatus::Running {
            return Ok(());
        }
        if job.status == JobStatus::Pending {
            self.store
                .apply(id, JobEvent::Started, Outcome::default(), now())?;
            self.notify();
        }
        let paths = JobPaths::new(&self.config.data_dir, id);
        let termination = paths.root.join("termination.log");
        let mut command = Command::new(&self.config.harvester);
        command
            .arg("run")
            .arg("--plan")
            .arg(paths.input().join("plan.json"))
            .args(["--progress", "json", "--model-name", &job.model])
            .arg("--termination-log")
            .arg(&termination)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if let Some(threads) = self.config.threads {
            command.env("HARVEST_THREADS", threads.to_string());
        }
        let mut child = command.spawn()?;
        let (stop_tx, stop_rx) = oneshot::channel();
        self.running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(id.to_owned(), stop_tx);
        tracing::info!(job = %id, pid = child.id(), "worker started");
        let stderr = child.stderr.take();
        let store = Arc::clone(&self.store);
        let progress_id = id.to_owned();
        let reader = tokio::spawn(async move {
            let Some(stderr) = stderr else { return };
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(event) = ProgressEvent::parse_line(&line) {
                    let _ = store.set_progress(&progress_id, &Progress::from(&event));
                }
            }
        });
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
        if status.success() {
            let result = read_result(&paths)?;
            let tokens = result.tokens;
            self.store.apply(
                id,
                JobEvent::Succeeded { tokens },
                Outcome {
                    result: Some(result),
                    error: None,
                },
                now(),
            )?;
            tracing::info!(job = %id, tokens, "job done");
        } else {
            let message = match std::fs::read_to_string(&termination)
                .ok()
                .as_deref()
                .and_then(Termination::parse)
            {
                Some(Termination::Failed(failure)) => failure.error,
                _ => format!("the harvester exited with {status}"),
            };
            tracing::info!(job = %id, %status, "job failed");
            self.store.apply(
                id,
                JobEvent::Failed,
                Outcome {
                    result: None,
                    error: Some(message),
                },
                now(),
            )?;
        }
        Ok(())
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
