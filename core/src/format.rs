//! The output format's schema: `manifest.json`, written last as a harvest's commit point.
//! `docs/format.md` describes the files in prose; this module is the single source of the JSON.

use serde::{Deserialize, Serialize};

use crate::layout::LayoutName;
use crate::selection::{Dropped, TokenSelection};
use crate::sites::{Site, Sites};

/// Bumped on any incompatible change to the files a harvest writes.
pub const FORMAT_VERSION: u32 = 1;

/// The layer convention, spelled out in every manifest.
pub const LAYER_CONVENTION: &str = "layer k is the output of decoder block k (0-based): the residual stream after block k has added its attention and MLP outputs, before the model's final norm";

/// What the shards hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Contents {
    /// Raw residual-stream rows, bf16 `[layers, tokens, hidden]`.
    Activations,
    /// Projections onto unit directions, f32 `[layers, tokens, directions]`.
    Projections,
}

impl Contents {
    /// The name the manifest and the API use: `activations` or `projections`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Activations => "activations",
            Self::Projections => "projections",
        }
    }

    /// The dtype name of `prompt_i` tensors.
    pub fn dtype(self) -> &'static str {
        match self {
            Self::Activations => "bfloat16",
            Self::Projections => "float32",
        }
    }

    /// The `statistics` sentence of the manifest.
    pub fn statistics(self) -> &'static str {
        match self {
            Self::Activations => {
                "stats.safetensors: per-layer mean and std of the residual stream over every token except each prompt's leading BOS, accumulated in f64, stored as float32 [n_layers, hidden]; mean_token_norm is the mean L2 norm of those residual vectors"
            }
            Self::Projections => {
                "stats.safetensors: per-layer mean and std of the projections (not the residual stream) over every token except each prompt's leading BOS, accumulated in f64, stored as float32 [n_layers, n_directions]; mean_token_norm is the mean L2 norm of the projection vectors"
            }
        }
    }
}

/// `manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// [`FORMAT_VERSION`].
    pub format_version: u32,
    /// A digest of everything that decides the files' bytes; a rerun of the same plan into the
    /// same place resumes, a different plan is refused.
    pub plan_fingerprint: String,
    /// The model that ran.
    pub model: ModelInfo,
    /// How prompts were tokenized.
    pub tokenizer: TokenizerInfo,
    /// Activations or projections.
    pub contents: Contents,
    /// dtype of every `prompt_i`.
    pub dtype: String,
    /// Kept blocks, ascending; the first axis of every `prompt_i`.
    pub layer_indices: Vec<usize>,
    /// [`LAYER_CONVENTION`].
    pub layer_convention: String,
    /// The tensors of a shard, in words.
    pub tensors: String,
    /// Prompts in the job.
    pub n_prompts: usize,
    /// Prompts per shard (the last may hold fewer).
    pub shard_size: usize,
    /// Tokens run, over all prompts.
    pub total_tokens: u64,
    /// Every shard, in order.
    pub shards: Vec<ShardEntry>,
    /// Prompts cut to `tokenizer.max_tokens`.
    pub truncated_prompts: Vec<Truncation>,
    /// Present for projections.
    pub projection: Option<ProjectionInfo>,
    /// What `stats.safetensors` and `mean_token_norm` describe.
    pub statistics: String,
    /// Tokens counted in the statistics (all tokens less each leading BOS).
    pub stats_tokens: u64,
    /// Per kept layer, the mean L2 norm of the captured vectors.
    pub mean_token_norm: Vec<f64>,
    /// `stats.safetensors`'s size and checksum, so a download can be verified like a shard's.
    /// Absent from manifests written before it was added.
    #[serde(default)]
    pub stats_file: Option<FileDigest>,
    /// The hook sites kept, in block order, each with its tensors and statistics. Absent from
    /// manifests written before sites were added, which kept `resid_post` alone.
    #[serde(default)]
    pub sites: Vec<SiteInfo>,
    /// Present when the job selected tokens: its rules and what they kept and dropped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selection: Option<SelectionInfo>,
    /// `by_prompt` (the seed's shards, listed in `shards`) or `shuffled` (training files,
    /// listed in `train`, and no shards).
    #[serde(default, skip_serializing_if = "is_by_prompt")]
    pub layout: LayoutName,
    /// The training files of the shuffled layout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train: Option<TrainInfo>,
    /// The forward pass's arithmetic: `f32`, or `bf16` (see `docs/engine.md`). Manifests
    /// written before it was recorded ran in f32.
    #[serde(default)]
    pub precision: crate::plan::Precision,
    /// The UID of the Kubernetes HarvestJob the harvest ran for, so that its cleanup deletes
    /// these files only for that job. Absent outside Kubernetes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_uid: Option<String>,
    /// Present for a job of conversations: what `roles_i` and `turns_i` hold, and each role id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub roles: Option<RolesInfo>,
    /// Present for a job that keeps the `router` site: the blocks and what the router tensors
    /// hold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router: Option<RouterInfo>,
}

/// One of the router's tensors of a prompt, `{prefix}_{i}` `[layers, rows, width]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouterPart {
    /// `router_ids`, `router_weights` or `router_logits`.
    pub prefix: &'static str,
    /// `int32` or `float32`: 4 bytes a value either way.
    pub dtype: &'static str,
    /// Values per row: `k`, or the experts for the logits.
    pub width: usize,
}

/// The expert choices of a job that keeps the `router` site, as the manifest documents them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouterInfo {
    /// The kept layers that are mixture-of-experts blocks, ascending: the first axis of every
    /// router tensor (the kept dense blocks have none).
    pub layer_indices: Vec<usize>,
    /// Routed experts per block: the range of the ids, and the last axis of `router_logits_i`.
    pub experts: usize,
    /// Experts each token goes to: the last axis of `router_ids_i` and `router_weights_i`.
    pub experts_per_token: usize,
    /// Whether `router_logits_i` is kept.
    pub logits: bool,
    /// The tensors, in words.
    pub tensors: String,
}

impl RouterInfo {
    /// The record of a job that keeps the router at `layer_indices` of a model with `experts`
    /// routed experts, `experts_per_token` per token.
    pub fn new(
        layer_indices: Vec<usize>,
        experts: usize,
        experts_per_token: usize,
        logits: bool,
    ) -> Self {
        let mut tensors = "router_ids_{i}: int32 [n_router_layers, n_tokens, experts_per_token], each token's experts in the order the router ranks them (highest sigmoid score plus expert bias first, the lower id first on a tie); router_weights_{i}: float32 of the same shape, each expert's gate weight, the factor its output is multiplied by (its sigmoid score normalised over the chosen experts, times route_scale). The layers are layer_indices here; the tokens are those of the activations, in the same order".to_owned();
        if logits {
            tensors.push_str("; router_logits_{i}: float32 [n_router_layers, n_tokens, experts], the router's logits before the sigmoid");
        }
        Self {
            layer_indices,
            experts,
            experts_per_token,
            logits,
            tensors,
        }
    }

    /// What a job with `options` on a model of `shape` records: none unless it keeps the
    /// router (and the model has routed experts).
    pub fn of_job(shape: &crate::ModelShape, options: &crate::JobOptions) -> Option<Self> {
        let (router, moe) = (options.sites.router()?, shape.moe?);
        Some(Self::new(
            shape.router_layers(&options.layers),
            moe.experts,
            moe.experts_per_token,
            router.logits(),
        ))
    }

    /// What the router keeps per token and layer, in the order every file holds it: tensor
    /// prefix, dtype and values (each 4 bytes): `router_ids` and `router_weights` of `k`,
    /// then `router_logits` of `experts` when kept.
    pub fn parts(&self) -> Vec<RouterPart> {
        let part = |prefix, dtype, width| RouterPart {
            prefix,
            dtype,
            width,
        };
        let k = self.experts_per_token;
        let mut all = vec![
            part("router_ids", "int32", k),
            part("router_weights", "float32", k),
        ];
        if self.logits {
            all.push(part("router_logits", "float32", self.experts));
        }
        all
    }

    /// The router's tensors of a training file of the shuffled layout, layer by layer and
    /// part by part ([`RouterInfo::parts`]): name (`router_ids.{layer}`), dtype, values per row.
    pub fn train_tensors(&self) -> Vec<(String, &'static str, usize)> {
        let parts = self.parts();
        self.layer_indices
            .iter()
            .flat_map(|layer| {
                let named =
                    move |p: &RouterPart| (format!("{}.{layer}", p.prefix), p.dtype, p.width);
                parts.iter().map(named).collect::<Vec<_>>()
            })
            .collect()
    }

    /// A prompt's router tensors with `rows` kept tokens: name prefix, dtype, shape.
    fn tensors_of(&self, i: usize, rows: usize) -> Vec<TensorEntry> {
        let layers = self.layer_indices.len();
        self.parts()
            .into_iter()
            .map(|p| TensorEntry {
                name: format!("{}_{i}", p.prefix),
                dtype: p.dtype.to_owned(),
                shape: vec![layers, rows, p.width],
            })
            .collect()
    }
}

/// The per-token roles of a job of conversations, as the manifest documents them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolesInfo {
    /// Each role id of `roles_i` (as a string, JSON's keys being strings) and its name.
    pub ids: std::collections::BTreeMap<String, String>,
    /// The tensors, in words.
    pub tensors: String,
}

impl RolesInfo {
    /// What every job of conversations records.
    pub fn of_conversations() -> Self {
        Self {
            ids: crate::chat::ROLE_NAMES
                .iter()
                .map(|&(id, name)| (id.to_string(), name.to_owned()))
                .collect(),
            tensors: "roles_{i}: uint8 [n_tokens], each token's role id (ids); a token of a message's content has the message's role, any other (the template's markup, BOS, the generation prompt) is template. turns_{i}: uint16 [n_tokens], the message each token belongs to, from 0 (markup before message k belongs to turn k; the generation prompt's turn is the message count). Both run beside tokens_{i}, over every token that ran".to_owned(),
        }
    }
}

impl Manifest {
    /// Every file of the finished harvest, relative to its output: the shards or training
    /// files, the statistics, `result.json`, and the manifest itself last.
    pub fn listed_files(&self) -> Vec<String> {
        let data = self.shards.iter().map(|s| s.file.clone());
        let train = self
            .train
            .iter()
            .flat_map(|t| t.files.iter().map(|f| f.file.clone()));
        let stats = self.stats_file.as_ref().map(|f| f.file.clone());
        data.chain(train)
            .chain(stats)
            .chain([RESULT_FILE.to_owned(), MANIFEST_FILE.to_owned()])
            .collect()
    }
}

/// The files to delete under `output` given its manifest (`None` when there is none), for
/// the job with UID `job_uid` (a HarvestJob's cleanup, `outputRetention: Delete`): the
/// manifest's own list, manifest last, or why none. A listed name that would climb out of
/// `output` (`..`, an absolute path) is left out.
pub fn files_to_delete(
    output: &str,
    manifest: Option<&[u8]>,
    job_uid: &str,
) -> Result<Vec<String>, String> {
    let Some(bytes) = manifest else {
        return Err(format!(
            "{output} holds no manifest, so no finished harvest of this job; nothing is deleted"
        ));
    };
    let manifest: Manifest = serde_json::from_slice(bytes).map_err(|e| {
        format!("the manifest under {output} cannot be read ({e}); nothing is deleted")
    })?;
    match manifest.job_uid.as_deref() {
        Some(uid) if uid == job_uid && !job_uid.is_empty() => Ok(manifest
            .listed_files()
            .into_iter()
            .filter(|file| {
                file.split('/')
                    .all(|segment| !matches!(segment, "" | "." | ".."))
            })
            .collect()),
        Some(other) => Err(format!(
            "the manifest under {output} was written for another job (UID {other}, this job is {job_uid}); nothing is deleted"
        )),
        None => Err(format!(
            "the manifest under {output} was not written by a HarvestJob (it names no job UID); nothing is deleted"
        )),
    }
}

/// The manifest's file name, at the top of a harvest's output.
pub const MANIFEST_FILE: &str = "manifest.json";

/// The run's summary beside the outputs (the worker protocol's `RunResult`).
pub const RESULT_FILE: &str = "result.json";

fn is_by_prompt(layout: &LayoutName) -> bool {
    *layout == LayoutName::ByPrompt
}

/// The shuffled layout's files, as the manifest records them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainInfo {
    /// The permutation's seed.
    pub seed: u64,
    /// Rows per file (the last may hold fewer).
    pub rows_per_file: usize,
    /// Rows over every file: each kept token once.
    pub rows: u64,
    /// The tensors of every file: `{site}.{layer}` `[rows, width]` in the manifest's dtype,
    /// then `index`, int32 `[rows, 2]`, each row's (prompt, position); then `roles` for
    /// conversations and the router's (`router.train_tensors`) when kept.
    pub tensors: Vec<String>,
    /// Every file, in order.
    pub files: Vec<TrainFile>,
}

/// One training file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainFile {
    /// File name, relative to the manifest.
    pub file: String,
    /// Its rows.
    pub rows: usize,
    /// Its size.
    pub bytes: u64,
    /// Hex sha256 of the file.
    pub sha256: String,
}

/// A job's token selection, as the manifest records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SelectionInfo {
    /// The rules, as the job gave them.
    pub rules: TokenSelection,
    /// The block whose `resid_post` norms the norm filter read (the deepest kept), if it ran.
    pub norm_layer: Option<usize>,
    /// Tokens kept, over all prompts: the token axis of every activation tensor.
    pub kept_tokens: u64,
    /// Tokens dropped, by the first filter that dropped each.
    pub dropped: Dropped,
}

/// One kept hook site, as the manifest lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SiteInfo {
    /// `resid_pre`, `attn_out`, `resid_mid`, `mlp_out` or `resid_post`.
    pub site: Site,
    /// Its per-prompt tensors are `{tensor_prefix}_{i}` (`prompt_i` for `resid_post`).
    pub tensor_prefix: String,
    /// Its mean and std in `stats.safetensors`.
    pub stats_mean: String,
    /// See `stats_mean`.
    pub stats_std: String,
    /// Per kept layer, the mean L2 norm of its captured vectors.
    pub mean_token_norm: Vec<f64>,
}

impl SiteInfo {
    /// The manifest entry of `site`, with its per-layer mean norms.
    pub fn new(site: Site, mean_token_norm: Vec<f64>) -> Self {
        let (mean, std) = stats_names(site);
        Self {
            site,
            tensor_prefix: site.tensor_prefix().to_owned(),
            stats_mean: mean,
            stats_std: std,
            mean_token_norm,
        }
    }
}

/// The names of `site`'s mean and std in `stats.safetensors`: `mean` and `std` for `resid_post`
/// (the seed's names), `{site}_mean` and `{site}_std` for the others.
pub fn stats_names(site: Site) -> (String, String) {
    match site {
        Site::ResidPost => ("mean".into(), "std".into()),
        other => (format!("{other}_mean"), format!("{other}_std")),
    }
}

/// A file's name, size and sha256, as the manifest records them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileDigest {
    /// File name, relative to the manifest.
    pub file: String,
    /// Its size.
    pub bytes: u64,
    /// Lowercase hex sha256 of its bytes.
    pub sha256: String,
}

/// The model, as recorded in the manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelInfo {
    /// The name the job used.
    pub name: String,
    /// Hugging Face architecture class.
    pub architecture: String,
    /// Decoder blocks in the model.
    pub num_layers: usize,
    /// Residual-stream width.
    pub hidden_size: usize,
}

/// Tokenization, as recorded in the manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizerInfo {
    /// Whether the tokenizer's special tokens were added.
    pub add_special_tokens: bool,
    /// The BOS id, if the tokenizer has one.
    pub bos_token_id: Option<u32>,
    /// How BOS was treated, in words.
    pub bos: String,
    /// The most tokens of a prompt that ran: the context window, or the job's
    /// `max_prompt_tokens` when smaller.
    pub max_tokens: usize,
}

/// One shard file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardEntry {
    /// File name, relative to the manifest.
    pub file: String,
    /// Global index of its first prompt.
    pub first_prompt: usize,
    /// Tokens of each of its prompts, in order.
    pub token_counts: Vec<usize>,
    /// Tokens kept of each of its prompts, when the job selected tokens.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kept_counts: Vec<usize>,
    /// Global index of each of its prompts, in order (`first_prompt` onwards).
    #[serde(default)]
    pub prompts: Vec<usize>,
    /// Every tensor it holds, in prompt order: each site's tensor in block order (`prompt_i`
    /// for `resid_post`), then `tokens_i`, then `roles_i` and `turns_i` for conversations,
    /// then `positions_i` when the job selected tokens, then the router's tensors when kept.
    #[serde(default)]
    pub tensors: Vec<TensorEntry>,
    /// File size.
    pub bytes: u64,
    /// Hex sha256 of the file.
    pub sha256: String,
}

/// One tensor of a shard, as the manifest lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorEntry {
    /// Its name in the shard (`prompt_7`, `attn_out_7`, `tokens_7`).
    pub name: String,
    /// `bfloat16`, `float32`, `int32`, `uint8` or `uint16`.
    pub dtype: String,
    /// Its shape.
    pub shape: Vec<usize>,
}

impl ShardEntry {
    /// The prompt indices and tensors of a shard whose first prompt is `first_prompt` and whose
    /// prompts have `token_counts` tokens, each site's tensor holding `layers` kept layers of
    /// `width` values per token.
    /// With `kept_counts` (a job that selects tokens), the activations hold that many tokens
    /// and `positions_i` lists them; `conversations` adds `roles_i` and `turns_i`, `router`
    /// the router's tensors.
    pub fn contents_of(
        first_prompt: usize,
        token_counts: &[usize],
        kept_counts: Option<&[usize]>,
        (contents, sites): (Contents, &Sites),
        (layers, width): (usize, usize),
        (conversations, router): (bool, Option<&RouterInfo>),
    ) -> (Vec<usize>, Vec<TensorEntry>) {
        let prompts: Vec<usize> = (first_prompt..first_prompt + token_counts.len()).collect();
        let mut tensors = Vec::with_capacity(prompts.len() * (sites.len() + 4));
        for (n, (&i, &tokens)) in prompts.iter().zip(token_counts).enumerate() {
            let kept = kept_counts.map(|k| k.get(n).copied().unwrap_or(0));
            let rows = kept.unwrap_or(tokens);
            tensors.extend(sites.as_slice().iter().map(|site| TensorEntry {
                name: format!("{}_{i}", site.tensor_prefix()),
                dtype: contents.dtype().to_owned(),
                shape: vec![layers, rows, width],
            }));
            tensors.push(TensorEntry {
                name: format!("tokens_{i}"),
                dtype: "int32".to_owned(),
                shape: vec![tokens],
            });
            if conversations {
                for (name, dtype) in [("roles", "uint8"), ("turns", "uint16")] {
                    tensors.push(TensorEntry {
                        name: format!("{name}_{i}"),
                        dtype: dtype.to_owned(),
                        shape: vec![tokens],
                    });
                }
            }
            if let Some(kept) = kept {
                tensors.push(TensorEntry {
                    name: format!("positions_{i}"),
                    dtype: "int32".to_owned(),
                    shape: vec![kept],
                });
            }
            tensors.extend(router.iter().flat_map(|r| r.tensors_of(i, rows)));
        }
        (prompts, tensors)
    }
}

/// A prompt cut to the context window.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Truncation {
    /// Global prompt index.
    pub prompt: usize,
    /// Tokens before the cut.
    pub original_tokens: usize,
    /// Tokens kept.
    pub kept_tokens: usize,
}

/// Projection settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProjectionInfo {
    /// Number of directions: the last axis of every `prompt_i`.
    pub n_directions: usize,
    /// Always true: directions are L2-normalised before projecting.
    pub normalized: bool,
}

/// The `statistics` sentence of the manifest: the seed's, plus where each other site's
/// statistics are when a job keeps any.
pub fn statistics_description(contents: Contents, sites: &Sites) -> String {
    let base = contents.statistics();
    if sites.is_default() {
        return base.to_owned();
    }
    format!(
        "{base}. Every kept hook site has its own mean and std (named in sites[].stats_mean and sites[].stats_std) and its own sites[].mean_token_norm; the top-level mean and mean_token_norm are resid_post's, empty when resid_post is not kept"
    )
}

/// The BOS sentence of the manifest.
pub fn bos_treatment(add_special_tokens: bool, bos_token_id: Option<u32>) -> String {
    match (add_special_tokens, bos_token_id) {
        (_, None) => "the tokenizer has no BOS token; nothing is left out of the statistics".into(),
        (true, Some(id)) => format!(
            "add_special_tokens was true, so the tokenizer's post-processor decided whether to prepend BOS (id {id}); a prompt whose first id is BOS has that token left out of the statistics (it stays in the shards)"
        ),
        (false, Some(id)) => format!(
            "add_special_tokens was false: the text was tokenized verbatim; a prompt whose text began with BOS (id {id}) has that token left out of the statistics (it stays in the shards)"
        ),
    }
}

/// The `tensors` sentence of the manifest: the seed's, plus a sentence on the other sites when
/// a job keeps any.
pub fn tensors_description(contents: Contents, sites: &Sites) -> String {
    let base = seed_tensors_description(contents);
    let others: Vec<&str> = sites
        .as_slice()
        .iter()
        .filter(|&&s| s != Site::ResidPost)
        .map(|s| s.as_str())
        .collect();
    if others.is_empty() {
        return base.to_owned();
    }
    let kept = if sites.contains(Site::ResidPost) {
        "prompt_{i} is the resid_post site"
    } else {
        "resid_post was not kept, so there is no prompt_{i}"
    };
    format!(
        "{base}. Other hook sites ({}) have tensors {{site}}_{{i}} of the same shape and dtype; {kept}",
        others.join(", ")
    )
}

fn seed_tensors_description(contents: Contents) -> &'static str {
    match contents {
        Contents::Activations => {
            "prompt_{i}: bfloat16 [n_layers, n_tokens, hidden], the layers of layer_indices in order; tokens_{i}: int32 [n_tokens], the ids that ran, in the order of the token axis; i is the global prompt index"
        }
        Contents::Projections => {
            "prompt_{i}: float32 [n_layers, n_tokens, n_directions], projections onto the unit directions; tokens_{i}: int32 [n_tokens], the ids that ran, in the order of the token axis; i is the global prompt index"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shard_entry_lists_its_prompts_and_the_shape_of_each_tensor() {
        let (prompts, tensors) = ShardEntry::contents_of(
            4,
            &[3, 5],
            None,
            (Contents::Projections, &Sites::default()),
            (2, 8),
            (false, None),
        );
        assert_eq!(prompts, [4, 5]);
        let listed: Vec<(&str, &str, &[usize])> = tensors
            .iter()
            .map(|t| (t.name.as_str(), t.dtype.as_str(), t.shape.as_slice()))
            .collect();
        assert_eq!(
            listed,
            [
                ("prompt_4", "float32", &[2, 3, 8][..]),
                ("tokens_4", "int32", &[3][..]),
                ("prompt_5", "float32", &[2, 5, 8][..]),
                ("tokens_5", "int32", &[5][..]),
            ]
        );
        let router = RouterInfo::new(vec![3], 16, 4, true);
        let (_, tensors) = ShardEntry::contents_of(
            0,
            &[3],
            Some(&[2]),
            (Contents::Activations, &Sites::default()),
            (2, 8),
            (true, Some(&router)),
        );
        let listed: Vec<(&str, &str, &[usize])> = tensors
            .iter()
            .map(|t| (t.name.as_str(), t.dtype.as_str(), t.shape.as_slice()))
            .collect();
        assert_eq!(
            listed,
            [
                ("prompt_0", "bfloat16", &[2, 2, 8][..]),
                ("tokens_0", "int32", &[3][..]),
                ("roles_0", "uint8", &[3][..]),
                ("turns_0", "uint16", &[3][..]),
                ("positions_0", "int32", &[2][..]),
                ("router_ids_0", "int32", &[1, 2, 4][..]),
                ("router_weights_0", "float32", &[1, 2, 4][..]),
                ("router_logits_0", "float32", &[1, 2, 16][..]),
            ]
        );
    }
}
