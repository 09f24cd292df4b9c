//! The CUDA kernels compile with NVRTC, as PTX and as a Hopper cubin, wherever its library
//! loads: CI installs the `nvidia-cuda-nvrtc` wheel and sets `HARVEST_REQUIRE_NVRTC`, so there a
//! missing library fails the test instead of skipping it. No GPU is needed.
#![allow(clippy::unwrap_used)]

use harvester::backend::cuda::kernels::{
    KernelCode, NAMES, compile, compile_cubin, nvrtc_present, nvrtc_version,
};

fn nvrtc_loads() -> bool {
    if !nvrtc_present() {
        assert!(
            std::env::var_os("HARVEST_REQUIRE_NVRTC").is_none(),
            "HARVEST_REQUIRE_NVRTC is set but libnvrtc.so.13 does not load: check LD_LIBRARY_PATH"
        );
        eprintln!("skipped: libnvrtc.so.13 is not on this machine");
        return false;
    }
    true
}

#[test]
fn every_kernel_compiles_to_ptx_for_hopper() {
    if !nvrtc_loads() {
        return;
    }
    let ptx = compile(KernelCode::Ptx).unwrap().to_src();
    assert!(ptx.contains(".target sm_90"), "compiled for Hopper");
    for name in NAMES {
        assert!(
            ptx.contains(&format!(".entry {name}(")),
            "{name} is missing from the PTX"
        );
    }
}

#[test]
fn every_kernel_compiles_to_a_hopper_cubin_that_names_each_entry_point() {
    if !nvrtc_loads() {
        return;
    }
    let (major, _) = nvrtc_version().unwrap();
    assert!(major >= 12, "NVRTC {major}.x");
    let bytes = compile_cubin().unwrap();
    assert_eq!(&bytes[..4], b"\x7fELF", "a cubin is an ELF image");
    for name in NAMES {
        assert!(
            bytes.windows(name.len()).any(|w| w == name.as_bytes()),
            "{name} is missing from the cubin"
        );
    }
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
