//! The kernels' CUDA C source and its compilation by NVRTC, once per process: a cubin for
//! [`SM_ARCH`] (machine code: no JIT, so an NVRTC newer than the driver still loads) or PTX for
//! [`ARCH`] (JIT-compiled by the driver, which must be at least as new as the NVRTC). The
//! backend tries them in [`KernelCode::order`] and keeps the first whose module loads.

use std::ffi::{CString, c_char, c_int};

use crate::error::{CudaError, Result};

/// The source of every kernel (`kernels.cu`).
pub const SOURCE: &str = include_str!("kernels.cu");

/// The entry points the forward pass launches (the typed ones in both modes: `name` for bf16,
/// `name_f32`).
pub const NAMES: [&str; 25] = [
    "embed_gather",
    "embed_gather_f32",
    "rms_norm",
    "rms_norm_wide",
    "rms_norm_f32",
    "head_norm",
    "head_norm_f32",
    "sigmoid_gate",
    "sigmoid_gate_f32",
    "moe_gather",
    "moe_gather_f32",
    "moe_scatter",
    "rope",
    "rope_f32",
    "swiglu",
    "swiglu_f32",
    "round_bf16",
    "add_rows",
    "add_bias_bf16",
    "add_bias",
    "attention_varlen",
    "attention_varlen_f32",
    "attention_mma_64",
    "attention_mma_128",
    "project",
];

/// Queries per attention block (`QUERIES` in the source).
pub const ATTENTION_QUERIES_PER_BLOCK: u32 = 8;
/// The widest head the attention kernel takes (`MAX_HEAD_DIM`).
pub const ATTENTION_MAX_HEAD_DIM: usize = 256;
/// Queries per block of the tensor-core attention kernels (`MMA_QUERIES`): 16 per warp.
pub const ATTENTION_MMA_QUERIES_PER_BLOCK: u32 = 64;
/// Threads per block of the tensor-core attention kernels: four warps.
pub const ATTENTION_MMA_THREADS: u32 = 128;
/// The head widths with a tensor-core attention kernel (`attention_mma_<D>`).
pub const ATTENTION_MMA_HEAD_DIMS: [usize; 2] = [64, 128];

/// The virtual GPU generation PTX is compiled for: Hopper (H100, H200).
pub const ARCH: &str = "compute_90";
/// The real GPU generation a cubin is compiled for.
pub const SM_ARCH: &str = "sm_90";

/// The environment variable that forces one form of the kernels (`cubin` or `ptx`).
pub const CODE_VARIABLE: &str = "HARVEST_CUDA_CODE";

/// The form the kernels reach the driver in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelCode {
    /// Machine code for [`SM_ARCH`], made by NVRTC.
    Cubin,
    /// PTX for [`ARCH`], compiled by the driver when the module loads.
    Ptx,
}

impl KernelCode {
    /// Its name, as [`CODE_VARIABLE`] takes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cubin => "cubin",
            Self::Ptx => "ptx",
        }
    }

    /// The forms to try, in order: the one `forced` names (the value of [`CODE_VARIABLE`]),
    /// else a cubin first, since it loads whatever the driver's age.
    pub fn order(forced: Option<&str>) -> Result<Vec<Self>> {
        match forced.map(str::trim) {
            None | Some("") => Ok(vec![Self::Cubin, Self::Ptx]),
            Some("cubin") => Ok(vec![Self::Cubin]),
            Some("ptx") => Ok(vec![Self::Ptx]),
            Some(other) => Err(CudaError::Unavailable {
                reason: format!(
                    "{CODE_VARIABLE}={other:?} is not cubin or ptx: unset it, or set one of those"
                ),
            }
            .into()),
        }
    }
}

/// Whether NVRTC's library loads here.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen libnvrtc under its usual names; no symbol is called.
    #[allow(unsafe_code)]
    unsafe {
        cudarc::nvrtc::sys::is_culib_present()
    }
}

fn require_nvrtc() -> Result<()> {
    if nvrtc_present() {
        return Ok(());
    }
    Err(CudaError::Unavailable {
        reason: "NVRTC (libnvrtc.so.13) is not on this machine: install the CUDA runtime or the nvidia-cuda-nvrtc wheel and put its lib directory on LD_LIBRARY_PATH".into(),
    }
    .into())
}

/// NVRTC's version, `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    require_nvrtc()?;
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: NVRTC is loaded (checked above); both pointers are to live locals.
    #[allow(unsafe_code)]
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&raw mut major, &raw mut minor) };
    status.result().map_err(|e| CudaError::Compile {
        log: format!("nvrtcVersion: {e:?}"),
    })?;
    Ok((major, minor))
}

/// Compiles [`SOURCE`] in the form `code` names.
pub fn compile(code: KernelCode) -> Result<cudarc::nvrtc::Ptx> {
    require_nvrtc()?;
    match code {
        KernelCode::Ptx => {
            let options = cudarc::nvrtc::CompileOptions {
                arch: Some(ARCH),
                ..Default::default()
            };
            cudarc::nvrtc::compile_ptx_with_opts(SOURCE, options)
                .map_err(|e| CudaError::Compile { log: e.to_string() }.into())
        }
        KernelCode::Cubin => compile_cubin().map(cudarc::nvrtc::Ptx::from_binary),
    }
}

/// NVRTC's log of `program`, or what went wrong reading it.
///
/// # Safety
/// `program` must be a live program from `create_program`.
#[allow(unsafe_code)]
unsafe fn program_log(program: cudarc::nvrtc::sys::nvrtcProgram) -> String {
    // SAFETY: the caller passes a live program.
    match unsafe { cudarc::nvrtc::result::get_program_log(program) } {
        Ok(raw) => {
            let bytes: Vec<u8> = raw
                .iter()
                .map(|&c| c as u8)
                .take_while(|&b| b != 0)
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        }
        Err(e) => format!("(no log: {e:?})"),
    }
}

/// [`SOURCE`] compiled to a cubin (an ELF image) for [`SM_ARCH`].
pub fn compile_cubin() -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result, sys};
    let source = CString::new(SOURCE).map_err(|e| CudaError::Compile { log: e.to_string() })?;
    let program = result::create_program(&source, None).map_err(|e| CudaError::Compile {
        log: format!("nvrtcCreateProgram: {e:?}"),
    })?;
    let options = [format!("--gpu-architecture={SM_ARCH}")];
    // SAFETY: `program` was created just above and is destroyed once, at the end; every NVRTC
    // call gets it and buffers of the sizes NVRTC reported.
    #[allow(unsafe_code)]
    let outcome = unsafe {
        match result::compile_program(program, &options) {
            Err(e) => Err(format!("{e:?}: {}", program_log(program))),
            Ok(()) => {
                let mut size = 0usize;
                match sys::nvrtcGetCUBINSize(program, &raw mut size).result() {
                    Err(e) => Err(format!("nvrtcGetCUBINSize: {e:?}")),
                    Ok(()) => {
                        let mut cubin = vec![0u8; size];
                        sys::nvrtcGetCUBIN(program, cubin.as_mut_ptr().cast::<c_char>())
                            .result()
                            .map(|()| cubin)
                            .map_err(|e| format!("nvrtcGetCUBIN: {e:?}"))
                    }
                }
            }
        }
    };
    // SAFETY: `program` is live and not used after this.
    #[allow(unsafe_code)]
    let _ = unsafe { result::destroy_program(program) };
    outcome.map_err(|log| CudaError::Compile { log }.into())
}
