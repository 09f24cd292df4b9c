//! Our extensions for a client that has lost track of its jobs, and for the status page:
//! `GET /v1/harvest` (an account's jobs, newest first, a page at a time) and `GET /v1/account`
//! (its lanes, budgets and storage against their limits). The query is parsed once into a
//! [`JobFilter`]; [`page`] and [`Usage::new`] are pure, so both backends answer alike.

use std::collections::BTreeMap;

use harvest_core::clock::UnixMillis;
use harvest_core::lifecycle::JobStatus;
use harvest_core::quota::{AccountLimits, Ledger};
use serde::Serialize;

use crate::error::ApiError;
use crate::job::JobRecord;
use crate::wire::{self, JobView};

/// Jobs in a page when `limit` is not given.
pub const DEFAULT_PAGE: usize = 20;
/// The most jobs a page may hold.
pub const MAX_PAGE: usize = 100;

/// A validated `GET /v1/harvest` query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobFilter {
    /// Jobs in the page, 1 to [`MAX_PAGE`].
    pub limit: usize,
    /// Only jobs older than this one (the last id of the previous page).
    pub after: Option<String>,
    /// Only jobs in this status.
    pub status: Option<JobStatus>,
}

impl JobFilter {
    /// Parses the query string's pairs, refusing unknown names and bad values by name.
    pub fn parse(query: &BTreeMap<String, String>) -> Result<Self, ApiError> {
        if let Some(name) = query
            .keys()
            .find(|k| !["limit", "after", "status"].contains(&k.as_str()))
        {
            return Err(ApiError::invalid(format!(
                "unknown query parameter {name:?}: the job list takes limit, after and status"
            )));
        }
        let limit = match query.get("limit") {
            None => DEFAULT_PAGE,
            Some(text) => match text.parse::<usize>() {
                Ok(n) if (1..=MAX_PAGE).contains(&n) => n,
                _ => {
                    return Err(ApiError::invalid(format!(
                        "limit={text:?} must be a whole number from 1 to {MAX_PAGE}"
                    )));
                }
            },
        };
        let after = match query.get("after") {
            None => None,
            Some(id) if wire::is_valid_job_id(id) => Some(id.clone()),
            Some(id) => {
                return Err(ApiError::invalid(format!(
                    "after={id:?} is not a job id: pass the next_after of the previous page"
                )));
            }
        };
        let status = match query.get("status").map(String::as_str) {
            None => None,
            Some("pending") => Some(JobStatus::Pending),
            Some("running") => Some(JobStatus::Running),
            Some("done") => Some(JobStatus::Done),
            Some("failed") => Some(JobStatus::Failed),
            Some("cancelled") => Some(JobStatus::Cancelled),
            Some(other) => {
                return Err(ApiError::invalid(format!(
                    "status={other:?} is not a job status: use pending, running, done, failed or cancelled"
                )));
            }
        };
        Ok(Self {
            limit,
            after,
            status,
        })
    }
}

/// One page of an account's jobs.
#[derive(Debug, Clone, PartialEq)]
pub struct JobPage {
    /// Newest first.
    pub jobs: Vec<JobRecord>,
    /// Whether older jobs match the filter.
    pub has_more: bool,
}

/// The order of the list: newest first, ties (Kubernetes times are whole seconds) by id.
fn newest_first(a: &JobRecord, b: &JobRecord) -> std::cmp::Ordering {
    (b.created_at, &b.id).cmp(&(a.created_at, &a.id))
}

/// The page `filter` asks for out of all of one account's `jobs`, in any order. A cursor that
/// is not one of them is refused, so a client never silently restarts from the top.
pub fn page(mut jobs: Vec<JobRecord>, filter: &JobFilter) -> Result<JobPage, ApiError> {
    jobs.sort_by(newest_first);
    let start = match &filter.after {
        None => 0,
        Some(after) => {
            let at = jobs
                .iter()
                .position(|j| &j.id == after)
                .ok_or_else(|| unknown_cursor(after))?;
            at + 1
        }
    };
    let mut matching = jobs
        .into_iter()
        .skip(start)
        .filter(|j| filter.status.is_none_or(|s| j.status == s));
    let page: Vec<JobRecord> = matching.by_ref().take(filter.limit).collect();
    let has_more = matching.next().is_some();
    Ok(JobPage {
        jobs: page,
        has_more,
    })
}

/// The refusal of a cursor that names no job of the caller's.
pub fn unknown_cursor(after: &str) -> ApiError {
    ApiError::invalid(format!(
        "after={after:?} is not one of your jobs: pass the next_after of the previous page, or leave it out to start from the newest"
    ))
}

/// `GET /v1/harvest`: a page of jobs, each as `GET /v1/harvest/{job_id}` answers it but without
/// `result` (ask for the job itself for its links).
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct JobList {
    /// The jobs, newest first.
    pub data: Vec<JobView>,
    /// Whether there are older jobs matching the filter.
    pub has_more: bool,
    /// With `has_more`: the `after` that asks for the next page.
    pub next_after: Option<String>,
}

/// Used against a limit; a `limit` of null is unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Measure {
    /// Used so far (jobs running, tokens charged or held, bytes kept).
    pub used: u64,
    /// The limit, or null for none.
    pub limit: Option<u64>,
}

/// An account's lanes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct LaneUsage {
    /// Single-GPU models: jobs running against the lane's limit.
    pub small: Measure,
    /// Multi-GPU models.
    pub large: Measure,
}

/// An account's token budgets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct TokenUsage {
    /// The current UTC day.
    pub daily: Measure,
    /// The current UTC month.
    pub monthly: Measure,
    /// The account's life.
    pub total: Measure,
}

/// `GET /v1/account`: the caller's account, its usage against its limits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Usage {
    /// The account the key belongs to.
    pub account: String,
    /// Running jobs per lane.
    pub lanes: LaneUsage,
    /// Tokens charged or held.
    pub tokens: TokenUsage,
    /// Jobs this key submitted in the current UTC month, against its monthly quota.
    pub key_jobs_this_month: Measure,
    /// Bytes the account's kept files take (with the estimates of unfinished jobs), against its
    /// storage budget; null where the backend does not track storage (Kubernetes).
    pub storage_bytes: Option<Measure>,
}

impl Usage {
    /// The usage as of `now`: the ledger's windows rolled first, so yesterday's tokens are
    /// not shown as today's.
    pub fn new(
        account: &str,
        limits: &AccountLimits,
        mut ledger: Ledger,
        key_jobs: u32,
        storage_bytes: Option<Measure>,
        now: UnixMillis,
    ) -> Self {
        ledger.roll(now);
        let measure = |used: u64, limit: Option<u64>| Measure { used, limit };
        Self {
            account: account.to_owned(),
            lanes: LaneUsage {
                small: measure(
                    ledger.active_small.into(),
                    Some(limits.small_concurrency.into()),
                ),
                large: measure(
                    ledger.active_large.into(),
                    Some(limits.large_concurrency.into()),
                ),
            },
            tokens: TokenUsage {
                daily: measure(ledger.tokens_today, limits.daily_tokens),
                monthly: measure(ledger.tokens_month, limits.monthly_tokens),
                total: measure(ledger.tokens_total, limits.total_tokens),
            },
            key_jobs_this_month: measure(key_jobs.into(), Some(limits.monthly_jobs_per_key.into())),
            storage_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(id: &str, created: i64, status: JobStatus) -> JobRecord {
        JobRecord {
            id: id.into(),
            run_id: "r".into(),
            account: "a".into(),
            key_hash: "k".into(),
            model: "m".into(),
            status,
            n_prompts: 1,
            reserved: 2,
            tokens: None,
            created_at: UnixMillis(created),
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
        }
    }

    fn query(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn ids(page: &JobPage) -> Vec<&str> {
        page.jobs.iter().map(|j| j.id.as_str()).collect()
    }

    #[test]
    fn pages_walk_every_job_once_newest_first_with_equal_times_ordered_by_id() {
        let jobs = vec![
            job("b", 1000, JobStatus::Done),
            job("d", 3000, JobStatus::Running),
            job("a", 1000, JobStatus::Failed),
            job("c", 2000, JobStatus::Done),
            job("e", 1000, JobStatus::Cancelled),
        ];
        let mut filter = JobFilter::parse(&query(&[("limit", "2")])).unwrap();
        let mut seen = Vec::new();
        loop {
            let page = page(jobs.clone(), &filter).unwrap();
            seen.extend(ids(&page).into_iter().map(str::to_owned));
            if !page.has_more {
                break;
            }
            filter.after = page.jobs.last().map(|j| j.id.clone());
        }
        assert_eq!(seen, ["d", "c", "e", "b", "a"]);
    }

    #[test]
    fn a_status_filter_keeps_only_that_status_and_has_more_looks_past_the_page() {
        let jobs = vec![
            job("a", 1, JobStatus::Done),
            job("b", 2, JobStatus::Failed),
            job("c", 3, JobStatus::Done),
            job("d", 4, JobStatus::Done),
        ];
        let filter = JobFilter::parse(&query(&[("status", "done"), ("limit", "2")])).unwrap();
        let first = page(jobs.clone(), &filter).unwrap();
        assert_eq!((ids(&first), first.has_more), (vec!["d", "c"], true));
        let rest = JobFilter {
            after: Some("c".into()),
            ..filter
        };
        let second = page(jobs, &rest).unwrap();
        assert_eq!((ids(&second), second.has_more), (vec!["a"], false));
    }

    #[test]
    fn a_cursor_that_is_not_one_of_the_jobs_is_refused_naming_it() {
        let filter = JobFilter {
            limit: 5,
            after: Some("00000000-0000-4000-8000-000000000000".into()),
            status: None,
        };
        let error = page(vec![job("a", 1, JobStatus::Done)], &filter).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("00000000-0000-4000-8000-000000000000"),
            "{error}"
        );
    }

    #[test]
    fn bad_queries_are_refused_naming_the_parameter_and_the_value() {
        for (pairs, needle) in [
            (vec![("limit", "0")], "limit=\"0\""),
            (vec![("limit", "101")], "limit=\"101\""),
            (vec![("limit", "ten")], "limit=\"ten\""),
            (vec![("status", "finished")], "status=\"finished\""),
            (vec![("after", "42")], "after=\"42\""),
            (vec![("page", "2")], "\"page\""),
        ] {
            let error = JobFilter::parse(&query(&pairs)).unwrap_err();
            assert!(error.to_string().contains(needle), "{pairs:?}: {error}");
        }
        assert_eq!(
            JobFilter::parse(&query(&[])).unwrap(),
            JobFilter {
                limit: DEFAULT_PAGE,
                after: None,
                status: None
            }
        );
    }

    #[test]
    fn usage_rolls_the_windows_so_yesterdays_tokens_are_not_counted_today() {
        let yesterday = UnixMillis(1_793_698_200_000);
        let today = UnixMillis(yesterday.0 + 86_400_000);
        let mut ledger = Ledger::new(yesterday);
        ledger.tokens_today = 500;
        ledger.tokens_month = 500;
        ledger.tokens_total = 500;
        ledger.active_small = 2;
        let limits = AccountLimits {
            daily_tokens: Some(1000),
            ..AccountLimits::default()
        };
        let usage = Usage::new("acme", &limits, ledger, 7, None, today);
        assert_eq!(
            usage.tokens.daily,
            Measure {
                used: 0,
                limit: Some(1000)
            }
        );
        assert_eq!(usage.tokens.total.used, 500);
        assert_eq!(
            usage.lanes.small,
            Measure {
                used: 2,
                limit: Some(3)
            }
        );
        assert_eq!(
            usage.key_jobs_this_month,
            Measure {
                used: 7,
                limit: Some(200)
            }
        );
    }
}
