//! `config.json` of a Hugging Face checkpoint: a loose mirror parsed at the edge, then one
//! validation step into [`ModelConfig`], which has no optional soup left in it.

use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, ModelError, Result};

/// The decoder families that share the Llama block and that harvest runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// `LlamaForCausalLM` (Llama 2, 3, 3.1, SmolLM, …).
    Llama,
    /// `MistralForCausalLM`: Llama blocks with an optional sliding attention window.
    Mistral,
    /// `Qwen2ForCausalLM`: Llama blocks with biases on the Q, K and V projections.
    Qwen2,
    /// `AfmoeForCausalLM` (Arcee's Trinity): Llama attention with per-head QK norms and a
    /// sigmoid output gate, norms on both branch outputs, and mixture-of-experts MLPs after the
    /// leading dense blocks ([`AfmoeConfig`]).
    Afmoe,
}

impl Architecture {
    /// The Hugging Face class name.
    pub fn hf_name(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Afmoe => "AfmoeForCausalLM",
        }
    }

    fn from_hf_name(name: &str) -> Option<Self> {
        match name {
            "LlamaForCausalLM" | "LlamaModel" => Some(Self::Llama),
            "MistralForCausalLM" | "MistralModel" => Some(Self::Mistral),
            "Qwen2ForCausalLM" | "Qwen2Model" => Some(Self::Qwen2),
            "AfmoeForCausalLM" | "AfmoeModel" => Some(Self::Afmoe),
            _ => None,
        }
    }
}

/// How RoPE frequencies are rescaled for long contexts.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Position interpolation: every frequency divided by `factor`.
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// The piecewise scaling of Llama 3.1.
    Llama3 {
        /// Divisor for low frequencies.
        factor: f64,
        /// Wavelength threshold (as a fraction of the original context) for low frequencies.
        low_freq_factor: f64,
        /// Wavelength threshold for high frequencies, which are left alone.
        high_freq_factor: f64,
        /// The context length the model was pre-trained with.
        original_max_position_embeddings: f64,
    },
    /// Frequency `i` divided by `factors[i]`, as llama.cpp applies a GGUF's `rope_freqs` tensor
    /// (which is how Llama 3.x GGUFs carry the scaling above). The GGUF importer writes it as
    /// `{"rope_type": "frequency_factors", "factors": [...]}`.
    FrequencyFactors {
        /// One per frequency (`head_dim / 2`), each finite and positive.
        factors: Vec<f64>,
    },
}

/// A validated model configuration: everything the forward pass needs, nothing optional.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Which family.
    pub architecture: Architecture,
    /// Residual-stream width.
    pub hidden_size: usize,
    /// MLP inner width.
    pub intermediate_size: usize,
    /// Decoder blocks.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `num_heads`).
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE rescaling.
    pub rope_scaling: RopeScaling,
    /// Context window; longer prompts are truncated to it.
    pub max_position_embeddings: usize,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// Whether the LM head shares the embedding (it is never computed, but the tensor may be absent).
    pub tie_word_embeddings: bool,
    /// Biases on the Q, K and V projections.
    pub qkv_bias: bool,
    /// A bias on the attention output projection.
    pub o_bias: bool,
    /// Per block: keys this many positions back or further are masked (Mistral, and Qwen2 with
    /// `use_sliding_window`); `None` is full causal attention.
    pub attention_windows: Vec<Option<usize>>,
    /// Per block: whether RoPE rotates Q and K (AFMoE's full-attention blocks have no RoPE).
    pub rotary: Vec<bool>,
    /// AFMoE's extras; `None` for the plain Llama block.
    pub afmoe: Option<AfmoeConfig>,
}

/// What an AFMoE block adds to the Llama block, as transformers' `AfmoeForCausalLM` computes it:
/// - attention: RMSNorm on each query and key head before RoPE, and the attention output
///   multiplied by `sigmoid(gate_proj(normed input))` before `o_proj`;
/// - each branch's output goes through its own RMSNorm before it joins the residual stream;
/// - the embedding is scaled by `embedding_scale`;
/// - blocks from `num_dense_layers` on replace the MLP with shared experts (one SwiGLU MLP of
///   `num_shared_experts × expert_intermediate_size`) plus `experts_per_token` routed experts:
///   sigmoid router scores, top-k on the scores plus `expert_bias`, the chosen scores normalised
///   to sum to one and multiplied by `route_scale`.
#[derive(Debug, Clone, PartialEq)]
pub struct AfmoeConfig {
    /// Leading blocks with a dense MLP of `intermediate_size`.
    pub num_dense_layers: usize,
    /// Routed experts per sparse block.
    pub num_experts: usize,
    /// Experts each token is routed to.
    pub experts_per_token: usize,
    /// Inner width of one expert.
    pub expert_intermediate_size: usize,
    /// Shared experts, fused into one MLP (zero for none).
    pub num_shared_experts: usize,
    /// Multiplies the normalised routing weights.
    pub route_scale: f64,
    /// Multiplies the token embedding: `sqrt(hidden_size)` with muP, else 1.
    pub embedding_scale: f64,
}

#[derive(Debug, Deserialize)]
struct RawConfig {
    #[serde(default)]
    architectures: Vec<String>,
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: f64,
    rope_theta: Option<f64>,
    rope_scaling: Option<RawRopeScaling>,
    /// transformers 5 writes RoPE settings here, theta included.
    rope_parameters: Option<RawRopeScaling>,
    max_position_embeddings: usize,
    vocab_size: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    hidden_act: Option<String>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    max_window_layers: Option<usize>,
    layer_types: Option<Vec<String>>,
    #[serde(flatten)]
    afmoe: RawAfmoe,
}

/// AFMoE's keys (transformers' `AfmoeConfig`, and the published checkpoints' extra routing
/// keys, which must hold their neutral values).
#[derive(Debug, Default, Deserialize)]
struct RawAfmoe {
    num_dense_layers: Option<usize>,
    moe_intermediate_size: Option<usize>,
    num_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    num_shared_experts: Option<usize>,
    route_scale: Option<f64>,
    route_norm: Option<bool>,
    score_func: Option<String>,
    global_attn_every_n_layers: Option<usize>,
    mup_enabled: Option<bool>,
    n_group: Option<usize>,
    topk_group: Option<usize>,
    num_expert_groups: Option<usize>,
    num_limited_groups: Option<usize>,
}

#[derive(Debug, Deserialize)]
struct RawRopeScaling {
    rope_theta: Option<f64>,
    rope_type: Option<String>,
    #[serde(rename = "type")]
    legacy_type: Option<String>,
    factor: Option<f64>,
    low_freq_factor: Option<f64>,
    high_freq_factor: Option<f64>,
    original_max_position_embeddings: Option<f64>,
    factors: Option<Vec<f64>>,
}

impl ModelConfig {
    /// Reads and validates `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| match source.kind() {
            std::io::ErrorKind::NotFound => Error::Model(ModelError::MissingFile {
                path: path.to_owned(),
                hint: "a Hugging Face checkpoint directory needs config.json",
            }),
            _ => Error::io("reading", path, source),
        })?;
        Self::parse(&text, path)
    }

    /// Parses and validates `config.json` text; `path` is only named in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        let raw: RawConfig = serde_json::from_str(text).map_err(|e| {
            Error::Model(ModelError::BadConfig {
                path: path.to_owned(),
                reason: e.to_string(),
            })
        })?;
        raw.validate(path)
    }

    /// The RoPE inverse frequencies, one per pair of head dimensions, as Hugging Face computes
    /// them (including Llama 3.1 scaling).
    pub fn inverse_frequencies(&self) -> Vec<f64> {
        let dim = self.head_dim as f64;
        let base: Vec<f64> = (0..self.head_dim / 2)
            .map(|i| 1.0 / self.rope_theta.powf((2 * i) as f64 / dim))
            .collect();
        match &self.rope_scaling {
            RopeScaling::None => base,
            RopeScaling::Linear { factor } => base.into_iter().map(|f| f / factor).collect(),
            RopeScaling::FrequencyFactors { factors } => {
                base.iter().zip(factors).map(|(f, k)| f / k).collect()
            }
            &RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old_context,
            } => {
                let low_freq_wavelen = old_context / low_freq_factor;
                let high_freq_wavelen = old_context / high_freq_factor;
                base.into_iter()
                    .map(|freq| {
                        let wavelen = 2.0 * std::f64::consts::PI / freq;
                        if wavelen < high_freq_wavelen {
                            freq
                        } else if wavelen > low_freq_wavelen {
                            freq / factor
                        } else {
                            let smooth = (old_context / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * freq / factor + smooth * freq
                        }
                    })
                    .collect()
            }
        }
    }

    /// The geometry every component shares (depth, width, and the routed experts).
    pub fn shape(&self) -> harvest_core::ModelShape {
        let moe = self
            .afmoe
            .as_ref()
            .filter(|a| a.num_dense_layers < self.num_layers);
        harvest_core::ModelShape {
            num_layers: self.num_layers,
            hidden_size: self.hidden_size,
            moe: moe.map(|a| harvest_core::model::MoeShape {
                first_sparse_layer: a.num_dense_layers,
                experts: a.num_experts,
                experts_per_token: a.experts_per_token,
            }),
        }
    }

    /// Width of the fused Q|K|V projection output.
    pub fn qkv_width(&self) -> usize {
        (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
    }

    /// What the token embedding is multiplied by: AFMoE's muP scale, else 1.
    pub fn embedding_scale(&self) -> f32 {
        self.afmoe
            .as_ref()
            .map_or(1.0, |a| a.embedding_scale as f32)
    }

    /// Whether block `layer` has routed experts.
    pub fn is_sparse(&self, layer: usize) -> bool {
        self.afmoe
            .as_ref()
            .is_some_and(|moe| layer >= moe.num_dense_layers)
    }

    /// Inner width of block `layer`'s dense MLP: `intermediate_size`, or for a sparse block its
    /// fused shared experts (zero when it has none).
    pub fn mlp_width(&self, layer: usize) -> usize {
        match &self.afmoe {
            Some(moe) if layer >= moe.num_dense_layers => {
                moe.num_shared_experts * moe.expert_intermediate_size
            }
            _ => self.intermediate_size,
        }
    }
}

impl RawConfig {
    fn validate(mut self, path: &Path) -> Result<ModelConfig> {
        let architecture = architecture(&self.architectures, self.model_type.take())?;
        let bad = |reason: String| {
            Error::Model(ModelError::BadConfig {
                path: path.to_owned(),
                reason,
            })
        };
        let afmoe = self.take_afmoe(architecture).map_err(bad)?;
        let Self {
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            rope_parameters,
            max_position_embeddings,
            vocab_size,
            tie_word_embeddings,
            attention_bias,
            mlp_bias,
            hidden_act,
            sliding_window,
            use_sliding_window,
            max_window_layers,
            layer_types,
            ..
        } = self;
        check_supported(
            hidden_act,
            mlp_bias,
            [hidden_size, intermediate_size, vocab_size],
        )
        .map_err(bad)?;
        let (num_kv_heads, head_dim) = heads(
            hidden_size,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
        )
        .map_err(bad)?;
        let (rope_theta, rope_scaling) =
            rope(rope_theta, rope_scaling, rope_parameters, head_dim).map_err(bad)?;
        let attention_windows = attention_windows(
            architecture,
            num_hidden_layers,
            sliding_window,
            use_sliding_window.unwrap_or(false),
            max_window_layers.unwrap_or(0),
            layer_types.as_deref(),
        )
        .map_err(bad)?;
        let rotary = rotary_blocks(architecture, &attention_windows);
        let (qkv_bias, o_bias) = match architecture {
            Architecture::Qwen2 => (true, false),
            _ => (attention_bias, attention_bias),
        };
        Ok(ModelConfig {
            architecture,
            hidden_size,
            intermediate_size,
            num_layers: num_hidden_layers,
            num_heads: num_attention_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            vocab_size,
            tie_word_embeddings,
            qkv_bias,
            o_bias,
            attention_windows,
            rotary,
            afmoe,
        })
    }
}

impl RawConfig {
    /// For AFMoE, its validated extras, with transformers' defaults filled in where the Llama
    /// keys mean something else: `layer_types` from `global_attn_every_n_layers`, a 1024-token
    /// window, and `head_dim` 128.
    fn take_afmoe(
        &mut self,
        architecture: Architecture,
    ) -> std::result::Result<Option<AfmoeConfig>, String> {
        if architecture != Architecture::Afmoe {
            return Ok(None);
        }
        let raw = std::mem::take(&mut self.afmoe);
        let every = raw.global_attn_every_n_layers;
        let given = self.layer_types.take();
        self.layer_types = Some(afmoe_layer_types(given, every, self.num_hidden_layers)?);
        self.sliding_window = Some(self.sliding_window.unwrap_or(1024));
        self.head_dim = Some(self.head_dim.unwrap_or(128));
        raw.validate(self.num_hidden_layers, self.hidden_size)
            .map(Some)
    }
}

impl RawAfmoe {
    fn validate(
        self,
        num_layers: usize,
        hidden_size: usize,
    ) -> std::result::Result<AfmoeConfig, String> {
        if let Some(score) = self.score_func.filter(|s| s != "sigmoid") {
            return Err(format!(
                "score_func {score:?} is not supported: AFMoE routes on sigmoid scores (\"sigmoid\")"
            ));
        }
        if self.route_norm == Some(false) {
            return Err("route_norm false is not supported: AFMoE normalises the chosen scores (route_norm true)".into());
        }
        for (groups_key, groups, limit_key, limit) in [
            ("n_group", self.n_group, "topk_group", self.topk_group),
            (
                "num_expert_groups",
                self.num_expert_groups,
                "num_limited_groups",
                self.num_limited_groups,
            ),
        ] {
            let groups = groups.unwrap_or(1);
            if groups > 1 && limit.unwrap_or(groups) < groups {
                return Err(format!(
                    "{groups_key} {groups} with {limit_key} {} limits routing to groups of experts, which AFMoE does not do; set {limit_key} to {groups}",
                    limit.unwrap_or(groups)
                ));
            }
        }
        let num_experts = self.num_experts.unwrap_or(64);
        let experts_per_token = self.num_experts_per_tok.unwrap_or(6);
        if num_experts == 0 || experts_per_token == 0 || experts_per_token > num_experts {
            return Err(format!(
                "num_experts_per_tok {experts_per_token} must be between 1 and num_experts {num_experts}"
            ));
        }
        let expert_intermediate_size = self.moe_intermediate_size.unwrap_or(1408);
        if expert_intermediate_size == 0 {
            return Err("moe_intermediate_size must be positive".into());
        }
        let num_dense_layers = self.num_dense_layers.unwrap_or(1);
        if num_dense_layers > num_layers {
            return Err(format!(
                "num_dense_layers {num_dense_layers} exceeds num_hidden_layers {num_layers}"
            ));
        }
        let route_scale = self.route_scale.unwrap_or(1.0);
        if !route_scale.is_finite() {
            return Err(format!("route_scale {route_scale} must be finite"));
        }
        Ok(AfmoeConfig {
            num_dense_layers,
            num_experts,
            experts_per_token,
            expert_intermediate_size,
            num_shared_experts: self.num_shared_experts.unwrap_or(2),
            route_scale,
            embedding_scale: if self.mup_enabled.unwrap_or(false) {
                (hidden_size as f64).sqrt()
            } else {
                1.0
            },
        })
    }
}

/// Which blocks RoPE rotates: all, except AFMoE's full-attention ones (AfmoeAttention rotates
/// only in its sliding-window layers).
fn rotary_blocks(architecture: Architecture, windows: &[Option<usize>]) -> Vec<bool> {
    match architecture {
        Architecture::Afmoe => windows.iter().map(Option::is_some).collect(),
        _ => vec![true; windows.len()],
    }
}

/// AFMoE's `layer_types`: as given, or transformers' default of every `every`-th block (4 when
/// unset) full attention and the rest sliding.
fn afmoe_layer_types(
    given: Option<Vec<String>>,
    every: Option<usize>,
    num_layers: usize,
) -> std::result::Result<Vec<String>, String> {
    if let Some(types) = given {
        return Ok(types);
    }
    let every = every.unwrap_or(4);
    if every == 0 {
        return Err("global_attn_every_n_layers must be positive".into());
    }
    Ok((0..num_layers)
        .map(|i| match (i + 1) % every {
            0 => "full_attention".to_owned(),
            _ => "sliding_attention".to_owned(),
        })
        .collect())
}

/// RoPE's base and scaling, from the transformers 4 keys or the transformers 5
/// `rope_parameters` (base 10,000 when neither gives one).
fn rope(
    theta: Option<f64>,
    scaling: Option<RawRopeScaling>,
    parameters: Option<RawRopeScaling>,
    head_dim: usize,
) -> std::result::Result<(f64, RopeScaling), String> {
    let theta = theta
        .or(parameters.as_ref().and_then(|p| p.rope_theta))
        .unwrap_or(10_000.0);
    let scaling = scaling
        .or(parameters)
        .map_or(Ok(RopeScaling::None), RawRopeScaling::validate)?;
    if let RopeScaling::FrequencyFactors { factors } = &scaling
        && factors.len() != head_dim / 2
    {
        return Err(format!(
            "rope_scaling has {} frequency factors, but head_dim {head_dim} has {} frequencies",
            factors.len(),
            head_dim / 2
        ));
    }
    Ok((theta, scaling))
}

/// What the CPU and CUDA blocks implement: a SwiGLU MLP without biases, and positive widths
/// (`hidden_size`, `intermediate_size`, `vocab_size`).
fn check_supported(
    hidden_act: Option<String>,
    mlp_bias: bool,
    widths: [usize; 3],
) -> std::result::Result<(), String> {
    if widths.contains(&0) {
        return Err("hidden_size, intermediate_size and vocab_size must be positive".into());
    }
    if let Some(act) = hidden_act.filter(|act| act != "silu") {
        return Err(format!(
            "hidden_act {act:?} is not supported; Llama blocks use \"silu\""
        ));
    }
    if mlp_bias {
        return Err("mlp_bias true is not supported".into());
    }
    Ok(())
}

/// The architecture named by `architectures` (or, failing that, `model_type`).
fn architecture(architectures: &[String], model_type: Option<String>) -> Result<Architecture> {
    let named = architectures
        .first()
        .cloned()
        .or(model_type)
        .unwrap_or_default();
    Architecture::from_hf_name(&named)
        .or(match named.as_str() {
            "llama" => Some(Architecture::Llama),
            "mistral" => Some(Architecture::Mistral),
            "qwen2" => Some(Architecture::Qwen2),
            "afmoe" => Some(Architecture::Afmoe),
            _ => None,
        })
        .ok_or(Error::Model(ModelError::UnsupportedArchitecture {
            architecture: named,
        }))
}

/// The key/value head count and head width, checked: the query heads group evenly over the
/// key/value heads, and RoPE needs an even head width.
fn heads(
    hidden_size: usize,
    num_heads: usize,
    num_kv_heads: Option<usize>,
    head_dim: Option<usize>,
) -> std::result::Result<(usize, usize), String> {
    let num_kv_heads = num_kv_heads.unwrap_or(num_heads);
    if num_heads == 0 || num_kv_heads == 0 || !num_heads.is_multiple_of(num_kv_heads) {
        return Err(format!(
            "num_attention_heads {num_heads} must be a positive multiple of num_key_value_heads {num_kv_heads}"
        ));
    }
    let head_dim = head_dim.unwrap_or(hidden_size / num_heads);
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(format!(
            "head_dim {head_dim} must be even and positive for RoPE"
        ));
    }
    Ok((num_kv_heads, head_dim))
}

/// Which blocks attend through a sliding window, following transformers: an explicit
/// `layer_types` list wins; else Mistral windows every block, and Qwen2 (with
/// `use_sliding_window`) the blocks from `max_window_layers` on.
fn attention_windows(
    architecture: Architecture,
    num_layers: usize,
    window: Option<usize>,
    use_sliding_window: bool,
    max_window_layers: usize,
    layer_types: Option<&[String]>,
) -> std::result::Result<Vec<Option<usize>>, String> {
    let Some(window) = window else {
        return Ok(vec![None; num_layers]);
    };
    if window == 0 {
        return Err(
            "sliding_window is 0, which lets a token see no key: give the window's width, or null for full attention"
                .into(),
        );
    }
    if let Some(types) = layer_types {
        if types.len() != num_layers {
            return Err(format!(
                "layer_types lists {} blocks, but the model has {num_layers}",
                types.len()
            ));
        }
        return types
            .iter()
            .enumerate()
            .map(|(i, t)| match t.as_str() {
                "full_attention" => Ok(None),
                "sliding_attention" => Ok(Some(window)),
                other => Err(format!(
                    "layer_types[{i}] is {other:?}: the layer types harvest runs are \"full_attention\" and \"sliding_attention\""
                )),
            })
            .collect();
    }
    Ok((0..num_layers)
        .map(|layer| match architecture {
            Architecture::Mistral => Some(window),
            Architecture::Qwen2 if use_sliding_window && layer >= max_window_layers => Some(window),
            Architecture::Llama | Architecture::Qwen2 | Architecture::Afmoe => None,
        })
        .collect())
}

impl RawRopeScaling {
    fn validate(self) -> std::result::Result<RopeScaling, String> {
        let kind = self
            .rope_type
            .or(self.legacy_type)
            .unwrap_or_else(|| "default".into());
        let need = |value: Option<f64>, field: &str| {
            value.ok_or_else(|| format!("rope_scaling of type {kind:?} needs {field}"))
        };
        match kind.as_str() {
            "default" => Ok(RopeScaling::None),
            "linear" => Ok(RopeScaling::Linear {
                factor: need(self.factor, "factor")?,
            }),
            "llama3" => Ok(RopeScaling::Llama3 {
                factor: need(self.factor, "factor")?,
                low_freq_factor: need(self.low_freq_factor, "low_freq_factor")?,
                high_freq_factor: need(self.high_freq_factor, "high_freq_factor")?,
                original_max_position_embeddings: need(
                    self.original_max_position_embeddings,
                    "original_max_position_embeddings",
                )?,
            }),
            "frequency_factors" => {
                let factors = self
                    .factors
                    .ok_or("rope_scaling of type \"frequency_factors\" needs factors")?;
                match factors.iter().position(|f| !(f.is_finite() && *f > 0.0)) {
                    Some(i) => Err(format!(
                        "rope_scaling factors[{i}] is {}: every factor must be finite and positive",
                        factors[i]
                    )),
                    None => Ok(RopeScaling::FrequencyFactors { factors }),
                }
            }
            other => Err(format!(
                "rope_scaling type {other:?} is not supported; use none, \"linear\", \"llama3\" or \"frequency_factors\""
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ModelConfig> {
        ModelConfig::parse(text, Path::new("config.json"))
    }

    #[test]
    fn frequency_factors_divide_each_frequency_and_must_match_head_dim() {
        // head_dim 16: eight frequencies.
        let factors = "[1, 1, 1, 2, 4, 8, 8, 0.5]";
        let config = parse(&llama(&format!(
            r#", "rope_scaling": {{"rope_type": "frequency_factors", "factors": {factors}}}"#
        )))
        .unwrap();
        let plain = parse(&llama("")).unwrap().inverse_frequencies();
        let scaled = config.inverse_frequencies();
        let divisors = [1.0, 1.0, 1.0, 2.0, 4.0, 8.0, 8.0, 0.5];
        for ((s, p), k) in scaled.iter().zip(&plain).zip(divisors) {
            assert_eq!(*s, p / k);
        }
        let short = r#", "rope_scaling": {"rope_type": "frequency_factors", "factors": [1, 2]}"#;
        let error = parse(&llama(short)).unwrap_err().to_string();
        assert!(
            error.contains("2 frequency factors") && error.contains("8 frequencies"),
            "{error}"
        );
        let zero = r#", "rope_scaling": {"rope_type": "frequency_factors", "factors": [1, 0, 1, 1, 1, 1, 1, 1]}"#;
        let error = parse(&llama(zero)).unwrap_err().to_string();
        assert!(error.contains("factors[1] is 0"), "{error}");
    }

    fn llama(extra: &str) -> String {
        format!(
            r#"{{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "max_position_embeddings": 256, "vocab_size": 100 {extra}}}"#
        )
    }

    #[test]
    fn a_plain_llama_config_validates_with_defaults() {
        let config = parse(&llama("")).unwrap();
        assert_eq!(config.architecture, Architecture::Llama);
        assert_eq!(config.head_dim, 16);
        assert_eq!(config.rope_theta, 10_000.0);
        assert_eq!(config.rope_scaling, RopeScaling::None);
        assert_eq!(config.qkv_width(), (4 + 2 * 2) * 16);
        assert!(!config.qkv_bias);
    }

    #[test]
    fn qwen2_always_has_qkv_bias_but_no_output_bias() {
        let text = llama("").replace("LlamaForCausalLM", "Qwen2ForCausalLM");
        let config = parse(&text).unwrap();
        assert!(config.qkv_bias && !config.o_bias);
    }

    #[test]
    fn an_unknown_architecture_is_named_in_the_error() {
        let text = llama("").replace("LlamaForCausalLM", "GPT2LMHeadModel");
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.contains("GPT2LMHeadModel"), "{err}");
    }

    #[test]
    fn llama3_scaling_leaves_high_frequencies_and_divides_low_ones() {
        let scaled = llama(
            r#", "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#,
        );
        let plain = parse(&llama(r#", "rope_theta": 500000.0"#)).unwrap();
        let scaled = parse(&scaled).unwrap();
        let (a, b) = (plain.inverse_frequencies(), scaled.inverse_frequencies());
        assert_eq!(a[0], b[0], "the highest frequency is untouched");
        let last = a.len() - 1;
        assert!(
            (a[last] / 8.0 - b[last]).abs() < 1e-15,
            "the lowest is divided by the factor"
        );
    }

    #[test]
    fn transformers_5_rope_parameters_carry_theta_and_scaling() {
        let text = llama(
            r#", "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}"#,
        );
        let config = parse(&text).unwrap();
        assert_eq!(config.rope_theta, 500_000.0);
        assert!(matches!(
            config.rope_scaling,
            RopeScaling::Llama3 { factor: 8.0, .. }
        ));
    }

    #[test]
    fn mistral_windows_every_block_and_llama_none() {
        let text =
            llama(r#", "sliding_window": 8"#).replace("LlamaForCausalLM", "MistralForCausalLM");
        assert_eq!(parse(&text).unwrap().attention_windows, [Some(8), Some(8)]);
        assert_eq!(
            parse(&llama(r#", "sliding_window": 8"#))
                .unwrap()
                .attention_windows,
            [None, None]
        );
        let empty = text.replace(r#""sliding_window": 8"#, r#""sliding_window": 0"#);
        let error = parse(&empty).unwrap_err().to_string();
        assert!(
            error.contains("sliding_window is 0") && error.contains("null"),
            "{error}"
        );
    }

    #[test]
    fn qwen2_windows_only_blocks_past_max_window_layers() {
        let text =
            llama(r#", "sliding_window": 8, "use_sliding_window": true, "max_window_layers": 1"#)
                .replace("LlamaForCausalLM", "Qwen2ForCausalLM");
        assert_eq!(parse(&text).unwrap().attention_windows, [None, Some(8)]);
    }

    #[test]
    fn an_unknown_rope_scaling_type_is_rejected_by_name() {
        let text = llama(r#", "rope_scaling": {"type": "yarn", "factor": 4.0}"#);
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.contains("yarn"), "{err}");
    }

    #[test]
    fn a_missing_field_is_a_parse_error_naming_it() {
        let text = llama("").replace(r#""vocab_size": 100"#, r#""vocab": 100"#);
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.contains("vocab_size"), "{err}");
    }

    fn afmoe(extra: &str) -> String {
        llama(&format!(
            r#", "moe_intermediate_size": 32, "num_dense_layers": 1, "num_experts": 8,
            "num_experts_per_tok": 2, "num_shared_experts": 1, "route_scale": 2.5,
            "mup_enabled": true, "global_attn_every_n_layers": 2, "sliding_window": 6 {extra}"#
        ))
        .replace("LlamaForCausalLM", "AfmoeForCausalLM")
    }

    #[test]
    fn afmoe_windows_and_rotates_only_its_sliding_blocks_and_routes_after_the_dense_ones() {
        let config = parse(&afmoe("")).unwrap();
        assert_eq!(config.architecture, Architecture::Afmoe);
        // Every second block is full attention: no window and no RoPE there.
        assert_eq!(config.attention_windows, [Some(6), None]);
        assert_eq!(config.rotary, [true, false]);
        let moe = config.afmoe.as_ref().unwrap();
        assert_eq!((moe.num_experts, moe.experts_per_token), (8, 2));
        assert_eq!(moe.embedding_scale, 8.0, "muP scales by sqrt(64)");
        assert!(!config.is_sparse(0) && config.is_sparse(1));
        assert_eq!((config.mlp_width(0), config.mlp_width(1)), (128, 32));
    }

    #[test]
    fn afmoe_keys_that_change_the_maths_are_refused_by_name() {
        let cases = [
            (r#"{"score_func": "softmax"}"#, "score_func \"softmax\""),
            (r#"{"route_norm": false}"#, "route_norm false"),
            (
                r#"{"n_group": 4, "topk_group": 2}"#,
                "n_group 4 with topk_group 2",
            ),
            (
                r#"{"layer_types": ["sliding_attention", "chunked_attention"]}"#,
                "layer_types[1] is \"chunked_attention\"",
            ),
            (r#"{"num_experts_per_tok": 9}"#, "num_experts_per_tok 9"),
            (r#"{"num_dense_layers": 3}"#, "num_dense_layers 3"),
        ];
        for (changes, named) in cases {
            let mut config: serde_json::Value = serde_json::from_str(&afmoe("")).unwrap();
            let changes: serde_json::Map<String, serde_json::Value> =
                serde_json::from_str(changes).unwrap();
            config.as_object_mut().unwrap().extend(changes);
            let error = parse(&config.to_string()).unwrap_err().to_string();
            assert!(error.contains(named), "{named}: {error}");
        }
    }
}
