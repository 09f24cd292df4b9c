//! The kernels' CUDA C source and its compilation by NVRTC, once per process.

use crate::error::{CudaError, Result};

/// The source of every kernel (`kernels.cu`).
pub const SOURCE: &str = include_str!("kernels.cu");

/// The entry points the forward pass launches.
pub const NAMES: [&str; 6] = [
    "embed_gather",
    "rms_norm",
    "rope",
    "swiglu",
    "attention_varlen",
    "project",
];

/// Queries per attention block (`QUERIES` in the source).
pub const ATTENTION_QUERIES_PER_BLOCK: u32 = 8;
/// The widest head the attention kernel takes (`MAX_HEAD_DIM`).
pub const ATTENTION_MAX_HEAD_DIM: usize = 128;

/// The GPU generation compiled for: Hopper (H100, H200).
pub const ARCH: &str = "compute_90";

/// Whether NVRTC's library loads here.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen libnvrtc under its usual names; no symbol is called.
    #[allow(unsafe_code)]
    unsafe {
        cudarc::nvrtc::sys::is_culib_present()
    }
}

/// Compiles [`SOURCE`] to PTX for [`ARCH`].
pub fn compile() -> Result<cudarc::nvrtc::Ptx> {
    if !nvrtc_present() {
        return Err(CudaError::Unavailable {
            reason: "NVRTC (libnvrtc.so.13) is not on this machine: install the CUDA runtime or the nvidia-cuda-nvrtc wheel and put its lib directory on LD_LIBRARY_PATH".into(),
        }
        .into());
    }
    let options = cudarc::nvrtc::CompileOptions {
        arch: Some(ARCH),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(SOURCE, options)
        .map_err(|e| CudaError::Compile { log: e.to_string() }.into())
}
