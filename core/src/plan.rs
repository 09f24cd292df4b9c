//! A harvest plan: everything one `harvester run` needs, as handed over by the API or the
//! operator (JSON) or built from CLI flags. Parsed strictly ([`RawPlan`] rejects unknown fields),
//! then validated once into [`HarvestPlan`].

use std::num::NonZeroUsize;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::layers::{LayerError, LayerSelection};
use crate::layout::LayoutName;
/// The file name of shard `shard` (the by-prompt layout's files).
pub use crate::layout::shard_file_name;
use crate::model::ModelShape;
pub use crate::options::{DEFAULT_SHARD_SIZE, Precision};
use crate::options::{JobOptions, OptionsError, RawOptions};
use crate::selection::RawSelection;
use crate::sites::Sites;

/// Tokens per forward batch unless the plan says otherwise.
pub const DEFAULT_BATCH_TOKENS: usize = 4096;
/// Most prompts one job may hold.
pub const MAX_PROMPTS: usize = 4096;
/// Most projection directions one job may send.
pub const MAX_DIRECTIONS: usize = 64;

/// A place that holds an object or a prefix of objects.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Location {
    /// A local path.
    Local(PathBuf),
    /// `s3://bucket/prefix` on any S3-compatible server.
    S3 {
        /// The bucket.
        bucket: String,
        /// The key prefix, without leading or trailing slashes (may be empty).
        prefix: String,
    },
}

/// Why a plan is invalid.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// An `s3://` URL without a bucket.
    #[error("{value:?} is not a valid location: write s3://bucket/prefix or a local path")]
    BadLocation {
        /// What was given.
        value: String,
    },
    /// A zero or absurd number.
    #[error("{field} must be between 1 and {max}, got {value}")]
    OutOfRange {
        /// The field.
        field: &'static str,
        /// What was given.
        value: usize,
        /// The largest accepted value.
        max: usize,
    },
    /// A required string is empty.
    #[error("{field} is empty: give a path or an s3:// URL")]
    Empty {
        /// The field.
        field: &'static str,
    },
    /// The job's options are refused.
    #[error(transparent)]
    Options(#[from] OptionsError),
}

/// The plan as written, before validation. Unknown fields are an error, never ignored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPlan {
    /// Checkpoint directory (Hugging Face layout).
    pub model: String,
    /// Prompts file: `.jsonl` with `{"text": ...}` per line, a `.json` list of strings, or `.txt`
    /// with one prompt per line. A local path or `s3://bucket/key`.
    pub prompts: String,
    /// Which block outputs to keep.
    #[serde(default)]
    pub layers: LayerSelection,
    /// Which hook sites of each kept block to keep (default `["resid_post"]`).
    #[serde(default, skip_serializing_if = "Sites::is_default")]
    pub sites: Sites,
    /// Prompts per shard.
    #[serde(default = "default_shard_size")]
    pub shard_size: usize,
    /// Whether the tokenizer adds its special tokens (BOS for Llama 3).
    #[serde(default = "default_true")]
    pub add_special_tokens: bool,
    /// Optional projection directions, `[n, hidden]` in `.safetensors` or `.npy`.
    #[serde(default)]
    pub project_onto: Option<String>,
    /// Output directory or `s3://bucket/prefix`.
    pub output: String,
    /// Tokens per forward batch.
    #[serde(default = "default_batch_tokens")]
    pub batch_tokens: usize,
    /// Drop the tokens the tokenizer marks special.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub exclude_special_tokens: bool,
    /// Keep positions `[start, end)` of each prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub positions: Option<Vec<u64>>,
    /// Keep only the tokens of these roles (`assistant`, ...): conversations only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub roles: Option<Vec<String>>,
    /// Keep each token with this probability (seeded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sample_rate: Option<f64>,
    /// The sampling's seed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Drop tokens whose resid_post norm exceeds this multiple of the running median.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_norm_multiple: Option<f64>,
    /// `by_prompt` (the seed's shards) or `shuffled` (training files).
    #[serde(default, skip_serializing_if = "is_by_prompt")]
    pub layout: LayoutName,
    /// Rows per training file of the shuffled layout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows_per_file: Option<usize>,
    /// `f32` or `bf16`; none for the device's own ([`Precision::or_device`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<Precision>,
    /// Cut each prompt to its first N tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_prompt_tokens: Option<usize>,
}

fn is_by_prompt(name: &LayoutName) -> bool {
    *name == LayoutName::ByPrompt
}

fn default_shard_size() -> usize {
    DEFAULT_SHARD_SIZE
}

fn default_batch_tokens() -> usize {
    DEFAULT_BATCH_TOKENS
}

fn default_true() -> bool {
    true
}

/// A validated plan.
#[derive(Debug, Clone, PartialEq)]
pub struct HarvestPlan {
    /// Checkpoint directory.
    pub model: PathBuf,
    /// Prompts file.
    pub prompts: Location,
    /// Optional projection directions.
    pub project_onto: Option<Location>,
    /// Output location.
    pub output: Location,
    /// Tokens per forward batch.
    pub batch_tokens: NonZeroUsize,
    /// What the job keeps and how it is cut; its layers resolve once the model is known.
    pub options: JobOptions<LayerSelection>,
}

/// A plan whose layers are resolved against the model: what the worker runs.
#[derive(Debug, Clone, PartialEq)]
pub struct ResolvedPlan {
    /// Checkpoint directory.
    pub model: PathBuf,
    /// Prompts file.
    pub prompts: Location,
    /// Optional projection directions.
    pub project_onto: Option<Location>,
    /// Output location.
    pub output: Location,
    /// Tokens per forward batch.
    pub batch_tokens: NonZeroUsize,
    /// What the job keeps and how it is cut.
    pub options: JobOptions,
}

impl HarvestPlan {
    /// Resolves the layer selection against the model.
    pub fn resolve(self, shape: &ModelShape) -> Result<ResolvedPlan, LayerError> {
        let Self {
            model,
            prompts,
            project_onto,
            output,
            batch_tokens,
            options,
        } = self;
        Ok(ResolvedPlan {
            model,
            prompts,
            project_onto,
            output,
            batch_tokens,
            options: options.resolve(shape)?,
        })
    }
}

impl ResolvedPlan {
    /// The plan as a worker is handed it (`plan.json`, `--plan-json`), layers listed.
    pub fn to_raw(&self) -> RawPlan {
        let Self {
            model,
            prompts,
            project_onto,
            output,
            batch_tokens,
            options,
        } = self;
        let RawOptions {
            layers,
            sites,
            selection,
            layout,
            rows_per_file,
            precision,
            shard_size,
            add_special_tokens,
            max_prompt_tokens,
        } = options.to_raw();
        RawPlan {
            model: model.display().to_string(),
            prompts: prompts.to_string(),
            layers,
            sites,
            shard_size,
            add_special_tokens,
            project_onto: project_onto.as_ref().map(Location::to_string),
            output: output.to_string(),
            batch_tokens: batch_tokens.get(),
            exclude_special_tokens: selection.exclude_special_tokens.unwrap_or(false),
            positions: selection.positions,
            roles: selection.roles,
            sample_rate: selection.sample_rate,
            seed: selection.seed,
            max_norm_multiple: selection.max_norm_multiple,
            layout,
            rows_per_file,
            precision,
            max_prompt_tokens,
        }
    }
}

impl Location {
    /// Parses `s3://bucket/prefix` or a local path.
    pub fn parse(value: &str, field: &'static str) -> Result<Self, PlanError> {
        if value.trim().is_empty() {
            return Err(PlanError::Empty { field });
        }
        match value.strip_prefix("s3://") {
            None => Ok(Self::Local(PathBuf::from(value))),
            Some(rest) => {
                let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
                if bucket.is_empty() {
                    return Err(PlanError::BadLocation {
                        value: value.to_owned(),
                    });
                }
                Ok(Self::S3 {
                    bucket: bucket.to_owned(),
                    prefix: prefix.trim_matches('/').to_owned(),
                })
            }
        }
    }
}

impl Location {
    /// Whether this location lies inside `root`: the same store, and every path segment of
    /// `root` its own first ones. A location that climbs (`..`) or names `.` lies nowhere.
    pub fn is_within(&self, root: &Location) -> bool {
        fn segments(path: &str) -> Option<Vec<&str>> {
            let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
            (!parts.iter().any(|p| *p == ".." || *p == ".")).then_some(parts)
        }
        let (mine, theirs) = match (self, root) {
            (
                Self::S3 { bucket, prefix },
                Self::S3 {
                    bucket: root_bucket,
                    prefix: root_prefix,
                },
            ) if bucket == root_bucket => (segments(prefix), segments(root_prefix)),
            (Self::Local(path), Self::Local(root_path)) => {
                match (path.to_str(), root_path.to_str()) {
                    (Some(path), Some(root_path))
                        if path.starts_with('/') && root_path.starts_with('/') =>
                    {
                        (segments(path), segments(root_path))
                    }
                    _ => (None, None),
                }
            }
            _ => (None, None),
        };
        match (mine, theirs) {
            (Some(mine), Some(theirs)) => mine.starts_with(&theirs),
            _ => false,
        }
    }
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Local(path) => write!(f, "{}", path.display()),
            Self::S3 { bucket, prefix } if prefix.is_empty() => write!(f, "s3://{bucket}"),
            Self::S3 { bucket, prefix } => write!(f, "s3://{bucket}/{prefix}"),
        }
    }
}

fn bounded(field: &'static str, value: usize, max: usize) -> Result<NonZeroUsize, PlanError> {
    NonZeroUsize::new(value)
        .filter(|v| v.get() <= max)
        .ok_or(PlanError::OutOfRange { field, value, max })
}

impl TryFrom<RawPlan> for HarvestPlan {
    type Error = PlanError;

    fn try_from(raw: RawPlan) -> Result<Self, PlanError> {
        let RawPlan {
            model,
            prompts,
            layers,
            sites,
            shard_size,
            add_special_tokens,
            project_onto,
            output,
            batch_tokens,
            exclude_special_tokens,
            positions,
            roles,
            sample_rate,
            seed,
            max_norm_multiple,
            layout,
            rows_per_file,
            precision,
            max_prompt_tokens,
        } = raw;
        if model.trim().is_empty() {
            return Err(PlanError::Empty { field: "model" });
        }
        let options = RawOptions {
            layers,
            sites,
            selection: RawSelection {
                exclude_special_tokens: Some(exclude_special_tokens),
                positions,
                roles,
                sample_rate,
                seed,
                max_norm_multiple,
            },
            layout,
            rows_per_file,
            precision,
            shard_size,
            add_special_tokens,
            max_prompt_tokens,
        }
        .validate(project_onto.is_some())?;
        Ok(Self {
            model: PathBuf::from(model),
            prompts: Location::parse(&prompts, "prompts")?,
            project_onto: project_onto
                .as_deref()
                .map(|p| Location::parse(p, "project_onto"))
                .transpose()?,
            output: Location::parse(&output, "output")?,
            batch_tokens: bounded("batch_tokens", batch_tokens, 1 << 20)?,
            options,
        })
    }
}

/// How many shards `n_prompts` prompts fill.
pub fn shard_count(n_prompts: usize, shard_size: NonZeroUsize) -> usize {
    n_prompts.div_ceil(shard_size.get())
}

/// One of `count` parts of a job (`index` from 0): a contiguous range of its shards, so that
/// several workers can run one job and a finalize step can close it as one run would.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    index: usize,
    count: usize,
}

impl Part {
    /// Part `index` of `count`; `count` is at least 1 and `index` below it.
    pub fn new(index: usize, count: usize) -> Result<Self, String> {
        if count == 0 || index >= count {
            return Err(format!(
                "part {index}/{count}: write INDEX/COUNT with COUNT at least 1 and INDEX from 0 to COUNT - 1, e.g. 0/4"
            ));
        }
        Ok(Self { index, count })
    }

    /// Its index, from 0.
    pub fn index(self) -> usize {
        self.index
    }

    /// How many parts the job has.
    pub fn count(self) -> usize {
        self.count
    }

    /// Its shards of a job of `n_shards`: contiguous, every part within one shard of the
    /// others in size, the earlier ones the larger (a part past the shards has none).
    pub fn shards(self, n_shards: usize) -> std::ops::Range<usize> {
        let (base, extra) = (n_shards / self.count, n_shards % self.count);
        let start = self.index * base + self.index.min(extra);
        start..start + base + usize::from(self.index < extra)
    }
}

impl std::fmt::Display for Part {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

impl std::str::FromStr for Part {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let parse = |s: &str| s.trim().parse::<usize>().ok();
        match text.split_once('/').map(|(i, n)| (parse(i), parse(n))) {
            Some((Some(index), Some(count))) => Self::new(index, count),
            _ => Err(format!(
                "{text:?} is not a part: write INDEX/COUNT, e.g. 0/4 for the first of four"
            )),
        }
    }
}

/// The prompt indices of shard `shard`: `[shard * size, min((shard + 1) * size, n_prompts))`.
pub fn shard_prompts(
    shard: usize,
    shard_size: NonZeroUsize,
    n_prompts: usize,
) -> std::ops::Range<usize> {
    let size = shard_size.get();
    (shard * size).min(n_prompts)..((shard + 1) * size).min(n_prompts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(json: &str) -> Result<RawPlan, serde_json::Error> {
        serde_json::from_str(json)
    }

    #[test]
    fn a_location_is_within_a_root_only_below_it_in_the_same_store() {
        let at = |s: &str| Location::parse(s, "output").unwrap();
        let root = at("s3://harvest/teams/a");
        assert!(at("s3://harvest/teams/a").is_within(&root));
        assert!(at("s3://harvest/teams/a/job-1/").is_within(&root));
        for outside in [
            "s3://harvest",
            "s3://harvest/teams",
            "s3://harvest/teams/ab",
            "s3://harvest/teams/a/../b",
            "s3://other/teams/a/x",
            "/teams/a/x",
        ] {
            assert!(!at(outside).is_within(&root), "{outside}");
        }
        let local = at("/data/teams/a");
        assert!(at("/data/teams/a/x").is_within(&local));
        assert!(!at("/data/teams/a/../b").is_within(&local));
        assert!(!at("/data/teams/ab").is_within(&local));
        assert!(!at("relative/x").is_within(&at("relative")));
    }

    #[test]
    fn a_minimal_plan_gets_the_documented_defaults() {
        let plan: HarvestPlan =
            raw(r#"{"model": "m", "prompts": "p.jsonl", "output": "s3://bucket/jobs/1/"}"#)
                .unwrap()
                .try_into()
                .unwrap();
        assert_eq!(plan.options.shard_size.get(), 32);
        assert_eq!(plan.batch_tokens.get(), 4096);
        assert!(plan.options.add_special_tokens);
        assert_eq!(plan.options.layers, LayerSelection::Quartiles);
        assert_eq!(
            plan.output,
            Location::S3 {
                bucket: "bucket".into(),
                prefix: "jobs/1".into()
            }
        );
        assert_eq!(plan.output.to_string(), "s3://bucket/jobs/1");
    }

    #[test]
    fn a_resolved_plan_travels_as_a_raw_plan_that_resolves_to_the_same_plan() {
        let shape = ModelShape {
            num_layers: 30,
            hidden_size: 576,
            moe: None,
        };
        let plan: HarvestPlan = raw(
            r#"{"model": "/m", "prompts": "s3://b/in/p.jsonl", "output": "/out", "project_onto": "/d.npy", "shard_size": 4}"#,
        )
        .unwrap()
        .try_into()
        .unwrap();
        let resolved = plan.resolve(&shape).unwrap();
        assert_eq!(resolved.options.layers.as_slice(), &[7, 15, 22]);
        let wire = serde_json::to_string(&resolved.to_raw()).unwrap();
        let again = HarvestPlan::try_from(raw(&wire).unwrap())
            .unwrap()
            .resolve(&shape)
            .unwrap();
        assert_eq!(again, resolved);
    }

    #[test]
    fn resolving_names_a_layer_the_model_does_not_have() {
        let shape = ModelShape {
            num_layers: 2,
            hidden_size: 8,
            moe: None,
        };
        let plan: HarvestPlan =
            raw(r#"{"model": "m", "prompts": "p", "output": "o", "layers": [2]}"#)
                .unwrap()
                .try_into()
                .unwrap();
        let error = plan.resolve(&shape).unwrap_err();
        assert!(error.to_string().contains("layer 2"), "{error}");
    }

    #[test]
    fn an_unknown_field_is_rejected_by_name() {
        let err =
            raw(r#"{"model": "m", "prompts": "p", "output": "o", "shard_sise": 4}"#).unwrap_err();
        assert!(err.to_string().contains("shard_sise"), "{err}");
    }

    #[test]
    fn a_zero_shard_size_is_rejected_with_the_range() {
        let err = HarvestPlan::try_from(
            raw(r#"{"model": "m", "prompts": "p", "output": "o", "shard_size": 0}"#).unwrap(),
        )
        .unwrap_err();
        assert_eq!(
            err,
            PlanError::Options(OptionsError::OutOfRange {
                field: "shard_size",
                value: 0,
                max: crate::options::MAX_SHARD_SIZE
            })
        );
    }

    #[test]
    fn an_s3_url_without_bucket_is_rejected() {
        assert!(Location::parse("s3:///x", "output").is_err());
        assert_eq!(
            Location::parse("s3://b", "output").unwrap(),
            Location::S3 {
                bucket: "b".into(),
                prefix: String::new()
            }
        );
    }

    #[test]
    fn shards_cover_prompts_in_order_with_a_short_last_shard() {
        let size = NonZeroUsize::new(32).unwrap();
        assert_eq!(shard_count(65, size), 3);
        assert_eq!(shard_prompts(0, size, 65), 0..32);
        assert_eq!(shard_prompts(2, size, 65), 64..65);
        assert_eq!(shard_count(0, size), 0);
        assert_eq!(shard_file_name(7), "shard_00007.safetensors");
    }

    #[test]
    fn parts_cover_every_shard_once_in_order_and_differ_by_at_most_one() {
        for n_shards in 0..20 {
            for count in 1..8 {
                let ranges: Vec<_> = (0..count)
                    .map(|i| Part::new(i, count).unwrap().shards(n_shards))
                    .collect();
                assert_eq!(ranges.first().map(|r| r.start), Some(0));
                assert_eq!(ranges.last().map(|r| r.end), Some(n_shards));
                assert!(ranges.windows(2).all(|w| w[0].end == w[1].start));
                let sizes: Vec<_> = ranges.iter().map(|r| r.len()).collect();
                let (min, max) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
                assert!(max - min <= 1, "{n_shards} shards in {count}: {sizes:?}");
            }
        }
        assert_eq!(Part::new(1, 3).unwrap().shards(7), 3..5);
    }

    #[test]
    fn a_part_is_written_index_slash_count_and_a_bad_one_names_the_form() {
        let part: Part = "2/4".parse().unwrap();
        assert_eq!(
            (part.index(), part.count(), part.to_string()),
            (2, 4, "2/4".to_owned())
        );
        for bad in ["4/4", "0/0", "two/4", "3"] {
            let error = bad.parse::<Part>().unwrap_err();
            assert!(error.contains("INDEX/COUNT"), "{bad}: {error}");
        }
    }
}
