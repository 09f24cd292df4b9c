//! The embedded backend's state: accounts with their usage ledgers, hashed API keys, and jobs,
//! in one SQLite file that survives restarts. Every change that touches quota runs in one
//! transaction, applying the pure rules of `harvest_core::{quota, lifecycle}`.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use harvest_core::clock::UnixMillis;
use harvest_core::lifecycle::{self, JobEvent, JobStatus, LifecycleError, Transition};
use harvest_core::quota::{AccountLimits, Denial, Hold, Lane, Ledger};
use rusqlite::{Connection, OptionalExtension, params};

use crate::error::ApiError;
use crate::job::{JobRecord, JobSpec, StoredResult};
use crate::keys::{KeyInfo, check_key_format, key_hash, new_key, shown_prefix};
use crate::wire::Progress;

/// Errors of the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// SQLite failed.
    #[error("sqlite: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// A stored JSON column is unreadable.
    #[error("stored JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// A quota denied the job.
    #[error(transparent)]
    Denied(#[from] Denial),
    /// The lifecycle refused the event.
    #[error(transparent)]
    Lifecycle(#[from] LifecycleError),
    /// No such row.
    #[error("{what} not found")]
    NotFound {
        /// What was looked for.
        what: &'static str,
    },
    /// A key to import is not of a known format, or is already stored.
    #[error("{reason}")]
    BadKey {
        /// What is wrong and what would do.
        reason: String,
    },
    /// A label names keys of several accounts.
    #[error("{}", crate::keys::ambiguous_label(label, accounts))]
    AmbiguousLabel {
        /// The label.
        label: String,
        /// The accounts it names keys of.
        accounts: Vec<String>,
    },
}

impl From<StoreError> for ApiError {
    fn from(error: StoreError) -> Self {
        use StoreError as S;
        match error {
            S::Denied(denial) => Self::Denied(denial),
            S::Lifecycle(e) => Self::NotCancellable {
                message: e.to_string(),
            },
            S::NotFound { .. } => Self::NotFound,
            other => Self::Internal {
                detail: other.to_string(),
            },
        }
    }
}

impl From<StoreError> for crate::error::StartupError {
    fn from(error: StoreError) -> Self {
        Self::Store(error.to_string())
    }
}

type Result<T, E = StoreError> = std::result::Result<T, E>;

/// The store.
#[derive(Debug)]
pub struct Store {
    conn: Mutex<Connection>,
    /// A file of [`RESERVE_BYTES`] beside the database, given up when the disk is full so that
    /// a job's ending can still be written.
    reserve: PathBuf,
}

/// Bytes the store keeps in reserve on its disk.
pub const RESERVE_BYTES: usize = 4 << 20;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS accounts (name TEXT PRIMARY KEY, limits TEXT NOT NULL, ledger TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS keys (hash TEXT PRIMARY KEY, account TEXT NOT NULL, label TEXT NOT NULL,
  created_at INTEGER NOT NULL, revoked_at INTEGER);
CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, run_id TEXT NOT NULL, account TEXT NOT NULL,
  key_hash TEXT NOT NULL, model TEXT NOT NULL, status TEXT NOT NULL, n_prompts INTEGER NOT NULL,
  reserved INTEGER NOT NULL, tokens INTEGER, created_at INTEGER NOT NULL, started_at INTEGER,
  completed_at INTEGER, result TEXT, error TEXT, progress TEXT, hold TEXT, spec TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS jobs_by_key ON jobs (key_hash, created_at);
CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status);
CREATE INDEX IF NOT EXISTS jobs_by_account ON jobs (account, created_at);
";

/// How often a key's `last_used` is written at most: a request a minute per key, not one per
/// request.
const LAST_USED_RESOLUTION_MS: i64 = 60_000;

/// Adds the columns later versions added to a store an earlier one made.
fn migrate(conn: &Connection) -> Result<()> {
    let columns = |table: &str| -> Result<Vec<String>> {
        let mut stmt = conn.prepare(&format!("PRAGMA table_info({table})"))?;
        let names = stmt
            .query_map([], |r| r.get::<_, String>(1))?
            .collect::<rusqlite::Result<_>>()?;
        Ok(names)
    };
    let keys = columns("keys")?;
    for (column, kind) in [("prefix", "TEXT"), ("last_used", "INTEGER")] {
        if !keys.iter().any(|c| c == column) {
            conn.execute_batch(&format!("ALTER TABLE keys ADD COLUMN {column} {kind}"))?;
        }
    }
    if !columns("jobs")?.iter().any(|c| c == "files_deleted") {
        conn.execute_batch("ALTER TABLE jobs ADD COLUMN files_deleted INTEGER")?;
    }
    if !columns("accounts")?.iter().any(|c| c == "disabled") {
        conn.execute_batch("ALTER TABLE accounts ADD COLUMN disabled INTEGER NOT NULL DEFAULT 0")?;
    }
    Ok(())
}

/// Jobs the key submitted since `since`: what its monthly quota counts, for admission (inside
/// its transaction) and for the account's usage alike.
fn key_jobs_since(conn: &Connection, key_hash: &str, since: UnixMillis) -> Result<u32> {
    let n: i64 = conn.query_row(
        "SELECT COUNT(*) FROM jobs WHERE key_hash = ?1 AND created_at >= ?2",
        params![key_hash, since.0],
        |r| r.get(0),
    )?;
    Ok(n as u32)
}

fn status_from(text: &str) -> JobStatus {
    match text {
        "running" => JobStatus::Running,
        "done" => JobStatus::Done,
        "failed" => JobStatus::Failed,
        "cancelled" => JobStatus::Cancelled,
        _ => JobStatus::Pending,
    }
}

const JOB_COLUMNS: &str = "id, run_id, account, key_hash, model, status, n_prompts, reserved, tokens, created_at, \
                           started_at, completed_at, result, error, progress, spec";

/// A job row with its JSON columns still as text (result, progress, spec).
type RawJob = (JobRecord, Option<String>, Option<String>, String);

fn job_from_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<RawJob> {
    let millis = |v: Option<i64>| v.map(UnixMillis);
    let record = JobRecord {
        id: row.get(0)?,
        run_id: row.get(1)?,
        account: row.get(2)?,
        key_hash: row.get(3)?,
        model: row.get(4)?,
        status: status_from(&row.get::<_, String>(5)?),
        n_prompts: row.get::<_, i64>(6)? as usize,
        reserved: row.get::<_, i64>(7)? as u64,
        tokens: row.get::<_, Option<i64>>(8)?.map(|t| t as u64),
        created_at: UnixMillis(row.get(9)?),
        started_at: millis(row.get(10)?),
        completed_at: millis(row.get(11)?),
        result: None,
        error: row.get(13)?,
        progress: None,
        spec: JobSpec {
            options: Default::default(),
            has_directions: false,
            lane: Lane::Small,
            estimated_bytes: 0,
            estimated_ms: None,
            parallelism: 1,
        },
    };
    Ok((record, row.get(12)?, row.get(14)?, row.get(15)?))
}

fn finish_job((mut record, result, progress, spec): RawJob) -> Result<JobRecord> {
    record.result = result.map(|r| serde_json::from_str(&r)).transpose()?;
    record.progress = progress.map(|p| serde_json::from_str(&p)).transpose()?;
    record.spec = serde_json::from_str(&spec)?;
    Ok(record)
}

impl Store {
    /// Opens (creating if needed) the store at `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let conn = Connection::open(path)?;
        conn.execute_batch("PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;")?;
        conn.execute_batch(SCHEMA)?;
        migrate(&conn)?;
        let store = Self {
            conn: Mutex::new(conn),
            reserve: path.with_extension("reserve"),
        };
        store.refill_reserve();
        Ok(store)
    }

    /// Writes the reserve file if it is missing and the disk has room for it (best effort: a
    /// disk without room keeps trying at the next call).
    pub fn refill_reserve(&self) {
        if self.reserve.exists() {
            return;
        }
        let written = std::fs::File::create(&self.reserve).and_then(|mut file| {
            // Real bytes, not a sparse file: the point is to hold blocks.
            std::io::Write::write_all(&mut file, &vec![0u8; RESERVE_BYTES])?;
            file.sync_all()
        });
        if let Err(error) = written {
            let _ = std::fs::remove_file(&self.reserve);
            tracing::debug!(%error, path = %self.reserve.display(), "no room for the store's reserve yet");
        }
    }

    /// Frees the reserve, when the disk is full, so the next write can succeed; true if there
    /// was one to free.
    fn release_reserve(&self) -> bool {
        let freed = std::fs::remove_file(&self.reserve).is_ok();
        if freed {
            tracing::error!(
                path = %self.reserve.display(),
                bytes = RESERVE_BYTES,
                "the disk is full: released the store's reserve to record a job's ending; free space on the data directory"
            );
        }
        freed
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        // A panic while holding the lock leaves SQLite consistent (transactions roll back).
        self.conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Creates the account or updates its limits, keeping its ledger.
    pub fn upsert_account(
        &self,
        name: &str,
        limits: &AccountLimits,
        now: UnixMillis,
    ) -> Result<()> {
        let ledger = serde_json::to_string(&Ledger::new(now))?;
        self.conn().execute(
            "INSERT INTO accounts (name, limits, ledger) VALUES (?1, ?2, ?3)
             ON CONFLICT(name) DO UPDATE SET limits = excluded.limits",
            params![name, serde_json::to_string(limits)?, ledger],
        )?;
        Ok(())
    }

    /// Enables the accounts of the configuration (creating them, or updating their limits and
    /// keeping their ledgers) and disables every other: their keys then get 401.
    pub fn sync_accounts(
        &self,
        accounts: &[(String, AccountLimits)],
        now: UnixMillis,
    ) -> Result<()> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        tx.execute("UPDATE accounts SET disabled = 1", [])?;
        let ledger = serde_json::to_string(&Ledger::new(now))?;
        for (name, limits) in accounts {
            tx.execute(
                "INSERT INTO accounts (name, limits, ledger, disabled) VALUES (?1, ?2, ?3, 0)
                 ON CONFLICT(name) DO UPDATE SET limits = excluded.limits, disabled = 0",
                params![name, serde_json::to_string(limits)?, ledger],
            )?;
        }
        tx.commit()?;
        Ok(())
    }

    /// Creates a key for `account` and returns it; only its hash is stored.
    pub fn create_key(&self, account: &str, label: &str, now: UnixMillis) -> Result<String> {
        let key = new_key();
        self.store_key(account, label, &key, now)?;
        Ok(key)
    }

    /// Stores a key made elsewhere (the hosted service's `sk-acs-…`, its old platform's
    /// `acs-bm-…`, or another harvest server's `sk-hv-…`) for `account`.
    pub fn import_key(&self, account: &str, label: &str, key: &str, now: UnixMillis) -> Result<()> {
        check_key_format(key).map_err(|reason| StoreError::BadKey { reason })?;
        self.store_key(account, label, key, now)
    }

    fn store_key(&self, account: &str, label: &str, key: &str, now: UnixMillis) -> Result<()> {
        let conn = self.conn();
        let exists: Option<String> = conn
            .query_row(
                "SELECT name FROM accounts WHERE name = ?1 AND disabled = 0",
                [account],
                |r| r.get(0),
            )
            .optional()?;
        if exists.is_none() {
            return Err(StoreError::NotFound { what: "account" });
        }
        let inserted = conn.execute(
            "INSERT INTO keys (hash, account, label, created_at, prefix) VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT(hash) DO NOTHING",
            params![key_hash(key), account, label, now.0, shown_prefix(key)],
        )?;
        if inserted == 0 {
            return Err(StoreError::BadKey {
                reason: "this key is already stored: revoke it first to move it to another account"
                    .into(),
            });
        }
        Ok(())
    }

    /// Every key, newest first, of one account or all.
    pub fn list_keys(&self, account: Option<&str>) -> Result<Vec<KeyInfo>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(
            "SELECT account, label, COALESCE(prefix, ''), created_at, last_used, revoked_at
             FROM keys WHERE ?1 IS NULL OR account = ?1 ORDER BY created_at DESC, hash",
        )?;
        let rows = stmt.query_map([account], |r| {
            Ok(KeyInfo {
                account: r.get(0)?,
                label: r.get(1)?,
                prefix: r.get(2)?,
                created_at: UnixMillis(r.get(3)?),
                last_used: r.get::<_, Option<i64>>(4)?.map(UnixMillis),
                revoked_at: r.get::<_, Option<i64>>(5)?.map(UnixMillis),
            })
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Revokes every active key labelled `label` (of `account`, when given); returns how many.
    /// A label that names keys of several accounts is refused without `account`.
    pub fn revoke_label(
        &self,
        label: &str,
        account: Option<&str>,
        now: UnixMillis,
    ) -> Result<usize> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        let accounts: Vec<String> = {
            let mut stmt = tx.prepare(
                "SELECT DISTINCT account FROM keys WHERE label = ?1 AND revoked_at IS NULL
                 AND (?2 IS NULL OR account = ?2) ORDER BY account",
            )?;
            stmt.query_map(params![label, account], |r| r.get(0))?
                .collect::<rusqlite::Result<_>>()?
        };
        if accounts.len() > 1 {
            return Err(StoreError::AmbiguousLabel {
                label: label.to_owned(),
                accounts,
            });
        }
        let n = tx.execute(
            "UPDATE keys SET revoked_at = ?3 WHERE label = ?1 AND revoked_at IS NULL
             AND (?2 IS NULL OR account = ?2)",
            params![label, account, now.0],
        )?;
        tx.commit()?;
        Ok(n)
    }

    /// Revokes the key; returns whether it existed.
    pub fn revoke_key(&self, key: &str, now: UnixMillis) -> Result<bool> {
        let n = self.conn().execute(
            "UPDATE keys SET revoked_at = ?2 WHERE hash = ?1 AND revoked_at IS NULL",
            params![key_hash(key), now.0],
        )?;
        Ok(n > 0)
    }

    /// The account of a valid key (not revoked, its account still configured), and the key's
    /// hash. Records the use, to the minute.
    pub fn authenticate(&self, key: &str) -> Result<Option<(String, String)>> {
        self.authenticate_at(key, crate::paths::now())
    }

    fn authenticate_at(&self, key: &str, now: UnixMillis) -> Result<Option<(String, String)>> {
        let hash = key_hash(key);
        let conn = self.conn();
        let account: Option<String> = conn
            .query_row(
                "SELECT k.account FROM keys k JOIN accounts a ON a.name = k.account
                 WHERE k.hash = ?1 AND k.revoked_at IS NULL AND a.disabled = 0",
                [&hash],
                |r| r.get(0),
            )
            .optional()?;
        if account.is_some() {
            // last_used is advisory: a full disk must not turn every request into a 500.
            let stamped = conn.execute(
                "UPDATE keys SET last_used = ?2 WHERE hash = ?1
                 AND (last_used IS NULL OR last_used <= ?2 - ?3)",
                params![hash, now.0, LAST_USED_RESOLUTION_MS],
            );
            if let Err(error) = stamped {
                tracing::debug!(%error, "could not stamp the key's last use");
            }
        }
        Ok(account.map(|a| (a, hash)))
    }

    /// The account's limits and ledger.
    pub fn account(&self, name: &str) -> Result<(AccountLimits, Ledger)> {
        let (limits, ledger): (String, String) = self
            .conn()
            .query_row(
                "SELECT limits, ledger FROM accounts WHERE name = ?1",
                [name],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?
            .ok_or(StoreError::NotFound { what: "account" })?;
        Ok((
            serde_json::from_str(&limits)?,
            serde_json::from_str(&ledger)?,
        ))
    }

    /// Admits and records a new job in one transaction: the lane, the key's monthly quota and
    /// the budgets are checked, the tokens held, the job inserted as pending.
    pub fn admit(&self, job: &JobRecord, now: UnixMillis) -> Result<()> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        let (limits, ledger): (String, String) = tx
            .query_row(
                "SELECT limits, ledger FROM accounts WHERE name = ?1",
                [&job.account],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?
            .ok_or(StoreError::NotFound { what: "account" })?;
        let limits: AccountLimits = serde_json::from_str(&limits)?;
        let mut ledger: Ledger = serde_json::from_str(&ledger)?;
        let key_jobs = key_jobs_since(&tx, &job.key_hash, now.month().start())?;
        let hold = ledger.admit(&limits, job.spec.lane, job.reserved, key_jobs, now)?;
        tx.execute(
            "UPDATE accounts SET ledger = ?2 WHERE name = ?1",
            params![job.account, serde_json::to_string(&ledger)?],
        )?;
        tx.execute(
            &format!("INSERT INTO jobs ({JOB_COLUMNS}, hold) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, NULL, ?9, NULL, NULL, NULL, NULL, NULL, ?10, ?11)"),
            params![
                job.id,
                job.run_id,
                job.account,
                job.key_hash,
                job.model,
                job.status.as_str(),
                job.n_prompts as i64,
                job.reserved as i64,
                job.created_at.0,
                serde_json::to_string(&job.spec)?,
                serde_json::to_string(&hold)?
            ],
        )?;
        tx.commit()?;
        Ok(())
    }

    /// A job by id.
    pub fn job(&self, id: &str) -> Result<Option<JobRecord>> {
        let parts = self
            .conn()
            .query_row(
                &format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = ?1"),
                [id],
                job_from_row,
            )
            .optional()?;
        parts.map(finish_job).transpose()
    }

    /// Jobs that were pending or running, oldest first (for restart reconciliation and the
    /// worker queue).
    pub fn unfinished_jobs(&self) -> Result<Vec<JobRecord>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(&format!(
            "SELECT {JOB_COLUMNS} FROM jobs WHERE status IN ('pending', 'running') ORDER BY created_at"
        ))?;
        let rows = stmt
            .query_map([], job_from_row)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        rows.into_iter().map(finish_job).collect()
    }

    /// Every job of `account`, oldest first.
    pub fn jobs_of(&self, account: &str) -> Result<Vec<JobRecord>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(&format!(
            "SELECT {JOB_COLUMNS} FROM jobs WHERE account = ?1 ORDER BY created_at, id"
        ))?;
        let rows = stmt
            .query_map([account], job_from_row)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        rows.into_iter().map(finish_job).collect()
    }

    /// Up to `limit` of `account`'s jobs, newest first (ties by id, descending), only those in
    /// `status` if given, and only those before `cursor` (a job's creation time and id) if
    /// given: one page of `GET /v1/harvest`.
    pub fn jobs_page(
        &self,
        account: &str,
        status: Option<JobStatus>,
        cursor: Option<(UnixMillis, &str)>,
        limit: usize,
    ) -> Result<Vec<JobRecord>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(&format!(
            "SELECT {JOB_COLUMNS} FROM jobs WHERE account = ?1 AND (?2 IS NULL OR status = ?2)
             AND (?3 IS NULL OR created_at < ?3 OR (created_at = ?3 AND id < ?4))
             ORDER BY created_at DESC, id DESC LIMIT ?5"
        ))?;
        let rows = stmt
            .query_map(
                params![
                    account,
                    status.map(JobStatus::as_str),
                    cursor.map(|(at, _)| at.0),
                    cursor.map(|(_, id)| id),
                    limit as i64
                ],
                job_from_row,
            )?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        rows.into_iter().map(finish_job).collect()
    }

    /// Tokens per second of the model's most recent done job, wall clock from its start to its
    /// end (model loading included, as a user waits for it).
    pub fn throughput(&self, model: &str) -> Result<Option<f64>> {
        let row: Option<(i64, i64, i64)> = self
            .conn()
            .query_row(
                "SELECT tokens, started_at, completed_at FROM jobs WHERE model = ?1 AND status = 'done'
                 AND tokens > 0 AND started_at IS NOT NULL AND completed_at > started_at
                 ORDER BY completed_at DESC LIMIT 1",
                [model],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .optional()?;
        Ok(row.map(|(tokens, start, end)| tokens as f64 / ((end - start) as f64 / 1000.0)))
    }

    /// Jobs the key submitted since `since` (its monthly quota's count).
    pub fn key_jobs_since(&self, key_hash: &str, since: UnixMillis) -> Result<u32> {
        key_jobs_since(&self.conn(), key_hash, since)
    }

    /// Ended jobs whose files are still kept and that ended before `cutoff`: what the
    /// retention sweeper deletes.
    pub fn expired_jobs(&self, cutoff: UnixMillis) -> Result<Vec<String>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(
            "SELECT id FROM jobs WHERE status IN ('done', 'failed', 'cancelled')
             AND files_deleted IS NULL AND completed_at < ?1 ORDER BY completed_at",
        )?;
        let ids = stmt
            .query_map([cutoff.0], |r| r.get(0))?
            .collect::<rusqlite::Result<_>>()?;
        Ok(ids)
    }

    /// Records that job `id`'s files were deleted; its record stays.
    pub fn mark_files_deleted(&self, id: &str, now: UnixMillis) -> Result<()> {
        self.conn().execute(
            "UPDATE jobs SET files_deleted = ?2 WHERE id = ?1",
            params![id, now.0],
        )?;
        Ok(())
    }

    /// Bytes the account's kept files take or will take: what its done jobs wrote, plus the
    /// estimates of its unfinished ones.
    pub fn stored_bytes(&self, account: &str) -> Result<u64> {
        let conn = self.conn();
        let mut stmt = conn.prepare(&format!(
            "SELECT {JOB_COLUMNS} FROM jobs WHERE account = ?1 AND files_deleted IS NULL
             AND status IN ('pending', 'running', 'done')"
        ))?;
        let rows = stmt
            .query_map([account], job_from_row)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        let mut total = 0u64;
        for job in rows.into_iter().map(finish_job) {
            let job = job?;
            total += match &job.result {
                Some(result) => result.bytes_written,
                None => job.spec.estimated_bytes,
            };
        }
        Ok(total)
    }

    /// How many jobs are pending or running (a cheap query for health and metrics).
    pub fn unfinished_count(&self) -> Result<u64> {
        let n: i64 = self.conn().query_row(
            "SELECT COUNT(*) FROM jobs WHERE status IN ('pending', 'running')",
            [],
            |r| r.get(0),
        )?;
        Ok(n as u64)
    }

    /// Applies a lifecycle event in one transaction; when the job ends, its hold settles at the
    /// charge the lifecycle decides. Returns the updated job and the transition.
    pub fn apply(
        &self,
        id: &str,
        event: JobEvent,
        outcome: Outcome,
        now: UnixMillis,
    ) -> Result<(JobRecord, Transition)> {
        match self.apply_once(id, event, outcome.clone(), now) {
            Err(error) if is_disk_full(&error) && self.release_reserve() => {
                self.apply_once(id, event, outcome, now)
            }
            other => other,
        }
    }

    fn apply_once(
        &self,
        id: &str,
        event: JobEvent,
        outcome: Outcome,
        now: UnixMillis,
    ) -> Result<(JobRecord, Transition)> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        let (status, reserved, account, hold): (String, i64, String, Option<String>) = tx
            .query_row(
                "SELECT status, reserved, account, hold FROM jobs WHERE id = ?1",
                [id],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
            )
            .optional()?
            .ok_or(StoreError::NotFound { what: "job" })?;
        let transition = lifecycle::next(status_from(&status), reserved as u64, event)?;
        if let Transition::To { status, charge, .. } = transition {
            tx.execute(
                "UPDATE jobs SET status = ?2 WHERE id = ?1",
                params![id, status.as_str()],
            )?;
            if status == JobStatus::Running {
                tx.execute(
                    "UPDATE jobs SET started_at = ?2 WHERE id = ?1",
                    params![id, now.0],
                )?;
            }
            if let Some(charge) = charge {
                let result = outcome
                    .result
                    .as_ref()
                    .map(serde_json::to_string)
                    .transpose()?;
                tx.execute(
                    "UPDATE jobs SET tokens = ?2, completed_at = ?3, hold = NULL, result = ?4, error = ?5 WHERE id = ?1",
                    params![id, charge as i64, now.0, result, outcome.error],
                )?;
                if let Some(hold) = hold {
                    let hold: Hold = serde_json::from_str(&hold)?;
                    let ledger: String = tx.query_row(
                        "SELECT ledger FROM accounts WHERE name = ?1",
                        [&account],
                        |r| r.get(0),
                    )?;
                    let mut ledger: Ledger = serde_json::from_str(&ledger)?;
                    ledger.finish(hold, charge, now);
                    tx.execute(
                        "UPDATE accounts SET ledger = ?2 WHERE name = ?1",
                        params![account, serde_json::to_string(&ledger)?],
                    )?;
                }
            }
        }
        tx.commit()?;
        drop(conn);
        let job = self.job(id)?.ok_or(StoreError::NotFound { what: "job" })?;
        Ok((job, transition))
    }

    /// Records a running job's progress.
    pub fn set_progress(&self, id: &str, progress: &Progress) -> Result<()> {
        self.conn().execute(
            "UPDATE jobs SET progress = ?2 WHERE id = ?1 AND status = 'running'",
            params![id, serde_json::to_string(progress)?],
        )?;
        Ok(())
    }
}

/// Whether SQLite failed because its disk is full.
fn is_disk_full(error: &StoreError) -> bool {
    matches!(
        error,
        StoreError::Sqlite(rusqlite::Error::SqliteFailure(e, _))
            if e.code == rusqlite::ErrorCode::DiskFull
    )
}

/// What a worker reports with an ending event.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// The result of a done job.
    pub result: Option<StoredResult>,
    /// The error of a failed job.
    pub error: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: UnixMillis = UnixMillis(1_793_698_200_000);

    fn job(id: &str, key_hash: &str, reserved: u64) -> JobRecord {
        JobRecord {
            id: id.into(),
            run_id: format!("run-{id}"),
            account: "acme".into(),
            key_hash: key_hash.into(),
            model: "m".into(),
            status: JobStatus::Pending,
            n_prompts: 1,
            reserved,
            tokens: None,
            created_at: NOW,
            started_at: None,
            completed_at: None,
            result: None,
            error: None,
            progress: None,
            spec: JobSpec {
                options: harvest_core::JobOptions {
                    layers: vec![1].into(),
                    shard_size: std::num::NonZeroUsize::new(32).unwrap(),
                    ..Default::default()
                },
                has_directions: false,
                lane: Lane::Small,
                estimated_bytes: 0,
                estimated_ms: None,
                parallelism: 1,
            },
        }
    }

    fn store() -> (tempfile::TempDir, Store, String) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("db.sqlite")).unwrap();
        let limits = AccountLimits {
            daily_tokens: Some(100),
            ..Default::default()
        };
        store.upsert_account("acme", &limits, NOW).unwrap();
        let key = store.create_key("acme", "test", NOW).unwrap();
        (dir, store, key)
    }

    #[test]
    fn keys_are_stored_hashed_and_can_be_revoked() {
        let (_dir, store, key) = store();
        let (account, hash) = store.authenticate(&key).unwrap().unwrap();
        assert_eq!(account, "acme");
        assert_ne!(hash, key);
        assert!(store.authenticate("sk-hv-wrong").unwrap().is_none());
        assert!(store.revoke_key(&key, NOW).unwrap());
        assert!(store.authenticate(&key).unwrap().is_none());
    }

    #[test]
    fn keys_of_the_documented_formats_import_and_others_are_refused_by_name() {
        let (_dir, store, _) = store();
        let hosted = "sk-acs-0123456789abcdefABCDEF";
        let legacy = "acs-bm-0123456789abcdef_-xy";
        store.import_key("acme", "hosted", hosted, NOW).unwrap();
        store.import_key("acme", "legacy", legacy, NOW).unwrap();
        assert_eq!(store.authenticate(hosted).unwrap().unwrap().0, "acme");
        assert_eq!(store.authenticate(legacy).unwrap().unwrap().0, "acme");
        let again = store.import_key("acme", "again", hosted, NOW).unwrap_err();
        assert!(again.to_string().contains("already stored"), "{again}");
        for (bad, says) in [
            ("pk-live-0123456789abcdef", "starts with"),
            ("sk-acs-short", "at least 16"),
            ("sk-acs-0123456789abcdef!!", "others"),
        ] {
            let error = store.import_key("acme", "bad", bad, NOW).unwrap_err();
            assert!(error.to_string().contains(says), "{bad}: {error}");
        }
        assert!(matches!(
            store.import_key("nobody", "x", "sk-acs-0123456789abcdefXYZ", NOW),
            Err(StoreError::NotFound { what: "account" })
        ));
    }

    #[test]
    fn listed_keys_show_a_prefix_and_their_last_use_never_the_key() {
        let (_dir, store, key) = store();
        assert!(store.authenticate_at(&key, NOW).unwrap().is_some());
        let later = UnixMillis(NOW.0 + 30_000);
        assert!(store.authenticate_at(&key, later).unwrap().is_some());
        let keys = store.list_keys(Some("acme")).unwrap();
        assert_eq!(keys.len(), 1);
        let listed = &keys[0];
        assert_eq!(listed.prefix, key[..10]);
        assert!(!format!("{listed:?}").contains(&key));
        assert_eq!(listed.last_used, Some(NOW), "written at most once a minute");
        let much_later = UnixMillis(NOW.0 + 61_000);
        store.authenticate_at(&key, much_later).unwrap();
        assert_eq!(
            store.list_keys(None).unwrap()[0].last_used,
            Some(much_later)
        );
    }

    #[test]
    fn a_label_revokes_every_key_it_names_and_an_ambiguous_one_asks_for_the_account() {
        let (_dir, store, first) = store();
        store
            .upsert_account("other", &AccountLimits::default(), NOW)
            .unwrap();
        let second = store.create_key("acme", "test", NOW).unwrap();
        let theirs = store.create_key("other", "test", NOW).unwrap();
        let error = store.revoke_label("test", None, NOW).unwrap_err();
        assert!(
            error.to_string().contains("acme, other") && error.to_string().contains("--account"),
            "{error}"
        );
        assert_eq!(store.revoke_label("test", Some("acme"), NOW).unwrap(), 2);
        assert!(store.authenticate(&first).unwrap().is_none());
        assert!(store.authenticate(&second).unwrap().is_none());
        assert!(store.authenticate(&theirs).unwrap().is_some());
        assert_eq!(store.revoke_label("test", Some("acme"), NOW).unwrap(), 0);
    }

    #[test]
    fn an_account_removed_from_the_configuration_loses_its_keys_until_it_returns() {
        let (_dir, store, key) = store();
        let limits = AccountLimits::default();
        store
            .sync_accounts(&[("other".to_owned(), limits.clone())], NOW)
            .unwrap();
        assert!(
            store.authenticate(&key).unwrap().is_none(),
            "acme is disabled"
        );
        assert!(matches!(
            store.create_key("acme", "x", NOW),
            Err(StoreError::NotFound { what: "account" })
        ));
        store
            .sync_accounts(&[("acme".to_owned(), limits)], NOW)
            .unwrap();
        assert!(store.authenticate(&key).unwrap().is_some(), "acme is back");
    }

    #[test]
    fn a_store_made_before_key_prefixes_and_disabled_accounts_is_migrated() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old.sqlite");
        {
            let conn = Connection::open(&path).unwrap();
            conn.execute_batch(
                "CREATE TABLE accounts (name TEXT PRIMARY KEY, limits TEXT NOT NULL, ledger TEXT NOT NULL);
                 CREATE TABLE keys (hash TEXT PRIMARY KEY, account TEXT NOT NULL, label TEXT NOT NULL,
                   created_at INTEGER NOT NULL, revoked_at INTEGER);",
            )
            .unwrap();
            let ledger = serde_json::to_string(&Ledger::new(NOW)).unwrap();
            let limits = serde_json::to_string(&AccountLimits::default()).unwrap();
            conn.execute(
                "INSERT INTO accounts VALUES ('acme', ?1, ?2)",
                params![limits, ledger],
            )
            .unwrap();
            conn.execute(
                "INSERT INTO keys VALUES (?1, 'acme', 'old', 1, NULL)",
                [key_hash("sk-hv-old-key")],
            )
            .unwrap();
        }
        let store = Store::open(&path).unwrap();
        assert_eq!(
            store.authenticate("sk-hv-old-key").unwrap().unwrap().0,
            "acme"
        );
        assert_eq!(store.list_keys(None).unwrap()[0].prefix, "");
    }

    #[test]
    fn admission_holds_tokens_and_the_lifecycle_settles_them_once() {
        let (_dir, store, key) = store();
        let hash = key_hash(&key);
        store.admit(&job("a", &hash, 60), NOW).unwrap();
        let denial = store.admit(&job("b", &hash, 60), NOW).unwrap_err();
        assert!(
            matches!(denial, StoreError::Denied(Denial::Budget { .. })),
            "{denial}"
        );
        store
            .apply("a", JobEvent::Started, Outcome::default(), NOW)
            .unwrap();
        let (done, _) = store
            .apply(
                "a",
                JobEvent::Succeeded { tokens: 20 },
                Outcome::default(),
                NOW,
            )
            .unwrap();
        assert_eq!((done.status, done.tokens), (JobStatus::Done, Some(20)));
        let (_, ledger) = store.account("acme").unwrap();
        assert_eq!((ledger.tokens_today, ledger.active_small), (20, 0));
        let (_, again) = store
            .apply(
                "a",
                JobEvent::Succeeded { tokens: 99 },
                Outcome::default(),
                NOW,
            )
            .unwrap();
        assert_eq!(
            again,
            Transition::Unchanged,
            "a late report never charges twice"
        );
        assert_eq!(store.account("acme").unwrap().1.tokens_today, 20);
        store.admit(&job("b", &hash, 60), NOW).unwrap();
    }

    #[test]
    fn a_cancel_after_the_start_charges_the_reservation_and_state_survives_reopening() {
        let (dir, store, key) = store();
        store.admit(&job("a", &key_hash(&key), 30), NOW).unwrap();
        store
            .apply("a", JobEvent::Started, Outcome::default(), NOW)
            .unwrap();
        store
            .apply("a", JobEvent::Cancel, Outcome::default(), NOW)
            .unwrap();
        drop(store);
        let reopened = Store::open(&dir.path().join("db.sqlite")).unwrap();
        let job = reopened.job("a").unwrap().unwrap();
        assert_eq!((job.status, job.tokens), (JobStatus::Cancelled, Some(30)));
        assert_eq!(reopened.account("acme").unwrap().1.tokens_today, 30);
        assert!(reopened.unfinished_jobs().unwrap().is_empty());
    }
}
