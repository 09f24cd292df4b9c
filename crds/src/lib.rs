//! `harvest-crds`: the Kubernetes wire types of harvest and their one-way conversion into `core`.
//!
//! This crate only describes: it holds the `HarvestJob` custom resource (spec, status,
//! conditions, printer columns, CEL rules) and the cluster-scoped `HarvestAccount` (limits and
//! the usage ledger), and turns a spec into a validated
//! [`harvest_core::RawPlan`]. It talks to no apiserver; the operator and the API do that.
//!
//! ```text
//! HarvestJob (YAML / JSON, written by kubectl, GitOps or the API)
//!        │ serde + the CRD schema's CEL rules (enforced by the apiserver)
//!        ▼
//! HarvestJobSpec ──validate(&ServedModel, checkpoint)──► ValidJob { plan: ResolvedPlan, lane, budget }
//! HarvestJobStatus ◄── conditions::set(...) ── the operator's decisions
//! ```
//!
//! `cargo run -p harvest-crds --bin crdgen` prints the CRD YAML that `manifests/` commits.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod account;
pub mod conditions;
pub mod job;
pub mod validate;

pub use account::{
    HarvestAccount, HarvestAccountSpec, HarvestAccountStatus, HoldEntry, LaneLimits,
};
pub use job::{
    HarvestJob, HarvestJobSpec, HarvestJobStatus, HarvestOptions, InputRef, JobPhase,
    OutputRetention, Progress, ResultSummary, TokenUsage,
};
pub use validate::{SpecError, ValidJob};

/// On a job in the API's namespace: the HarvestAccount it is charged to. Trusted only there
/// (only the API may create jobs in that namespace); anywhere else the namespace decides.
pub const ACCOUNT_LABEL: &str = "harvest.dev/account";
/// On a job in the API's namespace: the submitting key's id (a prefix of its hash), for the
/// per-key monthly job quota.
pub const KEY_LABEL: &str = "harvest.dev/key";

/// The API group the project owns.
pub const GROUP: &str = "harvest.dev";

/// Every CRD of the project, in the order `crdgen` prints them.
pub fn all_crds()
-> Vec<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>
{
    use kube::CustomResourceExt;
    vec![HarvestAccount::crd(), HarvestJob::crd()]
}
