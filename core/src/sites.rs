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
//!
//! A mixture-of-experts model adds one more: `router`, each token's top-k expert ids and gate
//! weights at each kept sparse block (`router_logits` adds the router's full logits). It is
//! not a row of the residual stream, so [`Sites`] holds it apart from the activation sites and
//! it has no statistics; it is kept beside at least one activation site.

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
    /// A mixture-of-experts block's expert choices: top-k ids and gate weights per token.
    Router,
    /// `router`, plus the router's full logits per token.
    RouterLogits,
}

impl Site {
    /// Every activation site (a row of the residual stream or a branch of it), in the order a
    /// block computes them (and the order outputs list them).
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
            Self::Router => "router",
            Self::RouterLogits => "router_logits",
        }
    }

    /// Whether the site is a row of the residual stream (or a branch of it), not the router.
    pub fn is_activation(self) -> bool {
        !matches!(self, Self::Router | Self::RouterLogits)
    }

    /// What the site's per-prompt tensors are called before `_i`: `prompt` for `resid_post` (the
    /// seed's name), the site's own name otherwise (the router's are listed by [`Router`]).
    pub fn tensor_prefix(self) -> &'static str {
        match self {
            Self::ResidPost => "prompt",
            other => other.as_str(),
        }
    }

    /// Parses a site's name.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .chain([Self::Router, Self::RouterLogits])
            .find(|s| s.as_str() == name)
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
    #[error(
        "sites[{index}] {name:?} is not a hook site: use one of {}, router, router_logits",
        names()
    )]
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
    /// `router` with no activation site beside it.
    #[error(
        "sites lists only {site}: the router's choices are kept beside the activations, so add an activation site ({}); to keep little else, add resid_post with one projection direction",
        names()
    )]
    RouterAlone {
        /// `router` or `router_logits`.
        site: Site,
    },
}

fn names() -> String {
    Site::ALL.map(Site::as_str).join(", ")
}

/// What a job keeps of a mixture-of-experts model's routing: the `router` site.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Router {
    /// Each token's top-k expert ids (highest score first) and their gate weights.
    Choices,
    /// The choices, and the router's logits over every expert.
    WithLogits,
}

impl Router {
    /// The site name that asks for it.
    pub fn site(self) -> Site {
        match self {
            Self::Choices => Site::Router,
            Self::WithLogits => Site::RouterLogits,
        }
    }

    /// Whether the full logits are kept.
    pub fn logits(self) -> bool {
        self == Self::WithLogits
    }
}

/// A set of sites: one or more activation sites, held in block order, and perhaps the router.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Sites {
    activations: Vec<Site>,
    router: Option<Router>,
}

impl Default for Sites {
    /// `resid_post` alone: what a request without `sites` gets.
    fn default() -> Self {
        Self {
            activations: vec![Site::ResidPost],
            router: None,
        }
    }
}

impl Sites {
    /// Validates a list of sites. `router_logits` includes `router`, so the two may be given
    /// together.
    pub fn new(sites: &[Site]) -> Result<Self, SiteError> {
        if sites.is_empty() {
            return Err(SiteError::Empty);
        }
        let mut sorted = sites.to_vec();
        sorted.sort_unstable();
        if let Some(pair) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(SiteError::Repeated { site: pair[0] });
        }
        let router = if sorted.contains(&Site::RouterLogits) {
            Some(Router::WithLogits)
        } else {
            sorted.contains(&Site::Router).then_some(Router::Choices)
        };
        sorted.retain(|s| s.is_activation());
        if let (true, Some(router)) = (sorted.is_empty(), router) {
            return Err(SiteError::RouterAlone {
                site: router.site(),
            });
        }
        Ok(Self {
            activations: sorted,
            router,
        })
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

    /// The activation sites, in block order.
    pub fn as_slice(&self) -> &[Site] {
        &self.activations
    }

    /// How many activation sites.
    pub fn len(&self) -> usize {
        self.activations.len()
    }

    /// Never true: a set of sites keeps an activation site.
    pub fn is_empty(&self) -> bool {
        self.activations.is_empty()
    }

    /// Where `site` sits in [`Sites::as_slice`], if kept.
    pub fn position(&self, site: Site) -> Option<usize> {
        self.activations.iter().position(|&s| s == site)
    }

    /// Whether activation site `site` is kept.
    pub fn contains(&self, site: Site) -> bool {
        self.activations.contains(&site)
    }

    /// What is kept of the router, if anything.
    pub fn router(&self) -> Option<Router> {
        self.router
    }

    /// Whether this is `resid_post` alone, what the seed's contract returns.
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }

    /// Every site, the activations in block order and then the router's: what a request
    /// lists.
    pub fn all(&self) -> Vec<Site> {
        let router = self.router.map(Router::site);
        self.activations.iter().copied().chain(router).collect()
    }

    /// The names of [`Sites::all`].
    pub fn names(&self) -> Vec<&'static str> {
        self.all().into_iter().map(Site::as_str).collect()
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
        self.all().serialize(serializer)
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
    fn the_router_is_kept_apart_from_the_activation_sites_and_never_alone() {
        let sites = Sites::parse(&["router", "resid_post", "attn_out"]).unwrap();
        assert_eq!(sites.as_slice(), [Site::AttnOut, Site::ResidPost]);
        assert_eq!(sites.router(), Some(Router::Choices));
        assert_eq!(sites.to_string(), "attn_out,resid_post,router");
        assert_eq!(sites.position(Site::Router), None);
        let logits = Sites::parse(&["resid_post", "router_logits", "router"]).unwrap();
        assert_eq!(logits.router(), Some(Router::WithLogits));
        assert_eq!(logits.names(), ["resid_post", "router_logits"]);
        let error = Sites::parse(&["router"]).unwrap_err();
        assert_eq!(error, SiteError::RouterAlone { site: Site::Router });
        assert!(
            error.to_string().contains("add an activation site"),
            "{error}"
        );
        assert!(Sites::default().router().is_none());
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
