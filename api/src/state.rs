//! The application state: which backend holds the jobs, the catalogue, the server-wide limits
//! of the contract (counting turns, long-poll slots), and the metrics. The handlers are in
//! `routes` (wired up by `app`); they reach jobs only through [`JobBackend`].

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::Semaphore;

use crate::backend::JobBackend;
use crate::catalogue::Catalogue;
use crate::error::ApiError;
use crate::permits::{
    COUNTS_SERVER_WIDE, LONG_POLLS_PER_KEY, LONG_POLLS_SERVER_WIDE, Scope, SharedPermit,
};
use crate::ratelimit::{RateLimit, RateLimiter};
use crate::signing::Signer;

/// Largest request body.
pub const MAX_BODY_BYTES: usize = 50 << 20;
/// Most tokens (counted by the real tokenizer) per job.
pub const MAX_JOB_TOKENS: u64 = 2_000_000;
/// Longest `?wait=`.
pub const MAX_WAIT_S: f64 = 60.0;
/// What a declined long-poll asks the client to wait.
pub const LONG_POLL_RETRY_AFTER_S: u32 = 3;

/// Everything the handlers share.
#[derive(Debug)]
pub struct AppState {
    /// Where jobs live and run.
    pub backend: Arc<dyn JobBackend>,
    /// Models.
    pub catalogue: Catalogue,
    /// Checks the links this server signed (`/files`).
    pub signer: Signer,
    /// Link lifetime.
    pub url_ttl_s: i64,
    /// Data directory (`/files` serves outputs from it).
    pub data_dir: PathBuf,
    /// Longest a submit may spend counting tokens.
    pub count_timeout: Duration,
    /// Flips to true when the server starts stopping: open long-polls answer at once.
    stopping: tokio::sync::watch::Sender<bool>,
    pub(crate) counting: Arc<Semaphore>,
    counting_accounts: Mutex<HashSet<String>>,
    long_polls: Mutex<HashMap<String, usize>>,
    /// Each key's request allowance; `None` when the limit is off.
    rate_limiter: Option<Mutex<RateLimiter>>,
    /// Running jobs' record headers already read (`?partial=true`).
    pub(crate) records: crate::ready::RecordCache,
    pub(crate) metrics: Metrics,
}

/// The API's Prometheus metrics.
#[derive(Debug)]
pub(crate) struct Metrics {
    pub(crate) registry: Registry,
    pub(crate) submitted: Counter,
    pub(crate) denied: Counter,
    pub(crate) long_polls_declined: Counter,
    pub(crate) downloads: Counter,
    pub(crate) unfinished: Gauge,
    /// Long-polls holding a slot now (so a test or an operator can see a wait has begun).
    pub(crate) long_polls_waiting: Gauge,
}

impl Metrics {
    fn new() -> Self {
        let (submitted, denied, long_polls_declined, downloads) = Default::default();
        let (unfinished, long_polls_waiting) = (Gauge::default(), Gauge::default());
        let mut registry = Registry::default();
        let counters: [(&str, &str, &Counter); 4] = [
            ("harvest_jobs_submitted", "Jobs admitted", &submitted),
            ("harvest_jobs_denied", "Submits denied by quota", &denied),
            (
                "harvest_long_polls_declined",
                "Long-polls answered at once for lack of slots",
                &long_polls_declined,
            ),
            (
                "harvest_downloads",
                "Files served through signed links",
                &downloads,
            ),
        ];
        for (name, help, counter) in counters {
            registry.register(name, help, counter.clone());
        }
        registry.register(
            "harvest_jobs_unfinished",
            "Jobs pending or running",
            unfinished.clone(),
        );
        registry.register(
            "harvest_long_polls_waiting",
            "Long-polls waiting for their job now",
            long_polls_waiting.clone(),
        );
        Self {
            registry,
            submitted,
            denied,
            long_polls_declined,
            downloads,
            unfinished,
            long_polls_waiting,
        }
    }
}

impl AppState {
    /// The state over a backend.
    pub fn new(
        backend: Arc<dyn JobBackend>,
        catalogue: Catalogue,
        signer: Signer,
        url_ttl_s: i64,
        data_dir: PathBuf,
        count_timeout: Duration,
        rate_limit: Option<RateLimit>,
    ) -> Arc<Self> {
        Arc::new(Self {
            backend,
            catalogue,
            signer,
            url_ttl_s,
            data_dir,
            count_timeout,
            stopping: tokio::sync::watch::channel(false).0,
            counting: Arc::new(Semaphore::new(COUNTS_SERVER_WIDE)),
            counting_accounts: Mutex::default(),
            long_polls: Mutex::default(),
            rate_limiter: rate_limit.map(|limit| Mutex::new(RateLimiter::new(limit))),
            metrics: Metrics::new(),
            records: crate::ready::RecordCache::default(),
        })
    }

    /// Takes one request of the bearer key's allowance (by its hash: raw keys are not kept).
    pub(crate) fn take_request(&self, key: &str) -> Result<(), ApiError> {
        let Some(limiter) = &self.rate_limiter else {
            return Ok(());
        };
        let hash = crate::keys::key_hash(key);
        let mut limiter = limiter
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        limiter
            .take(&hash, std::time::Instant::now())
            .map_err(|wait| ApiError::RateLimited {
                per_second: limiter.limit().requests_per_second,
                retry_after_s: u32::try_from(wait.as_secs_f64().ceil() as u64)
                    .unwrap_or(u32::MAX)
                    .max(1),
            })
    }

    /// Takes the account's counting turn, or `None` if one of its submits is being counted.
    pub fn counting_turn(&self, account: &str) -> Option<CountingTurn<'_>> {
        let mut accounts = self
            .counting_accounts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        accounts.insert(account.to_owned()).then(|| CountingTurn {
            state: self,
            account: account.to_owned(),
        })
    }

    /// Starts stopping: every open long-poll answers now.
    pub fn begin_stop(&self) {
        self.stopping.send_replace(true);
    }

    /// Resolves once the server is stopping.
    pub async fn stopped(&self) {
        let mut stopping = self.stopping.subscribe();
        let _ = stopping.wait_for(|stopping| *stopping).await;
    }

    /// Submits being counted now, server-wide.
    pub fn counts_in_progress(&self) -> usize {
        COUNTS_SERVER_WIDE - self.counting.available_permits()
    }

    /// Long-polls waiting now, server-wide.
    pub fn long_polls_waiting(&self) -> usize {
        self.long_polls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .values()
            .sum()
    }

    /// Takes one of the key's long-poll slots for at most `lasts`, or `None` when the key or
    /// the server has none: this replica's, then (with several replicas) the shared one.
    pub(crate) async fn long_poll_slot(
        &self,
        key: &str,
        lasts: Duration,
    ) -> Option<LongPollSlot<'_>> {
        let mut slot = {
            let mut polls = self
                .long_polls
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let total: usize = polls.values().sum();
            let mine = polls.get(key).copied().unwrap_or(0);
            if total >= LONG_POLLS_SERVER_WIDE || mine >= LONG_POLLS_PER_KEY {
                return None;
            }
            *polls.entry(key.to_owned()).or_default() += 1;
            self.metrics.long_polls_waiting.inc();
            LongPollSlot {
                state: self,
                key: key.to_owned(),
                shared: None,
            }
        };
        // Dropping the slot gives this replica's count back if the shared one is full.
        slot.shared = self.shared_permit(Scope::wait(key), lasts).await?;
        Some(slot)
    }

    /// A permit from the replicas' shared limits: `Some(None)` when this server is the only
    /// one, `None` when a limit is full (or the permits cannot be reached: the caller is
    /// told to come back, as when full).
    pub(crate) async fn shared_permit(
        &self,
        scope: Scope,
        lasts: Duration,
    ) -> Option<Option<SharedPermit>> {
        let Some(limits) = self.backend.shared_limits() else {
            return Some(None);
        };
        match SharedPermit::take(&limits, scope, lasts).await {
            Ok(permit) => permit.map(Some),
            Err(error) => {
                tracing::warn!(%error, "the shared limits could not be reached; declining");
                None
            }
        }
    }
}

/// An account's turn to have a submit counted; released when dropped.
#[derive(Debug)]
pub struct CountingTurn<'a> {
    state: &'a AppState,
    account: String,
}

impl Drop for CountingTurn<'_> {
    fn drop(&mut self) {
        self.state
            .counting_accounts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.account);
    }
}

/// A long-poll slot; released when dropped.
#[derive(Debug)]
pub(crate) struct LongPollSlot<'a> {
    state: &'a AppState,
    key: String,
    /// Its permit among the replicas', if there are several.
    shared: Option<SharedPermit>,
}

impl Drop for LongPollSlot<'_> {
    fn drop(&mut self) {
        let mut polls = self
            .state
            .long_polls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = polls.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                polls.remove(&self.key);
            }
        }
        self.state.metrics.long_polls_waiting.dec();
    }
}
