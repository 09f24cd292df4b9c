//! The block ops on the device ([`BlockOps`] for [`DeviceOps`]): each a kernel launch or a
//! cuBLAS GEMM over one batch's buffers, in the mode's type `E`, and the capture of a kept
//! site into its slot.

use crate::backend::cuda::blas::{Blas, DataType};
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use std::sync::Arc;

use super::buffers::{Kept, Scratch};
use super::kernel_set::Kernels;
use super::{Activation, F32, OnDevice};
use crate::backend::cuda::error::CudaError;
use crate::backend::cuda::launch::{self, AttentionShape, gemm};
use crate::error::Result;
use crate::model::ModelConfig;
use crate::model::block::{BlockOps, Source, Sublayer};
use crate::model::{HeadNorms, MoeWeights};

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

/// Where kept sites go on this device.
pub(super) struct Keeping<'a> {
    /// The kept layers (positions among the job's) this device's blocks hold.
    pub(super) kept: std::ops::Range<usize>,
    /// The job's kept layers.
    pub(super) layers: usize,
    /// Values per captured token.
    pub(super) width: usize,
    /// Projection directions, when the job projects.
    pub(super) directions: Option<&'a CudaSlice<f32>>,
    /// The stream that copies kept slots to the host.
    pub(super) copies: &'a Arc<CudaStream>,
    /// Whether the batch tail is hidden (`tail`): the deepest layer's copies deferred, each
    /// slot written after the batch before's copy of it.
    pub(super) overlap: bool,
}

impl Keeping<'_> {
    /// This device's slot for the job's capture slot `slot`.
    pub(super) fn local_slot(&self, slot: usize) -> usize {
        local_slot(slot, self.layers, &self.kept)
    }

    /// Whether this device's slot `slot` is written and copied as the overlapped tail asks:
    /// after the last batch's copy of it, and its own copy deferred.
    fn tail(&self, slot: usize) -> (bool, bool) {
        let deferred = self.overlap && super::tail::deferred(slot, self.kept.len());
        (self.overlap, deferred)
    }
}

/// A device's slot for the job's capture slot `slot` (`site * layers + layer`, over the job's
/// `layers` kept layers), on a device holding the kept layers `kept`: `site * kept.len() +
/// (layer - kept.start)`, the order its slots are copied back in.
fn local_slot(slot: usize, layers: usize, kept: &std::ops::Range<usize>) -> usize {
    let (site, layer) = (slot / layers, slot % layers);
    site * kept.len() + layer - kept.start
}

/// The pass's ops on the device: its launches over the batch's scratch buffers.
pub(super) struct DeviceOps<'p, 's, E> {
    pub(super) pass: &'p Pass<'p>,
    pub(super) s: &'s mut Scratch<E>,
    /// The embedding, on the first stage.
    pub(super) embed: Option<&'p CudaSlice<E>>,
    /// The inner width of the last `gate_up`, for SwiGLU and the down projection.
    pub(super) inter: usize,
    /// Where kept sites go.
    pub(super) keeping: &'p Keeping<'p>,
    /// The batch's expert choices, which a sparse block with a route slot fills.
    pub(super) routes: &'s mut crate::backend::Routes,
}

impl<E> DeviceOps<'_, '_, E> {
    /// The `(n, k)` of `sublayer`'s output projection.
    fn output_shape(&self, sublayer: Sublayer) -> (usize, usize) {
        let c = self.pass.config;
        match sublayer {
            Sublayer::Attention => (c.hidden_size, c.num_heads * c.head_dim),
            Sublayer::Mlp => (c.hidden_size, self.inter),
        }
    }
}

impl<'p, E: Activation> BlockOps<'p, OnDevice<E>> for DeviceOps<'p, '_, E> {
    fn embed(&mut self, scale: f32) -> Result<()> {
        let p = self.pass;
        let Some(embed) = self.embed else {
            return Err(CudaError::Fault {
                action: "embedding the batch",
                reason: "this stage holds no embedding".into(),
            }
            .into());
        };
        let s = &mut *self.s;
        let shape = (p.tokens, p.config.hidden_size, scale);
        launch::embed_gather(
            p.stream,
            &p.kernels.embed_gather,
            embed,
            &s.ids,
            &mut s.x,
            shape,
        )
    }

    fn norm(&mut self, weight: &'p CudaSlice<E>, _: Sublayer) -> Result<()> {
        self.pass.norm(weight, &self.s.x, &mut self.s.normed)
    }

    fn qkv(&mut self, weight: &'p CudaSlice<E>, bias: Option<&'p CudaSlice<f32>>) -> Result<()> {
        let (c, p) = (self.pass.config, self.pass);
        let shape = (c.qkv_width(), c.hidden_size);
        let s = &mut *self.s;
        match bias {
            None => p.gemm(&s.normed, weight, &mut s.qkv, E::DATA_TYPE, shape, 0.0),
            Some(bias) => {
                let buffers = (&mut s.qkv, &mut s.qkv_wide);
                E::biased_product(p, (&s.normed, weight, bias), buffers, shape)
            }
        }
    }

    fn head_norms(&mut self, norms: &'p HeadNorms<OnDevice<E>>) -> Result<()> {
        self.head_norms_of(norms)
    }

    fn attention_gate(&mut self, weight: &'p CudaSlice<E>) -> Result<()> {
        self.attention_gate_of(weight)
    }

    fn branch_norm(&mut self, weight: &'p CudaSlice<E>) -> Result<()> {
        self.branch_norm_of(weight)
    }

    fn clear_branch(&mut self) -> Result<()> {
        let n = self.pass.tokens * self.pass.config.hidden_size;
        self.pass
            .stream
            .memset_zeros(&mut self.s.branch.slice_mut(..n))
            .map_err(|e| CudaError::fault("clearing the branch")(e).into())
    }

    fn routed_experts(
        &mut self,
        moe: &'p MoeWeights<OnDevice<E>>,
        norm: &'p CudaSlice<E>,
        route: Option<usize>,
    ) -> Result<()> {
        self.routed_experts_of(moe, norm, route)
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

    fn gate_up(&mut self, weight: &'p CudaSlice<E>, width: usize) -> Result<()> {
        let c = self.pass.config;
        self.inter = width;
        let shape = (2 * width, c.hidden_size);
        let s = &mut *self.s;
        let c_type = E::DATA_TYPE;
        self.pass
            .gemm(&s.normed, weight, &mut s.gate_up, c_type, shape, 0.0)
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

    fn output_into_residual(&mut self, weight: &'p CudaSlice<E>, sublayer: Sublayer) -> Result<()> {
        let shape = self.output_shape(sublayer);
        let s = &mut *self.s;
        let input = match sublayer {
            Sublayer::Attention => &s.attn,
            Sublayer::Mlp => &s.act,
        };
        self.pass.gemm(input, weight, &mut s.x, F32, shape, 1.0)
    }

    fn output_apart(
        &mut self,
        weight: &'p CudaSlice<E>,
        bias: Option<&'p CudaSlice<f32>>,
        sublayer: Sublayer,
    ) -> Result<()> {
        let (c, p) = (self.pass.config, self.pass);
        let shape = self.output_shape(sublayer);
        let s = &mut *self.s;
        let input = match sublayer {
            Sublayer::Attention => &s.attn,
            Sublayer::Mlp => &s.act,
        };
        p.gemm(input, weight, &mut s.branch, F32, shape, 0.0)?;
        match bias {
            Some(bias) => {
                let n = (p.tokens * c.hidden_size, c.hidden_size);
                launch::add_bias(p.stream, &p.kernels.add_bias, &mut s.branch, bias, n)
            }
            None => Ok(()),
        }
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
        let keeping = self.keeping;
        let s = &mut *self.s;
        let source = match source {
            Source::Residual => &s.x,
            Source::Branch => &s.branch,
        };
        self.pass
            .keep(source, &mut s.kept, keeping, keeping.local_slot(slot))
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
        let (wait, deferred) = keeping.tail(slot);
        match (kept, keeping.directions) {
            (Kept::Rows(slots), None) => {
                if wait {
                    slots.wait_copied(self.stream, slot)?;
                }
                let start = slot * slots.capacity;
                let mut view = slots.device.slice_mut(start..start + size);
                launch::round_bf16(
                    self.stream,
                    &self.kernels.round_bf16,
                    source,
                    &mut view,
                    size,
                )?;
                slots.send(self.stream, keeping.copies, (slot, size), deferred)
            }
            (Kept::Projections(slots), Some(units)) => {
                if wait {
                    slots.wait_copied(self.stream, slot)?;
                }
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
                slots.send(self.stream, keeping.copies, (slot, size), deferred)
            }
            _ => Err(CudaError::Fault {
                action: "keeping a layer",
                reason: "the capture slots do not match the job's contents".into(),
            }
            .into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stage_numbers_its_slots_site_by_its_own_layers_from_the_jobs_numbering() {
        // The job keeps 5 layers and 2 sites; this stage holds kept layers 2..4.
        let job_slot = |site: usize, layer: usize| site * 5 + layer;
        let ours: Vec<usize> = [(0, 2), (0, 3), (1, 2), (1, 3)]
            .iter()
            .map(|&(site, layer)| local_slot(job_slot(site, layer), 5, &(2..4)))
            .collect();
        assert_eq!(ours, [0, 1, 2, 3]);
        // One stage holding every layer keeps the job's numbering.
        assert_eq!(local_slot(job_slot(1, 4), 5, &(0..5)), job_slot(1, 4));
    }
}
