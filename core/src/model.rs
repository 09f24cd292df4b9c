//! What every component knows of a model: its geometry ([`ModelShape`], read from the
//! checkpoint's `config.json` by the harvester and the API, or written in the operator's
//! catalogue) and, for a served model, its name and lane ([`ServedModel`]). The API catalogue,
//! the operator catalogue and the harvester all resolve layers through [`ModelShape::layers`],
//! so they cannot disagree on what a selection means.

use serde::{Deserialize, Serialize};

use crate::layers::{LayerError, LayerSelection, Layers};
use crate::quota::Lane;

/// A model's geometry: how deep it is and how wide its residual stream is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ModelShape {
    /// Decoder blocks; valid layers are `0..num_layers`.
    pub num_layers: usize,
    /// Residual-stream width: the `hidden` of projection directions.
    pub hidden_size: usize,
    /// Its routed experts, for a mixture-of-experts model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeShape>,
}

/// The routing geometry of a mixture-of-experts model (AFMoE: `num_dense_layers`,
/// `num_experts`, `num_experts_per_tok` of its `config.json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MoeShape {
    /// The first block with routed experts; every later block has them too.
    pub first_sparse_layer: usize,
    /// Routed experts per block.
    pub experts: usize,
    /// Experts each token goes to.
    pub experts_per_token: usize,
}

/// A model as a catalogue serves it under a name.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ServedModel {
    /// The name clients send.
    pub name: String,
    /// Its geometry.
    pub shape: ModelShape,
    /// Its concurrency lane.
    pub lane: Lane,
}

impl ModelShape {
    /// Resolves a selection against this model.
    pub fn layers(&self, selection: &LayerSelection) -> Result<Layers, LayerError> {
        selection.resolve(self.num_layers)
    }

    /// Of `layers`, those whose routing the `router` site keeps: the sparse blocks.
    pub fn router_layers(&self, layers: &Layers) -> Vec<usize> {
        let first = self.moe.map_or(usize::MAX, |m| m.first_sparse_layer);
        layers
            .as_slice()
            .iter()
            .copied()
            .filter(|&l| l >= first)
            .collect()
    }

    /// The layers kept when a request names none (none for a model without blocks).
    pub fn default_layers(&self) -> Vec<usize> {
        self.layers(&LayerSelection::Quartiles)
            .map(|layers| layers.as_slice().to_vec())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shape_resolves_the_quartiles_and_refuses_a_layer_past_its_depth() {
        let shape = ModelShape {
            num_layers: 30,
            hidden_size: 576,
            moe: None,
        };
        assert_eq!(shape.default_layers(), [7, 15, 22]);
        assert!(shape.layers(&LayerSelection::Explicit(vec![30])).is_err());
    }
}
