//! AFMoE's ops on the device ([`AfmoeOps`] for [`DeviceOps`]): the per-head norms, the
//! attention gate and the branch norms are kernels; the routed experts are the f32 router's
//! GEMM, the routing on the host ([`crate::model::routing`], so it is the CPU's rule to the
//! bit, from the device's logits), then one cuBLAS GEMM pair per expert over its grouped rows.
//! The host routing waits for the logits once per sparse block.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use super::{Activation, DeviceOps, F32, OnDevice, memory_error};
use crate::backend::cuda::error::CudaError;
use crate::backend::cuda::launch::{self, gemm_f32};
use crate::error::Result;
use crate::model::routing::{Choice, Grouping, choose};
use crate::model::{AfmoeConfig, HeadNorms, ModelConfig, MoeWeights};

/// The batch buffers AFMoE adds, for up to `tokens` tokens, those between kernels in `E`.
pub(super) struct AfmoeScratch<E> {
    /// The attention gate's product, `[tokens, heads head_dim]`.
    gate: CudaSlice<E>,
    /// An f32 norm: the router's input, then a branch norm's output (swapped with the branch).
    wide: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    /// The grouped expert inputs, `[tokens k, hidden]`.
    rows: CudaSlice<E>,
    /// One expert's gate|up and activation, for up to `tokens` rows.
    expert_gate_up: CudaSlice<E>,
    expert_act: CudaSlice<E>,
    /// The grouped expert outputs, `[tokens k, hidden]`.
    expert_out: CudaSlice<f32>,
    /// The token of each grouped row, each choice's row and its weight.
    row_tokens: CudaSlice<u32>,
    slots: CudaSlice<u32>,
    weights: CudaSlice<f32>,
    host: HostRouting,
}

/// The routing's host buffers; they only grow.
#[derive(Default)]
struct HostRouting {
    logits: Vec<f32>,
    choices: Vec<Choice>,
    grouping: Grouping,
    weights: Vec<f32>,
}

/// The routed experts' sizes: (experts, k, one expert's width), or zeros for a dense model.
fn routed(config: &ModelConfig) -> (usize, usize, usize) {
    config.afmoe.as_ref().map_or((0, 0, 0), |a: &AfmoeConfig| {
        (
            a.num_experts,
            a.experts_per_token,
            a.expert_intermediate_size,
        )
    })
}

/// Device bytes of AFMoE's buffers for `tokens` tokens of an AFMoE `config`, its activations
/// `value_bytes` each (2 in the bf16 mode, 4 in the f32 mode).
pub(super) fn scratch_bytes(config: &ModelConfig, tokens: usize, value_bytes: usize) -> u64 {
    let (experts, k, inter) = routed(config);
    let (hidden, attn) = (config.hidden_size, config.num_heads * config.head_dim);
    let per_token = value_bytes * (attn + k * hidden + 3 * inter)
        + 4 * hidden
        + 4 * experts
        + 4 * k * hidden
        + 12 * k;
    (per_token * tokens) as u64
}

impl<E: Activation> AfmoeScratch<E> {
    pub(super) fn new(
        stream: &Arc<CudaStream>,
        config: &ModelConfig,
        tokens: usize,
    ) -> Result<Self> {
        let (experts, k, inter) = routed(config);
        let hidden = config.hidden_size;
        let action = "allocating a batch's activations";
        // Zero-length buffers (a model without routed experts) take one value: the driver
        // refuses empty allocations.
        let f32s = |n: usize| {
            stream
                .alloc_zeros::<f32>(n.max(1))
                .map_err(memory_error(action))
        };
        let values = |n: usize| {
            stream
                .alloc_zeros::<E>(n.max(1))
                .map_err(memory_error(action))
        };
        let u32s = |n: usize| {
            stream
                .alloc_zeros::<u32>(n.max(1))
                .map_err(memory_error(action))
        };
        Ok(Self {
            gate: values(tokens * config.num_heads * config.head_dim)?,
            wide: f32s(tokens * hidden)?,
            logits: f32s(tokens * experts)?,
            rows: values(tokens * k * hidden)?,
            expert_gate_up: values(tokens * 2 * inter)?,
            expert_act: values(tokens * inter)?,
            expert_out: f32s(tokens * k * hidden)?,
            row_tokens: u32s(tokens * k)?,
            slots: u32s(tokens * k)?,
            weights: f32s(tokens * k)?,
            host: HostRouting::default(),
        })
    }
}

/// A fault: a block without its AFMoE weights or buffers reached an AFMoE op.
fn not_afmoe(op: &'static str) -> crate::Error {
    CudaError::Fault {
        action: op,
        reason: "the batch has no AFMoE buffers".into(),
    }
    .into()
}

impl<E: Activation> DeviceOps<'_, '_, E> {
    /// `head_norm`: each query head by `q`, each key head by `k`, in place.
    pub(super) fn head_norms_of(&mut self, norms: &HeadNorms<OnDevice<E>>) -> Result<()> {
        let p = self.pass;
        let c = p.config;
        launch::head_norm(
            p.stream,
            &p.kernels.head_norm,
            &mut self.s.qkv,
            (&norms.q, &norms.k),
            (
                p.tokens,
                c.num_heads,
                c.num_kv_heads,
                c.head_dim,
                c.rms_norm_eps as f32,
            ),
        )
    }

    /// The gate's product, then `sigmoid_gate` on the attention output.
    pub(super) fn attention_gate_of(&mut self, weight: &CudaSlice<E>) -> Result<()> {
        let p = self.pass;
        let c = p.config;
        let attn_width = c.num_heads * c.head_dim;
        let s = &mut *self.s;
        let Some(scratch) = s.afmoe.as_mut() else {
            return Err(not_afmoe("sigmoid_gate"));
        };
        let shape = (attn_width, c.hidden_size);
        let c_type = E::DATA_TYPE;
        p.gemm(&s.normed, weight, &mut scratch.gate, c_type, shape, 0.0)?;
        let n = p.tokens * attn_width;
        launch::sigmoid_gate(
            p.stream,
            &p.kernels.sigmoid_gate,
            &mut s.attn,
            &scratch.gate,
            n,
        )
    }

    /// `rms_norm_wide` of the branch, swapped in as the branch.
    pub(super) fn branch_norm_of(&mut self, weight: &CudaSlice<E>) -> Result<()> {
        let p = self.pass;
        let c = p.config;
        let s = &mut *self.s;
        let Some(scratch) = s.afmoe.as_mut() else {
            return Err(not_afmoe("rms_norm_wide"));
        };
        let shape = (p.tokens, c.hidden_size, c.rms_norm_eps as f32);
        let kernel = &p.kernels.rms_norm_wide;
        launch::rms_norm_wide(
            p.stream,
            kernel,
            &s.branch,
            weight,
            &mut scratch.wide,
            shape,
        )?;
        std::mem::swap(&mut s.branch, &mut scratch.wide);
        Ok(())
    }

    /// The f32 router on `rms_norm_wide(x) · norm`, the host's routing, the grouped expert
    /// GEMMs and `moe_scatter` into the branch.
    pub(super) fn routed_experts_of(
        &mut self,
        moe: &MoeWeights<OnDevice<E>>,
        norm: &CudaSlice<E>,
        keep: Option<usize>,
    ) -> Result<()> {
        let p = self.pass;
        let (c, tokens) = (p.config, p.tokens);
        let hidden = c.hidden_size;
        let (experts, k, _) = routed(c);
        let s = &mut *self.s;
        let Some(scratch) = s.afmoe.as_mut() else {
            return Err(not_afmoe("routing"));
        };
        // The router reads the MLP's norm in f32.
        let eps = c.rms_norm_eps as f32;
        let shape = (tokens, hidden, eps);
        let kernel = &p.kernels.rms_norm_wide;
        launch::rms_norm_wide(p.stream, kernel, &s.x, norm, &mut scratch.wide, shape)?;
        let logits = (tokens, experts, hidden);
        gemm_f32(
            p.blas,
            p.stream,
            &scratch.wide,
            &moe.router,
            &mut scratch.logits,
            logits,
        )?;
        route(p.stream, scratch, moe, c, tokens)?;
        launch::moe_gather(
            p.stream,
            &p.kernels.moe_gather,
            &s.normed,
            &scratch.row_tokens,
            &mut scratch.rows,
            (tokens * k, tokens, hidden),
        )?;
        run_experts(p, moe, scratch)?;
        launch::moe_scatter(
            p.stream,
            &p.kernels.moe_scatter,
            (&scratch.expert_out, &scratch.slots, &scratch.weights),
            &mut s.branch,
            (tokens, k, hidden),
        )?;
        if let Some(slot) = keep {
            let host = &scratch.host;
            (self.routes).record(slot, &host.choices, &host.logits, &moe.expert_bias);
        }
        Ok(())
    }
}

/// Each expert's SwiGLU over its block of grouped rows, one GEMM pair per expert, into
/// `expert_out`.
fn run_experts<E: Activation>(
    p: &super::Pass<'_>,
    moe: &MoeWeights<OnDevice<E>>,
    scratch: &mut AfmoeScratch<E>,
) -> Result<()> {
    let hidden = p.config.hidden_size;
    let (_, _, inter) = routed(p.config);
    for (e, expert) in moe.experts.iter().enumerate() {
        let rows = scratch.host.grouping.rows(e);
        let n = rows.len();
        if n == 0 {
            continue;
        }
        let input = scratch.rows.slice(rows.start * hidden..rows.end * hidden);
        let product = (n, 2 * inter, hidden);
        let types = (E::DATA_TYPE, E::DATA_TYPE, E::COMPUTE);
        let buffers = (&input, &expert.gate_up, &mut scratch.expert_gate_up);
        launch::gemm(p.blas, p.stream, buffers, types, product, 0.0)?;
        let swiglu = &p.kernels.swiglu;
        launch::swiglu(
            p.stream,
            swiglu,
            &scratch.expert_gate_up,
            &mut scratch.expert_act,
            (n, inter),
        )?;
        let mut out = scratch
            .expert_out
            .slice_mut(rows.start * hidden..rows.end * hidden);
        let types = (E::DATA_TYPE, F32, E::COMPUTE);
        let buffers = (&scratch.expert_act, &expert.down, &mut out);
        launch::gemm(p.blas, p.stream, buffers, types, (n, hidden, inter), 0.0)?;
    }
    Ok(())
}

/// Downloads the logits, routes each token on the host and uploads the grouping.
fn route<E: Activation>(
    stream: &Arc<CudaStream>,
    scratch: &mut AfmoeScratch<E>,
    moe: &MoeWeights<OnDevice<E>>,
    c: &ModelConfig,
    tokens: usize,
) -> Result<()> {
    let (experts, k, _) = routed(c);
    let scale = c.afmoe.as_ref().map_or(1.0, |a| a.route_scale as f32);
    let copy = CudaError::fault("routing the batch's tokens");
    let host = &mut scratch.host;
    host.logits.resize(tokens * experts, 0.0);
    stream
        .memcpy_dtoh(
            &scratch.logits.slice(..tokens * experts),
            &mut host.logits[..],
        )
        .map_err(&copy)?;
    stream.synchronize().map_err(&copy)?;
    host.choices.resize(tokens * k, Choice::default());
    for (chosen, logits) in host
        .choices
        .chunks_exact_mut(k)
        .zip(host.logits.chunks_exact(experts))
    {
        choose(logits, &moe.expert_bias, scale, chosen);
    }
    host.grouping.group(&host.choices, experts, k);
    host.weights.clear();
    host.weights.extend(host.choices.iter().map(|c| c.weight));
    let n = tokens * k;
    stream
        .memcpy_htod(
            &host.grouping.tokens[..n],
            &mut scratch.row_tokens.slice_mut(..n),
        )
        .map_err(&copy)?;
    stream
        .memcpy_htod(&host.grouping.slots[..n], &mut scratch.slots.slice_mut(..n))
        .map_err(&copy)?;
    stream
        .memcpy_htod(&host.weights[..n], &mut scratch.weights.slice_mut(..n))
        .map_err(&copy)?;
    Ok(())
}
