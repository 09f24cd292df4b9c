//! Which cuBLAS and NVRTC the CUDA backend loads, from where, and why.
//!
//! A driver of the CUDA 13 line (580 and newer) runs CUDA 13's libraries and CUDA 12's; a
//! driver of the 12 line (535 to 575) only CUDA 12's. So the backend takes the newest major
//! version the driver supports whose cuBLAS and NVRTC are both found ([`choose`], a pure
//! function), looks for them in the folders [`LibrarySearch`] lists (NVIDIA's Python wheels,
//! a CUDA toolkit, `LD_LIBRARY_PATH`), then through the system's loader, and loads each by
//! its full path, so that the two always come from one CUDA release and never from another
//! that happens to be first on the loader's path. The driver library itself (`libcuda.so.1`)
//! is the system's own: cudarc loads it, with the bindings of CUDA 12.2, the oldest driver
//! supported, whose every entry point newer drivers keep.
//!
//! What was loaded is process-wide ([`loaded`]): the libraries stay mapped until the process
//! ends.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde::Serialize;

use super::blas::CublasApi;
use super::error::CudaError;
use super::nvrtc::NvrtcApi;
use crate::error::Result;

/// A CUDA version, as the driver reports the newest it supports, or as a library's major.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct CudaVersion {
    /// The major version: 12 or 13.
    pub major: u32,
    /// The minor version.
    pub minor: u32,
}

impl CudaVersion {
    /// The version `cuDriverGetVersion` encodes as `1000 * major + 10 * minor`.
    pub fn from_driver(code: i32) -> Self {
        let code = u32::try_from(code).unwrap_or(0);
        Self {
            major: code / 1000,
            minor: code % 1000 / 10,
        }
    }
}

impl std::fmt::Display for CudaVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// The oldest driver the harvester runs on: CUDA 12.2 (driver 535), whose entry points are the
/// bindings' ([`super`]).
pub const OLDEST_DRIVER: CudaVersion = CudaVersion {
    major: 12,
    minor: 2,
};

/// The CUDA major versions whose libraries the harvester loads, newest first.
pub const MAJORS: [u32; 2] = [13, 12];

/// The oldest NVIDIA driver of each supported CUDA major: what a refusal tells a user to
/// install.
pub fn oldest_driver_of(major: u32) -> &'static str {
    match major {
        13 => "580",
        _ => "535",
    }
}

/// One of the two libraries the backend loads itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// cuBLAS (`libcublas.so.N`, which brings its `libcublasLt.so.N`): the GEMMs.
    Cublas,
    /// NVRTC (`libnvrtc.so.N`): compiles the kernels.
    Nvrtc,
}

impl Kind {
    /// Its name, for people.
    pub fn name(self) -> &'static str {
        match self {
            Self::Cublas => "cuBLAS",
            Self::Nvrtc => "NVRTC",
        }
    }

    /// The file's name (its soname) in CUDA `major`.
    pub fn file_name(self, major: u32) -> String {
        match self {
            Self::Cublas => format!("libcublas.so.{major}"),
            Self::Nvrtc => format!("libnvrtc.so.{major}"),
        }
    }

    /// The folders under a Python `site-packages` where NVIDIA's wheel of CUDA `major` puts it:
    /// CUDA 13's wheels share `nvidia/cu13/lib`, CUDA 12's have a folder each.
    fn wheel_dirs(self, major: u32) -> Vec<String> {
        match (self, major) {
            (_, 13) => vec!["nvidia/cu13/lib".into()],
            (Self::Cublas, _) => vec!["nvidia/cublas/lib".into()],
            (Self::Nvrtc, _) => vec!["nvidia/cuda_nvrtc/lib".into()],
        }
    }

    /// The pip package that has it.
    pub fn wheel(self, major: u32) -> &'static str {
        match (self, major) {
            (Self::Cublas, 13) => "nvidia-cublas",
            (Self::Nvrtc, 13) => "nvidia-cuda-nvrtc",
            (Self::Cublas, _) => "nvidia-cublas-cu12",
            (Self::Nvrtc, _) => "nvidia-cuda-nvrtc-cu12",
        }
    }
}

/// Where to look for the libraries, as `main` reads it from the environment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LibrarySearch {
    /// Folders to look in, in order. Each may be a folder with the library files, a CUDA
    /// toolkit (`lib64/`, `lib/`), a Python `site-packages` with NVIDIA's wheels, or a Python
    /// environment (`lib/python3.*/site-packages`).
    pub roots: Vec<PathBuf>,
    /// Load only this CUDA major's libraries (`HARVEST_CUDA_MAJOR`), where the driver allows it.
    pub major: Option<u32>,
}

/// The variable with the folders the harvester looks in first (colon-separated).
pub const PATH_VARIABLE: &str = "HARVEST_CUDA_LIBRARY_PATH";
/// The variable that pins the CUDA major of the libraries (12 or 13).
pub const MAJOR_VARIABLE: &str = "HARVEST_CUDA_MAJOR";

/// Where CUDA toolkits usually live, looked in after the environment's folders.
const TOOLKIT_DIRS: [&str; 4] = [
    "/usr/local/cuda/lib64",
    "/usr/local/cuda-13/lib64",
    "/usr/local/cuda-12/lib64",
    "/usr/lib/x86_64-linux-gnu",
];

impl LibrarySearch {
    /// The search the environment describes (`var` reads a variable): [`PATH_VARIABLE`], then
    /// `LD_LIBRARY_PATH`, the Python environment (`VIRTUAL_ENV`, `CONDA_PREFIX`), the CUDA
    /// toolkit (`CUDA_HOME`, `CUDA_PATH`), then the usual toolkit folders; [`MAJOR_VARIABLE`]
    /// pins the major.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> std::result::Result<Self, String> {
        let mut roots: Vec<PathBuf> = Vec::new();
        for name in [PATH_VARIABLE, "LD_LIBRARY_PATH"] {
            roots.extend(
                var(name)
                    .unwrap_or_default()
                    .split(':')
                    .filter(|part| !part.trim().is_empty())
                    .map(PathBuf::from),
            );
        }
        for name in ["VIRTUAL_ENV", "CONDA_PREFIX", "CUDA_HOME", "CUDA_PATH"] {
            roots.extend(
                var(name)
                    .filter(|v| !v.trim().is_empty())
                    .map(PathBuf::from),
            );
        }
        roots.extend(TOOLKIT_DIRS.iter().map(PathBuf::from));
        let major = match var(MAJOR_VARIABLE).as_deref().map(str::trim) {
            None | Some("") => None,
            Some(text) => Some(parse_major(text)?),
        };
        Ok(Self { roots, major })
    }
}

/// A CUDA major the harvester loads, from `12`, `13`, `cu12` or `cu13`.
pub fn parse_major(text: &str) -> std::result::Result<u32, String> {
    let digits = text.trim().trim_start_matches("cu");
    match digits.parse::<u32>() {
        Ok(major) if MAJORS.contains(&major) => Ok(major),
        _ => Err(format!(
            "CUDA major {text:?} is not one the harvester loads: use 12 or 13 ({MAJOR_VARIABLE})"
        )),
    }
}

/// The folders to look in for `kind` of CUDA `major` under `roots`, in order; `python_dirs`
/// lists the `lib/python3.*/site-packages` folders under a root (the caller reads them).
pub fn candidate_dirs(
    roots: &[PathBuf],
    kind: Kind,
    major: u32,
    python_dirs: &dyn Fn(&Path) -> Vec<PathBuf>,
) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for root in roots {
        dirs.push(root.clone());
        dirs.push(root.join("lib64"));
        let mut packages = vec![root.clone()];
        packages.extend(python_dirs(root));
        for site in packages {
            dirs.extend(kind.wheel_dirs(major).iter().map(|wheel| site.join(wheel)));
        }
    }
    let mut seen = std::collections::HashSet::new();
    dirs.retain(|dir| seen.insert(dir.clone()));
    dirs
}

/// A library file found, by path, or through the system's loader by its soname.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// Which library.
    pub kind: Kind,
    /// Its CUDA major.
    pub major: u32,
    /// The file (a bare soname when only the system's loader found it).
    pub path: PathBuf,
}

/// What [`choose`] picked: one CUDA major's libraries, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// The CUDA major.
    pub major: u32,
    /// The files to load, one for each kind needed.
    pub files: Vec<Found>,
    /// Why this major, in a sentence.
    pub why: String,
}

/// Picks the libraries to load: the newest major that the driver supports (every major when
/// there is no driver: compiling only) and that `forced` allows, with every kind in `needs`
/// found. A driver older than [`OLDEST_DRIVER`] is refused by name, and so is a search that
/// found no usable set, saying what was missing and how to install it.
pub fn choose(
    driver: Option<CudaVersion>,
    forced: Option<u32>,
    found: &[Found],
    needs: &[Kind],
) -> std::result::Result<Choice, String> {
    if let Some(driver) = driver
        && driver < OLDEST_DRIVER
    {
        return Err(format!(
            "the NVIDIA driver supports CUDA {driver}, but the harvester needs CUDA {OLDEST_DRIVER} or newer (driver {} or newer): update the driver, or use --device cpu",
            oldest_driver_of(OLDEST_DRIVER.major)
        ));
    }
    let mut passed_over = Vec::new();
    for major in MAJORS {
        if forced.is_some_and(|forced| forced != major) {
            continue;
        }
        if let Some(driver) = driver
            && driver.major < major
        {
            passed_over.push(format!(
                "CUDA {major}'s need a driver of CUDA {major}.0 (driver {} or newer)",
                oldest_driver_of(major)
            ));
            continue;
        }
        let files: Vec<Found> = needs
            .iter()
            .filter_map(|&kind| {
                found
                    .iter()
                    .find(|f| f.kind == kind && f.major == major)
                    .cloned()
            })
            .collect();
        if files.len() == needs.len() {
            let why = why_chosen((driver, forced), major, needs, &passed_over);
            return Ok(Choice { major, files, why });
        }
        let missing: Vec<String> = needs
            .iter()
            .filter(|&&kind| !files.iter().any(|f| f.kind == kind))
            .map(|&kind| format!("{} ({})", kind.file_name(major), kind.wheel(major)))
            .collect();
        passed_over.push(format!("CUDA {major}'s lack {}", missing.join(" and ")));
    }
    Err(none_usable((driver, forced), needs, &passed_over))
}

/// Why `major` was chosen, in a sentence, with what was passed over first.
fn why_chosen(
    (driver, forced): (Option<CudaVersion>, Option<u32>),
    major: u32,
    needs: &[Kind],
    passed_over: &[String],
) -> String {
    let mut why = match driver {
        Some(driver) => format!("the driver supports CUDA {driver}"),
        None => "no driver is loaded (compiling only)".to_owned(),
    };
    if forced.is_some() {
        why.push_str(&format!(", and {MAJOR_VARIABLE}={major} pins CUDA {major}"));
    }
    let names: Vec<&str> = needs.iter().map(|kind| kind.name()).collect();
    why.push_str(&format!("; CUDA {major}'s {} found", names.join(" and ")));
    if !passed_over.is_empty() {
        why.push_str(&format!(" (passed over: {})", passed_over.join("; ")));
    }
    why
}

/// The refusal when no major has a usable set: what each lacked, and the wheels to install for
/// the majors the driver runs.
fn none_usable(
    (driver, forced): (Option<CudaVersion>, Option<u32>),
    needs: &[Kind],
    passed_over: &[String],
) -> String {
    let install: Vec<String> = MAJORS
        .iter()
        .copied()
        .filter(|&major| driver.is_none_or(|d| d.major >= major))
        .filter(|&major| forced.is_none_or(|f| f == major))
        .map(|major| {
            let wheels: Vec<&str> = needs.iter().map(|kind| kind.wheel(major)).collect();
            format!("`pip install {}`", wheels.join(" "))
        })
        .collect();
    let driver_text = driver.map_or_else(
        || "no driver is loaded".to_owned(),
        |d| format!("the driver supports CUDA {d}"),
    );
    format!(
        "no usable CUDA libraries: {driver_text}; {}. Install them ({}) and name their folder in {PATH_VARIABLE} (a site-packages folder will do), or use --device cpu",
        passed_over.join("; "),
        if install.is_empty() {
            "none fits this driver".to_owned()
        } else {
            install.join(" or ")
        }
    )
}

/// The libraries as loaded: each one's file, version and entry points.
#[derive(Debug)]
pub struct Loaded {
    /// The CUDA major of both.
    pub major: u32,
    /// Why this major.
    pub why: String,
    /// cuBLAS, where the process runs on a GPU (absent when it only compiles).
    pub cublas: Option<LoadedLibrary<CublasApi>>,
    /// NVRTC.
    pub nvrtc: LoadedLibrary<NvrtcApi>,
    /// The driver's CUDA version, where a driver is loaded.
    pub driver: Option<CudaVersion>,
    /// Every folder looked in.
    pub looked_in: Vec<PathBuf>,
}

/// One library, loaded: its file and its entry points.
#[derive(Debug)]
pub struct LoadedLibrary<Api> {
    /// Where it was loaded from.
    pub path: PathBuf,
    /// Its version, as it says.
    pub version: String,
    /// Its entry points.
    pub api: Api,
    /// Keeps the library mapped: `api`'s pointers point into it.
    _library: libloading::Library,
}

/// What a process needs of the libraries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// Running on a GPU: cuBLAS and NVRTC of a major the driver supports.
    Run,
    /// Compiling the kernels only, with no GPU: NVRTC.
    Compile,
}

impl Purpose {
    fn needs(self) -> &'static [Kind] {
        match self {
            Self::Run => &[Kind::Cublas, Kind::Nvrtc],
            Self::Compile => &[Kind::Nvrtc],
        }
    }
}

/// The search `main` configured ([`configure`]); without one, the system's loader alone.
static SEARCH: OnceLock<LibrarySearch> = OnceLock::new();
/// What was loaded, once a process.
static LOADED: OnceLock<std::result::Result<Loaded, String>> = OnceLock::new();

/// Sets where the libraries are looked for; `main` calls it once, before anything loads.
/// A second call is ignored.
pub fn configure(search: LibrarySearch) {
    let _ = SEARCH.set(search);
}

/// The libraries for `purpose`, loaded on first use: a [`CudaError::Unavailable`] naming what
/// is missing and how to install it, or why the driver cannot run any of them.
pub fn loaded(purpose: Purpose) -> Result<&'static Loaded> {
    let loaded = LOADED.get_or_init(|| load(purpose));
    match loaded {
        Ok(loaded) if purpose == Purpose::Run && loaded.cublas.is_none() => {
            Err(CudaError::Unavailable {
                reason: "this process loaded NVRTC only, to compile; cuBLAS was not loaded".into(),
            }
            .into())
        }
        Ok(loaded) => Ok(loaded),
        Err(reason) => Err(CudaError::Unavailable {
            reason: reason.clone(),
        }
        .into()),
    }
}

/// The `lib/python3.*/site-packages` folders under `root`.
fn python_dirs(root: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(root.join("lib")) else {
        return Vec::new();
    };
    let mut dirs: Vec<PathBuf> = entries
        .flatten()
        .filter(|entry| entry.file_name().to_string_lossy().starts_with("python3"))
        .map(|entry| entry.path().join("site-packages"))
        .collect();
    dirs.sort();
    dirs
}

/// Every library file `search` finds, by folder first, then through the system's loader.
fn discover(search: &LibrarySearch, looked_in: &mut Vec<PathBuf>) -> Vec<Found> {
    let mut found = Vec::new();
    for major in MAJORS {
        for kind in [Kind::Cublas, Kind::Nvrtc] {
            let dirs = candidate_dirs(&search.roots, kind, major, &python_dirs);
            let file = kind.file_name(major);
            let hit = dirs.iter().map(|dir| dir.join(&file)).find(|p| p.is_file());
            for dir in dirs {
                if !looked_in.contains(&dir) {
                    looked_in.push(dir);
                }
            }
            let path = hit.or_else(|| {
                // SAFETY: loading a CUDA library runs only its initialisers, which set up its
                // own state; it is unloaded again when `library` drops.
                #[allow(unsafe_code)]
                let library = unsafe { libloading::Library::new(file.as_str()) };
                library
                    .ok()
                    .map(|_| system_path(&file).unwrap_or_else(|| PathBuf::from(&file)))
            });
            if let Some(path) = path {
                found.push(Found { kind, major, path });
            }
        }
    }
    found
}

/// Where the system's loader finds `soname`: its path in `ldconfig`'s cache, if listed.
fn system_path(soname: &str) -> Option<PathBuf> {
    let output = std::process::Command::new("ldconfig")
        .arg("-p")
        .output()
        .ok()?;
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|line| line.trim_start().starts_with(&format!("{soname} ")))
        .find_map(|line| line.split("=>").nth(1).map(|p| PathBuf::from(p.trim())))
}

/// The cuBLAS of this process's libraries ([`loaded`] for a run on a GPU).
pub fn cublas() -> Result<&'static CublasApi> {
    let loaded = loaded(Purpose::Run)?;
    loaded.cublas.as_ref().map(|l| &l.api).ok_or_else(|| {
        CudaError::Unavailable {
            reason: "cuBLAS is not loaded".into(),
        }
        .into()
    })
}

/// The driver's CUDA version, where the driver library loads.
pub fn driver_cuda() -> Option<CudaVersion> {
    if !super::driver_present() {
        return None;
    }
    let mut code = 0;
    // SAFETY: the driver library loads (checked above); the pointer is to a live local.
    #[allow(unsafe_code)]
    let status = unsafe { cudarc::driver::sys::cuDriverGetVersion(&raw mut code) };
    status
        .result()
        .ok()
        .map(|()| CudaVersion::from_driver(code))
}

fn load(purpose: Purpose) -> std::result::Result<Loaded, String> {
    let default = LibrarySearch::default();
    let search = SEARCH.get().unwrap_or(&default);
    let driver = match purpose {
        Purpose::Run => Some(driver_cuda().ok_or_else(|| {
            "the NVIDIA driver library (libcuda.so.1) is not on this machine: run on a GPU node, or use --device cpu".to_owned()
        })?),
        Purpose::Compile => driver_cuda(),
    };
    let mut looked_in = Vec::new();
    let found = discover(search, &mut looked_in);
    let choice = choose(driver, search.major, &found, purpose.needs())?;
    let file = |kind: Kind| choice.files.iter().find(|f| f.kind == kind).cloned();
    let nvrtc = file(Kind::Nvrtc).ok_or_else(|| "NVRTC was chosen but not found".to_owned())?;
    let nvrtc = open(&nvrtc.path, NvrtcApi::resolve)?;
    let cublas = file(Kind::Cublas)
        .map(|f| open(&f.path, CublasApi::resolve))
        .transpose()?;
    Ok(Loaded {
        major: choice.major,
        why: choice.why,
        cublas,
        nvrtc,
        driver,
        looked_in,
    })
}

/// Loads the library at `path` and resolves its entry points with `resolve`.
fn open<Api>(
    path: &Path,
    resolve: fn(&libloading::Library) -> std::result::Result<(Api, String), String>,
) -> std::result::Result<LoadedLibrary<Api>, String> {
    let name = path
        .to_str()
        .ok_or_else(|| format!("{} is not a UTF-8 path: move the library", path.display()))?;
    // SAFETY: loading a CUDA library runs only its initialisers; it stays loaded for the rest
    // of the process (the caller keeps it in a static).
    #[allow(unsafe_code)]
    let library = unsafe { libloading::Library::new(name) }
        .map_err(|e| format!("{} did not load: {e}", path.display()))?;
    let (api, version) = resolve(&library).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(LoadedLibrary {
        path: path.to_path_buf(),
        version,
        api,
        _library: library,
    })
}

/// What `cuda-info` says of the libraries.
#[derive(Debug, Clone, Serialize)]
pub struct LibraryReport {
    /// The driver's CUDA version, where a driver is loaded.
    pub driver_cuda: Option<String>,
    /// The CUDA major of the libraries.
    pub major: u32,
    /// Why that major.
    pub why: String,
    /// cuBLAS's file and version.
    pub cublas: Option<LibraryFile>,
    /// NVRTC's file and version.
    pub nvrtc: LibraryFile,
    /// Every folder looked in, in order, before the system's loader.
    pub looked_in: Vec<PathBuf>,
}

/// One loaded library's file and version.
#[derive(Debug, Clone, Serialize)]
pub struct LibraryFile {
    /// The file.
    pub path: PathBuf,
    /// Its version.
    pub version: String,
}

impl Loaded {
    /// The report of what was loaded.
    pub fn report(&self) -> LibraryReport {
        LibraryReport {
            driver_cuda: self.driver.map(|d| d.to_string()),
            major: self.major,
            why: self.why.clone(),
            cublas: self.cublas.as_ref().map(|l| LibraryFile {
                path: l.path.clone(),
                version: l.version.clone(),
            }),
            nvrtc: LibraryFile {
                path: self.nvrtc.path.clone(),
                version: self.nvrtc.version.clone(),
            },
            looked_in: self.looked_in.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(kind: Kind, major: u32) -> Found {
        Found {
            kind,
            major,
            path: PathBuf::from(format!("/x/cu{major}/{}", kind.file_name(major))),
        }
    }

    const RUN: &[Kind] = &[Kind::Cublas, Kind::Nvrtc];

    fn both(major: u32) -> Vec<Found> {
        vec![found(Kind::Cublas, major), found(Kind::Nvrtc, major)]
    }

    fn driver(major: u32, minor: u32) -> Option<CudaVersion> {
        Some(CudaVersion { major, minor })
    }

    #[test]
    fn a_driver_of_cuda_13_takes_cuda_13s_libraries_and_one_of_cuda_12_takes_12s() {
        let mut all = both(12);
        all.extend(both(13));
        let choice = choose(driver(13, 0), None, &all, RUN).unwrap();
        assert_eq!(choice.major, 13);
        assert!(choice.files.iter().all(|f| f.major == 13));
        assert!(choice.why.contains("supports CUDA 13.0"), "{}", choice.why);
        let choice = choose(driver(12, 2), None, &all, RUN).unwrap();
        assert_eq!(choice.major, 12);
        assert!(
            choice
                .why
                .contains("CUDA 13's need a driver of CUDA 13.0 (driver 580"),
            "{}",
            choice.why
        );
    }

    #[test]
    fn a_driver_of_cuda_13_without_13s_libraries_takes_12s_and_says_what_13_lacked() {
        let mut all = both(12);
        all.push(found(Kind::Nvrtc, 13));
        let choice = choose(driver(13, 1), None, &all, RUN).unwrap();
        assert_eq!(choice.major, 12);
        assert!(
            choice.why.contains("libcublas.so.13 (nvidia-cublas)"),
            "{}",
            choice.why
        );
    }

    #[test]
    fn a_pinned_major_is_kept_and_one_the_driver_cannot_run_is_refused() {
        let mut all = both(12);
        all.extend(both(13));
        let choice = choose(driver(13, 0), Some(12), &all, RUN).unwrap();
        assert_eq!(choice.major, 12);
        assert!(
            choice.why.contains("HARVEST_CUDA_MAJOR=12"),
            "{}",
            choice.why
        );
        let error = choose(driver(12, 4), Some(13), &all, RUN).unwrap_err();
        assert!(
            error.contains("supports CUDA 12.4") && error.contains("driver 580"),
            "{error}"
        );
    }

    #[test]
    fn a_driver_older_than_cuda_12_2_is_refused_naming_both_versions() {
        let error = choose(driver(12, 0), None, &both(12), RUN).unwrap_err();
        assert!(
            error.contains("supports CUDA 12.0")
                && error.contains("CUDA 12.2 or newer")
                && error.contains("driver 535"),
            "{error}"
        );
        let error = choose(driver(11, 8), None, &both(12), RUN).unwrap_err();
        assert!(error.contains("CUDA 11.8"), "{error}");
    }

    #[test]
    fn no_libraries_is_refused_with_the_wheels_to_install_for_the_driver() {
        let error = choose(driver(12, 8), None, &[], RUN).unwrap_err();
        assert!(
            error.contains("pip install nvidia-cublas-cu12 nvidia-cuda-nvrtc-cu12")
                && !error.contains("pip install nvidia-cublas nvidia")
                && error.contains(PATH_VARIABLE),
            "{error}"
        );
        let error = choose(driver(13, 0), None, &[], RUN).unwrap_err();
        assert!(
            error.contains("pip install nvidia-cublas nvidia-cuda-nvrtc`")
                && error.contains("nvidia-cublas-cu12"),
            "{error}"
        );
    }

    #[test]
    fn compiling_needs_nvrtc_alone_and_takes_the_newest_without_a_driver() {
        let all = vec![found(Kind::Nvrtc, 12), found(Kind::Nvrtc, 13)];
        let choice = choose(None, None, &all, &[Kind::Nvrtc]).unwrap();
        assert_eq!((choice.major, choice.files.len()), (13, 1));
        let choice = choose(None, Some(12), &all, &[Kind::Nvrtc]).unwrap();
        assert_eq!(choice.major, 12);
    }

    #[test]
    fn the_search_reads_its_folders_in_order_and_refuses_a_major_it_does_not_load() {
        let vars = |name: &str| match name {
            PATH_VARIABLE => Some("/opt/a::/opt/b".to_owned()),
            "LD_LIBRARY_PATH" => Some("/ld".to_owned()),
            "VIRTUAL_ENV" => Some("/venv".to_owned()),
            MAJOR_VARIABLE => Some("cu12".to_owned()),
            _ => None,
        };
        let search = LibrarySearch::from_vars(vars).unwrap();
        assert_eq!(
            search.roots[..4],
            ["/opt/a", "/opt/b", "/ld", "/venv"].map(PathBuf::from)
        );
        assert_eq!(search.major, Some(12));
        let error =
            LibrarySearch::from_vars(|name| (name == MAJOR_VARIABLE).then(|| "11".to_owned()))
                .unwrap_err();
        assert!(
            error.contains("\"11\"") && error.contains("12 or 13"),
            "{error}"
        );
    }

    #[test]
    fn a_site_packages_root_is_searched_where_each_majors_wheels_put_the_library() {
        let roots = [PathBuf::from("/env")];
        let python = |root: &Path| vec![root.join("lib/python3.12/site-packages")];
        let dirs = candidate_dirs(&roots, Kind::Cublas, 12, &python);
        assert!(dirs.contains(&PathBuf::from("/env/nvidia/cublas/lib")));
        assert!(dirs.contains(&PathBuf::from(
            "/env/lib/python3.12/site-packages/nvidia/cublas/lib"
        )));
        let dirs = candidate_dirs(&roots, Kind::Nvrtc, 13, &python);
        assert!(dirs.contains(&PathBuf::from(
            "/env/lib/python3.12/site-packages/nvidia/cu13/lib"
        )));
        assert_eq!(dirs[0], PathBuf::from("/env"));
    }
}
