//! One library entry point resolved as a typed function pointer: what the cuBLAS and NVRTC
//! tables (`blas`, `nvrtc`) are made of.

/// Resolves `name` in `library` as a function pointer of type `T`.
///
/// # Safety
/// `T` must be the function's type as its library declares it.
#[allow(unsafe_code)]
pub(super) unsafe fn entry_point<T: Copy>(
    library: &libloading::Library,
    name: &str,
) -> Result<T, String> {
    // SAFETY: the caller gives the declared type; the pointer is copied out and used only
    // while the library stays loaded (it is kept with the pointer).
    unsafe { library.get::<T>(name) }
        .map(|symbol| *symbol)
        .map_err(|e| {
            format!("entry point {name} is missing ({e}): the library is too old or not NVIDIA's")
        })
}
