//! The models catalogue: for each configured model, what validation and counting need (depth,
//! width, lane, tokenizer), read once at start-up from its checkpoint directory.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

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
    /// Its context window.
    pub max_tokens: usize,
}

/// The catalogue, by name.
#[derive(Debug, Clone, Default)]
pub struct Catalogue {
    models: BTreeMap<String, CatalogueModel>,
}

#[derive(Deserialize)]
struct Shape {
    num_hidden_layers: usize,
    hidden_size: usize,
    max_position_embeddings: usize,
}

/// A model as `GET /v1/models` lists it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ModelView {
    /// The name to send.
    pub name: String,
    /// Decoder blocks; valid layers are `0..layers`.
    pub layers: usize,
    /// Residual-stream width (the `hidden` of `project_onto`).
    pub hidden_size: usize,
    /// The layers kept when `layers` is omitted.
    pub default_layers: Vec<usize>,
    /// Its concurrency lane: `small` or `large`.
    #[schema(value_type = String, example = "small")]
    pub lane: harvest_core::quota::Lane,
    /// Its context window; longer prompts are truncated.
    pub max_tokens: usize,
}

impl Catalogue {
    /// Loads every configured model's config.json and tokenizer.json.
    pub fn load(models: &[ModelConfig]) -> Result<Self, StartupError> {
        let mut out = BTreeMap::new();
        for model in models {
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
            let served = ServedModel {
                name: model.name.clone(),
                shape: ModelShape {
                    num_layers: shape.num_hidden_layers,
                    hidden_size: shape.hidden_size,
                },
                lane: model.lane,
            };
            out.insert(
                model.name.clone(),
                CatalogueModel {
                    model: served,
                    path: model.path.clone(),
                    tokenizer: Arc::new(tokenizer),
                    max_tokens: shape.max_position_embeddings,
                },
            );
        }
        Ok(Self { models: out })
    }

    /// A model by name.
    pub fn get(&self, name: &str) -> Option<&CatalogueModel> {
        self.models.get(name)
    }

    /// The names, for error messages.
    pub fn names(&self) -> Vec<&str> {
        self.models.keys().map(String::as_str).collect()
    }

    /// Every model, as listed by the API.
    pub fn views(&self) -> Vec<ModelView> {
        self.models
            .values()
            .map(|m| ModelView {
                name: m.model.name.clone(),
                layers: m.model.shape.num_layers,
                hidden_size: m.model.shape.hidden_size,
                default_layers: m.model.shape.default_layers(),
                lane: m.model.lane,
                max_tokens: m.max_tokens,
            })
            .collect()
    }
}
