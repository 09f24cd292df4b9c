//! `harvest-core`: the domain types and pure rules shared by every harvest crate.
//!
//! This crate decides; it never acts. It has no I/O dependencies (no tokio, kube, axum,
//! cudarc, files or sockets), so the embedded API, the Kubernetes operator and the harvester
//! all apply exactly the same rules.
//!
//! ```text
//! raw request / CLI flags / CRD spec
//!        │ parse at the edge (serde)
//!        ▼
//! LayerSelection ──resolve(num_layers)──► Layers (sorted, unique, in range)
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod layers;

pub use layers::{LayerError, LayerSelection, Layers};
