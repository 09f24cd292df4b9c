//! Which decoder-block outputs a harvest keeps.
//!
//! The layer convention never drifts: layer `k` (0-based) is the residual stream after decoder
//! block `k` has added its attention and MLP outputs, before the model's final norm.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The layers a user asked for, before the model is known.
///
/// On the wire it is either omitted (the quartile default), the exact lowercase string
/// `"all"`, or a list of block indices.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum LayerSelection {
    /// `[n/4, n/2, 3n/4]` with integer division: `[8, 16, 24]` for 32 blocks.
    #[default]
    Quartiles,
    /// Every block, `0..n`.
    All,
    /// An explicit list; order and duplicates do not matter.
    Explicit(Vec<i64>),
}

/// Why a layer selection cannot be applied to a model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayerError {
    /// An explicit index outside `0..num_layers`.
    #[error("layer {layer} is out of range: the model has {num_layers} layers, so use 0..={max}", max = num_layers.saturating_sub(1))]
    OutOfRange {
        /// The index the user gave.
        layer: i64,
        /// How many decoder blocks the model has.
        num_layers: usize,
    },
    /// An explicit, empty list.
    #[error(
        "the layer list is empty: give at least one layer index, \"all\", or omit layers for the quartile default"
    )]
    Empty,
    /// A string other than `"all"`.
    #[error(
        "layers must be a list of integers or the exact lowercase string \"all\", got {value:?}"
    )]
    BadString {
        /// The string the user gave.
        value: String,
    },
    /// A model with no blocks cannot have layers.
    #[error("the model has no decoder blocks")]
    NoBlocks,
    /// The `router` site on a model without routed experts.
    #[error(
        "sites lists {site}, the expert choices of a mixture-of-experts model, and {model} is dense: leave {site} out of sites"
    )]
    RouterOnDense {
        /// `router` or `router_logits`.
        site: crate::Site,
        /// The model's name.
        model: String,
    },
    /// The `router` site with no kept sparse block.
    #[error(
        "sites lists {site}, the expert choices of {model}'s mixture-of-experts blocks, and none of the kept layers {kept} is one: its sparse blocks are layers {first}..={last}, so keep one of them"
    )]
    RouterWithoutSparseLayer {
        /// `router` or `router_logits`.
        site: crate::Site,
        /// The model's name.
        model: String,
        /// The kept layers.
        kept: String,
        /// The first sparse block.
        first: usize,
        /// The last block.
        last: usize,
    },
}

/// A validated, ascending, duplicate-free list of block indices, all below the model's depth.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(from = "Vec<usize>")]
pub struct Layers(Vec<usize>);

/// The layers a record lists, ascending and unique, whether or not a model has them (a job
/// row, or a `HarvestJob`'s explicit list); empty for a record that names none.
impl From<Vec<usize>> for Layers {
    fn from(mut list: Vec<usize>) -> Self {
        list.sort_unstable();
        list.dedup();
        Self(list)
    }
}

impl LayerSelection {
    /// Resolves the selection against a model with `num_layers` decoder blocks.
    pub fn resolve(&self, num_layers: usize) -> Result<Layers, LayerError> {
        if num_layers == 0 {
            return Err(LayerError::NoBlocks);
        }
        let mut indices = match self {
            Self::Quartiles => vec![num_layers / 4, num_layers / 2, 3 * num_layers / 4],
            Self::All => (0..num_layers).collect(),
            Self::Explicit(list) => {
                if list.is_empty() {
                    return Err(LayerError::Empty);
                }
                list.iter()
                    .map(|&layer| {
                        usize::try_from(layer)
                            .ok()
                            .filter(|&k| k < num_layers)
                            .ok_or(LayerError::OutOfRange { layer, num_layers })
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
        };
        indices.sort_unstable();
        indices.dedup();
        Ok(Layers(indices))
    }
}

impl Layers {
    /// The indices, ascending.
    pub fn as_slice(&self) -> &[usize] {
        &self.0
    }

    /// How many layers are kept.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Always false: a resolved selection keeps at least one layer.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The deepest kept block; the forward pass stops after it.
    pub fn deepest(&self) -> usize {
        // Resolution never yields an empty list, so 0 is unreachable in practice.
        self.0.last().copied().unwrap_or(0)
    }

    /// Where block `block` sits in the kept list, if it is kept.
    pub fn position(&self, block: usize) -> Option<usize> {
        self.0.binary_search(&block).ok()
    }

    /// The selection that resolves to exactly these layers on any model deep enough: the wire
    /// form a resolved plan travels in.
    pub fn to_selection(&self) -> LayerSelection {
        LayerSelection::Explicit(self.0.iter().map(|&l| l as i64).collect())
    }
}

impl fmt::Display for LayerSelection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Quartiles => f.write_str("quartiles"),
            Self::All => f.write_str("all"),
            Self::Explicit(list) => {
                let parts: Vec<String> = list.iter().map(i64::to_string).collect();
                f.write_str(&parts.join(","))
            }
        }
    }
}

impl std::str::FromStr for LayerSelection {
    type Err = LayerError;

    /// Parses the CLI form: `all`, `quartiles`, or a comma-separated list such as `8,16,24`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "all" => Ok(Self::All),
            "quartiles" | "default" => Ok(Self::Quartiles),
            list => list
                .split(',')
                .map(|part| part.trim().parse::<i64>())
                .collect::<Result<Vec<_>, _>>()
                .map(Self::Explicit)
                .map_err(|_| LayerError::BadString {
                    value: s.to_owned(),
                }),
        }
    }
}

impl Serialize for LayerSelection {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Quartiles => serializer.serialize_none(),
            Self::All => serializer.serialize_str("all"),
            Self::Explicit(list) => list.serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for LayerSelection {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Wire {
            Text(String),
            List(Vec<i64>),
        }
        match Option::<Wire>::deserialize(deserializer)? {
            None => Ok(Self::Quartiles),
            Some(Wire::Text(text)) if text == "all" => Ok(Self::All),
            Some(Wire::Text(value)) => {
                Err(serde::de::Error::custom(LayerError::BadString { value }))
            }
            Some(Wire::List(list)) => Ok(Self::Explicit(list)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn omitted_layers_give_the_quartiles_of_a_32_block_model() {
        let layers = LayerSelection::Quartiles.resolve(32).unwrap();
        assert_eq!(layers.as_slice(), &[8, 16, 24]);
        assert_eq!(layers.deepest(), 24);
    }

    #[test]
    fn quartiles_of_a_30_block_model_use_integer_division() {
        let layers = LayerSelection::Quartiles.resolve(30).unwrap();
        assert_eq!(layers.as_slice(), &[7, 15, 22]);
    }

    #[test]
    fn quartiles_of_a_tiny_model_collapse_duplicates() {
        assert_eq!(
            LayerSelection::Quartiles.resolve(2).unwrap().as_slice(),
            &[0, 1]
        );
        assert_eq!(
            LayerSelection::Quartiles.resolve(1).unwrap().as_slice(),
            &[0]
        );
    }

    #[test]
    fn all_keeps_every_block() {
        let layers = LayerSelection::All.resolve(4).unwrap();
        assert_eq!(layers.as_slice(), &[0, 1, 2, 3]);
    }

    #[test]
    fn explicit_lists_are_sorted_and_deduplicated() {
        let layers = LayerSelection::Explicit(vec![5, 1, 5, 0])
            .resolve(6)
            .unwrap();
        assert_eq!(layers.as_slice(), &[0, 1, 5]);
        assert_eq!(layers.position(5), Some(2));
        assert_eq!(layers.position(2), None);
    }

    #[test]
    fn an_index_past_the_last_block_is_rejected_by_name() {
        let err = LayerSelection::Explicit(vec![3, 30])
            .resolve(30)
            .unwrap_err();
        assert_eq!(
            err,
            LayerError::OutOfRange {
                layer: 30,
                num_layers: 30
            }
        );
        assert!(err.to_string().contains("layer 30"), "{err}");
        assert!(err.to_string().contains("0..=29"), "{err}");
    }

    #[test]
    fn a_negative_index_is_rejected() {
        let err = LayerSelection::Explicit(vec![-1]).resolve(30).unwrap_err();
        assert_eq!(
            err,
            LayerError::OutOfRange {
                layer: -1,
                num_layers: 30
            }
        );
    }

    #[test]
    fn an_empty_list_is_rejected() {
        assert_eq!(
            LayerSelection::Explicit(vec![]).resolve(30),
            Err(LayerError::Empty)
        );
    }

    #[test]
    fn wire_form_accepts_null_all_and_lists_only() {
        let parse = |s: &str| serde_json::from_str::<LayerSelection>(s);
        assert_eq!(parse("null").unwrap(), LayerSelection::Quartiles);
        assert_eq!(parse("\"all\"").unwrap(), LayerSelection::All);
        assert_eq!(
            parse("[24, 8]").unwrap(),
            LayerSelection::Explicit(vec![24, 8])
        );
        let err = parse("\"ALL\"").unwrap_err().to_string();
        assert!(err.contains("\"ALL\""), "{err}");
        assert!(parse("[1.5]").is_err());
    }

    #[test]
    fn cli_form_parses_lists_and_all() {
        assert_eq!(
            "all".parse::<LayerSelection>().unwrap(),
            LayerSelection::All
        );
        assert_eq!(
            "8, 16,24".parse::<LayerSelection>().unwrap(),
            LayerSelection::Explicit(vec![8, 16, 24])
        );
        assert!("8;16".parse::<LayerSelection>().is_err());
    }
}
