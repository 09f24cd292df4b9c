//! `--device cuda-replay`: the CUDA backend's forward pass run on the CPU, for tests. The same
//! blocks ([`crate::model::forward_block`]: dense, and AFMoE in `afmoe`) run over host buffers, each op replaying its kernel
//! in `kernels.cu` loop for loop: the same bf16 weights and rounding points, the same
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
use super::forward::{bf16_values, rounded_bf16};
use super::launch::ROW_THREADS;
use super::plan::{ATTENTION_VARIABLE, uses_tensor_cores};
use crate::backend::{Backend, Batch, CaptureSpec, Captured, Stage};
use crate::error::Result;
use crate::model::dense::{BlockOps, Source, Sublayer};
use crate::model::{Half, LlamaWeights, Matrix, ModelConfig};

/// One block's weights in bf16, as the CUDA backend uploads them.
struct HostBlock {
    attn_norm: Vec<u16>,
    qkv: Vec<u16>,
    qkv_bias: Option<Vec<f32>>,
    o: Vec<u16>,
    o_bias: Option<Vec<f32>>,
    mlp_norm: Vec<u16>,
    gate_up: Vec<u16>,
    down: Vec<u16>,
    /// The MLP's inner width (0 for a sparse block without shared experts).
    inter: usize,
    afmoe: Option<afmoe::HostAfmoe>,
}

/// The CUDA backend's forward pass replayed on the CPU.
pub struct ReplayBackend {
    spec: CaptureSpec,
    config: ModelConfig,
    /// The embedding, on the first stage only (empty on the others).
    embed: Vec<u16>,
    /// The model's block the first of `blocks` is.
    first_block: usize,
    /// The blocks this backend runs, up to the deepest kept one.
    blocks: Vec<HostBlock>,
    inv_freq: Vec<f32>,
    tensor_cores: bool,
}

impl std::fmt::Debug for ReplayBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplayBackend")
            .field("blocks", &self.blocks.len())
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
        let run = spec.blocks_to_run(weights.first_block, weights.blocks.len());
        let config = weights.config.clone();
        let blocks = weights.blocks[..run]
            .iter()
            .map(|b| HostBlock {
                attn_norm: bf16_values(&b.attn_norm),
                qkv: bf16_matrix(&b.qkv),
                qkv_bias: b.qkv_bias.clone(),
                o: bf16_matrix(&b.o),
                o_bias: b.o_bias.clone(),
                mlp_norm: bf16_values(&b.mlp_norm),
                gate_up: bf16_matrix(&b.gate_up),
                down: bf16_matrix(&b.down),
                inter: b.down.cols(),
                afmoe: b.afmoe.as_ref().map(afmoe::HostAfmoe::of),
            })
            .collect();
        let forced = std::env::var(ATTENTION_VARIABLE).ok();
        Ok(Self {
            tensor_cores: uses_tensor_cores(config.head_dim, forced.as_deref()),
            inv_freq: config
                .inverse_frequencies()
                .iter()
                .map(|&f| f as f32)
                .collect(),
            embed: bf16_matrix(&weights.embed),
            first_block: weights.first_block,
            blocks,
            config,
            spec,
        })
    }
}

impl Backend for ReplayBackend {
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
        out.reset(self.spec.sites.len(), self.spec.layers.len(), tokens, width);
        if tokens == 0 {
            return Ok(());
        }
        let mut x = Vec::new();
        self.run_blocks(batch, &mut x, out)
    }
}

impl Stage for ReplayBackend {
    fn forward(&mut self, batch: &Batch, x: &mut Vec<f32>, out: &mut Captured) -> Result<()> {
        batch.validate(self.config.vocab_size)?;
        self.run_blocks(batch, x, out)
    }
}

impl ReplayBackend {
    /// Runs the blocks on `x`, embedding `batch` into it first on the first stage; kept sites
    /// go to their slots in `out`, which holds the whole batch.
    fn run_blocks(&self, batch: &Batch, x: &mut Vec<f32>, out: &mut Captured) -> Result<()> {
        let hidden = self.config.hidden_size;
        if self.first_block == 0 {
            // embed_gather
            let scale = super::forward::embedding_scale(&self.config);
            x.clear();
            for &id in &batch.input_ids {
                let row = &self.embed[id as usize * hidden..][..hidden];
                x.extend(row.iter().map(|&b| widen(b) * scale));
            }
        }
        let mut ops = HostOps {
            config: &self.config,
            batch,
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
        let mut result = Ok(());
        for (local, block) in self.blocks.iter().enumerate() {
            let index = self.first_block + local;
            let layer = self.spec.layers.position(index);
            let slot = |site| {
                let layer = layer?;
                let position = self.spec.sites.position(site)?;
                Some(position * self.spec.layers.len() + layer)
            };
            ops.inter = block.inter;
            result = crate::model::forward_block(&mut ops, block, &self.config, index, slot);
            if result.is_err() {
                break;
            }
        }
        // The residual stream goes on to the next stage.
        *x = ops.x;
        result
    }
}

/// One batch's buffers on the host, in the CUDA backend's dtypes.
struct HostOps<'a> {
    config: &'a ModelConfig,
    batch: &'a Batch,
    inv_freq: &'a [f32],
    tensor_cores: bool,
    directions: Option<&'a [f32]>,
    x: Vec<f32>,
    normed: Vec<u16>,
    qkv: Vec<u16>,
    attn: Vec<u16>,
    gate_up: Vec<u16>,
    act: Vec<u16>,
    branch: Vec<f32>,
    /// The block's MLP width (`HostBlock::inter`), for SwiGLU.
    inter: usize,
    out: &'a mut Captured,
}

impl HostOps<'_> {
    fn tokens(&self) -> usize {
        self.batch.num_tokens()
    }

    /// The input and weight of `sublayer`'s output projection.
    fn output<'b>(&'b self, block: &'b HostBlock, sublayer: Sublayer) -> (&'b [u16], &'b [u16]) {
        match sublayer {
            Sublayer::Attention => (&self.attn, &block.o),
            Sublayer::Mlp => (&self.act, &block.down),
        }
    }
}

impl BlockOps for HostOps<'_> {
    type Block = HostBlock;

    fn norm(&mut self, block: &HostBlock, sublayer: Sublayer) -> Result<()> {
        let weight = match sublayer {
            Sublayer::Attention => &block.attn_norm,
            Sublayer::Mlp => &block.mlp_norm,
        };
        let c = self.config;
        self.normed = rms_norm(&self.x, weight, c.hidden_size, c.rms_norm_eps as f32);
        Ok(())
    }

    fn qkv(&mut self, block: &HostBlock) -> Result<()> {
        let c = self.config;
        let mut product = gemm(&self.normed, &block.qkv, c.qkv_width(), c.hidden_size);
        if let Some(bias) = &block.qkv_bias {
            add_bias(&mut product, bias);
        }
        self.qkv = product.iter().map(|&v| kernel_bf16(v)).collect();
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
        let qkv: Vec<f32> = self.qkv.iter().map(|&b| widen(b)).collect();
        let heads = Heads(c.num_heads, c.num_kv_heads, c.head_dim);
        let cu = &self.batch.cu_seq_lengths;
        let out = if self.tensor_cores {
            kernel_attention_mma(&qkv, cu, heads, window)
        } else {
            kernel_attention(&qkv, cu, heads, window)
        };
        self.attn = out.iter().map(|&v| kernel_bf16(v)).collect();
        Ok(())
    }

    fn gate_up(&mut self, block: &HostBlock) -> Result<()> {
        let c = self.config;
        let product = gemm(&self.normed, &block.gate_up, 2 * self.inter, c.hidden_size);
        self.gate_up = product.iter().map(|&v| kernel_bf16(v)).collect();
        Ok(())
    }

    fn swiglu(&mut self) -> Result<()> {
        self.act = swiglu(&self.gate_up, self.inter);
        Ok(())
    }

    fn output_into_residual(&mut self, block: &HostBlock, sublayer: Sublayer) -> Result<()> {
        let hidden = self.config.hidden_size;
        let (input, w) = self.output(block, sublayer);
        let product = gemm(input, w, hidden, input.len() / self.tokens());
        // beta = 1: the product, summed in f32, is added to x once.
        for (x, p) in self.x.iter_mut().zip(product) {
            *x += p;
        }
        Ok(())
    }

    fn output_apart(&mut self, block: &HostBlock, sublayer: Sublayer) -> Result<()> {
        let hidden = self.config.hidden_size;
        let (input, w) = self.output(block, sublayer);
        self.branch = gemm(input, w, hidden, input.len() / self.tokens());
        if let (Some(bias), Sublayer::Attention) = (&block.o_bias, sublayer) {
            add_bias(&mut self.branch, bias);
        }
        Ok(())
    }

    fn output_bias(&self, block: &HostBlock, sublayer: Sublayer) -> bool {
        sublayer == Sublayer::Attention && block.o_bias.is_some()
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
        let rows = self.out.layer_mut(slot);
        match self.directions {
            None => {
                for (kept, &v) in rows.iter_mut().zip(values) {
                    *kept = widen(kernel_bf16(v));
                }
            }
            Some(units) => {
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

/// `rms_norm` over each row of `x`: the scale of [`rms_scale`] times each value times its
/// bf16 weight, rounded to bf16.
fn rms_norm(x: &[f32], weight: &[u16], hidden: usize, eps: f32) -> Vec<u16> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(hidden) {
        let scale = rms_scale(row, eps);
        out.extend(
            row.iter()
                .zip(weight)
                .map(|(&v, &w)| kernel_bf16(v * scale * widen(w))),
        );
    }
    out
}

/// `rms_norm_wide`: [`rms_norm`] left in f32.
fn rms_norm_wide(x: &[f32], weight: &[u16], hidden: usize, eps: f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(hidden) {
        let scale = rms_scale(row, eps);
        out.extend(row.iter().zip(weight).map(|(&v, &w)| v * scale * widen(w)));
    }
    out
}

/// `rms_scale` (with `block_sum`): a block of `ROW_THREADS` threads, each summing the squares
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

/// `swiglu` over rows of `gate_up` (`[rows, 2 inter]`, gate first), bf16.
fn swiglu(gate_up: &[u16], inter: usize) -> Vec<u16> {
    gate_up
        .chunks_exact(2 * inter)
        .flat_map(|row| {
            let (gate, up) = row.split_at(inter);
            gate.iter().zip(up).map(|(&g, &u)| silu_times(g, u))
        })
        .collect()
}

/// `rope` on one head: dimension `i` pairs with `i + head_dim / 2`, the angle in f32.
fn rope_head(head: &mut [u16], position: u32, inv_freq: &[f32]) {
    let half = head.len() / 2;
    for (i, &frequency) in inv_freq.iter().enumerate().take(half) {
        let (s, c) = (position as f32 * frequency).sin_cos();
        let (a, b) = (widen(head[i]), widen(head[i + half]));
        head[i] = kernel_bf16(a * c - b * s);
        head[i + half] = kernel_bf16(b * c + a * s);
    }
}

/// `silu_times`: `silu(gate) · up` in f32 from bf16, rounded to bf16.
fn silu_times(gate: u16, up: u16) -> u16 {
    let g = widen(gate);
    kernel_bf16(g / (1.0 + (-g).exp()) * widen(up))
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

/// `c[t, n] = a[t, :] · w[n, :]` over bf16 inputs, in f32: cuBLAS's order is its own, so this
/// one keeps eight running sums (products of two bf16 values are exact in f32, fused or not).
fn gemm(a: &[u16], w: &[u16], n: usize, k: usize) -> Vec<f32> {
    let mut c = vec![0.0f32; a.len() / k * n];
    c.par_chunks_mut(n)
        .zip(a.par_chunks(k))
        .for_each(|(c_row, a_row)| {
            let a_row: Vec<f32> = a_row.iter().map(|&b| widen(b)).collect();
            for (value, w_row) in c_row.iter_mut().zip(w.chunks_exact(k)) {
                let mut sums = [0.0f32; 8];
                let (a_chunks, w_chunks) = (a_row.chunks_exact(8), w_row.chunks_exact(8));
                let (a_tail, w_tail) = (a_chunks.remainder(), w_chunks.remainder());
                for (a8, w8) in a_chunks.zip(w_chunks) {
                    for lane in 0..8 {
                        sums[lane] += a8[lane] * widen(w8[lane]);
                    }
                }
                for (lane, (&a, &w)) in a_tail.iter().zip(w_tail).enumerate() {
                    sums[lane] += a * widen(w);
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
