//! Embedded workers: each job runs as a `harvester run` child process, at most `max_workers` at
//! once machine-wide. The worker reads the harvester's JSON progress lines, and on exit applies
//! the job's ending through the store (and so through the core lifecycle and quota rules).
//!
//! - Cancel and shutdown terminate the process (SIGTERM, then SIGKILL after a grace period).
//!   A stop handle is registered before the job is marked started, so no cancel is lost.
//! - A harvester killed by a signal (the OOM killer, say) or ending with an infrastructure
//!   failure (exit 3) is run again, up to `attempts`; it resumes from its shards, and the job is
//!   charged what its result says ran, once.
//! - A job past its deadline is stopped and fails with a message naming the deadline.
//! - The final store write is retried; if it still fails the job is queued again, so it is never
//!   left running without a worker.
//! - Children get a clean environment: only [`PASSED_ENV`] of the server's.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use harvest_core::invocation::{Invocation, PlanArg, Task};
use harvest_core::lifecycle::{JobEvent, JobStatus};
use harvest_core::worker::{Blame, ProgressEvent, RESULT_FILE, RunResult, Termination};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;
use tokio::sync::{Semaphore, oneshot, watch};

use crate::embedded::gpus::GpuPool;
use crate::embedded::store::{Outcome, Store};
use crate::paths::{JobPaths, now};
use crate::wire::{JobResult, Progress};

/// Why a worker could not run its job.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] crate::embedded::store::StoreError),
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
/// The server's environment variables a harvester child gets; nothing else (no credentials,
/// no configuration of the server's own) reaches it.
pub const PASSED_ENV: [&str; 16] = [
    "PATH",
    "LD_LIBRARY_PATH",
    "TMPDIR",
    "CUDA_VISIBLE_DEVICES",
    "LANG",
    // Where the harvester finds cuBLAS and NVRTC (its library search), and keeps its compiled
    // kernels between starts.
    "HARVEST_CUDA_LIBRARY_PATH",
    "HARVEST_CUDA_MAJOR",
    "HARVEST_KERNEL_CACHE",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
    "CUDA_HOME",
    "HOME",
    "XDG_CACHE_HOME",
    // Let a model of several devices run its CUDA stages, and AFMoE and the f32 mode run on a
    // GPU, before a GPU window checks them.
    "HARVEST_CUDA_STAGES",
    "HARVEST_CUDA_AFMOE",
    "HARVEST_CUDA_F32",
];
/// Tries of the final store write before the job is queued again.
const FINAL_WRITE_TRIES: u32 = 5;

/// Settings of the worker pool.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// The harvester binary.
    pub harvester: PathBuf,
    /// The data directory.
    pub data_dir: PathBuf,
    /// Threads per harvester (None: all cores).
    pub threads: Option<usize>,
    /// Longest a job may run, over all its attempts (None: no limit).
    pub deadline: Option<Duration>,
    /// Runs of a job's harvester, the first included, when it dies of a signal or an
    /// infrastructure failure.
    pub attempts: u32,
    /// The GPUs (CUDA ordinals) harvesters run on, one each while they run (none: the CPU).
    pub gpus: Vec<u32>,
    /// GPUs one harvester of a model spans, by model name (its `devices` above 1): it runs
    /// as that many pipeline stages, one a GPU. Models not named take one.
    pub stages: BTreeMap<String, usize>,
}

/// Why a harvester is stopped from outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// The job was cancelled: the store already says so.
    Cancel,
    /// The server is stopping: the job stays running in the store, and the next start resumes it.
    Shutdown,
}

/// The worker pool.
#[derive(Debug)]
pub struct Workers {
    store: Arc<Store>,
    config: WorkerConfig,
    slots: Arc<Semaphore>,
    gpus: Arc<GpuPool>,
    running: Mutex<HashMap<String, oneshot::Sender<Stop>>>,
    stopping: std::sync::atomic::AtomicBool,
    capacity: usize,
    changes: watch::Sender<u64>,
}

/// How one attempt of a harvester ended.
enum Ended {
    /// It exited, with the last line it logged that was not progress.
    Exited(std::process::ExitStatus, Option<String>),
    Stopped(Stop),
    PastDeadline,
}

impl Workers {
    /// A pool running at most `max_workers` harvesters at once.
    pub fn new(store: Arc<Store>, config: WorkerConfig, max_workers: usize) -> Arc<Self> {
        let (changes, _) = watch::channel(0);
        Arc::new(Self {
            store,
            slots: Arc::new(Semaphore::new(max_workers)),
            gpus: GpuPool::new(&config.gpus),
            running: Mutex::default(),
            stopping: std::sync::atomic::AtomicBool::new(false),
            capacity: max_workers,
            changes,
            config,
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
            let Ok(permit) = Arc::clone(&pool.slots).acquire_owned().await else {
                return;
            };
            if pool.is_stopping() {
                drop(permit);
                pool.notify();
                return;
            }
            match pool.run(&id).await {
                Ok(()) => {}
                // The store is what failed: try the job again later, from its shards.
                Err(WorkerError::Store(error)) => {
                    tracing::error!(job = %id, %error, "could not record the job; queueing it again");
                    let again = Arc::clone(&pool);
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_secs(5)).await;
                        again.enqueue(id);
                    });
                }
                Err(error) => {
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
            }
            drop(permit);
            pool.notify();
        });
    }

    /// Stops the worker of job `id`, if one is running (or about to start the job).
    pub fn cancel(&self, id: &str) {
        self.stop(id, Stop::Cancel);
    }

    fn stop(&self, id: &str, why: Stop) {
        if let Some(stop) = self
            .running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(id)
        {
            let _ = stop.send(why);
        }
    }

    fn is_stopping(&self) -> bool {
        self.stopping.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Stops every harvester (their jobs stay running in the store, and resume at the next
    /// start) and waits up to `grace` for the workers to exit; queued jobs do not start.
    pub async fn shutdown(&self, grace: Duration) {
        self.stopping
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let ids: Vec<String> = self
            .running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .keys()
            .cloned()
            .collect();
        for id in &ids {
            self.stop(id, Stop::Shutdown);
        }
        let deadline = tokio::time::Instant::now() + grace;
        let mut changes = self.subscribe();
        while self.slots.available_permits() < self.capacity()
            && tokio::time::timeout_at(deadline, changes.changed())
                .await
                .is_ok_and(|r| r.is_ok())
        {}
    }

    fn capacity(&self) -> usize {
        // Every permit a worker holds is back once its task has ended.
        self.capacity
    }

    async fn run(&self, id: &str) -> Result<(), WorkerError> {
        // Registered before the job is marked started, so a cancel from here on reaches us.
        let (stop_tx, mut stop_rx) = oneshot::channel();
        self.running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(id.to_owned(), stop_tx);
        let outcome = self.attempts(id, &mut stop_rx).await;
        self.running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(id);
        outcome
    }

    /// Marks the job started and runs its harvester, again after a signal or an infrastructure
    /// failure, until it ends, is stopped, or passes its deadline.
    async fn attempts(
        &self,
        id: &str,
        stop_rx: &mut oneshot::Receiver<Stop>,
    ) -> Result<(), WorkerError> {
        let owned = id.to_owned();
        let Some(job) = self.store_call(move |s| s.job(&owned)).await? else {
            return Ok(());
        };
        match job.status {
            JobStatus::Pending => {
                let owned = id.to_owned();
                let started = self
                    .store_call(move |s| {
                        s.apply(&owned, JobEvent::Started, Outcome::default(), now())
                    })
                    .await;
                if let Err(WorkerError::Store(crate::embedded::store::StoreError::Lifecycle(_))) =
                    started
                {
                    // Cancelled while it waited for its slot.
                    return Ok(());
                }
                started?;
                self.notify();
            }
            JobStatus::Running => {}
            JobStatus::Done | JobStatus::Failed | JobStatus::Cancelled => return Ok(()),
        }
        let paths = JobPaths::new(&self.config.data_dir, id);
        let deadline = self
            .config
            .deadline
            .map(|d| tokio::time::Instant::now() + d);
        for attempt in 1..=self.config.attempts.max(1) {
            let parts = job.spec.parallelism;
            match self
                .attempt(id, (&job.model, parts), &paths, stop_rx, deadline)
                .await?
            {
                Ended::Exited(status, _) if retryable(status) && attempt < self.config.attempts => {
                    tracing::warn!(job = %id, attempt, %status, "the harvester died; running it again, resuming");
                }
                Ended::Exited(status, last_line) => {
                    return self.finish(id, &paths, status, last_line).await;
                }
                Ended::Stopped(Stop::Cancel) => {
                    tracing::info!(job = %id, "worker stopped on cancel");
                    return Ok(());
                }
                Ended::Stopped(Stop::Shutdown) => {
                    tracing::info!(job = %id, "worker stopped for shutdown; the next start resumes it");
                    return Ok(());
                }
                Ended::PastDeadline => return self.past_deadline(id).await,
            }
        }
        Ok(())
    }

    /// One run of the job: its harvester, or with `parts` above 1 that many harvesters on
    /// their shares of the shards and then `harvester finalize`.
    async fn attempt(
        &self,
        id: &str,
        (model, parts): (&str, usize),
        paths: &JobPaths,
        stop_rx: &mut oneshot::Receiver<Stop>,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<Ended, WorkerError> {
        // A termination log left by an earlier run would describe that run instead.
        let _ = std::fs::remove_file(termination_log(paths));
        if parts <= 1 {
            return self
                .supervise(id, model, paths, &[Role::Whole], stop_rx, deadline)
                .await;
        }
        let roles: Vec<Role> = (0..parts).map(|i| Role::Part(i, parts)).collect();
        match self
            .supervise(id, model, paths, &roles, stop_rx, deadline)
            .await?
        {
            Ended::Exited(status, _) if status.success() => {
                self.supervise(id, model, paths, &[Role::Finalize], stop_rx, deadline)
                    .await
            }
            other => Ok(other),
        }
    }

    /// Runs one harvester per role at once until all have exited (the first failure, or the
    /// last success, is the ending), the job is stopped, or its deadline passes.
    async fn supervise(
        &self,
        id: &str,
        model: &str,
        paths: &JobPaths,
        roles: &[Role],
        stop_rx: &mut oneshot::Receiver<Stop>,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<Ended, WorkerError> {
        // Finalize only merges records: it takes no GPU.
        let stages = self.config.stages.get(model).copied().unwrap_or(1).max(1);
        let lease = match roles {
            [Role::Finalize] => None,
            _ => tokio::select! {
                lease = self.gpus.lease(roles.len() * stages) => lease,
                why = &mut *stop_rx => return Ok(Ended::Stopped(why.unwrap_or(Stop::Shutdown))),
            },
        };
        let tally = Arc::new(Tally::new(roles.len()));
        let (mut children, mut readers) = (Vec::new(), Vec::new());
        for (slot, role) in roles.iter().enumerate() {
            let device = lease.as_ref().map(|l| l.devices_for(slot, stages));
            let mut child = self
                .command(model, paths, *role, (roles.len(), device))
                .spawn()?;
            tracing::info!(job = %id, pid = child.id(), role = %role, "worker started");
            let (store, id, tally) = (Arc::clone(&self.store), id.to_owned(), Arc::clone(&tally));
            readers.push(tokio::spawn(read_progress(
                child.stderr.take(),
                (store, id),
                (tally, slot),
            )));
            children.push(child);
        }
        let past_deadline = async {
            match deadline {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let ended = tokio::select! {
            statuses = wait_all(&mut children) => Some(statuses?),
            // A dropped sender means the pool is gone: stop as for a shutdown.
            why = &mut *stop_rx => return Ok(self.stop_all(&mut children, readers, Ended::Stopped(why.unwrap_or(Stop::Shutdown))).await),
            () = past_deadline => None,
        };
        let Some(statuses) = ended else {
            return Ok(self
                .stop_all(&mut children, readers, Ended::PastDeadline)
                .await);
        };
        let failed = statuses.iter().position(|s| !s.success());
        let slot = failed.unwrap_or(statuses.len() - 1);
        let mut last_lines = Vec::with_capacity(readers.len());
        for reader in readers {
            last_lines.push(reader.await.ok().flatten());
        }
        let words = roles[slot]
            .failure(paths)
            .or_else(|| last_lines.swap_remove(slot));
        Ok(Ended::Exited(statuses[slot], words))
    }

    /// Terminates every child of a stopped attempt and ends it as `ended`.
    async fn stop_all(
        &self,
        children: &mut [tokio::process::Child],
        readers: Vec<tokio::task::JoinHandle<Option<String>>>,
        ended: Ended,
    ) -> Ended {
        for child in children.iter_mut() {
            terminate(child).await;
        }
        for reader in readers {
            reader.abort();
        }
        ended
    }

    /// Fails a job that ran past its deadline.
    async fn past_deadline(&self, id: &str) -> Result<(), WorkerError> {
        let seconds = self.config.deadline.map_or(0, |d| d.as_secs());
        tracing::warn!(job = %id, seconds, "the job ran past its deadline; stopped");
        let outcome = Outcome {
            result: None,
            error: Some(format!(
                "the job ran past the server's job_timeout_seconds ({seconds} s) and was stopped: split the corpus, or ask the operator for a longer deadline"
            )),
        };
        self.record(id, JobEvent::Failed, outcome).await
    }

    /// The harvester of one role of a job, its progress on stderr as JSON lines; `of` is how
    /// many run at once, which share the threads, and `devices` its GPUs (none: the default;
    /// several: one pipeline stage each).
    fn command(
        &self,
        model: &str,
        paths: &JobPaths,
        role: Role,
        (of, devices): (usize, Option<Vec<u32>>),
    ) -> Command {
        let task = match role {
            Role::Whole => Task::Run,
            Role::Part(index, count) => Task::Part { index, count },
            Role::Finalize => Task::Finalize,
        };
        let device = if let Some(&[first, ..]) = devices.as_deref() {
            format!("cuda:{first}")
        } else if let (Role::Finalize, Some(first)) = (role, self.config.gpus.first()) {
            // Finalize takes no GPU, but its device says what arithmetic the parts ran in (a
            // job that names no precision runs bf16 on a GPU), so its fingerprint is theirs.
            format!("cuda:{first}")
        } else {
            // A server without GPUs keeps its workers on the CPU even where `auto` would find
            // one (`worker_gpus: []`).
            "cpu".to_owned()
        };
        let stages = devices.filter(|gpus| gpus.len() > 1);
        let invocation = Invocation {
            plan: Some(PlanArg::File(
                paths.input().join("plan.json").display().to_string(),
            )),
            device: Some(device),
            pipeline_stages: stages.as_ref().map(Vec::len),
            stage_devices: stages,
            model_name: Some(model.to_owned()),
            termination_log: Some(role.termination_log(paths).display().to_string()),
            progress_json: true,
            ..Invocation::new(task)
        };
        let mut command = Command::new(&self.config.harvester);
        command
            .args(invocation.to_args())
            .env_clear()
            .envs(
                PASSED_ENV
                    .iter()
                    .filter_map(|name| Some((name, std::env::var_os(name)?))),
            )
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let threads = self.config.threads.or_else(|| {
            // Parts share the machine's cores.
            (of > 1).then(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        });
        if let Some(threads) = threads {
            command.env("HARVEST_THREADS", (threads / of).max(1).to_string());
        }
        command
    }

    /// Records how the harvester ended: done with its result, or failed with its message.
    async fn finish(
        &self,
        id: &str,
        paths: &JobPaths,
        status: std::process::ExitStatus,
        last_line: Option<String>,
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
                // No termination log (a full disk cannot take one): its last words instead.
                _ => match last_line {
                    Some(line) => {
                        format!("the harvester exited with {status}: {}", log_message(&line))
                    }
                    None => format!("the harvester exited with {status}"),
                },
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
        self.record(id, event, outcome).await
    }

    /// Applies a job's ending, retrying a failed write with backoff (a busy or full disk may
    /// pass); a cancel that won the race leaves nothing to record.
    async fn record(&self, id: &str, event: JobEvent, outcome: Outcome) -> Result<(), WorkerError> {
        let mut wait = Duration::from_millis(100);
        for attempt in 1..=FINAL_WRITE_TRIES {
            let (owned, outcome) = (id.to_owned(), outcome.clone());
            match self
                .store_call(move |s| s.apply(&owned, event, outcome, now()))
                .await
            {
                Ok(_)
                | Err(WorkerError::Store(crate::embedded::store::StoreError::Lifecycle(_))) => {
                    return Ok(());
                }
                Err(error) if attempt == FINAL_WRITE_TRIES => return Err(error),
                Err(error) => {
                    tracing::warn!(job = %id, %error, attempt, "recording the job failed; retrying");
                    tokio::time::sleep(wait).await;
                    wait *= 2;
                }
            }
        }
        Ok(())
    }

    /// Runs a store call on a blocking thread, off the async workers.
    async fn store_call<T: Send + 'static>(
        &self,
        call: impl FnOnce(&Store) -> Result<T, crate::embedded::store::StoreError> + Send + 'static,
    ) -> Result<T, WorkerError> {
        let store = Arc::clone(&self.store);
        Ok(tokio::task::spawn_blocking(move || call(&store)).await??)
    }
}

/// What one harvester of a job does.
#[derive(Debug, Clone, Copy)]
enum Role {
    /// The whole job.
    Whole,
    /// Part `index` of `count`.
    Part(usize, usize),
    /// Closing a job run in parts.
    Finalize,
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Whole => write!(f, "whole"),
            Self::Part(index, count) => write!(f, "part {index}/{count}"),
            Self::Finalize => write!(f, "finalize"),
        }
    }
}

impl Role {
    /// Where it writes its termination message: the job's, or for a part its own.
    fn termination_log(self, paths: &JobPaths) -> PathBuf {
        match self {
            Self::Part(index, _) => paths.root.join(format!("termination-part-{index}.log")),
            Self::Whole | Self::Finalize => termination_log(paths),
        }
    }

    /// A failed part's own words, from its termination message (the job's termination log is
    /// then absent, and the job's failure reads them).
    fn failure(self, paths: &JobPaths) -> Option<String> {
        let Self::Part(..) = self else { return None };
        let text = std::fs::read_to_string(self.termination_log(paths)).ok()?;
        match Termination::parse(&text)? {
            Termination::Failed(failure) => Some(format!("{self}: {}", failure.error)),
            _ => None,
        }
    }
}

/// The latest progress of each harvester of a job, summed into the job's.
#[derive(Debug)]
struct Tally(Mutex<Vec<Option<Progress>>>);

impl Tally {
    fn new(harvesters: usize) -> Self {
        Self(Mutex::new(vec![None; harvesters]))
    }

    /// Records harvester `slot`'s progress; returns the job's: loading while any loads.
    fn record(&self, slot: usize, progress: Progress) -> Progress {
        let mut all = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(entry) = all.get_mut(slot) {
            *entry = Some(progress);
        }
        let known: Vec<&Progress> = all.iter().flatten().collect();
        let loading = known.iter().any(|p| p.phase == "loading");
        let bytes = |f: fn(&Progress) -> Option<u64>| {
            loading.then(|| known.iter().filter_map(|p| f(p)).sum())
        };
        Progress {
            phase: if loading { "loading" } else { "running" }.to_owned(),
            bytes_loaded: bytes(|p| p.bytes_loaded),
            bytes_total: bytes(|p| p.bytes_total),
            prompts_done: known.iter().map(|p| p.prompts_done).sum(),
            prompts_total: known.iter().map(|p| p.prompts_total).sum(),
            tokens_done: known.iter().map(|p| p.tokens_done).sum(),
        }
    }
}

/// Waits for every child to exit, in order.
async fn wait_all(
    children: &mut [tokio::process::Child],
) -> std::io::Result<Vec<std::process::ExitStatus>> {
    let mut statuses = Vec::with_capacity(children.len());
    for child in children.iter_mut() {
        statuses.push(child.wait().await?);
    }
    Ok(statuses)
}

/// Where a job's harvester writes its termination message.
fn termination_log(paths: &JobPaths) -> PathBuf {
    paths.root.join("termination.log")
}

/// The message of a log line as tracing writes it (`<time> <LEVEL> <target>: <message>`), or
/// the whole line.
fn log_message(line: &str) -> &str {
    const LEVELS: [&str; 5] = ["ERROR", "WARN", "INFO", "DEBUG", "TRACE"];
    let Some((_time, rest)) = line.trim().split_once(' ') else {
        return line;
    };
    match rest.trim_start().split_once(' ') {
        Some((level, rest)) if LEVELS.contains(&level) => {
            rest.split_once(": ").map_or(rest, |(_, message)| message)
        }
        _ => line,
    }
}

/// Longest last log line kept for a failure message.
const LAST_LINE_CHARS: usize = 1000;

/// Records each progress line of a harvester's stderr in the store, summed over the job's
/// harvesters (`slot` of the tally); returns the last other line (its final error, when it
/// could not write a termination log).
async fn read_progress(
    stderr: Option<tokio::process::ChildStderr>,
    (store, id): (Arc<Store>, String),
    (tally, slot): (Arc<Tally>, usize),
) -> Option<String> {
    let mut lines = BufReader::new(stderr?).lines();
    let mut last = None;
    while let Ok(Some(line)) = lines.next_line().await {
        if let Some(event) = ProgressEvent::parse_line(&line) {
            let (store, id) = (Arc::clone(&store), id.clone());
            let progress = tally.record(slot, Progress::from(&event));
            let _ = tokio::task::spawn_blocking(move || store.set_progress(&id, &progress)).await;
        } else if !line.trim().is_empty() {
            last = Some(line.chars().take(LAST_LINE_CHARS).collect());
        }
    }
    last
}

/// Whether a harvester's ending is worth another run, by the rule the operator retries by too
/// ([`Blame`]): anything but refused input (a kill, a crash, an infrastructure failure), which
/// the next run resumes from its records.
fn retryable(status: std::process::ExitStatus) -> bool {
    Blame::of_exit(status.code()).retried()
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

    #[test]
    fn a_failure_message_is_the_log_lines_message_without_time_level_or_target() {
        let line = "2026-12-01T19:35:11.106272Z ERROR harvester: harvest failed: storage x: No space left on device (os error 28) exit_code=3";
        assert_eq!(
            log_message(line),
            "harvest failed: storage x: No space left on device (os error 28) exit_code=3"
        );
        let padded = "2026-12-01T19:35:11Z  WARN harvester: slow";
        assert_eq!(log_message(padded), "slow");
        assert_eq!(log_message("plain words here"), "plain words here");
    }

    use std::os::unix::process::ExitStatusExt;

    use super::*;

    #[test]
    fn a_part_runs_on_the_gpu_it_was_given_and_shares_the_threads_with_the_other_parts() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(Store::open(&dir.path().join("harvest.sqlite")).unwrap());
        let config = WorkerConfig {
            harvester: "/bin/harvester".into(),
            data_dir: dir.path().into(),
            threads: Some(8),
            deadline: None,
            attempts: 1,
            gpus: vec![3],
            stages: BTreeMap::new(),
        };
        let workers = Workers::new(store, config, 1);
        let paths = JobPaths::new(dir.path(), "job");
        let args = |command: Command| -> Vec<String> {
            let std = command.as_std();
            let env = std
                .get_envs()
                .find(|(k, _)| *k == "HARVEST_THREADS")
                .and_then(|(_, v)| v)
                .map(|v| v.to_string_lossy().into_owned());
            let mut args: Vec<String> = std
                .get_args()
                .map(|a| a.to_string_lossy().into_owned())
                .collect();
            args.extend(env);
            args
        };
        let part = args(workers.command("m", &paths, Role::Part(1, 2), (2, Some(vec![3]))));
        let at = part.iter().position(|a| a == "--device").unwrap();
        assert_eq!(part[at + 1], "cuda:3");
        assert!(!part.iter().any(|a| a == "--pipeline-stages"), "{part:?}");
        // A model spanning GPUs runs as one stage a GPU, on the GPUs it was given.
        let staged = args(workers.command("m", &paths, Role::Whole, (1, Some(vec![4, 5, 6]))));
        let after = |flag: &str| &staged[staged.iter().position(|a| a == flag).unwrap() + 1];
        assert_eq!(after("--device"), "cuda:4");
        assert_eq!(after("--pipeline-stages"), "3");
        assert_eq!(after("--stage-devices"), "4,5,6");
        assert!(part.windows(2).any(|w| w == ["--part", "1/2"]), "{part:?}");
        assert_eq!(
            part.last().map(String::as_str),
            Some("4"),
            "8 threads over 2 parts"
        );
        // Finalize holds no GPU but names the parts' kind of device: on a server with GPUs, a
        // GPU's (it is never probed); on one without, none.
        let finalize = args(workers.command("m", &paths, Role::Finalize, (1, None)));
        let at = finalize.iter().position(|a| a == "--device").unwrap();
        assert_eq!(finalize[at + 1], "cuda:3");
        assert!(
            !finalize.iter().any(|a| a == "--pipeline-stages"),
            "{finalize:?}"
        );
        // A server without GPUs names the CPU, so `auto` never takes a GPU it was not given.
        let cpu_server = Workers::new(
            Arc::new(Store::open(&dir.path().join("cpu.sqlite")).unwrap()),
            WorkerConfig {
                harvester: "/bin/harvester".into(),
                data_dir: dir.path().into(),
                threads: None,
                deadline: None,
                attempts: 1,
                gpus: Vec::new(),
                stages: BTreeMap::new(),
            },
            1,
        );
        for role in [Role::Whole, Role::Part(0, 2), Role::Finalize] {
            let cpu = args(cpu_server.command("m", &paths, role, (1, None)));
            let at = cpu.iter().position(|a| a == "--device").unwrap();
            assert_eq!(cpu[at + 1], "cpu", "{cpu:?}");
        }
    }

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
