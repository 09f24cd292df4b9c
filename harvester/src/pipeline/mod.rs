//! `harvester run`: one harvest job, from a plan to a committed output.
//!
//! ```text
//! load: prompts ─► tokenize all (parallel; bad prompts fail before any output exists)
//!       model, directions, resume scan (shards with a valid partial record are skipped)
//! forward thread ──FORWARD_QUEUE──► assembler thread ──UPLOAD_QUEUE──► uploader (async)
//!  (owns the backend, or feeds       (shards in prompt order,           (shard, then its record)
//!   the pipeline stages (staged);     per-shard stats)
//!   packs batches by token budget)
//!          ▲────── recycled capture buffers (CAPTURE_POOL) ──────┘
//! finish: [shuffled layout: shards ─► key-range buckets ─► train files (shuffle)]
//!         merge per-shard stats in shard order ─► stats.safetensors ─► manifest.json (commit
//!         point) ─► result.json ─► partial records (and a shuffled job's shards) removed
//! ```
//! The assembler keeps each kept site of each kept layer, and only the tokens the job's
//! selection keeps (select).
//! Every queue is bounded, so memory stays flat whatever the corpus size. Because statistics are
//! merged per shard in shard order and batches never span shards, a resumed run writes files
//! identical to an uninterrupted one.

pub mod directions;
mod fingerprint;
mod outputs;
pub mod progress;
pub mod prompts;
pub mod result;
mod resume;
mod select;
pub mod shard;
mod shuffle;
mod staged;
pub mod store;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::time::Instant;

use bytes::Bytes;
use harvest_core::format::{Contents, Manifest};
use harvest_core::layout::Layout;
use harvest_core::plan::{Part, shard_count, shard_file_name, shard_prompts};
use harvest_core::worker::PartResult;
use harvest_core::{HarvestPlan, RawPlan, ResolvedPlan};
use rayon::prelude::*;

use self::progress::{Progress, ProgressMode};
use self::result::{RESULT_FILE, RunResult, Termination, Timings};
use self::select::Selector;
use self::shard::{KeptRows, ShardAssembly, ShardRecord, ShardShape};
use self::store::{S3Config, Store};
use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::DeviceChoice;
use crate::backend::cuda::forward::CudaBackend;
use crate::backend::{Backend, Batch, CaptureSpec, Captured};
use crate::error::{Error, Result};
use crate::model::{LlamaWeights, ModelConfig};
use crate::projection::Directions;
use crate::tokenizer::{Encoded, PromptTokenizer};

/// Forward outputs (one batch of captures each) waiting for assembly.
pub const FORWARD_QUEUE: usize = 2;
/// Capture buffers in circulation between the forward thread and the assembler.
pub const CAPTURE_POOL: usize = FORWARD_QUEUE + 2;
/// Serialised shards waiting for upload.
pub const UPLOAD_QUEUE: usize = 2;

/// Output file names.
pub use harvest_core::format::MANIFEST_FILE;
/// The statistics file.
pub const STATS_FILE: &str = "stats.safetensors";

/// How a run reports and names things.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Progress display.
    pub progress: ProgressMode,
    /// The model's name for the manifest (default: the checkpoint directory's name).
    pub model_name: Option<String>,
    /// Where the forward pass runs, as [`crate::backend::cuda::select`] resolved it.
    pub device: DeviceChoice,
    /// How to reach S3, when the plan names `s3://` locations.
    pub s3: S3Config,
    /// Where the shuffled layout spills its buckets (about the job's size); default `.shuffle/`
    /// in a local output, the system's temp dir for S3.
    pub spill_dir: Option<std::path::PathBuf>,
    /// Split the model's blocks into this many pipeline stages, each on its own thread and
    /// device (`pipeline/staged.rs`); `None` runs one backend.
    pub pipeline_stages: Option<usize>,
    /// Run only this part of the job's shards ([`run_part`]); `None` runs them all.
    pub part: Option<Part>,
    /// The most tokens the whole corpus may have (the operator's `tokenBudget`, what the job's
    /// account holds for it); checked after tokenizing, before the model loads.
    pub token_budget: Option<u64>,
    /// The Kubernetes HarvestJob's UID, recorded in the manifest for its cleanup.
    pub job_uid: Option<String>,
}

/// What runs the forward pass: one backend, or a chain of pipeline stages.
enum Engine {
    Single(Box<dyn Backend>),
    Staged(staged::Staged),
}

impl Engine {
    /// Capture buffers to keep in circulation.
    fn capture_pool(&self) -> usize {
        match self {
            Self::Single(_) => CAPTURE_POOL,
            Self::Staged(s) => staged::capture_pool(s.stages.len()),
        }
    }
}

struct Job<'a> {
    plan: &'a ResolvedPlan,
    encoded: &'a [Encoded],
    contents: Contents,
    fingerprint: &'a str,
    bos_id: Option<u32>,
    layers: usize,
    /// Kept sites times kept layers: the statistics' first axis.
    slots: usize,
    width: usize,
    n_shards: usize,
    /// The shards this process runs: all of them, or one part's.
    shards: std::ops::Range<usize>,
    /// Ids the tokenizer marks special, ascending.
    special_ids: Vec<u32>,
}

impl Job<'_> {
    /// Prompts of this process's shards that an earlier run finished.
    fn prompts_resumed(&self, resumed: &BTreeMap<usize, ShardRecord>) -> usize {
        resumed
            .keys()
            .filter(|s| self.shards.contains(s))
            .map(|&s| shard_prompts(s, self.plan.options.shard_size, self.encoded.len()).len())
            .sum()
    }
}

struct ForwardOutput {
    prompts: Vec<usize>,
    captured: Captured,
}

/// A readable summary of a finished local harvest: the manifest's key facts and the dtype and
/// shape of every tensor in every shard.
pub fn inspect(dir: &Path) -> Result<String> {
    use std::fmt::Write;
    let path = dir.join(MANIFEST_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io("reading", &path, e))?;
    let manifest: Manifest =
        serde_json::from_str(&text).map_err(|source| Error::Json { path, source })?;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} ({}), {:?} {}, layers {:?}, {} prompts, {} tokens, {} shards{}",
        manifest.model.name,
        manifest.model.architecture,
        manifest.contents,
        manifest.dtype,
        manifest.layer_indices,
        manifest.n_prompts,
        manifest.total_tokens,
        manifest.shards.len(),
        manifest.train.as_ref().map_or(String::new(), |t| format!(
            ", shuffled into {} training files of {} rows",
            t.files.len(),
            t.rows
        ))
    );
    let files: Vec<(&str, u64)> = match &manifest.train {
        None => manifest
            .shards
            .iter()
            .map(|s| (s.file.as_str(), s.bytes))
            .collect(),
        Some(train) => train
            .files
            .iter()
            .map(|f| (f.file.as_str(), f.bytes))
            .collect(),
    };
    for (file, size) in files {
        let path = dir.join(file);
        let bytes = std::fs::read(&path).map_err(|e| Error::io("reading", &path, e))?;
        let shard = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| {
            Error::CorruptSafetensors {
                path: path.clone(),
                reason: e.to_string(),
            }
        })?;
        let _ = writeln!(out, "{file} ({size} bytes)");
        let mut names = shard.names();
        names.sort_by_key(|n| {
            let (kind, index) = n.rsplit_once('_').unwrap_or((n, "0"));
            (index.parse::<usize>().unwrap_or(0), kind.to_owned())
        });
        for name in names {
            if let Ok(view) = shard.tensor(name) {
                let _ = writeln!(out, "  {name:<14} {:?} {:?}", view.dtype(), view.shape());
            }
        }
    }
    Ok(out)
}

/// Where `harvester run` takes its plan from.
#[derive(Debug, Clone)]
pub enum PlanSource {
    /// A JSON plan file, as the API writes it.
    File(std::path::PathBuf),
    /// The same JSON inline, as the operator passes it in a Pod's args.
    Json(String),
    /// A plan built from command-line flags.
    Given(Box<RawPlan>),
}

impl PlanSource {
    fn read(&self) -> std::result::Result<RawPlan, String> {
        match self {
            Self::File(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| format!("reading plan {}: {e}", path.display()))?;
                serde_json::from_str(&text)
                    .map_err(|e| format!("invalid plan {}: {e}", path.display()))
            }
            Self::Json(text) => {
                serde_json::from_str(text).map_err(|e| format!("invalid --plan-json: {e}"))
            }
            Self::Given(raw) => Ok((**raw).clone()),
        }
    }
}

/// `harvester run` as a supervisor sees it: reads and validates the plan, picks the device, runs
/// the harvest, and answers what the worker protocol says the process reports.
pub fn run_source(source: &PlanSource, options: &RunOptions) -> Termination {
    with_plan(source, options, |plan, options| match options.part {
        Some(part) => run_part(plan, options, part).map(Termination::Part),
        None => run(plan, options).map(Termination::Done),
    })
}

/// `harvester finalize` as a supervisor sees it (see [`finalize`]).
pub fn finalize_source(source: &PlanSource, options: &RunOptions) -> Termination {
    // The device only decides the arithmetic the plan's fingerprint records: finalize never
    // runs the model, so it probes nothing and runs where no GPU is (the operator's finalize
    // Pod takes none).
    let options = RunOptions {
        device: match options.device {
            DeviceChoice::Cuda(device) => DeviceChoice::Cuda(device),
            DeviceChoice::Auto | DeviceChoice::Cpu => DeviceChoice::Cpu,
        },
        ..options.clone()
    };
    let raw = match source.read() {
        Ok(raw) => raw,
        Err(message) => return result::bad_input(&message),
    };
    let outcome = HarvestPlan::try_from(raw)
        .map_err(Error::from)
        .and_then(|plan| finalize(&plan, &options).map(Termination::Done));
    result::termination(outcome)
}

/// Reads and validates the plan, picks the device, and turns `act`'s outcome into the worker
/// protocol's termination.
fn with_plan(
    source: &PlanSource,
    options: &RunOptions,
    act: impl FnOnce(&HarvestPlan, &RunOptions) -> Result<Termination>,
) -> Termination {
    let raw = match source.read() {
        Ok(raw) => raw,
        Err(message) => return result::bad_input(&message),
    };
    let outcome = crate::backend::cuda::select(options.device).and_then(|device| {
        let plan = HarvestPlan::try_from(raw)?;
        let options = RunOptions {
            device,
            ..options.clone()
        };
        act(&plan, &options)
    });
    result::termination(outcome)
}

/// Runs a harvest to completion (or resumes one), returning its result.
pub fn run(plan: &HarvestPlan, options: &RunOptions) -> Result<RunResult> {
    let (runtime, load_start) = (io_runtime()?, Instant::now());
    let ready = match prepare(&as_run(plan, options.device), options, &runtime)? {
        Prepared::Finished(result) => return Ok(result),
        Prepared::Ready(ready) => *ready,
    };
    let all = 0..shard_count(ready.encoded.len(), ready.plan.options.shard_size);
    let (fresh, timings) = harvest(&ready, options, all, (&runtime, load_start))?;
    close(ready, fresh, timings, options, &runtime)
}

/// Runs part `part` of a job (`harvester run --part I/N`): its shards and their records, which
/// `finalize` closes once every part has run. A rerun resumes; a finished job has nothing to do.
pub fn run_part(plan: &HarvestPlan, options: &RunOptions, part: Part) -> Result<PartResult> {
    let (runtime, load_start) = (io_runtime()?, Instant::now());
    let prepared = prepare(&as_run(plan, options.device), options, &runtime)?;
    let ready = match prepared {
        Prepared::Finished(result) => {
            // n_shards counts training files in the shuffled layout; prompts make the shards.
            let shards = part.shards(shard_count(result.n_prompts, plan.options.shard_size));
            return Ok(part_result(part, &shards, 0, shards.len(), 0));
        }
        Prepared::Ready(ready) => *ready,
    };
    if part.count() > 1 && ready.plan.options.selection.max_norm_multiple.is_some() {
        return Err(Error::BadParts {
            reason: "max_norm_multiple compares each token with the running median of every token before it, which one part cannot know: run the job as one part".into(),
        });
    }
    let shards = part.shards(shard_count(
        ready.encoded.len(),
        ready.plan.options.shard_size,
    ));
    let resumed = shards
        .clone()
        .filter(|s| ready.resumed.contains_key(s))
        .count();
    let fresh = if resumed == shards.len() {
        // Nothing left to run (every shard recorded by an earlier try, or none in this part's
        // range): the model is never loaded.
        Vec::new()
    } else {
        harvest(&ready, options, shards.clone(), (&runtime, load_start))?.0
    };
    let tokens = fresh
        .iter()
        .map(|r| r.meta.token_counts.iter().sum::<usize>() as u64)
        .sum();
    Ok(part_result(part, &shards, fresh.len(), resumed, tokens))
}

fn part_result(
    part: Part,
    shards: &std::ops::Range<usize>,
    written: usize,
    resumed: usize,
    tokens: u64,
) -> PartResult {
    PartResult {
        part: part.to_string(),
        shards: [shards.start, shards.end],
        written,
        resumed,
        tokens,
    }
}

/// Closes a job whose parts have all run (`harvester finalize`): statistics, manifest and
/// result from every part's records, byte for byte what one run would write. Idempotent: a
/// closed job answers its result again. Refuses, naming them, when shards are missing.
pub fn finalize(plan: &HarvestPlan, options: &RunOptions) -> Result<RunResult> {
    let runtime = io_runtime()?;
    let ready = match prepare(&as_run(plan, options.device), options, &runtime)? {
        Prepared::Finished(result) => return Ok(result),
        Prepared::Ready(ready) => *ready,
    };
    let n_shards = shard_count(ready.encoded.len(), ready.plan.options.shard_size);
    let missing: Vec<usize> = (0..n_shards)
        .filter(|s| !ready.resumed.contains_key(s))
        .collect();
    if !missing.is_empty() {
        return Err(Error::PartsMissing {
            missing: missing.len(),
            of: n_shards,
            first: missing[0],
        });
    }
    close(ready, Vec::new(), Timings::default(), options, &runtime)
}

fn io_runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::io("starting", "the I/O runtime", e))
}

/// The job as the forward and assembly stages see it.
fn job_of(ready: &Ready, shards: std::ops::Range<usize>) -> Job<'_> {
    let plan = &ready.plan;
    let (contents, width) = match &ready.directions {
        Some(directions) => (Contents::Projections, directions.count()),
        None => (Contents::Activations, ready.config.hidden_size),
    };
    Job {
        plan,
        encoded: &ready.encoded,
        contents,
        fingerprint: &ready.fingerprint,
        bos_id: ready.tokenizer.bos_id(),
        layers: plan.options.layers.len(),
        slots: plan.options.sites.len() * plan.options.layers.len(),
        width,
        n_shards: shard_count(ready.encoded.len(), plan.options.shard_size),
        shards,
        special_ids: ready.tokenizer.special_ids(),
    }
}

/// Loads the model and runs the not yet recorded shards of `shards`; returns their records and
/// the timings (`started`: the I/O runtime and when loading began).
fn harvest(
    ready: &Ready,
    options: &RunOptions,
    shards: std::ops::Range<usize>,
    (runtime, load_start): (&tokio::runtime::Runtime, Instant),
) -> Result<(Vec<ShardRecord>, Timings)> {
    let spec = capture_spec(&ready.plan, ready.directions.clone());
    let width = spec.width(ready.config.hidden_size);
    // Progress counts this process's shards, those an earlier run finished included.
    let prompts: usize = shards
        .clone()
        .map(|s| shard_prompts(s, ready.plan.options.shard_size, ready.encoded.len()).len())
        .sum();
    let progress = Progress::new(options.progress, prompts);
    let engine = open_engine(
        (&ready.plan, &ready.encoded),
        spec,
        options,
        width,
        &progress,
    )?;
    let load_s = load_start.elapsed().as_secs_f64();
    let job = job_of(ready, shards);
    let outcome = run_stages(
        &job,
        engine,
        &ready.resumed,
        &ready.store,
        runtime,
        &progress,
    )?;
    progress.finish();
    let timings = Timings {
        load_s,
        forward_s: outcome.forward_s,
        save_s: outcome.save_s,
        upload_s: outcome.upload_s,
    };
    Ok((outcome.records, timings))
}

/// Merges the earlier runs' records with `fresh` ones and commits the job.
fn close(
    mut ready: Ready,
    fresh: Vec<ShardRecord>,
    timings: Timings,
    options: &RunOptions,
    runtime: &tokio::runtime::Runtime,
) -> Result<RunResult> {
    let mut records = std::mem::take(&mut ready.resumed);
    let resumed_shards = records.len();
    let all = 0..shard_count(ready.encoded.len(), ready.plan.options.shard_size);
    let job = job_of(&ready, all);
    records.extend(fresh.into_iter().map(|r| (r.meta.shard, r)));
    let closing = Closing {
        job: &job,
        config: &ready.config,
        records: &records,
        model_name: options
            .model_name
            .clone()
            .unwrap_or_else(|| dir_name(&ready.plan.model)),
        max_tokens: ready.tokenizer.max_tokens(),
        timings,
        resumed_shards,
        spill_dir: options.spill_dir.clone(),
        job_uid: options.job_uid.clone(),
    };
    commit(&closing, &ready.store, runtime)
}

/// The plan as `device` runs it: the CUDA engine computes in bf16 whatever the plan asks, and
/// the manifest and fingerprint say what ran.
fn as_run(plan: &HarvestPlan, device: DeviceChoice) -> HarvestPlan {
    let mut plan = plan.clone();
    if let DeviceChoice::Cuda(_) = device {
        plan.options.precision = harvest_core::plan::Precision::Bf16;
    }
    plan
}

/// What [`prepare`] found: an output already complete, or a job ready to run.
enum Prepared {
    Finished(RunResult),
    Ready(Box<Ready>),
}

/// Everything a run needs before the model's weights load.
struct Ready {
    plan: ResolvedPlan,
    config: ModelConfig,
    store: Store,
    encoded: Vec<Encoded>,
    directions: Option<Directions>,
    tokenizer: PromptTokenizer,
    fingerprint: String,
    resumed: BTreeMap<usize, ShardRecord>,
}

/// Reads the inputs, resolves the plan against the model, tokenizes the corpus and finds what
/// an earlier run of the same plan left. Bad input fails here, before any output is written.
fn prepare(
    plan: &HarvestPlan,
    options: &RunOptions,
    runtime: &tokio::runtime::Runtime,
) -> Result<Prepared> {
    let store = Store::open(&plan.output, &options.s3)?;
    let (prompt_name, prompt_bytes) =
        runtime.block_on(read_object(&plan.prompts, "prompts", &options.s3))?;
    let prompts = prompts::parse_prompts(&prompt_name, &prompt_bytes)?;
    let config = ModelConfig::from_file(&plan.model.join("config.json"))?;
    let plan = plan.clone().resolve(&config.shape())?;
    let directions = match &plan.project_onto {
        Some(location) => {
            let (name, bytes) =
                runtime.block_on(read_object(location, "directions", &options.s3))?;
            Some(directions::load_directions(
                &name,
                &bytes,
                config.hidden_size,
            )?)
        }
        None => None,
    };
    let max_tokens = plan.options.max_tokens(config.max_position_embeddings);
    let tokenizer = PromptTokenizer::from_dir(&plan.model, max_tokens)?;
    let fingerprint = fingerprint::plan_fingerprint(
        &plan,
        &prompt_bytes,
        directions.as_ref(),
        tokenizer.max_tokens(),
    )?;
    if let Some(result) = runtime.block_on(resume::finished_result(&store, &fingerprint))? {
        tracing::info!(output = %plan.output, "harvest already complete; nothing to do");
        return Ok(Prepared::Finished(result));
    }
    let encoded: Vec<Encoded> = prompts
        .par_iter()
        .enumerate()
        .map(|(i, text)| tokenizer.encode(i, text, plan.options.add_special_tokens))
        .collect::<Result<_>>()?;
    drop(prompts);
    check_token_budget(&encoded, options.token_budget)?;
    let truncated = encoded
        .iter()
        .filter(|e| e.truncated_from.is_some())
        .count();
    if truncated > 0 {
        tracing::warn!(
            prompts = truncated,
            max_tokens = tokenizer.max_tokens(),
            "prompts longer than max_tokens (the context window, or max_prompt_tokens) were cut; the manifest lists them"
        );
    }
    let n_shards = shard_count(encoded.len(), plan.options.shard_size);
    let resumed = runtime.block_on(resume::resume_scan(&store, &fingerprint, n_shards))?;
    if !resumed.is_empty() {
        tracing::info!(
            shards = resumed.len(),
            of = n_shards,
            "resuming: skipping verified shards"
        );
    }
    Ok(Prepared::Ready(Box::new(Ready {
        plan,
        config,
        store,
        encoded,
        directions,
        tokenizer,
        fingerprint,
        resumed,
    })))
}

/// Refuses a corpus with more tokens than `budget`.
fn check_token_budget(encoded: &[Encoded], budget: Option<u64>) -> Result<()> {
    let Some(budget) = budget else {
        return Ok(());
    };
    let needed: u64 = encoded.iter().map(|e| e.ids.len() as u64).sum();
    if needed > budget {
        return Err(Error::TokenBudget { needed, budget });
    }
    Ok(())
}

/// The most tokens one batch of this job can hold: the batch budget, or one prompt longer than
/// it, and never more than the whole job.
fn largest_batch(plan: &ResolvedPlan, encoded: &[Encoded]) -> usize {
    let total: usize = encoded.iter().map(|e| e.ids.len()).sum();
    let longest = encoded.iter().map(|e| e.ids.len()).max().unwrap_or(0);
    total.min(plan.batch_tokens.get().max(longest))
}

/// Shards' worth of bytes the pipeline can hold at once: one being assembled, the upload queue,
/// and one being uploaded.
const SHARDS_HELD: usize = UPLOAD_QUEUE + 2;

/// What a batch needs besides the backend: how many tokens the largest one has, and the bytes
/// the pipeline itself holds then (its capture buffers of that size, and its shards).
#[derive(Debug, Clone, Copy)]
struct Sizing {
    batch_tokens: usize,
    pipeline_bytes: u64,
}

impl Sizing {
    /// The sizing of `plan` over `encoded`, capturing `slots` rows of `width` values a token,
    /// with `capture_buffers` capture buffers in circulation.
    fn of(
        plan: &ResolvedPlan,
        encoded: &[Encoded],
        (slots, width): (usize, usize),
        capture_buffers: usize,
    ) -> Self {
        let batch_tokens = largest_batch(plan, encoded);
        let captured = (batch_tokens * slots * width * 4) as u64;
        let value_bytes = if plan.project_onto.is_some() { 4 } else { 2 };
        let largest_shard = encoded
            .chunks(plan.options.shard_size.get())
            .map(|shard| shard.iter().map(|e| e.ids.len()).sum::<usize>())
            .max()
            .unwrap_or(0);
        let shard = (largest_shard * slots * width * value_bytes) as u64;
        Self {
            batch_tokens,
            pipeline_bytes: captured * capture_buffers.saturating_sub(1) as u64
                + shard * SHARDS_HELD as u64,
        }
    }
}

/// Loads the blocks up to the deepest kept layer onto the chosen device; on the CPU, first
/// checks that they and batches of `batch_tokens` fit the memory; on a GPU, allocates a batch
/// of `batch_tokens` against the device's free memory.
fn open_backend(
    plan: &ResolvedPlan,
    spec: CaptureSpec,
    device: DeviceChoice,
    sizing: Sizing,
    progress: &Progress,
) -> Result<Box<dyn Backend>> {
    let weights = LlamaWeights::load(&plan.model, Some(plan.options.layers.deepest() + 1))?;
    if let DeviceChoice::Cpu | DeviceChoice::Auto = device {
        let Sizing {
            batch_tokens,
            pipeline_bytes,
        } = sizing;
        CpuBackend::check_memory(&weights, &spec, batch_tokens, pipeline_bytes)?;
    }
    read_weights(&[&weights], progress);
    Ok(match device {
        DeviceChoice::Cuda(ordinal) => {
            let mut backend = CudaBackend::new(weights, spec, ordinal)?;
            // The job's largest batch is allocated now, so one that does not fit the GPU is
            // refused before any prompt runs, naming the bytes.
            backend.reserve(sizing.batch_tokens)?;
            Box::new(backend)
        }
        DeviceChoice::Cpu | DeviceChoice::Auto => Box::new(CpuBackend::new(weights, spec)?),
    })
}

/// What the job keeps: activations or projections, and the backends' capture spec.
fn capture_spec(plan: &ResolvedPlan, directions: Option<Directions>) -> CaptureSpec {
    CaptureSpec {
        layers: plan.options.layers.clone(),
        sites: plan.options.sites.clone(),
        precision: plan.options.precision,
        directions,
    }
}

/// One backend, or the pipeline stages `options` asks for, loaded for batches of up to
/// `largest` tokens.
fn open_engine(
    (plan, encoded): (&ResolvedPlan, &[Encoded]),
    spec: CaptureSpec,
    options: &RunOptions,
    width: usize,
    progress: &Progress,
) -> Result<Engine> {
    let dims = (spec.slots(), width);
    Ok(match options.pipeline_stages {
        None => {
            let sizing = Sizing::of(plan, encoded, dims, CAPTURE_POOL);
            Engine::Single(open_backend(plan, spec, options.device, sizing, progress)?)
        }
        Some(stages) => {
            // Each stage's working set counts one capture buffer of its own.
            let buffers = staged::capture_pool(stages).saturating_sub(stages.saturating_sub(1));
            let sizing = Sizing::of(plan, encoded, dims, buffers);
            let device = (options.device, stages);
            Engine::Staged(open_stages(plan, spec, device, sizing, progress)?)
        }
    })
}

/// Seconds between two loading progress lines.
const LOADING_REPORT_S: f64 = 1.0;

/// Reads the mapped weights in (every stage's at once), reporting the bytes as loading progress
/// at most every [`LOADING_REPORT_S`], and once at the end.
fn read_weights(weights: &[&LlamaWeights], progress: &Progress) {
    use std::sync::atomic::{AtomicU64, Ordering};
    let total: u64 = weights.iter().map(|w| w.mapped_block_bytes()).sum();
    if total == 0 {
        progress.running();
        return;
    }
    let start = Instant::now();
    let last_report = std::sync::Mutex::new(0.0f64);
    let done = AtomicU64::new(0);
    let read = |bytes: u64| {
        let so_far = done.fetch_add(bytes, Ordering::Relaxed) + bytes;
        let now = start.elapsed().as_secs_f64();
        // A report another thread is writing covers this one.
        if let Ok(mut last) = last_report.try_lock()
            && now - *last >= LOADING_REPORT_S
        {
            *last = now;
            progress.loading(so_far.min(total), total);
        }
    };
    progress.loading(0, total);
    std::thread::scope(|scope| {
        for w in weights {
            let read = &read;
            scope.spawn(move || w.prefault(read));
        }
    });
    progress.loading(total, total);
    progress.running();
    let seconds = start.elapsed().as_secs_f64();
    tracing::info!(bytes = total, seconds, "weights read");
}

/// The pipeline stages of a `--pipeline-stages` run: the model's blocks split by bytes, the
/// plan of each running stage logged, its memory checked, then each stage's blocks loaded. CPU
/// stages only, until a CUDA stage has been checked on a GPU.
fn open_stages(
    plan: &ResolvedPlan,
    spec: CaptureSpec,
    (device, stages): (DeviceChoice, usize),
    sizing: Sizing,
    progress: &Progress,
) -> Result<staged::Staged> {
    use crate::backend::stages::{Capacity, check_stage_memory, plan_stages};
    if let DeviceChoice::Cuda(_) = device {
        return Err(Error::BadStages {
            reason: "--pipeline-stages runs CPU stages only until its CUDA stages are checked on a GPU: use --device cpu".into(),
        });
    }
    let config = ModelConfig::from_file(&plan.model.join("config.json"))?;
    let checkpoint = crate::model::Checkpoint::open(&plan.model)?;
    let block_bytes: Vec<u64> = (0..config.num_layers)
        .map(|b| checkpoint.stored_bytes(&format!("model.layers.{b}.")))
        .collect();
    let embed = checkpoint.stored_bytes("model.embed_tokens.");
    let mut stage_plan = plan_stages(&block_bytes, embed, spec.layers.deepest(), stages)?;
    let mut weights = Vec::with_capacity(stage_plan.running.len());
    for share in &mut stage_plan.running {
        let w =
            LlamaWeights::range_from_checkpoint(config.clone(), &checkpoint, share.blocks.clone())?;
        share.working_bytes = CpuBackend::working_bytes(&w, &spec, sizing.batch_tokens);
        tracing::info!(
            stage = weights.len() + 1,
            of = stage_plan.stages,
            first_block = share.blocks.start,
            last_block = share.blocks.end - 1,
            weight_bytes = share.weight_bytes,
            working_bytes = share.working_bytes,
            "pipeline stage"
        );
        weights.push(w);
    }
    if let Some(available) = crate::memory::available_bytes() {
        // The pipeline's own buffers come out of the same memory first.
        let left = available.saturating_sub(sizing.pipeline_bytes);
        check_stage_memory(&stage_plan, &Capacity::Shared(left))?;
    }
    read_weights(&weights.iter().collect::<Vec<_>>(), progress);
    let stages = weights
        .into_iter()
        .map(
            |w| Ok(Box::new(CpuBackend::stage(w, spec.clone())?) as Box<dyn crate::backend::Stage>),
        )
        .collect::<Result<Vec<_>>>()?;
    let width = spec.width(config.hidden_size);
    Ok(staged::Staged {
        stages,
        capture: (spec.sites.len(), spec.layers.len(), width),
    })
}

/// What the closing files are made of.
struct Closing<'a> {
    job: &'a Job<'a>,
    config: &'a ModelConfig,
    records: &'a BTreeMap<usize, ShardRecord>,
    model_name: String,
    max_tokens: usize,
    timings: Timings,
    resumed_shards: usize,
    spill_dir: Option<std::path::PathBuf>,
    job_uid: Option<String>,
}

/// Writes the statistics, then the manifest (the commit point), then `result.json`, and
/// removes the partial records.
fn commit(
    closing: &Closing<'_>,
    store: &Store,
    runtime: &tokio::runtime::Runtime,
) -> Result<RunResult> {
    let Closing { job, records, .. } = closing;
    let finish_start = Instant::now();
    let train = train_files(job, records, store, runtime, closing.spill_dir.as_deref())?;
    let (manifest, stats_bytes) = outputs::build_outputs(
        job,
        closing.config,
        records,
        &closing.model_name,
        closing.max_tokens,
        train.as_ref(),
    )?;
    let manifest = Manifest {
        job_uid: closing.job_uid.clone(),
        ..manifest
    };
    let manifest_bytes = serde_json::to_vec_pretty(&manifest).map_err(|source| Error::Json {
        path: MANIFEST_FILE.into(),
        source,
    })?;
    let save_s = closing.timings.save_s + finish_start.elapsed().as_secs_f64();
    let shard_bytes: u64 = match &train {
        None => records.values().map(|r| r.meta.bytes).sum(),
        Some(train) => train.files.iter().map(|f| f.bytes).sum(),
    };
    let bytes_written = shard_bytes + (stats_bytes.len() + manifest_bytes.len()) as u64;
    let upload_start = Instant::now();
    runtime.block_on(async {
        store.put(STATS_FILE, Bytes::from(stats_bytes)).await?;
        store.put(MANIFEST_FILE, Bytes::from(manifest_bytes)).await
    })?;
    let result = RunResult {
        n_shards: train.as_ref().map_or(job.n_shards, |t| t.files.len()),
        layout: job.plan.options.layout.name(),
        n_prompts: manifest.n_prompts,
        layer_indices: job.plan.options.layers.as_slice().to_vec(),
        tokens: manifest.total_tokens,
        bytes_written,
        contents: job.contents,
        timings: Timings {
            save_s,
            upload_s: closing.timings.upload_s + upload_start.elapsed().as_secs_f64(),
            ..closing.timings.clone()
        },
        output: job.plan.output.to_string(),
        resumed_shards: closing.resumed_shards,
    };
    let result_bytes = serde_json::to_vec_pretty(&result).map_err(|source| Error::Json {
        path: RESULT_FILE.into(),
        source,
    })?;
    runtime.block_on(async {
        store.put(RESULT_FILE, Bytes::from(result_bytes)).await?;
        for shard in 0..job.n_shards {
            if let Err(e) = store.delete(&ShardRecord::file_name(shard)).await {
                tracing::warn!(error = %e, shard, "could not remove a partial record");
            }
            // The shuffled layout's shards were only the first phase.
            if train.is_some()
                && let Err(e) = store.delete(&shard_file_name(shard)).await
            {
                tracing::warn!(error = %e, shard, "could not remove a staged shard");
            }
        }
        Ok::<_, Error>(())
    })?;
    Ok(result)
}

/// What the concurrent stages produced.
struct StageOutcome {
    records: Vec<ShardRecord>,
    forward_s: f64,
    save_s: f64,
    upload_s: f64,
}

/// Runs forward, assembly and upload concurrently; the first real error wins.
fn run_stages(
    job: &Job<'_>,
    engine: Engine,
    resumed: &BTreeMap<usize, ShardRecord>,
    store: &Store,
    runtime: &tokio::runtime::Runtime,
    progress: &Progress,
) -> Result<StageOutcome> {
    let pool = engine.capture_pool();
    let (forward_tx, forward_rx) = sync_channel::<ForwardOutput>(FORWARD_QUEUE);
    let (free_tx, free_rx) = sync_channel::<Captured>(pool);
    let (upload_tx, upload_rx) = tokio::sync::mpsc::channel::<(Vec<u8>, ShardRecord)>(UPLOAD_QUEUE);
    for _ in 0..pool {
        let _ = free_tx.try_send(Captured::default());
    }
    std::thread::scope(|scope| {
        let forward = scope.spawn(move || match engine {
            Engine::Single(backend) => {
                forward_stage(job, backend, resumed, forward_tx, free_rx, progress)
            }
            Engine::Staged(staged) => {
                staged::forward(job, staged, resumed, forward_tx, free_rx, progress)
            }
        });
        let assemble =
            scope.spawn(move || assemble_stage(job, resumed, forward_rx, free_tx, upload_tx));
        let upload = runtime.block_on(upload_stage(store, upload_rx));
        let forward = forward
            .join()
            .unwrap_or(Err(Error::StageLost { stage: "forward" }));
        let assemble = assemble
            .join()
            .unwrap_or(Err(Error::StageLost { stage: "assemble" }));
        match (forward, assemble, upload) {
            (Ok((forward_s, _tokens)), Ok(save_s), Ok((records, upload_s))) => Ok(StageOutcome {
                records,
                forward_s,
                save_s,
                upload_s,
            }),
            (forward, assemble, upload) => {
                Err(root_cause([forward.err(), assemble.err(), upload.err()]))
            }
        }
    })
}

/// The error to report when stages fail: one that failed on its own, not one that only saw its
/// neighbour's channel close.
fn root_cause(errors: impl IntoIterator<Item = Option<Error>>) -> Error {
    let mut lost = None;
    for error in errors.into_iter().flatten() {
        match error {
            Error::StageLost { .. } => lost = lost.or(Some(error)),
            real => return real,
        }
    }
    lost.unwrap_or(Error::StageLost { stage: "pipeline" })
}

fn forward_stage(
    job: &Job<'_>,
    mut backend: Box<dyn Backend>,
    resumed: &BTreeMap<usize, ShardRecord>,
    tx: SyncSender<ForwardOutput>,
    free: Receiver<Captured>,
    progress: &Progress,
) -> Result<(f64, u64)> {
    let lost = || Error::StageLost { stage: "assemble" };
    let budget = job.plan.batch_tokens.get();
    let mut forward_s = 0.0;
    let mut tokens_done = 0u64;
    let mut prompts_done = job.prompts_resumed(resumed);
    let mut batch = Batch::default();
    let mut members = Vec::new();
    for shard in job.shards.clone().filter(|s| !resumed.contains_key(s)) {
        let range = shard_prompts(shard, job.plan.options.shard_size, job.encoded.len());
        let last = range.end - 1;
        for index in range {
            let ids = &job.encoded[index].ids;
            batch.push(ids);
            members.push(index);
            let next_len = job.encoded.get(index + 1).map_or(0, |e| e.ids.len());
            // Batches never span shards, so a shard's batches are the same in every run.
            if index == last || batch.num_tokens() + next_len > budget {
                let mut captured = free.recv().map_err(|_| lost())?;
                let start = Instant::now();
                backend.capture(&batch, &mut captured)?;
                forward_s += start.elapsed().as_secs_f64();
                tokens_done += batch.num_tokens() as u64;
                prompts_done += members.len();
                tx.send(ForwardOutput {
                    prompts: std::mem::take(&mut members),
                    captured,
                })
                .map_err(|_| lost())?;
                batch.clear();
                progress.update(prompts_done, tokens_done);
            }
        }
    }
    Ok((forward_s, tokens_done))
}

/// The selector of a job that selects tokens: the norm filter reads `resid_post` at the deepest
/// kept layer.
fn selector(job: &Job<'_>) -> Option<Selector> {
    let selection = job.plan.options.selection;
    if selection.is_everything() {
        return None;
    }
    let norm_slot = job
        .plan
        .options
        .sites
        .position(harvest_core::Site::ResidPost)
        .map(|site| site * job.layers + job.layers - 1);
    Some(Selector::new(selection, job.special_ids.clone(), norm_slot))
}

/// An empty assembly for shard `shard`.
fn new_assembly(job: &Job<'_>, shard: usize, selector: Option<&Selector>) -> ShardAssembly {
    let range = shard_prompts(shard, job.plan.options.shard_size, job.encoded.len());
    let shape = ShardShape {
        contents: job.contents,
        sites: &job.plan.options.sites,
        slots: job.slots,
        width: job.width,
        selecting: selector.is_some(),
        norms: selector.is_some_and(Selector::filters_norms),
    };
    ShardAssembly::new(shard, range.start, range.len(), &shape)
}

fn assemble_stage(
    job: &Job<'_>,
    resumed: &BTreeMap<usize, ShardRecord>,
    rx: Receiver<ForwardOutput>,
    free: SyncSender<Captured>,
    upload: tokio::sync::mpsc::Sender<(Vec<u8>, ShardRecord)>,
) -> Result<f64> {
    let mut busy = 0.0;
    let mut current: Option<ShardAssembly> = None;
    let mut selector = selector(job);
    let mut skipped = resumed.iter().peekable();
    let size = job.plan.options.shard_size;
    for output in rx {
        let start = Instant::now();
        let mut offset = 0;
        for &index in &output.prompts {
            let encoded = &job.encoded[index];
            let shard = index / size.get();
            let assembly = current.get_or_insert_with(|| {
                // The running median covers every earlier shard, made now or before.
                while let Some((_, record)) = skipped.next_if(|&(&s, _)| s < shard) {
                    if let (Some(selector), Some(norms)) = (selector.as_mut(), &record.norms) {
                        selector.skip_shard(norms);
                    }
                }
                new_assembly(job, shard, selector.as_ref())
            });
            let rows = offset..offset + encoded.ids.len();
            offset = rows.end;
            let skip_bos = job.bos_id.is_some() && encoded.ids.first() == job.bos_id.as_ref();
            let mut norms = assembly.norms.take().unwrap_or_default();
            let selected = selector.as_mut().map(|selector| {
                selector.select(
                    index,
                    &encoded.ids,
                    &output.captured,
                    rows.clone(),
                    &mut norms,
                )
            });
            let kept = match &selected {
                None => KeptRows::All,
                Some(selected) => KeptRows::Positions(selected.kept, selected.dropped),
            };
            assembly.push(
                index,
                &encoded.ids,
                encoded.truncated_from,
                &output.captured,
                rows,
                skip_bos,
                kept,
            );
            if selector.as_ref().is_some_and(Selector::filters_norms) {
                assembly.norms = Some(norms);
            }
            if assembly.is_complete()
                && let Some(done) = current.take()
            {
                let (bytes, mut record) = done.finish(job.fingerprint)?;
                record.seal(&bytes);
                record.meta.bos_token_id = job.bos_id;
                busy += start.elapsed().as_secs_f64();
                upload
                    .blocking_send((bytes, record))
                    .map_err(|_| Error::StageLost { stage: "upload" })?;
            }
        }
        let _ = free.try_send(output.captured);
        busy += start.elapsed().as_secs_f64();
    }
    Ok(busy)
}

async fn upload_stage(
    store: &Store,
    mut rx: tokio::sync::mpsc::Receiver<(Vec<u8>, ShardRecord)>,
) -> Result<(Vec<ShardRecord>, f64)> {
    let mut records = Vec::new();
    let mut busy = 0.0;
    while let Some((bytes, record)) = rx.recv().await {
        let start = Instant::now();
        store
            .put(&shard_file_name(record.meta.shard), Bytes::from(bytes))
            .await?;
        store
            .put(
                &ShardRecord::file_name(record.meta.shard),
                Bytes::from(record.to_bytes()?),
            )
            .await?;
        busy += start.elapsed().as_secs_f64();
        tracing::debug!(shard = record.meta.shard, "shard stored");
        records.push(record);
    }
    Ok((records, busy))
}

/// Reads an input object; one that is absent is the job's mistake ([`Error::MissingInput`]),
/// a store that fails is not.
async fn read_object(
    location: &harvest_core::Location,
    what: &'static str,
    s3: &S3Config,
) -> Result<(String, Vec<u8>)> {
    let (store, name) = Store::open_object(location, s3)?;
    let bytes = store.get(&name).await?.ok_or_else(|| Error::MissingInput {
        what,
        location: location.to_string(),
    })?;
    Ok((name, bytes.to_vec()))
}

/// The shuffled layout's training files, made from the shards; none for the by-prompt layout.
fn train_files(
    job: &Job<'_>,
    records: &BTreeMap<usize, ShardRecord>,
    store: &Store,
    runtime: &tokio::runtime::Runtime,
    spill_dir_given: Option<&Path>,
) -> Result<Option<shuffle::TrainFiles>> {
    match job.plan.options.layout {
        Layout::ByPrompt => Ok(None),
        Layout::Shuffled {
            rows_per_file,
            seed,
        } => {
            let spill = match spill_dir_given {
                // A directory the operator named may be shared: only our own subdirectory goes.
                Some(dir) => shuffle::SpillDir {
                    path: dir.to_owned(),
                    owned: false,
                },
                None => spill_dir(&job.plan.output),
            };
            let files = shuffle::write_train_files(
                job,
                records,
                store,
                runtime,
                rows_per_file,
                seed,
                &spill,
            )?;
            Ok(Some(files))
        }
    }
}

/// Where the shuffle spills its buckets: `.shuffle/` in a local output (the job's own, so what a
/// killed run left there is cleared first), else the system's temp dir.
fn spill_dir(output: &harvest_core::Location) -> shuffle::SpillDir {
    match output {
        harvest_core::Location::Local(dir) => shuffle::SpillDir {
            path: dir.join(".shuffle"),
            owned: true,
        },
        harvest_core::Location::S3 { .. } => shuffle::SpillDir {
            path: std::env::temp_dir(),
            owned: false,
        },
    }
}

fn dir_name(path: &Path) -> String {
    path.canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| path.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_memory_check_counts_the_pipelines_capture_buffers_and_the_shards_it_holds() {
        use std::num::NonZeroUsize;
        let plan = HarvestPlan {
            model: "m".into(),
            prompts: harvest_core::Location::Local("p.jsonl".into()),
            project_onto: None,
            output: harvest_core::Location::Local("out".into()),
            batch_tokens: NonZeroUsize::new(100).unwrap(),
            options: harvest_core::JobOptions {
                layers: harvest_core::LayerSelection::All,
                shard_size: NonZeroUsize::new(2).unwrap(),
                ..Default::default()
            },
        };
        let shape = harvest_core::ModelShape {
            num_layers: 4,
            hidden_size: 8,
        };
        let plan = plan.resolve(&shape).unwrap();
        let encoded: Vec<Encoded> = [30, 50, 70, 10]
            .iter()
            .map(|&n| Encoded {
                ids: vec![1; n],
                truncated_from: None,
            })
            .collect();
        let sizing = Sizing::of(&plan, &encoded, (4, 8), CAPTURE_POOL);
        // Batches of 100 tokens (the longest prompt is shorter); shards of 80 tokens at most.
        assert_eq!(sizing.batch_tokens, 100);
        let captured = 100 * 4 * 8 * 4;
        let shard = 80 * 4 * 8 * 2;
        let expected = captured * (CAPTURE_POOL - 1) + shard * SHARDS_HELD;
        assert_eq!(sizing.pipeline_bytes, expected as u64);
    }

    #[test]
    fn the_root_cause_is_the_stage_that_failed_on_its_own() {
        let store = Error::Store {
            location: "s3://b/p".into(),
            reason: "403".into(),
        };
        let lost = Error::StageLost { stage: "assemble" };
        let cause = root_cause([Some(lost), Some(store), None]);
        assert!(matches!(cause, Error::Store { .. }), "{cause}");
        assert_eq!(
            cause.kind(),
            harvest_core::worker::ErrorKind::Infrastructure
        );
        let only_lost = root_cause([None, Some(Error::StageLost { stage: "upload" }), None]);
        assert!(matches!(only_lost, Error::StageLost { stage: "upload" }));
    }
}
