//! The CUDA forward pass: the model's blocks as `crate::model` writes them (dense, and AFMoE in
//! `afmoe`) on one GPU, each op a kernel launch or a cuBLAS GEMM over the batch's buffers
//! (`DeviceOps`). The
//! residual stream stays f32; GEMM inputs are bf16 with f32 accumulation (cuBLAS `gemm_ex`),
//! QKV and gate/up each one fused GEMM, and the attention output and down projections add
//! straight into the residual (`beta = 1`). Kernels come from `kernels.cu`, compiled once.
//!
//! Checked on an H200 by the GPU window (`scripts/gpu-window.sh`, figures in `docs/gpu.md`):
//! as close to transformers float32 as the CPU bf16 mode. Attention runs on tensor cores
//! (`attention_mma_<D>`) for head widths 64 and 128, else on the CUDA-core kernel.

mod afmoe;
mod element;
mod staging;

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::cudaDataType;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtrMut, DeviceRepr};
use rayon::prelude::*;

use super::download::Slots;
use super::error::CudaError;
use super::kernels::{self, KernelCode};
use super::launch::{self, AttentionKernel, AttentionShape, gemm};
use super::plan::{ATTENTION_VARIABLE, attention_tiles, check_heads, uses_tensor_cores};
use harvest_core::{Site, Sites};

use crate::backend::{Backend, Batch, CaptureSpec, Captured, Stage};
use crate::error::Result;
use crate::model::dense::{BlockOps, Source, Sublayer};
use crate::model::{LlamaWeights, Matrix, ModelConfig};
use harvest_core::plan::Precision;

pub(super) use self::element::{Activation, decoded_f32};
use self::staging::{Plain, Staging, UPLOAD_VARIABLE};

/// GEMM outputs added into the f32 residual stream.
const F32: cudaDataType = cudaDataType::CUDA_R_32F;

/// Setting up on a device failed: that machine cannot run the backend.
fn driver(error: impl std::fmt::Display) -> crate::Error {
    CudaError::unavailable(error).into()
}

/// Rows one conversion task rounds.
const CONVERT_ROWS: usize = 64;

/// f32 values (norm weights) rounded to bf16 bits (`half`'s rounding, to nearest even).
pub(super) fn bf16_values(values: &[f32]) -> Vec<u16> {
    values
        .par_iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect()
}

/// A matrix rounded to bf16 bits, its rows decoded and rounded in parallel tasks of
/// [`CONVERT_ROWS`] (the load's conversion phase: a bf16 checkpoint's mapped bytes skip it).
pub(super) fn rounded_bf16(matrix: &Matrix) -> Vec<u16> {
    let cols = matrix.cols();
    let mut bits = vec![0u16; matrix.len()];
    if cols == 0 {
        return bits;
    }
    bits.par_chunks_mut(cols * CONVERT_ROWS)
        .enumerate()
        .for_each(|(task, out)| {
            let mut values = vec![0.0f32; out.len()];
            matrix.decode_rows(task * CONVERT_ROWS, &mut values);
            for (b, &v) in out.iter_mut().zip(&values) {
                *b = half::bf16::from_f32(v).to_bits();
            }
        });
    bits
}

/// Seconds each phase of putting the weights on the device took.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct LoadPhases {
    /// Rounding f32 or f16 weights to bf16 on the host (none for a bf16 checkpoint).
    pub convert_seconds: f64,
    /// Copying the weights to the device (staged: from the first chunk queued to the last
    /// one done).
    pub upload_seconds: f64,
    /// Compiling the kernels and loading their module.
    pub kernels_seconds: f64,
    /// The form of the kernels that loaded.
    pub kernel_code: &'static str,
    /// The attention kernel chosen for the model's head width.
    pub attention_kernel: &'static str,
    /// Whether the weights went up through page-locked staging buffers (else from pageable
    /// memory, by the driver).
    pub staged: bool,
}

/// A mapped bf16 part viewed as bf16 bits, when it is 2-byte aligned (a safetensors payload
/// is; the view is refused otherwise and the caller converts).
fn bf16_bits(part: &[u8]) -> Option<&[u16]> {
    // SAFETY: every bit pattern is a valid u16, and `align_to` only yields the aligned middle;
    // empty ends mean the whole part was viewed. x86-64 is little-endian, as safetensors is.
    #[allow(unsafe_code)]
    let (head, bits, tail) = unsafe { part.align_to::<u16>() };
    (head.is_empty() && tail.is_empty()).then_some(bits)
}

/// Puts weights on the device, timing conversion and upload apart.
pub(super) struct Uploader<'a> {
    stream: &'a Arc<CudaStream>,
    phases: LoadPhases,
    /// Page-locked buffers the weights pass through, unless the driver's pageable path is
    /// kept (`staging`).
    staging: Option<Staging>,
}

impl Uploader<'_> {
    /// Queues `values` for `device` starting at element `offset`; `values` may be dropped on
    /// return (they are staged, or copied by the driver before it returns).
    fn copy<T: Plain>(
        &mut self,
        values: &[T],
        device: &mut CudaSlice<T>,
        offset: usize,
    ) -> Result<()> {
        let start = Instant::now();
        let failed = |e| memory_error("uploading the weights")(e);
        let mut view = device.slice_mut(offset..offset + values.len());
        match &mut self.staging {
            Some(staging) => {
                let (dst, _record) = view.device_ptr_mut(self.stream);
                staging
                    .upload(self.stream, T::bytes(values), dst)
                    .map_err(failed)?;
            }
            None => self.stream.memcpy_htod(values, &mut view).map_err(failed)?,
        }
        self.phases.upload_seconds += start.elapsed().as_secs_f64();
        Ok(())
    }

    /// Waits for the last staged uploads, counting the wait as upload time.
    fn finish(&mut self) -> Result<()> {
        let start = Instant::now();
        if let Some(staging) = &self.staging {
            staging
                .finish()
                .map_err(|e| memory_error("uploading the weights")(e))?;
        }
        self.phases.upload_seconds += start.elapsed().as_secs_f64();
        Ok(())
    }

    fn alloc<T: Plain>(&mut self, len: usize) -> Result<CudaSlice<T>> {
        // SAFETY: every element is written by `copy` before any kernel reads it (the callers
        // cover `0..len` with their parts).
        #[allow(unsafe_code)]
        // One value at least: the driver refuses empty allocations (a sparse block without
        // shared experts has no MLP of its own).
        let slice = unsafe { self.stream.alloc::<T>(len.max(1)) };
        slice.map_err(|e| memory_error("allocating the weights")(e))
    }

    /// f32 values (biases) as they are.
    fn f32s(&mut self, values: &[f32]) -> Result<CudaSlice<f32>> {
        let start = Instant::now();
        let device = self
            .stream
            .clone_htod(values)
            .map_err(|e| memory_error("uploading the weights")(e))?;
        self.phases.upload_seconds += start.elapsed().as_secs_f64();
        Ok(device)
    }

    /// One decoder block's weights, in `E`.
    fn block<E: Activation>(
        &mut self,
        block: &crate::model::BlockWeights,
    ) -> Result<DeviceBlock<E>> {
        Ok(DeviceBlock {
            attn_norm: E::upload_values(self, &block.attn_norm)?,
            qkv: E::upload_matrix(self, &block.qkv)?,
            qkv_bias: block
                .qkv_bias
                .as_deref()
                .map(|b| self.f32s(b))
                .transpose()?,
            o: E::upload_matrix(self, &block.o)?,
            o_bias: block.o_bias.as_deref().map(|b| self.f32s(b)).transpose()?,
            mlp_norm: E::upload_values(self, &block.mlp_norm)?,
            gate_up: E::upload_matrix(self, &block.gate_up)?,
            down: E::upload_matrix(self, &block.down)?,
            inter: block.down.cols(),
            afmoe: block.afmoe.as_ref().map(|a| self.afmoe(a)).transpose()?,
        })
    }
}

/// A closure that classes a driver error met during `action`: out of device memory, or a fault.
fn memory_error(action: &'static str) -> impl Fn(cudarc::driver::DriverError) -> crate::Error {
    move |error| CudaError::from_driver(action, error).into()
}

/// The attention kernel for heads of `head_dim` in `E`: on tensor cores where one is built for
/// that width and the mode is bf16 (unless `HARVEST_CUDA_ATTENTION=simple`), else the CUDA-core
/// kernel of the mode.
fn attention_kernel<E: Activation>(
    function: &dyn Fn(&str) -> Result<CudaFunction>,
    head_dim: usize,
) -> Result<AttentionKernel> {
    let forced = std::env::var(ATTENTION_VARIABLE).ok();
    let bf16 = E::PRECISION == Precision::Bf16;
    Ok(if bf16 && uses_tensor_cores(head_dim, forced.as_deref()) {
        let name = if head_dim == 64 {
            "attention_mma_64"
        } else {
            "attention_mma_128"
        };
        AttentionKernel {
            function: function(name)?,
            name,
            queries_per_block: kernels::ATTENTION_MMA_QUERIES_PER_BLOCK,
            threads: kernels::ATTENTION_MMA_THREADS,
            takes_head_dim: false,
        }
    } else {
        let name = if bf16 {
            "attention_varlen"
        } else {
            "attention_varlen_f32"
        };
        AttentionKernel {
            function: function(name)?,
            name,
            queries_per_block: kernels::ATTENTION_QUERIES_PER_BLOCK,
            threads: 32 * kernels::ATTENTION_QUERIES_PER_BLOCK,
            takes_head_dim: true,
        }
    })
}

/// Compiles the kernels and loads them on `context` in the first form of `order` that loads.
fn load_kernels(
    context: &Arc<CudaContext>,
    order: &[KernelCode],
) -> Result<(Arc<cudarc::driver::CudaModule>, KernelCode)> {
    let mut attempts = Vec::new();
    for &code in order {
        let image = match kernels::compile(code) {
            Ok(image) => image,
            Err(crate::Error::Cuda(CudaError::Compile { log })) => {
                attempts.push(format!("{}: did not compile: {log}", code.as_str()));
                continue;
            }
            Err(other) => return Err(other),
        };
        match context.load_module(image) {
            Ok(module) => return Ok((module, code)),
            Err(e) => attempts.push(format!("{}: {e}", code.as_str())),
        }
    }
    let nvrtc = kernels::nvrtc_version().map_or_else(
        |e| e.to_string(),
        |(major, minor)| format!("{major}.{minor}"),
    );
    Err(CudaError::ModuleLoad {
        attempts: attempts.join("; "),
        nvrtc,
        driver: super::driver_version().unwrap_or_else(|| "unknown".into()),
    }
    .into())
}

struct Kernels {
    embed_gather: CudaFunction,
    rms_norm: CudaFunction,
    rms_norm_wide: CudaFunction,
    head_norm: CudaFunction,
    sigmoid_gate: CudaFunction,
    moe_gather: CudaFunction,
    moe_scatter: CudaFunction,
    rope: CudaFunction,
    swiglu: CudaFunction,
    round_bf16: CudaFunction,
    add_rows: CudaFunction,
    add_bias_bf16: CudaFunction,
    add_bias: CudaFunction,
    attention: AttentionKernel,
    project: CudaFunction,
}

impl Kernels {
    /// Compiles the kernels, loads them on `context` in the first form that loads
    /// ([`kernels::CODE_VARIABLE`] may force one) and finds each entry point, the typed ones
    /// for activations of `E`; the attention kernel is the one for heads of `head_dim`.
    fn load<E: Activation>(
        context: &Arc<CudaContext>,
        head_dim: usize,
    ) -> Result<(Self, KernelCode)> {
        let order = KernelCode::order(std::env::var(kernels::CODE_VARIABLE).ok().as_deref())?;
        let (module, code) = load_kernels(context, &order)?;
        let function = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| CudaError::from_driver("finding a kernel in its module", e).into())
        };
        let typed = |name: &str| function(&format!("{name}{}", E::KERNEL_SUFFIX));
        let kernels = Self {
            embed_gather: typed("embed_gather")?,
            rms_norm: typed("rms_norm")?,
            rms_norm_wide: function(E::WIDE_NORM)?,
            head_norm: typed("head_norm")?,
            sigmoid_gate: typed("sigmoid_gate")?,
            moe_gather: typed("moe_gather")?,
            moe_scatter: function("moe_scatter")?,
            rope: typed("rope")?,
            swiglu: typed("swiglu")?,
            round_bf16: function("round_bf16")?,
            add_rows: function("add_rows")?,
            add_bias_bf16: function("add_bias_bf16")?,
            add_bias: function("add_bias")?,
            attention: attention_kernel::<E>(&function, head_dim)?,
            project: function("project")?,
        };
        Ok((kernels, code))
    }
}

/// One block's weights on the device, in the mode's type `E`.
struct DeviceBlock<E> {
    attn_norm: CudaSlice<E>,
    qkv: CudaSlice<E>,
    /// Qwen2's (or Llama's `attention_bias`) QKV bias, f32.
    qkv_bias: Option<CudaSlice<f32>>,
    o: CudaSlice<E>,
    /// Llama's `attention_bias` O bias, f32.
    o_bias: Option<CudaSlice<f32>>,
    mlp_norm: CudaSlice<E>,
    gate_up: CudaSlice<E>,
    down: CudaSlice<E>,
    /// The MLP's inner width: the dense MLP's, or a sparse block's shared experts' (0 for none).
    inter: usize,
    afmoe: Option<afmoe::DeviceAfmoe<E>>,
}

/// Activation buffers for up to `tokens` tokens, those between kernels in `E`; they only grow.
struct Scratch<E> {
    tokens: usize,
    ids: CudaSlice<u32>,
    positions: CudaSlice<u32>,
    cu_seq_lengths: CudaSlice<u32>,
    tiles: CudaSlice<u32>,
    x: CudaSlice<f32>,
    normed: CudaSlice<E>,
    qkv: CudaSlice<E>,
    /// The QKV product in f32 before its bias joins it and it is rounded; one value when the
    /// model has none or the mode is f32 (the product gains its bias in place).
    qkv_wide: CudaSlice<f32>,
    attn: CudaSlice<E>,
    gate_up: CudaSlice<E>,
    act: CudaSlice<E>,
    /// A branch output kept as a hook site (`attn_out`, `mlp_out`), or given its bias, before
    /// it joins `x`; one value when the job keeps neither and the model has no output bias.
    branch: CudaSlice<f32>,
    kept: Kept,
    /// AFMoE's own buffers, for an AFMoE model.
    afmoe: Option<afmoe::AfmoeScratch<E>>,
}

/// The kept layers' slots: residual rows in bf16, or projections in f32.
enum Kept {
    Rows(Slots<u16>),
    Projections(Slots<f32>),
}

/// The CUDA backend on one device, computing in the job's precision: a `Device` of bf16 or
/// of f32 activations.
pub struct CudaBackend {
    device: Box<dyn DevicePass>,
}

/// What [`CudaBackend`] asks of the pass in either precision.
trait DevicePass: Backend + Stage {
    fn reserve(&mut self, tokens: usize) -> Result<()>;
    fn load_phases(&self) -> LoadPhases;
}

impl<E: Activation> DevicePass for Device<E> {
    fn reserve(&mut self, tokens: usize) -> Result<()> {
        self.ensure_scratch(tokens)
    }

    fn load_phases(&self) -> LoadPhases {
        self.phases
    }
}

/// The pass on one device, its activations between kernels in `E`.
struct Device<E> {
    spec: CaptureSpec,
    config: ModelConfig,
    stream: Arc<CudaStream>,
    /// Copies kept layers to the host while later blocks run on `stream`.
    copies: Arc<CudaStream>,
    blas: CudaBlas,
    kernels: Kernels,
    /// The embedding, on the first stage only.
    embed: Option<CudaSlice<E>>,
    /// The model's block the first of `blocks` is (0 unless this is a later pipeline stage).
    first_block: usize,
    /// The blocks this backend runs, up to the deepest kept one.
    blocks: Vec<DeviceBlock<E>>,
    /// The kept layers (positions among the job's) that `blocks` hold: this backend's slots.
    kept: Range<usize>,
    inv_freq: CudaSlice<f32>,
    directions: Option<CudaSlice<f32>>,
    scratch: Option<Scratch<E>>,
    host_tiles: Vec<u32>,
    phases: LoadPhases,
    /// Whether some block has a QKV bias, and an O bias: they need buffers of their own.
    qkv_bias: bool,
    o_bias: bool,
    /// The widest MLP among the blocks.
    mlp_width: usize,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("precision", &self.device.spec().precision)
            .finish_non_exhaustive()
    }
}

/// Why a model cannot run on this backend (its head shapes): read off its configuration, so
/// a model is refused before its weights are read.
pub fn check_model(config: &ModelConfig) -> Result<()> {
    check_heads(config.num_heads, config.num_kv_heads, config.head_dim)
}

/// The environment variable that lets AFMoE run on a GPU before a GPU window has checked it.
pub const CUDA_AFMOE_VARIABLE: &str = "HARVEST_CUDA_AFMOE";
/// The environment variable that lets the f32 mode run on a GPU before a GPU window has
/// checked it.
pub const CUDA_F32_VARIABLE: &str = "HARVEST_CUDA_F32";

/// Refuses what has run only on the replay, on a GPU, unless its variable (read by `env`) is
/// `try`, as the GPU window sets them: AFMoE ([`CUDA_AFMOE_VARIABLE`]) and the f32 mode
/// ([`CUDA_F32_VARIABLE`]).
pub fn check_unchecked(
    config: &ModelConfig,
    precision: Precision,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<()> {
    let tried = |variable: &str| env(variable).as_deref().map(str::trim) == Some("try");
    let unchecked = if config.afmoe.is_some() && !tried(CUDA_AFMOE_VARIABLE) {
        Some((
            "AFMoE (AfmoeForCausalLM)",
            CUDA_AFMOE_VARIABLE,
            "use --device cpu",
        ))
    } else if precision == Precision::F32 && !tried(CUDA_F32_VARIABLE) {
        Some((
            "The f32 mode",
            CUDA_F32_VARIABLE,
            "ask for bf16 (--precision bf16, or no precision: a GPU's own), or use --device cpu",
        ))
    } else {
        None
    };
    match unchecked {
        None => Ok(()),
        Some((feature, variable, instead)) => Err(CudaError::Unchecked {
            feature,
            variable,
            instead,
        }
        .into()),
    }
}

impl CudaBackend {
    /// Uploads `weights` (the blocks up to the deepest kept one) to GPU `ordinal` in the
    /// spec's precision and compiles the kernels.
    pub fn new(weights: LlamaWeights, spec: CaptureSpec, ordinal: usize) -> Result<Self> {
        spec.check(&weights)?;
        Self::load(weights, spec, ordinal)
    }

    /// A pipeline stage on GPU `ordinal`: `weights` holds a range of the model's blocks (and
    /// the embedding when it starts at block 0); the residual stream arrives from the stage
    /// before through host memory and leaves the same way.
    pub fn stage(weights: LlamaWeights, spec: CaptureSpec, ordinal: usize) -> Result<Self> {
        spec.check_directions(&weights)?;
        Self::load(weights, spec, ordinal)
    }

    fn load(weights: LlamaWeights, spec: CaptureSpec, ordinal: usize) -> Result<Self> {
        check_model(&weights.config)?;
        check_unchecked(&weights.config, spec.precision, &|name| {
            std::env::var(name).ok()
        })?;
        let device: Box<dyn DevicePass> = match spec.precision {
            Precision::Bf16 => Box::new(Device::<u16>::load(weights, spec, ordinal)?),
            Precision::F32 => Box::new(Device::<f32>::load(weights, spec, ordinal)?),
        };
        Ok(Self { device })
    }

    /// Allocates the buffers of a batch of `tokens` now, refusing one that does not fit the
    /// device's free memory ([`CudaError::DoesNotFit`], naming the bytes).
    pub fn reserve(&mut self, tokens: usize) -> Result<()> {
        self.device.reserve(tokens)
    }

    /// How long each phase of the load took.
    pub fn load_phases(&self) -> LoadPhases {
        self.device.load_phases()
    }

    /// Device bytes a batch of `tokens` needs on a stage holding `weights` (its blocks up to
    /// the deepest kept one): what the stage plan checks against a GPU before loading.
    pub fn stage_batch_bytes(weights: &LlamaWeights, spec: &CaptureSpec, tokens: usize) -> u64 {
        let first = weights.first_block;
        let run = spec.blocks_to_run(first, weights.blocks.len());
        let blocks = &weights.blocks[..run];
        let buffers = BatchBuffers {
            kept_layers: spec.kept_in(first..first + run).len(),
            branch: keeps_branches(&spec.sites)
                || blocks.iter().any(|b| b.o_bias.is_some())
                || weights.config.afmoe.is_some(),
            qkv_wide: blocks.iter().any(|b| b.qkv_bias.is_some()),
            mlp_width: mlp_width(blocks),
            value_bytes: value_bytes(spec.precision),
        };
        buffers.bytes(&weights.config, spec, tokens)
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn capture_width(&self) -> usize {
        self.device.capture_width()
    }

    fn spec(&self) -> &CaptureSpec {
        self.device.spec()
    }

    fn capture(&mut self, batch: &Batch, out: &mut Captured) -> Result<()> {
        self.device.capture(batch, out)
    }
}

impl Stage for CudaBackend {
    fn forward(&mut self, batch: &Batch, x: &mut Vec<f32>, out: &mut Captured) -> Result<()> {
        self.device.forward(batch, x, out)
    }
}

/// Bytes of one activation between kernels in `precision`.
fn value_bytes(precision: Precision) -> usize {
    match precision {
        Precision::Bf16 => 2,
        Precision::F32 => 4,
    }
}

impl<E: Activation> Device<E> {
    fn load(weights: LlamaWeights, spec: CaptureSpec, ordinal: usize) -> Result<Self> {
        let config = weights.config.clone();
        super::probe(ordinal)?;
        let first_block = weights.first_block;
        let run = spec.blocks_to_run(first_block, weights.blocks.len());
        let kept = spec.kept_in(first_block..first_block + run);
        let context = CudaContext::new(ordinal).map_err(driver)?;
        // SAFETY: called before any buffer or second stream exists. Every launch, GEMM and
        // upload runs on `stream`, in order; the one other stream, `copies`, only reads kept
        // slots, each behind an event recorded after the slot is written (`Slots::send`), and
        // `capture` waits for every copy before it returns, so no slot or host buffer is
        // reused while a copy may read it. cudarc's per-buffer events would add a record and
        // a wait to every launch for nothing.
        #[allow(unsafe_code)]
        unsafe {
            context.disable_event_tracking();
        }
        let stream = context.default_stream();
        let copies = context.new_stream().map_err(driver)?;
        let kernels_start = Instant::now();
        let (kernels, code) = Kernels::load::<E>(&context, config.head_dim)?;
        let blas = CudaBlas::new(stream.clone()).map_err(driver)?;
        let staging = Staging::new(&context, std::env::var(UPLOAD_VARIABLE).ok().as_deref());
        let mut up = Uploader {
            stream: &stream,
            phases: LoadPhases {
                kernels_seconds: kernels_start.elapsed().as_secs_f64(),
                kernel_code: code.as_str(),
                attention_kernel: kernels.attention.name,
                staged: staging.is_some(),
                ..LoadPhases::default()
            },
            staging,
        };
        let embed = if first_block == 0 {
            Some(E::upload_matrix(&mut up, &weights.embed)?)
        } else {
            None
        };
        let blocks = weights.blocks[..run]
            .iter()
            .map(|b| up.block(b))
            .collect::<Result<Vec<_>>>()?;
        up.finish()?;
        let phases = up.phases;
        let inv_freq: Vec<f32> = config
            .inverse_frequencies()
            .iter()
            .map(|&f| f as f32)
            .collect();
        let inv_freq = stream.clone_htod(&inv_freq).map_err(driver)?;
        let directions = match &spec.directions {
            Some(d) => Some(stream.clone_htod(d.unit_vectors()).map_err(driver)?),
            None => None,
        };
        stream
            .synchronize()
            .map_err(|e| CudaError::from_driver("uploading the weights", e))?;
        Ok(Self {
            spec,
            config,
            stream,
            copies,
            blas,
            kernels,
            embed,
            first_block,
            blocks,
            kept,
            inv_freq,
            directions,
            scratch: None,
            host_tiles: Vec::new(),
            phases,
            qkv_bias: weights.blocks.iter().any(|b| b.qkv_bias.is_some()),
            o_bias: weights.blocks.iter().any(|b| b.o_bias.is_some()),
            mlp_width: mlp_width(&weights.blocks[..run]),
        })
    }

    /// Capture slots on this device: each kept site of the kept layers its blocks hold.
    fn slots(&self) -> usize {
        self.spec.sites.len() * self.kept.len()
    }

    /// Whether a batch needs the branch buffer: a kept branch output, an O bias, or AFMoE's
    /// branch norms.
    fn needs_branch(&self) -> bool {
        keeps_branches(&self.spec.sites) || self.o_bias || self.config.afmoe.is_some()
    }

    /// Device bytes a batch of `tokens` needs for its activations and captured rows.
    fn batch_bytes(&self, tokens: usize) -> u64 {
        let buffers = BatchBuffers {
            kept_layers: self.kept.len(),
            branch: self.needs_branch(),
            qkv_wide: self.qkv_bias,
            mlp_width: self.mlp_width,
            value_bytes: size_of::<E>(),
        };
        buffers.bytes(&self.config, &self.spec, tokens)
    }

    fn ensure_scratch(&mut self, tokens: usize) -> Result<()> {
        if self.scratch.as_ref().is_some_and(|s| s.tokens >= tokens) {
            return Ok(());
        }
        // The old buffers go first, so their bytes count as free.
        self.scratch = None;
        let needed = self.batch_bytes(tokens);
        let (free, total) = self
            .stream
            .context()
            .mem_get_info()
            .map_err(|e| CudaError::from_driver("reading the free device memory", e))?;
        super::plan::check_fits(tokens, needed, free as u64, total as u64)?;
        let c = &self.config;
        let width = self.capture_width();
        let kept = self.slots();
        let branch = if self.needs_branch() {
            tokens * c.hidden_size
        } else {
            1
        };
        // The f32 mode adds the bias to its f32 product in place.
        let qkv_wide = if self.qkv_bias && E::PRECISION == Precision::Bf16 {
            tokens * c.qkv_width()
        } else {
            1
        };
        let s = &self.stream;
        let action = "allocating a batch's activations";
        let f32s = |n: usize| s.alloc_zeros::<f32>(n).map_err(memory_error(action));
        let values = |n: usize| s.alloc_zeros::<E>(n).map_err(memory_error(action));
        let u32s = |n: usize| s.alloc_zeros::<u32>(n).map_err(memory_error(action));
        self.scratch = Some(Scratch {
            tokens,
            ids: u32s(tokens)?,
            positions: u32s(tokens)?,
            cu_seq_lengths: u32s(tokens + 1)?,
            tiles: u32s(2 * tokens)?,
            x: f32s(tokens * c.hidden_size)?,
            normed: values(tokens * c.hidden_size)?,
            qkv: values(tokens * c.qkv_width())?,
            qkv_wide: f32s(qkv_wide)?,
            attn: values(tokens * c.num_heads * c.head_dim)?,
            gate_up: values(tokens * 2 * self.mlp_width.max(1))?,
            act: values(tokens * self.mlp_width.max(1))?,
            branch: f32s(branch)?,
            kept: if self.spec.directions.is_some() {
                Kept::Projections(Slots::new(s, kept, tokens * width)?)
            } else {
                Kept::Rows(Slots::new(s, kept, tokens * width)?)
            },
            afmoe: match c.afmoe {
                Some(_) => Some(afmoe::AfmoeScratch::new(s, c, tokens)?),
                None => None,
            },
        });
        if let Some(scratch) = &self.scratch {
            let pinned_bytes = match &scratch.kept {
                Kept::Rows(slots) => slots.host_bytes(),
                Kept::Projections(slots) => slots.host_bytes(),
            };
            tracing::info!(
                tokens,
                device_bytes = needed,
                pinned_bytes,
                "batch buffers ready"
            );
        }
        Ok(())
    }
}

impl<E: Activation> Backend for Device<E> {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn capture_width(&self) -> usize {
        self.spec.width(self.config.hidden_size)
    }

    fn spec(&self) -> &CaptureSpec {
        &self.spec
    }

    fn capture(&mut self, batch: &Batch, out: &mut Captured) -> Result<()> {
        batch.validate(self.config.vocab_size)?;
        let tokens = batch.num_tokens();
        let width = self.capture_width();
        out.reset(self.spec.sites.len(), self.spec.layers.len(), tokens, width);
        if tokens == 0 {
            return Ok(());
        }
        self.run(batch, None, out)
    }
}

impl<E: Activation> Stage for Device<E> {
    fn forward(&mut self, batch: &Batch, x: &mut Vec<f32>, out: &mut Captured) -> Result<()> {
        batch.validate(self.config.vocab_size)?;
        if batch.num_tokens() == 0 {
            return Ok(());
        }
        self.run(batch, Some(x), out)
    }
}

impl<E: Activation> Device<E> {
    /// Runs the blocks on a batch of at least one token: from the embedding on the first
    /// stage, else from `x`, the residual stream the stage before handed on, which gets this
    /// stage's output back. Kept sites land in their slots of `out` (the whole batch's).
    fn run(&mut self, batch: &Batch, x: Option<&mut Vec<f32>>, out: &mut Captured) -> Result<()> {
        let tokens = batch.num_tokens();
        let width = self.capture_width();
        self.ensure_scratch(tokens)?;
        attention_tiles(
            &batch.cu_seq_lengths,
            self.kernels.attention.queries_per_block,
            &mut self.host_tiles,
        );
        let Some(s) = self.scratch.as_mut() else {
            return Ok(());
        };
        upload_batch(&self.stream, batch, &self.host_tiles, s)?;
        let c = &self.config;
        let stream_values = tokens * c.hidden_size;
        let handed_on = CudaError::fault("handing the residual stream between stages");
        match (&self.embed, &x) {
            (Some(embed), _) => launch::embed_gather(
                &self.stream,
                &self.kernels.embed_gather,
                embed,
                &s.ids,
                &mut s.x,
                (tokens, c.hidden_size, embedding_scale(c)),
            )?,
            (None, Some(x)) if x.len() >= stream_values => self
                .stream
                .memcpy_htod(&x[..stream_values], &mut s.x.slice_mut(..stream_values))
                .map_err(&handed_on)?,
            (None, _) => return Err(no_stream(self.first_block, stream_values)),
        }
        let pass = Pass {
            config: c,
            stream: &self.stream,
            blas: &self.blas,
            kernels: &self.kernels,
            inv_freq: &self.inv_freq,
            tokens,
            tiles: self.host_tiles.len() / 2,
        };
        for (local, block) in self.blocks.iter().enumerate() {
            let index = self.first_block + local;
            let keeping = self.spec.layers.position(index).map(|layer| Keeping {
                layer: layer - self.kept.start,
                layers: self.kept.len(),
                sites: &self.spec.sites,
                width,
                directions: self.directions.as_ref(),
                copies: &self.copies,
            });
            let slot = |site| keeping.as_ref().and_then(|k| k.slot(site));
            let mut ops = DeviceOps {
                pass: &pass,
                s: &mut *s,
                inter: block.inter,
                keeping: keeping.as_ref(),
            };
            crate::model::forward_block(&mut ops, block, c, index, slot)?;
        }
        // Each kept slot is widened as its copy lands, while the blocks after it run. This
        // device's slot `site * kept + layer` is the batch's `site * layers + first + layer`.
        let kept = self.kept.len();
        for slot in 0..self.spec.sites.len() * kept {
            let (site, layer) = (slot / kept, slot % kept);
            let rows = out.layer_mut(site * self.spec.layers.len() + self.kept.start + layer);
            match &s.kept {
                Kept::Rows(slots) => slots.receive(slot, rows)?,
                Kept::Projections(slots) => slots.receive(slot, rows)?,
            }
        }
        if let Some(x) = x {
            x.resize(stream_values, 0.0);
            self.stream
                .memcpy_dtoh(&s.x.slice(..stream_values), &mut x[..])
                .map_err(&handed_on)?;
            self.stream.synchronize().map_err(&handed_on)?;
        }
        Ok(())
    }
}

/// AFMoE's muP scale of the embedding (1 for the others).
pub(super) fn embedding_scale(c: &ModelConfig) -> f32 {
    c.afmoe.as_ref().map_or(1.0, |a| a.embedding_scale as f32)
}

/// A later stage ran without the residual stream of the one before: a bug in the caller.
fn no_stream(first_block: usize, values: usize) -> crate::Error {
    CudaError::Fault {
        action: "running a pipeline stage",
        reason: format!(
            "the stage from block {first_block} needs the {values} residual values of the stage before"
        ),
    }
    .into()
}

/// Copies a batch's ids, positions, sequence bounds and attention tiles to the device.
fn upload_batch<E>(
    stream: &Arc<CudaStream>,
    batch: &Batch,
    host_tiles: &[u32],
    s: &mut Scratch<E>,
) -> Result<()> {
    let tokens = batch.num_tokens();
    let copy = CudaError::fault("copying the batch to the device");
    stream
        .memcpy_htod(&batch.input_ids, &mut s.ids.slice_mut(..tokens))
        .map_err(&copy)?;
    stream
        .memcpy_htod(&batch.positions, &mut s.positions.slice_mut(..tokens))
        .map_err(&copy)?;
    stream
        .memcpy_htod(
            &batch.cu_seq_lengths,
            &mut s.cu_seq_lengths.slice_mut(..batch.cu_seq_lengths.len()),
        )
        .map_err(&copy)?;
    stream
        .memcpy_htod(host_tiles, &mut s.tiles.slice_mut(..host_tiles.len()))
        .map_err(&copy)?;
    Ok(())
}

/// One forward pass over a batch: what every block's launches share.
pub(super) struct Pass<'a> {
    config: &'a ModelConfig,
    stream: &'a Arc<CudaStream>,
    blas: &'a CudaBlas,
    kernels: &'a Kernels,
    inv_freq: &'a CudaSlice<f32>,
    tokens: usize,
    tiles: usize,
}

/// Where one kept block's hook sites go.
struct Keeping<'a> {
    /// The block's place among the kept layers this device holds.
    layer: usize,
    /// Kept layers this device holds.
    layers: usize,
    /// Kept sites.
    sites: &'a Sites,
    /// Values per captured token.
    width: usize,
    /// Projection directions, when the job projects.
    directions: Option<&'a CudaSlice<f32>>,
    /// The stream that copies kept slots to the host.
    copies: &'a Arc<CudaStream>,
}

impl Keeping<'_> {
    /// The capture slot of `site` in this block, if it is kept.
    fn slot(&self, site: Site) -> Option<usize> {
        self.sites
            .position(site)
            .map(|position| position * self.layers + self.layer)
    }
}

/// What sizes a batch's buffers on one device besides the model's shape.
struct BatchBuffers {
    /// Kept layers the device holds.
    kept_layers: usize,
    /// Whether a branch output is written apart (kept, or given an O bias).
    branch: bool,
    /// Whether the QKV product is written in f32 for its bias.
    qkv_wide: bool,
    /// The widest MLP among the blocks ([`mlp_width`]).
    mlp_width: usize,
    /// Bytes of one activation between kernels: 2 in the bf16 mode, 4 in the f32 mode.
    value_bytes: usize,
}

/// The widest MLP (dense, or a sparse block's shared experts) among `blocks`.
fn mlp_width(blocks: &[crate::model::BlockWeights]) -> usize {
    blocks.iter().map(|b| b.down.cols()).max().unwrap_or(0)
}

impl BatchBuffers {
    fn bytes(&self, c: &ModelConfig, spec: &CaptureSpec, tokens: usize) -> u64 {
        let shape = super::plan::Shape {
            hidden: c.hidden_size,
            intermediate: self.mlp_width,
            q_heads: c.num_heads,
            kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
        };
        let kept_bytes = if spec.directions.is_some() { 4 } else { 2 };
        let slots = spec.sites.len() * self.kept_layers;
        let capture = (kept_bytes * slots * spec.width(c.hidden_size)) as u64;
        let branch = if self.branch {
            4 * c.hidden_size as u64
        } else {
            0
        };
        let qkv_wide = if self.qkv_wide && self.value_bytes == 2 {
            4 * c.qkv_width() as u64
        } else {
            0
        };
        let afmoe = match c.afmoe {
            Some(_) => afmoe::scratch_bytes(c, tokens, self.value_bytes),
            None => 0,
        };
        shape.activation_bytes(tokens, self.value_bytes)
            + (capture + branch + qkv_wide + 16) * tokens as u64
            + afmoe
    }
}

/// Whether a job keeps a branch output (`attn_out` or `mlp_out`), which then needs a buffer
/// of its own before it joins the residual stream.
fn keeps_branches(sites: &Sites) -> bool {
    sites.contains(Site::AttnOut) || sites.contains(Site::MlpOut)
}

/// The block ops on the device: one pass's launches over its scratch buffers.
struct DeviceOps<'p, 's, E> {
    pass: &'p Pass<'p>,
    s: &'s mut Scratch<E>,
    /// The block's MLP width (`DeviceBlock::inter`), for SwiGLU.
    inter: usize,
    /// Where this block's kept sites go, if it is a kept layer.
    keeping: Option<&'p Keeping<'p>>,
}

/// The input and weight of `sublayer`'s output projection (`attn` and O, or `act` and down),
/// and its `(n, k)`.
fn output_of<'a, E>(
    c: &ModelConfig,
    block: &'a DeviceBlock<E>,
    (attn, act): (&'a CudaSlice<E>, &'a CudaSlice<E>),
    sublayer: Sublayer,
) -> (&'a CudaSlice<E>, &'a CudaSlice<E>, (usize, usize)) {
    match sublayer {
        Sublayer::Attention => (attn, &block.o, (c.hidden_size, c.num_heads * c.head_dim)),
        Sublayer::Mlp => (act, &block.down, (c.hidden_size, block.inter)),
    }
}

impl<E: Activation> BlockOps for DeviceOps<'_, '_, E> {
    type Block = DeviceBlock<E>;

    fn norm(&mut self, block: &DeviceBlock<E>, sublayer: Sublayer) -> Result<()> {
        let weight = match sublayer {
            Sublayer::Attention => &block.attn_norm,
            Sublayer::Mlp => &block.mlp_norm,
        };
        self.pass.norm(weight, &self.s.x, &mut self.s.normed)
    }

    fn qkv(&mut self, block: &DeviceBlock<E>) -> Result<()> {
        let (c, p) = (self.pass.config, self.pass);
        let shape = (c.qkv_width(), c.hidden_size);
        let s = &mut *self.s;
        match &block.qkv_bias {
            None => p.gemm(&s.normed, &block.qkv, &mut s.qkv, E::DATA_TYPE, shape, 0.0),
            Some(bias) => {
                let buffers = (&mut s.qkv, &mut s.qkv_wide);
                E::biased_product(p, (&s.normed, &block.qkv, bias), buffers, shape)
            }
        }
    }

    fn rope(&mut self) -> Result<()> {
        let (c, p) = (self.pass.config, self.pass);
        launch::rope(
            p.stream,
            &p.kernels.rope,
            &mut self.s.qkv,
            &self.s.positions,
            p.inv_freq,
            (
                p.tokens,
                c.num_heads + c.num_kv_heads,
                c.qkv_width(),
                c.head_dim,
            ),
        )
    }

    fn attention(&mut self, window: Option<usize>) -> Result<()> {
        let (c, p) = (self.pass.config, self.pass);
        let shape = AttentionShape {
            tokens: p.tokens,
            tiles: p.tiles,
            heads: c.num_heads,
            kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            window,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
        };
        let s = &mut *self.s;
        launch::attention(
            p.stream,
            &p.kernels.attention,
            &s.qkv,
            &mut s.attn,
            &s.cu_seq_lengths,
            &s.tiles,
            shape,
        )
    }

    fn gate_up(&mut self, block: &DeviceBlock<E>) -> Result<()> {
        let c = self.pass.config;
        let shape = (2 * block.inter, c.hidden_size);
        let s = &mut *self.s;
        let c_type = E::DATA_TYPE;
        self.pass.gemm(
            &s.normed,
            &block.gate_up,
            &mut s.gate_up,
            c_type,
            shape,
            0.0,
        )
    }

    fn swiglu(&mut self) -> Result<()> {
        let p = self.pass;
        launch::swiglu(
            p.stream,
            &p.kernels.swiglu,
            &self.s.gate_up,
            &mut self.s.act,
            (p.tokens, self.inter),
        )
    }

    fn output_into_residual(&mut self, block: &DeviceBlock<E>, sublayer: Sublayer) -> Result<()> {
        let s = &mut *self.s;
        let (input, w, shape) = output_of(self.pass.config, block, (&s.attn, &s.act), sublayer);
        self.pass.gemm(input, w, &mut s.x, F32, shape, 1.0)
    }

    fn output_apart(&mut self, block: &DeviceBlock<E>, sublayer: Sublayer) -> Result<()> {
        let (c, p) = (self.pass.config, self.pass);
        let s = &mut *self.s;
        let (input, w, shape) = output_of(c, block, (&s.attn, &s.act), sublayer);
        p.gemm(input, w, &mut s.branch, F32, shape, 0.0)?;
        match (&block.o_bias, sublayer) {
            (Some(bias), Sublayer::Attention) => {
                let n = (p.tokens * c.hidden_size, c.hidden_size);
                launch::add_bias(p.stream, &p.kernels.add_bias, &mut s.branch, bias, n)
            }
            _ => Ok(()),
        }
    }

    fn output_bias(&self, block: &DeviceBlock<E>, sublayer: Sublayer) -> bool {
        sublayer == Sublayer::Attention && block.o_bias.is_some()
    }

    fn add_branch(&mut self) -> Result<()> {
        let p = self.pass;
        launch::add_rows(
            p.stream,
            &p.kernels.add_rows,
            &mut self.s.x,
            &self.s.branch,
            p.tokens * p.config.hidden_size,
        )
    }

    fn keep(&mut self, source: Source, slot: usize) -> Result<()> {
        let Some(keeping) = self.keeping else {
            return Ok(());
        };
        let s = &mut *self.s;
        let source = match source {
            Source::Residual => &s.x,
            Source::Branch => &s.branch,
        };
        self.pass.keep(source, &mut s.kept, keeping, slot)
    }
}

impl Pass<'_> {
    /// `out = rms_norm(x) · weight` over the batch, in the mode's type `E`.
    fn norm<E: DeviceRepr>(
        &self,
        weight: &CudaSlice<E>,
        x: &CudaSlice<f32>,
        out: &mut CudaSlice<E>,
    ) -> Result<()> {
        let c = self.config;
        launch::rms_norm(
            self.stream,
            &self.kernels.rms_norm,
            x,
            weight,
            out,
            (self.tokens, c.hidden_size, c.rms_norm_eps as f32),
        )
    }

    /// `c[tokens, n] = a · w[n, k]ᵀ + beta · c` over the batch, `a` and `w` in the mode's type.
    fn gemm<E: Activation, C>(
        &self,
        a: &CudaSlice<E>,
        w: &CudaSlice<E>,
        c: &mut CudaSlice<C>,
        c_type: cudaDataType,
        (n, k): (usize, usize),
        beta: f32,
    ) -> Result<()> {
        let types = (E::DATA_TYPE, c_type, E::COMPUTE);
        gemm(
            self.blas,
            self.stream,
            (a, w, c),
            types,
            (self.tokens, n, k),
            beta,
        )
    }

    /// Writes `source` (`[tokens, hidden]` f32) into capture slot `slot`, rounded to bf16, or
    /// its projections when the job projects, and queues the slot's copy to the host.
    fn keep(
        &self,
        source: &CudaSlice<f32>,
        kept: &mut Kept,
        keeping: &Keeping<'_>,
        slot: usize,
    ) -> Result<()> {
        let size = self.tokens * keeping.width;
        match (kept, keeping.directions) {
            (Kept::Rows(slots), None) => {
                let start = slot * slots.capacity;
                let mut view = slots.device.slice_mut(start..start + size);
                launch::round_bf16(
                    self.stream,
                    &self.kernels.round_bf16,
                    source,
                    &mut view,
                    size,
                )?;
                slots.send(self.stream, keeping.copies, slot, size)
            }
            (Kept::Projections(slots), Some(units)) => {
                let start = slot * slots.capacity;
                let mut view = slots.device.slice_mut(start..start + size);
                launch::project(
                    self.stream,
                    &self.kernels.project,
                    source,
                    units,
                    &mut view,
                    (self.tokens, self.config.hidden_size, keeping.width),
                )?;
                slots.send(self.stream, keeping.copies, slot, size)
            }
            _ => Err(CudaError::Fault {
                action: "keeping a layer",
                reason: "the capture slots do not match the job's contents".into(),
            }
            .into()),
        }
    }
}

/// bf16 GEMM GFLOP/s of cuBLAS on GPU `ordinal` for `out[m, n] = a[m, k] · b[n, k]ᵀ` (f32
/// accumulation and output, as the forward pass's residual GEMMs): the best of several timed
/// rounds after a warm-up, the ceiling the benchmark reports next to the forward pass.
pub fn gemm_rate(ordinal: usize, [m, n, k]: [usize; 3]) -> Result<f64> {
    super::probe(ordinal)?;
    let context = CudaContext::new(ordinal).map_err(driver)?;
    let stream = context.default_stream();
    let blas = CudaBlas::new(stream.clone()).map_err(driver)?;
    let a = stream
        .clone_htod(&bf16_values(
            &(0..m * k)
                .map(|i| (i % 17) as f32 * 0.01)
                .collect::<Vec<_>>(),
        ))
        .map_err(driver)?;
    let b = stream
        .clone_htod(&bf16_values(
            &(0..n * k)
                .map(|i| (i % 13) as f32 * 0.01)
                .collect::<Vec<_>>(),
        ))
        .map_err(driver)?;
    let mut c = stream.alloc_zeros::<f32>(m * n).map_err(driver)?;
    let timing = CudaError::fault("timing the GEMM");
    const REPS: usize = 20;
    let mut best = f64::INFINITY;
    for round in 0..4 {
        stream.synchronize().map_err(&timing)?;
        let start = Instant::now();
        for _ in 0..REPS {
            gemm(
                &blas,
                &stream,
                (&a, &b, &mut c),
                (u16::DATA_TYPE, F32, u16::COMPUTE),
                (m, n, k),
                0.0,
            )?;
        }
        stream.synchronize().map_err(&timing)?;
        if round > 0 {
            best = best.min(start.elapsed().as_secs_f64() / REPS as f64);
        }
    }
    Ok(2.0 * (m * n * k) as f64 / best / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture_config(name: &str) -> ModelConfig {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        ModelConfig::from_file(&dir.join(name).join("config.json")).unwrap()
    }

    #[test]
    fn afmoe_and_the_f32_mode_run_on_a_gpu_only_when_asked_for_and_the_rest_always() {
        let afmoe = fixture_config("tiny-afmoe-bf16");
        let dense = fixture_config("tiny-mistral-window-bf16");
        let env = |afmoe: Option<&'static str>, f32: Option<&'static str>| {
            move |name: &str| match name {
                CUDA_AFMOE_VARIABLE => afmoe.map(String::from),
                CUDA_F32_VARIABLE => f32.map(String::from),
                _ => None,
            }
        };
        let check = |config, precision, env: &dyn Fn(&str) -> Option<String>| {
            check_unchecked(config, precision, env).map_err(|e| e.to_string())
        };
        assert!(check(&afmoe, Precision::Bf16, &env(Some("try"), None)).is_ok());
        assert!(check(&afmoe, Precision::Bf16, &env(Some(" try "), None)).is_ok());
        for value in [None, Some("yes"), Some("")] {
            let error = check(&afmoe, Precision::Bf16, &env(value, None)).unwrap_err();
            assert!(
                error.contains("AFMoE") && error.contains("HARVEST_CUDA_AFMOE=try"),
                "{value:?}: {error}"
            );
            let error = check(&dense, Precision::F32, &env(None, value)).unwrap_err();
            assert!(
                error.contains("f32 mode")
                    && error.contains("HARVEST_CUDA_F32=try")
                    && error.contains("--precision bf16"),
                "{value:?}: {error}"
            );
        }
        assert!(check(&dense, Precision::Bf16, &env(None, None)).is_ok());
        assert!(check(&dense, Precision::F32, &env(None, Some("try"))).is_ok());
        // AFMoE in f32 needs both.
        assert!(check(&afmoe, Precision::F32, &env(Some("try"), None)).is_err());
        assert!(check(&afmoe, Precision::F32, &env(Some("try"), Some("try"))).is_ok());
    }
}
