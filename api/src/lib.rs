//! `harvest-api`: the REST API, compatible with the hosted bulk-harvest API, so existing client
//! scripts work unchanged.
//!
//! It must not depend on cudarc or on the harvester crate: jobs run in `harvester` processes (the
//! embedded backend) or Pods (the Kubernetes backend).
//!
//! ```text
//! HTTP body ──wire::HarvestRequest (strict serde)──validate(catalogue entry)──► wire::Submission
//!                                                                    │ errors: error::ApiError
//!                                                                    ▼   (one status/code table)
//!                                                 job store + quota (harvest_core::quota) ──► 202
//! ```
//! The embedded backend: `store` (SQLite), `workers` (harvester child processes), `signing`
//! (download links the server signs and serves). `server` wires them together.
#![forbid(unsafe_code)]

pub mod app;
pub mod catalogue;
pub mod config;
pub mod error;
pub mod kubernetes;
pub mod openapi;
pub mod server;
pub mod signing;
pub mod storage;
pub mod store;
pub mod wire;
pub mod workers;

pub use error::ApiError;
