//! A spec, validated once into what the operator needs to run it ([`ValidJob`]). Errors are
//! permanent: the job ends `Finished/Failed` with the message, and is never retried.

use std::num::NonZeroUsize;
use std::path::Path;

use harvest_core::options::OptionsError;
use harvest_core::plan::DEFAULT_BATCH_TOKENS;
use harvest_core::quota::Lane;
use harvest_core::{LayerError, Location, PlanError, ResolvedPlan, ServedModel};

use crate::job::HarvestJobSpec;

/// Why a spec cannot run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SpecError {
    /// The model is not in the catalogue.
    #[error("model {model:?} is not in the catalogue; known models: {}", known.join(", "))]
    UnknownModel {
        /// What the spec named.
        model: String,
        /// What the catalogue has.
        known: Vec<String>,
    },
    /// A layer index out of range, or an empty list.
    #[error("spec.harvest.layers: {0}")]
    Layers(#[from] LayerError),
    /// Hook sites listed twice (the apiserver refuses that too, as a set).
    #[error("spec.harvest.sites: {0}")]
    Sites(#[from] harvest_core::SiteError),
    /// A token selection field is refused.
    #[error("spec.harvest: {0}")]
    Selection(#[from] PlanError),
    /// No output, and no account storage for the operator to choose one under.
    #[error(
        "spec.output is not set, and the paying account names no storage to put the output under: set spec.output, or spec.storage.prefix on the HarvestAccount"
    )]
    NoOutput,
    /// More workers than the model's catalogue entry allows.
    #[error(
        "spec.parallelism {wanted} is above model {model:?}'s maxParallelism {cap}: use at most {cap}, or leave it out and the operator chooses"
    )]
    Parallelism {
        /// What the spec asked.
        wanted: u32,
        /// The catalogue's cap.
        cap: u32,
        /// The model.
        model: String,
    },
    /// Parts asked of a job whose norm filter spans the corpus in order.
    #[error(
        "spec.parallelism {wanted} cannot be combined with spec.harvest.maxNormMultiple, whose running median spans the corpus in order: drop one of them"
    )]
    PartsWithNormFilter {
        /// What the spec asked.
        wanted: u32,
    },
    /// A location that is neither `s3://bucket/...` nor an absolute path.
    #[error("spec.{field}: {value:?} is not a location: write s3://bucket/key or an absolute path")]
    BadLocation {
        /// The field.
        field: &'static str,
        /// What was given.
        value: String,
    },
}

/// A hook site listed twice is a sites error; every other refused option is the selection's.
impl From<OptionsError> for SpecError {
    fn from(error: OptionsError) -> Self {
        match error {
            OptionsError::Sites(sites) => Self::Sites(sites),
            other => Self::Selection(PlanError::Options(other)),
        }
    }
}

impl SpecError {
    /// A stable CamelCase reason for the `Finished` condition and the Event.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::UnknownModel { .. } => "UnknownModel",
            Self::Layers(_) => "InvalidLayers",
            Self::Sites(_) => "InvalidSites",
            Self::Selection(_) => "InvalidSelection",
            Self::BadLocation { .. } => "InvalidLocation",
            Self::NoOutput => "NoOutput",
            Self::Parallelism { .. } => "ParallelismAboveCap",
            Self::PartsWithNormFilter { .. } => "InvalidParallelism",
        }
    }
}

/// A spec that can run.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidJob {
    /// The harvester plan, layers resolved; the worker gets it as `--plan-json`.
    pub plan: ResolvedPlan,
    /// The lane it queues in.
    pub lane: Lane,
    /// Tokens reserved at admission.
    pub token_budget: u64,
    /// Workers it runs in (1 from the spec check; the operator applies its catalogue).
    pub parallelism: u32,
}

impl HarvestJobSpec {
    /// Validates the spec against its model, whose checkpoint the worker finds at `checkpoint`.
    pub fn validate(&self, model: &ServedModel, checkpoint: &Path) -> Result<ValidJob, SpecError> {
        let Self {
            model: _,
            input,
            harvest,
            output,
            token_budget,
            suspend: _,
            cancel: _,
            active_deadline_seconds: _,
            backoff_limit: _,
            ttl_seconds_after_finished: _,
            output_retention: _,
            parallelism: _,
        } = self;
        let location = |field: &'static str, value: &str| {
            // A worker has no useful working directory, so local paths must be absolute.
            match Location::parse(value, field) {
                Ok(Location::Local(path)) if path.is_absolute() => Ok(Location::Local(path)),
                Ok(s3 @ Location::S3 { .. }) => Ok(s3),
                _ => Err(SpecError::BadLocation {
                    field,
                    value: value.to_owned(),
                }),
            }
        };
        let options = harvest.to_options(input.directions.is_some())?;
        let plan = ResolvedPlan {
            model: checkpoint.to_owned(),
            prompts: location("input.prompts", &input.prompts)?,
            project_onto: input
                .directions
                .as_deref()
                .map(|d| location("input.directions", d))
                .transpose()?,
            output: location("output", output.as_deref().ok_or(SpecError::NoOutput)?)?,
            batch_tokens: NonZeroUsize::new(DEFAULT_BATCH_TOKENS).unwrap_or(NonZeroUsize::MIN),
            options: options.resolve_served(model)?,
        };
        Ok(ValidJob {
            plan,
            lane: model.lane,
            token_budget: *token_budget,
            parallelism: 1,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smollm() -> ServedModel {
        ServedModel {
            name: "smollm2-135m".into(),
            shape: harvest_core::ModelShape {
                num_layers: 30,
                hidden_size: 576,
                moe: None,
            },
            lane: Lane::Small,
        }
    }

    const CHECKPOINT: &str = "/models/smollm2-135m";

    fn spec() -> HarvestJobSpec {
        HarvestJobSpec::new(
            "smollm2-135m",
            "s3://in/prompts.jsonl",
            "s3://out/job-1",
            1000,
        )
    }

    #[test]
    fn omitted_layers_become_the_quartiles_of_the_model() {
        let job = spec().validate(&smollm(), Path::new(CHECKPOINT)).unwrap();
        assert_eq!(job.plan.options.layers.as_slice(), &[7, 15, 22]);
        assert_eq!(job.plan.model, Path::new(CHECKPOINT));
        assert_eq!(job.lane, Lane::Small);
    }

    #[test]
    fn a_layer_out_of_range_names_the_index_and_the_valid_range() {
        let mut spec = spec();
        spec.harvest.layers = Some(vec![3, 30]);
        let error = spec.validate(&smollm(), Path::new(CHECKPOINT)).unwrap_err();
        assert_eq!(error.reason(), "InvalidLayers");
        assert!(
            error.to_string().contains("layer 30") && error.to_string().contains("0..=29"),
            "{error}"
        );
    }

    #[test]
    fn the_router_on_a_dense_model_is_refused_naming_it_and_on_a_moe_model_reaches_the_plan() {
        let mut spec = spec();
        use harvest_core::Site;
        spec.harvest.sites = Some(vec![Site::ResidPost, Site::Router]);
        let error = spec.validate(&smollm(), Path::new(CHECKPOINT)).unwrap_err();
        assert_eq!(error.reason(), "InvalidLayers");
        assert!(
            error.to_string().contains("smollm2-135m is dense"),
            "{error}"
        );
        let mut moe = smollm();
        moe.shape.moe = Some(harvest_core::model::MoeShape {
            first_sparse_layer: 2,
            experts: 8,
            experts_per_token: 2,
        });
        let plan = spec.validate(&moe, Path::new(CHECKPOINT)).unwrap().plan;
        assert_eq!(plan.options.sites.names(), ["resid_post", "router"]);
        let written = crate::HarvestOptions::from(&plan.options);
        assert_eq!(written.sites, Some(vec![Site::ResidPost, Site::Router]));
    }

    #[test]
    fn a_relative_or_bucketless_location_is_refused_with_its_field() {
        for bad in ["prompts.jsonl", "s3://", "s3:///key"] {
            let mut spec = spec();
            spec.input.prompts = bad.into();
            let error = spec.validate(&smollm(), Path::new(CHECKPOINT)).unwrap_err();
            assert!(error.to_string().contains("spec.input.prompts"), "{error}");
        }
    }

    #[test]
    fn sites_a_selection_and_the_shuffled_layout_reach_the_workers_plan() {
        let mut spec = spec();
        spec.harvest.sites = Some(vec![
            harvest_core::Site::ResidPost,
            harvest_core::Site::AttnOut,
        ]);
        spec.harvest.positions = Some(vec![1, 64]);
        spec.harvest.seed = Some(9);
        spec.harvest.layout = Some(harvest_core::layout::LayoutName::Shuffled);
        spec.harvest.rows_per_file = Some(1024);
        let plan = spec
            .validate(&smollm(), Path::new(CHECKPOINT))
            .unwrap()
            .plan;
        assert_eq!(plan.options.sites.names(), ["attn_out", "resid_post"]);
        assert_eq!(
            plan.options.selection.positions.map(|p| (p.start, p.end)),
            Some((1, 64))
        );
        assert_eq!(plan.options.layout.file_name(0), "train_00000.safetensors");
        let raw = plan.to_raw();
        assert_eq!((raw.seed, raw.rows_per_file), (Some(9), Some(1024)));
    }

    #[test]
    fn a_bad_selection_or_layout_is_refused_with_its_reason() {
        let mut spec = spec();
        spec.harvest.positions = Some(vec![8, 2]);
        let error = spec.validate(&smollm(), Path::new(CHECKPOINT)).unwrap_err();
        assert_eq!(error.reason(), "InvalidSelection");
        assert!(error.to_string().contains("[8, 2)"), "{error}");
        let mut spec = self::spec();
        spec.harvest.rows_per_file = Some(10);
        let error = spec.validate(&smollm(), Path::new(CHECKPOINT)).unwrap_err();
        assert!(error.to_string().contains("shuffled"), "{error}");
        let mut spec = self::spec();
        spec.harvest.sites = Some(vec![harvest_core::Site::MlpOut, harvest_core::Site::MlpOut]);
        let error = spec.validate(&smollm(), Path::new(CHECKPOINT)).unwrap_err();
        assert_eq!(error.reason(), "InvalidSites");
    }
}
