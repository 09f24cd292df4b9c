//! `harvester cuda-info`: what the CUDA backend finds on this machine, as the GPU window's first
//! step records it: the driver's version, the device, which cuBLAS and NVRTC were loaded, from
//! where and why, the libraries the process mapped (from `/proc/self/maps`, so two CUDA installs
//! mixed show), and whether each form of the kernels builds (from the cache or NVRTC), loads
//! and runs. With `--compile-only` it needs no GPU: every kernel compiled for the architectures
//! asked, each entry point checked in both forms, and the attention kernels' registers and
//! spills.

use std::time::Instant;

use cudarc::driver::CudaContext;
use serde::Serialize;

use super::error::CudaError;
use super::kernels::{self, Arch, KernelCache, KernelCode};
use super::launch;
use super::libraries::{self, LibraryReport, Purpose};
use super::nvrtc::{self, KernelResources};
use crate::error::Result;

/// What the CUDA backend found.
#[derive(Debug, Clone, Serialize)]
pub struct CudaInfo {
    /// The CUDA version the driver supports.
    pub driver_cuda: Option<String>,
    /// The cuBLAS and NVRTC loaded, from where, and why.
    pub libraries: LibraryReport,
    /// The device's name.
    pub device: String,
    /// Its compute capability.
    pub compute_capability: String,
    /// The architecture the kernels are compiled for: the device's own.
    pub arch: Arch,
    /// Device memory, bytes.
    pub total_bytes: u64,
    /// Free device memory, bytes.
    pub free_bytes: u64,
    /// Each form of the kernels.
    pub kernels: Vec<KernelForm>,
    /// Whether a cuBLAS handle opened, or why not.
    pub cublas: std::result::Result<(), String>,
    /// The CUDA libraries this process loaded, with their paths.
    pub loaded_libraries: Vec<String>,
}

/// One form of the kernels: how far it got.
#[derive(Debug, Clone, Serialize)]
pub struct KernelForm {
    /// `cubin` or `ptx`.
    pub code: &'static str,
    /// The architecture it was compiled for.
    pub target: Option<Arch>,
    /// Bytes of the compiled image.
    pub bytes: usize,
    /// Whether it came from the disk cache (then `compile_seconds` is the read's).
    pub cached: bool,
    /// Its cache file, where the cache is kept.
    pub cache_file: Option<std::path::PathBuf>,
    /// Seconds NVRTC took.
    pub compile_seconds: f64,
    /// Seconds the driver took to load the module.
    pub load_seconds: f64,
    /// Whether a kernel of it ran and wrote what it should.
    pub ran: bool,
    /// The first failure, if any.
    pub error: Option<String>,
}

/// The CUDA libraries mapped into this process, one path each.
pub fn loaded_libraries() -> Vec<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut paths: Vec<String> = maps
        .lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .filter(|path| {
            ["libcuda", "libcublas", "libnvrtc", "libnvJitLink"]
                .iter()
                .any(|name| path.contains(name))
        })
        .map(str::to_owned)
        .collect();
    paths.sort();
    paths.dedup();
    paths
}

/// Builds (from the cache, or NVRTC), loads and runs one form of the kernels on `context`.
fn try_form(
    context: &std::sync::Arc<CudaContext>,
    nvrtc: &nvrtc::NvrtcApi,
    device: Arch,
    code: KernelCode,
) -> KernelForm {
    let mut form = KernelForm {
        code: code.as_str(),
        target: None,
        bytes: 0,
        cached: false,
        cache_file: None,
        compile_seconds: 0.0,
        load_seconds: 0.0,
        ran: false,
        error: None,
    };
    let image = match kernels::build(nvrtc, &KernelCache::configured(), code, device) {
        Ok(image) => image,
        Err(e) => {
            form.error = Some(e.to_string());
            return form;
        }
    };
    form.target = Some(image.target);
    form.bytes = image.image.len();
    form.cached = image.cached;
    form.cache_file.clone_from(&image.cache_file);
    form.compile_seconds = image.seconds;
    let start = Instant::now();
    let module = match context.load_module(image.module_image()) {
        Ok(module) => module,
        Err(e) => {
            form.error = Some(format!("module load: {e}"));
            return form;
        }
    };
    form.load_seconds = start.elapsed().as_secs_f64();
    match smoke(context, &module) {
        Ok(ran) => form.ran = ran,
        Err(e) => form.error = Some(e.to_string()),
    }
    form
}

/// Runs `embed_gather` on a 3-row table and checks the rows it gathered.
fn smoke(
    context: &std::sync::Arc<CudaContext>,
    module: &std::sync::Arc<cudarc::driver::CudaModule>,
) -> Result<bool> {
    let fault = |action| move |e| CudaError::from_driver(action, e);
    let stream = context.default_stream();
    let kernel = module
        .load_function("embed_gather")
        .map_err(fault("finding embed_gather"))?;
    let hidden = 40;
    let table: Vec<u16> = (0..3 * hidden)
        .map(|i| half::bf16::from_f32(i as f32).to_bits())
        .collect();
    let table = stream.clone_htod(&table).map_err(fault("uploading"))?;
    let ids = stream.clone_htod(&[2u32, 0]).map_err(fault("uploading"))?;
    let mut x = stream
        .alloc_zeros::<f32>(2 * hidden)
        .map_err(fault("allocating"))?;
    launch::embed_gather(&stream, &kernel, &table, &ids, &mut x, (2, hidden, 1.0))?;
    let x = stream
        .clone_dtoh(&x)
        .map_err(fault("running embed_gather"))?;
    Ok((0..hidden).all(|i| x[i] == (2 * hidden + i) as f32 && x[hidden + i] == i as f32))
}

/// Probes GPU `ordinal` and tries every form of the kernels on it.
pub fn report(ordinal: usize) -> Result<CudaInfo> {
    let gpu = super::probe(ordinal)?;
    let loaded = libraries::loaded(Purpose::Run)?;
    let context = CudaContext::new(ordinal).map_err(CudaError::unavailable)?;
    let (free, total) = context.mem_get_info().map_err(CudaError::unavailable)?;
    let kernels = [KernelCode::Cubin, KernelCode::Ptx]
        .into_iter()
        .map(|code| try_form(&context, &loaded.nvrtc.api, gpu.arch, code))
        .collect();
    Ok(CudaInfo {
        driver_cuda: super::driver_version(),
        libraries: loaded.report(),
        device: gpu.name,
        compute_capability: gpu.arch.capability(),
        arch: gpu.arch,
        total_bytes: total as u64,
        free_bytes: free as u64,
        kernels,
        cublas: libraries::cublas()
            .and_then(|api| super::blas::Blas::new(api, context.default_stream()))
            .map(drop)
            .map_err(|e| e.to_string()),
        loaded_libraries: loaded_libraries(),
    })
}

/// `cuda-info --compile-only`: NVRTC's report for each architecture asked, without a GPU.
#[derive(Debug, Clone, Serialize)]
pub struct CompileReport {
    /// The NVRTC loaded, from where, and why.
    pub libraries: LibraryReport,
    /// The architectures this NVRTC compiles for.
    pub nvrtc_archs: Vec<Arch>,
    /// One entry an architecture asked.
    pub archs: Vec<ArchReport>,
}

impl CompileReport {
    /// Whether every architecture compiled in every form with every entry point.
    pub fn succeeded(&self) -> bool {
        self.archs
            .iter()
            .all(|arch| arch.forms.iter().all(|form| form.error.is_none()))
    }
}

/// The kernels compiled for one architecture.
#[derive(Debug, Clone, Serialize)]
pub struct ArchReport {
    /// The architecture asked.
    pub arch: Arch,
    /// The GPUs of it.
    pub gpus: &'static str,
    /// Each form.
    pub forms: Vec<CompiledForm>,
    /// The attention kernels' registers, spills and shared memory, from ptxas (the cubin's
    /// compile; empty when it came from the cache).
    pub attention: Vec<KernelResources>,
}

/// One form compiled for one architecture.
#[derive(Debug, Clone, Serialize)]
pub struct CompiledForm {
    /// `cubin` or `ptx`.
    pub code: &'static str,
    /// The architecture it was compiled for.
    pub target: Option<Arch>,
    /// Bytes of the image.
    pub bytes: usize,
    /// Entry points found in it, of [`kernels::NAMES`].
    pub entry_points: usize,
    /// Whether it came from the disk cache.
    pub cached: bool,
    /// Seconds NVRTC (or the cache) took.
    pub seconds: f64,
    /// What went wrong, if anything.
    pub error: Option<String>,
}

/// Compiles every kernel for each of `archs` in both forms with the NVRTC the search finds
/// (of CUDA `major` where the search pins one), never from the cache, checking each image for
/// every entry point. Needs no GPU.
pub fn compile_report(archs: &[Arch]) -> Result<CompileReport> {
    let loaded = libraries::loaded(Purpose::Compile)?;
    let nvrtc = &loaded.nvrtc.api;
    // A check compiles every time, so ptxas reports each kernel.
    let cache = KernelCache { dir: None };
    let archs = archs
        .iter()
        .map(|&arch| {
            let mut attention = Vec::new();
            let forms = [KernelCode::Cubin, KernelCode::Ptx]
                .into_iter()
                .map(|code| {
                    // A report compiles exactly for the architecture asked: no PTX of an
                    // older one stands in.
                    if kernels::target(code, arch, nvrtc.archs()) != Some(arch) {
                        let (major, minor) = nvrtc.version();
                        return CompiledForm {
                            code: code.as_str(),
                            target: None,
                            bytes: 0,
                            entry_points: 0,
                            cached: false,
                            seconds: 0.0,
                            error: Some(format!(
                                "NVRTC {major}.{minor} does not compile for {arch}"
                            )),
                        };
                    }
                    match kernels::build(nvrtc, &cache, code, arch) {
                        Ok(image) => {
                            let missing = image.missing_entry_points();
                            if code == KernelCode::Cubin {
                                attention = nvrtc::kernel_resources(&image.log)
                                    .into_iter()
                                    .filter(|k| k.kernel.starts_with("attention"))
                                    .collect();
                            }
                            CompiledForm {
                                code: code.as_str(),
                                target: Some(image.target),
                                bytes: image.image.len(),
                                entry_points: kernels::NAMES.len() - missing.len(),
                                cached: image.cached,
                                seconds: image.seconds,
                                error: (!missing.is_empty()).then(|| {
                                    format!("missing entry points: {}", missing.join(", "))
                                }),
                            }
                        }
                        Err(e) => CompiledForm {
                            code: code.as_str(),
                            target: Some(arch),
                            bytes: 0,
                            entry_points: 0,
                            cached: false,
                            seconds: 0.0,
                            error: Some(e.to_string()),
                        },
                    }
                })
                .collect();
            ArchReport {
                arch,
                gpus: arch.gpus(),
                forms,
                attention,
            }
        })
        .collect();
    Ok(CompileReport {
        libraries: loaded.report(),
        nvrtc_archs: nvrtc.archs().iter().map(|&a| Arch(a)).collect(),
        archs,
    })
}
