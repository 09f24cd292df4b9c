//! Q4_K, Q5_K and Q6_K dequantised bit for bit as gguf-py (the reference Python of llama.cpp)
//! does, on random super-blocks it writes (tests/python/kquants.py, run with `HARVEST_PYTHON`,
//! where scripts/test-tools.sh installs gguf).

#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;
use std::process::Command;

use harvester::gguf::quant::GgmlType;

#[test]
fn k_quants_dequantise_to_the_same_bits_as_gguf_py_on_random_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/kquants.py");
    for seed in [1, 2] {
        let out = Command::new(common::python())
            .arg(&script)
            .arg(dir.path())
            .arg(seed.to_string())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        for (name, id) in [("Q4_K", 12), ("Q5_K", 13), ("Q6_K", 14)] {
            let ggml = GgmlType::from_id(id).unwrap();
            let blocks = std::fs::read(dir.path().join(format!("{name}.blocks"))).unwrap();
            let expected: Vec<u32> = std::fs::read(dir.path().join(format!("{name}.f32")))
                .unwrap()
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            assert_eq!(ggml.byte_len(expected.len()), Some(blocks.len()), "{name}");
            let mut ours = Vec::new();
            ggml.dequantize(&blocks, &mut ours);
            let bits: Vec<u32> = ours.iter().map(|v| v.to_bits()).collect();
            let first_difference = bits.iter().zip(&expected).position(|(a, b)| a != b);
            assert_eq!(
                first_difference, None,
                "{name}, seed {seed}: value {first_difference:?}"
            );
        }
    }
}
