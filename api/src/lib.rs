//! `harvest-api`: the REST API, compatible with the hosted bulk-harvest API, so existing client
//! scripts work unchanged.
//!
//! It must not depend on cudarc or on the harvester crate: jobs run in `harvester` processes (the
//! embedded backend) or Pods (the Kubernetes backend).
//!
//! ```text
//! HTTP ──routes (Caller, AppJson)──wire::HarvestRequest──validate(ServedModel)──► wire::Submission
//!                                                                    │ errors: error::ApiError
//!                                                                    ▼   (one status/code table)
//!            backend::JobBackend ─┬─ embedded/: store (SQLite), workers (harvester processes), gpus
//!                                 └─ kubernetes/: HarvestJobs, watch caches, lookups, cancel, limits
//! ```
//! The handlers and the wire types depend on neither backend: they see jobs as `job::JobRecord`
//! and callers as `backend::Caller`, keys by `keys` (only hashes are kept). `state` holds what
//! the handlers share, `app` the router, `routes` the handlers (`listing` the job list and the
//! account's usage, `page` the status page's built-in files, `ready` the shards of a running
//! job that can be read already), `signing` the links this server signs (both backends, for
//! local outputs), `storage` where outputs live (local or S3), `paths` where a job's files live
//! in the data directory. `server` and `admin` are the only modules that know both backends:
//! they wire one up and serve, or run the key commands.
#![forbid(unsafe_code)]

pub mod admin;
pub mod app;
pub mod backend;
pub mod catalogue;
pub mod config;
pub mod counting;
pub mod embedded;
pub mod error;
pub mod job;
pub mod keys;
pub mod kubernetes;
pub mod listing;
pub mod openapi;
pub mod page;
pub mod paths;
pub mod permits;
pub mod ratelimit;
pub mod ready;
pub mod routes;
pub mod server;
pub mod signing;
pub mod state;
pub mod storage;
pub mod wire;

pub use error::ApiError;
