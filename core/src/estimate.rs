//! What a job's files will take, predicted before it runs from its prompts' token counts: the
//! answer of a dry run, the estimate a job's status shows, and what the embedded server's
//! free-space check reserves.
//!
//! Shards and the statistics are predicted to the byte: their data sizes follow from the shapes,
//! and their safetensors headers are laid out here exactly as the `safetensors` crate writes
//! them (tensors sorted by descending dtype, then by name; compact JSON padded with spaces to a
//! multiple of 8). The manifest is built with placeholders of the real lengths (checksums,
//! fingerprint) and measured; only its floats' digits can differ, a few bytes per kept layer.

use std::num::NonZeroUsize;

use crate::format::{
    self, Contents, FileDigest, Manifest, ModelInfo, ProjectionInfo, SelectionInfo, ShardEntry,
    SiteInfo, TokenizerInfo, TrainFile, TrainInfo, Truncation,
};
use crate::layout::{Layout, train_file_name, train_tensor_name};
use crate::selection::{Dropped, TokenSelection};
use crate::sites::{Site, Sites};

/// Hex digits of a sha256 (checksums and the plan fingerprint).
const SHA256_HEX: usize = 64;
/// A representative `mean_token_norm` value (ryu prints most f64 norms in 16 to 18 characters).
const TYPICAL_NORM: f64 = 1_234.567_890_123_456_7;

/// Everything the files' sizes depend on.
#[derive(Debug, Clone)]
pub struct JobShape<'a> {
    /// Tokens of each prompt, as they will run (cut to the context window).
    pub token_counts: &'a [usize],
    /// Prompts cut to the context window: (prompt, tokens before the cut).
    pub truncated: &'a [(usize, usize)],
    /// Prompts per shard.
    pub shard_size: usize,
    /// Kept layers, ascending.
    pub layers: &'a [usize],
    /// Kept hook sites.
    pub sites: &'a Sites,
    /// How the files are laid out.
    pub layout: Layout,
    /// The forward pass's arithmetic (recorded in the manifest).
    pub precision: crate::plan::Precision,
    /// The token selection, and per prompt the tokens it keeps with what it drops (the pure
    /// filters only: the norm filter can drop more, so this is an upper bound).
    pub selection: Option<KeptTokens<'a>>,
    /// Activations or projections.
    pub contents: Contents,
    /// The last axis: the hidden size, or the number of directions.
    pub width: usize,
    /// The model as the manifest names it.
    pub model: ModelInfo,
    /// Whether special tokens are added.
    pub add_special_tokens: bool,
    /// The tokenizer's BOS id, if any.
    pub bos_token_id: Option<u32>,
    /// The context window.
    pub max_tokens: usize,
    /// Whether the job runs conversations (shards then carry `roles_i` and `turns_i`).
    pub conversations: bool,
    /// The router's record, for a job that keeps it ([`format::RouterInfo::of_job`]).
    pub router: Option<&'a format::RouterInfo>,
}

/// What a token selection keeps, as predicted before the job runs.
#[derive(Debug, Clone)]
pub struct KeptTokens<'a> {
    /// The rules.
    pub rules: &'a TokenSelection,
    /// Tokens kept of each prompt.
    pub kept_counts: &'a [usize],
    /// Tokens dropped over the job.
    pub dropped: Dropped,
}

/// The predicted sizes of a job's files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Predicted {
    /// Each data file, in order: shards, or training files for the shuffled layout.
    pub shards: Vec<u64>,
    /// `stats.safetensors`.
    pub stats: u64,
    /// `manifest.json`.
    pub manifest: u64,
}

impl Predicted {
    /// Every file together (what a job's `bytes_written` reports).
    pub fn total(&self) -> u64 {
        self.shards.iter().sum::<u64>() + self.stats + self.manifest
    }
}

/// A tensor as the safetensors header lists it.
struct Tensor {
    name: String,
    dtype: &'static str,
    shape: Vec<usize>,
}

impl Tensor {
    fn new(name: String, dtype: &'static str, shape: Vec<usize>) -> Self {
        Self { name, dtype, shape }
    }

    /// A shard's tensor as the manifest lists it.
    fn listed(entry: format::TensorEntry) -> Self {
        let dtype = match entry.dtype.as_str() {
            "bfloat16" => "BF16",
            "float32" => "F32",
            "int32" => "I32",
            "uint8" => "U8",
            "uint16" => "U16",
            _ => "I64",
        };
        Self::new(entry.name, dtype, entry.shape)
    }

    fn data_len(&self) -> u64 {
        let width = match self.dtype {
            "U8" => 1,
            "U16" | "BF16" | "F16" => 2,
            "I32" | "F32" => 4,
            _ => 8,
        };
        self.shape.iter().product::<usize>() as u64 * width
    }

    /// The dtype's place in the crate's `Dtype` order (which sorts the header).
    fn rank(&self) -> u8 {
        match self.dtype {
            "U8" => 0,
            "U16" => 1,
            "F16" => 2,
            "BF16" => 3,
            "I32" => 4,
            "F32" => 5,
            _ => 6,
        }
    }
}

/// Bytes of a safetensors file holding `tensors` and one metadata entry `(key, value length)`.
fn safetensors_len(mut tensors: Vec<Tensor>, metadata: (&str, usize)) -> u64 {
    tensors.sort_by(|a, b| b.rank().cmp(&a.rank()).then(a.name.cmp(&b.name)));
    let (key, value_len) = metadata;
    // {"__metadata__":{"KEY":"VALUE"}
    let mut header = 1 + "\"__metadata__\":{".len() + key.len() + 5 + value_len + 1;
    let mut offset = 0u64;
    for tensor in &tensors {
        let end = offset + tensor.data_len();
        let shape: Vec<String> = tensor.shape.iter().map(ToString::to_string).collect();
        let entry = format!(
            ",\"{}\":{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{offset},{end}]}}",
            tensor.name,
            tensor.dtype,
            shape.join(",")
        );
        header += entry.len();
        offset = end;
    }
    header += 1; // the closing brace
    8 + header.next_multiple_of(8) as u64 + offset
}

/// Predicts the sizes of the files of a job of `shape`.
pub fn predict(shape: &JobShape<'_>) -> Predicted {
    let shard_size = shape.shard_size.max(1);
    let layers = shape.layers.len();
    let value_dtype = match shape.contents {
        Contents::Activations => "BF16",
        Contents::Projections => "F32",
    };
    let kept = shape.selection.as_ref().map(|k| k.kept_counts);
    let shards: Vec<u64> = shape
        .token_counts
        .chunks(shard_size)
        .enumerate()
        .map(|(shard, counts)| {
            let first_prompt = shard * shard_size;
            let kept = kept.map(|k| {
                let end = (first_prompt + counts.len()).min(k.len());
                &k[first_prompt.min(end)..end]
            });
            let (_, listed) = ShardEntry::contents_of(
                first_prompt,
                counts,
                kept,
                (shape.contents, shape.sites),
                (layers, shape.width),
                (shape.conversations, shape.router),
            );
            let tensors = listed.into_iter().map(Tensor::listed).collect();
            safetensors_len(tensors, ("harvest_plan", SHA256_HEX))
        })
        .collect();
    let mut stats_tensors: Vec<Tensor> = shape
        .sites
        .as_slice()
        .iter()
        .flat_map(|&site| {
            let (mean, std) = format::stats_names(site);
            [
                Tensor::new(mean, "F32", vec![layers, shape.width]),
                Tensor::new(std, "F32", vec![layers, shape.width]),
            ]
        })
        .collect();
    stats_tensors.push(Tensor::new("count".into(), "I64", vec![1]));
    let stats = safetensors_len(stats_tensors, ("format", 2));
    let shards = match shape.layout {
        Layout::ByPrompt => shards,
        Layout::Shuffled { rows_per_file, .. } => train_files(shape, value_dtype, rows_per_file),
    };
    let manifest = manifest_len(shape, &shards, stats);
    Predicted {
        shards,
        stats,
        manifest,
    }
}

/// The manifest's shard entries, checksums as placeholders of their length.
fn shard_entries(shape: &JobShape<'_>, shards: &[u64]) -> Vec<ShardEntry> {
    let shard_size = shape.shard_size.max(1);
    shape
        .token_counts
        .chunks(shard_size)
        .zip(shards)
        .enumerate()
        .map(|(shard, (counts, &bytes))| {
            let first_prompt = shard * shard_size;
            let kept = shape.selection.as_ref().map(|k| {
                let end = (first_prompt + counts.len()).min(k.kept_counts.len());
                &k.kept_counts[first_prompt.min(end)..end]
            });
            let (prompts, tensors) = ShardEntry::contents_of(
                first_prompt,
                counts,
                kept,
                (shape.contents, shape.sites),
                (shape.layers.len(), shape.width),
                (shape.conversations, shape.router),
            );
            ShardEntry {
                file: crate::plan::shard_file_name(shard),
                first_prompt,
                token_counts: counts.to_vec(),
                kept_counts: kept.map(<[usize]>::to_vec).unwrap_or_default(),
                prompts,
                tensors,
                bytes,
                sha256: "0".repeat(SHA256_HEX),
            }
        })
        .collect()
}

/// Rows of every training file: each kept token once, `rows_per_file` at a time.
fn train_rows(shape: &JobShape<'_>, rows_per_file: NonZeroUsize) -> Vec<usize> {
    let counts = shape
        .selection
        .as_ref()
        .map_or(shape.token_counts, |k| k.kept_counts);
    let total = counts.iter().sum::<usize>();
    let per = rows_per_file.get();
    (0..total.div_ceil(per))
        .map(|i| per.min(total - i * per))
        .collect()
}

/// The tensor names of a training file, values first, then `index`.
fn train_tensors(shape: &JobShape<'_>) -> Vec<String> {
    let mut names: Vec<String> = shape
        .sites
        .as_slice()
        .iter()
        .flat_map(|&site| {
            shape
                .layers
                .iter()
                .map(move |&l| train_tensor_name(site, l))
        })
        .collect();
    names.push("index".into());
    if shape.conversations {
        names.push("roles".into());
    }
    let router = shape.router.map(format::RouterInfo::train_tensors);
    names.extend(router.into_iter().flatten().map(|(name, _, _)| name));
    names
}

/// The sizes of the shuffled layout's training files.
fn train_files(shape: &JobShape<'_>, dtype: &'static str, rows_per_file: NonZeroUsize) -> Vec<u64> {
    let names = train_tensors(shape);
    train_rows(shape, rows_per_file)
        .into_iter()
        .map(|rows| {
            let mut tensors: Vec<Tensor> = names
                .iter()
                .take_while(|n| *n != "index")
                .map(|n| Tensor::new(n.clone(), dtype, vec![rows, shape.width]))
                .collect();
            tensors.push(Tensor::new("index".into(), "I32", vec![rows, 2]));
            if shape.conversations {
                tensors.push(Tensor::new("roles".into(), "U8", vec![rows]));
            }
            let router = shape.router.map(format::RouterInfo::train_tensors);
            for (name, dtype, width) in router.into_iter().flatten() {
                let dtype = if dtype == "int32" { "I32" } else { "F32" };
                tensors.push(Tensor::new(name, dtype, vec![rows, width]));
            }
            safetensors_len(tensors, ("harvest_plan", SHA256_HEX))
        })
        .collect()
}

/// The manifest's training files block, checksums as placeholders of their length.
fn train_block(
    shape: &JobShape<'_>,
    shards: &[u64],
    rows_per_file: NonZeroUsize,
    seed: u64,
) -> TrainInfo {
    let rows = train_rows(shape, rows_per_file);
    let files = rows
        .iter()
        .zip(shards)
        .enumerate()
        .map(|(i, (&rows, &bytes))| TrainFile {
            file: train_file_name(i),
            rows,
            bytes,
            sha256: "0".repeat(SHA256_HEX),
        })
        .collect();
    TrainInfo {
        seed,
        rows_per_file: rows_per_file.get(),
        rows: rows.iter().sum::<usize>() as u64,
        tensors: train_tensors(shape),
        files,
    }
}

/// The manifest's cut prompts, each cut to the context window.
fn truncations(shape: &JobShape<'_>) -> Vec<Truncation> {
    shape
        .truncated
        .iter()
        .map(|&(prompt, original_tokens)| Truncation {
            prompt,
            original_tokens,
            kept_tokens: shape.max_tokens,
        })
        .collect()
}

/// The length of the job's pretty-printed manifest, with placeholders of the real lengths.
fn manifest_len(shape: &JobShape<'_>, shards: &[u64], stats: u64) -> u64 {
    let total_tokens: usize = shape.token_counts.iter().sum();
    let (entries, train) = match shape.layout {
        Layout::ByPrompt => (shard_entries(shape, shards), None),
        Layout::Shuffled {
            rows_per_file,
            seed,
        } => (
            Vec::new(),
            Some(train_block(shape, shards, rows_per_file, seed)),
        ),
    };
    let manifest = Manifest {
        format_version: format::FORMAT_VERSION,
        plan_fingerprint: "0".repeat(SHA256_HEX),
        model: shape.model.clone(),
        tokenizer: TokenizerInfo {
            add_special_tokens: shape.add_special_tokens,
            bos_token_id: shape.bos_token_id,
            bos: format::bos_treatment(shape.add_special_tokens, shape.bos_token_id),
            max_tokens: shape.max_tokens,
        },
        contents: shape.contents,
        dtype: shape.contents.dtype().to_owned(),
        layer_indices: shape.layers.to_vec(),
        layer_convention: format::LAYER_CONVENTION.to_owned(),
        tensors: format::tensors_description(shape.contents, shape.sites),
        n_prompts: shape.token_counts.len(),
        shard_size: shape.shard_size,
        total_tokens: total_tokens as u64,
        shards: entries,
        truncated_prompts: truncations(shape),
        projection: (shape.contents == Contents::Projections).then_some(ProjectionInfo {
            n_directions: shape.width,
            normalized: true,
        }),
        statistics: format::statistics_description(shape.contents, shape.sites),
        stats_tokens: total_tokens as u64,
        mean_token_norm: if shape.sites.contains(Site::ResidPost) {
            vec![TYPICAL_NORM; shape.layers.len()]
        } else {
            Vec::new()
        },
        stats_file: Some(FileDigest {
            file: "stats.safetensors".into(),
            bytes: stats,
            sha256: "0".repeat(SHA256_HEX),
        }),
        sites: shape
            .sites
            .as_slice()
            .iter()
            .map(|&site| SiteInfo::new(site, vec![TYPICAL_NORM; shape.layers.len()]))
            .collect(),
        selection: shape.selection.as_ref().map(|k| SelectionInfo {
            rules: *k.rules,
            norm_layer: k
                .rules
                .max_norm_multiple
                .and_then(|_| shape.layers.last().copied()),
            kept_tokens: k.kept_counts.iter().sum::<usize>() as u64,
            dropped: k.dropped,
        }),
        layout: shape.layout.name(),
        train,
        precision: shape.precision,
        job_uid: None,
        roles: shape
            .conversations
            .then(format::RolesInfo::of_conversations),
        router: shape.router.cloned(),
    };
    serde_json::to_vec_pretty(&manifest).map_or(0, |v| v.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape<'a>(counts: &'a [usize], layers: &'a [usize], contents: Contents) -> JobShape<'a> {
        static DEFAULT: std::sync::LazyLock<Sites> = std::sync::LazyLock::new(Sites::default);
        JobShape {
            token_counts: counts,
            truncated: &[],
            shard_size: 2,
            layers,
            sites: &DEFAULT,
            layout: Layout::ByPrompt,
            precision: Default::default(),
            selection: None,
            contents,
            width: 8,
            model: ModelInfo {
                name: "m".into(),
                architecture: "LlamaForCausalLM".into(),
                num_layers: 4,
                hidden_size: 8,
            },
            add_special_tokens: true,
            bos_token_id: Some(1),
            max_tokens: 512,
            conversations: false,
            router: None,
        }
    }

    #[test]
    fn the_router_adds_its_ids_and_weights_per_kept_sparse_layer_and_token_and_its_block() {
        let prompts = predict(&shape(&[3, 5, 7], &[1, 2], Contents::Activations));
        let choices = format::RouterInfo::new(vec![2], 8, 2, false);
        let routed = predict(&JobShape {
            router: Some(&choices),
            ..shape(&[3, 5, 7], &[1, 2], Contents::Activations)
        });
        let extra: u64 = routed.shards.iter().sum::<u64>() - prompts.shards.iter().sum::<u64>();
        // 15 tokens of 2 (id, weight) pairs of 4 + 4 bytes, two header entries per prompt.
        assert!((15 * 16..15 * 16 + 3 * 2 * 112).contains(&extra), "{extra}");
        assert!(routed.manifest > prompts.manifest + 300, "the router block");
        let logits = format::RouterInfo::new(vec![2], 8, 2, true);
        let with_logits = predict(&JobShape {
            router: Some(&logits),
            ..shape(&[3, 5, 7], &[1, 2], Contents::Activations)
        });
        let more = with_logits.shards.iter().sum::<u64>() - routed.shards.iter().sum::<u64>();
        assert!((15 * 32..15 * 32 + 3 * 112).contains(&more), "{more}");
    }

    #[test]
    fn conversations_add_a_role_byte_and_a_turn_pair_per_token_and_the_roles_block() {
        let prompts = predict(&shape(&[3, 5, 7], &[1], Contents::Activations));
        let chats = predict(&JobShape {
            conversations: true,
            ..shape(&[3, 5, 7], &[1], Contents::Activations)
        });
        let extra: u64 = chats.shards.iter().sum::<u64>() - prompts.shards.iter().sum::<u64>();
        // 15 tokens of 1 + 2 bytes, and two header entries (under 96 bytes each) per prompt.
        assert!((15 * 3..15 * 3 + 3 * 2 * 96).contains(&extra), "{extra}");
        assert!(chats.manifest > prompts.manifest + 200, "the roles block");
    }

    #[test]
    fn shards_split_by_shard_size_and_grow_with_tokens_and_layers() {
        let one = predict(&shape(&[3, 5, 7], &[1], Contents::Activations));
        assert_eq!(one.shards.len(), 2);
        let two = predict(&shape(&[3, 5, 7], &[1, 2], Contents::Activations));
        // Each extra layer adds every token's row of 8 bf16 values, and nothing else but digits.
        let extra: u64 = two.shards.iter().sum::<u64>() - one.shards.iter().sum::<u64>();
        assert!((15 * 16..15 * 16 + 64).contains(&extra), "{extra}");
        let projected = predict(&shape(&[3, 5, 7], &[1], Contents::Projections));
        assert!(
            projected.shards[0] > one.shards[0],
            "f32 rows are twice as wide"
        );
        assert_eq!(
            one.total(),
            one.shards.iter().sum::<u64>() + one.stats + one.manifest
        );
    }

    #[test]
    fn each_extra_site_adds_its_rows_to_every_shard_and_its_mean_and_std_to_the_stats() {
        let one = predict(&shape(&[3, 5, 7], &[1], Contents::Activations));
        let sites = Sites::parse(&["attn_out", "resid_post"]).unwrap();
        let two = predict(&JobShape {
            sites: &sites,
            ..shape(&[3, 5, 7], &[1], Contents::Activations)
        });
        let extra: u64 = two.shards.iter().sum::<u64>() - one.shards.iter().sum::<u64>();
        // 15 tokens of 8 bf16 values, and a header entry (under 96 bytes) per prompt.
        assert!((15 * 16..15 * 16 + 3 * 96).contains(&extra), "{extra}");
        assert!(
            two.stats >= one.stats + 2 * 8 * 4,
            "{} {}",
            two.stats,
            one.stats
        );
        assert!(two.manifest > one.manifest);
    }

    #[test]
    fn a_header_is_padded_to_eight_bytes_after_its_eight_byte_length() {
        let bytes = safetensors_len(
            vec![Tensor::new("tokens_0".into(), "I32", vec![3])],
            ("harvest_plan", 64),
        );
        assert_eq!((bytes - 8 - 12) % 8, 0);
    }
}
