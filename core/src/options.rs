//! What a job keeps and how it is cut: [`JobOptions`], the one options type from the REST
//! edge to the worker.
//!
//! Each edge (the REST request, `plan.json` and the CLI, the `HarvestJob`'s `spec.harvest`)
//! parses its own wire form, moves the fields into a [`RawOptions`], and validates it here, so
//! the three agree on defaults, bounds and messages. The write-back direction is
//! [`JobOptions::to_raw`]: what an edge writes so that reading it again gives the same options.
//!
//! ```text
//! REST body / plan.json / spec.harvest ──► RawOptions ──validate──► JobOptions<LayerSelection>
//!                                                  ◄──to_raw──     ──resolve(&ModelShape)──► JobOptions
//! ```
//!
//! A new option is a field of [`RawOptions`] and of [`JobOptions`], checked in
//! [`RawOptions::validate`] and written back in [`JobOptions::to_raw`].

use std::num::NonZeroUsize;

use serde::{Deserialize, Serialize};

use crate::layers::{LayerError, LayerSelection, Layers};
use crate::layout::{Layout, LayoutError, LayoutName, MAX_ROWS_PER_FILE};
use crate::model::{ModelShape, ServedModel};
use crate::selection::{RawSelection, SelectionError, TokenSelection};
use crate::sites::{Site, SiteError, Sites};

/// Prompts per shard unless the job says otherwise.
pub const DEFAULT_SHARD_SIZE: usize = 32;
/// Most prompts per shard.
pub const MAX_SHARD_SIZE: usize = 4096;
/// Largest accepted `max_prompt_tokens`; the model's context window caps it further.
pub const MAX_PROMPT_TOKENS: usize = 1 << 20;
/// The whole-number options, each accepted from 1 to its maximum: what [`RawOptions::validate`]
/// checks, and what the REST schema declares.
pub const COUNT_LIMITS: [(&str, usize); 3] = [
    ("shard_size", MAX_SHARD_SIZE),
    ("rows_per_file", MAX_ROWS_PER_FILE),
    ("max_prompt_tokens", MAX_PROMPT_TOKENS),
];

/// The arithmetic of the forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// f32 throughout (weights widened exactly from their storage): the reference.
    #[default]
    F32,
    /// bf16 matrix-product inputs with f32 accumulation, activations rounded to bf16 at the
    /// points `docs/engine.md` lists; norms, softmax, RoPE and the residual stream stay f32.
    Bf16,
}

impl Precision {
    /// What runs when a job names no precision: the device's own arithmetic, f32 on a CPU (the
    /// reference) and bf16 on a GPU (the checkpoints' dtype, at the tensor cores' rate).
    pub fn or_device(asked: Option<Self>, gpu: bool) -> Self {
        asked.unwrap_or(if gpu { Self::Bf16 } else { Self::F32 })
    }

    /// The name flags and manifests use.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "f32" => Ok(Self::F32),
            "bf16" => Ok(Self::Bf16),
            other => Err(format!("precision {other:?} is not one of f32, bf16")),
        }
    }
}

/// Why a job's options are refused. Each message names the field and the fix.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OptionsError {
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
    /// A hook site listed twice.
    #[error(transparent)]
    Sites(#[from] SiteError),
    /// A token selection field is refused.
    #[error(transparent)]
    Selection(#[from] SelectionError),
    /// The layout is refused.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// The norm filter without what it measures.
    #[error("max_norm_multiple filters on the resid_post norm, {reason}")]
    NormFilter {
        /// What is missing, and the fix.
        reason: &'static str,
    },
}

/// Prompts per shard unless the job says otherwise, as a count that is never zero.
const DEFAULT_SHARD: NonZeroUsize = match NonZeroUsize::new(DEFAULT_SHARD_SIZE) {
    Some(n) => n,
    None => panic!("DEFAULT_SHARD_SIZE is not zero"),
};

/// The options as an edge read them, before validation; omitted fields hold their defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct RawOptions {
    /// Which blocks to keep.
    pub layers: LayerSelection,
    /// Which hook sites of each kept block to keep.
    pub sites: Sites,
    /// The token selection's fields.
    pub selection: RawSelection,
    /// How the files are laid out.
    pub layout: LayoutName,
    /// Rows per training file (shuffled layout only).
    pub rows_per_file: Option<usize>,
    /// The engine's arithmetic; none for the device's own ([`Precision::or_device`]).
    pub precision: Option<Precision>,
    /// Prompts per shard.
    pub shard_size: usize,
    /// Whether the tokenizer adds its special tokens.
    pub add_special_tokens: bool,
    /// Cut each prompt to its first N tokens.
    pub max_prompt_tokens: Option<usize>,
}

impl Default for RawOptions {
    fn default() -> Self {
        Self {
            layers: LayerSelection::default(),
            sites: Sites::default(),
            selection: RawSelection::default(),
            layout: LayoutName::default(),
            rows_per_file: None,
            precision: None,
            shard_size: DEFAULT_SHARD_SIZE,
            add_special_tokens: true,
            max_prompt_tokens: None,
        }
    }
}

/// A job's validated options. `L` is what its layers are: a [`LayerSelection`] until the model
/// is known, then the resolved [`Layers`]. The serialized form is the one job rows have always
/// had, so rows written before this type existed still read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobOptions<L = Layers> {
    /// Which blocks are kept.
    pub layers: L,
    /// The hook sites of each kept block (`resid_post` alone unless chosen).
    #[serde(default, skip_serializing_if = "Sites::is_default")]
    pub sites: Sites,
    /// Which tokens are kept (every token unless chosen).
    #[serde(default, skip_serializing_if = "TokenSelection::is_everything")]
    pub selection: TokenSelection,
    /// How the files are laid out (by prompt unless chosen).
    #[serde(default, skip_serializing_if = "Layout::is_by_prompt")]
    pub layout: Layout,
    /// The engine's arithmetic; none for the device's own ([`Precision::or_device`]). Rows
    /// written before it could be omitted name `f32`, which they then ran in on a CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<Precision>,
    /// Prompts per shard.
    pub shard_size: NonZeroUsize,
    /// Whether the tokenizer adds its special tokens (BOS for Llama 3).
    pub add_special_tokens: bool,
    /// Each prompt is cut to its first N tokens (special tokens included) before the forward
    /// pass; the model's context window cuts it in any case.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_prompt_tokens: Option<NonZeroUsize>,
}

/// The seed's defaults, with `L`'s default layers.
impl<L: Default> Default for JobOptions<L> {
    fn default() -> Self {
        Self {
            layers: L::default(),
            sites: Sites::default(),
            selection: TokenSelection::default(),
            layout: Layout::default(),
            precision: None,
            shard_size: DEFAULT_SHARD,
            add_special_tokens: true,
            max_prompt_tokens: None,
        }
    }
}

impl RawOptions {
    /// Validates the options of a job that does (`projecting`) or does not send directions.
    pub fn validate(self, projecting: bool) -> Result<JobOptions<LayerSelection>, OptionsError> {
        let Self {
            layers,
            sites,
            selection,
            layout,
            rows_per_file,
            precision,
            shard_size,
            add_special_tokens,
            max_prompt_tokens,
        } = self;
        let shard_size = bounded("shard_size", shard_size, MAX_SHARD_SIZE)?;
        let (selection, layout) = selection_and_layout(selection, layout, rows_per_file)?;
        check_norm_filter(&selection, &sites, projecting)?;
        let max_prompt_tokens = max_prompt_tokens
            .map(|n| bounded("max_prompt_tokens", n, MAX_PROMPT_TOKENS))
            .transpose()?;
        Ok(JobOptions {
            layers,
            sites,
            selection,
            layout,
            precision,
            shard_size,
            add_special_tokens,
            max_prompt_tokens,
        })
    }
}

impl JobOptions<LayerSelection> {
    /// Resolves the layers against the model.
    pub fn resolve(self, shape: &ModelShape) -> Result<JobOptions, LayerError> {
        let layers = shape.layers(&self.layers)?;
        Ok(self.with_layers(layers))
    }

    /// Resolves the layers against served model `model` and checks what else depends on it
    /// (the `router` site).
    pub fn resolve_served(self, model: &ServedModel) -> Result<JobOptions, LayerError> {
        let options = self.resolve(&model.shape)?;
        options.check_router(&model.name, &model.shape)?;
        Ok(options)
    }
}

impl JobOptions {
    /// Refuses the `router` site on model `name` of `shape` unless it has routed experts and a
    /// kept layer is one of its sparse blocks.
    pub fn check_router(&self, name: &str, shape: &ModelShape) -> Result<(), LayerError> {
        let Some(router) = self.sites.router() else {
            return Ok(());
        };
        let site = router.site();
        let Some(moe) = shape.moe else {
            return Err(LayerError::RouterOnDense {
                site,
                model: name.to_owned(),
            });
        };
        if shape.router_layers(&self.layers).is_empty() {
            return Err(LayerError::RouterWithoutSparseLayer {
                site,
                model: name.to_owned(),
                kept: format!("{:?}", self.layers.as_slice()),
                first: moe.first_sparse_layer,
                last: shape.num_layers.saturating_sub(1),
            });
        }
        Ok(())
    }
}

impl<L> JobOptions<L> {
    /// The same options with other layers.
    pub fn with_layers<M>(self, layers: M) -> JobOptions<M> {
        self.map_layers(|_| layers)
    }

    /// The same options with their layers mapped.
    pub fn map_layers<M>(self, map: impl FnOnce(L) -> M) -> JobOptions<M> {
        let Self {
            layers,
            sites,
            selection,
            layout,
            precision,
            shard_size,
            add_special_tokens,
            max_prompt_tokens,
        } = self;
        JobOptions {
            layers: map(layers),
            sites,
            selection,
            layout,
            precision,
            shard_size,
            add_special_tokens,
            max_prompt_tokens,
        }
    }

    /// The most tokens of a prompt that reach the forward pass, on a model whose context
    /// window holds `context_window`.
    pub fn max_tokens(&self, context_window: usize) -> usize {
        self.max_prompt_tokens
            .map_or(context_window, |n| n.get().min(context_window))
    }
}

impl JobOptions {
    /// The raw options that validate back to these: what an edge writes. The token selection
    /// and the shuffled layout share one `seed`.
    pub fn to_raw(&self) -> RawOptions {
        let Self {
            layers,
            sites,
            selection,
            layout,
            precision,
            shard_size,
            add_special_tokens,
            max_prompt_tokens,
        } = self;
        let (rows_per_file, layout_seed) = match layout {
            Layout::ByPrompt => (None, None),
            Layout::Shuffled {
                rows_per_file,
                seed,
            } => (Some(rows_per_file.get()), Some(*seed)),
        };
        RawOptions {
            layers: layers.to_selection(),
            sites: sites.clone(),
            selection: RawSelection {
                exclude_special_tokens: Some(selection.exclude_special_tokens),
                positions: selection
                    .positions
                    .map(|p| vec![u64::from(p.start), u64::from(p.end)]),
                roles: selection
                    .roles
                    .map(|r| r.names().into_iter().map(str::to_owned).collect()),
                sample_rate: selection.sample.map(|s| s.rate),
                seed: selection.sample.map(|s| s.seed).or(layout_seed),
                max_norm_multiple: selection.max_norm_multiple,
            },
            layout: layout.name(),
            rows_per_file,
            precision: *precision,
            shard_size: shard_size.get(),
            add_special_tokens: *add_special_tokens,
            max_prompt_tokens: max_prompt_tokens.map(NonZeroUsize::get),
        }
    }
}

/// 1 to `max`, or the error that names the field and the range.
pub fn bounded(
    field: &'static str,
    value: usize,
    max: usize,
) -> Result<NonZeroUsize, OptionsError> {
    NonZeroUsize::new(value)
        .filter(|v| v.get() <= max)
        .ok_or(OptionsError::OutOfRange { field, value, max })
}

/// The token selection and the layout, which share `seed`: it seeds the sampling when a rate is
/// given, and the shuffled layout's permutation.
fn selection_and_layout(
    selection: RawSelection,
    layout: LayoutName,
    rows_per_file: Option<usize>,
) -> Result<(TokenSelection, Layout), OptionsError> {
    let seed = selection.seed;
    let shuffled = layout == LayoutName::Shuffled;
    let selection = RawSelection {
        seed: seed.filter(|_| selection.sample_rate.is_some() || !shuffled),
        ..selection
    }
    .validate()?;
    let layout = Layout::new(layout, rows_per_file, seed.unwrap_or(0))?;
    Ok((selection, layout))
}

/// The norm filter measures `resid_post` at the deepest kept layer, which a projection job
/// does not keep.
fn check_norm_filter(
    selection: &TokenSelection,
    sites: &Sites,
    projecting: bool,
) -> Result<(), OptionsError> {
    if selection.max_norm_multiple.is_none() {
        return Ok(());
    }
    if !sites.contains(Site::ResidPost) {
        return Err(OptionsError::NormFilter {
            reason: "so add resid_post to sites",
        });
    }
    if projecting {
        return Err(OptionsError::NormFilter {
            reason: "which a projection job does not keep: drop project_onto or max_norm_multiple",
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOLLM: ModelShape = ModelShape {
        num_layers: 30,
        hidden_size: 576,
        moe: None,
    };

    fn every_option() -> RawOptions {
        RawOptions {
            layers: LayerSelection::Explicit(vec![7, 3]),
            sites: Sites::parse(&["resid_post", "attn_out"]).unwrap(),
            selection: RawSelection {
                exclude_special_tokens: Some(true),
                positions: Some(vec![1, 64]),
                roles: Some(vec!["assistant".into()]),
                sample_rate: Some(0.5),
                seed: Some(9),
                max_norm_multiple: None,
            },
            layout: LayoutName::Shuffled,
            rows_per_file: Some(1000),
            precision: Some(Precision::Bf16),
            shard_size: 8,
            add_special_tokens: false,
            max_prompt_tokens: Some(128),
        }
    }

    #[test]
    fn options_written_back_validate_to_the_same_options() {
        let options = every_option()
            .validate(false)
            .unwrap()
            .resolve(&SMOLLM)
            .unwrap();
        assert_eq!(options.layers.as_slice(), [3, 7]);
        let again = options
            .to_raw()
            .validate(false)
            .unwrap()
            .resolve(&SMOLLM)
            .unwrap();
        assert_eq!(again, options);
    }

    #[test]
    fn omitted_options_are_the_seeds_defaults() {
        let options = RawOptions::default()
            .validate(false)
            .unwrap()
            .resolve(&SMOLLM)
            .unwrap();
        assert_eq!(options.layers.as_slice(), [7, 15, 22]);
        assert!(options.sites.is_default() && options.selection.is_everything());
        assert!(options.layout.is_by_prompt() && options.add_special_tokens);
        assert_eq!(options.shard_size.get(), DEFAULT_SHARD_SIZE);
        assert_eq!((options.precision, options.max_prompt_tokens), (None, None));
    }

    #[test]
    fn a_job_that_names_no_precision_runs_in_its_devices_own_and_one_that_does_keeps_it() {
        assert_eq!(Precision::or_device(None, false), Precision::F32);
        assert_eq!(Precision::or_device(None, true), Precision::Bf16);
        for asked in [Precision::F32, Precision::Bf16] {
            for gpu in [false, true] {
                assert_eq!(Precision::or_device(Some(asked), gpu), asked);
            }
        }
    }

    #[test]
    fn a_zero_or_absurd_number_names_its_field_and_range() {
        for (raw, field) in [
            (
                RawOptions {
                    shard_size: 0,
                    ..RawOptions::default()
                },
                "shard_size",
            ),
            (
                RawOptions {
                    shard_size: MAX_SHARD_SIZE + 1,
                    ..RawOptions::default()
                },
                "shard_size",
            ),
            (
                RawOptions {
                    max_prompt_tokens: Some(0),
                    ..RawOptions::default()
                },
                "max_prompt_tokens",
            ),
        ] {
            let message = raw.validate(false).unwrap_err().to_string();
            assert!(
                message.starts_with(&format!("{field} must be between 1 and ")),
                "{message}"
            );
        }
    }

    #[test]
    fn the_norm_filter_needs_resid_post_and_no_directions() {
        let raw = RawOptions {
            selection: RawSelection {
                max_norm_multiple: Some(4.0),
                ..RawSelection::default()
            },
            ..RawOptions::default()
        };
        assert!(raw.clone().validate(false).is_ok());
        let projecting = raw.clone().validate(true).unwrap_err().to_string();
        assert!(projecting.contains("drop project_onto"), "{projecting}");
        let no_resid = RawOptions {
            sites: Sites::parse(&["mlp_out"]).unwrap(),
            ..raw
        };
        let message = no_resid.validate(false).unwrap_err().to_string();
        assert!(message.contains("add resid_post"), "{message}");
    }

    #[test]
    fn a_seed_without_a_rate_seeds_only_the_shuffle() {
        let raw = RawOptions {
            layout: LayoutName::Shuffled,
            selection: RawSelection {
                seed: Some(5),
                ..RawSelection::default()
            },
            ..RawOptions::default()
        };
        let options = raw.validate(false).unwrap();
        assert!(options.selection.sample.is_none());
        assert!(matches!(options.layout, Layout::Shuffled { seed: 5, .. }));
    }

    fn served(moe: Option<crate::model::MoeShape>) -> ServedModel {
        ServedModel {
            name: "trinity".into(),
            shape: ModelShape {
                num_layers: 8,
                hidden_size: 64,
                moe,
            },
            lane: crate::quota::Lane::Small,
        }
    }

    fn layers_and_sites(layers: &[i64], sites: &[&str]) -> JobOptions<LayerSelection> {
        JobOptions {
            layers: LayerSelection::Explicit(layers.to_vec()),
            sites: Sites::parse(sites).unwrap(),
            ..JobOptions::default()
        }
    }

    #[test]
    fn the_router_is_refused_on_a_dense_model_and_without_a_sparse_layer_naming_the_model() {
        let moe = Some(crate::model::MoeShape {
            first_sparse_layer: 2,
            experts: 8,
            experts_per_token: 2,
        });
        let both = ["resid_post", "router"];
        let dense = layers_and_sites(&[3], &both).resolve_served(&served(None));
        let text = dense.unwrap_err().to_string();
        assert!(text.contains("trinity is dense"), "{text}");
        let early = layers_and_sites(&[0, 1], &both).resolve_served(&served(moe));
        let text = early.unwrap_err().to_string();
        assert!(text.contains("[0, 1]") && text.contains("2..=7"), "{text}");
        let kept = layers_and_sites(&[1, 2, 7], &both).resolve_served(&served(moe));
        assert_eq!(
            served(moe).shape.router_layers(&kept.unwrap().layers),
            [2, 7]
        );
        let plain = layers_and_sites(&[1], &["resid_post"]).resolve_served(&served(None));
        assert!(plain.is_ok());
    }
}
