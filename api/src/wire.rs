//! The wire contract of `/v1/harvest`: request bodies parsed strictly, validated once against
//! the model's catalogue entry into a [`Submission`], and the job as it is answered.

use std::num::NonZeroUsize;

use base64::Engine;
use harvest_core::chat::{ChatTemplate, Conversation, Message, Span};
use harvest_core::clock::UnixMillis;
use harvest_core::layout::LayoutName;
use harvest_core::lifecycle::JobStatus;
use harvest_core::options::{DEFAULT_SHARD_SIZE, JobOptions, RawOptions};
use harvest_core::plan::MAX_PROMPTS;
use harvest_core::plan::Precision;
use harvest_core::quota::Lane;
use harvest_core::selection::{RawSelection, TokenSelection};
use harvest_core::worker::RunResult;
use harvest_core::{LayerSelection, ServedModel, Sites};
use serde::{Deserialize, Serialize};

use crate::error::ApiError;

pub use harvest_core::options::{MAX_PROMPT_TOKENS, MAX_SHARD_SIZE};
pub use harvest_core::plan::MAX_DIRECTIONS;
/// Largest accepted `batch_size` hint.
pub const MAX_BATCH_SIZE: usize = 4096;

/// `POST /v1/harvest` as sent. Unknown fields are rejected by name.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HarvestRequest {
    /// A model name from the catalogue.
    pub model: String,
    /// 1 to 4,096 prompts (or, instead, `conversations`).
    #[serde(default)]
    pub prompts: Option<Vec<String>>,
    /// Our extension, instead of `prompts`: 1 to 4,096 conversations, each a list of messages
    /// `{"role": "system" | "user" | "assistant" | "tool", "content": "..."}`, rendered by the
    /// model's own chat template and tokenized as transformers' `apply_chat_template` does,
    /// with one BOS. A model without a chat template refuses them.
    #[serde(default)]
    #[schema(value_type = Option<Vec<Vec<Object>>>, example = json!([[{"role": "user", "content": "What is a residual stream?"}, {"role": "assistant", "content": "The sum every block reads and writes."}]]))]
    pub conversations: Option<Vec<Vec<Message>>>,
    /// Our extension: with `conversations`, end each with the template's opening of the
    /// assistant's next turn (default false).
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    /// A list of block indices, `"all"`, or omitted for the quartile default.
    #[serde(default)]
    #[schema(value_type = Option<Object>, example = json!([8, 16, 24]))]
    pub layers: LayerSelection,
    /// Our extension: the hook sites kept of each kept layer, any of `resid_pre`, `attn_out`,
    /// `resid_mid`, `mlp_out` and `resid_post` (the default, alone). `resid_post` stays
    /// `prompt_i`; every other site is `<site>_i`, of the same shape. For a mixture-of-experts
    /// model, `router` adds each kept token's top-k expert ids and gate weights at each kept
    /// sparse layer (`router_ids_i`, `router_weights_i`), and `router_logits` the router's
    /// logits too (`router_logits_i`); either goes beside an activation site.
    #[serde(default)]
    #[schema(example = json!(["attn_out", "mlp_out", "resid_post"]))]
    pub sites: Option<Vec<String>>,
    /// Prompts per shard.
    #[serde(default)]
    pub shard_size: Option<usize>,
    /// A batching hint; validated, then left to the engine.
    #[serde(default)]
    pub batch_size: Option<usize>,
    /// Whether the tokenizer adds its special tokens.
    #[serde(default)]
    pub add_special_tokens: Option<bool>,
    /// Directions to project onto instead of returning raw activations.
    #[serde(default)]
    pub project_onto: Option<ProjectOnto>,
    /// Our extension: drop every token the tokenizer marks special (`tokens_i` still lists
    /// them; `positions_i` lists the kept positions).
    #[serde(default)]
    pub exclude_special_tokens: Option<bool>,
    /// Our extension: keep positions `[start, end)` of each prompt.
    #[serde(default)]
    #[schema(example = json!([1, 512]))]
    pub positions: Option<Vec<u64>>,
    /// Our extension, for `conversations`: keep only the tokens of these roles, any of
    /// `template` (the chat template's own markup and BOS), `system`, `user`, `assistant` and
    /// `tool`. Every token's role is in `roles_i` and its message in `turns_i` either way.
    #[serde(default)]
    #[schema(example = json!(["assistant"]))]
    pub roles: Option<Vec<String>>,
    /// Our extension: keep each token with this probability, in (0, 1], decided by a hash of
    /// `seed`, the prompt and the position (the same in every run).
    #[serde(default)]
    pub sample_rate: Option<f64>,
    /// Our extension: the seed of `sample_rate` (default 0).
    #[serde(default)]
    pub seed: Option<u64>,
    /// Our extension: drop tokens whose `resid_post` norm at the deepest kept layer exceeds
    /// this multiple of the running median (above 1); the manifest counts them.
    #[serde(default)]
    pub max_norm_multiple: Option<f64>,
    /// Our extension: `by_prompt` (the seed's shards, the default) or `shuffled`: training
    /// files `train_NNNNN.safetensors` of `rows_per_file` rows, permuted over the whole job with
    /// `seed`.
    #[serde(default)]
    pub layout: Option<String>,
    /// Our extension: rows per training file of the shuffled layout (default 65,536, at most
    /// 2^24).
    #[serde(default)]
    pub rows_per_file: Option<usize>,
    /// Our extension: the engine's arithmetic, `f32` or `bf16` (bf16 product inputs, f32
    /// accumulation; about twice as fast on CPUs with AVX512-BF16). Omitted: the device's own,
    /// f32 on a CPU and bf16 on a GPU; the manifest records what ran.
    #[serde(default)]
    pub precision: Option<String>,
    /// Our extension: validate and count, then answer what the job would be (`DryRun`), with
    /// no job made and no quota used.
    #[serde(default)]
    pub dry_run: Option<bool>,
    /// Our extension: cut each prompt to its first N tokens (special tokens included) before
    /// the forward pass, 1 to 1,048,576; the manifest lists each cut prompt under
    /// `truncated_prompts`. The model's context window cuts it in any case.
    #[serde(default)]
    pub max_prompt_tokens: Option<usize>,
    /// Our extension: run the job as this many harvester processes at once, each on its own
    /// share of the shards (1, the default, to 16, at most the job's shards and the model's
    /// cap); the files are byte for byte those of one process. On Kubernetes, one worker Pod
    /// per part, then a finalize Pod.
    #[serde(default)]
    pub parallelism: Option<usize>,
}

/// Most harvester processes one job may run at once.
pub const MAX_PARALLELISM: usize = 16;

/// Projection directions as sent: a raw little-endian buffer in base64.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ProjectOnto {
    /// Base64 of the raw buffer.
    pub data: String,
    /// `float32`, `float16` or `bfloat16`.
    pub dtype: String,
    /// `[n_directions, hidden]`.
    pub shape: Vec<usize>,
    /// Only `"none"`.
    #[serde(default = "no_compression")]
    pub compression: String,
}

fn no_compression() -> String {
    "none".into()
}

/// A validated submission.
#[derive(Debug, Clone, PartialEq)]
pub struct Submission {
    /// The model's catalogue name.
    pub model: String,
    /// The prompts, or each conversation as its chat template renders it (what is counted).
    pub prompts: Vec<String>,
    /// The conversations, where the job is of conversations: what the worker is handed.
    pub conversations: Option<Vec<Conversation>>,
    /// Each conversation's spans of `prompts` (which bytes are which message's), where the job
    /// is of conversations: what counting by `roles` reads.
    pub spans: Option<Vec<Vec<Span>>>,
    /// What the job keeps and how it is cut, layers resolved.
    pub options: JobOptions,
    /// Directions as f32, `[n, hidden]` row-major, not yet normalised.
    pub directions: Option<(usize, Vec<f32>)>,
    /// Each prompt's UTF-8 bytes plus one for its start token, at most `max_prompt_tokens`.
    pub reserved_tokens: u64,
    /// The model's lane.
    pub lane: Lane,
    /// Harvester processes to run the job in.
    pub parallelism: usize,
}

impl Submission {
    /// The inputs file the worker is handed: the prompts, or the conversations, which it
    /// renders with the model's chat template as the count did.
    pub fn inputs_jsonl(&self) -> String {
        match &self.conversations {
            Some(conversations) => harvest_core::worker::write_conversations_jsonl(conversations),
            None => harvest_core::worker::write_prompts_jsonl(&self.prompts),
        }
    }
}

impl HarvestRequest {
    /// Validates the request against the model's catalogue entry, rendering its conversations
    /// with `chat`, the model's template (or why it has none).
    pub fn validate(
        self,
        model: &ServedModel,
        chat: Result<&ChatTemplate, &str>,
    ) -> Result<Submission, ApiError> {
        let Self {
            model: name,
            prompts,
            conversations,
            add_generation_prompt,
            layers,
            sites,
            shard_size,
            batch_size,
            add_special_tokens,
            project_onto,
            exclude_special_tokens,
            positions,
            roles,
            sample_rate,
            seed,
            max_norm_multiple,
            layout,
            rows_per_file,
            precision,
            dry_run: _,
            parallelism,
            max_prompt_tokens,
        } = self;
        let (prompts, conversations, spans) = inputs(
            prompts,
            conversations,
            (add_generation_prompt, add_special_tokens),
            chat,
        )?;
        check_sizes(prompts.len(), batch_size)?;
        let directions = project_onto
            .map(|p| p.decode(model.shape.hidden_size))
            .transpose()?;
        let invalid = |e: &dyn std::fmt::Display| ApiError::invalid(e.to_string());
        let options = RawOptions {
            layers,
            sites: sites
                .map_or(Ok(Sites::default()), |names| Sites::parse(&names))
                .map_err(|e| invalid(&e))?,
            selection: RawSelection {
                exclude_special_tokens,
                positions,
                roles,
                sample_rate,
                seed,
                max_norm_multiple,
            },
            layout: parsed::<LayoutName>(layout)?.unwrap_or(LayoutName::ByPrompt),
            rows_per_file,
            precision: parsed::<Precision>(precision)?,
            shard_size: shard_size.unwrap_or(DEFAULT_SHARD_SIZE),
            add_special_tokens: add_special_tokens.unwrap_or(true),
            max_prompt_tokens,
        }
        .validate(directions.is_some())
        .map_err(|e| invalid(&e))?;
        let options = options.resolve_served(model).map_err(|e| invalid(&e))?;
        check_roles(conversations.is_some(), &options.selection)?;
        let reserved_tokens = reserved_tokens(&prompts, &options);
        let shards = prompts.len().div_ceil(options.shard_size.get());
        let parallelism = check_parallelism(parallelism, shards, &options.selection)?;
        Ok(Submission {
            model: name,
            prompts,
            conversations,
            spans,
            options,
            directions,
            reserved_tokens,
            lane: model.lane,
            parallelism,
        })
    }
}

/// The prompt count and the `batch_size` hint, each within its bounds.
fn check_sizes(prompts: usize, batch_size: Option<usize>) -> Result<(), ApiError> {
    check_prompt_count(prompts)?;
    if let Some(batch) = batch_size {
        bounded("batch_size", batch, MAX_BATCH_SIZE)?;
    }
    Ok(())
}

/// A named value (`layout`, `precision`) parsed, or the 400 that names it.
fn parsed<T: std::str::FromStr>(value: Option<String>) -> Result<Option<T>, ApiError>
where
    T::Err: std::fmt::Display,
{
    value
        .as_deref()
        .map(str::parse::<T>)
        .transpose()
        .map_err(|e| ApiError::invalid(e.to_string()))
}

/// `roles` selects among a conversation's tokens: plain prompts have none.
fn check_roles(conversations: bool, selection: &TokenSelection) -> Result<(), ApiError> {
    if conversations || selection.roles.is_none() {
        return Ok(());
    }
    Err(ApiError::invalid(
        "roles keeps the tokens of some roles of a conversation, and this job sends prompts: send conversations instead, or leave roles out",
    ))
}

/// What the job reserves before its count: each prompt's bytes plus one for its start token,
/// at most `max_prompt_tokens`.
fn reserved_tokens(prompts: &[String], options: &JobOptions) -> u64 {
    let per_prompt_cap = options
        .max_prompt_tokens
        .map_or(u64::MAX, |n| n.get() as u64);
    prompts
        .iter()
        .map(|p| (p.len() as u64 + 1).min(per_prompt_cap))
        .sum()
}

/// The job's inputs: its prompts, or its conversations with each rendered by `chat` (what is
/// counted) and its spans (whose bytes are whose), refusing both or neither, a conversation
/// without messages, options that apply to the other kind, and conversations for a model
/// without a template.
#[allow(clippy::type_complexity)]
fn inputs(
    prompts: Option<Vec<String>>,
    conversations: Option<Vec<Vec<Message>>>,
    (add_generation_prompt, add_special_tokens): (Option<bool>, Option<bool>),
    chat: Result<&ChatTemplate, &str>,
) -> Result<
    (
        Vec<String>,
        Option<Vec<Conversation>>,
        Option<Vec<Vec<Span>>>,
    ),
    ApiError,
> {
    let conversations = match (prompts, conversations) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "send prompts or conversations, not both: one job holds one kind",
            ));
        }
        (None, None) => {
            return Err(ApiError::invalid(
                "prompts is missing: send 1 to 4096 prompts (or, our extension, conversations)",
            ));
        }
        (Some(prompts), None) => {
            if add_generation_prompt.is_some() {
                return Err(ApiError::invalid(
                    "add_generation_prompt applies to conversations: leave it out with prompts",
                ));
            }
            return Ok((prompts, None, None));
        }
        (None, Some(conversations)) => conversations,
    };
    if add_special_tokens == Some(false) {
        return Err(ApiError::invalid(
            "add_special_tokens: false applies to prompts; a conversation's special tokens are its chat template's, with one BOS: leave add_special_tokens out with conversations",
        ));
    }
    check_prompt_count(conversations.len())?;
    let template = chat.map_err(ApiError::invalid)?;
    let conversations: Vec<Conversation> = conversations
        .into_iter()
        .map(|messages| Conversation {
            messages,
            add_generation_prompt: add_generation_prompt.unwrap_or(false),
        })
        .collect();
    let (rendered, spans) = conversations
        .iter()
        .enumerate()
        .map(|(index, conversation)| {
            template
                .spans(index, conversation)
                .map_err(|e| ApiError::invalid(e.to_string()))
        })
        .collect::<Result<(Vec<_>, Vec<_>), _>>()?;
    Ok((rendered, Some(conversations), Some(spans)))
}

/// The processes a job runs in: 1 to [`MAX_PARALLELISM`], at most its `shards`, and 1 with the
/// norm filter (its running median spans the corpus in order).
fn check_parallelism(
    parallelism: Option<usize>,
    shards: usize,
    selection: &TokenSelection,
) -> Result<usize, ApiError> {
    let Some(wanted) = parallelism else {
        return Ok(1);
    };
    let wanted = bounded("parallelism", wanted, MAX_PARALLELISM)?.get();
    if wanted > shards {
        return Err(ApiError::invalid(format!(
            "parallelism {wanted} is more than the job's {shards} shards: use at most {shards}, or a smaller shard_size"
        )));
    }
    if wanted > 1 && selection.max_norm_multiple.is_some() {
        return Err(ApiError::invalid(
            "parallelism above 1 cannot be combined with max_norm_multiple, whose running median spans the corpus in order: drop one of them",
        ));
    }
    Ok(wanted)
}

/// 1 to [`MAX_PROMPTS`] prompts, or the error that says what to do.
fn check_prompt_count(count: usize) -> Result<(), ApiError> {
    if count == 0 {
        return Err(ApiError::invalid(
            "prompts is empty: send between 1 and 4096 prompts",
        ));
    }
    if count > MAX_PROMPTS {
        return Err(ApiError::TooLarge {
            message: format!(
                "{count} prompts is more than the {MAX_PROMPTS} a job may hold: split the corpus into several jobs"
            ),
        });
    }
    Ok(())
}

fn bounded(field: &str, value: usize, max: usize) -> Result<NonZeroUsize, ApiError> {
    NonZeroUsize::new(value)
        .filter(|v| v.get() <= max)
        .ok_or_else(|| {
            ApiError::invalid(format!("{field} must be between 1 and {max}, got {value}"))
        })
}

impl ProjectOnto {
    /// Decodes and checks the buffer: dtype, shape, hidden size, exact byte count, finite values.
    pub fn decode(&self, hidden: usize) -> Result<(usize, Vec<f32>), ApiError> {
        if self.compression != "none" {
            return Err(ApiError::invalid(format!(
                "project_onto.compression {:?} is not supported: send the raw buffer with \"none\"",
                self.compression
            )));
        }
        let itemsize = match self.dtype.as_str() {
            "float32" => 4,
            "float16" | "bfloat16" => 2,
            other => {
                return Err(ApiError::invalid(format!(
                    "project_onto.dtype {other:?} is not supported: use float32, float16 or bfloat16"
                )));
            }
        };
        let &[n, width] = self.shape.as_slice() else {
            return Err(ApiError::invalid(format!(
                "project_onto.shape {:?} must be [n_directions, hidden]",
                self.shape
            )));
        };
        if n == 0 || n > MAX_DIRECTIONS {
            return Err(ApiError::invalid(format!(
                "project_onto has {n} directions: send between 1 and {MAX_DIRECTIONS}"
            )));
        }
        if width != hidden {
            return Err(ApiError::invalid(format!(
                "project_onto.shape has hidden size {width}, but this model's hidden size is {hidden}"
            )));
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(self.data.as_bytes())
            .map_err(|e| {
                ApiError::invalid(format!("project_onto.data is not valid base64: {e}"))
            })?;
        let expected = n * width * itemsize;
        if bytes.len() != expected {
            return Err(ApiError::invalid(format!(
                "project_onto.data holds {} bytes, but shape [{n}, {width}] of {} needs exactly {expected} bytes",
                bytes.len(),
                self.dtype
            )));
        }
        let values: Vec<f32> = match itemsize {
            4 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            _ if self.dtype == "float16" => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            _ => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        };
        for (row, chunk) in values.chunks_exact(width).enumerate() {
            if let Some(col) = chunk.iter().position(|v| !v.is_finite()) {
                return Err(ApiError::invalid(format!(
                    "project_onto direction {row} has a non-finite value at index {col}"
                )));
            }
            if chunk.iter().all(|&v| v == 0.0) {
                return Err(ApiError::invalid(format!(
                    "project_onto direction {row} is all zeros"
                )));
            }
        }
        Ok((n, values))
    }
}

/// Whether `id` matches the job id pattern of the reference: a UUID of versions 1 to 8 with the
/// RFC 4122 variant, or the nil or max UUID.
pub fn is_valid_job_id(id: &str) -> bool {
    let bytes = id.as_bytes();
    if bytes.len() != 36 {
        return false;
    }
    let hex_groups = [0..8, 9..13, 14..18, 19..23, 24..36];
    let dashes_ok = [8, 13, 18, 23].iter().all(|&i| bytes[i] == b'-');
    let hex_ok = hex_groups
        .iter()
        .all(|r| bytes[r.clone()].iter().all(u8::is_ascii_hexdigit));
    if !dashes_ok || !hex_ok {
        return false;
    }
    let lower = id.to_ascii_lowercase();
    if lower == "00000000-0000-0000-0000-000000000000"
        || lower == "ffffffff-ffff-ffff-ffff-ffffffffffff"
    {
        return true;
    }
    matches!(bytes[14], b'1'..=b'8') && matches!(bytes[19], b'8' | b'9' | b'a' | b'b' | b'A' | b'B')
}

/// Per-stage seconds of a finished job, as the reference reports them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ResultTimings {
    /// Model loading.
    pub load_s: f64,
    /// Forward passes.
    pub forward_s: f64,
    /// Assembling and writing.
    pub save_s: f64,
    /// Storing.
    pub upload_s: f64,
}

/// The files of a done job, with links valid until `urls_expire_at`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct JobResult {
    /// Shards (training files for the shuffled layout).
    pub n_shards: usize,
    /// Our extension: `shuffled` when the files are training files (absent for shards).
    #[serde(default, skip_serializing_if = "is_by_prompt")]
    #[schema(value_type = Option<String>)]
    pub layout: LayoutName,
    /// Kept layers, ascending.
    pub layer_indices: Vec<usize>,
    /// Link to manifest.json.
    pub manifest_url: String,
    /// Links to the shards, in order.
    pub shard_urls: Vec<String>,
    /// Link to stats.safetensors.
    pub stats_url: String,
    /// `activations` or `projections`.
    pub contents: String,
    /// Tokens run.
    pub tokens: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Per-stage seconds.
    pub timings: ResultTimings,
}

impl JobResult {
    /// A worker's result, less the links (made fresh on every answer).
    pub fn from_run(run: &RunResult) -> Self {
        let timings = &run.timings;
        Self {
            n_shards: run.n_shards,
            layout: run.layout,
            layer_indices: run.layer_indices.clone(),
            manifest_url: String::new(),
            shard_urls: Vec::new(),
            stats_url: String::new(),
            contents: run.contents.as_str().to_owned(),
            tokens: run.tokens,
            bytes_written: run.bytes_written,
            timings: ResultTimings {
                load_s: timings.load_s,
                forward_s: timings.forward_s,
                save_s: timings.save_s,
                upload_s: timings.upload_s,
            },
        }
    }
}

/// Progress of a running job, from its worker.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Progress {
    /// `loading` while the worker reads the model's weights, then `running`.
    #[serde(default = "running")]
    #[schema(example = "running")]
    pub phase: String,
    /// Weight bytes read so far, while loading.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_loaded: Option<u64>,
    /// Weight bytes to read, while loading.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_total: Option<u64>,
    /// Prompts done.
    pub prompts_done: usize,
    /// Prompts in the job.
    pub prompts_total: usize,
    /// Tokens run so far.
    pub tokens_done: u64,
}

/// The phase of progress recorded before phases were (and of workers that do not say).
fn running() -> String {
    harvest_core::worker::Phase::Running.as_str().to_owned()
}

impl From<&harvest_core::worker::ProgressEvent> for Progress {
    fn from(event: &harvest_core::worker::ProgressEvent) -> Self {
        Self {
            phase: event.phase.as_str().to_owned(),
            bytes_loaded: event.bytes_loaded,
            bytes_total: event.bytes_total,
            prompts_done: event.prompts_done,
            prompts_total: event.prompts_total,
            tokens_done: event.tokens_done,
        }
    }
}

/// A job as `GET`, `POST` and `DELETE` answer it.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct JobView {
    /// The job's id.
    pub job_id: String,
    /// The id of its run.
    pub run_id: String,
    /// pending, running, done, failed or cancelled.
    #[schema(value_type = String, example = "pending")]
    pub status: JobStatus,
    /// The model's catalogue name.
    pub model: String,
    /// Prompts in the job.
    pub n_prompts: usize,
    /// Tokens held against the budget.
    pub reserved_tokens: u64,
    /// Kept layers, ascending.
    pub layers: Vec<usize>,
    /// Our extension: the kept hook sites, present when they are not `resid_post` alone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sites: Option<Vec<String>>,
    /// Tokens charged; null until the job ends.
    pub tokens: Option<u64>,
    /// ISO 8601 UTC with milliseconds.
    pub created_at: String,
    /// When its run started; null until then.
    pub started_at: Option<String>,
    /// When it ended; null until then.
    pub completed_at: Option<String>,
    /// The files, for a done job whose files are kept.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<JobResult>,
    /// When the links of `result` expire.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub urls_expire_at: Option<String>,
    /// Present once the files of a done job are gone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub urls_expired: Option<bool>,
    /// Why it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Progress of a running job.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub progress: Option<Progress>,
    /// Its predicted output (our extension), when it was made at submit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub estimate: Option<Estimate>,
    /// Our extension, with `?partial=true` on a pending or running job: the shards that are
    /// finished and will not change, with links, in shard order.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ready_shard_urls: Option<Vec<ReadyShardUrl>>,
    /// Our extension, beside `ready_shard_urls`: what a reader needs before the manifest.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub partial: Option<PartialInfo>,
}

/// A finished shard of a running job (our extension): it is byte for byte the file of that
/// name the done job lists.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ReadyShardUrl {
    /// Its file name (`shard_NNNNN.safetensors`).
    pub file: String,
    /// A link to it, valid until `urls_expire_at`.
    pub url: String,
    /// Its first and last prompt, inclusive.
    pub prompts: [usize; 2],
    /// Its size.
    pub bytes: u64,
    /// Its hex sha256.
    pub sha256: String,
}

/// What `?partial=true` says besides the links (our extension).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PartialInfo {
    /// Shards the job will have; null for the shuffled layout.
    pub shards_total: Option<usize>,
    /// The tokenizer's BOS id, for dropping each prompt's leading BOS as the statistics do;
    /// null until a shard is ready, or for a model without one.
    pub bos_token_id: Option<u32>,
    /// Why no shard can be ready before the job ends, when none can.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unavailable: Option<String>,
}

/// A job's predicted output (our extension): its files' bytes, and how long it should take
/// from the last measured throughput of its model (null before any job of it ran).
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Estimate {
    /// Bytes of its shards, statistics and manifest.
    pub bytes: u64,
    /// Seconds from start to end.
    pub seconds: Option<f64>,
}

/// Predicted shard files.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ShardFiles {
    /// How many.
    pub count: usize,
    /// Their bytes together.
    pub bytes: u64,
}

/// Predicted bytes per file kind.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct FileSizes {
    /// The shards.
    pub shards: ShardFiles,
    /// `stats.safetensors`.
    pub stats_bytes: u64,
    /// `manifest.json`.
    pub manifest_bytes: u64,
}

/// `POST /v1/harvest` with `"dry_run": true` (our extension): what the job would be. Nothing
/// is created and no quota is used.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct DryRun {
    /// Always true.
    pub dry_run: bool,
    /// The model's catalogue name.
    pub model: String,
    /// Prompts in the job.
    pub n_prompts: usize,
    /// Kept layers, ascending.
    pub layers: Vec<usize>,
    /// The kept hook sites, in block order.
    pub sites: Vec<String>,
    /// Tokens the engine would read (each prompt cut to the context window).
    pub tokens: u64,
    /// With a token selection: the tokens it keeps by position, specialness and sampling (the
    /// norm filter can only keep fewer); null without one.
    pub kept_tokens: Option<u64>,
    /// Tokens it would hold against the budget while it runs.
    pub reserved_tokens: u64,
    /// Bytes per file kind.
    pub files: FileSizes,
    /// Bytes of every file together.
    pub total_bytes: u64,
    /// Seconds it should take, from the last measured throughput (null before any job of this
    /// model ran here).
    pub estimated_seconds: Option<f64>,
    /// That throughput, tokens per second, start to end.
    pub tokens_per_second: Option<f64>,
}

fn is_by_prompt(layout: &LayoutName) -> bool {
    *layout == LayoutName::ByPrompt
}

/// Formats an optional instant for the wire.
pub fn timestamp(at: Option<UnixMillis>) -> Option<String> {
    at.map(UnixMillis::to_iso8601)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loading_worker_shows_its_bytes_and_stored_progress_without_a_phase_reads_as_running() {
        let line = r#"{"event":"progress","phase":"loading","bytes_loaded":5,"bytes_total":9,"prompts_done":0,"prompts_total":2,"tokens_done":0}"#;
        let event = harvest_core::worker::ProgressEvent::parse_line(line).unwrap();
        let shown = serde_json::to_value(Progress::from(&event)).unwrap();
        assert_eq!(shown["phase"], "loading");
        assert_eq!(
            (
                shown["bytes_loaded"].as_u64(),
                shown["bytes_total"].as_u64()
            ),
            (Some(5), Some(9))
        );
        let stored = r#"{"prompts_done":1,"prompts_total":2,"tokens_done":7}"#;
        let old: Progress = serde_json::from_str(stored).unwrap();
        let shown = serde_json::to_value(&old).unwrap();
        assert_eq!(shown["phase"], "running");
        assert!(shown.get("bytes_loaded").is_none(), "{shown}");
    }

    fn model() -> ServedModel {
        ServedModel {
            name: "smollm2-135m".into(),
            shape: harvest_core::ModelShape {
                num_layers: 30,
                hidden_size: 4,
                moe: None,
            },
            lane: Lane::Small,
        }
    }

    const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    fn parse_with(
        json: serde_json::Value,
        chat: Result<&ChatTemplate, &str>,
    ) -> Result<Submission, ApiError> {
        let request: HarvestRequest =
            serde_json::from_value(json).map_err(|e| ApiError::invalid(e.to_string()))?;
        request.validate(&model(), chat)
    }

    fn parse(json: serde_json::Value) -> Result<Submission, ApiError> {
        parse_with(json, Err("model smollm2-135m has no chat template"))
    }

    #[test]
    fn conversations_are_rendered_by_the_model_s_template_and_counted_as_rendered() {
        let template =
            ChatTemplate::new(CHATML, harvest_core::chat::SpecialTokens::default()).unwrap();
        let chat = Ok(&template);
        let submission = parse_with(
            serde_json::json!({"model": "m", "add_generation_prompt": true, "conversations": [
                [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                [{"role": "user", "content": "Again"}]]}),
            chat,
        )
        .unwrap();
        assert_eq!(
            submission.prompts[1],
            "<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n"
        );
        let conversations = submission.conversations.as_ref().unwrap();
        assert!(conversations.iter().all(|c| c.add_generation_prompt));
        assert_eq!(conversations[0].messages.len(), 2);
        // The reservation bounds the rendered text, markup included.
        let rendered: u64 = submission.prompts.iter().map(|p| p.len() as u64 + 1).sum();
        assert_eq!(submission.reserved_tokens, rendered);
    }

    #[test]
    fn a_bad_mix_of_prompts_and_conversations_or_their_options_is_named() {
        let template =
            ChatTemplate::new(CHATML, harvest_core::chat::SpecialTokens::default()).unwrap();
        let chat = || Ok(&template);
        let one = serde_json::json!([[{"role": "user", "content": "x"}]]);
        let cases = [
            (
                serde_json::json!({"model": "m", "prompts": ["a"], "conversations": one}),
                "not both",
            ),
            (serde_json::json!({"model": "m"}), "prompts is missing"),
            (
                serde_json::json!({"model": "m", "prompts": ["a"], "add_generation_prompt": true}),
                "add_generation_prompt applies to conversations",
            ),
            (
                serde_json::json!({"model": "m", "conversations": one, "add_special_tokens": false}),
                "add_special_tokens: false applies to prompts",
            ),
            (
                serde_json::json!({"model": "m", "conversations": [[]]}),
                "conversation 0 has no messages",
            ),
        ];
        for (body, words) in cases {
            let error = parse_with(body, chat()).unwrap_err().to_string();
            assert!(error.contains(words), "{words}: {error}");
        }
        let error = parse(serde_json::json!({"model": "m", "conversations": one}))
            .unwrap_err()
            .to_string();
        assert!(error.contains("has no chat template"), "{error}");
        let error = serde_json::from_value::<HarvestRequest>(serde_json::json!(
            {"model": "m", "conversations": [[{"role": "narrator", "content": "x"}]]}
        ))
        .unwrap_err()
        .to_string();
        assert!(error.contains("narrator"), "{error}");
        let refusing = ChatTemplate::new(
            "{{ raise_exception('Conversation roles must alternate') }}",
            harvest_core::chat::SpecialTokens::default(),
        )
        .unwrap();
        let error = parse_with(
            serde_json::json!({"model": "m", "conversations": [[{"role": "user", "content": "x"}], [{"role": "user", "content": "y"}]]}),
            Ok(&refusing),
        )
        .unwrap_err()
        .to_string();
        assert!(
            error.contains("conversation 0") && error.contains("roles must alternate"),
            "{error}"
        );
    }

    fn b64(bytes: &[u8]) -> String {
        base64::engine::general_purpose::STANDARD.encode(bytes)
    }

    #[test]
    fn the_seed_example_validates_with_defaults_and_reserves_bytes_plus_one() {
        let s = parse(serde_json::json!({
            "model": "smollm2-135m",
            "prompts": ["The quick brown fox jumps over the lazy dog.", "Interpretability research reads the residual stream."],
            "layers": [24, 8, 16]
        }))
        .unwrap();
        assert_eq!(s.options.layers.as_slice(), &[8, 16, 24]);
        assert_eq!(s.options.shard_size.get(), 32);
        assert!(s.options.add_special_tokens);
        assert_eq!(s.reserved_tokens, (44 + 1) + (52 + 1));
    }

    #[test]
    fn a_misspelled_field_is_named() {
        let err =
            parse(serde_json::json!({"model": "m", "prompts": ["a"], "layer": [1]})).unwrap_err();
        assert_eq!(err.code(), "invalid_request");
        assert!(err.to_string().contains("layer"), "{err}");
    }

    #[test]
    fn sites_default_to_resid_post_and_an_unknown_site_is_named_with_the_choices() {
        let s = parse(serde_json::json!({"model": "m", "prompts": ["a"]})).unwrap();
        assert!(s.options.sites.is_default());
        let s = parse(
            serde_json::json!({"model": "m", "prompts": ["a"], "sites": ["mlp_out", "resid_pre"]}),
        )
        .unwrap();
        assert_eq!(s.options.sites.names(), ["resid_pre", "mlp_out"]);
        let err = parse(serde_json::json!({"model": "m", "prompts": ["a"], "sites": ["attn"]}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("sites[0] \"attn\""), "{err}");
        assert!(err.contains("attn_out"), "{err}");
        let err = parse(serde_json::json!({"model": "m", "prompts": ["a"], "sites": []}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("sites is empty"), "{err}");
    }

    #[test]
    fn the_router_site_on_a_dense_model_is_a_400_naming_the_model_and_alone_naming_the_fix() {
        let request =
            serde_json::json!({"model": "m", "prompts": ["a"], "sites": ["resid_post", "router"]});
        let err = parse(request).unwrap_err();
        assert_eq!(err.code(), "invalid_request");
        let text = err.to_string();
        assert!(text.contains("smollm2-135m is dense"), "{text}");
        let alone = serde_json::json!({"model": "m", "prompts": ["a"], "sites": ["router_logits"]});
        let text = parse(alone).unwrap_err().to_string();
        assert!(text.contains("add an activation site"), "{text}");
    }

    #[test]
    fn layers_accept_all_and_reject_out_of_range_by_name() {
        let s =
            parse(serde_json::json!({"model": "m", "prompts": ["a"], "layers": "all"})).unwrap();
        assert_eq!(s.options.layers.len(), 30);
        let err =
            parse(serde_json::json!({"model": "m", "prompts": ["a"], "layers": [30]})).unwrap_err();
        assert!(err.to_string().contains("layer 30"), "{err}");
        assert!(
            parse(serde_json::json!({"model": "m", "prompts": ["a"], "layers": "ALL"})).is_err()
        );
    }

    #[test]
    fn more_than_4096_prompts_says_to_split_the_job() {
        let err = parse(serde_json::json!({"model": "m", "prompts": vec!["a"; 4097]})).unwrap_err();
        assert_eq!(
            (err.status().as_u16(), err.code()),
            (400, "harvest_too_large")
        );
        assert!(err.to_string().contains("split"), "{err}");
        assert!(parse(serde_json::json!({"model": "m", "prompts": []})).is_err());
    }

    #[test]
    fn a_short_direction_buffer_reports_both_byte_counts() {
        let data = b64(&[0u8; 12]);
        let err = parse(serde_json::json!({"model": "m", "prompts": ["a"],
            "project_onto": {"data": data, "dtype": "float32", "shape": [1, 4], "compression": "none"}}))
        .unwrap_err();
        assert!(
            err.to_string().contains("12 bytes") && err.to_string().contains("16 bytes"),
            "{err}"
        );
    }

    #[test]
    fn directions_decode_from_each_dtype_and_the_wrong_hidden_size_is_rejected() {
        let f32s: Vec<u8> = [1.0f32, 0.0, 0.0, 2.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let bf16s: Vec<u8> = [1.0f32, 0.0, 0.0, 2.0]
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect();
        for (dtype, bytes) in [("float32", f32s), ("bfloat16", bf16s)] {
            let s = parse(serde_json::json!({"model": "m", "prompts": ["a"],
                "project_onto": {"data": b64(&bytes), "dtype": dtype, "shape": [1, 4]}}))
            .unwrap();
            assert_eq!(s.directions, Some((1, vec![1.0, 0.0, 0.0, 2.0])), "{dtype}");
        }
        // 0.1 and 1e-4 have other bits in f16 than in bf16, so only an f16 decoder gets them back.
        let values = [0.1f32, 1e-4, -2.5, 3.0];
        let f16s: Vec<u8> = values
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect();
        let s = parse(serde_json::json!({"model": "m", "prompts": ["a"],
            "project_onto": {"data": b64(&f16s), "dtype": "float16", "shape": [1, 4]}}))
        .unwrap();
        let expected: Vec<f32> = values
            .iter()
            .map(|v| half::f16::from_f32(*v).to_f32())
            .collect();
        assert_eq!(s.directions, Some((1, expected)));
        let err = parse(serde_json::json!({"model": "m", "prompts": ["a"],
            "project_onto": {"data": "", "dtype": "float32", "shape": [1, 8]}}))
        .unwrap_err();
        assert!(
            err.to_string().contains("hidden size 8") && err.to_string().contains("is 4"),
            "{err}"
        );
        let err = parse(serde_json::json!({"model": "m", "prompts": ["a"],
            "project_onto": {"data": "", "dtype": "int8", "shape": [1, 4]}}))
        .unwrap_err();
        assert!(err.to_string().contains("int8"), "{err}");
    }

    #[test]
    fn nan_or_zero_directions_are_rejected() {
        let nan: Vec<u8> = [f32::NAN, 0.0, 0.0, 1.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let err = parse(serde_json::json!({"model": "m", "prompts": ["a"],
            "project_onto": {"data": b64(&nan), "dtype": "float32", "shape": [1, 4]}}))
        .unwrap_err();
        assert!(err.to_string().contains("non-finite"), "{err}");
        let zero = vec![0u8; 16];
        assert!(
            parse(serde_json::json!({"model": "m", "prompts": ["a"],
            "project_onto": {"data": b64(&zero), "dtype": "float32", "shape": [1, 4]}}))
            .is_err()
        );
    }

    #[test]
    fn job_ids_follow_the_reference_pattern() {
        assert!(is_valid_job_id("497f6eca-6276-4993-bfeb-53cbbbba6f08"));
        assert!(is_valid_job_id("00000000-0000-0000-0000-000000000000"));
        assert!(is_valid_job_id("FFFFFFFF-FFFF-FFFF-FFFF-FFFFFFFFFFFF"));
        assert!(
            !is_valid_job_id("497f6eca-6276-9993-bfeb-53cbbbba6f08"),
            "version 9"
        );
        assert!(
            !is_valid_job_id("497f6eca-6276-4993-cfeb-53cbbbba6f08"),
            "variant c"
        );
        assert!(!is_valid_job_id("497f6eca6276-4993-bfeb-53cbbbba6f08x"));
        assert!(!is_valid_job_id("../etc/passwd"));
        assert!(is_valid_job_id(&uuid::Uuid::new_v4().to_string()));
    }

    #[test]
    fn a_pending_job_serialises_nulls_and_omits_absent_sections() {
        let view = JobView {
            job_id: "j".into(),
            run_id: "r".into(),
            status: JobStatus::Pending,
            model: "m".into(),
            n_prompts: 2,
            reserved_tokens: 11,
            layers: vec![8, 16, 24],
            sites: None,
            tokens: None,
            created_at: UnixMillis(0).to_iso8601(),
            started_at: None,
            completed_at: None,
            result: None,
            urls_expire_at: None,
            urls_expired: None,
            error: None,
            progress: None,
            estimate: None,
            ready_shard_urls: None,
            partial: None,
        };
        let json = serde_json::to_value(&view).unwrap();
        assert_eq!(json["status"], "pending");
        assert!(json["tokens"].is_null() && json["started_at"].is_null());
        assert!(json.get("result").is_none() && json.get("error").is_none());
        assert_eq!(json["created_at"], "1970-01-01T00:00:00.000+00:00");
    }
}
