//! The CUDA forward pass: the model's pass as `crate::model::block` writes it, on one GPU, on
//! the weights in the device's form (`OnDevice`): each op a kernel launch or a cuBLAS GEMM
//! over the batch's buffers. The residual stream stays f32; the activations between kernels are bf16 in the bf16 mode and f32 in the
//! f32 mode (`element`), GEMMs sum in f32, QKV and gate/up are each one fused GEMM, and the
//! attention output and down projections add straight into the residual (`beta = 1`).
//!
//! - `ops`: the block ops (`DeviceOps`), and `afmoe` AFMoE's;
//! - `kernel_set`: the kernels of `kernels.cu` loaded, their entry points for the mode;
//! - `buffers`: a batch's buffers and what they take;
//! - `upload` and `staging`: the weights' way to the device, `hand_off` the residual
//!   stream's between pipeline stages;
//! - `settle`: when a batch's buffers may be freed or reused, after a failure too;
//! - here: the backend itself, its checks, load and per-batch run.
//!
//! Checked on an H200 by the GPU window (`scripts/gpu-window.sh`, figures in `docs/gpu.md`):
//! as close to transformers float32 as the CPU bf16 mode. Attention runs on tensor cores
//! (`attention_mma_<D>`) for head widths 64 and 128 in bf16, else on the CUDA-core kernel.

mod afmoe;
mod buffers;
mod element;
mod hand_off;
mod kernel_set;
mod ops;
mod settle;
mod staging;
mod tail;
mod upload;

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use super::blas::{Blas, DataType};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DriverError};

use super::download::Slots;
use super::error::CudaError;
use super::launch::gemm;
use super::plan::{attention_tiles, check_heads};

use crate::backend::{Backend, Batch, CaptureSpec, Captured, Held, Stage};
use crate::error::Result;
use crate::model::block::{Stack, forward};
use crate::model::weights::Form;
use crate::model::{BlockWeights, LlamaWeights, ModelConfig};
use harvest_core::plan::Precision;

use self::buffers::{BatchBuffers, Kept, Scratch, keeps_branches, mlp_width};
use self::element::Activation;
pub(super) use self::element::decoded_f32;
use self::hand_off::HandOff;
use self::kernel_set::Kernels;
use self::ops::{DeviceOps, Keeping, Pass};
use self::settle::{Health, leave_unfreed};
use self::staging::Staging;
pub use self::staging::UPLOAD_VARIABLE;
pub use self::tail::TAIL_VARIABLE;
use self::tail::{Ahead, BatchInputs, InputBuffers, Landing, Step, Tail};
pub use self::upload::LoadPhases;
use self::upload::Uploader;
pub(in crate::backend::cuda) use self::upload::{bf16_values, rounded_bf16};

/// GEMM outputs added into the f32 residual stream.
const F32: DataType = DataType::R_32F;

/// Setting up on a device failed: that machine cannot run the backend.
fn driver(error: impl std::fmt::Display) -> crate::Error {
    CudaError::unavailable(error).into()
}

/// A closure that classes a driver error met during `action`: out of device memory, or a fault.
fn memory_error(action: &'static str) -> impl Fn(DriverError) -> crate::Error {
    move |error| CudaError::from_driver(action, error).into()
}

/// The weights on the device: matrices and norms in the mode's type `E`, biases and the
/// router in f32 (uploaded by [`Uploader`]).
#[derive(Debug, Clone)]
struct OnDevice<E>(std::marker::PhantomData<E>);

impl<E: Activation> Form for OnDevice<E> {
    type Matrix = CudaSlice<E>;
    type Norm = CudaSlice<E>;
    type Bias = CudaSlice<f32>;
    type Router = CudaSlice<f32>;
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
struct Device<E: Activation> {
    spec: CaptureSpec,
    config: ModelConfig,
    /// Every launch, GEMM and upload, in order: a stream of this pass's own, not the legacy
    /// default one, which every pipeline stage on the device would share and wait on.
    stream: Arc<CudaStream>,
    /// Copies kept layers to the host while later blocks run on `stream`.
    copies: Arc<CudaStream>,
    blas: Blas,
    kernels: Kernels,
    /// The embedding, on the first stage only.
    embed: Option<CudaSlice<E>>,
    /// The model's block the first of `blocks` is (0 unless this is a later pipeline stage).
    first_block: usize,
    /// The blocks this backend runs, up to the deepest kept one.
    blocks: Vec<BlockWeights<OnDevice<E>>>,
    /// The kept layers (positions among the job's) that `blocks` hold: this backend's slots.
    kept: Range<usize>,
    inv_freq: CudaSlice<f32>,
    directions: Option<CudaSlice<f32>>,
    scratch: Option<Scratch<E>>,
    /// Whether the work queued for earlier batches is known to be done (`settle`).
    health: Health,
    /// The residual stream's page-locked buffer, on a pipeline stage.
    hand_off: HandOff,
    host_tiles: Vec<u32>,
    phases: LoadPhases,
    /// Whether some block has a QKV bias, and an O bias: they need buffers of their own.
    qkv_bias: bool,
    o_bias: bool,
    /// The widest MLP among the blocks.
    mlp_width: usize,
    /// The batch tail, hidden or not (`tail`).
    tail: Tail,
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

/// Refuses what has run only on the replay, on a GPU, unless its switch (read by `switch`,
/// [`super::switches::switch`] in a run) is `try`, as the GPU window sets them: AFMoE ([`CUDA_AFMOE_VARIABLE`]) and the f32 mode
/// ([`CUDA_F32_VARIABLE`]).
pub fn check_unchecked(
    config: &ModelConfig,
    precision: Precision,
    switch: &dyn Fn(&str) -> Option<String>,
) -> Result<()> {
    let tried = |variable: &str| switch(variable).as_deref().map(str::trim) == Some("try");
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
        check_unchecked(&weights.config, spec.precision, &super::switches::switch)?;
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

    fn capture_next(&mut self, batch: &Batch, out: Captured) -> Result<Option<Captured>> {
        self.device.capture_next(batch, out)
    }

    fn finish(&mut self) -> Result<Option<Captured>> {
        self.device.finish()
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
        let stream = context.new_stream().map_err(driver)?;
        let copies = context.new_stream().map_err(driver)?;
        let kernels_start = Instant::now();
        let (kernels, code) = Kernels::load::<E>(&context, config.head_dim)?;
        let blas = Blas::new(super::libraries::cublas()?, stream.clone())?;
        let staging = Staging::new(
            &context,
            super::switches::switch(UPLOAD_VARIABLE).as_deref(),
        );
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
        let (blocks, (qkv_bias, o_bias, mlp_width)) = upload_blocks(&mut up, weights.blocks, run)?;
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
        idle(&stream, &copies).map_err(|e| CudaError::from_driver("uploading the weights", e))?;
        Ok(Self {
            tail: Tail::new(&config),
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
            health: Health::default(),
            hand_off: HandOff::default(),
            host_tiles: Vec::new(),
            phases,
            qkv_bias,
            o_bias,
            mlp_width,
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
        self.health.check()?;
        if self.scratch.as_ref().is_some_and(|s| s.tokens >= tokens) {
            return Ok(());
        }
        // Taken out for the replacement, which reads the rest of `self`.
        let mut health = std::mem::take(&mut self.health);
        let mut scratch = self.scratch.take();
        // The old buffers go first, so their bytes count as free.
        let replaced = health.replace(
            &mut scratch,
            || idle(&self.stream, &self.copies),
            || self.allocate_scratch(tokens),
        );
        (self.health, self.scratch) = (health, scratch);
        replaced
    }

    /// A batch's buffers for `tokens`, once the device has room for them.
    fn allocate_scratch(&self, tokens: usize) -> Result<Scratch<E>> {
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
        let scratch = Scratch {
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
        };
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
        Ok(scratch)
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
        if self.tail.ahead.is_some() {
            return Err(CudaError::Fault {
                action: "capturing a batch",
                reason:
                    "a capture is held back (capture_next) and was not finished. This is a bug."
                        .into(),
            }
            .into());
        }
        if self.prepare(batch, out)? == 0 {
            return Ok(());
        }
        self.run(batch, None, out)
    }

    fn capture_next(&mut self, batch: &Batch, mut out: Captured) -> Result<Option<Captured>> {
        if !self.tail.overlap {
            self.capture(batch, &mut out)?;
            return Ok(Some(out));
        }
        let tokens = self.prepare(batch, &mut out)?;
        let result = self.settled(|device| device.overlapped(batch, out, tokens));
        if result.is_err() {
            self.tail.ahead = None;
        }
        result
    }

    fn finish(&mut self) -> Result<Option<Captured>> {
        let result = self.settled(Self::complete_ahead);
        if result.is_err() {
            self.tail.ahead = None;
        }
        result
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
        self.settled(|device| device.run_queued(batch, x, out))
    }

    /// `work`, and after it the errors cudarc met where it could not return them (a free, a
    /// stream wait), the batch's included; where either fails, the device waits for what
    /// was queued (`settle`).
    fn settled<T>(&mut self, work: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        self.health.check()?;
        let result = work(self).and_then(|value| {
            self.stream.context().check_err().map_err(|e| {
                crate::Error::from(CudaError::from_driver(
                    "a deferred driver call of the batch",
                    e,
                ))
            })?;
            Ok(value)
        });
        let (stream, copies) = (&self.stream, &self.copies);
        self.health.settle(result, || idle(stream, copies))
    }

    /// Checks `batch` and sizes `out` for it; returns its tokens.
    fn prepare(&self, batch: &Batch, out: &mut Captured) -> Result<usize> {
        batch.validate(self.config.vocab_size)?;
        let tokens = batch.num_tokens();
        let width = self.capture_width();
        let shape = (self.spec.sites.len(), self.spec.layers.len(), tokens, width);
        out.reset_held(Held::of(true, &self.spec), shape);
        out.routes
            .reset(self.spec.route_shape(&self.config), tokens);
        Ok(tokens)
    }

    /// [`Backend::capture_next`]'s work with the tail hidden (`tail`): queues `batch`, then
    /// completes the capture held back, and holds `out` back in its place.
    fn overlapped(
        &mut self,
        batch: &Batch,
        mut out: Captured,
        tokens: usize,
    ) -> Result<Option<Captured>> {
        let fits = self.scratch.as_ref().is_some_and(|s| s.tokens >= tokens);
        let mut previous = None;
        for step in tail::steps(tokens > 0, fits) {
            match step {
                Step::Queue => self.queue(batch, None, &mut out.routes, true)?,
                Step::TakeHeld => previous = self.complete_ahead()?,
                Step::QueueDeferredCopies => self.queue_deferred_copies(tokens)?,
                Step::ReceiveEarly => self.receive(&mut out, Landing::Early)?,
            }
        }
        self.tail.ahead = Some(Ahead {
            out,
            pending: tokens > 0,
        });
        Ok(previous)
    }

    /// Queues the copies of the deepest kept layer's slots of the batch just queued, of
    /// `tokens` tokens.
    fn queue_deferred_copies(&mut self, tokens: usize) -> Result<()> {
        let size = tokens * self.capture_width();
        let kept = self.kept.len();
        let Some(s) = self.scratch.as_mut() else {
            return Err(CudaError::Fault {
                action: "queueing the deepest layer's copies",
                reason: "the batch's buffers are gone. This is a bug.".into(),
            }
            .into());
        };
        for slot in (0..self.spec.sites.len() * kept).filter(|&slot| tail::deferred(slot, kept)) {
            match &mut s.kept {
                Kept::Rows(slots) => slots.queue_copy(&self.copies, slot, size)?,
                Kept::Projections(slots) => slots.queue_copy(&self.copies, slot, size)?,
            }
        }
        Ok(())
    }

    /// The capture held back, its deepest slots landed.
    fn complete_ahead(&mut self) -> Result<Option<Captured>> {
        let Some(mut ahead) = self.tail.ahead.take() else {
            return Ok(None);
        };
        if ahead.pending {
            self.receive(&mut ahead.out, Landing::Deferred)?;
        }
        Ok(Some(ahead.out))
    }

    /// [`Self::run`]'s work, which may leave work queued where it fails.
    fn run_queued(
        &mut self,
        batch: &Batch,
        mut x: Option<&mut Vec<f32>>,
        out: &mut Captured,
    ) -> Result<()> {
        self.queue(
            batch,
            x.as_deref().map(Vec::as_slice),
            &mut out.routes,
            false,
        )?;
        self.receive(out, Landing::All)?;
        if let (Some(x), Some(s)) = (x.as_mut(), self.scratch.as_ref()) {
            let stream_values = batch.num_tokens() * self.config.hidden_size;
            x.resize(stream_values, 0.0);
            self.hand_off
                .download(&self.stream, &s.x, &mut x[..])
                .map_err(CudaError::fault(HANDED_ON))?;
        }
        Ok(())
    }

    /// Queues a batch of at least one token: its inputs, the residual stream `x` from the
    /// stage before on a later stage, and the blocks, each kept slot's copy to the host queued
    /// as it is written (the deepest layer's left to the caller where `overlap`).
    fn queue(
        &mut self,
        batch: &Batch,
        x: Option<&[f32]>,
        routes: &mut crate::backend::Routes,
        overlap: bool,
    ) -> Result<()> {
        let tokens = batch.num_tokens();
        let width = self.capture_width();
        self.ensure_scratch(tokens)?;
        if overlap {
            self.ensure_inputs(tokens);
        }
        attention_tiles(
            &batch.cu_seq_lengths,
            self.kernels.attention.queries_per_block,
            &mut self.host_tiles,
        );
        let Some(s) = self.scratch.as_mut() else {
            return Ok(());
        };
        match self.tail.inputs.as_mut().filter(|_| overlap) {
            Some(inputs) => inputs.upload(
                &self.stream,
                batch,
                &self.host_tiles,
                InputBuffers {
                    ids: &mut s.ids,
                    positions: &mut s.positions,
                    cu_seq_lengths: &mut s.cu_seq_lengths,
                    tiles: &mut s.tiles,
                },
            )?,
            None => upload_batch(&self.stream, batch, &self.host_tiles, s)?,
        }
        let c = &self.config;
        let stream_values = tokens * c.hidden_size;
        if self.first_block > 0 {
            match x {
                Some(x) if x.len() >= stream_values => self
                    .hand_off
                    .upload(&self.stream, &x[..stream_values], &mut s.x)
                    .map_err(CudaError::fault(HANDED_ON))?,
                _ => return Err(no_stream(self.first_block, stream_values)),
            }
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
        let keeping = Keeping {
            kept: self.kept.clone(),
            layers: self.spec.layers.len(),
            width,
            directions: self.directions.as_ref(),
            copies: &self.copies,
            overlap,
        };
        let mut ops = DeviceOps {
            pass: &pass,
            s: &mut *s,
            embed: self.embed.as_ref(),
            inter: 0,
            keeping: &keeping,
            routes,
        };
        let stack = Stack {
            config: c,
            first_block: self.first_block,
            blocks: &self.blocks,
        };
        forward(&mut ops, stack, self.spec.keeps())
    }

    /// Takes the kept slots `landing` names into `out` as each copy lands, while the blocks
    /// after them run, held as `Held::of` says (bf16 rows, f32 projections). This device's
    /// slot `site * kept + layer` is the batch's `site * layers + first + layer`.
    fn receive(&self, out: &mut Captured, landing: Landing) -> Result<()> {
        let Some(s) = self.scratch.as_ref() else {
            return Ok(());
        };
        let kept = self.kept.len();
        for slot in (0..self.spec.sites.len() * kept).filter(|&slot| landing.includes(slot, kept)) {
            let (site, layer) = (slot / kept, slot % kept);
            let at = site * self.spec.layers.len() + self.kept.start + layer;
            match &s.kept {
                Kept::Rows(slots) => slots.receive(slot, out.layer_bits_mut(at))?,
                Kept::Projections(slots) => slots.receive(slot, out.layer_mut(at))?,
            }
        }
        Ok(())
    }

    /// Page-locked buffers for the inputs of batches of `tokens`, where the host grants
    /// them (else the driver's pageable copies, logged).
    fn ensure_inputs(&mut self, tokens: usize) {
        if self
            .tail
            .inputs
            .as_ref()
            .is_some_and(|inputs| inputs.holds(tokens))
        {
            return;
        }
        // The old buffers wait for their copies as they drop.
        self.tail.inputs = None;
        match BatchInputs::new(self.stream.context(), tokens) {
            Ok(inputs) => self.tail.inputs = Some(inputs),
            Err(error) => {
                tracing::warn!(error = ?error.0, tokens, "no page-locked memory for the batch inputs: they go up from pageable memory");
            }
        }
    }
}

/// What the hand-off between pipeline stages was doing when it failed.
const HANDED_ON: &str = "handing the residual stream between stages";

/// Waits until the work queued on both streams is done, and reports errors cudarc recorded
/// where it could not return them.
fn idle(compute: &CudaStream, copies: &CudaStream) -> std::result::Result<(), DriverError> {
    copies.synchronize()?;
    compute.synchronize()?;
    compute.context().check_err()
}

impl<E: Activation> Drop for Device<E> {
    fn drop(&mut self) {
        // The buffers are freed when the fields drop, after this: only once nothing queued
        // can still use them. Where that is not known, they are left to the process's end.
        let settled = self.health.check().is_ok()
            && match idle(&self.stream, &self.copies) {
                Ok(()) => true,
                Err(error) => {
                    tracing::warn!(error = ?error.0, "the device's queued work could not be waited for: its batch buffers are not freed");
                    false
                }
            };
        if !settled {
            leave_unfreed(self.scratch.take());
            leave_unfreed(std::mem::take(&mut self.hand_off));
        }
    }
}

/// What a batch's buffers need of the blocks: whether some block (of all loaded) has a QKV
/// bias, and an O bias, and the widest MLP among those that run.
type BufferNeeds = (bool, bool, usize);

/// The first `run` of `blocks` uploaded in `E`, and what a batch's buffers need of them.
fn upload_blocks<E: Activation>(
    up: &mut Uploader<'_>,
    blocks: Vec<BlockWeights>,
    run: usize,
) -> Result<(Vec<BlockWeights<OnDevice<E>>>, BufferNeeds)> {
    let qkv_bias = blocks.iter().any(|b| b.qkv_bias.is_some());
    let o_bias = blocks.iter().any(|b| b.o_bias.is_some());
    let mlp_width = mlp_width(&blocks[..run]);
    let blocks = blocks
        .into_iter()
        .take(run)
        .map(|b| b.convert(up))
        .collect::<Result<Vec<_>>>()?;
    Ok((blocks, (qkv_bias, o_bias, mlp_width)))
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

/// bf16 GEMM GFLOP/s of cuBLAS on GPU `ordinal` for `out[m, n] = a[m, k] · b[n, k]ᵀ` (f32
/// accumulation and output, as the forward pass's residual GEMMs): the best of several timed
/// rounds after a warm-up, the ceiling the benchmark reports next to the forward pass. The
/// inputs are seeded random values in [-1, 1), as weights and activations are: patterned data
/// (zeros, short cycles) toggles fewer bits and reads faster than real products run.
pub fn gemm_rate(ordinal: usize, [m, n, k]: [usize; 3]) -> Result<f64> {
    super::probe(ordinal)?;
    let context = CudaContext::new(ordinal).map_err(driver)?;
    let stream = context.default_stream();
    let blas = Blas::new(super::libraries::cublas()?, stream.clone())?;
    let a = stream
        .clone_htod(&bf16_values(&random_values(m * k, 1)))
        .map_err(driver)?;
    let b = stream
        .clone_htod(&bf16_values(&random_values(n * k, 2)))
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

/// `count` values uniform in [-1, 1) from a xorshift generator seeded with `seed`.
fn random_values(count: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..count)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // The top 24 bits as a fraction of 2^23, less 1: [-1, 1).
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gemm_rates_inputs_are_spread_over_minus_one_to_one_and_differ_by_seed() {
        let values = random_values(100_000, 1);
        assert!(values.iter().all(|v| (-1.0..1.0).contains(v)));
        let mean = values.iter().sum::<f32>() / values.len() as f32;
        assert!(mean.abs() < 0.01, "mean {mean}");
        let negative = values.iter().filter(|v| **v < 0.0).count();
        assert!((45_000..55_000).contains(&negative), "{negative} negative");
        let distinct: std::collections::BTreeSet<u32> =
            values.iter().map(|v| v.to_bits()).collect();
        assert!(distinct.len() > 90_000, "{} distinct", distinct.len());
        assert_ne!(values[..8], random_values(8, 2)[..]);
    }

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
