//! NVRTC as the backend uses it: the entry points it resolves in the library
//! [`super::libraries`] chose ([`NVRTC_ENTRY_POINTS`], the same in CUDA 12 and 13), the
//! architectures that NVRTC compiles for, and one compile of a source into a cubin or PTX with
//! ptxas's report of each kernel's registers and spills.

use std::ffi::{CString, c_char, c_int, c_void};

type Program = *mut c_void;
type Status = c_int;
const SUCCESS: Status = 0;

type Version = unsafe extern "C" fn(*mut c_int, *mut c_int) -> Status;
type NumArchs = unsafe extern "C" fn(*mut c_int) -> Status;
type Archs = unsafe extern "C" fn(*mut c_int) -> Status;
type Create = unsafe extern "C" fn(
    *mut Program,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> Status;
type Compile = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> Status;
type Size = unsafe extern "C" fn(Program, *mut usize) -> Status;
type Fill = unsafe extern "C" fn(Program, *mut c_char) -> Status;
type Destroy = unsafe extern "C" fn(*mut Program) -> Status;
type ErrorString = unsafe extern "C" fn(Status) -> *const c_char;

const VERSION: &str = "nvrtcVersion";
const NUM_ARCHS: &str = "nvrtcGetNumSupportedArchs";
const ARCHS: &str = "nvrtcGetSupportedArchs";
const CREATE: &str = "nvrtcCreateProgram";
const COMPILE: &str = "nvrtcCompileProgram";
const LOG_SIZE: &str = "nvrtcGetProgramLogSize";
const LOG: &str = "nvrtcGetProgramLog";
const CUBIN_SIZE: &str = "nvrtcGetCUBINSize";
const CUBIN: &str = "nvrtcGetCUBIN";
const PTX_SIZE: &str = "nvrtcGetPTXSize";
const PTX: &str = "nvrtcGetPTX";
const DESTROY: &str = "nvrtcDestroyProgram";
const ERROR_STRING: &str = "nvrtcGetErrorString";

/// Every NVRTC entry point the harvester resolves: the load-and-resolve test checks each in
/// CUDA 12's and 13's libraries.
pub const NVRTC_ENTRY_POINTS: [&str; 13] = [
    VERSION,
    NUM_ARCHS,
    ARCHS,
    CREATE,
    COMPILE,
    LOG_SIZE,
    LOG,
    CUBIN_SIZE,
    CUBIN,
    PTX_SIZE,
    PTX,
    DESTROY,
    ERROR_STRING,
];

/// NVRTC's entry points, resolved.
#[derive(Debug)]
pub struct NvrtcApi {
    version: (i32, i32),
    archs: Vec<u32>,
    create: Create,
    compile: Compile,
    log_size: Size,
    log: Fill,
    cubin_size: Size,
    cubin: Fill,
    ptx_size: Size,
    ptx: Fill,
    destroy: Destroy,
    error_string: ErrorString,
}

/// What NVRTC makes of a source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// Machine code (`--gpu-architecture=sm_XY`).
    Cubin,
    /// PTX (`--gpu-architecture=compute_XY`), compiled by the driver when it loads.
    Ptx,
}

/// One compile's image and NVRTC's log (with ptxas's report, for a cubin).
#[derive(Debug, Clone)]
pub struct Compiled {
    /// The cubin, or the PTX text.
    pub image: Vec<u8>,
    /// NVRTC's log.
    pub log: String,
}

impl NvrtcApi {
    /// Resolves every entry point in `library`, with its version (`major.minor`).
    pub fn resolve(library: &libloading::Library) -> Result<(Self, String), String> {
        use super::symbols::entry_point;
        // SAFETY: each type is the function's declaration in nvrtc.h, the same in CUDA 12 and
        // 13; `libraries` keeps the library loaded with these pointers.
        #[allow(unsafe_code)]
        let (version, num_archs, archs, api) = unsafe {
            (
                entry_point::<Version>(library, VERSION)?,
                entry_point::<NumArchs>(library, NUM_ARCHS)?,
                entry_point::<Archs>(library, ARCHS)?,
                Self {
                    version: (0, 0),
                    archs: Vec::new(),
                    create: entry_point(library, CREATE)?,
                    compile: entry_point(library, COMPILE)?,
                    log_size: entry_point(library, LOG_SIZE)?,
                    log: entry_point(library, LOG)?,
                    cubin_size: entry_point(library, CUBIN_SIZE)?,
                    cubin: entry_point(library, CUBIN)?,
                    ptx_size: entry_point(library, PTX_SIZE)?,
                    ptx: entry_point(library, PTX)?,
                    destroy: entry_point(library, DESTROY)?,
                    error_string: entry_point(library, ERROR_STRING)?,
                },
            )
        };
        let (mut major, mut minor, mut count): (c_int, c_int, c_int) = (0, 0, 0);
        // SAFETY: the pointers are to live locals.
        #[allow(unsafe_code)]
        let status = unsafe { version(&raw mut major, &raw mut minor) };
        api.check(status, VERSION)?;
        // SAFETY: the pointer is to a live local.
        #[allow(unsafe_code)]
        let status = unsafe { num_archs(&raw mut count) };
        api.check(status, NUM_ARCHS)?;
        let mut listed = vec![0 as c_int; usize::try_from(count).unwrap_or(0)];
        // SAFETY: `listed` has the room for `count` entries NVRTC said it writes.
        #[allow(unsafe_code)]
        let status = unsafe { archs(listed.as_mut_ptr()) };
        api.check(status, ARCHS)?;
        let api = Self {
            version: (major, minor),
            archs: listed
                .into_iter()
                .filter_map(|a| u32::try_from(a).ok())
                .collect(),
            ..api
        };
        Ok((api, format!("{major}.{minor}")))
    }

    /// Its version, `(major, minor)`.
    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    /// The architectures it compiles for, as `XY` of `sm_XY`, ascending.
    pub fn archs(&self) -> &[u32] {
        &self.archs
    }

    fn check(&self, status: Status, call: &str) -> Result<(), String> {
        if status == SUCCESS {
            return Ok(());
        }
        // SAFETY: NVRTC returns a static string for any status value, or null.
        #[allow(unsafe_code)]
        let text = unsafe { (self.error_string)(status) };
        let name = if text.is_null() {
            format!("status {status}")
        } else {
            // SAFETY: non-null, and a NUL-terminated static string (above).
            #[allow(unsafe_code)]
            let text = unsafe { std::ffi::CStr::from_ptr(text) };
            text.to_string_lossy().into_owned()
        };
        Err(format!("{call}: {name}"))
    }

    /// Compiles `source` (named `name` in messages) with `options` into `output`. A source
    /// that does not compile is an error with NVRTC's log.
    pub fn compile(
        &self,
        source: &str,
        name: &str,
        options: &[String],
        output: Output,
    ) -> Result<Compiled, String> {
        let source = CString::new(source).map_err(|e| e.to_string())?;
        let name = CString::new(name).map_err(|e| e.to_string())?;
        let options: Vec<CString> = options
            .iter()
            .map(|o| CString::new(o.as_str()).map_err(|e| e.to_string()))
            .collect::<Result<_, _>>()?;
        let pointers: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
        let count = c_int::try_from(pointers.len()).map_err(|e| e.to_string())?;
        let mut program: Program = std::ptr::null_mut();
        // SAFETY: the strings are NUL-terminated and outlive the call; no headers are given.
        #[allow(unsafe_code)]
        let status = unsafe {
            (self.create)(
                &raw mut program,
                source.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        self.check(status, CREATE)?;
        let program = ProgramGuard { api: self, program };
        // SAFETY: `program` is live; `pointers` holds `count` NUL-terminated options that
        // outlive the call.
        #[allow(unsafe_code)]
        let status = unsafe { (self.compile)(program.program, count, pointers.as_ptr()) };
        let log = program.read(self.log_size, self.log).map_or_else(
            |e| format!("(no log: {e})"),
            |bytes| {
                String::from_utf8_lossy(&bytes)
                    .trim_end_matches('\0')
                    .to_owned()
            },
        );
        self.check(status, COMPILE)
            .map_err(|e| format!("{e}\n{log}"))?;
        let image = match output {
            Output::Cubin => program.read(self.cubin_size, self.cubin)?,
            Output::Ptx => {
                let mut ptx = program.read(self.ptx_size, self.ptx)?;
                // The driver reads PTX up to its NUL; keep one at the end.
                if ptx.last() != Some(&0) {
                    ptx.push(0);
                }
                ptx
            }
        };
        Ok(Compiled { image, log })
    }
}

/// A live program, destroyed on drop.
struct ProgramGuard<'a> {
    api: &'a NvrtcApi,
    program: Program,
}

impl ProgramGuard<'_> {
    /// One of the program's outputs, of the size `size` reports, filled by `fill`.
    fn read(&self, size: Size, fill: Fill) -> Result<Vec<u8>, String> {
        let mut bytes = 0usize;
        // SAFETY: the program is live; the pointer is to a live local.
        #[allow(unsafe_code)]
        let status = unsafe { size(self.program, &raw mut bytes) };
        self.api.check(status, "reading an output's size")?;
        let mut buffer = vec![0u8; bytes];
        // SAFETY: `buffer` holds the `bytes` NVRTC said it writes.
        #[allow(unsafe_code)]
        let status = unsafe { fill(self.program, buffer.as_mut_ptr().cast::<c_char>()) };
        self.api.check(status, "reading an output")?;
        Ok(buffer)
    }
}

impl Drop for ProgramGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: the program is live and destroyed once, here; a failure leaks it only.
        #[allow(unsafe_code)]
        let _ = unsafe { (self.api.destroy)(&raw mut self.program) };
    }
}

/// One kernel's resources as ptxas reports them in a cubin's compile log (`-Xptxas -v`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct KernelResources {
    /// The entry point.
    pub kernel: String,
    /// Registers a thread.
    pub registers: u32,
    /// Bytes of spill stores.
    pub spill_stores: u32,
    /// Bytes of spill loads.
    pub spill_loads: u32,
    /// Bytes of static shared memory a block.
    pub shared_bytes: u32,
}

/// Each kernel's resources from ptxas's verbose log, in the log's order.
pub fn kernel_resources(log: &str) -> Vec<KernelResources> {
    let number_before = |line: &str, unit: &str| -> Option<u32> {
        let end = line.find(unit)?;
        line[..end].split_whitespace().last()?.parse().ok()
    };
    let mut kernels: Vec<KernelResources> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default();
            kernels.push(KernelResources {
                kernel: name.to_owned(),
                registers: 0,
                spill_stores: 0,
                spill_loads: 0,
                shared_bytes: 0,
            });
        } else if let Some(kernel) = kernels.last_mut() {
            if line.contains("spill stores") {
                kernel.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
                kernel.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
            }
            if line.contains("Used") && line.contains("registers") {
                kernel.registers = number_before(line, "registers").unwrap_or(0);
                kernel.shared_bytes = number_before(line, "bytes smem").unwrap_or(0);
            }
        }
    }
    kernels
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptxas_reports_read_as_each_kernels_registers_spills_and_shared_memory() {
        let log = "ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'attention_mma_128' for 'sm_80'
ptxas info    : Function properties for attention_mma_128
ptxas         .     0 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 176 registers, used 1 barriers, 34816 bytes smem, 400 bytes cmem[0]
ptxas info    : Compile time = 202.431 ms
ptxas info    : Compiling entry function 'project' for 'sm_80'
ptxas info    : Function properties for project
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 31 registers, used 0 barriers, 384 bytes cmem[0]
";
        let kernels = kernel_resources(log);
        assert_eq!(
            kernels[0],
            KernelResources {
                kernel: "attention_mma_128".into(),
                registers: 176,
                spill_stores: 8,
                spill_loads: 12,
                shared_bytes: 34816,
            }
        );
        assert_eq!(
            (
                kernels[1].kernel.as_str(),
                kernels[1].registers,
                kernels[1].shared_bytes
            ),
            ("project", 31, 0)
        );
    }
}
