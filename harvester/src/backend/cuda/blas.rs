//! cuBLAS as the backend uses it: the few entry points it resolves in the library
//! [`super::libraries`] chose ([`CUBLAS_ENTRY_POINTS`], the same in CUDA 12 and 13), and a
//! handle bound to one stream that runs `cublasGemmEx`.

use std::ffi::{c_char, c_int, c_void};
use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::error::CudaError;
use super::symbols::entry_point;
use crate::error::Result;

/// `cudaDataType`: an element type of a GEMM's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub struct DataType(c_int);

impl DataType {
    /// f32.
    pub const R_32F: Self = Self(0);
    /// bf16.
    pub const R_16BF: Self = Self(14);
}

/// `cublasComputeType_t`: how a GEMM sums.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub struct ComputeType(c_int);

impl ComputeType {
    /// f32 sums; cuBLAS may use TF32 for f32 inputs.
    pub const F32: Self = Self(68);
    /// f32 sums, never TF32 (the f32 mode and AFMoE's router).
    pub const F32_PEDANTIC: Self = Self(69);
}

type Handle = *mut c_void;
type Status = c_int;
const SUCCESS: Status = 0;
/// `cublasOperation_t`.
const OP_N: c_int = 0;
const OP_T: c_int = 1;
/// `CUBLAS_GEMM_DEFAULT`.
const GEMM_DEFAULT: c_int = -1;
/// `libraryPropertyType`.
const MAJOR_VERSION: c_int = 0;
const MINOR_VERSION: c_int = 1;
const PATCH_LEVEL: c_int = 2;

type Create = unsafe extern "C" fn(*mut Handle) -> Status;
type Destroy = unsafe extern "C" fn(Handle) -> Status;
type SetStream = unsafe extern "C" fn(Handle, cudarc::driver::sys::CUstream) -> Status;
type GemmEx = unsafe extern "C" fn(
    Handle,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    *const c_void,
    *const c_void,
    DataType,
    c_int,
    *const c_void,
    DataType,
    c_int,
    *const c_void,
    *mut c_void,
    DataType,
    c_int,
    ComputeType,
    c_int,
) -> Status;
type GetProperty = unsafe extern "C" fn(c_int, *mut c_int) -> Status;
type StatusString = unsafe extern "C" fn(Status) -> *const c_char;

const CREATE: &str = "cublasCreate_v2";
const DESTROY: &str = "cublasDestroy_v2";
const SET_STREAM: &str = "cublasSetStream_v2";
const GEMM_EX: &str = "cublasGemmEx";
const GET_PROPERTY: &str = "cublasGetProperty";
const STATUS_STRING: &str = "cublasGetStatusString";

/// Every cuBLAS entry point the harvester resolves: the load-and-resolve test checks each in
/// CUDA 12's and 13's libraries.
pub const CUBLAS_ENTRY_POINTS: [&str; 6] = [
    CREATE,
    DESTROY,
    SET_STREAM,
    GEMM_EX,
    GET_PROPERTY,
    STATUS_STRING,
];

/// cuBLAS's entry points, resolved.
#[derive(Debug)]
pub struct CublasApi {
    create: Create,
    destroy: Destroy,
    set_stream: SetStream,
    gemm_ex: GemmEx,
    status_string: StatusString,
}

impl CublasApi {
    /// Resolves every entry point in `library`, with its version (`major.minor.patch`).
    pub fn resolve(library: &libloading::Library) -> std::result::Result<(Self, String), String> {
        // SAFETY: each type is the function's declaration in cublas_api.h, the same in CUDA 12
        // and 13; `libraries` keeps the library loaded with these pointers.
        #[allow(unsafe_code)]
        let (api, get_property) = unsafe {
            (
                Self {
                    create: entry_point(library, CREATE)?,
                    destroy: entry_point(library, DESTROY)?,
                    set_stream: entry_point(library, SET_STREAM)?,
                    gemm_ex: entry_point(library, GEMM_EX)?,
                    status_string: entry_point(library, STATUS_STRING)?,
                },
                entry_point::<GetProperty>(library, GET_PROPERTY)?,
            )
        };
        let property = |which| {
            let mut value: c_int = 0;
            // SAFETY: the pointer is to a live local; the call needs no handle or device.
            #[allow(unsafe_code)]
            let status = unsafe { get_property(which, &raw mut value) };
            (status == SUCCESS).then_some(value)
        };
        let version = match (
            property(MAJOR_VERSION),
            property(MINOR_VERSION),
            property(PATCH_LEVEL),
        ) {
            (Some(major), Some(minor), Some(patch)) => format!("{major}.{minor}.{patch}"),
            _ => "unknown".to_owned(),
        };
        Ok((api, version))
    }

    /// cuBLAS's name for `status`.
    fn describe(&self, status: Status) -> String {
        // SAFETY: cuBLAS returns a static string for any status value, or null.
        #[allow(unsafe_code)]
        let text = unsafe { (self.status_string)(status) };
        if text.is_null() {
            return format!("cuBLAS status {status}");
        }
        // SAFETY: non-null, and a NUL-terminated static string (above).
        #[allow(unsafe_code)]
        let text = unsafe { std::ffi::CStr::from_ptr(text) };
        format!("{} ({status})", text.to_string_lossy())
    }
}

/// A cuBLAS handle whose work goes on one stream.
#[derive(Debug)]
pub struct Blas {
    handle: Handle,
    api: &'static CublasApi,
    /// The stream it runs on, kept alive as long as the handle.
    _stream: Arc<CudaStream>,
}

impl Blas {
    /// A handle of cuBLAS `api` on `stream`'s context, its work on `stream`.
    pub fn new(api: &'static CublasApi, stream: Arc<CudaStream>) -> Result<Self> {
        stream
            .context()
            .bind_to_thread()
            .map_err(CudaError::unavailable)?;
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: the pointer is to a live local, which cuBLAS fills.
        #[allow(unsafe_code)]
        let status = unsafe { (api.create)(&raw mut handle) };
        if status != SUCCESS {
            return Err(CudaError::Unavailable {
                reason: format!("cuBLAS did not start: {}", api.describe(status)),
            }
            .into());
        }
        let blas = Self {
            handle,
            api,
            _stream: Arc::clone(&stream),
        };
        // SAFETY: `handle` was just created; `stream` is live on its context and outlives the
        // handle (kept above).
        #[allow(unsafe_code)]
        let status = unsafe { (api.set_stream)(blas.handle, stream.cu_stream()) };
        if status != SUCCESS {
            return Err(CudaError::Unavailable {
                reason: format!("cuBLAS refused the stream: {}", api.describe(status)),
            }
            .into());
        }
        Ok(blas)
    }

    /// `c = w · a` in cuBLAS's column-major terms with `w` transposed: `c[n, m]` (column
    /// major) from `w[k, m]ᵀ` and `a[k, n]`, each `ld` its leading dimension.
    ///
    /// # Safety
    /// The pointers are device buffers on the handle's context with at least `k·m`, `k·n` and
    /// `m·n` elements of the types `types` names; `alpha` and `beta` are f32.
    #[allow(unsafe_code, clippy::too_many_arguments)]
    pub unsafe fn gemm_tn(
        &self,
        (m, n, k): (c_int, c_int, c_int),
        (w, a, c): (*const c_void, *const c_void, *mut c_void),
        (inputs, output, compute): (DataType, DataType, ComputeType),
        (alpha, beta): (f32, f32),
    ) -> std::result::Result<(), String> {
        // SAFETY: the caller's contract above; alpha and beta are live locals for the call,
        // which only enqueues work on the handle's stream.
        let status = unsafe {
            (self.api.gemm_ex)(
                self.handle,
                OP_T,
                OP_N,
                m,
                n,
                k,
                (&raw const alpha).cast(),
                w,
                inputs,
                k,
                a,
                inputs,
                k,
                (&raw const beta).cast(),
                c,
                output,
                m,
                compute,
                GEMM_DEFAULT,
            )
        };
        if status == SUCCESS {
            Ok(())
        } else {
            Err(self.api.describe(status))
        }
    }
}

// SAFETY: a cuBLAS handle may be used from any host thread, one at a time; `&mut`-free calls
// through a shared `Blas` happen on the thread that owns the backend (its ops borrow it there).
#[allow(unsafe_code)]
unsafe impl Send for Blas {}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `new` and is destroyed once, here. A failure here
        // leaks the handle and nothing else, so it is not reported.
        #[allow(unsafe_code)]
        let _ = unsafe { (self.api.destroy)(self.handle) };
    }
}
