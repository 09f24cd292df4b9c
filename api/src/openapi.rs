//! The OpenAPI document, generated from the handlers and wire types. `api/openapi.json` is the
//! committed copy; CI regenerates it (`cargo run -p harvest-api --bin openapi`) and fails on any
//! difference.

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::catalogue::{ModelList, ModelView};
use crate::error::{ErrorBody, ErrorEnvelope};
use crate::listing::{JobList, LaneUsage, Measure, TokenUsage, Usage};
use crate::wire::{
    DryRun, Estimate, FileSizes, HarvestRequest, JobResult, JobView, PartialInfo, Progress,
    ProjectOnto, ReadyShardUrl, ResultTimings, ShardFiles,
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

/// The document.
#[derive(Debug, OpenApi)]
#[openapi(
    info(title = "harvest", description = "Bulk harvesting of residual-stream activations. See docs/api.md.", version = "1"),
    paths(crate::routes::submit, crate::routes::status, crate::routes::cancel, crate::routes::models, crate::routes::list, crate::routes::account),
    components(schemas(HarvestRequest, ProjectOnto, JobView, JobResult, ResultTimings, Progress, ModelView, ModelList, ErrorEnvelope, ErrorBody, JobList, Usage, Measure, LaneUsage, TokenUsage, DryRun, Estimate, FileSizes, ShardFiles, ReadyShardUrl, PartialInfo)),
    modifiers(&BearerAuth)
)]
pub struct ApiDoc;

/// The document as pretty JSON, with a trailing newline.
pub fn document() -> String {
    ApiDoc::openapi().to_pretty_json().unwrap_or_default() + "\n"
}
