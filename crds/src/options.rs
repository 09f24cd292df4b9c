//! `spec.harvest`, the `HarvestJob`'s options, and both conversions between it and
//! [`JobOptions`]: [`HarvestOptions::to_options`] where a spec is read (the operator, the API's
//! record of a job), and `From<&JobOptions>` where the API writes one. An invalid option is an
//! error where it is read, never a silent default.

use harvest_core::layout::LayoutName;
use harvest_core::options::{DEFAULT_SHARD_SIZE, JobOptions, OptionsError, Precision, RawOptions};
use harvest_core::selection::RawSelection;
use harvest_core::{LayerSelection, Site, Sites};
use kube::KubeSchema;
use serde::{Deserialize, Serialize};

/// Layers, sharding and tokenizer options.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!(has(self.layers) && self.allLayers)")
        .message("give either layers or allLayers: true, not both")
)]
pub struct HarvestOptions {
    /// Block indices to keep. Omitted (and `allLayers` false): the quartiles `[n/4, n/2, 3n/4]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub layers: Option<Vec<u32>>,
    /// Keep every block.
    #[serde(default)]
    pub all_layers: bool,
    /// Hook sites to keep of each kept block. Omitted: `resid_post` alone. For a
    /// mixture-of-experts model, `router` (or `router_logits`, with the router's logits) keeps
    /// each token's expert choices at the kept sparse blocks, beside an activation site.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 7))]
    #[schemars(extend("x-kubernetes-list-type" = "set"))]
    pub sites: Option<Vec<Site>>,
    /// Prompts per shard.
    #[serde(default = "default_shard_size")]
    #[schemars(range(min = 1, max = 4096))]
    pub shard_size: u32,
    /// Whether the tokenizer adds its special tokens (BOS for Llama 3).
    #[serde(default = "default_true")]
    pub add_special_tokens: bool,
    /// Drop every token the tokenizer marks special (`tokens_i` still lists them).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub exclude_special_tokens: bool,
    /// Keep positions `[start, end)` of each prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 2, max = 2))]
    pub positions: Option<Vec<u32>>,
    /// For conversations: keep only the tokens of these roles, any of `template`, `system`,
    /// `user`, `assistant` and `tool`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 5))]
    #[schemars(extend("x-kubernetes-list-type" = "set"))]
    pub roles: Option<Vec<String>>,
    /// Keep each token with this probability, in (0, 1], decided by a hash seeded with `seed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 1.0))]
    pub sample_rate: Option<f64>,
    /// The seed of `sampleRate`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Drop tokens whose `resid_post` norm at the deepest kept layer exceeds this multiple of
    /// the running median (above 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_norm_multiple: Option<f64>,
    /// `by_prompt` (shards, the default) or `shuffled` (training files permuted with `seed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<LayoutName>,
    /// Rows per training file of the shuffled layout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 16_777_216))]
    pub rows_per_file: Option<u32>,
    /// The engine's arithmetic, `f32` or `bf16`; omitted, the device's own (f32 on a CPU,
    /// bf16 on a GPU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<Precision>,
    /// Cut each prompt to its first N tokens (special tokens included) before the forward
    /// pass; the manifest lists each cut prompt. The model's context window cuts it in any
    /// case.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1_048_576))]
    pub max_prompt_tokens: Option<u32>,
}

impl HarvestOptions {
    /// The job's options, validated for a job that does (`projecting`) or does not send
    /// directions; its layers resolve once the model is known.
    pub fn to_options(&self, projecting: bool) -> Result<JobOptions<LayerSelection>, OptionsError> {
        let layers = match (&self.layers, self.all_layers) {
            (_, true) => LayerSelection::All,
            (Some(layers), false) => {
                LayerSelection::Explicit(layers.iter().map(|&l| i64::from(l)).collect())
            }
            (None, false) => LayerSelection::Quartiles,
        };
        let sites = match &self.sites {
            None => Sites::default(),
            Some(sites) => Sites::new(sites)?,
        };
        RawOptions {
            layers,
            sites,
            selection: RawSelection {
                exclude_special_tokens: Some(self.exclude_special_tokens),
                positions: self
                    .positions
                    .as_ref()
                    .map(|p| p.iter().map(|&v| u64::from(v)).collect()),
                roles: self.roles.clone(),
                sample_rate: self.sample_rate,
                seed: self.seed,
                max_norm_multiple: self.max_norm_multiple,
            },
            layout: self.layout.unwrap_or_default(),
            rows_per_file: self.rows_per_file.map(|r| r as usize),
            precision: self.precision,
            shard_size: self.shard_size as usize,
            add_special_tokens: self.add_special_tokens,
            max_prompt_tokens: self.max_prompt_tokens.map(|n| n as usize),
        }
        .validate(projecting)
    }
}

/// The spec that reads back as these options, its defaults left out (layers always listed).
impl From<&JobOptions> for HarvestOptions {
    fn from(options: &JobOptions) -> Self {
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
        let to_u32 = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        Self {
            layers: match &layers {
                LayerSelection::Explicit(list) => Some(
                    list.iter()
                        .map(|&l| u32::try_from(l).unwrap_or(u32::MAX))
                        .collect(),
                ),
                LayerSelection::Quartiles | LayerSelection::All => None,
            },
            all_layers: layers == LayerSelection::All,
            sites: (!sites.is_default()).then(|| sites.all()),
            shard_size: to_u32(shard_size),
            add_special_tokens,
            exclude_special_tokens: selection.exclude_special_tokens.unwrap_or(false),
            positions: selection.positions.map(|p| {
                p.into_iter()
                    .map(|v| u32::try_from(v).unwrap_or(u32::MAX))
                    .collect()
            }),
            roles: selection.roles,
            sample_rate: selection.sample_rate,
            seed: selection.seed,
            max_norm_multiple: selection.max_norm_multiple,
            layout: (layout != LayoutName::ByPrompt).then_some(layout),
            rows_per_file: rows_per_file.map(to_u32),
            precision,
            max_prompt_tokens: max_prompt_tokens.map(to_u32),
        }
    }
}

impl Default for HarvestOptions {
    fn default() -> Self {
        Self {
            layers: None,
            all_layers: false,
            sites: None,
            shard_size: default_shard_size(),
            add_special_tokens: true,
            exclude_special_tokens: false,
            positions: None,
            roles: None,
            sample_rate: None,
            seed: None,
            max_norm_multiple: None,
            layout: None,
            rows_per_file: None,
            precision: None,
            max_prompt_tokens: None,
        }
    }
}

fn default_shard_size() -> u32 {
    DEFAULT_SHARD_SIZE as u32
}

fn default_true() -> bool {
    true
}

#[cfg(test)]
mod tests {
    use harvest_core::ModelShape;
    use harvest_core::layout::Layout;

    use super::*;

    const SMOLLM: ModelShape = ModelShape {
        num_layers: 30,
        hidden_size: 576,
        moe: None,
    };

    /// A spec with every option set, as a user or GitOps writes it.
    fn every_option() -> HarvestOptions {
        serde_json::from_value(serde_json::json!({
            "layers": [7, 3],
            "sites": ["attn_out", "resid_post"],
            "shardSize": 8,
            "addSpecialTokens": false,
            "excludeSpecialTokens": true,
            "positions": [1, 64],
            "sampleRate": 0.5,
            "seed": 9,
            "layout": "shuffled",
            "rowsPerFile": 1000,
            "precision": "bf16",
            "maxPromptTokens": 128,
        }))
        .unwrap()
    }

    #[test]
    fn a_spec_read_into_options_and_written_back_is_the_same_spec() {
        let spec = every_option();
        let options = spec.to_options(false).unwrap().resolve(&SMOLLM).unwrap();
        let written = HarvestOptions::from(&options);
        assert_eq!(
            written.layers,
            Some(vec![3, 7]),
            "layers are written sorted"
        );
        assert_eq!(
            written,
            HarvestOptions {
                layers: Some(vec![3, 7]),
                ..spec
            }
        );
    }

    #[test]
    fn options_written_as_a_spec_read_back_as_the_same_options() {
        let options = every_option()
            .to_options(false)
            .unwrap()
            .resolve(&SMOLLM)
            .unwrap();
        assert!(matches!(options.layout, Layout::Shuffled { seed: 9, .. }));
        assert_eq!(options.max_prompt_tokens.map(|n| n.get()), Some(128));
        let read = HarvestOptions::from(&options).to_options(false).unwrap();
        assert_eq!(read.resolve(&SMOLLM).unwrap(), options);
    }

    #[test]
    fn defaults_are_left_out_of_a_written_spec() {
        let options = HarvestOptions::default()
            .to_options(false)
            .unwrap()
            .resolve(&SMOLLM)
            .unwrap();
        let written = serde_json::to_value(HarvestOptions::from(&options)).unwrap();
        assert_eq!(
            written,
            serde_json::json!({"layers": [7, 15, 22], "allLayers": false, "shardSize": 32, "addSpecialTokens": true})
        );
    }

    #[test]
    fn an_invalid_option_is_an_error_where_it_is_read() {
        let twice = HarvestOptions {
            sites: Some(vec![Site::MlpOut, Site::MlpOut]),
            ..HarvestOptions::default()
        };
        assert!(matches!(
            twice.to_options(false),
            Err(OptionsError::Sites(_))
        ));
        let rows_alone = HarvestOptions {
            rows_per_file: Some(10),
            ..HarvestOptions::default()
        };
        let message = rows_alone.to_options(false).unwrap_err().to_string();
        assert!(
            message.contains("rows_per_file applies to layout"),
            "{message}"
        );
        let zero = HarvestOptions {
            max_prompt_tokens: Some(0),
            ..HarvestOptions::default()
        };
        assert!(zero.to_options(false).is_err());
    }
}
