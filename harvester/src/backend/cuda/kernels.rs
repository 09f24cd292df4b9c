//! The kernels' CUDA C source and its compilation by NVRTC for the GPU that runs them: a
//! cubin for the device's own architecture (machine code: no JIT, so it loads on any driver of
//! NVRTC's CUDA major) or PTX for it (JIT-compiled by the driver, which must be at least as new
//! as the NVRTC). The backend tries them in [`KernelCode::order`] and keeps the first whose
//! module loads. What NVRTC makes is cached on disk ([`KernelCache`]), keyed by the source's
//! digest, the options, the architecture and NVRTC's version, so a start pays NVRTC once.
//!
//! Every generation from Ampere ([`Arch::OLDEST`], sm_80) on runs the same source: the
//! tensor-core attention is `mma.sync` m16n8k16 bf16 and `ldmatrix`, both sm_80's, and every
//! kernel's shared memory is static and under 48 KiB, which every such GPU gives a block.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

use sha2::{Digest, Sha256};

use super::nvrtc::{NvrtcApi, Output};
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

/// A GPU architecture: `XY` of `sm_XY`, compute capability X.Y.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(into = "String")]
pub struct Arch(pub u32);

impl Arch {
    /// The oldest the kernels run on: Ampere (sm_80), the first with bf16 tensor cores.
    pub const OLDEST: Self = Self(80);

    /// The architecture of compute capability `major.minor`.
    pub fn from_capability((major, minor): (i32, i32)) -> Self {
        Self(u32::try_from(major * 10 + minor).unwrap_or(0))
    }

    /// `sm_XY`, what a cubin is compiled for.
    pub fn sm(self) -> String {
        format!("sm_{}", self.0)
    }

    /// `compute_XY`, what PTX is compiled for.
    pub fn compute(self) -> String {
        format!("compute_{}", self.0)
    }

    /// `X.Y`, as NVIDIA writes a compute capability.
    pub fn capability(self) -> String {
        format!("{}.{}", self.0 / 10, self.0 % 10)
    }

    /// The GPUs of this architecture, for people.
    pub fn gpus(self) -> &'static str {
        match self.0 {
            80 => "Ampere: A100, A30",
            86 => "Ampere: A10, A40, A6000, RTX 3090",
            87 => "Ampere: Jetson Orin",
            89 => "Ada: L4, L40S, RTX 4090, RTX 6000 Ada",
            90 => "Hopper: H100, H200, GH200",
            100 | 101 | 103 => "Blackwell: B200, B300, GB200",
            110 => "Blackwell: Jetson Thor",
            120 | 121 => "Blackwell: RTX 5090, RTX PRO 6000, DGX Spark",
            _ if self < Self::OLDEST => "older than Ampere",
            _ => "a newer generation",
        }
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sm_{}", self.0)
    }
}

impl From<Arch> for String {
    fn from(arch: Arch) -> Self {
        arch.sm()
    }
}

impl std::str::FromStr for Arch {
    type Err = String;

    /// `sm_80`, `compute_80`, `80` or `8.0`.
    fn from_str(text: &str) -> std::result::Result<Self, String> {
        let trimmed = text.trim();
        let digits = trimmed
            .strip_prefix("sm_")
            .or_else(|| trimmed.strip_prefix("compute_"))
            .unwrap_or(trimmed);
        let value = match digits.split_once('.') {
            Some((major, minor)) => major
                .parse::<u32>()
                .ok()
                .zip(minor.parse::<u32>().ok().filter(|m| *m < 10))
                .map(|(major, minor)| major * 10 + minor),
            None => digits.parse::<u32>().ok(),
        };
        match value {
            Some(value) if value >= 10 => Ok(Self(value)),
            _ => Err(format!(
                "architecture {text:?} is not one: write sm_80, 80 or 8.0 (the GPU's compute capability)"
            )),
        }
    }
}

/// The architectures CI compiles every kernel for, with NVRTC of both majors: each generation
/// from Ampere to Blackwell.
pub const LISTED_ARCHS: [Arch; 6] = [Arch(80), Arch(86), Arch(89), Arch(90), Arch(100), Arch(120)];

/// The environment variable that forces one form of the kernels (`cubin` or `ptx`).
pub const CODE_VARIABLE: &str = "HARVEST_CUDA_CODE";

/// The form the kernels reach the driver in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelCode {
    /// Machine code for the device's architecture, made by NVRTC.
    Cubin,
    /// PTX, compiled by the driver when the module loads.
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

    fn output(self) -> Output {
        match self {
            Self::Cubin => Output::Cubin,
            Self::Ptx => Output::Ptx,
        }
    }
}

/// What NVRTC compiles for a GPU of architecture `device`, given the architectures it supports:
/// a cubin for `device` itself where NVRTC knows it, and PTX for the newest architecture NVRTC
/// knows that is not newer than `device` (the driver compiles it on). `None` where NVRTC has
/// nothing for it.
pub fn target(code: KernelCode, device: Arch, supported: &[u32]) -> Option<Arch> {
    match code {
        KernelCode::Cubin => supported.contains(&device.0).then_some(device),
        KernelCode::Ptx => supported
            .iter()
            .copied()
            .filter(|&a| a <= device.0 && a >= Arch::OLDEST.0)
            .max()
            .map(Arch),
    }
}

/// The options of every compile: the target, and ptxas's report of each kernel's registers
/// and spills (it does not change the code).
fn options(code: KernelCode, target: Arch) -> Vec<String> {
    let arch = match code {
        KernelCode::Cubin => target.sm(),
        KernelCode::Ptx => target.compute(),
    };
    vec![
        format!("--gpu-architecture={arch}"),
        "--ptxas-options=-v".to_owned(),
    ]
}

/// The kernels compiled in one form for one architecture.
#[derive(Debug, Clone)]
pub struct KernelImage {
    /// The form.
    pub code: KernelCode,
    /// The architecture it was compiled for.
    pub target: Arch,
    /// The cubin, or the PTX text with its NUL.
    pub image: Vec<u8>,
    /// NVRTC's log (empty when the image came from the cache).
    pub log: String,
    /// Whether it came from the disk cache.
    pub cached: bool,
    /// Seconds NVRTC took (or the cache's read).
    pub seconds: f64,
    /// Its cache file, where a cache is kept.
    pub cache_file: Option<PathBuf>,
}

impl KernelImage {
    /// Every entry point of [`NAMES`] that the image lacks: none, for a whole image.
    pub fn missing_entry_points(&self) -> Vec<&'static str> {
        let text = String::from_utf8_lossy(&self.image);
        NAMES
            .iter()
            .copied()
            .filter(|name| match self.code {
                KernelCode::Ptx => !text.contains(&format!(".entry {name}(")),
                KernelCode::Cubin => !self.image.windows(name.len() + 2).any(|w| {
                    w[0] == 0 && &w[1..=name.len()] == name.as_bytes() && w[name.len() + 1] == 0
                }),
            })
            .collect()
    }

    /// The image as the driver loads it.
    pub fn module_image(&self) -> cudarc::nvrtc::Ptx {
        match self.code {
            KernelCode::Cubin => cudarc::nvrtc::Ptx::from_binary(self.image.clone()),
            KernelCode::Ptx => {
                let text = String::from_utf8_lossy(&self.image);
                cudarc::nvrtc::Ptx::from_src(text.trim_end_matches('\0'))
            }
        }
    }
}

/// Where compiled kernels are kept between starts; `main` configures it once ([`configure_cache`]).
static CACHE_DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
/// Whether the cache's first failure has been reported: later ones are not.
static CACHE_WARNED: OnceLock<()> = OnceLock::new();

/// Sets the folder compiled kernels are cached in (`None`: no cache). A second call is ignored.
pub fn configure_cache(dir: Option<PathBuf>) {
    let _ = CACHE_DIR.set(dir);
}

/// The disk cache of compiled kernels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelCache {
    /// Its folder; `None` keeps nothing.
    pub dir: Option<PathBuf>,
}

impl KernelCache {
    /// The cache `main` configured.
    pub fn configured() -> Self {
        Self {
            dir: CACHE_DIR.get().cloned().flatten(),
        }
    }

    /// The file name of the image of `code` for `target` by NVRTC `version`: the source's and
    /// options' digest, NVRTC's version and the architecture, so any change compiles anew.
    pub fn file_name(code: KernelCode, target: Arch, version: (i32, i32)) -> String {
        let mut digest = Sha256::new();
        digest.update(SOURCE.as_bytes());
        for option in options(code, target) {
            digest.update([0]);
            digest.update(option.as_bytes());
        }
        let digest = digest.finalize();
        let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        format!(
            "kernels-{hex}-nvrtc{}.{}-{}.{}",
            version.0,
            version.1,
            target.sm(),
            code.as_str()
        )
    }

    fn read(&self, name: &str) -> Option<(PathBuf, Vec<u8>)> {
        let path = self.dir.as_ref()?.join(name);
        std::fs::read(&path).ok().map(|bytes| (path, bytes))
    }

    /// Writes `bytes` as `name`, whole or not at all; a failure is reported once a process and
    /// otherwise ignored: the kernels still run, compiled anew at each start.
    fn write(&self, name: &str, bytes: &[u8]) -> Option<PathBuf> {
        let dir = self.dir.as_ref()?;
        let path = dir.join(name);
        let written = std::fs::create_dir_all(dir).and_then(|()| {
            let mut file = tempfile::NamedTempFile::new_in(dir)?;
            std::io::Write::write_all(&mut file, bytes)?;
            file.persist(&path).map_err(|e| e.error)?;
            Ok(())
        });
        match written {
            Ok(()) => Some(path),
            Err(error) => {
                if CACHE_WARNED.set(()).is_ok() {
                    tracing::warn!(
                        dir = %dir.display(),
                        %error,
                        "the compiled kernels cannot be cached here, so each start compiles them: set HARVEST_KERNEL_CACHE to a writable folder, or off"
                    );
                }
                None
            }
        }
    }

    /// Forgets the image cached as `path` (one the driver refused).
    pub fn forget(path: &Path) {
        let _ = std::fs::remove_file(path);
    }
}

/// The kernels in form `code` for a GPU of architecture `device`: from the cache, else compiled
/// by `nvrtc` and cached. [`CudaError::Compile`] when NVRTC has no target for the device or the
/// source does not compile.
pub fn build(
    nvrtc: &NvrtcApi,
    cache: &KernelCache,
    code: KernelCode,
    device: Arch,
) -> Result<KernelImage> {
    let version = nvrtc.version();
    let Some(target) = target(code, device, nvrtc.archs()) else {
        return Err(CudaError::Compile {
            log: format!(
                "NVRTC {}.{} cannot compile a {} for {device} (it knows {}): use the CUDA libraries of a newer release",
                version.0,
                version.1,
                code.as_str(),
                nvrtc
                    .archs()
                    .iter()
                    .map(|a| format!("sm_{a}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
        .into());
    };
    let name = KernelCache::file_name(code, target, version);
    let start = Instant::now();
    if let Some((path, image)) = cache.read(&name) {
        return Ok(KernelImage {
            code,
            target,
            image,
            log: String::new(),
            cached: true,
            seconds: start.elapsed().as_secs_f64(),
            cache_file: Some(path),
        });
    }
    let compiled = nvrtc
        .compile(SOURCE, "kernels.cu", &options(code, target), code.output())
        .map_err(|log| CudaError::Compile { log })?;
    let seconds = start.elapsed().as_secs_f64();
    let cache_file = cache.write(&name, &compiled.image);
    Ok(KernelImage {
        code,
        target,
        image: compiled.image,
        log: compiled.log,
        cached: false,
        seconds,
        cache_file,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn architectures_parse_from_each_spelling_and_a_bad_one_says_how_to_write_it() {
        for text in ["sm_86", "compute_86", "86", "8.6"] {
            assert_eq!(text.parse::<Arch>(), Ok(Arch(86)), "{text}");
        }
        assert_eq!("12.0".parse::<Arch>(), Ok(Arch(120)));
        assert_eq!(Arch::from_capability((10, 0)), Arch(100));
        let error = "hopper".parse::<Arch>().unwrap_err();
        assert!(
            error.contains("\"hopper\"") && error.contains("sm_80"),
            "{error}"
        );
        assert_eq!(Arch(89).capability(), "8.9");
    }

    #[test]
    fn a_cubin_targets_the_device_itself_and_ptx_the_newest_nvrtc_knows_below_it() {
        let nvrtc_12_4 = [75, 80, 86, 87, 89, 90];
        assert_eq!(
            target(KernelCode::Cubin, Arch(89), &nvrtc_12_4),
            Some(Arch(89))
        );
        assert_eq!(
            target(KernelCode::Ptx, Arch(89), &nvrtc_12_4),
            Some(Arch(89))
        );
        // A Blackwell GPU with an NVRTC that predates it: no cubin, Hopper's PTX for the driver.
        assert_eq!(target(KernelCode::Cubin, Arch(120), &nvrtc_12_4), None);
        assert_eq!(
            target(KernelCode::Ptx, Arch(120), &nvrtc_12_4),
            Some(Arch(90))
        );
        // Nothing below Ampere is a target.
        assert_eq!(target(KernelCode::Ptx, Arch(75), &nvrtc_12_4), None);
    }

    #[test]
    fn the_cache_name_changes_with_the_form_the_architecture_and_nvrtcs_version() {
        let base = KernelCache::file_name(KernelCode::Cubin, Arch(80), (13, 5));
        assert!(base.ends_with("-nvrtc13.5-sm_80.cubin"), "{base}");
        assert_ne!(
            base,
            KernelCache::file_name(KernelCode::Ptx, Arch(80), (13, 5))
        );
        assert_ne!(
            base,
            KernelCache::file_name(KernelCode::Cubin, Arch(86), (13, 5))
        );
        assert_ne!(
            base,
            KernelCache::file_name(KernelCode::Cubin, Arch(80), (12, 9))
        );
        assert_eq!(
            base,
            KernelCache::file_name(KernelCode::Cubin, Arch(80), (13, 5))
        );
    }

    #[test]
    fn a_cache_that_cannot_be_written_is_skipped_and_one_that_can_returns_what_it_kept() {
        let file = tempfile::NamedTempFile::new().unwrap();
        // A folder under a plain file cannot be made.
        let blocked = KernelCache {
            dir: Some(file.path().join("kernels")),
        };
        assert_eq!(blocked.write("x.cubin", b"image"), None);
        assert_eq!(blocked.read("x.cubin"), None);
        let dir = tempfile::tempdir().unwrap();
        let cache = KernelCache {
            dir: Some(dir.path().join("kernels")),
        };
        let path = cache.write("x.cubin", b"image").unwrap();
        assert_eq!(
            cache.read("x.cubin"),
            Some((path.clone(), b"image".to_vec()))
        );
        KernelCache::forget(&path);
        assert_eq!(cache.read("x.cubin"), None);
    }
}
