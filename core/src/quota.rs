//! Quota maths shared by the embedded API and the Kubernetes operator: concurrency lanes, token
//! budgets over UTC day and month windows plus an account total, and a monthly job quota per
//! key. Pure: the caller passes `now` and stores the [`Ledger`].
//!
//! A job's reserved tokens are *held* at admission ([`Ledger::admit`] returns a [`Hold`]) and
//! *settled* once when it ends ([`Ledger::finish`] consumes the hold): the hold leaves the
//! windows it was taken in, and what the job is charged enters the current windows.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::clock::{Day, Month, UnixMillis};

/// Concurrency lanes, counted separately per account across all its keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Lane {
    /// Single-GPU models.
    Small,
    /// Multi-GPU models.
    Large,
}

impl std::fmt::Display for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Small => "small",
            Self::Large => "large",
        })
    }
}

/// An account's limits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AccountLimits {
    /// Concurrent jobs on small models.
    pub small_concurrency: u32,
    /// Concurrent jobs on large models.
    pub large_concurrency: u32,
    /// Tokens per UTC day; `None` is unlimited.
    pub daily_tokens: Option<u64>,
    /// Tokens per UTC month.
    pub monthly_tokens: Option<u64>,
    /// Tokens over the account's life.
    pub total_tokens: Option<u64>,
    /// Jobs each key may submit per UTC month.
    pub monthly_jobs_per_key: u32,
}

impl Default for AccountLimits {
    fn default() -> Self {
        Self {
            small_concurrency: 3,
            large_concurrency: 1,
            daily_tokens: None,
            monthly_tokens: None,
            total_tokens: None,
            monthly_jobs_per_key: 200,
        }
    }
}

/// Which budget ran out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BudgetWindow {
    /// The UTC day.
    Daily,
    /// The UTC month.
    Monthly,
    /// The account total.
    Total,
}

/// Why a job cannot be admitted now.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Denial {
    /// The lane is full.
    #[error(
        "the {lane} lane is full: {limit} jobs of this account are already running on {lane} models; wait or cancel one"
    )]
    Concurrency {
        /// The lane.
        lane: Lane,
        /// Its limit.
        limit: u32,
    },
    /// A token budget would be exceeded.
    #[error(
        "the {window:?} token budget is exhausted: {used} of {limit} used, this job needs {requested}"
    )]
    Budget {
        /// Which budget.
        window: BudgetWindow,
        /// Its limit.
        limit: u64,
        /// Used and held so far in the window.
        used: u64,
        /// What the job would hold.
        requested: u64,
    },
    /// The key's monthly job quota is used up.
    #[error("this key has used its monthly quota of {limit} jobs")]
    JobQuota {
        /// The quota.
        limit: u32,
    },
}

/// Tokens a job holds against the ledger until it ends. Not `Clone`: it is settled once.
#[derive(Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hold {
    /// Reserved tokens.
    pub tokens: u64,
    /// The lane slot it occupies.
    pub lane: Lane,
    /// The day window it was taken in.
    pub day: Day,
    /// The month window it was taken in.
    pub month: Month,
}

/// An account's usage: tokens charged or held in the current windows, and running jobs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ledger {
    /// The current day window.
    pub day: Day,
    /// Tokens charged or held today.
    pub tokens_today: u64,
    /// The current month window.
    pub month: Month,
    /// Tokens charged or held this month.
    pub tokens_month: u64,
    /// Tokens charged or held over the account's life.
    pub tokens_total: u64,
    /// Running (admitted, unfinished) jobs on small models.
    pub active_small: u32,
    /// Running jobs on large models.
    pub active_large: u32,
}

impl Ledger {
    /// An empty ledger.
    pub fn new(now: UnixMillis) -> Self {
        Self {
            day: now.day(),
            tokens_today: 0,
            month: now.month(),
            tokens_month: 0,
            tokens_total: 0,
            active_small: 0,
            active_large: 0,
        }
    }

    /// Starts new windows when `now` has left the current ones.
    pub fn roll(&mut self, now: UnixMillis) {
        if now.day() != self.day {
            self.day = now.day();
            self.tokens_today = 0;
        }
        if now.month() != self.month {
            self.month = now.month();
            self.tokens_month = 0;
        }
    }

    fn active(&mut self, lane: Lane) -> &mut u32 {
        match lane {
            Lane::Small => &mut self.active_small,
            Lane::Large => &mut self.active_large,
        }
    }

    /// Running jobs in `lane`.
    pub fn running(&self, lane: Lane) -> u32 {
        match lane {
            Lane::Small => self.active_small,
            Lane::Large => self.active_large,
        }
    }

    /// Checks every limit without changing anything; the first denial found is returned, in
    /// the order lane, job quota, daily, monthly, total.
    pub fn check(
        &self,
        limits: &AccountLimits,
        lane: Lane,
        tokens: u64,
        key_jobs_this_month: u32,
        now: UnixMillis,
    ) -> Result<(), Denial> {
        let mut rolled = self.clone();
        rolled.roll(now);
        let limit = match lane {
            Lane::Small => limits.small_concurrency,
            Lane::Large => limits.large_concurrency,
        };
        if rolled.running(lane) >= limit {
            return Err(Denial::Concurrency { lane, limit });
        }
        if key_jobs_this_month >= limits.monthly_jobs_per_key {
            return Err(Denial::JobQuota {
                limit: limits.monthly_jobs_per_key,
            });
        }
        for (window, limit, used) in [
            (
                BudgetWindow::Daily,
                limits.daily_tokens,
                rolled.tokens_today,
            ),
            (
                BudgetWindow::Monthly,
                limits.monthly_tokens,
                rolled.tokens_month,
            ),
            (
                BudgetWindow::Total,
                limits.total_tokens,
                rolled.tokens_total,
            ),
        ] {
            if let Some(limit) = limit
                && used.saturating_add(tokens) > limit
            {
                return Err(Denial::Budget {
                    window,
                    limit,
                    used,
                    requested: tokens,
                });
            }
        }
        Ok(())
    }

    /// Admits a job: takes a lane slot and holds its tokens, or says why not.
    pub fn admit(
        &mut self,
        limits: &AccountLimits,
        lane: Lane,
        tokens: u64,
        key_jobs_this_month: u32,
        now: UnixMillis,
    ) -> Result<Hold, Denial> {
        self.check(limits, lane, tokens, key_jobs_this_month, now)?;
        self.roll(now);
        *self.active(lane) += 1;
        self.tokens_today += tokens;
        self.tokens_month += tokens;
        self.tokens_total += tokens;
        Ok(Hold {
            tokens,
            lane,
            day: self.day,
            month: self.month,
        })
    }

    /// Ends a job: frees its lane slot, drops its hold from the windows it was taken in (if they
    /// are still current) and charges `charged` tokens to the current windows.
    pub fn finish(&mut self, hold: Hold, charged: u64, now: UnixMillis) {
        self.roll(now);
        let slot = self.active(hold.lane);
        *slot = slot.saturating_sub(1);
        if hold.day == self.day {
            self.tokens_today = self.tokens_today.saturating_sub(hold.tokens);
        }
        if hold.month == self.month {
            self.tokens_month = self.tokens_month.saturating_sub(hold.tokens);
        }
        self.tokens_total = self.tokens_total.saturating_sub(hold.tokens);
        self.tokens_today += charged;
        self.tokens_month += charged;
        self.tokens_total += charged;
    }
}

/// What [`Book::admit`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admitted {
    /// The job now holds a lane slot and its tokens.
    New,
    /// The job already held them (a repeated admission after a crash or a lost race): nothing
    /// changed.
    AlreadyHeld,
}

/// An account's books as a cluster stores them: the [`Ledger`], the open [`Hold`] of each
/// running job keyed by job id, and how many jobs each key started this UTC month. Keyed holds
/// make admission and settlement idempotent, so a controller that restarts between writing the
/// books and writing the job neither loses nor repeats a charge.
#[derive(Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Book {
    /// Usage in the current windows.
    pub ledger: Ledger,
    /// Open holds by job id.
    pub holds: BTreeMap<String, Hold>,
    /// Jobs admitted this month (the ledger's month) by key.
    pub key_jobs: BTreeMap<String, u32>,
}

impl Book {
    /// Empty books.
    pub fn new(now: UnixMillis) -> Self {
        Self {
            ledger: Ledger::new(now),
            holds: BTreeMap::new(),
            key_jobs: BTreeMap::new(),
        }
    }

    /// Starts new windows when `now` has left the current ones; a new month clears the
    /// per-key job counts.
    pub fn roll(&mut self, now: UnixMillis) {
        if now.month() != self.ledger.month {
            self.key_jobs.clear();
        }
        self.ledger.roll(now);
    }

    /// Jobs `key` started in `now`'s month.
    pub fn jobs_of(&self, key: &str, now: UnixMillis) -> u32 {
        if now.month() == self.ledger.month {
            self.key_jobs.get(key).copied().unwrap_or(0)
        } else {
            0
        }
    }

    /// Whether `job` holds a slot.
    pub fn holds(&self, job: &str) -> bool {
        self.holds.contains_key(job)
    }

    /// Checks every limit for a new job of `key` without changing anything.
    pub fn check(
        &self,
        limits: &AccountLimits,
        key: &str,
        lane: Lane,
        tokens: u64,
        now: UnixMillis,
    ) -> Result<(), Denial> {
        self.ledger
            .check(limits, lane, tokens, self.jobs_of(key, now), now)
    }

    /// Admits `job` of `key` unless it already holds a slot.
    pub fn admit(
        &mut self,
        job: &str,
        key: &str,
        limits: &AccountLimits,
        lane: Lane,
        tokens: u64,
        now: UnixMillis,
    ) -> Result<Admitted, Denial> {
        if self.holds(job) {
            return Ok(Admitted::AlreadyHeld);
        }
        let jobs = self.jobs_of(key, now);
        let hold = self.ledger.admit(limits, lane, tokens, jobs, now)?;
        self.roll(now);
        *self.key_jobs.entry(key.to_owned()).or_default() += 1;
        self.holds.insert(job.to_owned(), hold);
        Ok(Admitted::New)
    }

    /// Settles `job`'s hold at `charged` tokens; `false` (and no change) when it holds none,
    /// so settling twice charges once.
    pub fn settle(&mut self, job: &str, charged: u64, now: UnixMillis) -> bool {
        match self.holds.remove(job) {
            Some(hold) => {
                self.roll(now);
                self.ledger.finish(hold, charged, now);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: UnixMillis = UnixMillis(1_793_698_200_000);

    fn limits() -> AccountLimits {
        AccountLimits {
            daily_tokens: Some(1_000),
            monthly_tokens: Some(5_000),
            total_tokens: Some(20_000),
            ..Default::default()
        }
    }

    #[test]
    fn the_fourth_small_job_is_denied_naming_the_lane_while_large_is_separate() {
        let mut ledger = Ledger::new(NOW);
        let holds: Vec<Hold> = (0..3)
            .map(|_| ledger.admit(&limits(), Lane::Small, 10, 0, NOW).unwrap())
            .collect();
        let denial = ledger
            .admit(&limits(), Lane::Small, 10, 0, NOW)
            .unwrap_err();
        assert_eq!(
            denial,
            Denial::Concurrency {
                lane: Lane::Small,
                limit: 3
            }
        );
        assert!(denial.to_string().contains("small lane"));
        ledger.admit(&limits(), Lane::Large, 10, 0, NOW).unwrap();
        assert!(ledger.admit(&limits(), Lane::Large, 10, 0, NOW).is_err());
        let first = holds.into_iter().next().unwrap();
        ledger.finish(first, 0, NOW);
        ledger.admit(&limits(), Lane::Small, 10, 0, NOW).unwrap();
    }

    #[test]
    fn holds_count_against_budgets_and_settle_to_the_charge() {
        let mut ledger = Ledger::new(NOW);
        let hold = ledger.admit(&limits(), Lane::Small, 900, 0, NOW).unwrap();
        let denial = ledger
            .admit(&limits(), Lane::Small, 200, 0, NOW)
            .unwrap_err();
        assert!(matches!(
            denial,
            Denial::Budget {
                window: BudgetWindow::Daily,
                used: 900,
                ..
            }
        ));
        ledger.finish(hold, 300, NOW);
        assert_eq!(
            (
                ledger.tokens_today,
                ledger.tokens_month,
                ledger.tokens_total
            ),
            (300, 300, 300)
        );
        ledger.admit(&limits(), Lane::Small, 700, 0, NOW).unwrap();
    }

    #[test]
    fn a_new_utc_day_resets_the_daily_window_but_not_the_month() {
        let mut ledger = Ledger::new(NOW);
        let hold = ledger.admit(&limits(), Lane::Small, 1_000, 0, NOW).unwrap();
        let tomorrow = NOW.day().end();
        ledger.finish(hold, 1_000, NOW);
        assert!(ledger.check(&limits(), Lane::Small, 1, 0, NOW).is_err());
        ledger
            .admit(&limits(), Lane::Small, 1_000, 0, tomorrow)
            .unwrap();
        assert_eq!(ledger.tokens_month, 2_000);
    }

    #[test]
    fn a_hold_from_yesterday_settles_without_touching_today() {
        let mut ledger = Ledger::new(NOW);
        let hold = ledger.admit(&limits(), Lane::Small, 800, 0, NOW).unwrap();
        let tomorrow = NOW.day().end();
        ledger.finish(hold, 800, tomorrow);
        assert_eq!(
            ledger.tokens_today, 800,
            "charged today, the hold left with yesterday's window"
        );
        assert_eq!(ledger.tokens_month, 800);
    }

    #[test]
    fn the_monthly_job_quota_is_per_key() {
        let ledger = Ledger::new(NOW);
        assert_eq!(
            ledger.check(&limits(), Lane::Small, 1, 200, NOW),
            Err(Denial::JobQuota { limit: 200 })
        );
        assert!(ledger.check(&limits(), Lane::Small, 1, 199, NOW).is_ok());
    }

    /// A seeded random walk of admissions and settlements: lanes are never exceeded, usage
    /// never goes negative, and when every job has ended the ledger equals the sum of charges.
    #[test]
    fn random_admissions_never_exceed_lanes_and_end_at_the_sum_of_charges() {
        let mut state = 42u64;
        let mut random = |n: u64| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) % n
        };
        let limits = AccountLimits {
            daily_tokens: Some(50_000),
            ..Default::default()
        };
        let start = NOW.day().start();
        let mut ledger = Ledger::new(start);
        let mut live: Vec<Hold> = Vec::new();
        let mut charged_today = 0u64;
        for step in 0..5_000i64 {
            let now = start.plus_millis(step * 10_000);
            if now.day() != start.day() {
                break;
            }
            if random(2) == 0 {
                let lane = if random(4) == 0 {
                    Lane::Large
                } else {
                    Lane::Small
                };
                if let Ok(hold) = ledger.admit(&limits, lane, random(3_000), 0, now) {
                    live.push(hold);
                }
            } else if !live.is_empty() {
                let hold = live.swap_remove(random(live.len() as u64) as usize);
                let charge = random(hold.tokens + 1);
                charged_today += charge;
                ledger.finish(hold, charge, now);
            }
            assert!(
                ledger.active_small <= 3 && ledger.active_large <= 1,
                "step {step}"
            );
            let held: u64 = live.iter().map(|h| h.tokens).sum();
            assert_eq!(ledger.tokens_today, charged_today + held, "step {step}");
        }
        let end = start.plus_millis(86_399_000);
        for hold in live.drain(..) {
            ledger.finish(hold, 0, end);
        }
        assert_eq!((ledger.active_small, ledger.active_large), (0, 0));
        assert_eq!(ledger.tokens_today, charged_today);
    }
}
