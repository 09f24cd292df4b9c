//! The kernels' module on one device and the entry points the pass launches: the typed ones
//! in the mode's type, and the attention kernel for the model's head width.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction};

use super::Activation;
use crate::backend::cuda::error::CudaError;
use crate::backend::cuda::kernels::{self, Arch, KernelCache, KernelCode};
use crate::backend::cuda::launch::AttentionKernel;
use crate::backend::cuda::libraries::{self, Purpose};
use crate::backend::cuda::plan::{ATTENTION_VARIABLE, uses_tensor_cores};
use crate::error::Result;
use harvest_core::plan::Precision;

/// The attention kernel for heads of `head_dim` in `E`: on tensor cores where one is built for
/// that width and the mode is bf16 (unless `HARVEST_CUDA_ATTENTION=simple`), else the CUDA-core
/// kernel of the mode.
fn attention_kernel<E: Activation>(
    function: &dyn Fn(&str) -> Result<CudaFunction>,
    head_dim: usize,
) -> Result<AttentionKernel> {
    let forced = crate::backend::cuda::switches::switch(ATTENTION_VARIABLE);
    let bf16 = E::PRECISION == Precision::Bf16;
    Ok(if bf16 && uses_tensor_cores(head_dim, forced.as_deref()) {
        let name = if head_dim == 64 {
            "attention_mma_64"
        } else {
            "attention_mma_128"
        };
        AttentionKernel {
            function: function(name)?,
            name,
            queries_per_block: kernels::ATTENTION_MMA_QUERIES_PER_BLOCK,
            threads: kernels::ATTENTION_MMA_THREADS,
            takes_head_dim: false,
        }
    } else {
        let name = if bf16 {
            "attention_varlen"
        } else {
            "attention_varlen_f32"
        };
        AttentionKernel {
            function: function(name)?,
            name,
            queries_per_block: kernels::ATTENTION_QUERIES_PER_BLOCK,
            threads: 32 * kernels::ATTENTION_QUERIES_PER_BLOCK,
            takes_head_dim: true,
        }
    })
}

/// Builds the kernels for `context`'s device and loads them in the first form of `order` that
/// loads. An image from the cache that the driver refuses is forgotten and compiled anew.
fn load_kernels(
    context: &Arc<CudaContext>,
    order: &[KernelCode],
) -> Result<(Arc<cudarc::driver::CudaModule>, KernelCode)> {
    let loaded = libraries::loaded(Purpose::Run)?;
    let nvrtc = &loaded.nvrtc.api;
    let device = Arch::from_capability(
        context
            .compute_capability()
            .map_err(CudaError::unavailable)?,
    );
    let cache = KernelCache::configured();
    let mut attempts = Vec::new();
    for &code in order {
        for _ in 0..2 {
            let image = match kernels::build(nvrtc, &cache, code, device) {
                Ok(image) => image,
                Err(crate::Error::Cuda(CudaError::Compile { log })) => {
                    attempts.push(format!("{}: did not compile: {log}", code.as_str()));
                    break;
                }
                Err(other) => return Err(other),
            };
            match context.load_module(image.module_image()) {
                Ok(module) => {
                    tracing::debug!(
                        code = code.as_str(),
                        target = %image.target,
                        cached = image.cached,
                        seconds = image.seconds,
                        "kernels loaded"
                    );
                    return Ok((module, code));
                }
                Err(e) => {
                    attempts.push(format!("{} for {}: {e}", code.as_str(), image.target));
                    match (&image.cache_file, image.cached) {
                        // A cached image the driver refuses may be damaged: compile once more.
                        (Some(path), true) => KernelCache::forget(path),
                        _ => break,
                    }
                }
            }
        }
    }
    let (major, minor) = nvrtc.version();
    Err(CudaError::ModuleLoad {
        attempts: attempts.join("; "),
        nvrtc: format!("{major}.{minor} ({})", loaded.nvrtc.path.display()),
        driver: crate::backend::cuda::driver_version().unwrap_or_else(|| "unknown".into()),
    }
    .into())
}

pub(super) struct Kernels {
    pub(super) embed_gather: CudaFunction,
    pub(super) rms_norm: CudaFunction,
    pub(super) rms_norm_wide: CudaFunction,
    pub(super) head_norm: CudaFunction,
    pub(super) sigmoid_gate: CudaFunction,
    pub(super) moe_gather: CudaFunction,
    pub(super) moe_scatter: CudaFunction,
    pub(super) rope: CudaFunction,
    pub(super) swiglu: CudaFunction,
    pub(super) round_bf16: CudaFunction,
    pub(super) add_rows: CudaFunction,
    pub(super) add_bias_bf16: CudaFunction,
    pub(super) add_bias: CudaFunction,
    pub(super) attention: AttentionKernel,
    pub(super) project: CudaFunction,
}

impl Kernels {
    /// Compiles the kernels, loads them on `context` in the first form that loads
    /// ([`kernels::CODE_VARIABLE`] may force one) and finds each entry point, the typed ones
    /// for activations of `E`; the attention kernel is the one for heads of `head_dim`.
    pub(super) fn load<E: Activation>(
        context: &Arc<CudaContext>,
        head_dim: usize,
    ) -> Result<(Self, KernelCode)> {
        let order = KernelCode::order(
            crate::backend::cuda::switches::switch(kernels::CODE_VARIABLE).as_deref(),
        )?;
        let (module, code) = load_kernels(context, &order)?;
        let function = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| CudaError::from_driver("finding a kernel in its module", e).into())
        };
        let typed = |name: &str| function(&format!("{name}{}", E::KERNEL_SUFFIX));
        let kernels = Self {
            embed_gather: typed("embed_gather")?,
            rms_norm: typed("rms_norm")?,
            rms_norm_wide: function(E::WIDE_NORM)?,
            head_norm: typed("head_norm")?,
            sigmoid_gate: typed("sigmoid_gate")?,
            moe_gather: typed("moe_gather")?,
            moe_scatter: function("moe_scatter")?,
            rope: typed("rope")?,
            swiglu: typed("swiglu")?,
            round_bf16: function("round_bf16")?,
            add_rows: function("add_rows")?,
            add_bias_bf16: function("add_bias_bf16")?,
            add_bias: function("add_bias")?,
            attention: attention_kernel::<E>(&function, head_dim)?,
            project: function("project")?,
        };
        Ok((kernels, code))
    }
}
