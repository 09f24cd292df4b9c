//! How a job's activations are laid out in files: by prompt (the seed's shards) or shuffled for
//! training (`train_NNNNN.safetensors`, rows permuted over the whole job).
//!
//! The shuffle is a sort by a seeded 64-bit key of each row's (prompt, position), so the order
//! is a uniform random permutation that depends on nothing but the seed and the rows kept: not
//! on threads, batches, shards or resumes. Rows are scattered into buckets by key range and each
//! bucket is sorted alone, so memory is bounded by a bucket, not by the job.

use std::num::NonZeroUsize;

use serde::{Deserialize, Serialize};

/// Rows per training file unless the job says otherwise.
pub const DEFAULT_ROWS_PER_FILE: usize = 65_536;
/// Most rows per training file.
pub const MAX_ROWS_PER_FILE: usize = 1 << 24;
/// About the most bytes of one bucket of the shuffle's spill: what the step that writes the
/// training files holds besides one training file.
pub const SHUFFLE_BUCKET_BYTES: u64 = 256 << 20;

/// The data bytes of a training file of `rows` rows: `slots` tensors (a site at a layer each)
/// of `width` values of `itemsize` bytes per row, and the index, two int32 per row. Its
/// header (a few kilobytes) aside.
pub fn train_file_data_bytes(rows: usize, slots: usize, width: usize, itemsize: usize) -> u64 {
    rows as u64 * (slots as u64 * width as u64 * itemsize as u64 + 8)
}

/// Bytes of a spill record before its values: key (u64), prompt (u32), position (u32).
pub const SPILL_RECORD_HEAD: usize = 16;

/// The scratch space the shuffle spills `rows` rows into: a record head and `slots` values of
/// `width` × `itemsize` bytes per row. The spill lives until the training files are written.
/// A job of conversations adds one byte a row (its role), which the callers' margin of one
/// bucket ([`SHUFFLE_BUCKET_BYTES`]) covers up to 2^28 rows.
pub fn spill_bytes(rows: u64, slots: usize, width: usize, itemsize: usize) -> u64 {
    rows * (SPILL_RECORD_HEAD as u64 + slots as u64 * width as u64 * itemsize as u64)
}

/// The layout as requests and plans name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum LayoutName {
    /// One tensor per prompt and site, prompts in order (the seed's shards).
    #[default]
    ByPrompt,
    /// Rows permuted over the whole job, in files of a fixed number of rows.
    Shuffled,
}

/// The file name of shard `shard`.
pub fn shard_file_name(shard: usize) -> String {
    format!("shard_{shard:05}.safetensors")
}

impl LayoutName {
    /// The name of output file `index` of this layout: a shard or a training file.
    pub fn file_name(self, index: usize) -> String {
        match self {
            Self::ByPrompt => shard_file_name(index),
            Self::Shuffled => train_file_name(index),
        }
    }

    /// Parses a layout's name.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "by_prompt" => Some(Self::ByPrompt),
            "shuffled" => Some(Self::Shuffled),
            _ => None,
        }
    }

    /// The name requests and manifests use.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ByPrompt => "by_prompt",
            Self::Shuffled => "shuffled",
        }
    }
}

impl std::str::FromStr for LayoutName {
    type Err = LayoutError;

    fn from_str(name: &str) -> Result<Self, LayoutError> {
        Self::parse(name).ok_or_else(|| LayoutError::Unknown {
            name: name.to_owned(),
        })
    }
}

impl std::fmt::Display for LayoutName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A validated layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(tag = "name", rename_all = "snake_case")]
pub enum Layout {
    /// The seed's shards.
    #[default]
    ByPrompt,
    /// Training files.
    Shuffled {
        /// Rows per file (the last may hold fewer).
        rows_per_file: NonZeroUsize,
        /// The permutation's seed.
        seed: u64,
    },
}

/// Why a layout is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// A name that is not a layout.
    #[error("layout {name:?} is not a layout this server writes: use by_prompt or shuffled")]
    Unknown {
        /// What was given.
        name: String,
    },
    /// Rows per file out of range.
    #[error("rows_per_file {value} must be between 1 and {MAX_ROWS_PER_FILE} (2^24)")]
    RowsPerFile {
        /// What was given.
        value: usize,
    },
    /// Rows per file for the by-prompt layout.
    #[error(
        "rows_per_file applies to layout \"shuffled\" only: add \"layout\": \"shuffled\" or drop it"
    )]
    RowsWithoutShuffle,
}

impl Layout {
    /// Validates a layout from its name, rows per file and seed.
    pub fn new(
        name: LayoutName,
        rows_per_file: Option<usize>,
        seed: u64,
    ) -> Result<Self, LayoutError> {
        match name {
            LayoutName::ByPrompt if rows_per_file.is_some() => Err(LayoutError::RowsWithoutShuffle),
            LayoutName::ByPrompt => Ok(Self::ByPrompt),
            LayoutName::Shuffled => {
                let value = rows_per_file.unwrap_or(DEFAULT_ROWS_PER_FILE);
                let rows_per_file = NonZeroUsize::new(value)
                    .filter(|v| v.get() <= MAX_ROWS_PER_FILE)
                    .ok_or(LayoutError::RowsPerFile { value })?;
                Ok(Self::Shuffled {
                    rows_per_file,
                    seed,
                })
            }
        }
    }

    /// Whether this is the seed's layout.
    pub fn is_by_prompt(&self) -> bool {
        *self == Self::ByPrompt
    }

    /// Its name.
    pub fn name(self) -> LayoutName {
        match self {
            Self::ByPrompt => LayoutName::ByPrompt,
            Self::Shuffled { .. } => LayoutName::Shuffled,
        }
    }

    /// The name of output file `index`: a shard or a training file.
    pub fn file_name(self, index: usize) -> String {
        self.name().file_name(index)
    }
}

/// The file name of training file `index`.
pub fn train_file_name(index: usize) -> String {
    format!("train_{index:05}.safetensors")
}

/// The name of a training file's tensor of `site` at `layer`: `resid_post.7`.
pub fn train_tensor_name(site: crate::Site, layer: usize) -> String {
    format!("{site}.{layer}")
}

/// Training files that `rows` rows fill, `rows_per_file` at a time.
pub fn train_file_count(rows: u64, rows_per_file: NonZeroUsize) -> usize {
    rows.div_ceil(rows_per_file.get() as u64) as usize
}

/// SplitMix64's finaliser.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Keeps the shuffle independent of the sampling that the same seed drives.
const SHUFFLE_SALT: u64 = 0x5348_5546_464c_4521;

/// The sort key of the row at `position` of prompt `prompt`: the shuffled order is ascending
/// key (ties, one in 2^64 per pair, broken by prompt and position).
pub fn shuffle_key(seed: u64, prompt: usize, position: usize) -> u64 {
    mix(mix(mix(seed ^ SHUFFLE_SALT) ^ prompt as u64) ^ position as u64)
}

/// The bucket of `key` among `buckets` equal key ranges, in key order.
pub fn bucket_of(key: u64, buckets: usize) -> usize {
    ((u128::from(key) * buckets as u128) >> 64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layout_is_checked_and_names_its_files() {
        assert_eq!(
            Layout::new(LayoutName::ByPrompt, None, 0),
            Ok(Layout::ByPrompt)
        );
        let shuffled = Layout::new(LayoutName::Shuffled, None, 9).unwrap();
        assert_eq!(
            shuffled,
            Layout::Shuffled {
                rows_per_file: NonZeroUsize::new(65_536).unwrap(),
                seed: 9
            }
        );
        assert_eq!(shuffled.file_name(3), "train_00003.safetensors");
        assert_eq!(Layout::ByPrompt.file_name(3), "shard_00003.safetensors");
        for bad in [0, (1 << 24) + 1] {
            let error = Layout::new(LayoutName::Shuffled, Some(bad), 0).unwrap_err();
            assert!(error.to_string().contains(&bad.to_string()), "{error}");
        }
        assert_eq!(
            Layout::new(LayoutName::ByPrompt, Some(5), 0),
            Err(LayoutError::RowsWithoutShuffle)
        );
        assert_eq!(LayoutName::parse("sorted"), None);
    }

    #[test]
    fn buckets_split_the_keys_in_order_and_about_evenly() {
        let buckets = 7;
        let mut sizes = [0usize; 7];
        let mut last = (0, 0);
        let mut keys: Vec<u64> = (0..70_000)
            .map(|p| shuffle_key(1, p / 100, p % 100))
            .collect();
        keys.sort_unstable();
        for key in keys {
            let bucket = bucket_of(key, buckets);
            assert!(bucket >= last.0, "buckets follow key order");
            last = (bucket, key);
            sizes[bucket] += 1;
        }
        assert!(
            sizes.iter().all(|&n| (9_000..11_000).contains(&n)),
            "{sizes:?}"
        );
        assert_ne!(shuffle_key(1, 0, 0), shuffle_key(2, 0, 0));
    }
}
