//! The CUDA forward pass: the CPU reference's block, in the same order, on one GPU. The
//! residual stream stays f32; GEMM inputs are bf16 with f32 accumulation (cuBLAS `gemm_ex`),
//! QKV and gate/up each one fused GEMM, and the attention output and down projections add
//! straight into the residual (`beta = 1`). Kernels come from `kernels.cu`, compiled once.
//!
//! NOT YET RUN ON A GPU: it compiles here, and the GPU check (`scripts/gpu-check.sh`) compares
//! it with the CPU backend. Until that has passed, `--device auto` keeps choosing the CPU.

use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig,
    PushKernelArg,
};

use super::kernels;
use super::plan::{attention_tiles, check_heads};
use crate::backend::{Backend, Batch, CaptureSpec, Captured};
use crate::error::{Error, Result};
use crate::model::{LlamaWeights, ModelConfig};

/// Threads per block of the row kernels.
const ROW_THREADS: u32 = 256;

fn driver(error: impl std::fmt::Display) -> Error {
    Error::NoGpu {
        reason: format!("CUDA: {error}"),
    }
}

fn bf16(values: &[f32]) -> Vec<u16> {
    values
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect()
}

struct Kernels {
    embed_gather: CudaFunction,
    rms_norm: CudaFunction,
    rope: CudaFunction,
    swiglu: CudaFunction,
    attention: CudaFunction,
    project: CudaFunction,
}

struct DeviceBlock {
    attn_norm: CudaSlice<u16>,
    qkv: CudaSlice<u16>,
    o: CudaSlice<u16>,
    mlp_norm: CudaSlice<u16>,
    gate_up: CudaSlice<u16>,
    down: CudaSlice<u16>,
}

/// Activation buffers for up to `tokens` tokens; they only grow.
struct Scratch {
    tokens: usize,
    ids: CudaSlice<u32>,
    positions: CudaSlice<u32>,
    cu_seq_lengths: CudaSlice<u32>,
    tiles: CudaSlice<u32>,
    x: CudaSlice<f32>,
    normed: CudaSlice<u16>,
    qkv: CudaSlice<u16>,
    attn: CudaSlice<u16>,
    gate_up: CudaSlice<u16>,
    act: CudaSlice<u16>,
    captured: CudaSlice<f32>,
}

/// The CUDA backend on one device.
pub struct CudaBackend {
    spec: CaptureSpec,
    config: ModelConfig,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    kernels: Kernels,
    embed: CudaSlice<u16>,
    blocks: Vec<DeviceBlock>,
    inv_freq: CudaSlice<f32>,
    directions: Option<CudaSlice<f32>>,
    scratch: Option<Scratch>,
    host_tiles: Vec<u32>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("blocks", &self.blocks.len())
            .finish_non_exhaustive()
    }
}

/// Why a model cannot run on this backend yet (biases, sliding windows, wide heads).
fn check_model(config: &ModelConfig, weights: &LlamaWeights) -> Result<()> {
    check_heads(config.num_heads, config.num_kv_heads, config.head_dim)?;
    let unsupported = |reason: &str| {
        Err(Error::CudaUnsupported {
            reason: reason.to_owned(),
        })
    };
    if weights
        .blocks
        .iter()
        .any(|b| b.qkv_bias.is_some() || b.o_bias.is_some())
    {
        return unsupported("attention biases");
    }
    if config.attention_windows.iter().any(Option::is_some) {
        return unsupported("sliding-window attention");
    }
    Ok(())
}

impl CudaBackend {
    /// Uploads `weights` (the blocks up to the deepest kept one) in bf16 to GPU `ordinal` and
    /// compiles the kernels.
    pub fn new(weights: LlamaWeights, spec: CaptureSpec, ordinal: usize) -> Result<Self> {
        super::probe(ordinal)?;
        let config = weights.config.clone();
        check_model(&config, &weights)?;
        spec.check(&weights)?;
        let deepest = spec.layers.deepest();
        let ptx = kernels::compile()?;
        let context = CudaContext::new(ordinal).map_err(driver)?;
        let stream = context.default_stream();
        let module = context.load_module(ptx).map_err(driver)?;
        let function = |name: &str| module.load_function(name).map_err(driver);
        let kernels = Kernels {
            embed_gather: function("embed_gather")?,
            rms_norm: function("rms_norm")?,
            rope: function("rope")?,
            swiglu: function("swiglu")?,
            attention: function("attention_varlen")?,
            project: function("project")?,
        };
        let blas = CudaBlas::new(stream.clone()).map_err(driver)?;
        let upload = |values: &[f32]| stream.clone_htod(&bf16(values)).map_err(driver);
        let embed = upload(&weights.embed)?;
        let blocks = weights.blocks[..=deepest]
            .iter()
            .map(|b| {
                Ok(DeviceBlock {
                    attn_norm: upload(&b.attn_norm)?,
                    qkv: upload(&b.qkv)?,
                    o: upload(&b.o)?,
                    mlp_norm: upload(&b.mlp_norm)?,
                    gate_up: upload(&b.gate_up)?,
                    down: upload(&b.down)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
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
        Ok(Self {
            spec,
            config,
            stream,
            blas,
            kernels,
            embed,
            blocks,
            inv_freq,
            directions,
            scratch: None,
            host_tiles: Vec::new(),
        })
    }

    fn ensure_scratch(&mut self, tokens: usize) -> Result<()> {
        if self.scratch.as_ref().is_some_and(|s| s.tokens >= tokens) {
            return Ok(());
        }
        let c = &self.config;
        let width = self.capture_width();
        let kept = self.spec.layers.len();
        let s = &self.stream;
        let f32s = |n: usize| s.alloc_zeros::<f32>(n).map_err(driver);
        let u16s = |n: usize| s.alloc_zeros::<u16>(n).map_err(driver);
        let u32s = |n: usize| s.alloc_zeros::<u32>(n).map_err(driver);
        self.scratch = Some(Scratch {
            tokens,
            ids: u32s(tokens)?,
            positions: u32s(tokens)?,
            cu_seq_lengths: u32s(tokens + 1)?,
            tiles: u32s(2 * tokens)?,
            x: f32s(tokens * c.hidden_size)?,
            normed: u16s(tokens * c.hidden_size)?,
            qkv: u16s(tokens * c.qkv_width())?,
            attn: u16s(tokens * c.num_heads * c.head_dim)?,
            gate_up: u16s(tokens * 2 * c.intermediate_size)?,
            act: u16s(tokens * c.intermediate_size)?,
            captured: f32s(kept * tokens * width)?,
        });
        Ok(())
    }
}

/// `c[rows, n] = a[rows, k] · w[n, k]ᵀ + beta · c`, row-major, bf16 inputs, f32 accumulation;
/// `c_type` says whether `c` is bf16 or f32. cuBLAS is column-major, so this computes
/// `cᵀ = w · aᵀ`.
#[allow(clippy::too_many_arguments)]
fn gemm<C>(
    blas: &CudaBlas,
    stream: &CudaStream,
    a: &CudaSlice<u16>,
    w: &CudaSlice<u16>,
    c: &mut CudaSlice<C>,
    c_type: cudaDataType,
    (rows, n, k): (usize, usize, usize),
    beta: f32,
) -> Result<()> {
    let alpha = 1.0f32;
    let dims = |v: usize| {
        i32::try_from(v).map_err(|_| Error::InvalidBatch {
            reason: format!("a GEMM dimension of {v} is too large for cuBLAS"),
        })
    };
    let (m, n_cols, k_dim) = (dims(n)?, dims(rows)?, dims(k)?);
    let (a_ptr, _a_sync) = a.device_ptr(stream);
    let (w_ptr, _w_sync) = w.device_ptr(stream);
    let (c_ptr, _c_sync) = c.device_ptr_mut(stream);
    // SAFETY: the three buffers live on `stream`'s device and hold at least rows·k, n·k and
    // rows·n elements of the types named; alpha and beta outlive the call, which only enqueues.
    #[allow(unsafe_code)]
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *blas.handle(),
            cublasOperation_t::CUBLAS_OP_T,
            cublasOperation_t::CUBLAS_OP_N,
            m,
            n_cols,
            k_dim,
            (&raw const alpha).cast(),
            w_ptr as *const _,
            cudaDataType::CUDA_R_16BF,
            k_dim,
            a_ptr as *const _,
            cudaDataType::CUDA_R_16BF,
            k_dim,
            (&raw const beta).cast(),
            c_ptr as *mut _,
            c_type,
            m,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(driver)
}

/// `out = rms_norm(x) · weight` for `tokens` rows of width `hidden`.
fn rms_norm(
    stream: &CudaStream,
    kernel: &CudaFunction,
    x: &CudaSlice<f32>,
    weight: &CudaSlice<u16>,
    out: &mut CudaSlice<u16>,
    (tokens, hidden, eps): (usize, i32, f32),
) -> Result<()> {
    // SAFETY: the arguments match `rms_norm`'s parameters in order and type; `x` and `out`
    // hold `tokens` rows of `hidden` values and `weight` holds `hidden`.
    #[allow(unsafe_code)]
    unsafe {
        stream
            .launch_builder(kernel)
            .arg(x)
            .arg(weight)
            .arg(out)
            .arg(&hidden)
            .arg(&eps)
            .launch(grid(tokens, 1, ROW_THREADS)?)
    }
    .map(|_| ())
    .map_err(driver)
}

fn grid(x: usize, y: usize, threads: u32) -> Result<LaunchConfig> {
    let dim = |v: usize| {
        u32::try_from(v).map_err(|_| Error::InvalidBatch {
            reason: format!("a launch dimension of {v} is too large"),
        })
    };
    Ok(LaunchConfig {
        grid_dim: (dim(x)?, dim(y)?, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn capture_width(&self) -> usize {
        self.spec.width(self.config.hidden_size)
    }

    fn spec(&self) -> &CaptureSpec {
        &self.spec
    }

    #[allow(unsafe_code)]
    fn capture(&mut self, batch: &Batch, out: &mut Captured) -> Result<()> {
        batch.validate(self.config.vocab_size)?;
        let tokens = batch.num_tokens();
        let width = self.capture_width();
        out.reset(self.spec.layers.len(), tokens, width);
        if tokens == 0 {
            return Ok(());
        }
        self.ensure_scratch(tokens)?;
        attention_tiles(&batch.cu_seq_lengths, &mut self.host_tiles);
        let Self {
            spec,
            config: c,
            stream,
            blas,
            kernels: k,
            embed,
            blocks,
            inv_freq,
            directions,
            scratch,
            host_tiles,
        } = self;
        let Some(s) = scratch.as_mut() else {
            return Ok(());
        };
        let hidden = c.hidden_size as i32;
        let (heads, kv_heads, head_dim) = (c.num_heads as i32, c.num_kv_heads as i32, c.head_dim);
        let qkv_width = c.qkv_width();
        let inter = c.intermediate_size;
        let eps = c.rms_norm_eps as f32;
        let scale = 1.0 / (head_dim as f32).sqrt();
        stream
            .memcpy_htod(&batch.input_ids, &mut s.ids.slice_mut(..tokens))
            .map_err(driver)?;
        stream
            .memcpy_htod(&batch.positions, &mut s.positions.slice_mut(..tokens))
            .map_err(driver)?;
        stream
            .memcpy_htod(
                &batch.cu_seq_lengths,
                &mut s.cu_seq_lengths.slice_mut(..batch.cu_seq_lengths.len()),
            )
            .map_err(driver)?;
        stream
            .memcpy_htod(
                host_tiles.as_slice(),
                &mut s.tiles.slice_mut(..host_tiles.len()),
            )
            .map_err(driver)?;
        let n_tiles = host_tiles.len() / 2;

        // SAFETY (every launch below): the arguments match the kernel's parameters in order and
        // type, and every buffer holds at least the elements the grid touches (the scratch is
        // sized for `tokens`, the weights for the model's shape).
        unsafe {
            stream
                .launch_builder(&k.embed_gather)
                .arg(&*embed)
                .arg(&s.ids)
                .arg(&mut s.x)
                .arg(&hidden)
                .launch(grid(tokens, 1, ROW_THREADS)?)
        }
        .map_err(driver)?;

        let rotated_heads = c.num_heads + c.num_kv_heads;
        let row_width = qkv_width as i32;
        let head_dim_i = head_dim as i32;
        let gate_up_elements = (tokens * inter) as i64;
        let inter_i = inter as i32;
        let swiglu_blocks = tokens * inter / ROW_THREADS as usize + 1;
        for (index, block) in blocks.iter().enumerate() {
            rms_norm(
                stream,
                &k.rms_norm,
                &s.x,
                &block.attn_norm,
                &mut s.normed,
                (tokens, hidden, eps),
            )?;
            gemm(
                blas,
                stream,
                &s.normed,
                &block.qkv,
                &mut s.qkv,
                cudaDataType::CUDA_R_16BF,
                (tokens, qkv_width, c.hidden_size),
                0.0,
            )?;
            unsafe {
                stream
                    .launch_builder(&k.rope)
                    .arg(&mut s.qkv)
                    .arg(&s.positions)
                    .arg(&*inv_freq)
                    .arg(&row_width)
                    .arg(&head_dim_i)
                    .launch(grid(tokens, rotated_heads, (head_dim / 2) as u32)?)
            }
            .map_err(driver)?;
            unsafe {
                stream
                    .launch_builder(&k.attention)
                    .arg(&s.qkv)
                    .arg(&mut s.attn)
                    .arg(&s.cu_seq_lengths)
                    .arg(&s.tiles)
                    .arg(&heads)
                    .arg(&kv_heads)
                    .arg(&head_dim_i)
                    .arg(&scale)
                    .launch(grid(
                        n_tiles,
                        c.num_heads,
                        32 * kernels::ATTENTION_QUERIES_PER_BLOCK,
                    )?)
            }
            .map_err(driver)?;
            gemm(
                blas,
                stream,
                &s.attn,
                &block.o,
                &mut s.x,
                cudaDataType::CUDA_R_32F,
                (tokens, c.hidden_size, c.num_heads * head_dim),
                1.0,
            )?;
            rms_norm(
                stream,
                &k.rms_norm,
                &s.x,
                &block.mlp_norm,
                &mut s.normed,
                (tokens, hidden, eps),
            )?;
            gemm(
                blas,
                stream,
                &s.normed,
                &block.gate_up,
                &mut s.gate_up,
                cudaDataType::CUDA_R_16BF,
                (tokens, 2 * inter, c.hidden_size),
                0.0,
            )?;
            unsafe {
                stream
                    .launch_builder(&k.swiglu)
                    .arg(&s.gate_up)
                    .arg(&mut s.act)
                    .arg(&inter_i)
                    .arg(&gate_up_elements)
                    .launch(grid(swiglu_blocks.min(65_535), 1, ROW_THREADS)?)
            }
            .map_err(driver)?;
            gemm(
                blas,
                stream,
                &s.act,
                &block.down,
                &mut s.x,
                cudaDataType::CUDA_R_32F,
                (tokens, c.hidden_size, inter),
                1.0,
            )?;
            if let Some(kept) = spec.layers.position(index) {
                let size = tokens * width;
                let mut dst = s.captured.slice_mut(kept * size..(kept + 1) * size);
                match directions.as_ref() {
                    None => stream
                        .memcpy_dtod(&s.x.slice(..size), &mut dst)
                        .map_err(driver)?,
                    Some(units) => {
                        let n = width as i32;
                        unsafe {
                            stream
                                .launch_builder(&k.project)
                                .arg(&s.x)
                                .arg(units)
                                .arg(&mut dst)
                                .arg(&hidden)
                                .arg(&n)
                                .launch(grid(tokens, 1, ROW_THREADS)?)
                        }
                        .map_err(driver)?;
                    }
                }
            }
        }
        let total = spec.layers.len() * tokens * width;
        stream
            .memcpy_dtoh(&s.captured.slice(..total), &mut out.data[..total])
            .map_err(driver)?;
        stream.synchronize().map_err(driver)
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
        .clone_htod(&bf16(
            &(0..m * k)
                .map(|i| (i % 17) as f32 * 0.01)
                .collect::<Vec<_>>(),
        ))
        .map_err(driver)?;
    let b = stream
        .clone_htod(&bf16(
            &(0..n * k)
                .map(|i| (i % 13) as f32 * 0.01)
                .collect::<Vec<_>>(),
        ))
        .map_err(driver)?;
    let mut c = stream.alloc_zeros::<f32>(m * n).map_err(driver)?;
    const REPS: usize = 20;
    let mut best = f64::INFINITY;
    for round in 0..4 {
        stream.synchronize().map_err(driver)?;
        let start = std::time::Instant::now();
        for _ in 0..REPS {
            gemm(
                &blas,
                &stream,
                &a,
                &b,
                &mut c,
                cudaDataType::CUDA_R_32F,
                (m, n, k),
                0.0,
            )?;
        }
        stream.synchronize().map_err(driver)?;
        if round > 0 {
            best = best.min(start.elapsed().as_secs_f64() / REPS as f64);
        }
    }
    Ok(2.0 * (m * n * k) as f64 / best / 1e9)
}
