//! The models catalogue: for each configured model, what validation and counting need (depth,
//! width, lane, tokenizer), read once at start-up from its checkpoint directory.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use harvest_core::chat::{ChatTemplate, from_tokenizer_config};
use harvest_core::{ModelShape, ServedModel};
use serde::{Deserialize, Serialize};

use crate::config::ModelConfig;
use crate::error::StartupError;

/// A loaded model entry.
#[derive(Debug, Clone)]
pub struct CatalogueModel {
    /// Its name, shape and lane: what validation needs.
    pub model: ServedModel,
    /// Its checkpoint directory (handed to the harvester).
    pub path: PathBuf,
    /// Its tokenizer, for counting.
    pub tokenizer: Arc<tokenizers::Tokenizer>,
    /// Its chat template, for conversations; or why it takes none.
    pub chat: Result<Arc<ChatTemplate>, String>,
    /// Its BOS id in the tokenizer, and whether the tokenizer puts BOS before plain text: what
    /// leaves a conversation one BOS (`harvest_core::chat::bos_once`).
    pub tokenizer_bos: Option<(u32, bool)>,
    /// Its context window.
    pub max_tokens: usize,
    /// Its Hugging Face architecture class (what a manifest names).
    pub architecture: String,
    /// Its BOS id from `config.json`, if it has one.
    pub bos_token_id: Option<u32>,
    /// Devices one job of it occupies.
    pub devices: u32,
    /// Most workers one job of it may be split over.
    pub max_parallelism: usize,
}

/// The catalogue, by name.
#[derive(Debug, Clone, Default)]
pub struct Catalogue {
    models: BTreeMap<String, CatalogueModel>,
    /// Optional entries whose files are missing: the reason, by name.
    unavailable: BTreeMap<String, Unavailable>,
}

/// An optional model whose files are not there.
#[derive(Debug, Clone)]
struct Unavailable {
    lane: harvest_core::quota::Lane,
    devices: u32,
    reason: String,
}

#[derive(Deserialize)]
struct Shape {
    num_hidden_layers: usize,
    hidden_size: usize,
    max_position_embeddings: usize,
    #[serde(default)]
    architectures: Vec<String>,
    #[serde(default)]
    bos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    num_dense_layers: Option<usize>,
    #[serde(default)]
    num_experts: Option<usize>,
    #[serde(default)]
    num_experts_per_tok: Option<usize>,
}

impl Shape {
    /// The routed experts of an AFMoE checkpoint, with the defaults its config class (and the
    /// harvester) gives; none for a dense one.
    fn moe(&self) -> Option<harvest_core::model::MoeShape> {
        let afmoe = self.architectures.iter().any(|a| a == "AfmoeForCausalLM");
        let first_sparse_layer = self.num_dense_layers.unwrap_or(1);
        (afmoe && first_sparse_layer < self.num_hidden_layers).then(|| {
            harvest_core::model::MoeShape {
                first_sparse_layer,
                experts: self.num_experts.unwrap_or(64),
                experts_per_token: self.num_experts_per_tok.unwrap_or(6),
            }
        })
    }
}

/// `GET /v1/models`.
#[derive(Debug, utoipa::ToSchema)]
pub struct ModelList {
    /// The catalogue.
    pub models: Vec<ModelView>,
}

/// A model as `GET /v1/models` lists it. An unavailable one (an optional entry whose files are
/// missing) has `available: false` and `unavailable_reason`, and no shape.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ModelView {
    /// The name to send.
    pub name: String,
    /// Decoder blocks; valid layers are `0..layers`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layers: Option<usize>,
    /// Residual-stream width (the `hidden` of `project_onto`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hidden_size: Option<usize>,
    /// The layers kept when `layers` is omitted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default_layers: Option<Vec<usize>>,
    /// Its concurrency lane: `small` or `large`.
    #[schema(value_type = String, example = "small")]
    pub lane: harvest_core::quota::Lane,
    /// Its context window; longer prompts are truncated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<usize>,
    /// Devices one job of it occupies (our extension).
    pub devices: u32,
    /// Whether jobs can be submitted for it (our extension).
    pub available: bool,
    /// Why not, when it is unavailable (our extension).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unavailable_reason: Option<String>,
}

impl Catalogue {
    /// Loads every configured model's config.json and tokenizer.json.
    pub fn load(models: &[ModelConfig]) -> Result<Self, StartupError> {
        let mut out = BTreeMap::new();
        let mut unavailable = BTreeMap::new();
        for model in models {
            let missing = ["config.json", "tokenizer.json"]
                .iter()
                .map(|f| model.path.join(f))
                .find(|p| !p.is_file());
            if let Some(missing) = missing {
                let reason = format!(
                    "its checkpoint is missing: {} does not exist (docs/models.md says how to get it)",
                    missing.display()
                );
                if model.optional {
                    tracing::warn!(model = %model.name, %reason, "model unavailable");
                    let (lane, devices) = (model.lane, model.devices);
                    let entry = Unavailable {
                        lane,
                        devices,
                        reason,
                    };
                    unavailable.insert(model.name.clone(), entry);
                    continue;
                }
                return Err(StartupError::config(format!(
                    "model {}: {reason}; or mark the entry \"optional\": true to serve without it",
                    model.name
                )));
            }
            out.insert(model.name.clone(), Self::open(model)?);
        }
        Ok(Self {
            models: out,
            unavailable,
        })
    }

    /// Reads one present model's config.json and tokenizer.json.
    fn open(model: &ModelConfig) -> Result<CatalogueModel, StartupError> {
        let config_path = model.path.join("config.json");
        let text = std::fs::read_to_string(&config_path).map_err(|e| {
            StartupError::config(format!(
                "model {}: reading {}: {e}",
                model.name,
                config_path.display()
            ))
        })?;
        let shape: Shape = serde_json::from_str(&text).map_err(|e| {
            StartupError::config(format!(
                "model {}: {}: {e}",
                model.name,
                config_path.display()
            ))
        })?;
        let tokenizer_path = model.path.join("tokenizer.json");
        let tokenizer = tokenizers::Tokenizer::from_file(&tokenizer_path).map_err(|e| {
            StartupError::config(format!(
                "model {}: {}: {e}",
                model.name,
                tokenizer_path.display()
            ))
        })?;
        let config_path = model.path.join("tokenizer_config.json");
        let tokenizer_config = std::fs::read_to_string(&config_path)
            .ok()
            .and_then(|text| serde_json::from_str(&text).ok())
            .unwrap_or(serde_json::Value::Null);
        let (template, special) = from_tokenizer_config(&tokenizer_config);
        let tokenizer_bos = special
            .bos
            .as_deref()
            .and_then(|token| tokenizer.token_to_id(token))
            .map(|bos| {
                let adds = tokenizer
                    .encode_fast("a", true)
                    .is_ok_and(|e| e.get_ids().first() == Some(&bos));
                (bos, adds)
            });
        let chat = match template {
            None => Err(format!(
                "model {} has no chat template ({} names no chat_template), so it takes no conversations: send prompts, rendered as the model expects them",
                model.name,
                config_path.display()
            )),
            Some(source) => ChatTemplate::new(&source, special)
                .map(Arc::new)
                .map_err(|e| format!("model {}: {e}, so it takes no conversations", model.name)),
        };
        let served = ServedModel {
            name: model.name.clone(),
            shape: ModelShape {
                num_layers: shape.num_hidden_layers,
                hidden_size: shape.hidden_size,
                moe: shape.moe(),
            },
            lane: model.lane,
        };
        Ok(CatalogueModel {
            model: served,
            path: model.path.clone(),
            tokenizer: Arc::new(tokenizer),
            chat,
            tokenizer_bos,
            max_tokens: shape.max_position_embeddings,
            architecture: shape.architectures.first().cloned().unwrap_or_default(),
            devices: model.devices,
            max_parallelism: model.max_parallelism,
            bos_token_id: shape
                .bos_token_id
                .as_ref()
                .and_then(serde_json::Value::as_u64)
                .and_then(|id| u32::try_from(id).ok()),
        })
    }

    /// Why a listed model cannot take jobs, if it is an unavailable optional entry.
    pub fn unavailable(&self, name: &str) -> Option<&str> {
        self.unavailable.get(name).map(|u| u.reason.as_str())
    }

    /// A model by name.
    pub fn get(&self, name: &str) -> Option<&CatalogueModel> {
        self.models.get(name)
    }

    /// The names of the models that take jobs, for error messages.
    pub fn names(&self) -> Vec<&str> {
        self.models.keys().map(String::as_str).collect()
    }

    /// Every model, as listed by the API.
    pub fn views(&self) -> Vec<ModelView> {
        let available = self.models.values().map(|m| ModelView {
            name: m.model.name.clone(),
            layers: Some(m.model.shape.num_layers),
            hidden_size: Some(m.model.shape.hidden_size),
            default_layers: Some(m.model.shape.default_layers()),
            lane: m.model.lane,
            max_tokens: Some(m.max_tokens),
            devices: m.devices,
            available: true,
            unavailable_reason: None,
        });
        let missing = self.unavailable.iter().map(|(name, u)| ModelView {
            name: name.clone(),
            layers: None,
            hidden_size: None,
            default_layers: None,
            lane: u.lane,
            max_tokens: None,
            devices: u.devices,
            available: false,
            unavailable_reason: Some(u.reason.clone()),
        });
        let mut views: Vec<ModelView> = available.chain(missing).collect();
        views.sort_by(|a, b| a.name.cmp(&b.name));
        views
    }
}
