//! The CUDA backend. Checked without a GPU: the NVRTC kernels (`kernels.cu`, compiled to a
//! cubin and to PTX in a test wherever libnvrtc is present), the host-side plans (attention
//! tiles, pipeline stages, activation memory), and the probe that turns a missing driver or
//! device into a clear error instead of cudarc's panic. The forward pass (`forward`: bf16
//! weights, cuBLAS GEMMs, the kernels, each launched through its own checked wrapper in
//! `launch`) has run on an H200 in the GPU window (`scripts/gpu-window.sh`, `docs/gpu.md`),
//! for dense Llama models, at every hook site. Each block is the dense model's
//! (`crate::model::dense`), run through the device's ops; `replay` runs the same block over the
//! kernels' arithmetic replayed on the CPU (`--device cuda-replay`), which is how CI checks
//! what has not yet run on a GPU (QKV biases, heads narrower than 32). Errors are a typed
//! [`CudaError`], classed by who can fix them (its module says how).
//!
//! ```text
//! probe (libcuda? device N?) ─► kernels::compile (NVRTC, once) ─► forward: upload bf16 weights,
//!   per batch: embed → [rms_norm → QKV GEMM (+ bias) → rope → attention → O GEMM (+= x)
//!                       → rms_norm → gate/up GEMM → swiglu → down GEMM (+= x)], each kept site
//!   rounded to bf16 (or projected) into its slot and copied back on a second stream (`download`)
//! ```

mod download;
mod emulation;
pub(crate) mod error;
pub mod forward;
pub mod info;
pub mod kernels;
mod launch;
pub mod plan;
pub mod replay;

pub use self::error::CudaError;
use crate::error::Result;

/// Where the forward pass runs, as `--device` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// A GPU if the probe finds one, else the CPU.
    #[default]
    Auto,
    /// The CPU reference backend.
    Cpu,
    /// GPU `N` (`cuda` is `cuda:0`).
    Cuda(usize),
    /// The CUDA backend's forward pass replayed on the CPU ([`replay`]): slow, for tests.
    CudaReplay,
}

impl DeviceChoice {
    /// Whether the forward pass is the CUDA backend's, on a GPU or replayed: its own precision
    /// is bf16 (`Precision::or_device`).
    pub fn is_cuda_arithmetic(self) -> bool {
        matches!(self, Self::Cuda(_) | Self::CudaReplay)
    }
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;

    fn from_str(text: &str) -> std::result::Result<Self, String> {
        match text {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            "cuda-replay" => Ok(Self::CudaReplay),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(|| {
                    format!(
                        "device {other:?} is not one of auto, cpu, cuda, cuda:N (N a GPU index), cuda-replay"
                    )
                }),
        }
    }
}

/// What the probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// Devices the driver sees.
    pub devices: usize,
}

/// Whether the CUDA driver library loads here.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library under its usual names; no symbol is
    // called.
    #[allow(unsafe_code)]
    unsafe {
        cudarc::driver::sys::is_culib_present()
    }
}

/// Whether cuBLAS loads here.
pub fn cublas_present() -> bool {
    // SAFETY: only tries to dlopen libcublas under its usual names; no symbol is called.
    #[allow(unsafe_code)]
    unsafe {
        cudarc::cublas::sys::is_culib_present()
    }
}

/// The CUDA libraries the backend loads at run time: what each is, and whether it loads here.
pub fn libraries() -> [(&'static str, bool); 3] {
    [
        (
            "the NVIDIA driver library (libcuda.so.1): run on a GPU node",
            driver_present(),
        ),
        (
            "cuBLAS (libcublas.so.13): install the CUDA runtime or the nvidia-cublas wheel",
            cublas_present(),
        ),
        (
            "NVRTC (libnvrtc.so.13): install the CUDA runtime or the nvidia-cuda-nvrtc wheel",
            kernels::nvrtc_present(),
        ),
    ]
}

/// The refusal for the first library that does not load, naming it and the fix.
pub fn missing_library(libraries: &[(&str, bool)]) -> Option<String> {
    let missing: Vec<&str> = libraries
        .iter()
        .filter(|(_, present)| !present)
        .map(|(name, _)| *name)
        .collect();
    (!missing.is_empty()).then(|| {
        format!(
            "the CUDA backend cannot load {}; put the library's directory on LD_LIBRARY_PATH, or use --device cpu",
            missing.join("; nor ")
        )
    })
}

/// The oldest GPU generation the kernels run on: they are compiled for [`kernels::ARCH`].
const MIN_COMPUTE_CAPABILITY: (i32, i32) = (9, 0);

/// The refusal of a GPU older than the kernels were compiled for.
pub fn check_capability(ordinal: usize, capability: (i32, i32)) -> Result<()> {
    if capability < MIN_COMPUTE_CAPABILITY {
        return Err(CudaError::Unavailable {
            reason: format!(
                "cuda:{ordinal} has compute capability {}.{}, but this harvester's kernels are built for {} (9.0, Hopper: H100, H200) and newer: use such a GPU, or --device cpu",
                capability.0,
                capability.1,
                kernels::ARCH
            ),
        }
        .into());
    }
    Ok(())
}

/// Checks that the CUDA libraries load, that device `ordinal` exists and that the kernels can
/// run on it, without touching cudarc's panicking loaders.
pub fn probe(ordinal: usize) -> Result<GpuInfo> {
    if let Some(reason) = missing_library(&libraries()) {
        return Err(CudaError::Unavailable { reason }.into());
    }
    let devices = cudarc::driver::result::init()
        .and_then(|()| cudarc::driver::result::device::get_count())
        .map_err(|e| CudaError::Unavailable {
            reason: format!("the CUDA driver did not start ({e}): check the driver and the GPU, or use --device cpu"),
        })?;
    let devices = usize::try_from(devices).unwrap_or(0);
    if ordinal >= devices {
        return Err(CudaError::Unavailable {
            reason: format!(
                "cuda:{ordinal} does not exist: this machine has {devices} GPU(s) (cuda:0 to cuda:{})",
                devices.saturating_sub(1)
            ),
        }
        .into());
    }
    let capability = compute_capability(ordinal).map_err(|e| CudaError::Unavailable {
        reason: format!("cuda:{ordinal} did not say its compute capability ({e})"),
    })?;
    check_capability(ordinal, capability)?;
    Ok(GpuInfo { devices })
}

/// The free bytes of GPU `ordinal`, after its probe passes: what a pipeline stage planned for
/// it may use.
pub fn free_memory(ordinal: usize) -> Result<u64> {
    probe(ordinal)?;
    let context = cudarc::driver::CudaContext::new(ordinal).map_err(CudaError::unavailable)?;
    let (free, _total) = context.mem_get_info().map_err(CudaError::unavailable)?;
    Ok(free as u64)
}

/// Device `ordinal`'s compute capability (major, minor).
fn compute_capability(
    ordinal: usize,
) -> std::result::Result<(i32, i32), cudarc::driver::DriverError> {
    use cudarc::driver::sys::CUdevice_attribute as Attribute;
    let device = cudarc::driver::result::device::get(i32::try_from(ordinal).unwrap_or(i32::MAX))?;
    // SAFETY: `device` was returned by `get` just above, as `get_attribute` requires.
    #[allow(unsafe_code)]
    unsafe {
        Ok((
            cudarc::driver::result::device::get_attribute(
                device,
                Attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            )?,
            cudarc::driver::result::device::get_attribute(
                device,
                Attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
            )?,
        ))
    }
}

/// The CUDA version the driver supports, as `major.minor`, if the driver loads.
pub fn driver_version() -> Option<String> {
    if !driver_present() {
        return None;
    }
    let mut version = 0;
    // SAFETY: the driver library loads (checked above); the pointer is to a live local.
    #[allow(unsafe_code)]
    let status = unsafe { cudarc::driver::sys::cuDriverGetVersion(&raw mut version) };
    status
        .result()
        .ok()
        .map(|()| format!("{}.{}", version / 1000, version % 1000 / 10))
}

/// The device `choice` resolves to here: `Auto` becomes `Cuda(0)` when the probe finds a GPU.
pub fn resolve(choice: DeviceChoice) -> Result<DeviceChoice> {
    match choice {
        DeviceChoice::Cpu => Ok(DeviceChoice::Cpu),
        DeviceChoice::CudaReplay => Ok(DeviceChoice::CudaReplay),
        DeviceChoice::Auto => Ok(if probe(0).is_ok() {
            DeviceChoice::Cuda(0)
        } else {
            DeviceChoice::Cpu
        }),
        DeviceChoice::Cuda(n) => {
            probe(n)?;
            Ok(DeviceChoice::Cuda(n))
        }
    }
}

/// The device a run uses. The CUDA pass does not yet cover every feature the CPU's does, so
/// `auto` runs on the CPU (saying so when a GPU is present); `cuda[:N]` runs on that GPU once
/// its probe passes.
pub fn select(choice: DeviceChoice) -> Result<DeviceChoice> {
    match (choice, resolve(choice)?) {
        (DeviceChoice::Cuda(device), _) => Ok(DeviceChoice::Cuda(device)),
        (DeviceChoice::CudaReplay, _) => Ok(DeviceChoice::CudaReplay),
        (_, DeviceChoice::Cuda(_)) => {
            tracing::warn!(
                "a GPU is present, but auto runs on the CPU while the CUDA backend lacks AFMoE and the f32 mode: pass --device cuda to use it"
            );
            Ok(DeviceChoice::Cpu)
        }
        (_, resolved) => Ok(resolved),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_named_with_its_fix_and_all_present_is_no_refusal() {
        let reason =
            missing_library(&[("the driver", true), ("cuBLAS (libcublas.so.13)", false)]).unwrap();
        assert!(
            reason.contains("cannot load cuBLAS (libcublas.so.13)"),
            "{reason}"
        );
        assert!(reason.contains("LD_LIBRARY_PATH"), "{reason}");
        assert_eq!(missing_library(&[("the driver", true)]), None);
        // Here (no GPU), the probe names the driver instead of panicking in cudarc's loader.
        if !driver_present() {
            let error = probe(0).unwrap_err().to_string();
            assert!(error.contains("libcuda.so.1"), "{error}");
        }
    }

    #[test]
    fn a_gpu_older_than_hopper_is_refused_naming_its_capability() {
        let error = check_capability(0, (8, 0)).unwrap_err().to_string();
        assert!(
            error.contains("compute capability 8.0") && error.contains("compute_90"),
            "{error}"
        );
        assert!(check_capability(0, (9, 0)).is_ok() && check_capability(1, (10, 0)).is_ok());
    }

    #[test]
    fn device_names_parse_and_a_bad_one_names_the_choices() {
        assert_eq!("auto".parse(), Ok(DeviceChoice::Auto));
        assert_eq!("cpu".parse(), Ok(DeviceChoice::Cpu));
        assert_eq!("cuda".parse(), Ok(DeviceChoice::Cuda(0)));
        assert_eq!("cuda:3".parse(), Ok(DeviceChoice::Cuda(3)));
        assert_eq!("cuda-replay".parse(), Ok(DeviceChoice::CudaReplay));
        let error = "gpu".parse::<DeviceChoice>().unwrap_err();
        assert!(
            error.contains("\"gpu\"") && error.contains("cuda:N"),
            "{error}"
        );
    }

    #[test]
    fn without_a_driver_cuda_is_a_clear_error_and_auto_falls_back_to_the_cpu() {
        if driver_present() {
            return; // a GPU machine: the GPU check script covers it
        }
        let error = probe(0).unwrap_err().to_string();
        assert!(
            error.contains("libcuda.so.1") && error.contains("--device cpu"),
            "{error}"
        );
        assert_eq!(resolve(DeviceChoice::Auto).unwrap(), DeviceChoice::Cpu);
        assert!(resolve(DeviceChoice::Cuda(0)).is_err());
        assert_eq!(select(DeviceChoice::Auto).unwrap(), DeviceChoice::Cpu);
        assert!(matches!(
            select(DeviceChoice::Cuda(1)),
            Err(crate::Error::Cuda(CudaError::Unavailable { .. }))
        ));
    }
}
