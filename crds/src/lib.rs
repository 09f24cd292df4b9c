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
//! spec.harvest (HarvestOptions) ◄──From / to_options──► core::JobOptions   (options)
//! HarvestJobStatus ◄── conditions::set(...) ── the operator's decisions
//! ```
//!
//! `cargo run -p harvest-crds --bin crdgen` prints the CRD YAML that `manifests/` commits.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod account;
pub mod conditions;
pub mod job;
pub mod options;
pub mod validate;

pub use account::{
    HarvestAccount, HarvestAccountSpec, HarvestAccountStatus, HoldEntry, LaneLimits,
};
pub use job::{
    HarvestJob, HarvestJobSpec, HarvestJobStatus, InputRef, JobPhase, OutputRetention, PartPhase,
    PartStatus, Progress, ResultSummary, TokenUsage,
};
pub use options::HarvestOptions;
pub use validate::{SpecError, ValidJob};

/// On a job in the API's namespace: the HarvestAccount it is charged to. Trusted only there
/// (only the API may create jobs in that namespace); anywhere else the namespace decides.
pub const ACCOUNT_LABEL: &str = "harvest.dev/account";
/// On a job in the API's namespace: the submitting key's id (a prefix of its hash), for the
/// per-key monthly job quota.
pub const KEY_LABEL: &str = "harvest.dev/key";

/// The API group the project owns.
pub const GROUP: &str = "harvest.dev";

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSONSchemaProps, JSONSchemaPropsOrArray, JSONSchemaPropsOrBool,
};

/// Every CRD of the project, in the order `crdgen` prints them, with every unsigned integer
/// bounded ([`bound_unsigned`]).
pub fn all_crds() -> Vec<CustomResourceDefinition> {
    use kube::CustomResourceExt;
    let mut crds = vec![HarvestAccount::crd(), HarvestJob::crd()];
    for crd in &mut crds {
        for version in &mut crd.spec.versions {
            if let Some(schema) = version
                .schema
                .as_mut()
                .and_then(|s| s.open_api_v3_schema.as_mut())
            {
                bound_unsigned(schema);
            }
        }
    }
    crds
}

/// The largest integer every JSON client reads exactly (2^53 - 1), the bound of 64-bit fields.
pub const MAX_SAFE_INTEGER: u64 = (1 << 53) - 1;

/// Gives every unsigned integer of a schema the bounds of its Rust type, where the field has
/// none of its own: `minimum: 0`, and `maximum` u32::MAX for `uint32`, [`MAX_SAFE_INTEGER`]
/// for `uint64`. Without them an apiserver stores 4294967296 in a u32 field, and then kube
/// cannot decode the whole list, stalling the controller for everyone. Its format becomes
/// `int32` or `int64`, which Kubernetes knows (`uint32` draws a warning on every apply).
pub fn bound_unsigned(schema: &mut JSONSchemaProps) {
    let maximum = match schema.format.as_deref() {
        Some("uint32" | "uint16" | "uint8") if schema.type_.as_deref() == Some("integer") => {
            Some(match schema.format.as_deref() {
                Some("uint8") => f64::from(u8::MAX),
                Some("uint16") => f64::from(u16::MAX),
                _ => f64::from(u32::MAX),
            })
        }
        Some("uint64" | "uint") if schema.type_.as_deref() == Some("integer") => {
            Some(MAX_SAFE_INTEGER as f64)
        }
        _ => None,
    };
    if let Some(maximum) = maximum {
        schema.minimum.get_or_insert(0.0);
        schema.maximum.get_or_insert(maximum);
        // The bounds now say what `uint32` said; the apiserver knows only int32 and int64,
        // and warns on every apply of a format it does not know.
        let signed = if maximum <= f64::from(u16::MAX) {
            "int32"
        } else {
            "int64"
        };
        schema.format = Some(signed.to_owned());
    }
    for property in schema.properties.iter_mut().flat_map(|p| p.values_mut()) {
        bound_unsigned(property);
    }
    match schema.items.as_mut() {
        Some(JSONSchemaPropsOrArray::Schema(item)) => bound_unsigned(item),
        Some(JSONSchemaPropsOrArray::Schemas(items)) => items.iter_mut().for_each(bound_unsigned),
        None => {}
    }
    if let Some(JSONSchemaPropsOrBool::Schema(values)) = schema.additional_properties.as_mut() {
        bound_unsigned(values);
    }
    for alternative in [&mut schema.any_of, &mut schema.one_of, &mut schema.all_of]
        .into_iter()
        .flatten()
        .flatten()
    {
        bound_unsigned(alternative);
    }
}

#[cfg(test)]
mod bounds {
    use std::collections::BTreeMap;

    use super::*;

    /// Every integer schema of `schema`, with its path.
    fn integers<'a>(
        path: String,
        schema: &'a JSONSchemaProps,
        out: &mut Vec<(String, &'a JSONSchemaProps)>,
    ) {
        if schema.type_.as_deref() == Some("integer") {
            out.push((path.clone(), schema));
        }
        for (name, property) in schema.properties.iter().flatten() {
            integers(format!("{path}.{name}"), property, out);
        }
        if let Some(JSONSchemaPropsOrArray::Schema(item)) = &schema.items {
            integers(format!("{path}[]"), item, out);
        }
        if let Some(JSONSchemaPropsOrBool::Schema(values)) = &schema.additional_properties {
            integers(format!("{path}{{}}"), values, out);
        }
    }

    /// The integers of each CRD's schema, by path.
    fn integers_of(crds: &[CustomResourceDefinition]) -> BTreeMap<String, JSONSchemaProps> {
        let mut found = Vec::new();
        for crd in crds {
            for version in &crd.spec.versions {
                let schema = version.schema.as_ref().unwrap();
                let schema = schema.open_api_v3_schema.as_ref().unwrap();
                integers(crd.spec.names.kind.clone(), schema, &mut found);
            }
        }
        found
            .into_iter()
            .map(|(path, s)| (path, s.clone()))
            .collect()
    }

    #[test]
    fn every_unsigned_integer_of_the_crds_has_a_maximum_that_fits_its_type() {
        use kube::CustomResourceExt;
        let derived = integers_of(&[HarvestAccount::crd(), HarvestJob::crd()]);
        let shipped = integers_of(&all_crds());
        let mut checked = 0;
        for (path, raw) in &derived {
            let Some(unsigned) = raw.format.as_deref().filter(|f| f.starts_with("uint")) else {
                continue;
            };
            let integer = &shipped[path];
            let maximum = integer
                .maximum
                .unwrap_or_else(|| panic!("{path} has no maximum"));
            assert!(maximum <= MAX_SAFE_INTEGER as f64, "{path}: {maximum}");
            if unsigned == "uint32" {
                assert!(maximum <= f64::from(u32::MAX), "{path}: {maximum}");
            }
            assert!(integer.minimum.is_some_and(|m| m >= 0.0), "{path}");
            checked += 1;
        }
        assert!(checked > 20, "only {checked} unsigned integers were found");
    }

    #[test]
    fn every_integer_format_of_the_crds_is_one_kubernetes_knows() {
        for (path, integer) in integers_of(&all_crds()) {
            let format = integer.format.as_deref();
            assert!(
                matches!(format, None | Some("int32" | "int64")),
                "{path}: {format:?} draws a warning on apply"
            );
        }
    }

    #[test]
    fn a_field_keeps_its_own_tighter_bound() {
        let crd = all_crds().remove(1);
        let spec = &crd.spec.versions[0]
            .schema
            .as_ref()
            .unwrap()
            .open_api_v3_schema
            .as_ref()
            .unwrap()
            .properties
            .as_ref()
            .unwrap()["spec"];
        let harvest = &spec.properties.as_ref().unwrap()["harvest"];
        let shard_size = &harvest.properties.as_ref().unwrap()["shardSize"];
        assert_eq!(shard_size.maximum, Some(4096.0));
    }
}
