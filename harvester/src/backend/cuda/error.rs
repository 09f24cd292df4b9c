//! The CUDA backend's errors, typed by who can fix them: a machine without a usable GPU
//! (infrastructure: another node may have one), a model the kernels do not cover (the input:
//! run it on the CPU), and a failed compile, launch or kernel fault (a bug: exit 70, never
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
    /// A kernel did not compile. This is a bug in the kernel source.
    #[error("compiling the CUDA kernels with NVRTC: {log}")]
    Compile {
        /// NVRTC's log.
        log: String,
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
            Self::Unavailable { .. } => ErrorKind::Infrastructure,
            Self::Unsupported { .. } => ErrorKind::BadInput,
            Self::Compile { .. } | Self::Fault { .. } => ErrorKind::Internal,
        }
    }

    /// A [`CudaError::Unavailable`] from a driver error met while setting up.
    pub fn unavailable(error: impl std::fmt::Display) -> Self {
        Self::Unavailable {
            reason: format!("CUDA: {error}"),
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
