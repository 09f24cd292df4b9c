//! One small wrapper per kernel of `kernels.cu` and one for the cuBLAS GEMM. Each checks that
//! its buffers hold what the grid touches, then launches with its own `// SAFETY:` note. A
//! failed launch is a [`CudaError::Fault`]: a bug, never "no GPU".

use super::blas::{Blas, ComputeType, DataType};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr,
    LaunchConfig, PushKernelArg,
};

use super::error::CudaError;
use crate::error::Result;

/// Threads per block of the row kernels.
pub(super) const ROW_THREADS: u32 = 256;
/// Most blocks of a grid-strided kernel (`round_bf16`, `add_rows`): enough to fill any GPU several times.
const GRID_STRIDE_MAX_BLOCKS: usize = 65_535;
/// The largest grid height the driver takes; the SwiGLU kernel strides its rows over it.
const GRID_Y_MAX: usize = 65_535;

/// Refuses a launch whose buffer `what` holds fewer than `needed` elements.
fn fits(kernel: &'static str, what: &str, len: usize, needed: usize) -> Result<()> {
    if len < needed {
        return Err(CudaError::Fault {
            action: kernel,
            reason: format!("{what} holds {len} elements, the launch needs {needed}"),
        }
        .into());
    }
    Ok(())
}

fn int(kernel: &'static str, value: usize) -> Result<i32> {
    i32::try_from(value).map_err(|_| {
        CudaError::Fault {
            action: kernel,
            reason: format!("{value} does not fit the kernel's int parameter"),
        }
        .into()
    })
}

fn grid(kernel: &'static str, x: usize, y: usize, threads: u32) -> Result<LaunchConfig> {
    let dim = |v: usize| {
        u32::try_from(v).map_err(|_| CudaError::Fault {
            action: kernel,
            reason: format!("a launch dimension of {v} is too large"),
        })
    };
    Ok(LaunchConfig {
        grid_dim: (dim(x)?, dim(y)?, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// `x[t] = table[ids[t]] · scale` (rows of the mode's type to f32) for `tokens` tokens of
/// width `hidden`.
pub(super) fn embed_gather<T: DeviceRepr>(
    stream: &CudaStream,
    kernel: &CudaFunction,
    table: &CudaSlice<T>,
    ids: &CudaSlice<u32>,
    x: &mut CudaSlice<f32>,
    (tokens, hidden, scale): (usize, usize, f32),
) -> Result<()> {
    const NAME: &str = "embed_gather";
    fits(NAME, "ids", ids.len(), tokens)?;
    fits(NAME, "x", x.len(), tokens * hidden)?;
    fits(NAME, "the embedding table", table.len(), hidden)?;
    let hidden = int(NAME, hidden)?;
    let config = grid(NAME, tokens, 1, ROW_THREADS)?;
    // SAFETY: the arguments match `embed_gather(const bf16*, const unsigned*, float*, int,
    // float)`, or `embed_gather_f32` (a `const float*` table), in order and type, the caller
    // pairing the kernel with `T`; `ids` and `x` hold `tokens` entries and rows (checked above), and the
    // ids were checked against the vocabulary by `Batch::validate`, so every row read exists.
    #[allow(unsafe_code)]
    let launched = unsafe {
        stream
            .launch_builder(kernel)
            .arg(table)
            .arg(ids)
            .arg(x)
            .arg(&hidden)
            .arg(&scale)
            .launch(config)
    };
    launched
        .map(|_| ())
        .map_err(|e| CudaError::fault(NAME)(e).into())
}

/// `out = rms_norm(x) · weight` for `tokens` rows of width `hidden`, in the mode's type `T`
/// (`rms_norm`, rounded to bf16, or `rms_norm_f32`).
pub(super) fn rms_norm<T: DeviceRepr>(
    stream: &CudaStream,
    kernel: &CudaFunction,
    x: &CudaSlice<f32>,
    weight: &CudaSlice<T>,
    out: &mut CudaSlice<T>,
    shape: (usize, usize, f32),
) -> Result<()> {
    row_norm("rms_norm", stream, kernel, (x, weight), out, shape)
}

/// `out = rms_norm(x) · weight` in f32 (`rms_norm_wide`, or `rms_norm_f32` for f32 weights),
/// for `tokens` rows of width `hidden`.
pub(super) fn rms_norm_wide<W: DeviceRepr>(
    stream: &CudaStream,
    kernel: &CudaFunction,
    x: &CudaSlice<f32>,
    weight: &CudaSlice<W>,
    out: &mut CudaSlice<f32>,
    shape: (usize, usize, f32),
) -> Result<()> {
    row_norm("rms_norm_wide", stream, kernel, (x, weight), out, shape)
}

/// `rms_norm`, `rms_norm_wide` or `rms_norm_f32`, whose signatures differ only in the types
/// `W` of `weight` and `T` of `out`.
fn row_norm<W: DeviceRepr, T: DeviceRepr>(
    name: &'static str,
    stream: &CudaStream,
    kernel: &CudaFunction,
    (x, weight): (&CudaSlice<f32>, &CudaSlice<W>),
    out: &mut CudaSlice<T>,
    (tokens, hidden, eps): (usize, usize, f32),
) -> Result<()> {
    fits(name, "x", x.len(), tokens * hidden)?;
    fits(name, "out", out.len(), tokens * hidden)?;
    fits(name, "weight", weight.len(), hidden)?;
    let hidden = int(name, hidden)?;
    let config = grid(name, tokens, 1, ROW_THREADS)?;
    // SAFETY: the arguments match `rms_norm(const float*, const bf16*, bf16*, int, float)`,
    // `rms_norm_wide(const float*, const bf16*, float*, int, float)` and `rms_norm_f32` (float
    // weights and output) in order and type (the callers pair each kernel with its `W` and
    // `T`); `x` and `out` hold `tokens` rows of `hidden` and
    // `weight` holds `hidden` (checked above).
    #[allow(unsafe_code)]
    let launched = unsafe {
        stream
            .launch_builder(kernel)
            .arg(x)
            .arg(weight)
            .arg(out)
            .arg(&hidden)
            .arg(&eps)
            .launch(config)
    };
    launched
        .map(|_| ())
        .map_err(|e| CudaError::fault(name)(e).into())
}

/// Rotates the query and key heads of `qkv` in place (HF pairs `i`, `i + head_dim/2`).
pub(super) fn rope<T: DeviceRepr>(
    stream: &CudaStream,
    kernel: &CudaFunction,
    qkv: &mut CudaSlice<T>,
    positions: &CudaSlice<u32>,
    inv_freq: &CudaSlice<f32>,
    (tokens, rotated_heads, row_width, head_dim): (usize, usize, usize, usize),
) -> Result<()> {
    const NAME: &str = "rope";
    fits(NAME, "qkv", qkv.len(), tokens * row_width)?;
    fits(NAME, "positions", positions.len(), tokens)?;
    fits(NAME, "inv_freq", inv_freq.len(), head_dim / 2)?;
    fits(NAME, "a qkv row", row_width, rotated_heads * head_dim)?;
    let config = grid(NAME, tokens, 1, (head_dim / 2) as u32)?;
    let (row_width, head_dim) = (int(NAME, row_width)?, int(NAME, head_dim)?);
    let heads = int(NAME, rotated_heads)?;
    // SAFETY: the arguments match `rope(bf16*, const unsigned*, const float*, int, int, int)`,
    // or `rope_f32` (a `float*` qkv), in order and type, the caller pairing the kernel with
    // `T`; the grid covers `tokens` rows, each thread turning one pair in the first
    // `rotated_heads` heads, all inside `qkv`'s rows, and reads `head_dim / 2` frequencies
    // (checked above).
    #[allow(unsafe_code)]
    let launched = unsafe {
        stream
            .launch_builder(kernel)
            .arg(qkv)
            .arg(positions)
            .arg(inv_freq)
            .arg(&row_width)
            .arg(&head_dim)
            .arg(&heads)
            .launch(config)
    };
    launched
        .map(|_| ())
        .map_err(|e| CudaError::fault(NAME)(e).into())
}

/// The shape of one attention launch.
#[derive(Debug, Clone, Copy)]
pub(super) struct AttentionShape {
    /// Tokens in the batch.
    pub tokens: usize,
    /// Tiles of the host plan (`tiles` holds two entries each).
    pub tiles: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Keys a query sees, itself included (a sliding window); `None` for all before it.
    pub window: Option<usize>,
    /// `1 / sqrt(head_dim)`.
    pub scale: f32,
}

/// An attention kernel and the shape of its blocks.
pub(super) struct AttentionKernel {
    /// The loaded kernel.
    pub function: CudaFunction,
    /// Its name, for errors.
    pub name: &'static str,
    /// Queries per block (the host's tiles are cut to this).
    pub queries_per_block: u32,
    /// Threads per block.
    pub threads: u32,
    /// Whether it takes the head width as an argument (the CUDA-core kernels; the tensor-core
    /// ones are built for one width).
    pub takes_head_dim: bool,
}

/// Causal GQA attention over the packed batch: `attn[t, head] = softmax(q·kᵀ)·v`.
pub(super) fn attention<T: DeviceRepr>(
    stream: &CudaStream,
    kernel: &AttentionKernel,
    qkv: &CudaSlice<T>,
    attn: &mut CudaSlice<T>,
    cu_seq_lengths: &CudaSlice<u32>,
    tiles: &CudaSlice<u32>,
    shape: AttentionShape,
) -> Result<()> {
    let name = kernel.name;
    let AttentionShape {
        tokens,
        tiles: n_tiles,
        heads,
        kv_heads,
        head_dim,
        window,
        scale,
    } = shape;
    fits(
        name,
        "qkv",
        qkv.len(),
        tokens * (heads + 2 * kv_heads) * head_dim,
    )?;
    fits(name, "attn", attn.len(), tokens * heads * head_dim)?;
    fits(name, "tiles", tiles.len(), 2 * n_tiles)?;
    fits(name, "cu_seq_lengths", cu_seq_lengths.len(), 2)?;
    let config = grid(name, n_tiles, heads, kernel.threads)?;
    let (heads, kv_heads, head_dim) = (
        int(name, heads)?,
        int(name, kv_heads)?,
        int(name, head_dim)?,
    );
    // A window as wide as an i32 sees every key of any batch a GPU holds.
    let window = window.map_or(i32::MAX, |w| i32::try_from(w).unwrap_or(i32::MAX));
    let mut builder = stream.launch_builder(&kernel.function);
    builder
        .arg(qkv)
        .arg(attn)
        .arg(cu_seq_lengths)
        .arg(tiles)
        .arg(&heads)
        .arg(&kv_heads);
    // The tensor-core kernels take their head width as a template parameter, not an argument.
    if kernel.takes_head_dim {
        builder.arg(&head_dim);
    }
    builder.arg(&window).arg(&scale);
    // SAFETY: the arguments match `attention_varlen(const bf16*, bf16*, const unsigned*,
    // const unsigned*, int, int, int, int, float)`, `attention_varlen_f32` (float qkv and out:
    // the f32 mode's `T`), or `attention_mma_<D>` (the same less head_dim, D being this head
    // width: `uses_tensor_cores`, bf16 only), in order and type; the tiles come from the
    // host plan over this batch's `cu_seq_lengths` cut to this kernel's queries per block, so
    // every query and key row they name lies in `qkv`, and `attn` holds every query head's
    // output (checked above); `check_heads` bounds head_dim to the kernel's shared tile.
    #[allow(unsafe_code)]
    let launched = unsafe { builder.launch(config) };
    launched
        .map(|_| ())
        .map_err(|e| CudaError::fault(name)(e).into())
}

/// `act = silu(gate) · up` over `tokens` rows of the fused gate|up output.
pub(super) fn swiglu<T: DeviceRepr>(
    stream: &CudaStream,
    kernel: &CudaFunction,
    gate_up: &CudaSlice<T>,
    act: &mut CudaSlice<T>,
    (tokens, inter): (usize, usize),
) -> Result<()> {
    const NAME: &str = "swiglu";
    fits(NAME, "gate_up", gate_up.len(), tokens * 2 * inter)?;
    fits(NAME, "act", act.len(), tokens * inter)?;
    // bf16 rows move eight values a thread when they allow 16-byte access (the kernel's own
    // test); `swiglu_f32` moves one.
    let bf16 = size_of::<T>() == 2;
    let per_thread = if bf16 && inter.is_multiple_of(8) {
        8
    } else {
        1
    };
    let column_blocks = inter.div_ceil(per_thread * ROW_THREADS as usize);
    let config = grid(NAME, column_blocks, tokens.min(GRID_Y_MAX), ROW_THREADS)?;
    let (inter, tokens) = (int(NAME, inter)?, int(NAME, tokens)?);
    // SAFETY: the arguments match `swiglu(const bf16*, bf16*, int, int)`, or `swiglu_f32`
    // (float rows), in order and type, the caller pairing the kernel with `T`;
    // the kernel strides over `tokens` rows of `inter` outputs, all inside `act`, reading rows
    // of `2 · inter` inside `gate_up` (checked above).
    #[allow(unsafe_code)]
    let launched = unsafe {
        stream
            .launch_builder(kernel)
            .arg(gate_up)
            .arg(act)
            .arg(&inter)
            .arg(&tokens)
            .launch(config)
    };
    launched
        .map(|_| ())
        .map_err(|e| CudaError::fault(NAME)(e).into())
}

/// The launch of a grid-strided kernel over `n` values, and `n` as its `long long` parameter.
fn grid_strided(kernel: &'static str, n: usize) -> Result<(LaunchConfig, i64)> {
    let blocks = n
        .div_ceil(ROW_THREADS as usize)
        .clamp(1, GRID_STRIDE_MAX_BLOCKS);
    let elements = i64::try_from(n).map_err(|_| CudaError::Fault {
        action: kernel,
        reason: format!("{n} values do not fit the kernel's long long parameter"),
    })?;
    Ok((grid(kernel, blocks, 1, ROW_THREADS)?, elements))
}

/// `x += branch` over `n` values: a branch output kept apart joins the residual stream.
pub(super) fn add_rows(
    stream: &CudaStream,
    kernel: &CudaFunction,
    x: &mut CudaSlice<f32>,
    branch: &CudaSlice<f32>,
    n: usize,
) -> Result<()> {
    in_place("add_rows", stream, kernel, x, branch, n)
}

/// `attn *= sigmoid(gate)` over `n` values, in the mode's type `T`.
pub(super) fn sigmoid_gate<T: DeviceRepr>(
    stream: &CudaStream,
    kernel: &CudaFunction,
    attn: &mut CudaSlice<T>,
    gate: &CudaSlice<T>,
    n: usize,
) -> Result<()> {
    in_place("sigmoid_gate", stream, kernel, attn, gate, n)
}

/// A grid-strided kernel `name(T* target, const S* source, long long n)` that changes `n`
/// values of `target` by the matching ones of `source`: `add_rows` (f32) or `sigmoid_gate`
/// (bf16).
fn in_place<T: DeviceRepr, S: DeviceRepr>(
    name: &'static str,
    stream: &CudaStream,
    kernel: &CudaFunction,
    target: &mut CudaSlice<T>,
    source: &CudaSlice<S>,
    n: usize,
) -> Result<()> {
    fits(name, "the target", target.len(), n)?;
    fits(name, "the source", source.len(), n)?;
    let (config, elements) = grid_strided(name, n)?;
    // SAFETY: the arguments match `add_rows(float*, const float*, long long)`,
    // `sigmoid_gate(bf16*, const bf16*, long long)` and `sigmoid_gate_f32` (float) in order and
    // type (the callers pair each
    // kernel with its types); the kernel strides over `n` values, all inside both buffers
    // (checked above).
    #[allow(unsafe_code)]
    let launched = unsafe {
        stream
            .launch_builder(kernel)
            .arg(target)
            .arg(source)
            .arg(&elements)
            .launch(config)
    };
    launched
        .map(|_| ())
        .map_err(|e| CudaError::fault(name)(e).into())
}

/// `out = bf16(x + bias)` over `n` values, `bias` repeating every `width` of them: a projection's
/// f32 product gains its bias and is rounded once.
pub(super) fn add_bias_bf16(
    stream: &CudaStream,
    kernel: &CudaFunction,
    x: &CudaSlice<f32>,
    bias: &CudaSlice<f32>,
    out: &mut CudaSlice<u16>,
    (n, width): (usize, usize),
) -> Result<()> {
    const NAME: &str = "add_bias_bf16";
    fits(NAME, "x", x.len(), n)?;
    fits(NAME, "out", out.len(), n)?;
    fits(NAME, "bias", bias.len(), width.max(1))?;
    let (config, elements) = grid_strided(NAME, n)?;
    let width = int(NAME, width)?;
    // SAFETY: the arguments match `add_bias_bf16(const float*, const float*, bf16*, int, long
    // long)` in order and type; the kernel strides over `n` values, all inside `x` and `out`,
    // and reads `bias` below `width`, which it holds (checked above).
    #[allow(unsafe_code)]
    let launched = unsafe {
        stream
            .launch_builder(kernel)
            .arg(x)
            .arg(bias)
            .arg(out)
            .arg(&width)
            .arg(&elements)
            .launch(config)
    };
    launched
        .map(|_| ())
        .map_err(|e| CudaError::fault(NAME)(e).into())
}

/// `x += bias` over `n` values, `bias` repeating every `width` of them.
pub(super) fn add_bias(
    stream: &CudaStream,
    kernel: &CudaFunction,
    x: &mut CudaSlice<f32>,
    bias: &CudaSlice<f32>,
    (n, width): (usize, usize),
) -> Result<()> {
    const NAME: &str = "add_bias";
    fits(NAME, "x", x.len(), n)?;
    fits(NAME, "bias", bias.len(), width.max(1))?;
    let (config, elements) = grid_strided(NAME, n)?;
    let width = int(NAME, width)?;
    // SAFETY: the arguments match `add_bias(float*, const float*, int, long long)` in order and
    // type; the kernel strides over `n` values, all inside `x`, and reads `bias` below
    // `width`, which it holds (checked above).
    #[allow(unsafe_code)]
    let launched = unsafe {
        stream
            .launch_builder(kernel)
            .arg(x)
            .arg(bias)
            .arg(&width)
            .arg(&elements)
            .launch(config)
    };
    launched
        .map(|_| ())
        .map_err(|e| CudaError::fault(NAME)(e).into())
}

/// `out = bf16(x)` over `n` values: a kept layer's residual stream in the shards' dtype.
pub(super) fn round_bf16(
    stream: &CudaStream,
    kernel: &CudaFunction,
    x: &CudaSlice<f32>,
    out: &mut CudaViewMut<'_, u16>,
    n: usize,
) -> Result<()> {
    const NAME: &str = "round_bf16";
    fits(NAME, "x", x.len(), n)?;
    fits(NAME, "out", out.len(), n)?;
    let (config, elements) = grid_strided(NAME, n)?;
    // SAFETY: the arguments match `round_bf16(const float*, bf16*, long long)` in order and
    // type; the kernel strides over `n` values, all inside `x` and `out` (checked above).
    #[allow(unsafe_code)]
    let launched = unsafe {
        stream
            .launch_builder(kernel)
            .arg(x)
            .arg(out)
            .arg(&elements)
            .launch(config)
    };
    launched
        .map(|_| ())
        .map_err(|e| CudaError::fault(NAME)(e).into())
}

/// `out[t] = x[t] · unitsᵀ`: each token's projections onto `n` unit directions.
pub(super) fn project(
    stream: &CudaStream,
    kernel: &CudaFunction,
    x: &CudaSlice<f32>,
    units: &CudaSlice<f32>,
    out: &mut CudaViewMut<'_, f32>,
    (tokens, hidden, n): (usize, usize, usize),
) -> Result<()> {
    const NAME: &str = "project";
    fits(NAME, "x", x.len(), tokens * hidden)?;
    fits(NAME, "directions", units.len(), n * hidden)?;
    fits(NAME, "out", out.len(), tokens * n)?;
    let config = grid(NAME, tokens, 1, ROW_THREADS)?;
    let (hidden, n) = (int(NAME, hidden)?, int(NAME, n)?);
    // SAFETY: the arguments match `project(const float*, const float*, float*, int, int)` in
    // order and type; `x` holds `tokens` rows of `hidden`, `units` holds `n` of them and `out`
    // `tokens` rows of `n` (checked above).
    #[allow(unsafe_code)]
    let launched = unsafe {
        stream
            .launch_builder(kernel)
            .arg(x)
            .arg(units)
            .arg(out)
            .arg(&hidden)
            .arg(&n)
            .launch(config)
    };
    launched
        .map(|_| ())
        .map_err(|e| CudaError::fault(NAME)(e).into())
}

/// `c[rows, n] = a[rows, k] · w[n, k]ᵀ + beta · c`, row-major, with f32 accumulation; `inputs`
/// names the element type `I` of `a` and `w` (bf16, or f32 in the f32 mode), `c_type` that of
/// `c`, and `compute` cuBLAS's compute type. cuBLAS is column-major, so this computes
/// `cᵀ = w · aᵀ`.
pub(super) fn gemm<I, C>(
    blas: &Blas,
    stream: &CudaStream,
    buffers: (
        &impl DevicePtr<I>,
        &impl DevicePtr<I>,
        &mut impl DevicePtrMut<C>,
    ),
    (inputs, c_type, compute): (DataType, DataType, ComputeType),
    shape: (usize, usize, usize),
    beta: f32,
) -> Result<()> {
    let types = GemmTypes {
        inputs,
        output: c_type,
        compute,
    };
    gemm_typed(blas, stream, buffers, types, shape, beta)
}

/// `c[rows, n] = a[rows, k] · w[n, k]ᵀ` all in f32, summed in f32 without TF32 (the pedantic
/// compute type): AFMoE's router, whose logits choose experts.
pub(super) fn gemm_f32(
    blas: &Blas,
    stream: &CudaStream,
    a: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    c: &mut CudaSlice<f32>,
    shape: (usize, usize, usize),
) -> Result<()> {
    let types = GemmTypes {
        inputs: DataType::R_32F,
        output: DataType::R_32F,
        compute: ComputeType::F32_PEDANTIC,
    };
    gemm_typed(blas, stream, (a, w, c), types, shape, 0.0)
}

/// The element types of a GEMM's buffers and its compute type.
pub(super) struct GemmTypes {
    inputs: DataType,
    output: DataType,
    compute: ComputeType,
}

/// `c = a · wᵀ + beta · c` through `cublasGemmEx`, the buffers of element types `I` and `C`
/// that `types` names.
fn gemm_typed<I, C>(
    blas: &Blas,
    stream: &CudaStream,
    (a, w, c): (
        &impl DevicePtr<I>,
        &impl DevicePtr<I>,
        &mut impl DevicePtrMut<C>,
    ),
    types: GemmTypes,
    (rows, n, k): (usize, usize, usize),
    beta: f32,
) -> Result<()> {
    const NAME: &str = "cublasGemmEx";
    fits(NAME, "a", a.len(), rows * k)?;
    fits(NAME, "w", w.len(), n * k)?;
    fits(NAME, "c", c.len(), rows * n)?;
    let alpha = 1.0f32;
    let (m, n_cols, k_dim) = (int(NAME, n)?, int(NAME, rows)?, int(NAME, k)?);
    let (a_ptr, _a_sync) = a.device_ptr(stream);
    let (w_ptr, _w_sync) = w.device_ptr(stream);
    let (c_ptr, _c_sync) = c.device_ptr_mut(stream);
    // SAFETY: the three buffers live on `stream`'s device and hold at least rows·k, n·k and
    // rows·n elements (checked above) of the types `types` names (the two callers pair them);
    // the call only enqueues on the handle's stream, `stream`.
    #[allow(unsafe_code)]
    let done = unsafe {
        blas.gemm_tn(
            (m, n_cols, k_dim),
            (w_ptr as *const _, a_ptr as *const _, c_ptr as *mut _),
            (types.inputs, types.output, types.compute),
            (alpha, beta),
        )
    };
    done.map_err(|e| CudaError::fault(NAME)(e).into())
}

/// RMSNorm of each query head with `q_norm` and each key head with `k_norm`, in place on
/// `tokens` fused QKV rows of `row_width`.
pub(super) fn head_norm<T: DeviceRepr>(
    stream: &CudaStream,
    kernel: &CudaFunction,
    qkv: &mut CudaSlice<T>,
    (q_norm, k_norm): (&CudaSlice<T>, &CudaSlice<T>),
    (tokens, q_heads, kv_heads, head_dim, eps): (usize, usize, usize, usize, f32),
) -> Result<()> {
    const NAME: &str = "head_norm";
    let row_width = (q_heads + 2 * kv_heads) * head_dim;
    fits(NAME, "qkv", qkv.len(), tokens * row_width)?;
    fits(NAME, "q_norm", q_norm.len(), head_dim)?;
    fits(NAME, "k_norm", k_norm.len(), head_dim)?;
    let config = grid(NAME, tokens, q_heads + kv_heads, 32)?;
    let (row_width, q_heads) = (int(NAME, row_width)?, int(NAME, q_heads)?);
    let head_dim = int(NAME, head_dim)?;
    // SAFETY: the arguments match `head_norm(bf16*, const bf16*, const bf16*, int, int, int,
    // float)`, or `head_norm_f32` (float qkv and norms), in order and type, the caller pairing
    // the kernel with `T`; the grid covers `tokens` rows of the query and key heads, all
    // inside `qkv`, and each norm holds `head_dim` weights (checked above).
    #[allow(unsafe_code)]
    let launched = unsafe {
        stream
            .launch_builder(kernel)
            .arg(qkv)
            .arg(q_norm)
            .arg(k_norm)
            .arg(&row_width)
            .arg(&q_heads)
            .arg(&head_dim)
            .arg(&eps)
            .launch(config)
    };
    launched
        .map(|_| ())
        .map_err(|e| CudaError::fault(NAME)(e).into())
}

/// `rows[r] = normed[tokens[r]]` for `rows` grouped rows of width `hidden`; every entry of
/// `tokens` is below `normed`'s row count (the routing's grouping makes them so).
pub(super) fn moe_gather<T: DeviceRepr>(
    stream: &CudaStream,
    kernel: &CudaFunction,
    normed: &CudaSlice<T>,
    tokens: &CudaSlice<u32>,
    rows: &mut CudaSlice<T>,
    (count, batch_tokens, hidden): (usize, usize, usize),
) -> Result<()> {
    const NAME: &str = "moe_gather";
    fits(NAME, "normed", normed.len(), batch_tokens * hidden)?;
    fits(NAME, "tokens", tokens.len(), count)?;
    fits(NAME, "rows", rows.len(), count * hidden)?;
    let config = grid(NAME, count, 1, ROW_THREADS)?;
    let hidden = int(NAME, hidden)?;
    // SAFETY: the arguments match `moe_gather(const bf16*, const unsigned*, bf16*, int)`, or
    // `moe_gather_f32` (float rows), in order and type, the caller pairing the kernel with `T`; `rows` holds `count` rows and `tokens` `count` entries (checked above),
    // each a token of the batch (`Grouping::group` writes only those), so every row read is in
    // `normed`.
    #[allow(unsafe_code)]
    let launched = unsafe {
        stream
            .launch_builder(kernel)
            .arg(normed)
            .arg(tokens)
            .arg(rows)
            .arg(&hidden)
            .launch(config)
    };
    launched
        .map(|_| ())
        .map_err(|e| CudaError::fault(NAME)(e).into())
}

/// `branch[t] += Σ_j weights[t, j] · out[slots[t, j]]` for `tokens` tokens of `k` choices;
/// every slot is below `tokens · k` (the grouping's rows).
pub(super) fn moe_scatter(
    stream: &CudaStream,
    kernel: &CudaFunction,
    (out, slots, weights): (&CudaSlice<f32>, &CudaSlice<u32>, &CudaSlice<f32>),
    branch: &mut CudaSlice<f32>,
    (tokens, k, hidden): (usize, usize, usize),
) -> Result<()> {
    const NAME: &str = "moe_scatter";
    fits(NAME, "out", out.len(), tokens * k * hidden)?;
    fits(NAME, "slots", slots.len(), tokens * k)?;
    fits(NAME, "weights", weights.len(), tokens * k)?;
    fits(NAME, "branch", branch.len(), tokens * hidden)?;
    let config = grid(NAME, tokens, 1, ROW_THREADS)?;
    let (hidden, k) = (int(NAME, hidden)?, int(NAME, k)?);
    // SAFETY: the arguments match `moe_scatter(const float*, const unsigned*, const float*,
    // float*, int, int)` in order and type; `branch` holds `tokens` rows, `slots` and `weights`
    // `tokens · k` entries, and `out` `tokens · k` rows (checked above), and every slot is a
    // grouped row below `tokens · k` (`Grouping::group`).
    #[allow(unsafe_code)]
    let launched = unsafe {
        stream
            .launch_builder(kernel)
            .arg(out)
            .arg(slots)
            .arg(weights)
            .arg(branch)
            .arg(&hidden)
            .arg(&k)
            .launch(config)
    };
    launched
        .map(|_| ())
        .map_err(|e| CudaError::fault(NAME)(e).into())
}
