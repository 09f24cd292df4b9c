//! A spec, validated once into what the operator needs to run it ([`ValidJob`]). Errors are
//! permanent: the job ends `Finished/Failed` with the message, and is never retried.

use harvest_core::quota::Lane;
use harvest_core::{LayerError, LayerSelection, Layers, Location, RawPlan};

use crate::job::HarvestJobSpec;

/// What the operator's catalogue knows of a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelShape {
    /// The checkpoint directory inside the worker's image or volume.
    pub path: String,
    /// Decoder blocks.
    pub num_layers: usize,
    /// Its concurrency lane.
    pub lane: Lane,
}

/// Why a spec cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
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
    /// A location that is neither `s3://bucket/...` nor an absolute path.
    #[error("spec.{field}: {value:?} is not a location: write s3://bucket/key or an absolute path")]
    BadLocation {
        /// The field.
        field: &'static str,
        /// What was given.
        value: String,
    },
}

impl SpecError {
    /// A stable CamelCase reason for the `Finished` condition and the Event.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::UnknownModel { .. } => "UnknownModel",
            Self::Layers(_) => "InvalidLayers",
            Self::BadLocation { .. } => "InvalidLocation",
        }
    }
}

/// A spec that can run.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidJob {
    /// The harvester plan, as the worker's `--plan-json`.
    pub plan: RawPlan,
    /// The resolved layers.
    pub layers: Layers,
    /// The lane it queues in.
    pub lane: Lane,
    /// Tokens reserved at admission.
    pub token_budget: u64,
}

impl HarvestJobSpec {
    /// Validates the spec against its model.
    pub fn validate(&self, model: &ModelShape) -> Result<ValidJob, SpecError> {
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
        } = self;
        let selection = match (&harvest.layers, harvest.all_layers) {
            (_, true) => LayerSelection::All,
            (Some(layers), false) => {
                LayerSelection::Explicit(layers.iter().map(|&l| i64::from(l)).collect())
            }
            (None, false) => LayerSelection::Quartiles,
        };
        let layers = selection.resolve(model.num_layers)?;
        let location = |field: &'static str, value: &str| {
            // A worker has no useful working directory, so local paths must be absolute.
            let ok = match Location::parse(value, field) {
                Ok(Location::Local(path)) => path.is_absolute(),
                Ok(Location::S3 { .. }) => true,
                Err(_) => false,
            };
            if ok {
                Ok(value.to_owned())
            } else {
                Err(SpecError::BadLocation {
                    field,
                    value: value.to_owned(),
                })
            }
        };
        let plan = RawPlan {
            model: model.path.clone(),
            prompts: location("input.prompts", &input.prompts)?,
            layers: LayerSelection::Explicit(layers.as_slice().iter().map(|&l| l as i64).collect()),
            shard_size: harvest.shard_size as usize,
            add_special_tokens: harvest.add_special_tokens,
            project_onto: input
                .directions
                .as_deref()
                .map(|d| location("input.directions", d))
                .transpose()?,
            output: location("output", output)?,
            batch_tokens: harvest_core::plan::DEFAULT_BATCH_TOKENS,
        };
        Ok(ValidJob {
            plan,
            layers,
            lane: model.lane,
            token_budget: *token_budget,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smollm() -> ModelShape {
        ModelShape {
            path: "/models/smollm2-135m".into(),
            num_layers: 30,
            lane: Lane::Small,
        }
    }

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
        let job = spec().validate(&smollm()).unwrap();
        assert_eq!(job.layers.as_slice(), &[7, 15, 22]);
        assert_eq!(job.plan.model, "/models/smollm2-135m");
        assert_eq!(job.lane, Lane::Small);
    }

    #[test]
    fn a_layer_out_of_range_names_the_index_and_the_valid_range() {
        let mut spec = spec();
        spec.harvest.layers = Some(vec![3, 30]);
        let error = spec.validate(&smollm()).unwrap_err();
        assert_eq!(error.reason(), "InvalidLayers");
        assert!(
            error.to_string().contains("layer 30") && error.to_string().contains("0..=29"),
            "{error}"
        );
    }

    #[test]
    fn a_relative_or_bucketless_location_is_refused_with_its_field() {
        for bad in ["prompts.jsonl", "s3://", "s3:///key"] {
            let mut spec = spec();
            spec.input.prompts = bad.into();
            let error = spec.validate(&smollm()).unwrap_err();
            assert!(error.to_string().contains("spec.input.prompts"), "{error}");
        }
    }
}
