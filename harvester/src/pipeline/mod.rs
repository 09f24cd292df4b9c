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
//!
//! Here: a run, a part and a finalize from start to end. The steps are grouped by what they do:
//! `input` (where the plan comes from, prompts, directions, the fingerprint, and `prepare`:
//! inputs, plan, tokens, resume scan), `forward` (the backend or the pipeline stages, sized and
//! loaded, and the batches both are fed), `flow` (the forward, assembly and upload threads,
//! what passes between them, progress), `assembly` (shards, token selection, the shuffled
//! layout's training files) and `output` (the store, statistics, manifest, the commit, result,
//! resume, `inspect`).

mod assembly;
mod flow;
mod forward;
mod input;
mod output;

pub use self::input::source::{PlanSource, finalize_source, run_source};
pub use self::output::inspect::inspect;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use harvest_core::format::Contents;
use harvest_core::plan::{Part, Precision, shard_count, shard_prompts};
use harvest_core::worker::PartResult;
use harvest_core::{HarvestPlan, ResolvedPlan};

use self::assembly::shard::ShardRecord;
use self::flow::progress::{Progress, ProgressMode};
use self::flow::threads::run_threads;
use self::forward::engine::{capture_spec, open_engine};
use self::input::prepare::{Prepared, Ready, prepare};
use self::output::commit::{Closing, commit};
use self::output::result::{RESULT_FILE, RunResult, Timings};
use self::output::store::S3Config;
use crate::backend::cuda::DeviceChoice;
use crate::error::{Error, InputError, Result, StoreError};
use crate::tokenizer::Encoded;

/// Forward outputs (one batch of captures each) waiting for assembly.
pub const FORWARD_QUEUE: usize = 2;
/// Capture buffers in circulation between the forward thread and the assembler.
pub const CAPTURE_POOL: usize = FORWARD_QUEUE + 2;
/// Serialised shards waiting for upload.
pub const UPLOAD_QUEUE: usize = 2;

pub use self::assembly::shard;
pub use self::flow::progress;
pub use self::input::{directions, prompts};
pub use self::output::{result, store};

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
    /// The variables of features not yet checked on a GPU that are set to `try` (see
    /// [`crate::backend::cuda::tried_variables`]): `--device auto` takes the GPU for them too.
    pub tried_on_gpu: Vec<&'static str>,
    /// Why `--device auto` chose `device` (set by the run itself; `result.json` carries it).
    pub device_reason: Option<String>,
    /// How to reach S3, when the plan names `s3://` locations.
    pub s3: S3Config,
    /// Where the shuffled layout spills its buckets (about the job's size); default `.shuffle/`
    /// in a local output, `temp_dir` for S3.
    pub spill_dir: Option<std::path::PathBuf>,
    /// The system's temp dir (`main` reads it): where an S3 job spills without `spill_dir`.
    pub temp_dir: Option<std::path::PathBuf>,
    /// Split the model's blocks into this many pipeline stages, each on its own thread and
    /// device (`pipeline/forward/staged.rs`); `None` runs one backend.
    pub pipeline_stages: Option<usize>,
    /// Each CUDA stage's GPU (`--stage-devices`); `None` puts stage `i` on GPU `N + i` for
    /// `--device cuda:N`.
    pub stage_devices: Option<Vec<usize>>,
    /// Run only this part of the job's shards ([`run_part`]); `None` runs them all.
    pub part: Option<Part>,
    /// The most tokens the whole corpus may have (the operator's `tokenBudget`, what the job's
    /// account holds for it); checked after tokenizing, before the model loads.
    pub token_budget: Option<u64>,
    /// The Kubernetes HarvestJob's UID, recorded in the manifest for its cleanup.
    pub job_uid: Option<String>,
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
    /// Whether the corpus is conversations (each prompt then has its tokens' roles).
    conversations: bool,
    /// What the router tensors hold, for a job that keeps the `router` site.
    router: Option<harvest_core::format::RouterInfo>,
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

    /// The forward batches of this process's shards not yet done, in order, as ranges of
    /// prompts ([`forward::batches::pack`]).
    fn batches<'b>(
        &'b self,
        resumed: &'b BTreeMap<usize, ShardRecord>,
    ) -> impl Iterator<Item = std::ops::Range<usize>> + 'b {
        let (shard_size, budget) = (self.plan.options.shard_size, self.plan.batch_tokens.get());
        let tokens = |index: usize| self.encoded[index].ids.len();
        self.shards
            .clone()
            .filter(|s| !resumed.contains_key(s))
            .flat_map(move |shard| {
                let prompts = shard_prompts(shard, shard_size, self.encoded.len());
                forward::batches::pack(prompts, tokens, budget)
            })
    }
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
        return Err(Error::Input(InputError::BadParts {
            reason: "max_norm_multiple compares each token with the running median of every token before it, which one part cannot know: run the job as one part".into(),
        }));
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
        return Err(Error::Store(StoreError::PartsMissing {
            missing: missing.len(),
            of: n_shards,
            first: missing[0],
        }));
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
        conversations: ready.encoded.iter().any(|e| e.roles.is_some()),
        router: harvest_core::format::RouterInfo::of_job(&ready.config.shape(), &plan.options),
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
    let outcome = run_threads(
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
        temp_dir: options.temp_dir.clone(),
        job_uid: options.job_uid.clone(),
        device: options.device,
        device_reason: options.device_reason.clone(),
    };
    commit(&closing, &ready.store, runtime)
}

/// The plan as `device` runs it: a job that names no precision runs in the device's own
/// ([`Precision::or_device`]: bf16 for the CUDA backend, f32 on the CPU), and the manifest and
/// fingerprint say what ran. Past here the plan always names one.
fn as_run(plan: &HarvestPlan, device: DeviceChoice) -> HarvestPlan {
    let mut plan = plan.clone();
    plan.options.precision = Some(Precision::or_device(
        plan.options.precision,
        device.is_cuda_arithmetic(),
    ));
    plan
}

fn dir_name(path: &Path) -> String {
    path.canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| path.display().to_string())
}
