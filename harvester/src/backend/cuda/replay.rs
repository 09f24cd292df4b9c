//! `--device cuda-replay`: the CUDA backend's forward pass run on the CPU, for tests. The same
//! pass ([`crate::model::block::forward`]; AFMoE's ops in `afmoe`) runs over host buffers,
//! in either mode's type (`HostValue`: bf16 bits, or f32 with every rounding left out, as
//! the kernels' `_f32` entry points leave it), each op replaying its kernel
//! in `kernels.cu` loop for loop: the same weights and rounding points, the same
//! block-wide sums in the same order (a 256-thread block's strided partial sums, then the warp
//! butterflies), and the attention kernel's tiles and online softmax. What cannot be replayed
//! to the bit is named where it happens: cuBLAS's summation order (not fixed: here eight
//! running sums), the GPU's `sincosf`, `__expf` and `rsqrtf` (here the CPU's `sin_cos`, `exp`
//! and `1/sqrt`, within a few ulps of them), and whether the compiler fuses RoPE's products. The replay refuses what the CUDA backend
//! refuses. It is slow: a GEMM is a plain loop.

mod afmoe;

use rayon::prelude::*;

use super::emulation::{
    Heads, WARP, kernel_attention, kernel_attention_mma, kernel_bf16, warp_sum,
};
use super::forward::{bf16_values, decoded_f32, rounded_bf16};
use super::launch::ROW_THREADS;
use super::plan::{ATTENTION_VARIABLE, uses_tensor_cores};
use crate::backend::{Backend, Batch, CaptureSpec, Captured, Held, Stage};
use crate::error::Result;
use crate::model::block::{BlockOps, Source, Stack, Sublayer, forward};
use crate::model::weights::{Convert, Form, Host};
use crate::model::{BlockWeights, Half, HeadNorms, LlamaWeights, Matrix, ModelConfig, MoeWeights};
use harvest_core::plan::Precision;

/// An activation between kernels, or a weight, as the replay holds it in one mode: bf16 bits
/// (`u16`) or `f32`, as the CUDA backend's `Activation`.
pub(super) trait HostValue:
    Copy + Default + Send + Sync + std::fmt::Debug + 'static
{
    /// The mode.
    const PRECISION: Precision;
    /// The kernels' `widened`.
    fn widen(self) -> f32;
    /// The kernels' `stored<T>`: rounded to bf16, or as it is.
    fn stored(value: f32) -> Self;
    /// A matrix as the CUDA backend uploads it in this mode.
    fn matrix(matrix: &Matrix) -> Vec<Self>;
    /// f32 values (norm weights) as the CUDA backend uploads them in this mode.
    fn values(values: &[f32]) -> Vec<Self>;
}

impl HostValue for u16 {
    const PRECISION: Precision = Precision::Bf16;

    fn widen(self) -> f32 {
        widen(self)
    }

    fn stored(value: f32) -> Self {
        kernel_bf16(value)
    }

    fn matrix(matrix: &Matrix) -> Vec<Self> {
        bf16_matrix(matrix)
    }

    fn values(values: &[f32]) -> Vec<Self> {
        bf16_values(values)
    }
}

impl HostValue for f32 {
    const PRECISION: Precision = Precision::F32;

    fn widen(self) -> f32 {
        self
    }

    fn stored(value: f32) -> Self {
        value
    }

    fn matrix(matrix: &Matrix) -> Vec<Self> {
        decoded_f32(matrix)
    }

    fn values(values: &[f32]) -> Vec<Self> {
        values.to_vec()
    }
}

/// The weights as the CUDA backend uploads them in the mode of `T`: matrices and norms in `T`,
/// biases and the router in f32.
#[derive(Debug, Clone)]
struct Replayed<T>(std::marker::PhantomData<T>);

impl<T: HostValue> Form for Replayed<T> {
    type Matrix = Vec<T>;
    type Norm = Vec<T>;
    type Bias = Vec<f32>;
    type Router = Vec<f32>;
}

/// The replay's upload.
struct ToHost;

impl<T: HostValue> Convert<Host, Replayed<T>> for ToHost {
    fn matrix(&mut self, matrix: Matrix) -> Result<Vec<T>> {
        Ok(T::matrix(&matrix))
    }
    fn norm(&mut self, norm: Vec<f32>) -> Result<Vec<T>> {
        Ok(T::values(&norm))
    }
    fn bias(&mut self, bias: Vec<f32>) -> Result<Vec<f32>> {
        Ok(bias)
    }
    fn router(&mut self, router: Matrix) -> Result<Vec<f32>> {
        Ok(router.to_f32_vec())
    }
}

/// The CUDA backend's forward pass replayed on the CPU, in the spec's precision.
pub struct ReplayBackend {
    replay: Box<dyn ReplayPass>,
    /// With the batch tail hidden (`HARVEST_CUDA_TAIL=overlap`), the capture held back until
    /// the next call, as the CUDA backend holds one: the run's order of hand-backs is the
    /// GPU's.
    overlap: bool,
    ahead: Option<Captured>,
}

/// What [`ReplayBackend`] asks of the replay in either mode.
trait ReplayPass: Backend + Stage {}

impl<T: HostValue> ReplayPass for Replay<T> {}

/// The replay in the mode of `T`.
struct Replay<T: HostValue> {
    spec: CaptureSpec,
    config: ModelConfig,
    /// The embedding, on the first stage only (empty on the others).
    embed: Vec<T>,
    /// The model's block the first of `blocks` is.
    first_block: usize,
    /// The blocks this backend runs, up to the deepest kept one.
    blocks: Vec<BlockWeights<Replayed<T>>>,
    inv_freq: Vec<f32>,
    tensor_cores: bool,
}

impl std::fmt::Debug for ReplayBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplayBackend")
            .field("precision", &self.replay.spec().precision)
            .finish_non_exhaustive()
    }
}

/// `f32_to_bf16`'s bits widened back to f32.
fn widen(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// A matrix in bf16 bits, as the CUDA backend's upload rounds it.
fn bf16_matrix(matrix: &Matrix) -> Vec<u16> {
    if matrix.half() == Some(Half::Bf16) {
        return matrix
            .half_bytes()
            .into_iter()
            .flat_map(|part| part.chunks_exact(2))
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
    }
    rounded_bf16(matrix)
}

impl ReplayBackend {
    /// Takes `weights` (the blocks up to the deepest kept one) in bf16, refusing what the CUDA
    /// backend refuses.
    pub fn new(weights: LlamaWeights, spec: CaptureSpec) -> Result<Self> {
        spec.check(&weights)?;
        Self::load(weights, spec)
    }

    /// A pipeline stage: `weights` holds a range of the model's blocks (the embedding too when
    /// it starts at block 0), run on the residual stream the stage before hands on.
    pub fn stage(weights: LlamaWeights, spec: CaptureSpec) -> Result<Self> {
        spec.check_directions(&weights)?;
        Self::load(weights, spec)
    }

    fn load(weights: LlamaWeights, spec: CaptureSpec) -> Result<Self> {
        super::forward::check_model(&weights.config)?;
        let replay: Box<dyn ReplayPass> = match spec.precision {
            Precision::Bf16 => Box::new(Replay::<u16>::load(weights, spec)?),
            Precision::F32 => Box::new(Replay::<f32>::load(weights, spec)?),
        };
        let overlap =
            super::switches::switch(super::forward::TAIL_VARIABLE).as_deref() == Some("overlap");
        Ok(Self {
            replay,
            overlap,
            ahead: None,
        })
    }
}

impl Backend for ReplayBackend {
    fn name(&self) -> &'static str {
        "cuda-replay"
    }

    fn capture_width(&self) -> usize {
        self.replay.capture_width()
    }

    fn spec(&self) -> &CaptureSpec {
        self.replay.spec()
    }

    fn capture(&mut self, batch: &Batch, out: &mut Captured) -> Result<()> {
        self.replay.capture(batch, out)
    }

    fn capture_next(&mut self, batch: &Batch, mut out: Captured) -> Result<Option<Captured>> {
        self.replay.capture(batch, &mut out)?;
        if !self.overlap {
            return Ok(Some(out));
        }
        Ok(self.ahead.replace(out))
    }

    fn finish(&mut self) -> Result<Option<Captured>> {
        Ok(self.ahead.take())
    }
}

impl Stage for ReplayBackend {
    fn forward(&mut self, batch: &Batch, x: &mut Vec<f32>, out: &mut Captured) -> Result<()> {
        self.replay.forward(batch, x, out)
    }
}

impl<T: HostValue> Replay<T> {
    fn load(weights: LlamaWeights, spec: CaptureSpec) -> Result<Self> {
        let run = spec.blocks_to_run(weights.first_block, weights.blocks.len());
        let config = weights.config;
        let blocks = weights
            .blocks
            .into_iter()
            .take(run)
            .map(|b| b.convert(&mut ToHost))
            .collect::<Result<_>>()?;
        let forced = super::switches::switch(ATTENTION_VARIABLE);
        // The tensor-core kernels are bf16's alone.
        let bf16 = T::PRECISION == Precision::Bf16;
        Ok(Self {
            tensor_cores: bf16 && uses_tensor_cores(config.head_dim, forced.as_deref()),
            inv_freq: config
                .inverse_frequencies()
                .iter()
                .map(|&f| f as f32)
                .collect(),
            embed: T::matrix(&weights.embed),
            first_block: weights.first_block,
            blocks,
            config,
            spec,
        })
    }
}

impl<T: HostValue> Backend for Replay<T> {
    fn name(&self) -> &'static str {
        "cuda-replay"
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
        let shape = (self.spec.sites.len(), self.spec.layers.len(), tokens, width);
        out.reset_held(Held::of(true, &self.spec), shape);
        out.routes
            .reset(self.spec.route_shape(&self.config), tokens);
        if tokens == 0 {
            return Ok(());
        }
        let mut x = Vec::new();
        self.run_blocks(batch, &mut x, out)
    }
}

impl<T: HostValue> Stage for Replay<T> {
    fn forward(&mut self, batch: &Batch, x: &mut Vec<f32>, out: &mut Captured) -> Result<()> {
        batch.validate(self.config.vocab_size)?;
        self.run_blocks(batch, x, out)
    }
}

impl<T: HostValue> Replay<T> {
    /// Runs the blocks on `x`, embedding `batch` into it first on the first stage; kept sites
    /// go to their slots in `out`, which holds the whole batch.
    fn run_blocks(&self, batch: &Batch, x: &mut Vec<f32>, out: &mut Captured) -> Result<()> {
        let mut ops = HostOps {
            config: &self.config,
            batch,
            embed: &self.embed,
            inv_freq: &self.inv_freq,
            tensor_cores: self.tensor_cores,
            directions: self.spec.directions.as_ref().map(|d| d.unit_vectors()),
            x: std::mem::take(x),
            normed: Vec::new(),
            qkv: Vec::new(),
            attn: Vec::new(),
            gate_up: Vec::new(),
            act: Vec::new(),
            branch: Vec::new(),
            inter: 0,
            out,
        };
        let stack = Stack {
            config: &self.config,
            first_block: self.first_block,
            blocks: &self.blocks,
        };
        let result = forward(&mut ops, stack, self.spec.keeps());
        // The residual stream goes on to the next stage.
        *x = ops.x;
        result
    }
}

/// One batch's buffers on the host, in the CUDA backend's dtypes for the mode of `T`.
struct HostOps<'a, T> {
    config: &'a ModelConfig,
    batch: &'a Batch,
    embed: &'a [T],
    inv_freq: &'a [f32],
    tensor_cores: bool,
    directions: Option<&'a [f32]>,
    x: Vec<f32>,
    normed: Vec<T>,
    qkv: Vec<T>,
    attn: Vec<T>,
    gate_up: Vec<T>,
    act: Vec<T>,
    branch: Vec<f32>,
    /// The inner width of the last `gate_up`, for SwiGLU and the down projection.
    inter: usize,
    out: &'a mut Captured,
}

impl<T: HostValue> HostOps<'_, T> {
    fn tokens(&self) -> usize {
        self.batch.num_tokens()
    }

    /// The input of `sublayer`'s output projection.
    fn output_input(&self, sublayer: Sublayer) -> &[T] {
        match sublayer {
            Sublayer::Attention => &self.attn,
            Sublayer::Mlp => &self.act,
        }
    }
}

impl<'a, T: HostValue> BlockOps<'a, Replayed<T>> for HostOps<'a, T> {
    fn embed(&mut self, scale: f32) -> Result<()> {
        // embed_gather
        let hidden = self.config.hidden_size;
        self.x.clear();
        for &id in &self.batch.input_ids {
            let row = &self.embed[id as usize * hidden..][..hidden];
            self.x.extend(row.iter().map(|&b| b.widen() * scale));
        }
        Ok(())
    }

    fn norm(&mut self, weight: &Vec<T>, _: Sublayer) -> Result<()> {
        let c = self.config;
        self.normed = rms_norm(&self.x, weight, c.hidden_size, c.rms_norm_eps as f32);
        Ok(())
    }

    fn qkv(&mut self, weight: &Vec<T>, bias: Option<&Vec<f32>>) -> Result<()> {
        let c = self.config;
        let mut product = gemm(&self.normed, weight, c.qkv_width(), c.hidden_size);
        if let Some(bias) = bias {
            add_bias(&mut product, bias);
        }
        self.qkv = product.iter().map(|&v| T::stored(v)).collect();
        Ok(())
    }

    fn rope(&mut self) -> Result<()> {
        let c = self.config;
        let rotated = c.num_heads + c.num_kv_heads;
        for (t, row) in self.qkv.chunks_exact_mut(c.qkv_width()).enumerate() {
            let position = self.batch.positions[t];
            for head in row.chunks_exact_mut(c.head_dim).take(rotated) {
                rope_head(head, position, self.inv_freq);
            }
        }
        Ok(())
    }

    fn attention(&mut self, window: Option<usize>) -> Result<()> {
        let c = self.config;
        let qkv: Vec<f32> = self.qkv.iter().map(|&v| v.widen()).collect();
        let heads = Heads(c.num_heads, c.num_kv_heads, c.head_dim);
        let cu = &self.batch.cu_seq_lengths;
        // attention_varlen_f32's smaller key tiles change no order: keys run one by one.
        let out = if self.tensor_cores {
            kernel_attention_mma(&qkv, cu, heads, window)
        } else {
            kernel_attention(&qkv, cu, heads, window)
        };
        self.attn = out.iter().map(|&v| T::stored(v)).collect();
        Ok(())
    }

    fn gate_up(&mut self, weight: &Vec<T>, width: usize) -> Result<()> {
        let c = self.config;
        self.inter = width;
        let product = gemm(&self.normed, weight, 2 * self.inter, c.hidden_size);
        self.gate_up = product.iter().map(|&v| T::stored(v)).collect();
        Ok(())
    }

    fn swiglu(&mut self) -> Result<()> {
        self.act = swiglu(&self.gate_up, self.inter);
        Ok(())
    }

    fn output_into_residual(&mut self, weight: &Vec<T>, sublayer: Sublayer) -> Result<()> {
        let hidden = self.config.hidden_size;
        let input = self.output_input(sublayer);
        let product = gemm(input, weight, hidden, input.len() / self.tokens());
        // beta = 1: the product, summed in f32, is added to x once.
        for (x, p) in self.x.iter_mut().zip(product) {
            *x += p;
        }
        Ok(())
    }

    fn output_apart(
        &mut self,
        weight: &Vec<T>,
        bias: Option<&Vec<f32>>,
        sublayer: Sublayer,
    ) -> Result<()> {
        let hidden = self.config.hidden_size;
        let input = self.output_input(sublayer);
        self.branch = gemm(input, weight, hidden, input.len() / self.tokens());
        if let Some(bias) = bias {
            add_bias(&mut self.branch, bias);
        }
        Ok(())
    }

    fn head_norms(&mut self, norms: &HeadNorms<Replayed<T>>) -> Result<()> {
        self.head_norms_of(norms)
    }

    fn attention_gate(&mut self, weight: &Vec<T>) -> Result<()> {
        self.attention_gate_of(weight)
    }

    fn branch_norm(&mut self, weight: &Vec<T>) -> Result<()> {
        let c = self.config;
        self.branch = rms_norm_wide(&self.branch, weight, c.hidden_size, c.rms_norm_eps as f32);
        Ok(())
    }

    fn clear_branch(&mut self) -> Result<()> {
        self.branch = vec![0.0; self.tokens() * self.config.hidden_size];
        Ok(())
    }

    fn routed_experts(
        &mut self,
        moe: &MoeWeights<Replayed<T>>,
        norm: &Vec<T>,
        route: Option<usize>,
    ) -> Result<()> {
        self.routed_experts_of(moe, norm, route)
    }

    fn add_branch(&mut self) -> Result<()> {
        for (x, b) in self.x.iter_mut().zip(&self.branch) {
            *x += b;
        }
        Ok(())
    }

    fn keep(&mut self, source: Source, slot: usize) -> Result<()> {
        let hidden = self.config.hidden_size;
        let values = match source {
            Source::Residual => &self.x,
            Source::Branch => &self.branch,
        };
        match self.directions {
            None => {
                // Held as bf16, as the CUDA backend holds its rows.
                let rows = self.out.layer_bits_mut(slot);
                for (kept, &v) in rows.iter_mut().zip(values) {
                    *kept = kernel_bf16(v);
                }
            }
            Some(units) => {
                let rows = self.out.layer_mut(slot);
                let n = units.len() / hidden;
                for (row, kept) in values.chunks_exact(hidden).zip(rows.chunks_exact_mut(n)) {
                    for (direction, value) in units.chunks_exact(hidden).zip(kept.iter_mut()) {
                        *value = warp_dot(row, direction);
                    }
                }
            }
        }
        Ok(())
    }
}

/// `add_bias` (and `add_bias_bf16` before its rounding): `bias` added to each row of `values`.
fn add_bias(values: &mut [f32], bias: &[f32]) {
    for row in values.chunks_exact_mut(bias.len()) {
        for (value, b) in row.iter_mut().zip(bias) {
            *value += b;
        }
    }
}

/// `norm_rows` over each row of `x`: the scale of [`rms_scale`] times each value times its
/// weight, stored in the mode's type (`rms_norm`, `rms_norm_f32`).
fn rms_norm<T: HostValue>(x: &[f32], weight: &[T], hidden: usize, eps: f32) -> Vec<T> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(hidden) {
        let scale = rms_scale(row, eps);
        out.extend(
            row.iter()
                .zip(weight)
                .map(|(&v, &w)| T::stored(v * scale * w.widen())),
        );
    }
    out
}

/// `rms_norm_wide` (`rms_norm_f32` for f32 weights): [`rms_norm`] left in f32.
fn rms_norm_wide<T: HostValue>(x: &[f32], weight: &[T], hidden: usize, eps: f32) -> Vec<f32> {
    rms_norm::<f32>(
        x,
        &weight.iter().map(|w| w.widen()).collect::<Vec<_>>(),
        hidden,
        eps,
    )
}

/// `norm_rows`'s scale (with `block_sum`): a block of `ROW_THREADS` threads, each summing the squares
/// of every `ROW_THREADS`-th value (fused multiply-adds, as the compiler contracts them), a
/// butterfly within each warp, then one over the warps' partial sums; `1 / sqrt(mean + eps)`.
fn rms_scale(row: &[f32], eps: f32) -> f32 {
    let threads = ROW_THREADS as usize;
    let mut partial = [0.0f32; WARP];
    for (warp, total) in partial.iter_mut().enumerate().take(threads / WARP) {
        let mut lanes = [0.0f32; WARP];
        for (lane, sum) in lanes.iter_mut().enumerate() {
            let thread = warp * WARP + lane;
            for value in row.iter().skip(thread).step_by(threads) {
                *sum = value.mul_add(*value, *sum);
            }
        }
        *total = warp_sum(lanes);
    }
    1.0 / (warp_sum(partial) / row.len() as f32 + eps).sqrt()
}

/// `swiglu` (or `swiglu_f32`) over rows of `gate_up` (`[rows, 2 inter]`, gate first).
fn swiglu<T: HostValue>(gate_up: &[T], inter: usize) -> Vec<T> {
    gate_up
        .chunks_exact(2 * inter)
        .flat_map(|row| {
            let (gate, up) = row.split_at(inter);
            gate.iter().zip(up).map(|(&g, &u)| silu_times(g, u))
        })
        .collect()
}

/// `rotate_heads` on one head: dimension `i` pairs with `i + head_dim / 2`, the angle in f32.
fn rope_head<T: HostValue>(head: &mut [T], position: u32, inv_freq: &[f32]) {
    let half = head.len() / 2;
    for (i, &frequency) in inv_freq.iter().enumerate().take(half) {
        let (s, c) = (position as f32 * frequency).sin_cos();
        let (a, b) = (head[i].widen(), head[i + half].widen());
        head[i] = T::stored(a * c - b * s);
        head[i + half] = T::stored(b * c + a * s);
    }
}

/// `silu_times`: `silu(gate) · up` in f32, stored in the mode's type.
fn silu_times<T: HostValue>(gate: T, up: T) -> T {
    let g = gate.widen();
    T::stored(g / (1.0 + (-g).exp()) * up.widen())
}

/// `project`'s dot product: lane `l` sums every 32nd product from `l` (fused), then the warp
/// butterfly.
fn warp_dot(row: &[f32], direction: &[f32]) -> f32 {
    let mut lanes = [0.0f32; WARP];
    for (lane, sum) in lanes.iter_mut().enumerate() {
        for i in (lane..row.len()).step_by(WARP) {
            *sum = row[i].mul_add(direction[i], *sum);
        }
    }
    warp_sum(lanes)
}

/// `c[t, n] = a[t, :] · w[n, :]` over inputs of the mode's type, in f32: cuBLAS's order is its
/// own, so this one keeps eight running sums (products of two bf16 values are exact in f32,
/// fused or not; f32 products are rounded here, and may be fused there).
fn gemm<T: HostValue>(a: &[T], w: &[T], n: usize, k: usize) -> Vec<f32> {
    let mut c = vec![0.0f32; a.len() / k * n];
    c.par_chunks_mut(n)
        .zip(a.par_chunks(k))
        .for_each(|(c_row, a_row)| {
            let a_row: Vec<f32> = a_row.iter().map(|&v| v.widen()).collect();
            for (value, w_row) in c_row.iter_mut().zip(w.chunks_exact(k)) {
                let mut sums = [0.0f32; 8];
                let (a_chunks, w_chunks) = (a_row.chunks_exact(8), w_row.chunks_exact(8));
                let (a_tail, w_tail) = (a_chunks.remainder(), w_chunks.remainder());
                for (a8, w8) in a_chunks.zip(w_chunks) {
                    for lane in 0..8 {
                        sums[lane] += a8[lane] * w8[lane].widen();
                    }
                }
                for (lane, (&a, &w)) in a_tail.iter().zip(w_tail).enumerate() {
                    sums[lane] += a * w.widen();
                }
                *value = sums.iter().sum();
            }
        });
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_warp_butterfly_adds_every_lane_once() {
        let lanes: [f32; WARP] = std::array::from_fn(|i| i as f32);
        assert_eq!(warp_sum(lanes), (0..32).sum::<i32>() as f32);
    }

    #[test]
    fn the_norm_replay_is_rms_norm_to_bf16_rounding() {
        let hidden = 600;
        let x: Vec<f32> = (0..2 * hidden)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let weight: Vec<u16> = (0..hidden)
            .map(|i| half::bf16::from_f32(0.5 + (i % 5) as f32 / 4.0).to_bits())
            .collect();
        let out = rms_norm(&x, &weight, hidden, 1e-5);
        for (row, normed) in x.chunks(hidden).zip(out.chunks(hidden)) {
            let mean: f64 = row
                .iter()
                .map(|&v| f64::from(v) * f64::from(v))
                .sum::<f64>()
                / hidden as f64;
            let scale = 1.0 / (mean + 1e-5).sqrt();
            for ((&v, &w), &got) in row.iter().zip(&weight).zip(normed) {
                let exact = f64::from(v) * scale * f64::from(widen(w));
                let error = (f64::from(widen(got)) - exact).abs();
                assert!(error <= exact.abs() / 128.0 + 1e-6, "{got} vs {exact}");
            }
        }
    }

    #[test]
    fn the_parallel_rounding_to_bf16_equals_rounding_value_by_value() {
        // More rows than one conversion task, and a last task that is not full.
        let (rows, cols) = (150, 7);
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| (i as f32 * 0.37).sin() * 1e3 + 1.0 / (1.0 + i as f32))
            .collect();
        let one_by_one: Vec<u16> = values
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect();
        let matrix = Matrix::from_f32(rows, cols, values.clone());
        assert_eq!(rounded_bf16(&matrix), one_by_one);
        assert_eq!(bf16_values(&values), one_by_one);
    }

    #[test]
    fn rope_at_position_zero_leaves_a_head_as_it_was() {
        let mut head: Vec<u16> = (0..8)
            .map(|i| half::bf16::from_f32(i as f32).to_bits())
            .collect();
        let before = head.clone();
        rope_head(&mut head, 0, &[1.0, 0.1, 0.01, 0.001]);
        assert_eq!(head, before);
        rope_head(&mut head, 3, &[1.0, 0.1, 0.01, 0.001]);
        assert_ne!(head, before);
    }
}
