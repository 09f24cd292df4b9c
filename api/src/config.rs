//! Server configuration: one JSON file (models catalogue, accounts and their limits, where
//! things live), with flags and environment variables overriding the paths.

use std::path::{Path, PathBuf};
use std::time::Duration;

use harvest_core::quota::{AccountLimits, Lane};
use serde::Deserialize;

use crate::error::StartupError;

/// Longest a submit may spend counting tokens, unless the configuration says otherwise.
pub const COUNT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long download links live: the S3-style maximum of 7 days.
pub const DEFAULT_URL_TTL_SECONDS: u64 = 7 * 24 * 3600;

/// The configuration file.
#[derive(Debug, Clone, Deserialize)]
pub struct ServerConfig {
    /// Where the SQLite store, job inputs and outputs, and the signing secret live.
    pub data_dir: PathBuf,
    /// The keys of the file this release does not know (a newer release's, or misspelt), as
    /// paths (`models.0.future_key`); ignored, and named in a warning at start.
    #[serde(skip)]
    pub unknown_keys: Vec<String>,
    /// The `harvester` binary (embedded backend).
    #[serde(default)]
    pub harvester: PathBuf,
    /// Worker processes at once, machine-wide.
    #[serde(default = "one")]
    pub max_workers: usize,
    /// The base URL clients reach this server at; download links start with it.
    pub public_url: String,
    /// Lifetime of download links.
    #[serde(default = "default_ttl")]
    pub url_ttl_seconds: u64,
    /// Threads each harvester process may use (default: all cores).
    #[serde(default)]
    pub worker_threads: Option<usize>,
    /// The GPUs (CUDA ordinals) the workers run on, each harvester on its own while it runs,
    /// a job's parts on one each. Left out, the server uses every GPU `harvester cuda-info
    /// --list` finds usable, and says so at start; `[]` keeps the workers on the CPU.
    #[serde(default)]
    pub worker_gpus: Option<Vec<u32>>,
    /// Longest a submit may spend counting its corpus's tokens before it is answered 429
    /// `harvest_count_busy` (the hosted service's 10 s).
    #[serde(default = "default_count_timeout")]
    pub count_timeout_seconds: f64,
    /// Longest a job may run on the embedded backend, over all its attempts; past it the job
    /// fails (default: no limit).
    #[serde(default)]
    pub job_timeout_seconds: Option<u64>,
    /// Runs of a job's harvester, the first included, when it dies of a signal (the OOM killer)
    /// or an infrastructure failure; each resumes from the shards already written.
    #[serde(default = "default_attempts")]
    pub worker_attempts: u32,
    /// On SIGTERM, how long workers have to stop before the server exits anyway.
    #[serde(default = "default_grace")]
    pub shutdown_grace_seconds: u64,
    /// Days an ended job's files (inputs and outputs) are kept before they are deleted; its
    /// record stays and answers `urls_expired: true`. `null` keeps them for ever.
    #[serde(default = "default_retention")]
    pub retention_days: Option<f64>,
    /// How often the retention sweeper looks for files past their time.
    #[serde(default = "default_sweep")]
    pub sweep_interval_seconds: u64,
    /// Free space the data directory keeps: a submit whose estimated files would eat into it
    /// is answered 507 `insufficient_storage`.
    #[serde(default = "default_min_free")]
    pub min_free_bytes: u64,
    /// The models clients may name.
    pub models: Vec<ModelConfig>,
    /// Accounts and their limits (embedded backend; on Kubernetes they are HarvestAccounts).
    #[serde(default)]
    pub accounts: Vec<AccountConfig>,
    /// Run on Kubernetes instead of the embedded backend.
    #[serde(default)]
    pub kubernetes: Option<KubernetesConfig>,
    /// Requests each bearer key may make, on every route (default 50 a second, bursts of
    /// 100); `null` turns the limit off.
    #[serde(default = "default_rate_limit")]
    pub rate_limit: Option<crate::ratelimit::RateLimit>,
}

fn default_rate_limit() -> Option<crate::ratelimit::RateLimit> {
    Some(crate::ratelimit::RateLimit::default())
}

/// The Kubernetes backend: jobs are HarvestJobs, accounts HarvestAccounts, keys Secrets.
#[derive(Debug, Clone, Deserialize)]
pub struct KubernetesConfig {
    /// The namespace the API owns: its HarvestJobs and key Secrets live there, and the
    /// operator's `apiNamespace` must name it.
    pub namespace: String,
    /// Where the key Secrets live (default: `namespace`). A namespace of their own lets RBAC
    /// give the API those Secrets and no others.
    #[serde(default)]
    pub keys_namespace: Option<String>,
    /// Where inputs go and outputs are read, and how links are made.
    pub storage: crate::storage::StorageConfig,
}

impl KubernetesConfig {
    /// The namespace of the key Secrets.
    pub fn keys_namespace(&self) -> &str {
        self.keys_namespace.as_deref().unwrap_or(&self.namespace)
    }
}

/// A model of the catalogue.
#[derive(Debug, Clone, Deserialize)]
pub struct ModelConfig {
    /// The name clients send.
    pub name: String,
    /// Its Hugging Face checkpoint directory.
    pub path: PathBuf,
    /// Its concurrency lane.
    #[serde(default = "small")]
    pub lane: Lane,
    /// Devices one job of it occupies (`GET /v1/models` shows it; 1 for a single-GPU model, 8
    /// for a whole 8-GPU machine). With `worker_gpus`, each harvester of its jobs takes this
    /// many and runs one pipeline stage on each.
    #[serde(default = "one_device")]
    pub devices: u32,
    /// When its files are missing: if true, it is listed as unavailable and a submit is
    /// refused naming it; if false (the default), the server refuses to start.
    #[serde(default)]
    pub optional: bool,
    /// Most workers one job of it may be split over (the `parallelism` extension). On the
    /// Kubernetes backend, give the operator's catalogue's `maxParallelism`; default 16.
    #[serde(default = "max_parallelism")]
    pub max_parallelism: usize,
}

fn max_parallelism() -> usize {
    crate::wire::MAX_PARALLELISM
}

fn one_device() -> u32 {
    1
}

/// An account.
#[derive(Debug, Clone, Deserialize)]
pub struct AccountConfig {
    /// Its name.
    pub name: String,
    /// Its limits.
    #[serde(default)]
    pub limits: AccountLimits,
    /// Bytes its kept files may take on the embedded backend (default: no budget).
    #[serde(default)]
    pub storage_bytes: Option<u64>,
}

fn one() -> usize {
    1
}

fn default_retention() -> Option<f64> {
    Some(7.0)
}

fn default_sweep() -> u64 {
    3600
}

fn default_min_free() -> u64 {
    1 << 30
}

fn default_attempts() -> u32 {
    3
}

fn default_grace() -> u64 {
    30
}

fn default_count_timeout() -> f64 {
    COUNT_TIMEOUT.as_secs_f64()
}

fn default_ttl() -> u64 {
    DEFAULT_URL_TTL_SECONDS
}

fn small() -> Lane {
    Lane::Small
}

impl ServerConfig {
    /// Reads the file, expanding a leading `~/` in paths and resolving relative paths against
    /// the file's directory.
    pub fn from_file(path: &Path) -> Result<Self, StartupError> {
        let text = std::fs::read_to_string(path)?;
        // Keys this release does not know are set aside, not refused, so that a rollback
        // with a newer release's configuration starts; `unknown_keys` names them.
        let mut unknown = Vec::new();
        let mut config: Self =
            serde_ignored::deserialize(&mut serde_json::Deserializer::from_str(&text), |key| {
                unknown.push(key.to_string());
            })
            .map_err(|e| StartupError::config(format!("{}: {e}", path.display())))?;
        config.unknown_keys = unknown;
        let base = path.parent().unwrap_or(Path::new("."));
        config.data_dir = resolve(base, &config.data_dir);
        config.harvester = resolve(base, &config.harvester);
        for model in &mut config.models {
            model.path = resolve(base, &model.path);
        }
        if config.models.is_empty() {
            return Err(StartupError::config(
                "the configuration needs at least one model",
            ));
        }
        if config
            .retention_days
            .is_some_and(|days| !(days.is_finite() && days > 0.0))
            || config.sweep_interval_seconds == 0
        {
            return Err(StartupError::config(format!(
                "retention_days is {:?} and sweep_interval_seconds {}: give a positive number of days (or null to keep files for ever) and a positive interval",
                config.retention_days, config.sweep_interval_seconds
            )));
        }
        if config.worker_attempts == 0 || config.job_timeout_seconds == Some(0) {
            return Err(StartupError::config(format!(
                "worker_attempts is {} and job_timeout_seconds {:?}: give at least 1 attempt, and a positive timeout or none",
                config.worker_attempts, config.job_timeout_seconds
            )));
        }
        if !(config.count_timeout_seconds.is_finite() && config.count_timeout_seconds > 0.0) {
            return Err(StartupError::config(format!(
                "count_timeout_seconds is {}: give a positive number of seconds (default 10)",
                config.count_timeout_seconds
            )));
        }
        let mut gpus = config.worker_gpus.clone().unwrap_or_default();
        gpus.sort_unstable();
        if let Some(twice) = gpus.windows(2).find(|w| w[0] == w[1]) {
            return Err(StartupError::config(format!(
                "worker_gpus lists GPU {} twice: list each CUDA ordinal once",
                twice[0]
            )));
        }
        if let Some(limit) = &config.rate_limit {
            limit.check().map_err(StartupError::config)?;
        }
        match &config.kubernetes {
            None if config.accounts.is_empty() => {
                return Err(StartupError::config(
                    "the embedded backend needs at least one account under accounts",
                ));
            }
            Some(_) if !config.accounts.is_empty() => {
                return Err(StartupError::config(
                    "accounts are HarvestAccount resources on Kubernetes: remove accounts from the configuration and kubectl apply them",
                ));
            }
            _ => {}
        }
        Ok(config)
    }
}

fn resolve(base: &Path, path: &Path) -> PathBuf {
    if let Ok(rest) = path.strip_prefix("~")
        && let Some(home) = std::env::var_os("HOME")
    {
        return PathBuf::from(home).join(rest);
    }
    if path.is_absolute() {
        path.to_owned()
    } else {
        base.join(path)
    }
}
