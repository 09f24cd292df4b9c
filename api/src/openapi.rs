//! The OpenAPI document, generated from the handlers and wire types. `api/openapi.json` is the
//! committed copy; CI regenerates it (`cargo run -p harvest-api --bin openapi`) and fails on any
//! difference.

use harvest_core::Site;
use harvest_core::options::COUNT_LIMITS;
use harvest_core::plan::MAX_PROMPTS;
use serde_json::{Value, json};
use utoipa::openapi::RefOr;
use utoipa::openapi::schema::{ArrayItems, Schema, SchemaType, Type};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::catalogue::{ModelList, ModelView};
use crate::error::{ErrorBody, ErrorEnvelope};
use crate::listing::{JobList, LaneUsage, MAX_PAGE, Measure, TokenUsage, Usage};
use crate::wire::{
    DryRun, Estimate, FileSizes, HarvestRequest, JobResult, JobView, MAX_BATCH_SIZE,
    MAX_PARALLELISM, PartialInfo, Progress, ProjectOnto, ReadyShardUrl, ResultTimings, ShardFiles,
};

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The bounds the server enforces, written into the document from the constants that
/// validate, so that a request valid by the schema is refused only for a rule the schema cannot
/// state (a layer past the model's depth, `seed` without `sample_rate`, ...), which a 400 names.
struct Bounds;

impl Modify for Bounds {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let router = [Site::Router, Site::RouterLogits];
        let sites: Vec<Value> = Site::ALL
            .iter()
            .chain(&router)
            .map(|s| json!(s.as_str()))
            .collect();
        if let Some(components) = openapi.components.as_mut() {
            if let Some(RefOr::T(request)) = components.schemas.get_mut("HarvestRequest") {
                limit_request(request, sites);
            }
            if let Some(RefOr::T(project)) = components.schemas.get_mut("ProjectOnto") {
                limit_projection(project);
            }
        }
        // The job a submit made, for the operations on one job (clients and fuzzers follow
        // these links to real ids).
        if let Some(submit) = openapi
            .paths
            .paths
            .get_mut("/v1/harvest")
            .and_then(|i| i.post.as_mut())
            && let Some(RefOr::T(accepted)) = submit.responses.responses.get_mut("202")
        {
            for (name, operation) in [("GetJob", "status"), ("CancelJob", "cancel")] {
                let link = utoipa::openapi::link::LinkBuilder::new()
                    .operation_id(operation)
                    .parameter("job_id", "$response.body#/job_id")
                    .build();
                accepted.links.insert(name.to_owned(), RefOr::T(link));
            }
        }
        for (path, method, name, bounds) in [
            (
                "/v1/harvest",
                "get",
                "limit",
                Limit::Range(1, MAX_PAGE as f64),
            ),
            (
                "/v1/harvest",
                "get",
                "status",
                Limit::OneOf(&["pending", "running", "done", "failed", "cancelled"]),
            ),
            (
                "/v1/harvest/{job_id}",
                "get",
                "wait",
                Limit::NumberOrEmpty(0.0),
            ),
            (
                "/v1/harvest/{job_id}",
                "get",
                "partial",
                Limit::OneOf(&["true", "false", "1", "0", ""]),
            ),
        ] {
            let operation = openapi
                .paths
                .paths
                .get_mut(path)
                .and_then(|item| match method {
                    "get" => item.get.as_mut(),
                    _ => None,
                });
            let parameter = operation
                .and_then(|op| op.parameters.as_mut())
                .and_then(|ps| ps.iter_mut().find(|p| p.name == name));
            if let Some(RefOr::T(schema)) = parameter.and_then(|p| p.schema.as_mut()) {
                bounds.apply(schema);
            }
        }
    }
}

/// A bound on one value.
enum Limit {
    /// An integer from, to (inclusive).
    Range(usize, f64),
    /// A number from (inclusive), any size (a longer wait is held for the longest one), or
    /// empty (as if not given).
    NumberOrEmpty(f64),
    /// A number above, to (inclusive).
    Above(f64, Option<f64>),
    /// One of these strings.
    OneOf(&'static [&'static str]),
}

impl Limit {
    fn apply(&self, schema: &mut Schema) {
        if let Self::NumberOrEmpty(min) = *self {
            let either = json!({"oneOf": [{"type": "number", "minimum": min}, {"type": "string", "enum": [""]}]});
            if let Ok(either) = serde_json::from_value(either) {
                *schema = either;
            }
            return;
        }
        let Schema::Object(schema) = schema else {
            return;
        };
        match *self {
            Self::Range(min, max) => {
                schema.minimum = Some(min.into());
                schema.maximum = Some(max.into());
                schema.schema_type = integer_type(&schema.schema_type);
            }
            Self::Above(min, max) => {
                schema.minimum = None;
                schema.exclusive_minimum = Some(min.into());
                schema.maximum = max.map(Into::into);
            }
            Self::OneOf(values) => {
                schema.enum_values = Some(values.iter().map(|v| json!(v)).collect());
            }
            Self::NumberOrEmpty(_) => {}
        }
    }
}

fn integer_type(current: &SchemaType) -> SchemaType {
    match current {
        SchemaType::Array(types) if types.contains(&Type::Null) => {
            SchemaType::from_iter([Type::Integer, Type::Null])
        }
        _ => SchemaType::Type(Type::Integer),
    }
}

fn property<'a>(schema: &'a mut Schema, name: &str) -> Option<&'a mut Schema> {
    match schema {
        Schema::Object(object) => match object.properties.get_mut(name)? {
            RefOr::T(inner) => Some(inner),
            RefOr::Ref(_) => None,
        },
        _ => None,
    }
}

fn limit_request(request: &mut Schema, sites: Vec<Value>) {
    let layouts = &["by_prompt", "shuffled"];
    let precisions = &["f32", "bf16"];
    let counts = COUNT_LIMITS.map(|(name, max)| (name, Limit::Range(1, max as f64)));
    for (name, limit) in counts.into_iter().chain([
        ("batch_size", Limit::Range(1, MAX_BATCH_SIZE as f64)),
        ("parallelism", Limit::Range(1, MAX_PARALLELISM as f64)),
        ("sample_rate", Limit::Above(0.0, Some(1.0))),
        ("max_norm_multiple", Limit::Above(1.0, None)),
        ("layout", Limit::OneOf(layouts)),
        ("precision", Limit::OneOf(precisions)),
    ]) {
        if let Some(schema) = property(request, name) {
            limit.apply(schema);
        }
    }
    if let Some(Schema::Object(model)) = property(request, "model") {
        model.min_length = Some(1);
    }
    if let Some(Schema::Array(prompts)) = property(request, "prompts") {
        prompts.min_items = Some(1);
        prompts.max_items = Some(MAX_PROMPTS);
    }
    if let Some(Schema::Array(positions)) = property(request, "positions") {
        positions.min_items = Some(2);
        positions.max_items = Some(2);
    }
    if let Some(Schema::Array(kept)) = property(request, "sites") {
        kept.min_items = Some(1);
        kept.max_items = Some(sites.len());
        kept.unique_items = true;
        if let ArrayItems::RefOrSchema(item) = &mut kept.items
            && let RefOr::T(Schema::Object(item)) = item.as_mut()
        {
            item.enum_values = Some(sites);
        }
    }
    if let Some(layers) = property(request, "layers") {
        *layers = serde_json::from_value(json!({
            "oneOf": [
                {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                {"type": "string", "enum": ["all"]},
                {"type": "null"}
            ],
            "description": "A list of block indices (each below the model's `layers`), `\"all\"`, or omitted for the quartile default."
        }))
        .unwrap_or_else(|_| layers.clone());
    }
}

fn limit_projection(project: &mut Schema) {
    if let Some(dtype) = property(project, "dtype") {
        Limit::OneOf(&["float32", "float16", "bfloat16"]).apply(dtype);
    }
    if let Some(compression) = property(project, "compression") {
        Limit::OneOf(&["none"]).apply(compression);
    }
    if let Some(Schema::Array(shape)) = property(project, "shape") {
        shape.min_items = Some(2);
        shape.max_items = Some(2);
        if let ArrayItems::RefOrSchema(item) = &mut shape.items
            && let RefOr::T(Schema::Object(item)) = item.as_mut()
        {
            item.minimum = Some(1.into());
        }
    }
}

/// The document.
#[derive(Debug, OpenApi)]
#[openapi(
    info(title = "harvest", description = "Bulk harvesting of residual-stream activations. See docs/api.md.", version = "1"),
    paths(crate::routes::submit, crate::routes::status, crate::routes::cancel, crate::routes::models, crate::routes::list, crate::routes::account),
    components(schemas(HarvestRequest, ProjectOnto, JobView, JobResult, ResultTimings, Progress, ModelView, ModelList, ErrorEnvelope, ErrorBody, JobList, Usage, Measure, LaneUsage, TokenUsage, DryRun, Estimate, FileSizes, ShardFiles, ReadyShardUrl, PartialInfo)),
    modifiers(&BearerAuth, &Bounds)
)]
pub struct ApiDoc;

/// The document as pretty JSON, with a trailing newline.
pub fn document() -> String {
    // utoipa 5.5 writes a Link's `operationId` in snake case (its `Link` has no camelCase
    // rename); no other key of the document is spelled `operation_id`.
    ApiDoc::openapi()
        .to_pretty_json()
        .unwrap_or_default()
        .replace("\"operation_id\":", "\"operationId\":")
        + "\n"
}
