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
//! Built so far: the wire contract and the error envelope. The router, the embedded store, the
//! workers and signed downloads are the next steps of this crate.
#![forbid(unsafe_code)]

pub mod catalogue;
pub mod config;
pub mod error;
pub mod store;
pub mod wire;

pub use error::ApiError;
