//! The CPU backend: the Llama block in f32, multi-threaded with rayon, products with weights on
//! our own kernel (`sgemm`: AVX-512, AVX2 or portable, picked at run time, one summation order
//! for all), attention's products on kernels of its own (`attention`, `in_place`). Weights stay
//! in the checkpoint's precision; a bf16 or f16 matrix is widened to f32 block by block as the
//! product packs it. In bf16 mode the products take bf16 inputs (`bf16`: `vdpbf16ps` where the
//! CPU has it), rounded where the CUDA backend rounds. It is the reference the CUDA backend is
//! checked against. There the passes between products write only what the next one reads: the
//! norms and SwiGLU write bf16 bits, the MLP's norm adds the attention branch as it goes, and
//! the gate|up product stores its sums as bits where they are whole in registers.
//!
//! The forward pass is the model's, written once in `crate::model::block` as a sequence of
//! ops, and run here by `ops::CpuOps` on the weights in the CPU's form (`Cpu`: in bf16 mode each
//! matrix beside its bf16 form, packed at load for the CPU's bf16 dot instruction where it has
//! one, the checkpoint's mapped pages then handed back), as the CUDA backend runs it on a GPU.
//! Each branch output (`attn_out`, `mlp_out`) is written to its own buffer and then added, kept
//! or not: `x + Σ` rounds once more than a product chained on from `x` would, and doing it the
//! one way everywhere means keeping a site never changes the stream's bits. AFMoE's routed
//! experts run grouped by expert (`moe.rs`).
//! Every buffer lives in `Scratch` and only grows, so steady-state batches allocate nothing.

pub mod amx;
mod attention;
pub mod bf16;
mod in_place;
pub mod kernels;
pub mod level;
pub mod matmul;
mod moe;
mod ops;
pub mod peak;
mod schedule;
pub mod sgemm;
pub mod views;

use std::path::Path;

use harvest_core::plan::Precision;
use harvest_core::{LayerSelection, Sites};
use rayon::prelude::*;

use self::matmul::{MatRef, matmul_weight};
use super::{Backend, Batch, CaptureSpec, Captured};
use crate::error::{Error, ModelError, Result};
use crate::model::block::{Stack, forward};
use crate::model::weights::{Convert, Form, Host};
use crate::model::{BlockWeights, LlamaWeights, Matrix, ModelConfig};
use crate::projection::Directions;

/// Rows handed to one rayon task in the element-wise passes.
const ROWS_PER_TASK: usize = 16;

/// The f32 reference backend, with a bf16 compute mode.
#[derive(Debug)]
pub struct CpuBackend {
    config: ModelConfig,
    /// The token embedding (no rows on a later pipeline stage).
    embed: Matrix,
    /// The model's block `blocks[0]` is.
    first_block: usize,
    blocks: Vec<BlockWeights<Cpu>>,
    spec: CaptureSpec,
    inv_freq: Vec<f32>,
    rope: RopeTable,
    scratch: Scratch,
}

#[derive(Debug, Default)]
struct RopeTable {
    positions: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

#[derive(Debug, Default)]
struct Scratch {
    x: Vec<f32>,
    normed: Vec<f32>,
    qkv: Vec<f32>,
    /// `qkv` as bf16 bits, where attention's `Q·Kᵀ` is a `vdpbf16ps` product (bf16 mode).
    qkv_bf16: Vec<u16>,
    /// Attention's keys, laid out once per layer for every query that reads them.
    keys: attention::KeyScratch,
    attn: Vec<f32>,
    gate_up: Vec<f32>,
    /// The same rounded to bf16 bits, where the product stores them so (bf16 mode).
    gate_up_bits: Vec<u16>,
    act: Vec<f32>,
    /// A branch output (attention or MLP) kept before it is added to `x`.
    branch: Vec<f32>,
    /// AFMoE's attention gate, `[tokens, heads head_dim]`.
    gate: Vec<f32>,
    /// AFMoE's routed experts.
    moe: moe::MoeScratch,
    /// What one matrix product needs besides its operands.
    gemm: GemmScratch,
}

#[derive(Debug, Default)]
struct GemmScratch {
    /// A GEMM's input rounded to bf16, in bf16 mode.
    input_bf16: Vec<u16>,
    /// The same, widened back to f32, where the bf16 product runs on the f32 kernel.
    input_rounded: Vec<f32>,
    /// The bf16 product's packed operands.
    packed: bf16::Packed,
}

/// `out (+)= input · wᵀ`: in f32 with the weight widened as it is packed, or, given its bf16
/// form `w16`, with `input` rounded to bf16 and the bf16 product (f32 accumulation).
fn project(
    input: MatRef<'_>,
    w: &Matrix,
    w16: Option<&Bf16Matrix>,
    out: &mut [f32],
    out_stride: usize,
    accumulate: bool,
    scratch: &mut GemmScratch,
) {
    let Some(w16) = w16 else {
        matmul_weight(input, w, out, out_stride, accumulate);
        return;
    };
    let bits = match w16 {
        Bf16Matrix::Packed(_) => None,
        Bf16Matrix::Bits(bits) => Some(bits),
    };
    if let Some(bits) = bits.filter(|_| !bf16::has_dot_instructions()) {
        return project_widened(input, w, bits, out, out_stride, accumulate, scratch);
    }
    let values = &input.data[..input.rows * input.cols];
    scratch.input_bf16.resize(values.len(), 0);
    bf16::round_into(values, &mut scratch.input_bf16);
    project_rounded((w, w16), out, out_stride, accumulate, scratch);
}

/// The bf16 product on an input already rounded into `scratch.input_bf16` (by
/// [`project`], or by the pass that made it: [`Pass::rounds_ahead`]), with a weight in both its
/// forms.
fn project_rounded(
    (w, w16): (&Matrix, &Bf16Matrix),
    out: &mut [f32],
    out_stride: usize,
    accumulate: bool,
    scratch: &mut GemmScratch,
) {
    let mut column = 0;
    for part in w16.parts(w) {
        bf16::weight_product(
            &scratch.input_bf16,
            part,
            &mut out[column..],
            out_stride,
            accumulate,
            &mut scratch.packed,
        );
        column += part.cols();
    }
}

/// [`project_rounded`] with each output rounded to bf16 bits as it is stored
/// ([`bf16::matmul_bf16_rounded`]: `k` in one block, on `vdpbf16ps`).
fn project_to_bits(
    (w, w16): (&Matrix, &Bf16Matrix),
    (out, out_stride): (&mut [u16], usize),
    scratch: &mut GemmScratch,
) {
    let mut column = 0;
    for part in w16.parts(w) {
        let out = (&mut out[column..], out_stride);
        bf16::weight_product_rounded(&scratch.input_bf16, part, out, &mut scratch.packed);
        column += part.cols();
    }
}

/// The bf16 product where the CPU has no bf16 dot instruction: the input rounded to bf16 into
/// the scratch (nothing allocated), then the f32 kernel, which widens the bf16 weight exactly as
/// it packs it. Only the order of the f32 sums differs from `vdpbf16ps`; it is as fixed.
fn project_widened(
    input: MatRef<'_>,
    w: &Matrix,
    bits: &Bf16Bits,
    out: &mut [f32],
    out_stride: usize,
    accumulate: bool,
    scratch: &mut GemmScratch,
) {
    let values = &input.data[..input.rows * input.cols];
    let rounded = &mut scratch.input_rounded;
    rounded.resize(values.len(), 0.0);
    rounded
        .par_chunks_mut(ROWS_PER_TASK * input.cols.max(1))
        .zip(values.par_chunks(ROWS_PER_TASK * input.cols.max(1)))
        .for_each(|(dst, src)| {
            dst.copy_from_slice(src);
            bf16::round_rows(dst);
        });
    let input = MatRef::dense(rounded, input.rows, input.cols);
    match bits {
        // The checkpoint's own bf16: the f32 mode's product on the same mapped rows.
        Bf16Bits::Mapped => matmul_weight(input, w, out, out_stride, accumulate),
        Bf16Bits::Owned(bits) => {
            let weight = bf16::Bf16View::dense(bits, w.rows(), w.cols());
            sgemm::product(input, &weight, out, out_stride, accumulate);
        }
    }
}

/// The CPU's form of the weights: the checkpoint's matrices as loaded, each beside its bf16
/// form in bf16 mode; norms, biases and the router as loaded.
#[derive(Debug, Clone)]
pub(super) struct Cpu;

impl Form for Cpu {
    type Matrix = CpuMatrix;
    type Norm = Vec<f32>;
    type Bias = Vec<f32>;
    type Router = Matrix;
}

/// A weight matrix, and in bf16 mode its bf16 form.
#[derive(Debug, Clone)]
pub(super) struct CpuMatrix {
    weight: Matrix,
    bf16: Option<Bf16Matrix>,
}

/// Makes the CPU's form: the bf16 form of every matrix in bf16 mode.
struct ToCpu {
    bf16: bool,
}

impl Convert<Host, Cpu> for ToCpu {
    fn matrix(&mut self, weight: Matrix) -> Result<CpuMatrix> {
        let bf16 = self.bf16.then(|| Bf16Matrix::of(&weight));
        Ok(CpuMatrix { weight, bf16 })
    }
    fn norm(&mut self, norm: Vec<f32>) -> Result<Vec<f32>> {
        Ok(norm)
    }
    fn bias(&mut self, bias: Vec<f32>) -> Result<Vec<f32>> {
        Ok(bias)
    }
    fn router(&mut self, router: Matrix) -> Result<Matrix> {
        Ok(router)
    }
}

/// A weight's bf16 form.
#[derive(Debug, Clone)]
enum Bf16Matrix {
    /// Where the CPU has a bf16 dot instruction: packed once, at load, into the panels its
    /// products read, one per row block of the checkpoint (Q|K|V's parts stay apart). The
    /// checkpoint's pages are then handed back, so the weight is held once.
    Packed(Vec<bf16::PackedWeight>),
    /// Elsewhere: the bits the f32 kernel widens as it packs them, product by product.
    Bits(Bf16Bits),
}

/// A weight as bf16 bits: the checkpoint's own mapped bf16 row blocks (nothing copied), or a
/// copy rounded once from f32 or f16.
#[derive(Debug, Clone)]
enum Bf16Bits {
    Mapped,
    Owned(Vec<u16>),
}

impl Bf16Matrix {
    /// The bf16 form of `m`: packed where the CPU's kernels read packed weights (its mapped
    /// pages then released), else its bits.
    fn of(m: &Matrix) -> Self {
        let bits = Bf16Bits::of(m);
        let packed: Option<Vec<_>> = bits
            .parts(m)
            .into_iter()
            .map(|part| bf16::PackedWeight::of(part, m.cols()))
            .collect();
        match packed {
            Some(packed) => {
                m.release_pages();
                Self::Packed(packed)
            }
            None => Self::Bits(bits),
        }
    }

    /// Its row blocks, in order, as the bf16 product's right operand.
    fn parts<'a>(&'a self, m: &'a Matrix) -> Vec<bf16::Weight<'a>> {
        match self {
            Self::Packed(parts) => parts.iter().map(bf16::Weight::Packed).collect(),
            Self::Bits(bits) => bits
                .parts(m)
                .into_iter()
                .map(|part| {
                    let rows = part.len() / m.cols().max(1);
                    bf16::Weight::Rows(bf16::Bf16View::dense(part, rows, m.cols()))
                })
                .collect(),
        }
    }
}

impl Bf16Bits {
    /// The bf16 bits of `m`.
    fn of(m: &Matrix) -> Self {
        let mapped_bf16 = m.half() == Some(crate::model::matrix::Half::Bf16)
            && m.half_bytes().iter().all(|b| aligned(b).is_some());
        if mapped_bf16 {
            return Self::Mapped;
        }
        let values = m.to_f32_vec();
        let mut bits = vec![0u16; values.len()];
        bf16::round_into(&values, &mut bits);
        Self::Owned(bits)
    }

    /// Its row blocks, in order.
    fn parts<'a>(&'a self, m: &'a Matrix) -> Vec<&'a [u16]> {
        match self {
            Self::Owned(bits) => vec![bits.as_slice()],
            Self::Mapped => m.half_bytes().into_iter().filter_map(aligned).collect(),
        }
    }
}

use self::bf16::aligned;

impl CpuBackend {
    /// Builds a backend over loaded weights. The weights must reach the deepest kept block.
    pub fn new(weights: LlamaWeights, spec: CaptureSpec) -> Result<Self> {
        spec.check(&weights)?;
        Self::build(weights, spec)
    }

    /// Builds one pipeline stage over weights that hold a range of the model's blocks
    /// (`weights.first_block` on); it runs those up to the deepest kept block.
    pub fn stage(weights: LlamaWeights, spec: CaptureSpec) -> Result<Self> {
        spec.check_directions(&weights)?;
        Self::build(weights, spec)
    }

    fn build(weights: LlamaWeights, spec: CaptureSpec) -> Result<Self> {
        level::Level::configured()?;
        if spec.precision == Precision::Bf16 && weights.config.afmoe.is_some() {
            // Measured on the AFMoE fixture: bf16 rounding moves router inputs enough to send
            // 6-20% of tokens (per site) to other experts, so those activations are not the
            // model's (docs/engine.md).
            return Err(Error::Model(ModelError::UnsupportedPrecision {
                precision: Precision::Bf16.as_str(),
                what: "AFMoE (AfmoeForCausalLM), whose routing bf16 rounding changes",
            }));
        }
        let mut to_cpu = ToCpu {
            bf16: spec.precision == Precision::Bf16,
        };
        let blocks = weights
            .blocks
            .into_iter()
            .map(|b| b.convert(&mut to_cpu))
            .collect::<Result<_>>()?;
        let config = weights.config;
        let inv_freq = config
            .inverse_frequencies()
            .iter()
            .map(|&f| f as f32)
            .collect();
        Ok(Self {
            config,
            embed: weights.embed,
            first_block: weights.first_block,
            blocks,
            spec,
            inv_freq,
            rope: RopeTable::default(),
            scratch: Scratch::default(),
        })
    }

    /// Loads a checkpoint directory, reading only the blocks that `layers` needs.
    pub fn load(
        dir: &Path,
        layers: &LayerSelection,
        sites: Sites,
        directions: Option<Directions>,
    ) -> Result<Self> {
        let config = ModelConfig::from_file(&dir.join("config.json"))?;
        let layers = layers.resolve(config.num_layers)?;
        let weights = LlamaWeights::load(dir, Some(layers.deepest() + 1))?;
        let spec = CaptureSpec {
            layers,
            sites,
            precision: Precision::F32,
            directions,
        };
        Self::check_memory(&weights, &spec, harvest_core::plan::DEFAULT_BATCH_TOKENS, 0)?;
        Self::new(weights, spec)
    }

    /// What a pass over batches of up to `tokens` tokens holds besides the weights: the
    /// scratch rows of every intermediate, the captured layers, and each thread's packing
    /// panels.
    pub fn working_bytes(weights: &LlamaWeights, spec: &CaptureSpec, tokens: usize) -> u64 {
        let c = &weights.config;
        let inter = weights
            .blocks
            .iter()
            .map(BlockWeights::mlp_width)
            .max()
            .unwrap_or(0);
        // AFMoE: the gate, and per token its router logits, its k grouped input and output
        // rows, and one expert's gate|up and activation.
        let afmoe = c.afmoe.as_ref().map_or(0, |m| {
            c.num_heads * c.head_dim
                + m.num_experts
                + 2 * m.experts_per_token * c.hidden_size
                + 3 * m.expert_intermediate_size
                + 4 * m.experts_per_token
        });
        // Attention's keys laid out per layer: transposed in f32 (in bf16 mode, see below).
        let per_token = 2 * c.hidden_size
            + c.qkv_width()
            + c.num_kv_heads * c.head_dim
            + c.num_heads * c.head_dim
            + 3 * inter
            + c.hidden_size
            + afmoe
            + spec.slots() * spec.width(c.hidden_size);
        let matrices = || weights.blocks.iter().flat_map(BlockWeights::matrices);
        let widest_product = matrices().map(|m| m.rows()).max().unwrap_or(0);
        let panels = sgemm::working_bytes(widest_product, rayon::current_num_threads());
        let bf16_mode = spec.precision == Precision::Bf16;
        if bf16_mode {
            // Each product's input rounded to bf16, and the bf16 copies of weights. Where the
            // CPU has a bf16 dot instruction every weight is packed at load and a mapped
            // checkpoint's pages are then released, so only a decoded f32 weight is held twice;
            // elsewhere every weight not stored in bf16 gets a rounded copy.
            let widest = c.hidden_size.max(2 * inter).max(c.num_heads * c.head_dim);
            let packed_at_load = bf16::has_dot_instructions();
            let copies: usize = matrices()
                .filter(|m| match packed_at_load {
                    true => m.as_f32().is_some(),
                    false => m.half() != Some(crate::model::Half::Bf16),
                })
                .map(|m| m.len())
                .sum();
            // Q|K|V as bits, the keys' panels (a sequence's last panel is padded to `PANEL`
            // keys, so one-token prompts take `PANEL` times their keys) and the values'
            // (columns padded to whole panels, and an odd sequence's last pair: at most twice).
            let value_panels = 2 * c.num_kv_heads * c.head_dim.next_multiple_of(bf16::PANEL);
            let attention =
                tokens * (c.qkv_width() + bf16::PANEL * c.num_kv_heads * c.head_dim + value_panels);
            // gate|up as bits, where the product can round as it stores.
            let gate_up_bits = if bf16::rounds_output(c.hidden_size) {
                tokens * 2 * inter
            } else {
                0
            };
            let bf16_values = tokens * widest + copies + attention + gate_up_bits;
            return (tokens * per_token * 4 + bf16_values * 2) as u64 + panels;
        }
        (tokens * per_token * 4) as u64 + panels
    }

    /// Refuses, before anything is read, weights and batches of `tokens` that would not fit
    /// this machine's available memory, beside `outside` bytes the caller holds (a pipeline's
    /// capture and shard buffers).
    pub fn check_memory(
        weights: &LlamaWeights,
        spec: &CaptureSpec,
        tokens: usize,
        outside: u64,
    ) -> Result<()> {
        let needed = crate::memory::Needed {
            weights: weights.resident_bytes(),
            working: Self::working_bytes(weights, spec, tokens) + outside,
        };
        crate::memory::check(needed, crate::memory::available_bytes())
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Extends the cos/sin tables to cover `positions`, computing angles in f32 as Hugging Face
    /// does (`position * inv_freq`), then cos and sin of that f32 angle.
    fn ensure_rope(&mut self, positions: usize) {
        if positions <= self.rope.positions {
            return;
        }
        let half = self.inv_freq.len();
        self.rope
            .cos
            .reserve((positions - self.rope.positions) * half);
        for pos in self.rope.positions..positions {
            for &freq in &self.inv_freq {
                let angle = f64::from(pos as f32 * freq);
                self.rope.cos.push(angle.cos() as f32);
                self.rope.sin.push(angle.sin() as f32);
            }
        }
        self.rope.positions = positions;
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn capture_width(&self) -> usize {
        self.spec.width(self.config.hidden_size)
    }

    fn spec(&self) -> &CaptureSpec {
        &self.spec
    }

    fn capture(&mut self, batch: &Batch, out: &mut Captured) -> Result<()> {
        let width = self.capture_width();
        let (sites, layers) = (self.spec.sites.len(), self.spec.layers.len());
        out.reset(sites, layers, batch.num_tokens(), width);
        let routes = self.spec.route_shape(&self.config);
        out.routes.reset(routes, batch.num_tokens());
        self.run_blocks(batch, out)
    }
}

impl super::Stage for CpuBackend {
    fn forward(&mut self, batch: &Batch, x: &mut Vec<f32>, out: &mut Captured) -> Result<()> {
        // The residual stream travels between stages; this stage borrows it as its own.
        std::mem::swap(&mut self.scratch.x, x);
        let result = self.run_blocks(batch, out);
        std::mem::swap(&mut self.scratch.x, x);
        result
    }
}

impl CpuBackend {
    /// Runs the loaded blocks up to the deepest kept one on `scratch.x`, embedding `batch`
    /// into it first when they start at block 0.
    fn run_blocks(&mut self, batch: &Batch, out: &mut Captured) -> Result<()> {
        batch.validate(self.config.vocab_size)?;
        self.ensure_rope(batch.max_length as usize);
        let config = &self.config;
        let tokens = batch.num_tokens();
        let s = &mut self.scratch;
        s.resize(config, tokens, max_mlp_width(&self.blocks));
        let pass = Pass {
            config,
            batch,
            rope: &self.rope,
            tokens,
            bf16: self.spec.precision == Precision::Bf16,
        };
        let directions = self.spec.directions.as_ref();
        let mut ops = ops::CpuOps::new(&pass, s, &self.embed, (out, directions));
        let stack = Stack {
            config,
            first_block: self.first_block,
            blocks: &self.blocks,
        };
        forward(&mut ops, stack, self.spec.keeps())
    }
}

/// The widest dense MLP (or fused shared experts) among the blocks.
fn max_mlp_width(blocks: &[BlockWeights<Cpu>]) -> usize {
    blocks
        .iter()
        .map(|b| b.down.weight.cols())
        .max()
        .unwrap_or(0)
}

impl Scratch {
    /// Sizes every buffer for `tokens` rows and MLPs up to `inter` wide (they only grow in
    /// capacity).
    fn resize(&mut self, config: &ModelConfig, tokens: usize, inter: usize) {
        let hidden = config.hidden_size;
        self.x.resize(tokens * hidden, 0.0);
        self.normed.resize(tokens * hidden, 0.0);
        self.qkv.resize(tokens * config.qkv_width(), 0.0);
        self.attn
            .resize(tokens * config.num_heads * config.head_dim, 0.0);
        self.gate_up.resize(tokens * 2 * inter, 0.0);
        self.act.resize(tokens * inter, 0.0);
        self.branch.resize(tokens * hidden, 0.0);
        if config.afmoe.is_some() {
            self.gate
                .resize(tokens * config.num_heads * config.head_dim, 0.0);
        }
    }
}

/// One forward pass over a batch: what every block shares.
struct Pass<'a> {
    config: &'a ModelConfig,
    batch: &'a Batch,
    rope: &'a RopeTable,
    tokens: usize,
    /// The bf16 mode: products on bf16 inputs.
    bf16: bool,
}

impl Pass<'_> {
    /// Whether products in this mode take their input as bf16 bits (`vdpbf16ps`), which the
    /// pass that makes the input can round for them while each chunk is in cache.
    fn rounds_ahead(&self) -> bool {
        self.bf16 && bf16::has_dot_instructions()
    }
}

/// RMSNorm of every query head with `q_norm` and every key head with `k_norm`, in place, on
/// fused Q|K|V rows; `heads` is (query heads, key/value heads, head width).
fn head_norms(
    rows: &mut [f32],
    heads: (usize, usize, usize),
    (q_norm, k_norm): (&[f32], &[f32]),
    eps: f32,
) {
    let (q_heads, kv_heads, head_dim) = heads;
    let width = (q_heads + 2 * kv_heads) * head_dim;
    for row in rows.chunks_exact_mut(width) {
        let (q, rest) = row.split_at_mut(q_heads * head_dim);
        kernels::rms_norm_in_place(q, q_norm, eps);
        kernels::rms_norm_in_place(&mut rest[..kv_heads * head_dim], k_norm, eps);
    }
}

/// `x += branch`, row chunks in parallel.
fn add_rows(x: &mut [f32], branch: &[f32], hidden: usize) {
    x.par_chunks_mut(hidden * ROWS_PER_TASK)
        .zip(branch.par_chunks(hidden * ROWS_PER_TASK))
        .for_each(|(x, b)| kernels::add_bias_rows(x, b));
}

/// A row kernel from `[rows, in_width]` to `[rows, out_width]` bf16 bits in `bits`, in
/// parallel chunks of rows: in bf16 mode the pass before a product writes the product's input
/// and nothing else.
fn rows_pass_bits(
    input: &[f32],
    in_width: usize,
    bits: &mut Vec<u16>,
    out_width: usize,
    kernel: impl Fn(&[f32], &mut [u16]) + Sync,
) {
    let rows = input.len() / in_width.max(1);
    bits.resize(rows * out_width, 0);
    bits.par_chunks_mut(out_width * ROWS_PER_TASK)
        .zip(input.par_chunks(in_width * ROWS_PER_TASK))
        .for_each(|(bits, input)| kernel(input, bits));
}

/// Applies a row kernel to `[rows, in_width]` → `[rows, out_width]` in parallel chunks of rows.
fn rows_pass(
    input: &[f32],
    in_width: usize,
    output: &mut [f32],
    out_width: usize,
    kernel: impl Fn(&[f32], &mut [f32]) + Sync,
) {
    output
        .par_chunks_mut(out_width * ROWS_PER_TASK)
        .zip(input.par_chunks(in_width * ROWS_PER_TASK))
        .for_each(|(out, inp)| kernel(inp, out));
}
