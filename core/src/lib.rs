//! `harvest-core`: the domain types and pure rules shared by every harvest crate.
//!
//! This crate decides; it never acts. It has no I/O dependencies (no tokio, kube, axum,
//! cudarc, files or sockets), so the embedded API, the Kubernetes operator and the harvester
//! all apply exactly the same rules.
//!
//! ```text
//! JSON plan / CLI flags / CRD spec
//!        │ parse at the edge (serde, deny_unknown_fields)
//!        ▼
//! RawPlan ──TryFrom──► HarvestPlan { model, prompts, layers: LayerSelection, output, … }
//! LayerSelection ──resolve(num_layers)──► Layers (sorted, unique, in range)
//! shard planning (plan), RunningStats (stats), Manifest schema (format)
//! job lifecycle: next(status, reserved, event) -> Transition (lifecycle)
//! quota: Ledger::admit / finish over lanes, UTC day/month budgets and job quotas (quota, clock)
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod clock;
pub mod format;
pub mod layers;
pub mod lifecycle;
pub mod npy;
pub mod plan;
pub mod quota;
pub mod stats;

pub use layers::{LayerError, LayerSelection, Layers};
pub use plan::{HarvestPlan, Location, PlanError, RawPlan};
pub use stats::RunningStats;
