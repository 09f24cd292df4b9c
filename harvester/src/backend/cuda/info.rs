//! `harvester cuda-info`: what the CUDA backend finds on this machine, as the GPU window's first
//! step records it: the driver's and NVRTC's versions, the device, the libraries the process
//! loaded (from `/proc/self/maps`, so two CUDA installs mixed show), and whether each form of
//! the kernels compiles, loads and runs.

use std::time::Instant;

use cudarc::driver::CudaContext;
use serde::Serialize;

use super::error::CudaError;
use super::kernels::{self, KernelCode};
use super::launch;
use crate::error::Result;

/// What the CUDA backend found.
#[derive(Debug, Clone, Serialize)]
pub struct CudaInfo {
    /// The CUDA version the driver supports.
    pub driver_cuda: Option<String>,
    /// NVRTC's version, or why it did not load.
    pub nvrtc: String,
    /// The device's name.
    pub device: String,
    /// Its compute capability.
    pub compute_capability: String,
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
    /// Bytes of the compiled image.
    pub bytes: usize,
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

/// Compiles, loads and runs one form of the kernels on `context`.
fn try_form(context: &std::sync::Arc<CudaContext>, code: KernelCode) -> KernelForm {
    let mut form = KernelForm {
        code: code.as_str(),
        bytes: 0,
        compile_seconds: 0.0,
        load_seconds: 0.0,
        ran: false,
        error: None,
    };
    let start = Instant::now();
    let image = match code {
        KernelCode::Cubin => kernels::compile_cubin().map(|bytes| {
            form.bytes = bytes.len();
            cudarc::nvrtc::Ptx::from_binary(bytes)
        }),
        KernelCode::Ptx => kernels::compile(code).inspect(|ptx| form.bytes = ptx.to_src().len()),
    };
    form.compile_seconds = start.elapsed().as_secs_f64();
    let image = match image {
        Ok(image) => image,
        Err(e) => {
            form.error = Some(e.to_string());
            return form;
        }
    };
    let start = Instant::now();
    let module = match context.load_module(image) {
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
    super::probe(ordinal)?;
    let context = CudaContext::new(ordinal).map_err(CudaError::unavailable)?;
    let nvrtc = kernels::nvrtc_version().map_or_else(
        |e| e.to_string(),
        |(major, minor)| format!("{major}.{minor}"),
    );
    let (free, total) = context.mem_get_info().map_err(CudaError::unavailable)?;
    let (major, minor) = context
        .compute_capability()
        .map_err(CudaError::unavailable)?;
    let kernels = [KernelCode::Cubin, KernelCode::Ptx]
        .into_iter()
        .map(|code| try_form(&context, code))
        .collect();
    let cublas = cudarc::cublas::CudaBlas::new(context.default_stream())
        .map(drop)
        .map_err(|e| e.to_string());
    Ok(CudaInfo {
        driver_cuda: super::driver_version(),
        nvrtc,
        device: context.name().map_err(CudaError::unavailable)?,
        compute_capability: format!("{major}.{minor}"),
        total_bytes: total as u64,
        free_bytes: free as u64,
        kernels,
        cublas,
        loaded_libraries: loaded_libraries(),
    })
}
