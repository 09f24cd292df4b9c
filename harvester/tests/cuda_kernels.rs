//! The CUDA backend without a GPU: every kernel compiles for every listed architecture with
//! NVRTC of CUDA 12 and of 13 (`harvester cuda-info --compile-only`, as a user runs it), every
//! cuBLAS and NVRTC entry point the harvester resolves exists in both majors' libraries, every
//! driver entry point it binds exists in the oldest driver supported (535, CUDA 12.2), and a
//! machine whose driver sees no GPU is told so by name while `auto` runs on the CPU.
//!
//! CI installs NVIDIA's wheels of both majors into the test tools' venv and names its
//! `site-packages` in `HARVEST_CUDA_LIBRARY_PATH`, puts Debian's `libcuda1` (535) in the folder
//! `HARVEST_TEST_LIBCUDA` names, and sets `HARVEST_REQUIRE_NVRTC`, so there a missing library
//! fails these tests instead of skipping them.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use harvester::backend::cuda::blas::{CUBLAS_ENTRY_POINTS, CublasApi};
use harvester::backend::cuda::kernels::{self, Arch, KernelCode, LISTED_ARCHS, NAMES};
use harvester::backend::cuda::libraries::{self, Kind, PATH_VARIABLE};
use harvester::backend::cuda::nvrtc::{NVRTC_ENTRY_POINTS, NvrtcApi};

fn required() -> bool {
    std::env::var_os("HARVEST_REQUIRE_NVRTC").is_some()
}

/// Skips (or, where CI requires them, fails) when `what` is absent.
fn present<T>(found: Option<T>, what: &str) -> Option<T> {
    if found.is_none() {
        assert!(
            !required(),
            "HARVEST_REQUIRE_NVRTC is set but {what} is missing: run scripts/test-tools.sh and scripts/test.sh's exports"
        );
        eprintln!("skipped: {what} is not on this machine");
    }
    found
}

/// The folders `HARVEST_CUDA_LIBRARY_PATH` names.
fn search_roots() -> Vec<PathBuf> {
    std::env::var(PATH_VARIABLE)
        .unwrap_or_default()
        .split(':')
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .collect()
}

/// The wheel's file of `kind` in CUDA `major` under the search's folders.
fn wheel_file(kind: Kind, major: u32) -> Option<PathBuf> {
    libraries::candidate_dirs(&search_roots(), kind, major, &|_: &Path| Vec::new())
        .into_iter()
        .map(|dir| dir.join(kind.file_name(major)))
        .find(|path| path.is_file())
}

/// The folder with the oldest supported driver's `libcuda.so.1`.
fn old_driver() -> Option<PathBuf> {
    std::env::var_os("HARVEST_TEST_LIBCUDA")
        .map(PathBuf::from)
        .filter(|dir| dir.join("libcuda.so.1").is_file())
}

fn harvester() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_harvester"));
    command
        .env("RUST_LOG", "info")
        .env_remove("LD_LIBRARY_PATH");
    command
}

fn json(output: &std::process::Output) -> serde_json::Value {
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

/// `cuda-info --compile-only --arch listed` with CUDA `major`'s NVRTC: every listed
/// architecture in both forms, every entry point, and the attention kernels' registers and
/// spills printed.
fn compile_every_listed_arch(major: u32) {
    if present(wheel_file(Kind::Nvrtc, major), &format!("NVRTC {major}")).is_none() {
        return;
    }
    let output = harvester()
        .args(["cuda-info", "--compile-only", "--arch", "listed"])
        .env(libraries::MAJOR_VARIABLE, major.to_string())
        .output()
        .unwrap();
    let report = json(&output);
    assert!(
        output.status.success(),
        "{report:#}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(report["libraries"]["major"], major);
    let nvrtc = report["libraries"]["nvrtc"]["path"].as_str().unwrap();
    assert!(nvrtc.ends_with(&format!("libnvrtc.so.{major}")), "{nvrtc}");
    let archs = report["archs"].as_array().unwrap();
    assert_eq!(archs.len(), LISTED_ARCHS.len());
    for (arch, listed) in archs.iter().zip(LISTED_ARCHS) {
        assert_eq!(arch["arch"], listed.sm());
        for form in arch["forms"].as_array().unwrap() {
            assert_eq!(form["error"], serde_json::Value::Null, "{form}");
            assert_eq!(form["entry_points"], NAMES.len(), "{form}");
            assert_eq!(form["target"], listed.sm(), "{form}");
        }
        let attention = arch["attention"].as_array().unwrap();
        assert_eq!(attention.len(), 4, "the four attention kernels: {arch}");
        for kernel in attention {
            eprintln!(
                "NVRTC {} {}: {:<22} {:>3} registers, {:>4} B spill stores, {:>4} B spill loads, {:>6} B shared",
                report["libraries"]["nvrtc"]["version"].as_str().unwrap(),
                listed,
                kernel["kernel"].as_str().unwrap(),
                kernel["registers"],
                kernel["spill_stores"],
                kernel["spill_loads"],
                kernel["shared_bytes"]
            );
            assert!(kernel["registers"].as_u64().unwrap() > 0, "{kernel}");
        }
    }
}

#[test]
fn every_kernel_compiles_for_every_listed_architecture_with_cuda_12s_nvrtc() {
    compile_every_listed_arch(12);
}

#[test]
fn every_kernel_compiles_for_every_listed_architecture_with_cuda_13s_nvrtc() {
    compile_every_listed_arch(13);
}

#[test]
fn an_architecture_older_than_ampere_or_unknown_to_nvrtc_fails_the_compile_report_by_name() {
    if present(wheel_file(Kind::Nvrtc, 13), "NVRTC 13").is_none() {
        return;
    }
    let output = harvester()
        .args(["cuda-info", "--compile-only", "--arch", "sm_70"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let report = json(&output);
    let error = report["archs"][0]["forms"][0]["error"].as_str().unwrap();
    assert!(error.contains("does not compile for sm_70"), "{error}");
    let output = harvester()
        .args(["cuda-info", "--compile-only", "--arch", "volta"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success() && stderr.contains("\"volta\"") && stderr.contains("sm_80"),
        "{stderr}"
    );
}

#[test]
fn every_cublas_and_nvrtc_entry_point_exists_in_cuda_12s_and_13s_libraries() {
    for major in libraries::MAJORS {
        let cublas = present(wheel_file(Kind::Cublas, major), &format!("cuBLAS {major}"));
        let nvrtc = present(wheel_file(Kind::Nvrtc, major), &format!("NVRTC {major}"));
        let (Some(cublas), Some(nvrtc)) = (cublas, nvrtc) else {
            continue;
        };
        // SAFETY: loading NVIDIA's libraries runs only their initialisers.
        #[allow(unsafe_code)]
        let (cublas_library, nvrtc_library) = unsafe {
            (
                libloading::Library::new(cublas.to_str().unwrap()).unwrap(),
                libloading::Library::new(nvrtc.to_str().unwrap()).unwrap(),
            )
        };
        for name in CUBLAS_ENTRY_POINTS {
            // SAFETY: only the symbol's presence is checked; nothing is called.
            #[allow(unsafe_code)]
            let found = unsafe { cublas_library.get::<*const ()>(name) };
            assert!(found.is_ok(), "{name} is missing from {}", cublas.display());
        }
        for name in NVRTC_ENTRY_POINTS {
            // SAFETY: as above.
            #[allow(unsafe_code)]
            let found = unsafe { nvrtc_library.get::<*const ()>(name) };
            assert!(found.is_ok(), "{name} is missing from {}", nvrtc.display());
        }
        // The harvester's own resolution, which also asks each library its version (no GPU).
        let (_, cublas_version) = CublasApi::resolve(&cublas_library).unwrap();
        assert!(
            cublas_version.starts_with(&format!("{major}.")),
            "{cublas_version}"
        );
        let (api, nvrtc_version) = NvrtcApi::resolve(&nvrtc_library).unwrap();
        assert!(
            nvrtc_version.starts_with(&format!("{major}.")),
            "{nvrtc_version}"
        );
        for arch in LISTED_ARCHS {
            assert!(
                api.archs().contains(&arch.0),
                "NVRTC {nvrtc_version} lacks {arch}"
            );
        }
        eprintln!(
            "CUDA {major}: cuBLAS {cublas_version} ({}), NVRTC {nvrtc_version} ({})",
            cublas.display(),
            nvrtc.display()
        );
    }
}

/// The driver entry points cudarc's bindings load, as the harvester builds them: every
/// `load::<_F>("name")` of `driver/sys/mod.rs` whose function is declared for the CUDA version
/// feature the workspace gives cudarc (all the harvester could call), with that feature. The
/// source is the one cargo unpacked for the locked version.
fn driver_bindings() -> (String, Vec<String>) {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let manifest = std::fs::read_to_string(workspace.join("Cargo.toml")).unwrap();
    let line = manifest
        .lines()
        .find(|l| l.starts_with("cudarc = "))
        .unwrap();
    let version = line
        .split('"')
        .find(|f| f.starts_with("cuda-") && f[5..].chars().all(|c| c.is_ascii_digit()))
        .unwrap()
        .to_owned();
    let lock = std::fs::read_to_string(workspace.join("Cargo.lock")).unwrap();
    let locked = lock
        .split("[[package]]")
        .find(|p| p.contains("name = \"cudarc\""))
        .and_then(|p| p.lines().find_map(|l| l.strip_prefix("version = \"")))
        .unwrap()
        .trim_end_matches('"');
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cargo"));
    let source = std::fs::read_dir(cargo_home.join("registry/src"))
        .unwrap()
        .flatten()
        .map(|index| {
            index
                .path()
                .join(format!("cudarc-{locked}/src/driver/sys/mod.rs"))
        })
        .find(|path| path.is_file())
        .unwrap_or_else(|| {
            panic!(
                "cudarc {locked}'s source is not under {}",
                cargo_home.display()
            )
        });
    let text = std::fs::read_to_string(source).unwrap();
    let mut names = Vec::new();
    let mut cfg: Option<&str> = None;
    let mut declared = false;
    for line in text.lines() {
        if line.starts_with("#[cfg(") {
            cfg = Some(line);
        } else if line.starts_with("pub unsafe fn ") {
            declared = cfg.is_none_or(|cfg| cfg.contains(&format!("\"{version}\"")));
            cfg = None;
        } else if let Some(rest) = line.split("load::<_F>(\"").nth(1)
            && declared
        {
            names.push(rest.split('"').next().unwrap().to_owned());
        } else if !line.starts_with(' ') {
            cfg = None;
        }
    }
    (version, names)
}

#[test]
fn every_driver_entry_point_the_bindings_can_load_exists_in_the_oldest_supported_driver() {
    let Some(dir) = present(
        old_driver(),
        "the 535 driver library (HARVEST_TEST_LIBCUDA)",
    ) else {
        return;
    };
    // SAFETY: loading the driver library runs only its initialisers; no GPU is touched.
    #[allow(unsafe_code)]
    let driver =
        unsafe { libloading::Library::new(dir.join("libcuda.so.1").to_str().unwrap()) }.unwrap();
    let (version, names) = driver_bindings();
    assert!(
        names.len() > 300,
        "{version}: only {} bindings",
        names.len()
    );
    for used in [
        "cuInit",
        "cuLaunchKernel",
        "cuModuleLoadData",
        "cuMemcpyDtoHAsync_v2",
    ] {
        assert!(names.iter().any(|n| n == used), "{used} is not bound");
    }
    let missing: Vec<&String> = names
        .iter()
        .filter(|name| {
            // SAFETY: only the symbol's presence is checked; nothing is called.
            #[allow(unsafe_code)]
            let found = unsafe { driver.get::<*const ()>(name.as_str()) }.is_ok();
            !found
        })
        .collect();
    assert!(
        missing.is_empty(),
        "driver 535 (CUDA 12.2) lacks {missing:?} of cudarc's {version} bindings: keep the bindings of CUDA 12.2"
    );
    eprintln!(
        "all {} driver entry points of cudarc's {version} bindings resolve in driver 535",
        names.len()
    );
}

#[test]
fn listing_gpus_on_a_machine_without_the_driver_says_why_none_instead_of_panicking() {
    if harvester::backend::cuda::driver_present() {
        eprintln!("skipped: this machine has an NVIDIA driver");
        return;
    }
    let listed = harvester().args(["cuda-info", "--list"]).output().unwrap();
    assert!(
        listed.status.success(),
        "{}",
        String::from_utf8_lossy(&listed.stderr)
    );
    let listed = json(&listed);
    assert_eq!(listed["gpus"], serde_json::json!([]));
    let because = listed["none_because"].as_str().unwrap();
    assert!(because.contains("libcuda.so.1"), "{because}");
}

#[test]
fn a_driver_that_sees_no_gpu_is_named_and_its_cuda_version_chooses_cuda_12s_libraries() {
    let Some(dir) = present(
        old_driver(),
        "the 535 driver library (HARVEST_TEST_LIBCUDA)",
    ) else {
        return;
    };
    let with_driver = || {
        let mut command = harvester();
        command.env("LD_LIBRARY_PATH", &dir);
        command
    };
    let listed = with_driver()
        .args(["cuda-info", "--list"])
        .output()
        .unwrap();
    assert!(listed.status.success());
    let listed = json(&listed);
    assert_eq!(listed["driver_cuda"], "12.2");
    assert_eq!(listed["gpus"], serde_json::json!([]));
    let because = listed["none_because"].as_str().unwrap();
    assert!(
        because.contains("driver (CUDA 12.2) is installed but finds no GPU")
            && because.contains("CUDA_VISIBLE_DEVICES"),
        "{because}"
    );
    let info = with_driver().arg("cuda-info").output().unwrap();
    let stderr = String::from_utf8_lossy(&info.stderr);
    assert!(
        !info.status.success() && stderr.contains("finds no GPU"),
        "{stderr}"
    );
    if present(wheel_file(Kind::Nvrtc, 12), "NVRTC 12").is_none() {
        return;
    }
    // The driver's CUDA 12.2 rules out CUDA 13's libraries, and the report says why.
    let compiled = with_driver()
        .args(["cuda-info", "--compile-only", "--arch", "sm_80"])
        .output()
        .unwrap();
    let report = json(&compiled);
    assert!(compiled.status.success(), "{report:#}");
    assert_eq!(report["libraries"]["major"], 12);
    assert_eq!(report["libraries"]["driver_cuda"], "12.2");
    let why = report["libraries"]["why"].as_str().unwrap();
    assert!(
        why.contains("supports CUDA 12.2") && why.contains("driver 580 or newer"),
        "{why}"
    );
}

#[test]
fn auto_runs_a_job_on_the_cpu_where_the_driver_sees_no_gpu_and_says_why_in_the_log_and_result() {
    let Some(dir) = present(
        old_driver(),
        "the 535 driver library (HARVEST_TEST_LIBCUDA)",
    ) else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let prompts = work.path().join("prompts.jsonl");
    std::fs::write(
        &prompts,
        "{\"text\": \"The cat sat\"}\n{\"text\": \"on the mat\"}\n",
    )
    .unwrap();
    let out = work.path().join("out");
    let output = harvester()
        .env("LD_LIBRARY_PATH", &dir)
        .args([
            "run",
            "--device",
            "auto",
            "--layers",
            "3",
            "--progress",
            "off",
            "--model",
        ])
        .arg(common::smollm2_dir())
        .arg("--prompts")
        .arg(&prompts)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(
        stderr.contains("auto runs on the CPU: no usable GPU: the NVIDIA driver")
            && stderr.contains("finds no GPU"),
        "{stderr}"
    );
    let result: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("result.json")).unwrap()).unwrap();
    assert_eq!(result["device"], "cpu");
    assert!(
        result["device_reason"]
            .as_str()
            .unwrap()
            .contains("driver (CUDA 12.2) is installed but finds no GPU"),
        "{result}"
    );
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["precision"], "f32", "the CPU's own arithmetic");
}

#[test]
fn a_compiled_image_is_cached_and_the_second_build_reads_it_instead_of_nvrtc() {
    if present(wheel_file(Kind::Nvrtc, 13), "NVRTC 13").is_none() {
        return;
    }
    harvester::backend::cuda::configure(harvester::backend::cuda::CudaSetup {
        libraries: libraries::LibrarySearch {
            roots: search_roots(),
            major: Some(13),
        },
        kernel_cache: None,
        switches: Default::default(),
    });
    let loaded = libraries::loaded(libraries::Purpose::Compile).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cache = kernels::KernelCache {
        dir: Some(dir.path().join("kernels")),
    };
    let first = kernels::build(&loaded.nvrtc.api, &cache, KernelCode::Cubin, Arch(86)).unwrap();
    assert!(!first.cached && first.cache_file.is_some());
    assert!(first.missing_entry_points().is_empty());
    let second = kernels::build(&loaded.nvrtc.api, &cache, KernelCode::Cubin, Arch(86)).unwrap();
    assert!(second.cached, "the second build came from NVRTC");
    assert_eq!(first.image, second.image);
    assert!(
        second.seconds < first.seconds,
        "read {} s, compile {} s",
        second.seconds,
        first.seconds
    );
    // Another architecture is another file.
    let other = kernels::build(&loaded.nvrtc.api, &cache, KernelCode::Ptx, Arch(89)).unwrap();
    assert!(!other.cached);
    assert!(String::from_utf8_lossy(&other.image).contains(".target sm_89"));
}

#[test]
fn the_kernel_form_is_cubin_then_ptx_unless_forced_and_a_bad_value_is_named() {
    assert_eq!(
        KernelCode::order(None).unwrap(),
        [KernelCode::Cubin, KernelCode::Ptx]
    );
    assert_eq!(KernelCode::order(Some("ptx")).unwrap(), [KernelCode::Ptx]);
    let error = KernelCode::order(Some("sass")).unwrap_err().to_string();
    assert!(
        error.contains("\"sass\"") && error.contains("cubin or ptx"),
        "{error}"
    );
}
