//! What runs the forward pass: one backend or a chain of pipeline stages, sized and loaded
//! (memory checked first), with the weights read in as loading progress.

use std::time::Instant;

use harvest_core::ResolvedPlan;
use harvest_core::plan::Precision;

use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::DeviceChoice;
use crate::backend::cuda::forward::CudaBackend;
use crate::backend::cuda::replay::ReplayBackend;
use crate::backend::{Backend, CaptureSpec, Held};
use crate::error::{Error, InputError, Result};
use crate::model::{LlamaWeights, ModelConfig};
use crate::pipeline::flow::progress::Progress;
use crate::pipeline::forward::staged;
use crate::pipeline::{CAPTURE_POOL, RunOptions, UPLOAD_QUEUE};
use crate::projection::Directions;
use crate::tokenizer::Encoded;

/// What runs the forward pass: one backend, or a chain of pipeline stages.
pub(in crate::pipeline) enum Engine {
    Single(Box<dyn Backend>),
    Staged(staged::Staged),
}

impl Engine {
    /// Capture buffers to keep in circulation.
    pub(in crate::pipeline) fn capture_pool(&self) -> usize {
        match self {
            Self::Single(_) => CAPTURE_POOL,
            Self::Staged(s) => staged::capture_pool(s.stages.len()),
        }
    }
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
    /// The sizing of `plan` over `encoded`, capturing `slots` rows of `width` values a token
    /// held as `held`, with `capture_buffers` capture buffers in circulation.
    pub(in crate::pipeline) fn of(
        plan: &ResolvedPlan,
        encoded: &[Encoded],
        (slots, width, held): (usize, usize, Held),
        capture_buffers: usize,
    ) -> Self {
        let batch_tokens = largest_batch(plan, encoded);
        let captured = (batch_tokens * slots * width * held.bytes()) as u64;
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

/// Refuses a model the CUDA backend cannot run (its heads), or what must not run yet on a GPU
/// (AFMoE and the f32 mode, unless their variables say try:
/// [`crate::backend::cuda::forward::check_unchecked`]); nothing for the CPU.
fn check_cuda_model(config: &ModelConfig, spec: &CaptureSpec, device: DeviceChoice) -> Result<()> {
    use crate::backend::cuda::forward::{check_model, check_unchecked};
    if device.is_cuda_arithmetic() {
        check_model(config)?;
    }
    if let DeviceChoice::Cuda(_) = device {
        check_unchecked(
            config,
            spec.precision,
            &crate::backend::cuda::switches::switch,
        )?;
    }
    Ok(())
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
    match device {
        DeviceChoice::Cpu | DeviceChoice::Auto => {
            let Sizing {
                batch_tokens,
                pipeline_bytes,
            } = sizing;
            CpuBackend::check_memory(&weights, &spec, batch_tokens, pipeline_bytes)?;
        }
        DeviceChoice::Cuda(_) => {
            crate::memory::check_host(sizing.pipeline_bytes, crate::memory::available_bytes())?;
        }
        DeviceChoice::CudaReplay => {}
    }
    // A model the GPU cannot run is refused before gigabytes are read for nothing.
    check_cuda_model(&weights.config, &spec, device)?;
    read_weights(&[&weights], progress);
    Ok(match device {
        DeviceChoice::Cuda(ordinal) => {
            let mut backend = CudaBackend::new(weights, spec, ordinal)?;
            // The job's largest batch is allocated now, so one that does not fit the GPU is
            // refused before any prompt runs, naming the bytes.
            backend.reserve(sizing.batch_tokens)?;
            Box::new(backend)
        }
        DeviceChoice::CudaReplay => Box::new(ReplayBackend::new(weights, spec)?),
        DeviceChoice::Cpu | DeviceChoice::Auto => Box::new(CpuBackend::new(weights, spec)?),
    })
}

/// What the job keeps: activations or projections, and the backends' capture spec.
pub(in crate::pipeline) fn capture_spec(
    plan: &ResolvedPlan,
    directions: Option<Directions>,
) -> CaptureSpec {
    CaptureSpec {
        layers: plan.options.layers.clone(),
        sites: plan.options.sites.clone(),
        precision: plan.options.precision.unwrap_or_default(),
        directions,
    }
}

/// One backend, or the pipeline stages `options` asks for, loaded for batches of up to
/// `largest` tokens.
pub(in crate::pipeline) fn open_engine(
    (plan, encoded): (&ResolvedPlan, &[Encoded]),
    spec: CaptureSpec,
    options: &RunOptions,
    width: usize,
    progress: &Progress,
) -> Result<Engine> {
    let dims = (
        spec.slots(),
        width,
        Held::of(options.device.is_cuda_arithmetic(), &spec),
    );
    Ok(match options.pipeline_stages {
        None => {
            let sizing = Sizing::of(plan, encoded, dims, CAPTURE_POOL);
            Engine::Single(open_backend(plan, spec, options.device, sizing, progress)?)
        }
        Some(stages) => {
            // Each stage's working set counts one capture buffer of its own.
            let buffers = staged::capture_pool(stages).saturating_sub(stages.saturating_sub(1));
            let sizing = Sizing::of(plan, encoded, dims, buffers);
            let device = StageDevices {
                device: options.device,
                stages,
                listed: options.stage_devices.as_deref(),
            };
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

/// Where a job's pipeline stages run.
struct StageDevices<'a> {
    /// The device the job asked for (`cuda:N`: stage `i` on GPU `N + i` unless `listed`).
    device: DeviceChoice,
    /// Stages to split the model into.
    stages: usize,
    /// `--stage-devices`: each stage's GPU.
    listed: Option<&'a [usize]>,
}

impl StageDevices<'_> {
    /// Each stage's GPU, for CUDA stages (none for the others), each one checked to exist.
    fn gpus(&self) -> Result<Vec<usize>> {
        use crate::backend::stages::{
            CUDA_STAGES_VARIABLE, check_cuda_stages_allowed, check_stage_devices, stage_devices,
        };
        match (self.device, self.listed) {
            (DeviceChoice::Cuda(first), listed) => {
                check_cuda_stages_allowed(
                    crate::backend::cuda::switches::switch(CUDA_STAGES_VARIABLE).as_deref(),
                )?;
                let gpus = stage_devices(first, self.stages, listed)?;
                check_stage_devices(&gpus, crate::backend::cuda::probe(first)?.devices)?;
                Ok(gpus)
            }
            (_, None) => Ok(Vec::new()),
            (_, Some(_)) => Err(Error::Input(InputError::BadStages {
                reason: "--stage-devices names the GPUs of CUDA stages: use it with --device cuda"
                    .into(),
            })),
        }
    }
}

/// Splits the model into stages, checks each running stage's memory against its device (the
/// machine's memory, shared, for CPU stages; each GPU's free memory for CUDA stages), then
/// loads them.
fn open_stages(
    plan: &ResolvedPlan,
    spec: CaptureSpec,
    devices: StageDevices<'_>,
    sizing: Sizing,
    progress: &Progress,
) -> Result<staged::Staged> {
    use crate::backend::stages::{Capacity, check_stage_memory, device_capacity, plan_stages};
    let (device, stages) = (devices.device, devices.stages);
    let gpus = devices.gpus()?;
    let config = ModelConfig::from_file(&plan.model.join("config.json"))?;
    check_cuda_model(&config, &spec, device)?;
    let checkpoint = crate::model::Checkpoint::open(&plan.model)?;
    // A GPU holds the weights in the mode's type (2 or 4 bytes a value, whatever the checkpoint
    // stores; AFMoE's small f32 routers aside); the CPU maps or decodes what is stored.
    let bytes = |prefix: &str| match (device, spec.precision) {
        (DeviceChoice::Cuda(_), Precision::Bf16) => 2 * checkpoint.stored_values(prefix),
        (DeviceChoice::Cuda(_), Precision::F32) => 4 * checkpoint.stored_values(prefix),
        _ => checkpoint.stored_bytes(prefix),
    };
    let block_bytes: Vec<u64> = (0..config.num_layers)
        .map(|b| bytes(&format!("model.layers.{b}.")))
        .collect();
    let embed = bytes("model.embed_tokens.");
    let mut stage_plan = plan_stages(&block_bytes, embed, spec.layers.deepest(), stages)?;
    let mut weights = Vec::with_capacity(stage_plan.running.len());
    for share in &mut stage_plan.running {
        let w =
            LlamaWeights::range_from_checkpoint(config.clone(), &checkpoint, share.blocks.clone())?;
        share.working_bytes = match device {
            DeviceChoice::Cuda(_) => CudaBackend::stage_batch_bytes(&w, &spec, sizing.batch_tokens),
            _ => CpuBackend::working_bytes(&w, &spec, sizing.batch_tokens),
        };
        tracing::info!(
            stage = weights.len() + 1,
            of = stage_plan.stages,
            first_block = share.blocks.start,
            last_block = share.blocks.end - 1,
            device = gpus.get(weights.len()).map(|gpu| format!("cuda:{gpu}")),
            weight_bytes = share.weight_bytes,
            working_bytes = share.working_bytes,
            "pipeline stage"
        );
        weights.push(w);
    }
    if let DeviceChoice::Cuda(_) = device {
        crate::memory::check_host(sizing.pipeline_bytes, crate::memory::available_bytes())?;
        let capacity = device_capacity(&stage_plan, &gpus, crate::backend::cuda::free_memory)?;
        check_stage_memory(&stage_plan, &capacity)?;
    } else if let Some(available) = crate::memory::available_bytes() {
        // The pipeline's own buffers come out of the same memory first.
        let left = available.saturating_sub(sizing.pipeline_bytes);
        check_stage_memory(&stage_plan, &Capacity::Shared(left))?;
    }
    read_weights(&weights.iter().collect::<Vec<_>>(), progress);
    let stages = weights
        .into_iter()
        .enumerate()
        .map(|(i, w)| open_stage(w, spec.clone(), (device, gpus.get(i).copied()), &sizing))
        .collect::<Result<Vec<_>>>()?;
    let width = spec.width(config.hidden_size);
    Ok(staged::Staged {
        stages,
        capture: (spec.sites.len(), spec.layers.len(), width),
        held: Held::of(device.is_cuda_arithmetic(), &spec),
        routes: spec.route_shape(&config),
    })
}

/// One stage's backend over `weights`: on `gpu` for CUDA stages (its largest batch allocated
/// now, against that GPU), replayed, or on the CPU.
fn open_stage(
    weights: LlamaWeights,
    spec: CaptureSpec,
    (device, gpu): (DeviceChoice, Option<usize>),
    sizing: &Sizing,
) -> Result<Box<dyn crate::backend::Stage>> {
    Ok(match (device, gpu) {
        (DeviceChoice::Cuda(_), Some(gpu)) => {
            let mut stage = CudaBackend::stage(weights, spec, gpu)?;
            stage.reserve(sizing.batch_tokens)?;
            Box::new(stage)
        }
        (DeviceChoice::CudaReplay, _) => Box::new(ReplayBackend::stage(weights, spec)?),
        _ => Box::new(CpuBackend::stage(weights, spec)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_memory_check_counts_the_pipelines_capture_buffers_and_the_shards_it_holds() {
        use std::num::NonZeroUsize;
        let plan = harvest_core::HarvestPlan {
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
            moe: None,
        };
        let plan = plan.resolve(&shape).unwrap();
        let encoded: Vec<Encoded> = [30, 50, 70, 10]
            .iter()
            .map(|&n| Encoded {
                ids: vec![1; n],
                truncated_from: None,
                roles: None,
            })
            .collect();
        // Batches of 100 tokens (the longest prompt is shorter); shards of 80 tokens at most.
        // Captures held as f32 (the CPU's) take 4 bytes a value, as bf16 (a GPU's) 2.
        for (held, value_bytes) in [(Held::F32, 4), (Held::Bf16, 2)] {
            let sizing = Sizing::of(&plan, &encoded, (4, 8, held), CAPTURE_POOL);
            assert_eq!(sizing.batch_tokens, 100);
            let captured = 100 * 4 * 8 * value_bytes;
            let shard = 80 * 4 * 8 * 2;
            let expected = captured * (CAPTURE_POOL - 1) + shard * SHARDS_HELD;
            assert_eq!(sizing.pipeline_bytes, expected as u64, "{held:?}");
        }
    }

    #[test]
    fn a_model_the_gpu_cannot_run_is_refused_by_feature_before_its_weights_are_read() {
        let model =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-afmoe-bf16");
        let plan = harvest_core::HarvestPlan {
            model,
            prompts: harvest_core::Location::Local("p.jsonl".into()),
            project_onto: None,
            output: harvest_core::Location::Local("out".into()),
            batch_tokens: std::num::NonZeroUsize::new(64).unwrap(),
            options: harvest_core::JobOptions::default(),
        };
        let plan = plan
            .resolve(&harvest_core::ModelShape {
                num_layers: 5,
                hidden_size: 64,
                moe: None,
            })
            .unwrap();
        let sizing = Sizing {
            batch_tokens: 64,
            pipeline_bytes: 0,
        };
        let progress = Progress::new(crate::pipeline::progress::ProgressMode::Off, 1);
        let spec = capture_spec(&plan, None);
        let Err(error) = open_backend(&plan, spec, DeviceChoice::Cuda(0), sizing, &progress) else {
            panic!("an AFMoE model opened on the CUDA backend");
        };
        let error = error.to_string();
        assert!(
            error.contains("AFMoE") && error.contains("--device cpu"),
            "{error}"
        );
        assert!(!progress.is_running(), "its weights were read first");
    }
}
