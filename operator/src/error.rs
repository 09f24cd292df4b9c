//! The operator's errors. Everything that reaches `error_policy` is transient (the apiserver or
//! the store was unreachable, a write lost a race) and is retried with backoff; a permanent
//! problem with a job (an invalid spec) is not an error here but a `Finished/Failed` decision.

/// An operator error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A Kubernetes API call failed (unreachable, conflict, forbidden).
    #[error("kubernetes api: {0}")]
    Kube(#[from] kube::Error),
    /// The configuration file is unreadable or invalid.
    #[error("operator config {path}: {reason}")]
    Config {
        /// The file.
        path: String,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// Output files could not be deleted (retried until the finalizer's timeout).
    #[error("deleting outputs under {output}: {reason}")]
    Cleanup {
        /// The output prefix.
        output: String,
        /// The store's error.
        reason: String,
    },
    /// An object the operator built could not be encoded. This is a bug.
    #[error("encoding {what}: {source}")]
    Encode {
        /// What was encoded.
        what: &'static str,
        /// The serde error.
        source: serde_json::Error,
    },
    /// A job without `metadata.uid` (not read from the apiserver) cannot own a Pod.
    #[error("job {job} has no metadata.uid, so it cannot own its Pod. This is a bug.")]
    MissingUid {
        /// The job.
        job: String,
    },
    /// The cache showed a job waiting that the apiserver shows admitted, finished or changed;
    /// retried at once, from the fresher copy.
    #[error("the cached copy of {job} is out of date")]
    StaleCache {
        /// `namespace/name`.
        job: String,
    },
    /// Another replica holds the leader Lease.
    #[error("lost the leader lease {lease} to {holder}")]
    LostLeadership {
        /// The Lease.
        lease: String,
        /// Its holder now.
        holder: String,
    },
}

/// Operator results.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A stable label for the `reconcile_errors_total` metric.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Kube(kube::Error::Api(status)) if status.code == 409 => "conflict",
            Self::Kube(_) => "kube",
            Self::Config { .. } => "config",
            Self::Cleanup { .. } => "cleanup",
            Self::Encode { .. } => "encode",
            Self::MissingUid { .. } => "missing_uid",
            Self::StaleCache { .. } => "stale_cache",
            Self::LostLeadership { .. } => "leadership",
        }
    }

    /// Whether the error is a lost optimistic-concurrency race or a stale cache (retried at
    /// once).
    pub fn is_conflict(&self) -> bool {
        matches!(self, Self::Kube(kube::Error::Api(status)) if status.code == 409)
            || matches!(self, Self::StaleCache { .. })
    }
}
