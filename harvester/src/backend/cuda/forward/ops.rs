//! The block ops on the device ([`BlockOps`] for [`DeviceOps`]): each a kernel launch or a
//! cuBLAS GEMM over one batch's buffers, in the mode's type `E`, and the capture of a kept
//! site into its slot.

use crate::backend::cuda::blas::{Blas, DataType};
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use std::sync::Arc;

use super::buffers::{Kept, Scratch};
use super::kernel_set::Kernels;
use super::{Activation, DeviceBlock, F32};
use crate::backend::cuda::error::CudaError;
use crate::backend::cuda::launch::{self, AttentionShape, gemm};
use crate::error::Result;
use crate::model::ModelConfig;
use crate::model::dense::{BlockOps, Source, Sublayer};
use harvest_core::{Site, Sites};

/// One forward pass over a batch: what every block's launches share.
pub(super) struct Pass<'a> {
    pub(super) config: &'a ModelConfig,
    pub(super) stream: &'a Arc<CudaStream>,
    pub(super) blas: &'a Blas,
    pub(super) kernels: &'a Kernels,
    pub(super) inv_freq: &'a CudaSlice<f32>,
    pub(super) tokens: usize,
    pub(super) tiles: usize,
}

/// Where one kept block's hook sites go.
pub(super) struct Keeping<'a> {
    /// The block's place among the kept layers this device holds.
    pub(super) layer: usize,
    /// Kept layers this device holds.
    pub(super) layers: usize,
    /// Kept sites.
    pub(super) sites: &'a Sites,
    /// Values per captured token.
    pub(super) width: usize,
    /// Projection directions, when the job projects.
    pub(super) directions: Option<&'a CudaSlice<f32>>,
    /// The stream that copies kept slots to the host.
    pub(super) copies: &'a Arc<CudaStream>,
}

impl Keeping<'_> {
    /// The capture slot of `site` in this block, if it is kept.
    pub(super) fn slot(&self, site: Site) -> Option<usize> {
        self.sites
            .position(site)
            .map(|position| position * self.layers + self.layer)
    }
}

/// The block ops on the device: one pass's launches over its scratch buffers.
pub(super) struct DeviceOps<'p, 's, E> {
    pub(super) pass: &'p Pass<'p>,
    pub(super) s: &'s mut Scratch<E>,
    /// The block's MLP width (`DeviceBlock::inter`), for SwiGLU.
    pub(super) inter: usize,
    /// Where this block's kept sites go, if it is a kept layer.
    pub(super) keeping: Option<&'p Keeping<'p>>,
    /// The batch's expert choices, which a sparse block with a route slot fills.
    pub(super) routes: &'s mut crate::backend::Routes,
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
    pub(super) fn norm<E: DeviceRepr>(
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
    pub(super) fn gemm<E: Activation, C>(
        &self,
        a: &CudaSlice<E>,
        w: &CudaSlice<E>,
        c: &mut CudaSlice<C>,
        c_type: DataType,
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
    pub(super) fn keep(
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
