//! The GGUF importer against transformers' own GGUF loader: every weight, dequantised and
//! un-permuted, must equal transformers' after bf16 rounding (hashes written by
//! scripts/reference/make_fixtures.py). A reference computed on our own import could not catch
//! a wrong import, because both sides would share the error.

#![allow(clippy::unwrap_used, clippy::print_stdout)]

mod common;

use std::collections::BTreeMap;

use common::{fixtures, model_cache};
use harvester::gguf::{OutputDtype, import_gguf};
use safetensors::SafeTensors;
use sha2::{Digest, Sha256};

#[derive(serde::Deserialize)]
struct Expected {
    sha256: String,
    shape: Vec<usize>,
}

#[test]
fn imported_smollm2_weights_equal_transformers_gguf_loader_after_bf16_rounding() {
    let gguf = model_cache().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        gguf.exists(),
        "{} is missing: run scripts/fetch-model.sh first",
        gguf.display()
    );
    let out = tempfile::tempdir().unwrap();
    let summary = import_gguf(&gguf, out.path(), OutputDtype::Bf16).unwrap();
    assert_eq!(summary.num_layers, 30);

    let expected: BTreeMap<String, Expected> = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("smollm2_gguf_weights.json")).unwrap(),
    )
    .unwrap();
    let bytes = std::fs::read(out.path().join("model.safetensors")).unwrap();
    let imported = SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = imported.names().into_iter().map(str::to_owned).collect();
    names.sort();
    let mut expected_names: Vec<&String> = expected.keys().collect();
    expected_names.sort();
    assert_eq!(
        names.iter().collect::<Vec<_>>(),
        expected_names,
        "same tensor names"
    );
    let mismatched: Vec<&String> = names
        .iter()
        .filter(|name| {
            let view = imported.tensor(name).unwrap();
            let want = &expected[name.as_str()];
            view.shape() != want.shape.as_slice()
                || format!("{:x}", Sha256::digest(view.data())) != want.sha256
        })
        .collect();
    assert!(
        mismatched.is_empty(),
        "tensors differing from transformers: {mismatched:?}"
    );

    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["tie_word_embeddings"], true);
    assert_eq!(config["num_key_value_heads"], 3);
}

#[test]
fn a_truncated_gguf_is_rejected_with_a_clear_error() {
    let gguf = model_cache().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        gguf.exists(),
        "{} is missing: run scripts/fetch-model.sh first",
        gguf.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let cut = dir.path().join("cut.gguf");
    let bytes = std::fs::read(&gguf).unwrap();
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let err = import_gguf(&cut, &dir.path().join("out"), OutputDtype::Bf16)
        .unwrap_err()
        .to_string();
    assert!(err.contains("past the end of the file"), "{err}");
    assert!(
        !dir.path().join("out/model.safetensors").exists(),
        "no partial checkpoint is left"
    );
}

/// The ids of a few prompts, long enough (300 positions) for the scaled low frequencies to turn.
fn long_prompts() -> Vec<Vec<u32>> {
    vec![
        (0..300).map(|i| (i * 7 % 64) as u32).collect(),
        (0..40).map(|i| (i * 3 % 64) as u32).collect(),
    ]
}

#[test]
fn a_llama3_gguf_with_rope_freqs_runs_as_the_same_model_with_its_hugging_face_scaling() {
    let python = common::python();
    let dir = tempfile::tempdir().unwrap();
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/tiny_llama3_gguf.py");
    let made = std::process::Command::new(&python)
        .arg(&script)
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let imported = dir.path().join("imported");
    import_gguf(&dir.path().join("tiny.gguf"), &imported, OutputDtype::F32).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(imported.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["rope_scaling"]["rope_type"], "frequency_factors");
    let layers = harvest_core::LayerSelection::All;
    let ours = common::capture(&imported, &layers, &long_prompts());
    let hugging_face = common::capture(&dir.path().join("hf"), &layers, &long_prompts());
    let unscaled = common::capture(&dir.path().join("hf-unscaled"), &layers, &long_prompts());
    let error = common::worst_relative_error(&ours.data, &hugging_face.data, ours.width);
    assert!(error < 1e-5, "against the scaled checkpoint: {error:e}");
    let without = common::worst_relative_error(&ours.data, &unscaled.data, ours.width);
    assert!(
        without > 1e-3,
        "the scaling matters at these positions: {without:e}"
    );
}
