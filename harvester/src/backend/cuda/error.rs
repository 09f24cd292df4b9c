//! The CUDA backend's errors, typed by who can fix them: a machine without a usable GPU, or
//! whose memory another process took mid-run (infrastructure: another node may do), a model the
//! kernels do not cover or a batch too large for the device (the input), and kernels that do not
//! compile or load, a failed launch or a kernel fault (a bug or a broken image: exit 70, never
//! retried on another node, where it would fail the same way).

use harvest_core::worker::ErrorKind;

/// What went wrong in the CUDA backend.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No driver, no device, no such device, or no NVRTC: this machine cannot run it.
    #[error("no usable GPU: {reason}")]
    Unavailable {
        /// What is missing and what to do.
        reason: String,
    },
    /// The model uses something the CUDA backend does not implement yet.
    #[error("the CUDA backend does not support {reason} yet: use --device cpu for this model")]
    Unsupported {
        /// What it uses.
        reason: String,
    },
    /// A feature that has run only on the replay, refused on a GPU until a GPU window checks it.
    #[error(
        "{feature} has run on the CUDA backend only replayed on the CPU (--device cuda-replay), not yet on a GPU: set {variable}=try to run it anyway, or {instead}"
    )]
    Unchecked {
        /// The feature.
        feature: &'static str,
        /// The environment variable that lets it run.
        variable: &'static str,
        /// What to do instead.
        instead: &'static str,
    },
    /// A kernel did not compile. This is a bug in the kernel source.
    #[error("compiling the CUDA kernels with NVRTC: {log}")]
    Compile {
        /// NVRTC's log.
        log: String,
    },
    /// The kernels compiled but no form of them loaded: the NVRTC that made them and the
    /// driver do not match.
    #[error(
        "the CUDA kernels did not load on this GPU in any form tried ({attempts}); NVRTC is {nvrtc}, the driver supports CUDA {driver}: put the CUDA libraries of the driver's version first on LD_LIBRARY_PATH, set HARVEST_CUDA_CODE=cubin or ptx to try one form, or use --device cpu"
    )]
    ModuleLoad {
        /// Each form tried and the driver's answer.
        attempts: String,
        /// NVRTC's version.
        nvrtc: String,
        /// The CUDA version the driver supports.
        driver: String,
    },
    /// A batch needs more device memory than is free.
    #[error(
        "a batch of {tokens} tokens needs {needed} bytes of GPU memory, but {free} of the device's {total} are free after the weights: lower batch_tokens, keep fewer or shallower layers, or use a GPU with more memory"
    )]
    DoesNotFit {
        /// Tokens in the batch.
        tokens: usize,
        /// Bytes its activations and captures need.
        needed: u64,
        /// Bytes free on the device.
        free: u64,
        /// The device's memory.
        total: u64,
    },
    /// The device ran out of memory although the plan was sized to fit: something else on the
    /// GPU took it.
    #[error(
        "the GPU ran out of memory while {action} ({reason}): another process may be using it; the job is retried"
    )]
    OutOfMemory {
        /// What was being allocated or copied.
        action: &'static str,
        /// The driver's word.
        reason: String,
    },
    /// A launch, copy or kernel failed on a working GPU. This is a bug in the CUDA backend.
    #[error(
        "CUDA {action} failed: {reason}; this is a bug in the CUDA backend: report it, and use --device cpu meanwhile"
    )]
    Fault {
        /// What was being done: the kernel's name, or the copy or call.
        action: &'static str,
        /// The driver's or cuBLAS's word.
        reason: String,
    },
}

impl CudaError {
    /// Who can fix it, as the worker protocol says.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Unavailable { .. } | Self::OutOfMemory { .. } => ErrorKind::Infrastructure,
            Self::Unsupported { .. } | Self::Unchecked { .. } | Self::DoesNotFit { .. } => {
                ErrorKind::BadInput
            }
            Self::Compile { .. } | Self::ModuleLoad { .. } | Self::Fault { .. } => {
                ErrorKind::Internal
            }
        }
    }

    /// A [`CudaError::Unavailable`] from a driver error met while setting up.
    pub fn unavailable(error: impl std::fmt::Display) -> Self {
        Self::Unavailable {
            reason: format!("CUDA: {error}"),
        }
    }

    /// A driver error met during `action`: out of memory, or else a fault.
    pub fn from_driver(action: &'static str, error: cudarc::driver::DriverError) -> Self {
        use cudarc::driver::sys::CUresult;
        // The code's name, not cudarc's Display, which asks the driver for a string and
        // panics where the driver library is absent.
        let reason = format!("{:?}", error.0);
        match error.0 {
            CUresult::CUDA_ERROR_OUT_OF_MEMORY => Self::OutOfMemory { action, reason },
            _ => Self::Fault { action, reason },
        }
    }

    /// A closure that turns a driver error met during `action` into a [`CudaError::Fault`].
    pub fn fault<E: std::fmt::Display>(action: &'static str) -> impl Fn(E) -> Self {
        move |error| Self::Fault {
            action,
            reason: error.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::DriverError;
    use cudarc::driver::sys::CUresult;

    #[test]
    fn out_of_memory_is_retried_elsewhere_and_a_kernel_fault_is_a_bug() {
        let oom = CudaError::from_driver(
            "allocating",
            DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY),
        );
        assert!(matches!(oom, CudaError::OutOfMemory { .. }), "{oom}");
        assert_eq!(oom.kind(), ErrorKind::Infrastructure);
        let fault = CudaError::from_driver(
            "running the kernels",
            DriverError(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS),
        );
        assert!(matches!(fault, CudaError::Fault { .. }), "{fault}");
        assert_eq!(fault.kind(), ErrorKind::Internal);
        assert!(
            fault.to_string().contains("running the kernels")
                && fault.to_string().contains("CUDA_ERROR_ILLEGAL_ADDRESS"),
            "{fault}"
        );
    }

    #[test]
    fn a_module_that_does_not_load_names_both_versions_and_is_not_retried() {
        let error = CudaError::ModuleLoad {
            attempts: "cubin: CUDA_ERROR_NO_BINARY_FOR_GPU".into(),
            nvrtc: "13.1".into(),
            driver: "13.0".into(),
        };
        let text = error.to_string();
        assert!(
            text.contains("NVRTC is 13.1") && text.contains("CUDA 13.0") && text.contains("cubin:"),
            "{text}"
        );
        assert_eq!(error.kind(), ErrorKind::Internal);
    }
}
