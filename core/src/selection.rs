//! Token selection on the server: which tokens of each prompt a job keeps.
//!
//! ```text
//! every token ─► positions [start, end) ─► of a kept role ─► not special ─► sampled (seeded hash)
//!             ─► norm ≤ m × median
//! ```
//! The first four are pure functions of (prompt, position, id, role), so they give the same answer in
//! every run, thread count and backend, and the API can count what they keep before a job runs.
//! The norm filter compares each token's `resid_post` norm at the deepest kept layer with the
//! median of every candidate norm so far, in prompt order, the current prompt included; the
//! median comes from a fixed log-spaced histogram ([`NormHistogram`]) that shards merge exactly,
//! so a resumed run decides as an uninterrupted one.

use serde::{Deserialize, Serialize};

/// Why a selection is refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SelectionError {
    /// `positions` is empty or inverted.
    #[error(
        "positions [{start}, {end}) is empty or inverted: give [start, end) with start < end, for example [1, 512]"
    )]
    EmptySlice {
        /// Its start.
        start: u64,
        /// Its end.
        end: u64,
    },
    /// `positions` is not two numbers.
    #[error("positions must be two numbers [start, end), got {count}")]
    SliceShape {
        /// How many were given.
        count: usize,
    },
    /// A sample rate outside (0, 1].
    #[error(
        "sample_rate {rate} is outside (0, 1]: give the fraction of tokens to keep, for example 0.1"
    )]
    Rate {
        /// What was given.
        rate: f64,
    },
    /// A norm multiple that is not a finite number above 1.
    #[error(
        "max_norm_multiple {multiple} must be a finite number above 1: tokens whose norm exceeds that many times the median are dropped, for example 10"
    )]
    NormMultiple {
        /// What was given.
        multiple: f64,
    },
    /// A seed without a sample rate.
    #[error(
        "seed is given without sample_rate or layout \"shuffled\", which are what it seeds: give one of them, or drop seed"
    )]
    SeedWithoutRate,
    /// A role name that is not one of [`crate::chat::ROLE_NAMES`].
    #[error(
        "roles names {name:?}, which is not a role: give any of \"template\", \"system\", \"user\", \"assistant\", \"tool\", for example [\"assistant\"]"
    )]
    UnknownRole {
        /// What was given.
        name: String,
    },
    /// `roles` without any role.
    #[error(
        "roles is empty, which would keep no token: give the roles to keep, for example [\"assistant\"], or leave roles out"
    )]
    NoRoles,
}

/// The roles a job keeps, as a set of [`crate::chat::ROLE_NAMES`] ids (bit `id` set when
/// kept); written as their names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoleSet(u8);

impl RoleSet {
    /// The set of the named roles; an unknown name or none at all is an error.
    pub fn from_names<S: AsRef<str>>(names: &[S]) -> Result<Self, SelectionError> {
        if names.is_empty() {
            return Err(SelectionError::NoRoles);
        }
        let mut bits = 0u8;
        for name in names {
            let name = name.as_ref();
            let (id, _) = crate::chat::ROLE_NAMES
                .iter()
                .find(|(_, known)| *known == name)
                .ok_or_else(|| SelectionError::UnknownRole {
                    name: name.to_owned(),
                })?;
            bits |= 1 << id;
        }
        Ok(Self(bits))
    }

    /// Whether the role with this id is kept.
    pub fn contains(self, role: u8) -> bool {
        role < 8 && self.0 & (1 << role) != 0
    }

    /// The kept roles' names, in id order.
    pub fn names(self) -> Vec<&'static str> {
        crate::chat::ROLE_NAMES
            .iter()
            .filter(|(id, _)| self.contains(*id))
            .map(|&(_, name)| name)
            .collect()
    }
}

impl Serialize for RoleSet {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.names().serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for RoleSet {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let names = Vec::<String>::deserialize(deserializer)?;
        Self::from_names(&names).map_err(serde::de::Error::custom)
    }
}

/// A slice of each prompt's positions, `[start, end)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PositionSlice {
    /// First position kept.
    pub start: u32,
    /// One past the last position kept.
    pub end: u32,
}

/// Seeded sampling of tokens.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// The fraction kept, in (0, 1].
    pub rate: f64,
    /// The seed of the keep decisions.
    pub seed: u64,
}

/// Which tokens a job keeps. The default keeps every token (the seed's contract).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenSelection {
    /// Drop every token the tokenizer marks special.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub exclude_special_tokens: bool,
    /// Keep only these positions of each prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub positions: Option<PositionSlice>,
    /// Keep only the tokens of these roles (a job of conversations only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub roles: Option<RoleSet>,
    /// Keep each token with this probability, decided by a seeded hash.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sample: Option<Sample>,
    /// Drop tokens whose `resid_post` norm at the deepest kept layer exceeds this multiple of
    /// the running median.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_norm_multiple: Option<f64>,
}

/// The selection fields as a request or a plan carries them, before validation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RawSelection {
    /// `exclude_special_tokens`.
    pub exclude_special_tokens: Option<bool>,
    /// `positions`: `[start, end)`.
    pub positions: Option<Vec<u64>>,
    /// `roles`: names of [`crate::chat::ROLE_NAMES`].
    pub roles: Option<Vec<String>>,
    /// `sample_rate`.
    pub sample_rate: Option<f64>,
    /// `seed` (0 when only a rate is given).
    pub seed: Option<u64>,
    /// `max_norm_multiple`.
    pub max_norm_multiple: Option<f64>,
}

impl RawSelection {
    /// Validates the fields into a selection.
    pub fn validate(self) -> Result<TokenSelection, SelectionError> {
        let positions = match self.positions {
            None => None,
            Some(slice) => {
                let [start, end] = slice[..] else {
                    return Err(SelectionError::SliceShape { count: slice.len() });
                };
                if start >= end {
                    return Err(SelectionError::EmptySlice { start, end });
                }
                let clamp = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
                Some(PositionSlice {
                    start: clamp(start),
                    end: clamp(end),
                })
            }
        };
        let roles = self.roles.as_deref().map(RoleSet::from_names).transpose()?;
        let sample = match (self.sample_rate, self.seed) {
            (None, None) => None,
            (None, Some(_)) => return Err(SelectionError::SeedWithoutRate),
            (Some(rate), seed) => {
                if !(rate > 0.0 && rate <= 1.0) {
                    return Err(SelectionError::Rate { rate });
                }
                Some(Sample {
                    rate,
                    seed: seed.unwrap_or(0),
                })
            }
        };
        if let Some(multiple) = self.max_norm_multiple
            && !(multiple.is_finite() && multiple > 1.0)
        {
            return Err(SelectionError::NormMultiple { multiple });
        }
        Ok(TokenSelection {
            exclude_special_tokens: self.exclude_special_tokens.unwrap_or(false),
            positions,
            roles,
            sample,
            max_norm_multiple: self.max_norm_multiple,
        })
    }
}

/// What a selection dropped, by reason (each token counted under the first filter that dropped
/// it, in the order of the module's diagram).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Dropped {
    /// Outside `positions`.
    pub positions: u64,
    /// Of a role not kept.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub roles: u64,
    /// Special tokens.
    pub special: u64,
    /// Not sampled.
    pub sampled: u64,
    /// Norm above the multiple of the running median.
    pub norm: u64,
}

impl Dropped {
    /// Adds another count.
    pub fn add(&mut self, other: &Self) {
        self.positions += other.positions;
        self.roles += other.roles;
        self.special += other.special;
        self.sampled += other.sampled;
        self.norm += other.norm;
    }

    /// Every dropped token.
    pub fn total(&self) -> u64 {
        self.positions + self.roles + self.special + self.sampled + self.norm
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl TokenSelection {
    /// Whether this keeps every token, as a job without selection fields does.
    pub fn is_everything(&self) -> bool {
        *self == Self::default()
    }

    /// The pure part of the decision for the token at `position` of prompt `prompt`: `None`
    /// when kept (so far), else the filter that drops it. `special` says whether the tokenizer
    /// marks its id special; `role` is its role id, for a conversation's tokens.
    pub fn pre_norm(
        &self,
        prompt: usize,
        position: usize,
        special: bool,
        role: Option<u8>,
    ) -> Option<Reason> {
        if let Some(slice) = self.positions
            && !(slice.start as usize..slice.end as usize).contains(&position)
        {
            return Some(Reason::Positions);
        }
        if let Some(roles) = self.roles
            && !role.is_some_and(|role| roles.contains(role))
        {
            return Some(Reason::Role);
        }
        if self.exclude_special_tokens && special {
            return Some(Reason::Special);
        }
        if let Some(sample) = self.sample
            && !sampled(sample, prompt, position)
        {
            return Some(Reason::Sampled);
        }
        None
    }

    /// How many tokens of one prompt the pure filters keep, and what they drop: what the API
    /// predicts before the norm filter (which can only drop more) runs. `roles` are the
    /// tokens' role ids, for a conversation.
    pub fn count(
        &self,
        prompt: usize,
        special: impl Iterator<Item = bool>,
        roles: Option<&[u8]>,
    ) -> (usize, Dropped) {
        let mut kept = 0;
        let mut dropped = Dropped::default();
        for (position, special) in special.enumerate() {
            let role = roles.and_then(|roles| roles.get(position).copied());
            match self.pre_norm(prompt, position, special, role) {
                None => kept += 1,
                Some(reason) => reason.count(&mut dropped),
            }
        }
        (kept, dropped)
    }
}

/// The filter that dropped a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// Outside `positions`.
    Positions,
    /// Of a role not kept.
    Role,
    /// A special token.
    Special,
    /// Not sampled.
    Sampled,
    /// Its norm.
    Norm,
}

impl Reason {
    /// Counts one token under this reason.
    pub fn count(self, dropped: &mut Dropped) {
        match self {
            Self::Positions => dropped.positions += 1,
            Self::Role => dropped.roles += 1,
            Self::Special => dropped.special += 1,
            Self::Sampled => dropped.sampled += 1,
            Self::Norm => dropped.norm += 1,
        }
    }
}

/// SplitMix64's finaliser: a bijective mix of 64 bits.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The seeded keep decision of one token: a hash of (seed, prompt, position) mapped to [0, 1).
fn sampled(sample: Sample, prompt: usize, position: usize) -> bool {
    let hash = mix(mix(mix(sample.seed) ^ prompt as u64) ^ position as u64);
    let unit = (hash >> 11) as f64 / (1u64 << 53) as f64;
    unit < sample.rate
}

/// Bins per octave of [`NormHistogram`].
pub const NORM_BINS_PER_OCTAVE: usize = 32;
/// The smallest norm the histogram resolves, as a power of two; smaller norms share bin 0.
const NORM_MIN_EXP: i32 = -24;
/// Octaves covered, from `2^NORM_MIN_EXP` up; larger norms share the last bin.
const NORM_OCTAVES: usize = 64;
/// Bins of [`NormHistogram`].
pub const NORM_BINS: usize = NORM_BINS_PER_OCTAVE * NORM_OCTAVES;

/// Counts of token norms in fixed log-spaced bins (1/32 octave, about 2.2% wide): mergeable
/// exactly, so the running median is the same however the job was split or resumed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NormHistogram {
    counts: Vec<u64>,
    total: u64,
}

impl Default for NormHistogram {
    fn default() -> Self {
        Self {
            counts: vec![0; NORM_BINS],
            total: 0,
        }
    }
}

impl NormHistogram {
    /// Rebuilds a histogram from its counts (as a record stores them); `None` if the length is
    /// not [`NORM_BINS`].
    pub fn from_counts(counts: Vec<u64>) -> Option<Self> {
        (counts.len() == NORM_BINS).then(|| Self {
            total: counts.iter().sum(),
            counts,
        })
    }

    /// The counts, bin by bin.
    pub fn counts(&self) -> &[u64] {
        &self.counts
    }

    /// Norms counted.
    pub fn total(&self) -> u64 {
        self.total
    }

    fn bin(norm: f64) -> usize {
        if norm.is_nan() || norm <= 0.0 {
            return 0;
        }
        let position = (norm.log2() - f64::from(NORM_MIN_EXP)) * NORM_BINS_PER_OCTAVE as f64;
        position.clamp(0.0, (NORM_BINS - 1) as f64) as usize
    }

    /// Counts one norm.
    pub fn push(&mut self, norm: f64) {
        self.counts[Self::bin(norm)] += 1;
        self.total += 1;
    }

    /// Adds another histogram's counts.
    pub fn merge(&mut self, other: &Self) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.total += other.total;
    }

    /// The median, as the upper edge of the bin holding the middle norm (so it errs high by at
    /// most one bin, 2.2%); `None` while empty.
    pub fn median(&self) -> Option<f64> {
        if self.total == 0 {
            return None;
        }
        let middle = self.total.div_ceil(2);
        let mut seen = 0;
        let bin = self
            .counts
            .iter()
            .position(|&c| {
                seen += c;
                seen >= middle
            })
            .unwrap_or(NORM_BINS - 1);
        let exponent = f64::from(NORM_MIN_EXP) + (bin + 1) as f64 / NORM_BINS_PER_OCTAVE as f64;
        Some(exponent.exp2())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw() -> RawSelection {
        RawSelection::default()
    }

    #[test]
    fn no_fields_keep_every_token() {
        let selection = raw().validate().unwrap();
        assert!(selection.is_everything());
        assert_eq!(
            selection.count(3, [true, false, false].into_iter(), None).0,
            3
        );
    }

    #[test]
    fn bad_fields_are_refused_with_the_value_and_the_fix() {
        let bad = |r: RawSelection| r.validate().unwrap_err().to_string();
        let text = bad(RawSelection {
            positions: Some(vec![5, 5]),
            ..raw()
        });
        assert!(
            text.contains("[5, 5)") && text.contains("start < end"),
            "{text}"
        );
        assert!(
            bad(RawSelection {
                positions: Some(vec![9, 2]),
                ..raw()
            })
            .contains("[9, 2)")
        );
        assert!(
            bad(RawSelection {
                positions: Some(vec![1]),
                ..raw()
            })
            .contains("got 1")
        );
        for rate in [0.0, -0.5, 1.5, f64::NAN] {
            let text = bad(RawSelection {
                sample_rate: Some(rate),
                ..raw()
            });
            assert!(text.contains("outside (0, 1]"), "{text}");
        }
        assert!(
            bad(RawSelection {
                max_norm_multiple: Some(0.5),
                ..raw()
            })
            .contains("above 1")
        );
        assert!(
            bad(RawSelection {
                seed: Some(3),
                ..raw()
            })
            .contains("without sample_rate")
        );
        let text = bad(RawSelection {
            roles: Some(vec!["assistent".into()]),
            ..raw()
        });
        assert!(
            text.contains("\"assistent\"") && text.contains("\"assistant\""),
            "{text}"
        );
        assert!(
            bad(RawSelection {
                roles: Some(vec![]),
                ..raw()
            })
            .contains("roles is empty")
        );
    }

    #[test]
    fn positions_and_special_tokens_drop_what_they_name_in_that_order() {
        let selection = RawSelection {
            positions: Some(vec![1, 3]),
            exclude_special_tokens: Some(true),
            ..raw()
        }
        .validate()
        .unwrap();
        let (kept, dropped) = selection.count(0, [true, true, false, false].into_iter(), None);
        assert_eq!(kept, 1);
        assert_eq!((dropped.positions, dropped.special), (2, 1));
    }

    #[test]
    fn roles_keep_only_the_named_roles_tokens_and_plain_prompts_keep_none() {
        let selection = RawSelection {
            roles: Some(vec!["assistant".into(), "user".into()]),
            positions: Some(vec![0, 5]),
            ..raw()
        }
        .validate()
        .unwrap();
        // template, user, user, template, assistant, assistant (outside positions)
        let roles = [0, 2, 2, 0, 3, 3];
        let (kept, dropped) = selection.count(0, [false; 6].into_iter(), Some(&roles));
        assert_eq!(kept, 3);
        assert_eq!((dropped.positions, dropped.roles), (1, 2));
        assert_eq!(dropped.total(), 3);
        let (kept, _) = selection.count(0, [false; 3].into_iter(), None);
        assert_eq!(kept, 0, "a token without a role is of no kept role");
        let json = serde_json::to_value(selection).unwrap();
        assert_eq!(json["roles"], serde_json::json!(["user", "assistant"]));
        assert_eq!(
            serde_json::from_value::<TokenSelection>(json).unwrap(),
            selection
        );
    }

    #[test]
    fn sampling_keeps_about_the_rate_and_the_same_tokens_every_time() {
        let selection = RawSelection {
            sample_rate: Some(0.25),
            seed: Some(7),
            ..raw()
        }
        .validate()
        .unwrap();
        let keep = |prompt| {
            (0..4000)
                .map(|p| selection.pre_norm(prompt, p, false, None).is_none())
                .collect::<Vec<_>>()
        };
        let kept = keep(0).iter().filter(|&&k| k).count();
        assert!((900..1100).contains(&kept), "{kept}");
        assert_eq!(keep(0), keep(0));
        assert_ne!(keep(0), keep(1), "prompts are sampled independently");
        let other_seed = TokenSelection {
            sample: Some(Sample {
                rate: 0.25,
                seed: 8,
            }),
            ..selection
        };
        let differs = (0..4000)
            .filter(|&p| other_seed.pre_norm(0, p, false, None).is_none() != keep(0)[p])
            .count();
        assert!(differs > 1000, "{differs}");
    }

    #[test]
    fn the_histogram_median_is_within_one_bin_and_merges_exactly() {
        let mut whole = NormHistogram::default();
        let (mut a, mut b) = (NormHistogram::default(), NormHistogram::default());
        for i in 1..=1001 {
            let norm = f64::from(i) * 0.37;
            whole.push(norm);
            if i % 2 == 0 {
                a.push(norm);
            } else {
                b.push(norm);
            }
        }
        a.merge(&b);
        assert_eq!(a, whole);
        let median = whole.median().unwrap();
        let exact = 501.0 * 0.37;
        assert!(
            median >= exact && median <= exact * 1.023,
            "{median} vs {exact}"
        );
        assert_eq!(NormHistogram::default().median(), None);
        let back = NormHistogram::from_counts(whole.counts().to_vec()).unwrap();
        assert_eq!(back, whole);
    }
}
