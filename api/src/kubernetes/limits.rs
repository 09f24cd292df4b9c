//! [`SharedLimits`] on a `coordination.k8s.io/v1` Lease in the API's namespace: every
//! replica's permits sit in one annotation of it, read and replaced with a resourceVersion
//! precondition, so the limits hold however many replicas serve. A long-poll or count costs
//! two reads and two writes; nothing is written while no one waits or counts.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};

use super::{KubeBackendError, MANAGER};
use crate::error::ApiError;
use crate::paths::now;
use crate::permits::{Permits, Scope, SharedLimits};

/// The Lease that holds the permits.
pub const LEASE: &str = "harvest-api-limits";
/// Its annotation with the permits, as JSON.
pub const ANNOTATION: &str = "harvest.dev/permits";
/// How often a write that lost a race to another replica is re-read and redone.
const WRITE_TRIES: u32 = 32;

/// The permits of every replica, on the Lease.
#[derive(Debug, Clone)]
pub struct LeaseLimits {
    leases: Api<Lease>,
}

impl LeaseLimits {
    /// The limits on the Lease in `namespace`.
    pub fn new(client: Client, namespace: &str) -> Self {
        Self {
            leases: Api::namespaced(client, namespace),
        }
    }

    fn post_params() -> PostParams {
        PostParams {
            field_manager: Some(MANAGER.into()),
            ..PostParams::default()
        }
    }

    /// The Lease, made if it does not exist yet.
    async fn lease(&self) -> Result<Lease, kube::Error> {
        if let Some(lease) = self.leases.get_opt(LEASE).await? {
            return Ok(lease);
        }
        let fresh = Lease {
            metadata: ObjectMeta {
                name: Some(LEASE.into()),
                ..ObjectMeta::default()
            },
            spec: None,
        };
        match self.leases.create(&Self::post_params(), &fresh).await {
            Ok(made) => Ok(made),
            // Another replica made it first.
            Err(kube::Error::Api(status)) if status.code == 409 => self.leases.get(LEASE).await,
            Err(error) => Err(error),
        }
    }

    /// Applies `change` to the permits (pruned of lapsed ones) and writes them back if it
    /// says so; what it returned.
    async fn update(
        &self,
        change: impl Fn(&mut Permits) -> (bool, bool),
    ) -> Result<bool, KubeBackendError> {
        for attempt in 0..WRITE_TRIES {
            let mut lease = self.lease().await?;
            let annotations = lease.metadata.annotations.get_or_insert_default();
            let mut permits: Permits = match annotations.get(ANNOTATION) {
                Some(json) => serde_json::from_str(json).unwrap_or_else(|error| {
                    tracing::warn!(lease = LEASE, %error, "the permits annotation is not valid JSON; starting afresh");
                    Permits::default()
                }),
                None => Permits::default(),
            };
            let held = permits.0.len();
            permits.prune(now());
            let (answer, changed) = change(&mut permits);
            if !changed && permits.0.len() == held {
                return Ok(answer);
            }
            let json = serde_json::to_string(&permits)
                .map_err(|e| KubeBackendError::Contended(format!("permits: {e}")))?;
            annotations.insert(ANNOTATION.into(), json);
            match self
                .leases
                .replace(LEASE, &Self::post_params(), &lease)
                .await
            {
                Ok(_) => return Ok(answer),
                Err(kube::Error::Api(status)) if status.code == 409 => {
                    // Spread the retries of replicas that collided.
                    let jitter = u64::from(uuid::Uuid::new_v4().as_bytes()[0] % 8);
                    tokio::time::sleep(Duration::from_millis(u64::from(attempt) * 2 + jitter))
                        .await;
                }
                Err(error) => return Err(error.into()),
            }
        }
        Err(KubeBackendError::Contended(format!("Lease {LEASE}")))
    }
}

#[async_trait::async_trait]
impl SharedLimits for LeaseLimits {
    async fn take(&self, id: &str, scope: Scope, lasts: Duration) -> Result<bool, ApiError> {
        let expires = now().0 + i64::try_from(lasts.as_millis()).unwrap_or(i64::MAX / 2);
        let expires = harvest_core::clock::UnixMillis(expires);
        Ok(self
            .update(|permits| {
                let had = permits.0.contains_key(id);
                let taken = permits.take(id, scope.clone(), expires);
                (taken, taken && !had)
            })
            .await?)
    }

    async fn give_back(&self, id: &str) -> Result<(), ApiError> {
        self.update(|permits| {
            let given = permits.give_back(id);
            (given, given)
        })
        .await?;
        Ok(())
    }
}
