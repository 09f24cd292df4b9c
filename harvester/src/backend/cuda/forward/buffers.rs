//! A batch's buffers on one device: the activations between kernels (`Scratch`, in the
//! mode's type), the kept layers' slots, and what they take (`BatchBuffers`), which the memory
//! plan checks before a batch is allocated.

use cudarc::driver::CudaSlice;

use super::afmoe;
use crate::backend::CaptureSpec;
use crate::backend::cuda::download::Slots;
use crate::model::ModelConfig;
use harvest_core::{Site, Sites};

/// Activation buffers for up to `tokens` tokens, those between kernels in `E`; they only grow.
pub(super) struct Scratch<E> {
    pub(super) tokens: usize,
    pub(super) ids: CudaSlice<u32>,
    pub(super) positions: CudaSlice<u32>,
    pub(super) cu_seq_lengths: CudaSlice<u32>,
    pub(super) tiles: CudaSlice<u32>,
    pub(super) x: CudaSlice<f32>,
    pub(super) normed: CudaSlice<E>,
    pub(super) qkv: CudaSlice<E>,
    /// The QKV product in f32 before its bias joins it and it is rounded; one value when the
    /// model has none or the mode is f32 (the product gains its bias in place).
    pub(super) qkv_wide: CudaSlice<f32>,
    pub(super) attn: CudaSlice<E>,
    pub(super) gate_up: CudaSlice<E>,
    pub(super) act: CudaSlice<E>,
    /// A branch output kept as a hook site (`attn_out`, `mlp_out`), or given its bias, before
    /// it joins `x`; one value when the job keeps neither and the model has no output bias.
    pub(super) branch: CudaSlice<f32>,
    pub(super) kept: Kept,
    /// AFMoE's own buffers, for an AFMoE model.
    pub(super) afmoe: Option<afmoe::AfmoeScratch<E>>,
}

/// The kept layers' slots: residual rows in bf16, or projections in f32.
pub(super) enum Kept {
    Rows(Slots<u16>),
    Projections(Slots<f32>),
}

/// What sizes a batch's buffers on one device besides the model's shape.
pub(super) struct BatchBuffers {
    /// Kept layers the device holds.
    pub(super) kept_layers: usize,
    /// Whether a branch output is written apart (kept, or given an O bias).
    pub(super) branch: bool,
    /// Whether the QKV product is written in f32 for its bias.
    pub(super) qkv_wide: bool,
    /// The widest MLP among the blocks ([`mlp_width`]).
    pub(super) mlp_width: usize,
    /// Bytes of one activation between kernels: 2 in the bf16 mode, 4 in the f32 mode.
    pub(super) value_bytes: usize,
}

/// The widest MLP (dense, or a sparse block's shared experts) among `blocks`.
pub(super) fn mlp_width(blocks: &[crate::model::BlockWeights]) -> usize {
    blocks.iter().map(|b| b.down.cols()).max().unwrap_or(0)
}

impl BatchBuffers {
    pub(super) fn bytes(&self, c: &ModelConfig, spec: &CaptureSpec, tokens: usize) -> u64 {
        let shape = crate::backend::cuda::plan::Shape {
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
pub(super) fn keeps_branches(sites: &Sites) -> bool {
    sites.contains(Site::AttnOut) || sites.contains(Site::MlpOut)
}
