//! The `HarvestAccount` custom resource: who pays for jobs, in Kueue's ClusterQueue style but
//! counted in tokens. Cluster-scoped; its spec binds namespaces and sets limits, and its status
//! is the usage ledger, written only by the operator's leader with resourceVersion
//! preconditions. Jobs are deleted by TTL, so this status, not the jobs, is the source of truth.

use std::collections::BTreeMap;

use harvest_core::clock::UnixMillis;
use harvest_core::quota::{AccountLimits, Book, Hold, Lane, Ledger};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// An account's bindings and limits.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "harvest.dev",
    version = "v1alpha1",
    kind = "HarvestAccount",
    shortname = "hacct",
    category = "harvest",
    status = "HarvestAccountStatus",
    printcolumn = r#"{"name": "Small", "type": "string", "jsonPath": ".status.lanes.small"}"#,
    printcolumn = r#"{"name": "Large", "type": "string", "jsonPath": ".status.lanes.large"}"#,
    printcolumn = r#"{"name": "Pending", "type": "integer", "jsonPath": ".status.pendingJobs"}"#,
    printcolumn = r#"{"name": "Today", "type": "string", "jsonPath": ".status.budgets.today"}"#,
    printcolumn = r#"{"name": "Month", "type": "string", "jsonPath": ".status.budgets.month"}"#,
    printcolumn = r#"{"name": "Jobs", "type": "integer", "jsonPath": ".status.jobsThisMonth"}"#,
    printcolumn = r#"{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct HarvestAccountSpec {
    /// Namespaces whose HarvestJobs this account pays for. A namespace belongs to one account.
    #[serde(default)]
    #[schemars(length(max = 256))]
    pub namespaces: Vec<String>,
    /// Concurrent jobs per lane.
    #[serde(default)]
    pub lanes: LaneLimits,
    /// Tokens per UTC day; unset is unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub daily_tokens: Option<u64>,
    /// Tokens per UTC month; unset is unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub monthly_tokens: Option<u64>,
    /// Tokens over the account's life; unset is unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_tokens: Option<u64>,
    /// Jobs each API key (or, for jobs applied directly, each namespace) may start per UTC month.
    #[serde(default = "default_monthly_jobs")]
    #[schemars(range(min = 0))]
    pub monthly_jobs_per_key: u32,
    /// Where this account's jobs may read and write: `s3://bucket/prefix`es or absolute
    /// paths. A job whose `input` or `output` lies outside all of them is refused at
    /// admission. Empty, jobs may name any location the workers' credentials reach.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16), inner(length(min = 2, max = 1024)))]
    #[x_kube(validation = Rule::new("self.all(p, p.startsWith('s3://') || p.startsWith('/'))")
        .message("each storagePrefixes item must be s3://bucket/prefix or an absolute path"))]
    pub storage_prefixes: Vec<String>,
    /// The account's own storage: the operator puts the output of each job that names none
    /// under its prefix, and reads inputs only from there (or the `storagePrefixes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage: Option<AccountStorage>,
    /// The Kueue LocalQueue (in the namespace the workers run in) that admits this account's
    /// worker Pods, over the catalogue entry's `localQueue`. Unset: the entry's, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub local_queue: Option<String>,
}

/// An account's storage.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct AccountStorage {
    /// `s3://bucket/prefix` or an absolute path. A job without `spec.output` writes to
    /// `<prefix>/<namespace>/<name>-<uid>`, chosen by the operator.
    #[x_kube(validation = Rule::new("self.startsWith('s3://') || self.startsWith('/')")
        .message("prefix must be s3://bucket/prefix or an absolute path"))]
    #[schemars(length(min = 2))]
    pub prefix: String,
    /// A Secret in the operator's worker namespace whose keys become the environment of this
    /// account's workers (their storage credentials) instead of the catalogue's
    /// `workerEnvSecret`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret: Option<String>,
}

/// Concurrency per lane.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct LaneLimits {
    /// Concurrent jobs on single-GPU models.
    pub small: u32,
    /// Concurrent jobs on multi-GPU models.
    pub large: u32,
}

impl Default for LaneLimits {
    fn default() -> Self {
        let limits = AccountLimits::default();
        Self {
            small: limits.small_concurrency,
            large: limits.large_concurrency,
        }
    }
}

fn default_monthly_jobs() -> u32 {
    AccountLimits::default().monthly_jobs_per_key
}

impl HarvestAccountSpec {
    /// The limits the quota maths apply.
    pub fn limits(&self) -> AccountLimits {
        AccountLimits {
            small_concurrency: self.lanes.small,
            large_concurrency: self.lanes.large,
            daily_tokens: self.daily_tokens,
            monthly_tokens: self.monthly_tokens,
            total_tokens: self.total_tokens,
            monthly_jobs_per_key: self.monthly_jobs_per_key,
        }
    }

    /// An account paying for `namespaces` with the default limits and no token budgets.
    pub fn for_namespaces(namespaces: &[&str]) -> Self {
        Self {
            namespaces: namespaces.iter().map(|n| (*n).to_owned()).collect(),
            lanes: LaneLimits::default(),
            daily_tokens: None,
            monthly_tokens: None,
            total_tokens: None,
            monthly_jobs_per_key: default_monthly_jobs(),
            storage_prefixes: Vec::new(),
            storage: None,
            local_queue: None,
        }
    }
}

/// The usage ledger. Windows are UTC; counts include the holds of running jobs.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HarvestAccountStatus {
    /// The current day window's start (UTC midnight).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub day_start: Option<Time>,
    /// When the day window ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub day_end: Option<Time>,
    /// The current month window's start (the 1st, UTC midnight).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub month_start: Option<Time>,
    /// When the month window ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub month_end: Option<Time>,
    /// Tokens charged or held today.
    #[serde(default)]
    pub tokens_today: u64,
    /// Tokens charged or held this month.
    #[serde(default)]
    pub tokens_this_month: u64,
    /// Tokens charged or held over the account's life.
    #[serde(default)]
    pub tokens_total: u64,
    /// Jobs started this month, all keys together.
    #[serde(default)]
    pub jobs_this_month: u32,
    /// Jobs started this month per key (`key:<hash>` for API keys, `namespace:<ns>` otherwise).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub jobs_by_key: BTreeMap<String, u32>,
    /// Running jobs per lane.
    #[serde(default)]
    pub active: LaneCounts,
    /// Jobs of this account waiting for admission.
    #[serde(default)]
    pub pending_jobs: u32,
    /// The tokens each running job holds, by job UID; settled (removed) when the job ends.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["uid"]))]
    pub holds: Vec<HoldEntry>,
    /// Jobs with a TTL that ran to their end, newest last, at most [`MAX_RAN`]: a job that a
    /// GitOps tool recreates from the same manifest after the TTL deleted it is recognised by
    /// name and spec digest, and ends `AlreadyRan` instead of running and being charged again.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["uid"]))]
    pub ran: Vec<RanEntry>,
    /// `used/limit` per lane, for `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lanes: Option<LaneSummary>,
    /// `used/limit` per budget, for `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budgets: Option<BudgetSummary>,
    /// The spec generation the operator has read: a job admitted before this reaches
    /// `metadata.generation` may have been judged by the limits and storage prefixes of the
    /// edit before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// What a newer release wrote that this one does not know, kept as it is: the ledger is
    /// written back whole, and after a rollback the older operator must not drop it.
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(skip)]
    pub newer: BTreeMap<String, serde_json::Value>,
}

/// Running jobs per lane.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct LaneCounts {
    /// On single-GPU models.
    pub small: u32,
    /// On multi-GPU models.
    pub large: u32,
}

/// `used/limit` lines per lane.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct LaneSummary {
    /// Small lane.
    pub small: String,
    /// Large lane.
    pub large: String,
}

/// `used/limit` lines per budget window (`-` for unlimited).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct BudgetSummary {
    /// Today.
    pub today: String,
    /// This month.
    pub month: String,
}

/// Jobs an account remembers having run ([`HarvestAccountStatus::ran`]): about 300 bytes each.
pub const MAX_RAN: usize = 500;

/// A job with a TTL that ran to its end.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RanEntry {
    /// The job's UID.
    pub uid: String,
    /// `namespace/name`.
    pub job: String,
    /// [`crate::HarvestJobSpec::digest`] of its spec.
    pub spec_digest: String,
    /// `Succeeded`, `Failed` or `Cancelled`.
    pub phase: String,
    /// Tokens charged for it.
    pub charged: u64,
    /// When its hold was settled.
    pub settled_at: Time,
}

impl HarvestAccountStatus {
    /// Remembers `entry`, dropping the oldest past [`MAX_RAN`]; an entry of the same UID is
    /// replaced.
    pub fn remember_ran(&mut self, entry: RanEntry) {
        self.ran.retain(|r| r.uid != entry.uid);
        self.ran.push(entry);
        let over = self.ran.len().saturating_sub(MAX_RAN);
        self.ran.drain(..over);
    }

    /// The run of another job of the same name and spec as the job `uid` at `key`
    /// (`namespace/name`) with spec digest `digest`, if one is remembered.
    pub fn ran_before(&self, key: &str, digest: &str, uid: &str) -> Option<&RanEntry> {
        self.ran
            .iter()
            .rev()
            .find(|r| r.job == key && r.spec_digest == digest && r.uid != uid)
    }
}

/// One running job's hold.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct HoldEntry {
    /// The job's UID (a job recreated under the same name is another job).
    pub uid: String,
    /// `namespace/name`, for people.
    pub job: String,
    /// Reserved tokens.
    pub tokens: u64,
    /// `small` or `large`.
    pub lane: LaneName,
    /// When it was taken (its day and month windows follow).
    pub taken_at: Time,
}

/// A lane as the schema spells it.
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LaneName {
    /// Single-GPU models.
    Small,
    /// Multi-GPU models.
    Large,
}

impl From<Lane> for LaneName {
    fn from(lane: Lane) -> Self {
        match lane {
            Lane::Small => Self::Small,
            Lane::Large => Self::Large,
        }
    }
}

impl From<LaneName> for Lane {
    fn from(lane: LaneName) -> Self {
        match lane {
            LaneName::Small => Self::Small,
            LaneName::Large => Self::Large,
        }
    }
}

/// A `jiff` timestamp as the quota maths' clock.
pub fn millis(t: Timestamp) -> UnixMillis {
    UnixMillis(t.as_millisecond())
}

fn time(t: UnixMillis) -> Time {
    Time(Timestamp::from_millisecond(t.0).unwrap_or(Timestamp::UNIX_EPOCH))
}

impl HarvestAccountStatus {
    /// The books this status stores; a fresh account's are empty books at `now`.
    pub fn book(&self, now: UnixMillis) -> Book {
        let (Some(day), Some(month)) = (&self.day_start, &self.month_start) else {
            return Book::new(now);
        };
        let ledger = Ledger {
            day: millis(day.0).day(),
            tokens_today: self.tokens_today,
            month: millis(month.0).month(),
            tokens_month: self.tokens_this_month,
            tokens_total: self.tokens_total,
            active_small: self.active.small,
            active_large: self.active.large,
        };
        let holds = self
            .holds
            .iter()
            .map(|entry| {
                let taken = millis(entry.taken_at.0);
                let hold = Hold {
                    tokens: entry.tokens,
                    lane: entry.lane.into(),
                    day: taken.day(),
                    month: taken.month(),
                };
                (entry.uid.clone(), hold)
            })
            .collect();
        Book {
            ledger,
            holds,
            key_jobs: self.jobs_by_key.clone(),
        }
    }

    /// Writes `book` into this status. `names` gives each held job's `namespace/name` and
    /// `taken` when each hold was taken (kept from the previous status, or now for new holds).
    pub fn store(
        &mut self,
        book: &Book,
        limits: &AccountLimits,
        names: &BTreeMap<String, String>,
        now: UnixMillis,
    ) {
        let previous: BTreeMap<String, HoldEntry> =
            self.holds.drain(..).map(|e| (e.uid.clone(), e)).collect();
        let ledger = &book.ledger;
        self.day_start = Some(time(ledger.day.start()));
        self.day_end = Some(time(ledger.day.end()));
        self.month_start = Some(time(ledger.month.start()));
        self.month_end = Some(time(ledger.month.end()));
        self.tokens_today = ledger.tokens_today;
        self.tokens_this_month = ledger.tokens_month;
        self.tokens_total = ledger.tokens_total;
        self.jobs_by_key = book.key_jobs.clone();
        self.jobs_this_month = book.key_jobs.values().sum();
        self.active = LaneCounts {
            small: ledger.active_small,
            large: ledger.active_large,
        };
        self.holds = book
            .holds
            .iter()
            .map(|(uid, hold)| {
                let known = previous.get(uid);
                HoldEntry {
                    uid: uid.clone(),
                    job: names
                        .get(uid)
                        .cloned()
                        .or_else(|| known.map(|e| e.job.clone()))
                        .unwrap_or_default(),
                    tokens: hold.tokens,
                    lane: hold.lane.into(),
                    taken_at: known.map_or_else(|| time(now), |e| e.taken_at.clone()),
                }
            })
            .collect();
        let of = |used: u64, limit: Option<u64>| match limit {
            Some(limit) => format!("{used}/{limit}"),
            None => format!("{used}/-"),
        };
        self.lanes = Some(LaneSummary {
            small: format!("{}/{}", ledger.active_small, limits.small_concurrency),
            large: format!("{}/{}", ledger.active_large, limits.large_concurrency),
        });
        self.budgets = Some(BudgetSummary {
            today: of(ledger.tokens_today, limits.daily_tokens),
            month: of(ledger.tokens_month, limits.monthly_tokens),
        });
    }
}

impl HarvestAccount {
    /// The account's status, or an empty one.
    pub fn status_or_default(&self) -> HarvestAccountStatus {
        self.status.clone().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_newer_releases_ledger_fields_survive_this_releases_read_and_write_back() {
        let written_by_newer = serde_json::json!({
            "tokensTotal": 900,
            "tokensByModel": {"llama-8b": 900},
        });
        let read: HarvestAccountStatus = serde_json::from_value(written_by_newer).unwrap();
        assert_eq!(read.tokens_total, 900);
        let written_back = serde_json::to_value(&read).unwrap();
        assert_eq!(
            written_back["tokensByModel"],
            serde_json::json!({"llama-8b": 900})
        );
    }

    #[test]
    fn books_survive_a_round_trip_through_the_status_with_their_hold_windows() {
        let now = UnixMillis(1_793_698_200_000);
        let limits = AccountLimits {
            daily_tokens: Some(1_000),
            ..AccountLimits::default()
        };
        let mut book = Book::new(now);
        book.admit("uid-1", "namespace:team", &limits, Lane::Small, 300, now)
            .unwrap();
        let mut status = HarvestAccountStatus::default();
        let names = BTreeMap::from([("uid-1".to_owned(), "team/j".to_owned())]);
        status.store(&book, &limits, &names, now);
        assert_eq!(status.book(now), book);
        assert_eq!(status.holds[0].job, "team/j");
        assert_eq!(status.budgets.as_ref().unwrap().today, "300/1000");
        assert_eq!(status.lanes.as_ref().unwrap().small, "1/3");
        assert_eq!(status.jobs_this_month, 1);

        // A hold taken yesterday settles out of yesterday's window, not today's.
        let tomorrow = now.day().end();
        let mut restored = status.book(tomorrow);
        assert!(restored.settle("uid-1", 250, tomorrow));
        assert_eq!(restored.ledger.tokens_today, 250);
        assert_eq!(restored.ledger.tokens_total, 250);
    }

    fn ran(uid: &str, job: &str, digest: &str) -> RanEntry {
        RanEntry {
            uid: uid.into(),
            job: job.into(),
            spec_digest: digest.into(),
            phase: "Succeeded".into(),
            charged: 10,
            settled_at: Time(Timestamp::UNIX_EPOCH),
        }
    }

    #[test]
    fn an_account_remembers_the_newest_runs_and_finds_another_job_of_the_same_name_and_spec() {
        let mut status = HarvestAccountStatus::default();
        for i in 0..MAX_RAN + 3 {
            status.remember_ran(ran(&format!("u{i}"), &format!("ns/j{i}"), "d"));
        }
        assert_eq!(status.ran.len(), MAX_RAN);
        assert_eq!(status.ran[0].uid, "u3", "the oldest go first");
        let key = format!("ns/j{MAX_RAN}");
        assert!(status.ran_before(&key, "d", "new-uid").is_some());
        assert!(
            status.ran_before(&key, "other", "new-uid").is_none(),
            "another spec"
        );
        assert!(
            status.ran_before("ns/j0", "d", "new-uid").is_none(),
            "forgotten"
        );
        assert!(
            status
                .ran_before(&key, "d", &format!("u{MAX_RAN}"))
                .is_none(),
            "itself"
        );
    }
}
