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
//! REST body / plan.json / spec.harvest ──► RawOptions ──validate──► JobOptions<LayerSelection>
//!         ──resolve(&ModelShape)──► JobOptions { layers: Layers (sorted, unique, in range), … }
//!         (options: the one options type; Submission, job rows and plans each hold one)
//! RawPlan ──TryFrom──► HarvestPlan { model, prompts, output, options: JobOptions<LayerSelection> }
//!         ──resolve(&ModelShape)──► ResolvedPlan { …, options: JobOptions }
//!         ──to_raw()──► RawPlan with the layers listed: what a worker is handed (model)
//! worker protocol: RunResult, ProgressEvent, Termination, ExitStatus, prompts JSONL (worker)
//! shard planning (plan), RunningStats (stats), Manifest schema (format), file sizes (estimate)
//! a run in progress: shard records and which shards are ready to read (partial)
//! what a job keeps: hook sites (sites), token selection (selection), file layout (layout)
//! job lifecycle: next(status, reserved, event) -> Transition (lifecycle)
//! quota: Ledger::admit / finish over lanes, UTC day/month budgets and job quotas (quota, clock)
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod chat;
pub mod clock;
pub mod estimate;
pub mod format;
pub mod invocation;
pub mod layers;
pub mod layout;
pub mod lifecycle;
pub mod model;
pub mod npy;
pub mod options;
pub mod partial;
pub mod plan;
pub mod quota;
pub mod selection;
pub mod sites;
pub mod stats;
pub mod worker;

pub use layers::{LayerError, LayerSelection, Layers};
pub use model::{ModelShape, ServedModel};
pub use options::{JobOptions, OptionsError, RawOptions};
pub use plan::{HarvestPlan, Location, PlanError, RawPlan, ResolvedPlan};
pub use sites::{Router, Site, SiteError, Sites};
pub use stats::RunningStats;
