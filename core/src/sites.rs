//! Hook sites: where in a decoder block a job reads the residual stream or a branch of it.
//!
//! ```text
//! resid_pre ─► + attn_out ─► resid_mid ─► + mlp_out ─► resid_post (layer k, the seed's prompt_i)
//! ```
//! `attn_out` is the attention output after `o_proj` (and its bias) as it is added; `mlp_out` is
//! the MLP's output (routed plus shared experts for a MoE) as it is added. Where a block norms a
//! branch output before adding it (AFMoE's post-attention and post-MLP norms), the site is what
//! the residual stream receives, after that norm. A job keeps any set of them, and one forward
//! pass serves them all.

use std::fmt;

use serde::{Deserialize, Serialize};

/// One hook site of a decoder block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Site {
    /// The block's input.
    ResidPre,
    /// The attention output after `o_proj`, before it is added.
    AttnOut,
    /// `resid_pre + attn_out`.
    ResidMid,
    /// The MLP (or MoE) output, before it is added.
    MlpOut,
    /// The block's output: the seed's layer `k`.
    ResidPost,
}

impl Site {
    /// Every site, in the order a block computes them (and the order outputs list them).
    pub const ALL: [Self; 5] = [
        Self::ResidPre,
        Self::AttnOut,
        Self::ResidMid,
        Self::MlpOut,
        Self::ResidPost,
    ];

    /// The name requests and manifests use.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ResidPre => "resid_pre",
            Self::AttnOut => "attn_out",
            Self::ResidMid => "resid_mid",
            Self::MlpOut => "mlp_out",
            Self::ResidPost => "resid_post",
        }
    }

    /// What the site's per-prompt tensors are called before `_i`: `prompt` for `resid_post` (the
    /// seed's name), the site's own name otherwise.
    pub fn tensor_prefix(self) -> &'static str {
        match self {
            Self::ResidPost => "prompt",
            other => other.as_str(),
        }
    }

    /// Parses a site's name.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_str() == name)
    }
}

impl fmt::Display for Site {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a list of sites is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SiteError {
    /// No site at all.
    #[error("sites is empty: give one or more of {}", names())]
    Empty,
    /// A name that is not a site.
    #[error("sites[{index}] {name:?} is not a hook site: use one of {}", names())]
    Unknown {
        /// Its place in the list.
        index: usize,
        /// What was given.
        name: String,
    },
    /// The same site twice.
    #[error("sites lists {site} twice: give each site once")]
    Repeated {
        /// The site.
        site: Site,
    },
}

fn names() -> String {
    Site::ALL.map(Site::as_str).join(", ")
}

/// A non-empty set of sites, held in block order.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Sites(Vec<Site>);

impl Default for Sites {
    /// `resid_post` alone: what a request without `sites` gets.
    fn default() -> Self {
        Self(vec![Site::ResidPost])
    }
}

impl Sites {
    /// Validates a list of sites.
    pub fn new(sites: &[Site]) -> Result<Self, SiteError> {
        if sites.is_empty() {
            return Err(SiteError::Empty);
        }
        let mut sorted = sites.to_vec();
        sorted.sort_unstable();
        if let Some(pair) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(SiteError::Repeated { site: pair[0] });
        }
        Ok(Self(sorted))
    }

    /// Parses and validates site names, as a request or a flag gives them.
    pub fn parse<S: AsRef<str>>(names: &[S]) -> Result<Self, SiteError> {
        let sites = names
            .iter()
            .enumerate()
            .map(|(index, name)| {
                Site::parse(name.as_ref()).ok_or_else(|| SiteError::Unknown {
                    index,
                    name: name.as_ref().to_owned(),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Self::new(&sites)
    }

    /// The sites, in block order.
    pub fn as_slice(&self) -> &[Site] {
        &self.0
    }

    /// How many.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Never true: a set of sites is not empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Where `site` sits in [`Sites::as_slice`], if kept.
    pub fn position(&self, site: Site) -> Option<usize> {
        self.0.iter().position(|&s| s == site)
    }

    /// Whether `site` is kept.
    pub fn contains(&self, site: Site) -> bool {
        self.0.contains(&site)
    }

    /// Whether this is `resid_post` alone, what the seed's contract returns.
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }

    /// The names, in block order.
    pub fn names(&self) -> Vec<&'static str> {
        self.0.iter().map(|s| s.as_str()).collect()
    }
}

impl std::str::FromStr for Sites {
    type Err = SiteError;

    /// A comma-separated list, as `--sites` takes it.
    fn from_str(text: &str) -> Result<Self, SiteError> {
        let names: Vec<&str> = text
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .collect();
        Self::parse(&names)
    }
}

impl fmt::Display for Sites {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.names().join(","))
    }
}

impl Serialize for Sites {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Sites {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let names = Vec::<String>::deserialize(deserializer)?;
        Self::parse(&names).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sites_are_held_in_block_order_whatever_order_they_came_in() {
        let sites = Sites::parse(&["resid_post", "attn_out", "resid_pre"]).unwrap();
        assert_eq!(
            sites.as_slice(),
            [Site::ResidPre, Site::AttnOut, Site::ResidPost]
        );
        assert_eq!(sites.to_string(), "resid_pre,attn_out,resid_post");
        assert_eq!(sites.position(Site::ResidPost), Some(2));
        assert!(!sites.is_default());
        assert!(Sites::default().is_default());
    }

    #[test]
    fn an_unknown_site_is_named_with_its_index_and_the_choices() {
        let error = Sites::parse(&["resid_post", "mlp_output"]).unwrap_err();
        let text = error.to_string();
        assert!(text.contains("sites[1] \"mlp_output\""), "{text}");
        assert!(text.contains("mlp_out, resid_post"), "{text}");
    }

    #[test]
    fn an_empty_or_repeated_list_is_refused() {
        assert_eq!(Sites::parse::<&str>(&[]), Err(SiteError::Empty));
        assert_eq!(
            "attn_out, attn_out".parse::<Sites>(),
            Err(SiteError::Repeated {
                site: Site::AttnOut
            })
        );
    }

    #[test]
    fn resid_post_keeps_the_seeds_tensor_name_and_the_others_their_own() {
        let prefixes = Site::ALL.map(Site::tensor_prefix);
        assert_eq!(
            prefixes,
            ["resid_pre", "attn_out", "resid_mid", "mlp_out", "prompt"]
        );
    }

    #[test]
    fn sites_travel_as_a_json_list_and_refuse_bad_names_on_the_way_in() {
        let sites: Sites = serde_json::from_str(r#"["mlp_out","resid_mid"]"#).unwrap();
        assert_eq!(
            serde_json::to_string(&sites).unwrap(),
            r#"["resid_mid","mlp_out"]"#
        );
        let error = serde_json::from_str::<Sites>(r#"["resid"]"#).unwrap_err();
        assert!(error.to_string().contains("\"resid\""), "{error}");
    }
}
