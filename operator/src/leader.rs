//! Leader election with a `coordination.k8s.io/v1` Lease: one replica reconciles, the others
//! wait. The choice is pure ([`step`]), as is what the election says of the replica's health
//! ([`health`]); the loop around them does the I/O.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use tokio::time::Instant;
use tracing::{info, warn};

use crate::error::{Error, Result};

/// What to do with the Lease now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseStep {
    /// Nobody holds it (or the holder let it lapse): take it.
    Acquire,
    /// We hold it: renew it.
    Renew,
    /// Someone else holds it for `left` more, unless they renew it.
    Wait {
        /// The holder.
        holder: String,
        /// How long until it lapses, counted on this replica's clock.
        left: Duration,
    },
}

/// Decides what `me` does with the Lease, given how long this replica has seen its record
/// unchanged. Expiry is judged by that locally observed time, as client-go does, never by
/// comparing the holder's `renewTime` with this machine's clock: clocks differ between nodes.
pub fn step(spec: Option<&LeaseSpec>, me: &str, unchanged_for: Duration) -> LeaseStep {
    let Some(spec) = spec else {
        return LeaseStep::Acquire;
    };
    let holder = spec.holder_identity.clone().unwrap_or_default();
    if holder == me {
        return LeaseStep::Renew;
    }
    let duration =
        Duration::from_secs(u64::try_from(spec.lease_duration_seconds.unwrap_or(15)).unwrap_or(15));
    if holder.is_empty() || unchanged_for >= duration {
        LeaseStep::Acquire
    } else {
        LeaseStep::Wait {
            holder,
            left: duration - unchanged_for,
        }
    }
}

/// The Lease record last seen and when this replica first saw it so.
#[derive(Debug, Clone, Default)]
struct Observation {
    record: Option<(Option<String>, Option<MicroTime>, Option<i32>)>,
    since: Option<Instant>,
}

impl Observation {
    /// How long `spec` has been seen unchanged, as of `now`.
    fn unchanged_for(&mut self, spec: Option<&LeaseSpec>, now: Instant) -> Duration {
        let record = spec.map(|s| {
            (
                s.holder_identity.clone(),
                s.renew_time.clone(),
                s.lease_transitions,
            )
        });
        if self.since.is_none() || record != self.record {
            self.record = record;
            self.since = Some(now);
        }
        self.since.map_or(Duration::ZERO, |since| now - since)
    }
}

/// How long a follower may go without any answer from the apiserver before `/healthz` fails,
/// so that the kubelet restarts it with fresh connections and a fresh token. A blip is far
/// shorter; a follower rides it out.
pub const UNREACHABLE_GRACE: Duration = Duration::from_secs(300);

/// What the election has seen of this replica, as `/healthz` and `/metrics` read it.
#[derive(Debug, Clone)]
pub struct Seen {
    /// Whether this replica leads (or runs without election).
    pub leading: bool,
    /// When the election started.
    pub started: Instant,
    /// When an election round last got an answer from the apiserver (a conflict included).
    pub reached: Option<Instant>,
    /// When this replica last took or renewed the Lease.
    pub renewed: Option<Instant>,
    /// The last failed round's error.
    pub last_error: Option<String>,
    /// Failed rounds so far.
    pub errors: u64,
}

/// Whether a liveness probe should pass: `Err` says why restarting the replica would help. A
/// leader past its Lease without a renewal is wedged (it should have stopped leading); a
/// follower that has reached no apiserver for [`UNREACHABLE_GRACE`] holds dead connections.
pub fn health(seen: &Seen, lease: Duration, now: Instant) -> std::result::Result<(), String> {
    let error = || {
        seen.last_error
            .as_deref()
            .map_or(String::new(), |e| format!(" (last error: {e})"))
    };
    if seen.leading {
        if let Some(renewed) = seen.renewed {
            let since = now - renewed;
            if since > lease {
                return Err(format!(
                    "leading, but the Lease was last renewed {} s ago, past its {} s{}",
                    since.as_secs(),
                    lease.as_secs(),
                    error()
                ));
            }
        }
        return Ok(());
    }
    let since = now - seen.reached.unwrap_or(seen.started);
    if since > UNREACHABLE_GRACE {
        return Err(format!(
            "following, and no election round has reached the apiserver for {} s{}",
            since.as_secs(),
            error()
        ));
    }
    Ok(())
}

/// The election's record of this replica, shared by the election loop and the HTTP endpoint.
#[derive(Debug, Clone)]
pub struct Election {
    seen: Arc<Mutex<Seen>>,
    lease: Duration,
}

impl Election {
    /// A replica that elects a leader with a Lease of `lease`, following until it wins.
    pub fn new(lease: Duration) -> Self {
        Self::starting(false, lease)
    }

    /// A replica that runs without election: it leads from the start.
    pub fn alone() -> Self {
        Self::starting(true, Duration::MAX)
    }

    fn starting(leading: bool, lease: Duration) -> Self {
        let seen = Seen {
            leading,
            started: Instant::now(),
            reached: None,
            renewed: None,
            last_error: None,
            errors: 0,
        };
        Self {
            seen: Arc::new(Mutex::new(seen)),
            lease,
        }
    }

    /// What has been seen so far.
    pub fn seen(&self) -> Seen {
        self.lock().clone()
    }

    /// [`health`] as of now.
    pub fn health(&self) -> std::result::Result<(), String> {
        health(&self.seen(), self.lease, Instant::now())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A round the apiserver answered; `held` when this replica holds the Lease after it.
    fn answered(&self, held: bool) {
        let mut seen = self.lock();
        let now = Instant::now();
        seen.reached = Some(now);
        seen.leading = held;
        if held {
            seen.renewed = Some(now);
        }
    }

    /// A round that failed; true when its error differs from the last one (worth a log line).
    fn failed(&self, error: String) -> bool {
        let mut seen = self.lock();
        seen.errors += 1;
        let new = seen.last_error.as_deref() != Some(error.as_str());
        seen.last_error = Some(error);
        new
    }

    fn lost(&self) {
        self.lock().leading = false;
    }
}

/// A held Lease.
#[derive(Debug)]
pub struct Leadership {
    api: Api<Lease>,
    name: String,
    me: String,
    duration: Duration,
    observed: Mutex<Observation>,
    election: Election,
}

/// How long the leader keeps trying to renew before it gives up leading: shorter than the
/// Lease, so that it stops before another replica may take over.
fn renew_deadline(duration: Duration) -> Duration {
    duration * 2 / 3
}

impl Leadership {
    /// Waits until this replica holds the Lease `name`, riding out apiserver errors (each
    /// round bounded by the Lease's duration): a follower that exited on one would
    /// crash-loop through a blip. What it sees goes to `election`.
    pub async fn acquire(
        api: Api<Lease>,
        name: &str,
        me: &str,
        duration: Duration,
        election: Election,
    ) -> Self {
        let this = Self {
            api,
            name: name.to_owned(),
            me: me.to_owned(),
            duration,
            observed: Mutex::default(),
            election,
        };
        loop {
            match tokio::time::timeout(duration, this.try_hold()).await {
                Ok(Ok(held)) => {
                    this.election.answered(held);
                    if held {
                        info!(lease = %this.name, identity = %this.me, "acquired leadership");
                        return this;
                    }
                }
                // Another replica wrote the Lease first: an answer, not a failure.
                Ok(Err(Error::Kube(kube::Error::Api(status)))) if status.code == 409 => {
                    this.election.answered(false);
                }
                Ok(Err(error)) => this.follower_failed(error.to_string()),
                Err(_) => {
                    let waited = duration.as_millis();
                    this.follower_failed(format!("no answer within {waited} ms"));
                }
            }
            tokio::time::sleep(this.duration / 3).await;
        }
    }

    /// Logs a follower's failed round when its error is new (the same error every few seconds
    /// through an outage would bury the log); `/healthz` and the metrics count them all.
    fn follower_failed(&self, error: String) {
        if self.election.failed(error.clone()) {
            warn!(%error, lease = %self.name, "reading the Lease failed; still following, retrying");
        }
    }

    /// Renews the Lease every third of its duration; returns when leadership is lost: another
    /// replica holds it, or no renewal succeeded for the renew deadline (two thirds of the
    /// Lease). A failed renewal is retried meanwhile, each try bounded by what is left.
    pub async fn keep(&self) -> Error {
        let deadline = renew_deadline(self.duration);
        let mut renewed = Instant::now();
        let mut wait = self.duration / 3;
        loop {
            tokio::time::sleep(wait).await;
            let left = deadline.saturating_sub(renewed.elapsed());
            let attempt = tokio::time::timeout(left, self.try_hold()).await;
            let error = match attempt {
                Ok(Ok(true)) => {
                    self.election.answered(true);
                    renewed = Instant::now();
                    wait = self.duration / 3;
                    continue;
                }
                Ok(Ok(false)) => {
                    self.election.lost();
                    let holder = self
                        .api
                        .get_opt(&self.name)
                        .await
                        .ok()
                        .flatten()
                        .and_then(|l| l.spec)
                        .and_then(|s| s.holder_identity)
                        .unwrap_or_default();
                    return Error::LostLeadership {
                        lease: self.name.clone(),
                        holder,
                    };
                }
                Ok(Err(error)) => error.to_string(),
                Err(_) => format!("no answer within {} ms", left.as_millis()),
            };
            self.election.failed(error.clone());
            if renewed.elapsed() >= deadline {
                self.election.lost();
                return Error::LostLeadership {
                    lease: self.name.clone(),
                    holder: format!(
                        "nobody known: no renewal succeeded for {} s ({error})",
                        deadline.as_secs()
                    ),
                };
            }
            warn!(%error, lease = %self.name, "renewing the Lease failed; retrying before the renew deadline");
            wait = (self.duration / 15).max(Duration::from_millis(100));
        }
    }

    /// Gives the Lease up on a clean stop, so another replica takes it at its next round
    /// instead of waiting out the Lease. Best effort: a failure only means the wait.
    pub async fn release(&self) {
        let Ok(Some(mut lease)) = self.api.get_opt(&self.name).await else {
            return;
        };
        let Some(spec) = lease.spec.as_mut() else {
            return;
        };
        if spec.holder_identity.as_deref() != Some(self.me.as_str()) {
            return;
        }
        spec.holder_identity = None;
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        let released = self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await;
        if let Err(error) = released {
            tracing::warn!(%error, lease = %self.name, "could not release the Lease; the next leader waits for it to expire");
        } else {
            info!(lease = %self.name, identity = %self.me, "released leadership");
        }
    }

    /// One election round: true when this replica holds the Lease afterwards.
    async fn try_hold(&self) -> Result<bool> {
        let now = Timestamp::now();
        let current = self.api.get_opt(&self.name).await?;
        let spec = current.as_ref().and_then(|l| l.spec.as_ref());
        let transitions = spec.and_then(|s| s.lease_transitions).unwrap_or(0);
        let held = |acquired: Option<MicroTime>, transitions| LeaseSpec {
            holder_identity: Some(self.me.clone()),
            lease_duration_seconds: Some(self.duration.as_secs() as i32),
            acquire_time: acquired.or(Some(MicroTime(now))),
            renew_time: Some(MicroTime(now)),
            lease_transitions: Some(transitions),
            ..LeaseSpec::default()
        };
        let unchanged_for = self
            .observed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .unchanged_for(spec, Instant::now());
        let spec = match step(spec, &self.me, unchanged_for) {
            LeaseStep::Wait { .. } => return Ok(false),
            LeaseStep::Renew => held(spec.and_then(|s| s.acquire_time.clone()), transitions),
            LeaseStep::Acquire => held(None, transitions + i32::from(current.is_some())),
        };
        match current {
            None => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.name.clone()),
                        ..ObjectMeta::default()
                    },
                    spec: Some(spec),
                };
                self.api.create(&PostParams::default(), &lease).await?;
            }
            Some(mut lease) => {
                lease.spec = Some(spec);
                self.api
                    .replace(&self.name, &PostParams::default(), &lease)
                    .await?;
            }
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held_by(holder: &str, renewed: i64) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(holder.into()),
            renew_time: Some(MicroTime(Timestamp::from_second(renewed).unwrap())),
            lease_duration_seconds: Some(15),
            ..LeaseSpec::default()
        }
    }

    #[test]
    fn a_lease_held_by_another_replica_is_waited_for_until_seen_unchanged_for_its_duration() {
        let lease = held_by("other", 100);
        assert_eq!(
            step(Some(&lease), "me", Duration::from_secs(10)),
            LeaseStep::Wait {
                holder: "other".into(),
                left: Duration::from_secs(5)
            }
        );
        assert_eq!(
            step(Some(&lease), "me", Duration::from_secs(15)),
            LeaseStep::Acquire
        );
    }

    #[test]
    fn expiry_counts_from_when_this_replica_saw_the_record_change_not_from_its_renew_time() {
        // A holder whose clock is an hour behind renewed long "ago" by our clock: still held.
        let start = Instant::now();
        let mut seen = Observation::default();
        let stale_clock = held_by("other", 0);
        assert_eq!(
            seen.unchanged_for(Some(&stale_clock), start),
            Duration::ZERO
        );
        let later = start + Duration::from_secs(10);
        assert_eq!(
            seen.unchanged_for(Some(&stale_clock), later),
            Duration::from_secs(10)
        );
        assert!(matches!(
            step(Some(&stale_clock), "me", Duration::from_secs(10)),
            LeaseStep::Wait { .. }
        ));
        // A renewal resets the count.
        let renewed = held_by("other", 5);
        assert_eq!(seen.unchanged_for(Some(&renewed), later), Duration::ZERO);
    }

    #[test]
    fn a_missing_or_released_lease_is_taken_and_our_own_is_renewed() {
        assert_eq!(step(None, "me", Duration::ZERO), LeaseStep::Acquire);
        let mut released = held_by("other", 0);
        released.holder_identity = None;
        assert_eq!(
            step(Some(&released), "me", Duration::ZERO),
            LeaseStep::Acquire
        );
        assert_eq!(
            step(Some(&held_by("me", 0)), "me", Duration::from_secs(1000)),
            LeaseStep::Renew
        );
    }

    fn seen(leading: bool, start: Instant) -> Seen {
        Seen {
            leading,
            started: start,
            reached: None,
            renewed: None,
            last_error: Some("connection refused".into()),
            errors: 3,
        }
    }

    #[test]
    fn a_follower_is_healthy_through_an_outage_until_the_grace_and_then_names_the_error() {
        let start = Instant::now();
        let lease = Duration::from_secs(15);
        let mut follower = seen(false, start);
        let minute = Duration::from_secs(60);
        assert_eq!(health(&follower, lease, start + minute), Ok(()));
        let why = health(&follower, lease, start + UNREACHABLE_GRACE + minute).unwrap_err();
        assert!(
            why.contains("360 s") && why.contains("connection refused"),
            "{why}"
        );
        // Any answer, a conflict included, restarts the count.
        follower.reached = Some(start + UNREACHABLE_GRACE);
        assert_eq!(
            health(&follower, lease, start + UNREACHABLE_GRACE + minute),
            Ok(())
        );
    }

    #[test]
    fn a_leader_past_its_lease_without_a_renewal_is_unhealthy() {
        let start = Instant::now();
        let lease = Duration::from_secs(15);
        let mut leader = seen(true, start);
        leader.renewed = Some(start);
        assert_eq!(
            health(&leader, lease, start + Duration::from_secs(10)),
            Ok(())
        );
        let why = health(&leader, lease, start + Duration::from_secs(20)).unwrap_err();
        assert!(why.contains("20 s ago, past its 15 s"), "{why}");
        // A replica without election leads and never renews: healthy.
        assert_eq!(Election::alone().health(), Ok(()));
    }

    #[test]
    fn the_renew_deadline_is_shorter_than_the_lease() {
        assert_eq!(
            renew_deadline(Duration::from_secs(15)),
            Duration::from_secs(10)
        );
    }
}
