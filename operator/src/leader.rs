//! Leader election with a `coordination.k8s.io/v1` Lease: one replica reconciles, the others
//! wait. The choice is pure ([`step`]); the loop around it does the I/O.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, PostParams};
use tracing::info;

use crate::error::{Error, Result};

/// What to do with the Lease now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseStep {
    /// Nobody holds it (or the holder's time ran out): take it.
    Acquire,
    /// We hold it: renew it.
    Renew,
    /// Someone else holds it until `until`.
    Wait {
        /// The holder.
        holder: String,
        /// When its hold runs out unless renewed.
        until: Timestamp,
    },
}

/// Decides, from the Lease's spec, what `me` does at `now`.
pub fn step(spec: Option<&LeaseSpec>, me: &str, now: Timestamp) -> LeaseStep {
    let Some(spec) = spec else {
        return LeaseStep::Acquire;
    };
    let holder = spec.holder_identity.clone().unwrap_or_default();
    if holder == me {
        return LeaseStep::Renew;
    }
    let renewed = spec
        .renew_time
        .as_ref()
        .map(|t| t.0)
        .or(spec.acquire_time.as_ref().map(|t| t.0));
    let duration = SignedDuration::from_secs(i64::from(spec.lease_duration_seconds.unwrap_or(15)));
    match renewed {
        Some(renewed) if !holder.is_empty() && renewed + duration > now => LeaseStep::Wait {
            holder,
            until: renewed + duration,
        },
        _ => LeaseStep::Acquire,
    }
}

/// A held Lease.
#[derive(Debug, Clone)]
pub struct Leadership {
    api: Api<Lease>,
    name: String,
    me: String,
    duration: Duration,
}

impl Leadership {
    /// Waits until this replica holds the Lease `name`.
    pub async fn acquire(
        api: Api<Lease>,
        name: &str,
        me: &str,
        duration: Duration,
    ) -> Result<Self> {
        let this = Self {
            api,
            name: name.to_owned(),
            me: me.to_owned(),
            duration,
        };
        loop {
            match this.try_hold().await {
                Ok(true) => {
                    info!(lease = %this.name, identity = %this.me, "acquired leadership");
                    return Ok(this);
                }
                Ok(false) => {}
                Err(Error::Kube(kube::Error::Api(status))) if status.code == 409 => {}
                Err(e) => return Err(e),
            }
            tokio::time::sleep(this.duration / 3).await;
        }
    }

    /// Renews the Lease every third of its duration; returns when leadership is lost.
    pub async fn keep(self) -> Error {
        loop {
            tokio::time::sleep(self.duration / 3).await;
            match self.try_hold().await {
                Ok(true) => {}
                Ok(false) => {
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
                Err(e) => return e,
            }
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
        let spec = match step(spec, &self.me, now) {
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

    fn at(second: i64) -> Timestamp {
        Timestamp::from_second(second).unwrap()
    }

    fn held_by(holder: &str, renewed: i64) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(holder.into()),
            renew_time: Some(MicroTime(at(renewed))),
            lease_duration_seconds: Some(15),
            ..LeaseSpec::default()
        }
    }

    #[test]
    fn a_fresh_lease_held_by_another_replica_is_waited_for_until_it_expires() {
        let lease = held_by("other", 100);
        assert_eq!(
            step(Some(&lease), "me", at(110)),
            LeaseStep::Wait {
                holder: "other".into(),
                until: at(115)
            }
        );
        assert_eq!(step(Some(&lease), "me", at(116)), LeaseStep::Acquire);
    }

    #[test]
    fn a_missing_lease_is_taken_and_our_own_is_renewed() {
        assert_eq!(step(None, "me", at(0)), LeaseStep::Acquire);
        assert_eq!(
            step(Some(&held_by("me", 0)), "me", at(1000)),
            LeaseStep::Renew
        );
    }
}
