//! The CUDA backend, for every NVIDIA GPU from Ampere (sm_80) on, on drivers of the CUDA 12
//! line (from 12.2, driver 535) and the 13 line. `probe` checks the driver, the device and
//! the libraries before any weight is read, naming the GPU, its compute capability and the
//! driver in each refusal, never through cudarc's panicking loaders; `libraries` picks cuBLAS
//! (`blas`) and NVRTC (`nvrtc`) of a CUDA major the driver supports and loads them by path;
//! `kernels` compiles `kernels.cu` for the device's own architecture and caches the result on
//! disk. The forward pass (`forward`: the weights, cuBLAS GEMMs, the kernels, each launched
//! through its own checked wrapper in `launch`) has run on an H200 in the GPU window
//! (`scripts/gpu-window.sh`, `docs/gpu.md`), for dense Llama models, at every hook site. Each
//! block is the model file's (`crate::model`), run through the device's ops; `replay` runs the
//! same block over the kernels' arithmetic replayed on the CPU (`--device cuda-replay`), which
//! is how CI checks what has not yet run on a GPU. Without a GPU, CI compiles every kernel for
//! every listed architecture with NVRTC of both majors and resolves every entry point in both
//! majors' libraries. Errors are a typed [`CudaError`], classed by who can fix them (its
//! module says how).
//!
//! ```text
//! probe (driver? device N? sm_80+? cuBLAS + NVRTC of the driver's major?) ─► kernels::build
//!   (cache, else NVRTC for the device's sm_XY) ─► forward: upload the weights,
//!   per batch: embed → [rms_norm → QKV GEMM (+ bias) → rope → attention → O GEMM (+= x)
//!                       → rms_norm → gate/up GEMM → swiglu → down GEMM (+= x)], each kept site
//!   rounded to bf16 (or projected) into its slot and copied back on a second stream (`download`)
//! ```

pub mod blas;
mod download;
mod emulation;
pub(crate) mod error;
pub mod forward;
pub mod info;
pub mod kernels;
mod launch;
pub mod libraries;
pub mod nvrtc;
pub mod plan;
pub mod replay;
pub mod switches;
mod symbols;

use std::path::PathBuf;

pub use self::error::CudaError;
use self::kernels::Arch;
use self::libraries::{CudaVersion, LibrarySearch, Purpose};
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

impl std::fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(ordinal) => write!(f, "cuda:{ordinal}"),
            Self::CudaReplay => f.write_str("cuda-replay"),
        }
    }
}

/// How the CUDA backend finds its libraries and keeps its compiled kernels, as `main` reads it
/// from the environment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CudaSetup {
    /// Where cuBLAS and NVRTC are looked for.
    pub libraries: LibrarySearch,
    /// The folder compiled kernels are cached in; `None` keeps none.
    pub kernel_cache: Option<PathBuf>,
    /// The switches that were set ([`SWITCHES`]).
    pub switches: switches::Switches,
}

/// Every variable the backend takes as a switch ([`switches`]).
pub const SWITCHES: [&str; 7] = [
    forward::CUDA_AFMOE_VARIABLE,
    forward::CUDA_F32_VARIABLE,
    crate::backend::stages::CUDA_STAGES_VARIABLE,
    plan::ATTENTION_VARIABLE,
    kernels::CODE_VARIABLE,
    forward::UPLOAD_VARIABLE,
    forward::TAIL_VARIABLE,
];

/// The variable that names the kernel cache's folder (`off`: no cache).
pub const KERNEL_CACHE_VARIABLE: &str = "HARVEST_KERNEL_CACHE";

impl CudaSetup {
    /// The setup the environment describes (`var` reads a variable): the library search of
    /// [`LibrarySearch::from_vars`], the kernel cache in [`KERNEL_CACHE_VARIABLE`], else
    /// `$XDG_CACHE_HOME/harvest/kernels`, else `$HOME/.cache/harvest/kernels`, and the
    /// [`SWITCHES`] that are set.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> std::result::Result<Self, String> {
        let set = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        let kernel_cache = match set(KERNEL_CACHE_VARIABLE) {
            Some(value) if value.trim() == "off" => None,
            Some(value) => Some(PathBuf::from(value)),
            None => set("XDG_CACHE_HOME")
                .map(|dir| PathBuf::from(dir).join("harvest/kernels"))
                .or_else(|| {
                    set("HOME").map(|home| PathBuf::from(home).join(".cache/harvest/kernels"))
                }),
        };
        Ok(Self {
            libraries: LibrarySearch::from_vars(&var)?,
            kernel_cache,
            switches: switches::Switches::from_vars(&SWITCHES, &var),
        })
    }
}

/// Sets how the backend finds its libraries and caches its kernels, once, before any GPU
/// work (`main` calls it; later calls are ignored).
pub fn configure(setup: CudaSetup) {
    libraries::configure(setup.libraries);
    kernels::configure_cache(setup.kernel_cache);
    switches::configure(setup.switches);
}

/// What the probe found: the GPU, and the driver and libraries that will run it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// Devices the driver sees.
    pub devices: usize,
    /// The GPU's name.
    pub name: String,
    /// Its architecture.
    pub arch: Arch,
    /// The CUDA version the driver supports.
    pub driver: CudaVersion,
    /// The CUDA major of the libraries loaded for it.
    pub libraries: u32,
}

impl GpuInfo {
    /// The GPU in words: name, compute capability, driver and libraries.
    pub fn describe(&self, ordinal: usize) -> String {
        format!(
            "cuda:{ordinal} ({}, compute capability {}, driver of CUDA {}, CUDA {} libraries)",
            self.name,
            self.arch.capability(),
            self.driver,
            self.libraries
        )
    }
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

/// The refusal of a GPU older than the kernels run on, naming it, its compute capability, the
/// driver, and the oldest generation supported.
pub fn check_capability(ordinal: usize, name: &str, arch: Arch, driver: CudaVersion) -> Result<()> {
    if arch < Arch::OLDEST {
        return Err(CudaError::Unavailable {
            reason: format!(
                "cuda:{ordinal} is {name}, compute capability {} (driver of CUDA {driver}), but the harvester's kernels need bf16 tensor cores: compute capability {} ({}) or newer; use such a GPU, or --device cpu",
                arch.capability(),
                Arch::OLDEST.capability(),
                Arch::OLDEST.gpus(),
            ),
        }
        .into());
    }
    Ok(())
}

/// Why the driver did not start, and what to check.
fn driver_refusal(error: cudarc::driver::DriverError, driver: CudaVersion) -> String {
    use cudarc::driver::sys::CUresult;
    match error.0 {
        CUresult::CUDA_ERROR_NO_DEVICE => format!(
            "the NVIDIA driver (CUDA {driver}) is installed but finds no GPU: check that this process can see one (CUDA_VISIBLE_DEVICES, a container's --gpus, a Pod's nvidia.com/gpu request), or use --device cpu"
        ),
        CUresult::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH
        | CUresult::CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE => format!(
            "the NVIDIA driver (CUDA {driver}) does not match its kernel module ({:?}): reboot or reinstall the driver, or use --device cpu",
            error.0
        ),
        other => format!(
            "the NVIDIA driver (CUDA {driver}) did not start ({other:?}): check the GPU with nvidia-smi, or use --device cpu"
        ),
    }
}

/// Checks, before any weight is read, that the driver loads and starts, that device `ordinal`
/// exists and is new enough for the kernels, and that cuBLAS and NVRTC of a CUDA version the
/// driver supports load; each refusal names the GPU, its compute capability, the driver and
/// what would work, never through cudarc's panicking loaders.
pub fn probe(ordinal: usize) -> Result<GpuInfo> {
    let unavailable = |reason: String| crate::Error::from(CudaError::Unavailable { reason });
    let driver = libraries::driver_cuda().ok_or_else(|| {
        unavailable(
            "the NVIDIA driver library (libcuda.so.1) is not on this machine: run on a GPU node with NVIDIA's driver (535 or newer), or use --device cpu".into(),
        )
    })?;
    cudarc::driver::result::init().map_err(|e| unavailable(driver_refusal(e, driver)))?;
    let devices = cudarc::driver::result::device::get_count()
        .map_err(|e| unavailable(driver_refusal(e, driver)))?;
    let devices = usize::try_from(devices).unwrap_or(0);
    if ordinal >= devices {
        return Err(unavailable(format!(
            "cuda:{ordinal} does not exist: this machine's driver (CUDA {driver}) sees {devices} GPU(s) (cuda:0 to cuda:{})",
            devices.saturating_sub(1)
        )));
    }
    let (name, capability) = device_identity(ordinal).map_err(|e| {
        unavailable(format!(
            "cuda:{ordinal} did not say its name and compute capability ({:?}; driver of CUDA {driver})",
            e.0
        ))
    })?;
    let arch = Arch::from_capability(capability);
    check_capability(ordinal, &name, arch, driver)?;
    let loaded = libraries::loaded(Purpose::Run).map_err(|e| {
        unavailable(format!(
            "cuda:{ordinal} ({name}, compute capability {}): {e}",
            arch.capability()
        ))
    })?;
    Ok(GpuInfo {
        devices,
        name,
        arch,
        driver,
        libraries: loaded.major,
    })
}

/// The free bytes of GPU `ordinal`, after its probe passes: what a pipeline stage planned for
/// it may use.
pub fn free_memory(ordinal: usize) -> Result<u64> {
    probe(ordinal)?;
    let context = cudarc::driver::CudaContext::new(ordinal).map_err(CudaError::unavailable)?;
    let (free, _total) = context.mem_get_info().map_err(CudaError::unavailable)?;
    Ok(free as u64)
}

/// Device `ordinal`'s name and compute capability (major, minor).
fn device_identity(
    ordinal: usize,
) -> std::result::Result<(String, (i32, i32)), cudarc::driver::DriverError> {
    use cudarc::driver::sys::CUdevice_attribute as Attribute;
    let device = cudarc::driver::result::device::get(i32::try_from(ordinal).unwrap_or(i32::MAX))?;
    let name = cudarc::driver::result::device::get_name(device)?;
    // SAFETY: `device` was returned by `get` just above, as `get_attribute` requires.
    #[allow(unsafe_code)]
    let capability = unsafe {
        (
            cudarc::driver::result::device::get_attribute(
                device,
                Attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            )?,
            cudarc::driver::result::device::get_attribute(
                device,
                Attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
            )?,
        )
    };
    Ok((name, capability))
}

/// The CUDA version the driver supports, as `major.minor`, if the driver loads.
pub fn driver_version() -> Option<String> {
    libraries::driver_cuda().map(|v| v.to_string())
}

/// The GPUs this machine has, as `cuda-info --list` prints them: what the embedded server
/// runs its workers on when its configuration names none.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GpuList {
    /// The CUDA version the driver supports, where it loads.
    pub driver_cuda: Option<String>,
    /// Each GPU the driver sees.
    pub gpus: Vec<ListedGpu>,
    /// Why there are none, where there are none.
    pub none_because: Option<String>,
}

/// One GPU of [`GpuList`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct ListedGpu {
    /// Its CUDA ordinal.
    pub ordinal: usize,
    /// Its name, where the driver said it.
    pub name: Option<String>,
    /// Its compute capability.
    pub compute_capability: Option<String>,
    /// Whether the harvester can run on it.
    pub usable: bool,
    /// Why not, where it cannot.
    pub refusal: Option<String>,
}

/// Lists this machine's GPUs, each probed as a run would be.
pub fn list_gpus() -> GpuList {
    let count = match probe(0) {
        Ok(gpu) => gpu.devices,
        Err(e) => {
            // The first GPU may be refused while the driver sees others. Asked only where the
            // driver loads: cudarc panics on a machine without one.
            let seen = libraries::driver_cuda()
                .and_then(|_| cudarc::driver::result::device::get_count().ok())
                .and_then(|n| usize::try_from(n).ok())
                .unwrap_or(0);
            if seen == 0 {
                return GpuList {
                    driver_cuda: driver_version(),
                    gpus: Vec::new(),
                    none_because: Some(e.to_string()),
                };
            }
            seen
        }
    };
    let gpus = (0..count)
        .map(|ordinal| {
            let identity = device_identity(ordinal).ok();
            let probed = probe(ordinal);
            ListedGpu {
                ordinal,
                name: identity.as_ref().map(|(name, _)| name.clone()),
                compute_capability: identity
                    .map(|(_, capability)| Arch::from_capability(capability).capability()),
                usable: probed.is_ok(),
                refusal: probed.err().map(|e| e.to_string()),
            }
        })
        .collect();
    GpuList {
        driver_cuda: driver_version(),
        gpus,
        none_because: None,
    }
}

/// What a job asks of the CUDA backend that has run only replayed so far, each refused on a
/// GPU unless its variable says `try`: AFMoE, the f32 mode named by the job, pipeline stages.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JobFeatures {
    /// The model is an AFMoE one.
    pub afmoe: bool,
    /// The job names the f32 mode.
    pub f32: bool,
    /// The job runs in pipeline stages.
    pub stages: bool,
}

impl JobFeatures {
    /// The first feature no GPU window has checked, with its variable, unless `tried` says
    /// that variable is `try`.
    pub fn unchecked(self, tried: &dyn Fn(&str) -> bool) -> Option<(&'static str, &'static str)> {
        use crate::backend::stages::CUDA_STAGES_VARIABLE;
        use forward::{CUDA_AFMOE_VARIABLE, CUDA_F32_VARIABLE};
        [
            (self.afmoe, "AFMoE", CUDA_AFMOE_VARIABLE),
            (self.f32, "the f32 mode", CUDA_F32_VARIABLE),
            (self.stages, "pipeline stages", CUDA_STAGES_VARIABLE),
        ]
        .into_iter()
        .find(|&(asked, _, variable)| asked && !tried(variable))
        .map(|(_, feature, variable)| (feature, variable))
    }
}

/// The variables of features not yet checked on a GPU that `var` says are `try`.
pub fn tried_variables(var: impl Fn(&str) -> Option<String>) -> Vec<&'static str> {
    use crate::backend::stages::CUDA_STAGES_VARIABLE;
    use forward::{CUDA_AFMOE_VARIABLE, CUDA_F32_VARIABLE};
    [CUDA_AFMOE_VARIABLE, CUDA_F32_VARIABLE, CUDA_STAGES_VARIABLE]
        .into_iter()
        .filter(|name| var(name).as_deref().map(str::trim) == Some("try"))
        .collect()
}

/// Where `--device auto` runs a job, and why: on GPU 0 when the probe found a usable one
/// (`gpu`, else the probe's refusal) and the job asks for nothing that has not run on a GPU
/// (`unchecked`), else on the CPU.
pub fn choose_auto(
    gpu: std::result::Result<&GpuInfo, String>,
    unchecked: Option<(&str, &str)>,
) -> (DeviceChoice, String) {
    match (gpu, unchecked) {
        (Ok(gpu), None) => (
            DeviceChoice::Cuda(0),
            format!("auto runs on {}", gpu.describe(0)),
        ),
        (Ok(gpu), Some((feature, variable))) => (
            DeviceChoice::Cpu,
            format!(
                "auto runs on the CPU: {} is here, but this job needs {feature}, which has not yet run on a GPU (set {variable}=try and pass --device cuda to use the GPU anyway)",
                gpu.describe(0)
            ),
        ),
        (Err(reason), _) => (DeviceChoice::Cpu, format!("auto runs on the CPU: {reason}")),
    }
}

/// The device a run uses, and for `auto` why: `auto` as [`choose_auto`] decides for a job with
/// `features` (`tried` tells whether a variable is `try`), logged; `cuda[:N]` once its probe
/// passes; `cpu` and `cuda-replay` as they are.
pub fn select(
    choice: DeviceChoice,
    features: JobFeatures,
    tried: &dyn Fn(&str) -> bool,
) -> Result<(DeviceChoice, Option<String>)> {
    match choice {
        DeviceChoice::Cpu | DeviceChoice::CudaReplay => Ok((choice, None)),
        DeviceChoice::Cuda(ordinal) => {
            let gpu = probe(ordinal)?;
            tracing::info!(device = %choice, "running on {}", gpu.describe(ordinal));
            Ok((choice, None))
        }
        DeviceChoice::Auto => {
            let probed = probe(0).map_err(|e| e.to_string());
            let (device, why) = choose_auto(
                probed.as_ref().map_err(Clone::clone),
                features.unchecked(tried),
            );
            tracing::info!(device = %device, "{why}");
            Ok((device, Some(why)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h100() -> GpuInfo {
        GpuInfo {
            devices: 1,
            name: "NVIDIA H100 80GB HBM3".into(),
            arch: Arch(90),
            driver: CudaVersion {
                major: 13,
                minor: 0,
            },
            libraries: 13,
        }
    }

    #[test]
    fn a_gpu_older_than_ampere_is_refused_naming_it_its_capability_and_the_oldest_supported() {
        let driver = CudaVersion {
            major: 12,
            minor: 2,
        };
        let error = check_capability(0, "Tesla V100-SXM2-16GB", Arch(70), driver)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("Tesla V100-SXM2-16GB")
                && error.contains("compute capability 7.0")
                && error.contains("CUDA 12.2")
                && error.contains("8.0 (Ampere: A100"),
            "{error}"
        );
        for arch in [80, 86, 89, 90, 100, 120] {
            assert!(check_capability(1, "gpu", Arch(arch), driver).is_ok());
        }
    }

    #[test]
    fn device_names_parse_and_print_back_and_a_bad_one_names_the_choices() {
        for text in ["auto", "cpu", "cuda:0", "cuda:3", "cuda-replay"] {
            let choice: DeviceChoice = text.parse().unwrap();
            assert_eq!(choice.to_string(), text);
        }
        assert_eq!("cuda".parse(), Ok(DeviceChoice::Cuda(0)));
        let error = "gpu".parse::<DeviceChoice>().unwrap_err();
        assert!(
            error.contains("\"gpu\"") && error.contains("cuda:N"),
            "{error}"
        );
    }

    #[test]
    fn auto_takes_a_usable_gpu_and_says_which_and_why() {
        let gpu = h100();
        let (device, why) = choose_auto(Ok(&gpu), None);
        assert_eq!(device, DeviceChoice::Cuda(0));
        assert!(
            why.contains("NVIDIA H100 80GB HBM3") && why.contains("compute capability 9.0"),
            "{why}"
        );
    }

    #[test]
    fn auto_keeps_a_job_on_the_cpu_when_it_needs_what_no_gpu_has_run_or_no_gpu_is_usable() {
        let gpu = h100();
        let afmoe = JobFeatures {
            afmoe: true,
            ..JobFeatures::default()
        };
        let never = |_: &str| false;
        let (device, why) = choose_auto(Ok(&gpu), afmoe.unchecked(&never));
        assert_eq!(device, DeviceChoice::Cpu);
        assert!(
            why.contains("AFMoE") && why.contains("HARVEST_CUDA_AFMOE=try"),
            "{why}"
        );
        // Once its variable says try, the feature no longer keeps the job off the GPU.
        let tried = |name: &str| name == "HARVEST_CUDA_AFMOE";
        assert_eq!(afmoe.unchecked(&tried), None);
        let staged_f32 = JobFeatures {
            f32: true,
            stages: true,
            ..JobFeatures::default()
        };
        assert_eq!(
            staged_f32.unchecked(&never),
            Some(("the f32 mode", "HARVEST_CUDA_F32"))
        );
        let (device, why) = choose_auto(Err("no usable GPU: no driver".into()), None);
        assert_eq!(device, DeviceChoice::Cpu);
        assert_eq!(why, "auto runs on the CPU: no usable GPU: no driver");
    }

    #[test]
    fn the_setup_caches_kernels_where_the_environment_says_and_off_keeps_none() {
        let setup =
            CudaSetup::from_vars(|name| (name == "HOME").then(|| "/home/researcher".to_owned()))
                .unwrap();
        assert_eq!(
            setup.kernel_cache,
            Some(PathBuf::from("/home/researcher/.cache/harvest/kernels"))
        );
        let setup = CudaSetup::from_vars(|name| match name {
            "HOME" => Some("/home/researcher".to_owned()),
            "XDG_CACHE_HOME" => Some("/cache".to_owned()),
            _ => None,
        })
        .unwrap();
        assert_eq!(
            setup.kernel_cache,
            Some(PathBuf::from("/cache/harvest/kernels"))
        );
        let setup =
            CudaSetup::from_vars(|name| (name == KERNEL_CACHE_VARIABLE).then(|| "off".to_owned()))
                .unwrap();
        assert_eq!(setup.kernel_cache, None);
    }

    #[test]
    fn the_setup_holds_each_switch_that_is_set_and_nothing_else() {
        let setup = CudaSetup::from_vars(|name| match name {
            "HARVEST_CUDA_ATTENTION" => Some("simple".to_owned()),
            "HARVEST_CUDA_AFMOE" => Some("try".to_owned()),
            "HARVEST_CUDA_CODE" => Some("  ".to_owned()),
            "HOME" => Some("/home/researcher".to_owned()),
            _ => None,
        })
        .unwrap();
        assert_eq!(setup.switches.get(plan::ATTENTION_VARIABLE), Some("simple"));
        assert_eq!(
            setup.switches.get(forward::CUDA_AFMOE_VARIABLE),
            Some("try")
        );
        assert_eq!(
            setup.switches.get(kernels::CODE_VARIABLE),
            None,
            "blank is unset"
        );
        assert_eq!(setup.switches.get("HOME"), None, "not a switch");
        assert!(
            SWITCHES
                .iter()
                .all(|name| name.starts_with("HARVEST_CUDA_"))
        );
    }

    #[test]
    fn without_a_driver_cuda_is_a_clear_error_and_auto_falls_back_to_the_cpu() {
        if driver_present() {
            return; // a machine with a driver: the GPU window and the driver test cover it
        }
        let error = probe(0).unwrap_err().to_string();
        assert!(
            error.contains("libcuda.so.1") && error.contains("--device cpu"),
            "{error}"
        );
        let never = |_: &str| false;
        let (device, why) = select(DeviceChoice::Auto, JobFeatures::default(), &never).unwrap();
        assert_eq!(device, DeviceChoice::Cpu);
        assert!(why.unwrap().contains("libcuda.so.1"));
        assert!(matches!(
            select(DeviceChoice::Cuda(1), JobFeatures::default(), &never),
            Err(crate::Error::Cuda(CudaError::Unavailable { .. }))
        ));
    }
}
