//! `harvester bench`: forward-pass throughput of an engine on a fixed corpus of token ids, next
//! to the throughput of a plain GEMM on the model's largest projection shape (the practical
//! ceiling): our own f32 kernel (`sgemm`) for the CPU, beside the `gemm` crate on the same shape,
//! and bf16 cuBLAS for CUDA. On the CPU it also measures the arithmetic ceilings themselves
//! (`backend::cpu::peak`). Weight loading is timed too.
//! `scripts/bench_cpu.py` runs the CPU engine beside PyTorch; the GPU window
//! (`scripts/gpu/run.sh`) runs CUDA beside transformers.

use std::path::Path;
use std::time::Instant;

use harvest_core::plan::Precision;
use harvest_core::{LayerSelection, Sites};
use serde::Serialize;

use crate::backend::cpu::CpuBackend;
use crate::backend::cpu::matmul::{MatRef, matmul_transposed};
use crate::backend::cpu::peak::{self, Peak};
use crate::backend::cpu::{bf16, sgemm};
use crate::backend::cuda::DeviceChoice;
use crate::backend::cuda::forward::{CudaBackend, LoadPhases};
use crate::backend::{Backend, Batch, CaptureSpec, Captured};
use crate::error::{Error, InputError, Result};
use crate::model::{LlamaWeights, ModelConfig};

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchConfig<'a> {
    /// Checkpoint directory.
    pub model: &'a Path,
    /// The corpus, one list of ids per prompt.
    pub prompts: Vec<Vec<u32>>,
    /// Kept layers (their depth decides how many blocks run).
    pub layers: LayerSelection,
    /// Kept hook sites. Other than `resid_post` alone, the same corpus also runs with
    /// `resid_post` alone, in alternating rounds, as the baseline.
    pub sites: Sites,
    /// Tokens per forward batch.
    pub batch_tokens: usize,
    /// The arithmetic.
    pub precision: Precision,
    /// The engine.
    pub device: DeviceChoice,
    /// Project onto this many seeded random directions instead of keeping activations.
    pub directions: Option<usize>,
    /// The forward pass alone: no GEMM rates or compute ceilings, whose buffers would add to
    /// the process's peak memory.
    pub forward_only: bool,
}

/// The figures, as printed (JSON).
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// Engine name.
    pub engine: &'static str,
    /// Directions projected onto (0: activations kept).
    pub directions: usize,
    /// The hook sites kept, comma-separated.
    pub sites: String,
    /// `f32` or `bf16`.
    pub precision: &'static str,
    /// Whether the bf16 products ran on `vdpbf16ps`.
    pub bf16_dot_instructions: bool,
    /// The CPU kernel level the run used (`HARVEST_CPU_LEVEL` caps it).
    pub cpu_level: &'static str,
    /// Layers kept.
    pub layers: usize,
    /// Worker threads.
    pub threads: usize,
    /// Prompts run.
    pub prompts: usize,
    /// Tokens run.
    pub tokens: usize,
    /// Blocks run per token.
    pub blocks: usize,
    /// Wall time of the timed passes, seconds.
    pub seconds: f64,
    /// Tokens per second.
    pub tokens_per_s: f64,
    /// Model FLOP per second achieved (projections and attention).
    pub gflops: f64,
    /// A plain f32 GEMM of the engine's own kernel, GFLOP/s (not measured `forward_only`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gemm_gflops: Option<f64>,
    /// On the CPU: the engine's f32 kernel (`sgemm`'s register block).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gemm_kernel: Option<&'static str>,
    /// On the CPU: the `gemm` crate on the same shape, GFLOP/s (a peer for our kernel).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gemm_crate_gflops: Option<f64>,
    /// On the CPU: our bf16 product on the same shape, GFLOP/s, with the weight packed ahead as
    /// the engine packs it at load (where it does: a CPU with a bf16 dot instruction).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gemm_bf16_gflops: Option<f64>,
    /// `gflops / gemm_gflops`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fraction_of_gemm: Option<f64>,
    /// The GEMM shape measured, `[m, n, k]`.
    pub gemm_shape: [usize; 3],
    /// On the CPU: the f32 FMA ceiling of every thread together, measured in the same run
    /// (before and after the timed pass; the higher).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub f32_fma_peak: Option<Peak>,
    /// On the CPU with `vdpbf16ps`: the bf16 dot ceiling, measured in the same run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bf16_dot_peak: Option<Peak>,
    /// `gflops` over this precision's own ceiling: the bf16 dot peak for bf16 products on
    /// `vdpbf16ps`, else the f32 FMA peak.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fraction_of_peak: Option<f64>,
    /// Seconds to read the checkpoint and hand the weights to the engine (on the CPU, every
    /// mapped page read in once).
    pub load_seconds: f64,
    /// Of `load_seconds`: reading the mapped checkpoint in from disk or the page cache.
    pub load_read_seconds: f64,
    /// On CUDA: rounding non-bf16 weights to bf16, uploading them, and compiling and loading
    /// the kernels.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cuda_load: Option<LoadPhases>,
    /// The loaded weights at 2 bytes a parameter (bf16, as the GPU holds them).
    pub weight_bytes_bf16: u64,
    /// `weight_bytes_bf16 / load_seconds`, GB/s.
    pub load_gb_per_s: f64,
    /// With sites other than `resid_post` alone: the same corpus with `resid_post` alone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline: Option<Baseline>,
}

/// The `resid_post`-alone run beside a many-site one.
#[derive(Debug, Clone, Serialize)]
pub struct Baseline {
    /// Always `resid_post`.
    pub sites: String,
    /// Tokens per second of the baseline.
    pub tokens_per_s: f64,
    /// The many-site run's tokens per second over the baseline's.
    pub fraction_of_baseline: f64,
}

/// Timed passes over the corpus per configuration when a baseline runs beside it; the two
/// alternate, so drifts in the machine's speed hit both alike.
const BASELINE_ROUNDS: usize = 3;

/// Seconds for one timed pass of `backend` over every batch, driven as a run drives it
/// ([`Backend::capture_next`]): the capture buffers of `pool` take turns, two where the
/// backend holds one batch back.
fn timed_pass(
    backend: &mut dyn Backend,
    batches: &[Batch],
    pool: &mut Vec<Captured>,
) -> Result<f64> {
    let start = Instant::now();
    for batch in batches {
        let buffer = pool.pop().unwrap_or_default();
        pool.extend(backend.capture_next(batch, buffer)?);
    }
    pool.extend(backend.finish()?);
    Ok(start.elapsed().as_secs_f64())
}

/// An untimed pass over the first two batches, which sizes every buffer of `pool` the timed
/// passes use.
fn warm_up(backend: &mut dyn Backend, batches: &[Batch], pool: &mut Vec<Captured>) -> Result<()> {
    timed_pass(backend, &batches[..batches.len().min(2)], pool).map(drop)
}

/// Mean seconds per pass of `ours` and of `base`, over [`BASELINE_ROUNDS`] rounds each, the
/// order swapped every round.
fn alternate(
    ours: &mut dyn Backend,
    base: &mut dyn Backend,
    batches: &[Batch],
    pool: &mut Vec<Captured>,
) -> Result<(f64, f64)> {
    let (mut mine, mut theirs) = (0.0, 0.0);
    for round in 0..BASELINE_ROUNDS {
        if round % 2 == 0 {
            mine += timed_pass(ours, batches, pool)?;
            theirs += timed_pass(base, batches, pool)?;
        } else {
            theirs += timed_pass(base, batches, pool)?;
            mine += timed_pass(ours, batches, pool)?;
        }
    }
    let rounds = BASELINE_ROUNDS as f64;
    Ok((mine / rounds, theirs / rounds))
}

/// Parameters of the loaded blocks and embedding.
fn parameters(weights: &LlamaWeights) -> usize {
    weights.embed.len()
        + weights
            .blocks
            .iter()
            .map(|b| {
                b.attn_norm.len()
                    + b.mlp_norm.len()
                    + b.matrices().iter().map(|m| m.len()).sum::<usize>()
            })
            .sum::<usize>()
}

/// Opens the engine `device` names over `weights`, with the CUDA load's phases.
fn open(
    weights: LlamaWeights,
    spec: CaptureSpec,
    device: DeviceChoice,
) -> Result<(Box<dyn Backend>, Option<LoadPhases>)> {
    Ok(match device {
        DeviceChoice::Cuda(ordinal) => {
            let backend = CudaBackend::new(weights, spec, ordinal)?;
            let phases = backend.load_phases();
            (Box::new(backend), Some(phases))
        }
        DeviceChoice::CudaReplay => {
            return Err(Error::Input(InputError::ReplayNotMeasured {
                command: "bench",
            }));
        }
        DeviceChoice::Cpu | DeviceChoice::Auto => (Box::new(CpuBackend::new(weights, spec)?), None),
    })
}

/// FLOP of one forward pass over `lengths`, counting matrix products and attention (the causal
/// half of the score and value products), through the first `blocks` blocks. An AFMoE block
/// adds its gate, its router and the experts each token is routed to.
pub fn forward_flops(config: &ModelConfig, lengths: &[usize], blocks: usize) -> f64 {
    let h = config.hidden_size as f64;
    let attn_width = (config.num_heads * config.head_dim) as f64;
    let tokens: f64 = lengths.iter().map(|&n| n as f64).sum();
    let attention: f64 = lengths
        .iter()
        .map(|&len| 2.0 * 2.0 * attn_width * len as f64 * (len as f64 + 1.0) / 2.0)
        .sum();
    let block = |b: usize| {
        let mut widths = config.qkv_width() as f64 + attn_width + 3.0 * config.mlp_width(b) as f64;
        if let Some(moe) = &config.afmoe {
            widths += attn_width;
            if config.is_sparse(b) {
                widths += moe.num_experts as f64
                    + 3.0 * (moe.experts_per_token * moe.expert_intermediate_size) as f64;
            }
        }
        2.0 * h * widths * tokens + attention
    };
    (0..blocks).map(block).sum()
}

/// The engines a benchmark times, loaded.
struct Loaded {
    model_config: ModelConfig,
    backend: Box<dyn Backend>,
    /// `resid_post` alone, when the benchmark keeps other sites.
    baseline: Option<Box<dyn Backend>>,
    parameters: usize,
    load_seconds: f64,
    read_seconds: f64,
    cuda_load: Option<LoadPhases>,
}

/// Loads the checkpoint and opens the engines, timing it.
fn load(config: &BenchConfig<'_>) -> Result<Loaded> {
    let load_start = Instant::now();
    let model_config = ModelConfig::from_file(&config.model.join("config.json"))?;
    let layers = config.layers.resolve(model_config.num_layers)?;
    let weights = LlamaWeights::load(config.model, Some(layers.deepest() + 1))?;
    let parameters = parameters(&weights);
    let directions = match config.directions {
        Some(count) => Some(random_directions(count, model_config.hidden_size)?),
        None => None,
    };
    let spec = CaptureSpec {
        layers,
        sites: config.sites.clone(),
        precision: config.precision,
        directions,
    };
    // Mapped weights load lazily; the load figure counts reading them all in, apart from
    // what the engine then does with them.
    let read_start = Instant::now();
    weights.touch();
    let read_seconds = read_start.elapsed().as_secs_f64();
    let baseline = if config.sites.is_default() {
        None
    } else {
        let spec = CaptureSpec {
            sites: Sites::default(),
            ..spec.clone()
        };
        Some(open(weights.clone(), spec, config.device)?.0)
    };
    let (backend, cuda_load) = open(weights, spec, config.device)?;
    Ok(Loaded {
        model_config,
        backend,
        baseline,
        parameters,
        load_seconds: load_start.elapsed().as_secs_f64(),
        read_seconds,
        cuda_load,
    })
}

/// Runs the benchmark: one warm-up pass over the first batch, then every batch timed.
pub fn run(config: BenchConfig<'_>) -> Result<BenchReport> {
    let Loaded {
        model_config,
        mut backend,
        mut baseline,
        parameters,
        load_seconds,
        read_seconds,
        cuda_load,
    } = load(&config)?;
    let weight_bytes_bf16 = 2 * parameters as u64;
    let blocks = backend.spec().layers.deepest() + 1;
    if config.prompts.is_empty() {
        return Err(Error::InvalidBatch {
            reason: "the benchmark corpus is empty".into(),
        });
    }
    let batches = pack(&config.prompts, config.batch_tokens.max(1));
    let mut pool = vec![Captured::default(), Captured::default()];
    warm_up(backend.as_mut(), &batches, &mut pool)?;
    let peaks_before = match config.device {
        _ if config.forward_only => (None, None),
        DeviceChoice::Cuda(_) | DeviceChoice::CudaReplay => (None, None),
        DeviceChoice::Cpu | DeviceChoice::Auto => cpu_peaks(),
    };
    let lengths: Vec<usize> = config.prompts.iter().map(Vec::len).collect();
    let tokens: usize = lengths.iter().sum();
    let (seconds, baseline) = match baseline.as_mut() {
        None => (timed_pass(backend.as_mut(), &batches, &mut pool)?, None),
        Some(base) => {
            warm_up(base.as_mut(), &batches, &mut pool)?;
            let (ours, theirs) = alternate(backend.as_mut(), base.as_mut(), &batches, &mut pool)?;
            let baseline = Baseline {
                sites: Sites::default().to_string(),
                tokens_per_s: tokens as f64 / theirs,
                fraction_of_baseline: theirs / ours,
            };
            (ours, Some(baseline))
        }
    };
    let gflops = forward_flops(&model_config, &lengths, blocks) / seconds / 1e9;
    let gemm_shape = [
        config.batch_tokens.clamp(256, 4096),
        2 * model_config.intermediate_size,
        model_config.hidden_size,
    ];
    let (gemm_gflops, cpu_rates, peaks) = match config.forward_only {
        true => (None, None, (None, None)),
        false => {
            let (gemm, cpu_rates, peaks) = device_rates(config.device, gemm_shape, peaks_before)?;
            (Some(gemm), cpu_rates, peaks)
        }
    };
    let (gemm_crate_gflops, gemm_bf16_gflops) = cpu_rates.unzip();
    let gemm_kernel = gemm_crate_gflops.map(|_| sgemm::Kernel::detect().name());
    let (f32_fma_peak, bf16_dot_peak) = peaks;
    let ceiling = match config.precision {
        Precision::Bf16 => bf16_dot_peak.or(f32_fma_peak),
        Precision::F32 => f32_fma_peak,
    };
    Ok(BenchReport {
        engine: backend.name(),
        directions: config.directions.unwrap_or(0),
        sites: config.sites.to_string(),
        precision: config.precision.as_str(),
        bf16_dot_instructions: bf16::has_dot_instructions(),
        cpu_level: crate::backend::cpu::level::Level::current().name(),
        layers: backend.spec().layers.len(),
        threads: rayon::current_num_threads(),
        prompts: config.prompts.len(),
        tokens,
        blocks,
        seconds,
        tokens_per_s: tokens as f64 / seconds,
        gflops,
        gemm_gflops,
        gemm_kernel,
        gemm_crate_gflops,
        gemm_bf16_gflops,
        fraction_of_gemm: gemm_gflops.map(|gemm| gflops / gemm),
        gemm_shape,
        f32_fma_peak,
        bf16_dot_peak,
        fraction_of_peak: ceiling.map(|peak| gflops / peak.gflops),
        load_seconds,
        load_read_seconds: read_seconds,
        cuda_load,
        weight_bytes_bf16,
        load_gb_per_s: weight_bytes_bf16 as f64 / load_seconds / 1e9,
        baseline,
    })
}

/// `count` seeded pseudo-random directions of width `hidden`, normalised.
fn random_directions(count: usize, hidden: usize) -> Result<crate::projection::Directions> {
    let mut state = 0x5eed_u64;
    let values: Vec<f32> = (0..count * hidden)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect();
    crate::projection::Directions::new(&values, count, hidden, hidden)
}

/// The bench's corpus: a JSON file of token-id lists (`ids`), or else a prompts file
/// tokenized as `harvester run` does.
pub fn load_corpus(
    model: &Path,
    ids: Option<&Path>,
    prompts: Option<&Path>,
) -> Result<Vec<Vec<u32>>> {
    match (ids, prompts) {
        (Some(ids), _) => {
            let text = std::fs::read_to_string(ids).map_err(|e| Error::io("reading", ids, e))?;
            serde_json::from_str(&text).map_err(|e| {
                Error::Input(InputError::Prompts {
                    source_name: ids.display().to_string(),
                    reason: format!("{e} (expected a JSON list of lists of token ids)"),
                })
            })
        }
        (None, Some(path)) => tokenize_prompts_file(model, path),
        (None, None) => Err(Error::Input(InputError::Prompts {
            source_name: "the bench".into(),
            reason: "no corpus: give --ids or --prompts".into(),
        })),
    }
}

/// Reads a prompts file and tokenizes it as `harvester run` does (special tokens added).
pub fn tokenize_prompts_file(model: &Path, path: &Path) -> Result<Vec<Vec<u32>>> {
    let config = ModelConfig::from_file(&model.join("config.json"))?;
    let bytes = std::fs::read(path).map_err(|e| Error::io("reading", path, e))?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let texts = crate::pipeline::prompts::parse_prompts(&name, &bytes)?;
    let tokenizer =
        crate::tokenizer::PromptTokenizer::from_dir(model, config.max_position_embeddings)?;
    Ok(tokenizer
        .encode_all(&texts, true)?
        .into_iter()
        .map(|e| e.ids)
        .collect())
}

/// Greedy packing of whole prompts into batches of at most `budget` tokens (a longer prompt
/// gets a batch of its own).
pub fn pack(prompts: &[Vec<u32>], budget: usize) -> Vec<Batch> {
    let mut batches = Vec::new();
    let mut current = Batch::default();
    for prompt in prompts {
        if current.num_tokens() > 0 && current.num_tokens() + prompt.len() > budget {
            batches.push(std::mem::take(&mut current));
        }
        current.push(prompt);
    }
    if current.num_tokens() > 0 {
        batches.push(current);
    }
    batches
}

/// The device's GEMM rate for `gemm_shape` (the CPU's also with the crate peer's and its bf16
/// kernel's) and the CPU's compute peaks, the higher of `peaks_before` and now.
#[allow(clippy::type_complexity)]
fn device_rates(
    device: DeviceChoice,
    gemm_shape: [usize; 3],
    peaks_before: (Option<Peak>, Option<Peak>),
) -> Result<(f64, Option<(f64, f64)>, (Option<Peak>, Option<Peak>))> {
    Ok(match device {
        DeviceChoice::Cuda(ordinal) => (
            crate::backend::cuda::forward::gemm_rate(ordinal, gemm_shape)?,
            None,
            (None, None),
        ),
        DeviceChoice::CudaReplay => {
            return Err(Error::Input(InputError::ReplayNotMeasured {
                command: "bench",
            }));
        }
        DeviceChoice::Cpu | DeviceChoice::Auto => {
            // The bf16 rate with the weight packed at load, as the engine runs it.
            let [ours, crate_peer, _, ours_bf16] = gemm_rates(gemm_shape, 6);
            let (f32_after, bf16_after) = cpu_peaks();
            let peaks = (
                higher(peaks_before.0, f32_after),
                higher(peaks_before.1, bf16_after),
            );
            (ours, Some((crate_peer, ours_bf16)), peaks)
        }
    })
}

/// The CPU's f32 FMA and bf16 dot ceilings.
fn cpu_peaks() -> (Option<Peak>, Option<Peak>) {
    (peak::f32_fma(), peak::bf16_dot())
}

/// The higher of two measurements of one ceiling. The benchmark measures each ceiling before and
/// after the timed pass and keeps the higher: on a shared VM a moment's contention halves a
/// short measurement, and a low ceiling would flatter the fraction reached.
fn higher(a: Option<Peak>, b: Option<Peak>) -> Option<Peak> {
    match (a, b) {
        (Some(a), Some(b)) => Some(if b.gflops > a.gflops { b } else { a }),
        (a, b) => a.or(b),
    }
}

/// GFLOP/s of `out[m, n] = a[m, k] · b[n, k]ᵀ` on our f32 kernel, on the `gemm` crate, on our
/// bf16 product (the operands rounded to bf16) packing the weight as it runs, and on the same
/// with the weight packed once beforehand, as the engine packs it at load (where the CPU has no
/// bf16 dot instruction nothing is packed ahead, and the last two time the same path). Each is
/// the best of `rounds` runs after a warm-up, the four alternating so drifts hit all alike.
pub fn gemm_rates([m, n, k]: [usize; 3], rounds: usize) -> [f64; 4] {
    let a: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 * 0.01).collect();
    let b: Vec<f32> = (0..n * k).map(|i| (i % 13) as f32 * 0.01).collect();
    let a16: Vec<u16> = a.iter().map(|&v| bf16::to_bf16_bits(v)).collect();
    let b16: Vec<u16> = b.iter().map(|&v| bf16::to_bf16_bits(v)).collect();
    let packed_weight = bf16::PackedWeight::of(&b16, k);
    let (a, b) = (MatRef::dense(&a, m, k), MatRef::dense(&b, n, k));
    let mut out = vec![0.0f32; m * n];
    let mut packed = bf16::Packed::default();
    let mut best = [f64::INFINITY; 4];
    for round in 0..=rounds {
        let start = Instant::now();
        sgemm::product(a, &b, &mut out, n, false);
        let ours = start.elapsed().as_secs_f64();
        let start = Instant::now();
        matmul_transposed(a, b, &mut out, n, 1.0, false, gemm::Parallelism::Rayon(0));
        let theirs = start.elapsed().as_secs_f64();
        let start = Instant::now();
        bf16::matmul_bf16(&a16, &b16, k, &mut out, n, false, &mut packed);
        let ours_bf16 = start.elapsed().as_secs_f64();
        let start = Instant::now();
        match &packed_weight {
            Some(w) => {
                let w = bf16::Weight::Packed(w);
                bf16::weight_product(&a16, w, &mut out, n, false, &mut packed);
            }
            None => bf16::matmul_bf16(&a16, &b16, k, &mut out, n, false, &mut packed),
        }
        let ours_bf16_packed = start.elapsed().as_secs_f64();
        if round > 0 {
            let times = [ours, theirs, ours_bf16, ours_bf16_packed];
            best = std::array::from_fn(|i| best[i].min(times[i]));
        }
    }
    best.map(|seconds| 2.0 * (m * n * k) as f64 / seconds / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forward_only_bench_times_the_pass_and_measures_no_gemm_rates_or_ceilings() {
        let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-qwen2-f32");
        let prompts = vec![vec![5, 9, 11, 2], vec![7; 9]];
        let report = run(BenchConfig {
            model: &model,
            prompts,
            layers: LayerSelection::All,
            sites: Sites::default(),
            batch_tokens: 8,
            precision: Precision::F32,
            device: DeviceChoice::Cpu,
            directions: None,
            forward_only: true,
        })
        .unwrap();
        assert_eq!((report.prompts, report.tokens), (2, 13));
        assert!(report.tokens_per_s > 0.0);
        assert_eq!((report.gemm_gflops, report.fraction_of_gemm), (None, None));
        assert!(report.f32_fma_peak.is_none() && report.bf16_dot_peak.is_none());
        let json = serde_json::to_string(&report).unwrap();
        assert!(
            !json.contains("gemm_gflops") && !json.contains("fraction_of_gemm"),
            "{json}"
        );
    }

    #[test]
    fn packing_respects_the_budget_and_keeps_order() {
        let prompts = vec![vec![1; 3], vec![2; 3], vec![3; 5], vec![4; 1]];
        let batches = pack(&prompts, 6);
        let sizes: Vec<usize> = batches.iter().map(Batch::num_tokens).collect();
        assert_eq!(sizes, [6, 6]);
        assert_eq!(batches[1].input_ids, [3, 3, 3, 3, 3, 4]);
        assert_eq!(
            pack(&[vec![1; 9], vec![2; 1]], 4).len(),
            2,
            "a long prompt gets a batch of its own"
        );
    }
}
