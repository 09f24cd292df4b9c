//! The contract's server-wide limits held across API replicas: one count per account and two
//! overall, four long-polls per key and eight overall. Each replica checks its own counters
//! first (`app`); a backend with several replicas also takes a [`SharedPermit`] from its
//! [`SharedLimits`], which keeps every replica's permits in one object ([`Permits`]) written
//! with optimistic concurrency, so two replicas cannot both take the last one.
//!
//! Each permit carries its own expiry (the end of its long-poll or count, plus a grace), so a
//! replica that dies holding permits frees them without anyone's help.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use harvest_core::clock::UnixMillis;
use serde::{Deserialize, Serialize};

use crate::error::ApiError;

/// Submits counted at once, server-wide (one per account besides).
pub const COUNTS_SERVER_WIDE: usize = 2;
/// Long-polls waiting at once per key.
pub const LONG_POLLS_PER_KEY: usize = 4;
/// Long-polls waiting at once, server-wide.
pub const LONG_POLLS_SERVER_WIDE: usize = 8;

/// How long past its holder's own end a permit lasts, so that clocks a little apart between
/// replicas never expire a live one.
pub const EXPIRY_GRACE: Duration = Duration::from_secs(10);

/// What a permit is for, and whose limit it counts against.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Scope {
    /// A long-poll by the key with this id (a prefix of its hash).
    Wait {
        /// The key's id.
        key: String,
    },
    /// A submit of the account being counted.
    Count {
        /// The account.
        account: String,
    },
}

impl Scope {
    /// A long-poll by the key with hash `key_hash`.
    pub fn wait(key_hash: &str) -> Self {
        Self::Wait {
            key: key_hash.chars().take(16).collect(),
        }
    }

    /// A count of a submit of `account`.
    pub fn count(account: &str) -> Self {
        Self::Count {
            account: account.to_owned(),
        }
    }

    /// The limits: (per key or account, overall).
    fn limits(&self) -> (usize, usize) {
        match self {
            Self::Wait { .. } => (LONG_POLLS_PER_KEY, LONG_POLLS_SERVER_WIDE),
            Self::Count { .. } => (1, COUNTS_SERVER_WIDE),
        }
    }

    fn same_kind(&self, other: &Self) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
    }
}

/// One permit held.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// What it is for.
    #[serde(flatten)]
    pub scope: Scope,
    /// When it lapses, whether given back or not (Unix milliseconds).
    pub expires: i64,
}

/// Every permit held across the replicas, by permit id.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Permits(pub BTreeMap<String, Entry>);

impl Permits {
    /// Drops the permits that lapsed before `now`.
    pub fn prune(&mut self, now: UnixMillis) {
        self.0.retain(|_, entry| entry.expires > now.0);
    }

    /// Takes permit `id` for `scope` until `expires`, unless that would pass one of the scope's
    /// limits; whether it is held. Taking an id already held changes nothing.
    pub fn take(&mut self, id: &str, scope: Scope, expires: UnixMillis) -> bool {
        if self.0.contains_key(id) {
            return true;
        }
        let (per_owner, overall) = scope.limits();
        let kind = self.0.values().filter(|e| e.scope.same_kind(&scope));
        let (mut all, mut owners) = (0, 0);
        for entry in kind {
            all += 1;
            owners += usize::from(entry.scope == scope);
        }
        if all >= overall || owners >= per_owner {
            return false;
        }
        self.0.insert(
            id.to_owned(),
            Entry {
                scope,
                expires: expires.0,
            },
        );
        true
    }

    /// Gives permit `id` back; whether it was held.
    pub fn give_back(&mut self, id: &str) -> bool {
        self.0.remove(id).is_some()
    }
}

/// Where the replicas keep their permits.
#[async_trait::async_trait]
pub trait SharedLimits: Send + Sync + std::fmt::Debug {
    /// Takes permit `id` for `scope` for at most `lasts`; `false` when a limit is full.
    async fn take(&self, id: &str, scope: Scope, lasts: Duration) -> Result<bool, ApiError>;

    /// Gives permit `id` back (it lapses on its own if this fails).
    async fn give_back(&self, id: &str) -> Result<(), ApiError>;
}

/// A permit held in [`SharedLimits`]; given back when dropped.
#[derive(Debug)]
pub struct SharedPermit {
    limits: Arc<dyn SharedLimits>,
    id: String,
}

impl SharedPermit {
    /// Takes a permit for `scope` for at most `lasts`: `Ok(None)` when a limit is full.
    pub async fn take(
        limits: &Arc<dyn SharedLimits>,
        scope: Scope,
        lasts: Duration,
    ) -> Result<Option<Self>, ApiError> {
        let id = uuid::Uuid::new_v4().to_string();
        let taken = limits.take(&id, scope, lasts + EXPIRY_GRACE).await?;
        Ok(taken.then(|| Self {
            limits: Arc::clone(limits),
            id,
        }))
    }

    /// Gives the permit back now and waits for it, so that the caller's next request (a submit
    /// after its dry run) finds it free. Dropping it instead gives it back in the background.
    pub async fn give_back(mut self) {
        let id = std::mem::take(&mut self.id);
        if let Err(error) = self.limits.give_back(&id).await {
            tracing::warn!(permit = %id, %error, "could not give a permit back; it lapses on its own");
        }
    }
}

impl Drop for SharedPermit {
    fn drop(&mut self) {
        if self.id.is_empty() {
            return; // given back already
        }
        let (limits, id) = (Arc::clone(&self.limits), std::mem::take(&mut self.id));
        // Outside a runtime (a test dropping it late) the permit simply lapses.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Err(error) = limits.give_back(&id).await {
                    tracing::warn!(permit = %id, %error, "could not give a permit back; it lapses on its own");
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: UnixMillis = UnixMillis(1_793_698_200_000);
    const LATER: UnixMillis = UnixMillis(NOW.0 + 60_000);

    #[test]
    fn a_fifth_wait_of_one_key_and_a_ninth_overall_are_refused() {
        let mut permits = Permits::default();
        for i in 0..4 {
            assert!(permits.take(&format!("a{i}"), Scope::wait("aaaa"), LATER));
        }
        assert!(!permits.take("a4", Scope::wait("aaaa"), LATER));
        for i in 0..4 {
            assert!(permits.take(&format!("b{i}"), Scope::wait("bbbb"), LATER));
        }
        assert!(
            !permits.take("c0", Scope::wait("cccc"), LATER),
            "nine overall"
        );
        assert!(
            permits.take("n0", Scope::count("acme"), LATER),
            "counts are limited apart from waits"
        );
        assert!(permits.give_back("b0"));
        assert!(!permits.give_back("b0"), "given back once");
        assert!(permits.take("c0", Scope::wait("cccc"), LATER));
    }

    /// Permits in memory, given back only after a yield, as a round trip to the apiserver would.
    #[derive(Debug, Default)]
    struct RoundTripLimits {
        permits: std::sync::Mutex<Permits>,
        given_back: std::sync::atomic::AtomicUsize,
    }

    #[async_trait::async_trait]
    impl SharedLimits for RoundTripLimits {
        async fn take(&self, id: &str, scope: Scope, _lasts: Duration) -> Result<bool, ApiError> {
            Ok(self.permits.lock().unwrap().take(id, scope, LATER))
        }

        async fn give_back(&self, id: &str) -> Result<(), ApiError> {
            tokio::task::yield_now().await;
            self.given_back
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            self.permits.lock().unwrap().give_back(id);
            Ok(())
        }
    }

    #[tokio::test]
    async fn a_count_permit_given_back_explicitly_is_free_for_the_accounts_next_submit_at_once() {
        let fake = Arc::new(RoundTripLimits::default());
        let limits: Arc<dyn SharedLimits> = fake.clone();
        let lasts = Duration::from_secs(10);
        let dry_run = SharedPermit::take(&limits, Scope::count("acme"), lasts).await;
        let dry_run = dry_run.unwrap().expect("the first count of the account");
        let meanwhile = SharedPermit::take(&limits, Scope::count("acme"), lasts).await;
        assert!(meanwhile.unwrap().is_none(), "one count per account");
        dry_run.give_back().await;
        let submit = SharedPermit::take(&limits, Scope::count("acme"), lasts).await;
        assert!(
            submit.unwrap().is_some(),
            "free as soon as give_back returns"
        );
        let given_back = fake.given_back.load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(given_back, 1, "given back once, not again when dropped");
    }

    #[test]
    fn one_count_per_account_and_two_overall() {
        let mut permits = Permits::default();
        assert!(permits.take("1", Scope::count("acme"), LATER));
        assert!(!permits.take("2", Scope::count("acme"), LATER));
        assert!(permits.take("3", Scope::count("other"), LATER));
        assert!(!permits.take("4", Scope::count("third"), LATER));
        assert!(
            permits.take("1", Scope::count("acme"), LATER),
            "held already"
        );
    }

    #[test]
    fn permits_of_a_replica_that_died_lapse_at_their_expiry() {
        let mut permits = Permits::default();
        assert!(permits.take("1", Scope::count("acme"), LATER));
        permits.prune(UnixMillis(LATER.0 - 1));
        assert!(!permits.take("2", Scope::count("acme"), LATER));
        permits.prune(LATER);
        assert!(permits.take("2", Scope::count("acme"), LATER));
    }

    #[test]
    fn permits_round_trip_through_the_json_a_lease_annotation_holds() {
        let mut permits = Permits::default();
        permits.take("1", Scope::wait("0123456789abcdef0123"), LATER);
        permits.take("2", Scope::count("acme"), LATER);
        let json = serde_json::to_string(&permits).unwrap();
        assert!(
            json.contains(r#""kind":"wait","key":"0123456789abcdef""#),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<Permits>(&json).unwrap(), permits);
    }
}
