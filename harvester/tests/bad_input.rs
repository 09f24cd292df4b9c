//! Bad input gets an error that names the value, never a panic.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;

use common::{WriteTiny, tiny_model};
use harvest_core::LayerSelection;
use harvester::backend::cpu::CpuBackend;
use harvester::backend::{Backend, Batch, CaptureSpec, Captured};
use harvester::gguf::{OutputDtype, import_gguf};
use harvester::model::LlamaWeights;
use harvester::tokenizer::PromptTokenizer;

fn tiny() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    tiny_model().write(dir.path(), 9);
    dir
}

fn load_error(dir: &Path) -> String {
    LlamaWeights::load(dir, None).unwrap_err().to_string()
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(path, config.to_string()).unwrap();
}

#[test]
fn a_missing_config_is_named_with_its_path() {
    let dir = tempfile::tempdir().unwrap();
    let err = load_error(dir.path());
    assert!(
        err.contains("config.json") && err.contains("does not exist"),
        "{err}"
    );
}

#[test]
fn a_missing_weights_file_is_named() {
    let dir = tiny();
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("model.safetensors"), "{err}");
}

#[test]
fn a_corrupt_safetensors_file_is_reported_not_panicked_on() {
    let dir = tiny();
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 3]).unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("corrupt safetensors"), "{err}");
    std::fs::write(&path, b"not a safetensors file").unwrap();
    assert!(load_error(dir.path()).contains("corrupt safetensors"));
}

#[test]
fn an_unsupported_architecture_is_named() {
    let dir = tiny();
    edit_config(dir.path(), |c| {
        c["architectures"] = serde_json::json!(["FalconForCausalLM"]);
    });
    let err = load_error(dir.path());
    assert!(err.contains("FalconForCausalLM"), "{err}");
}

#[test]
fn a_shape_mismatch_names_the_tensor_and_both_shapes() {
    let dir = tiny();
    edit_config(dir.path(), |c| {
        c["intermediate_size"] = serde_json::json!(40);
    });
    let err = load_error(dir.path());
    assert!(
        err.contains("mlp.gate_proj.weight")
            && err.contains("[48, 32]")
            && err.contains("[40, 32]"),
        "{err}"
    );
}

#[test]
fn a_missing_tensor_is_named() {
    let dir = tiny();
    edit_config(dir.path(), |c| {
        c["num_hidden_layers"] = serde_json::json!(4);
    });
    let err = load_error(dir.path());
    assert!(
        err.contains("model.layers.3.self_attn.q_proj.weight"),
        "{err}"
    );
}

#[test]
fn an_unsupported_dtype_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let data = vec![0u8; 64 * 32 * 8];
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![64, 32], &data).unwrap();
    safetensors::serialize_to_file(
        [("model.embed_tokens.weight", view)],
        None,
        &dir.path().join("model.safetensors"),
    )
    .unwrap();
    tiny_model().write(&dir.path().join("unused"), 0);
    std::fs::copy(
        dir.path().join("unused/config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let err = load_error(dir.path());
    assert!(
        err.contains("I64") && err.contains("model.embed_tokens.weight"),
        "{err}"
    );
}

#[test]
fn a_layer_out_of_range_names_the_layer_and_the_depth() {
    let err = LayerSelection::Explicit(vec![3])
        .resolve(3)
        .unwrap_err()
        .to_string();
    assert!(err.contains("layer 3") && err.contains("3 layers"), "{err}");
}

#[test]
fn a_backend_refuses_weights_shallower_than_the_deepest_layer() {
    let dir = tiny();
    let weights = LlamaWeights::load(dir.path(), Some(1)).unwrap();
    let layers = LayerSelection::Explicit(vec![2]).resolve(3).unwrap();
    let err = CpuBackend::new(
        weights,
        CaptureSpec {
            layers,
            sites: harvest_core::Sites::default(),
            precision: Default::default(),
            directions: None,
        },
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("layer 2"), "{err}");
}

#[test]
fn a_token_id_outside_the_vocabulary_is_rejected_by_value() {
    let dir = tiny();
    let mut backend = CpuBackend::load(
        dir.path(),
        &LayerSelection::All,
        harvest_core::Sites::default(),
        None,
    )
    .unwrap();
    let err = backend
        .capture(
            &Batch::from_sequences(&[vec![1, 64]]),
            &mut Captured::default(),
        )
        .unwrap_err();
    assert!(err.to_string().contains("token id 64"), "{err}");
}

#[test]
fn an_empty_prompt_is_rejected_with_its_index() {
    let dir = common::fixtures().join("tiny-qwen2-f32");
    let tokenizer = PromptTokenizer::from_dir(&dir, 64).unwrap();
    let err = tokenizer
        .encode_all(&["fine", ""], true)
        .unwrap_err()
        .to_string();
    assert!(err.contains("prompt 1 is empty"), "{err}");
}

#[test]
fn a_missing_tokenizer_is_named() {
    let dir = tiny();
    let err = PromptTokenizer::from_dir(dir.path(), 64)
        .unwrap_err()
        .to_string();
    assert!(err.contains("tokenizer.json"), "{err}");
}

/// A minimal GGUF v3 file: the given metadata and one tensor.
fn gguf_bytes(metadata: &[(&str, u32, Vec<u8>)], tensor_type: u32, tensor_len: usize) -> Vec<u8> {
    let string = |s: &str| [&(s.len() as u64).to_le_bytes()[..], s.as_bytes()].concat();
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend(1u64.to_le_bytes());
    out.extend((metadata.len() as u64).to_le_bytes());
    for (key, kind, value) in metadata {
        out.extend(string(key));
        out.extend(kind.to_le_bytes());
        out.extend(value);
    }
    out.extend(string("blk.0.attn_q.weight"));
    out.extend(2u32.to_le_bytes());
    out.extend(256u64.to_le_bytes());
    out.extend(4u64.to_le_bytes());
    out.extend(tensor_type.to_le_bytes());
    out.extend(0u64.to_le_bytes());
    out.resize(out.len().div_ceil(32) * 32 + tensor_len, 0);
    out
}

fn llama_metadata() -> Vec<(&'static str, u32, Vec<u8>)> {
    let string = |s: &str| [&(s.len() as u64).to_le_bytes()[..], s.as_bytes()].concat();
    let uint = |v: u32| v.to_le_bytes().to_vec();
    let strings = |items: &[&str]| {
        let mut out = 8u32.to_le_bytes().to_vec();
        out.extend((items.len() as u64).to_le_bytes());
        for item in items {
            out.extend(string(item));
        }
        out
    };
    vec![
        ("general.architecture", 8, string("llama")),
        ("llama.embedding_length", 4, uint(256)),
        ("llama.feed_forward_length", 4, uint(512)),
        ("llama.block_count", 4, uint(1)),
        ("llama.attention.head_count", 4, uint(4)),
        ("llama.context_length", 4, uint(128)),
        ("tokenizer.ggml.model", 8, string("gpt2")),
        ("tokenizer.ggml.tokens", 9, strings(&["a", "b", "ab"])),
        ("tokenizer.ggml.merges", 9, strings(&["a b"])),
    ]
}

#[test]
fn a_gguf_tensor_of_an_unsupported_quantisation_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("q3k.gguf");
    std::fs::write(&path, gguf_bytes(&llama_metadata(), 11, 4096)).unwrap();
    let err = import_gguf(&path, &dir.path().join("out"), OutputDtype::Bf16)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("blk.0.attn_q.weight") && err.contains("Q3_K"),
        "{err}"
    );
}

#[test]
fn a_k_quant_tensor_shorter_than_its_shape_needs_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("q6k.gguf");
    // [256, 4] in Q6_K needs 4 super-blocks of 210 bytes; the file holds 100.
    std::fs::write(&path, gguf_bytes(&llama_metadata(), 14, 100)).unwrap();
    let err = import_gguf(&path, &dir.path().join("out"), OutputDtype::Bf16)
        .unwrap_err()
        .to_string();
    assert!(err.contains("blk.0.attn_q.weight"), "{err}");
}

#[test]
fn a_gguf_of_another_architecture_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("falcon.gguf");
    let mut metadata = llama_metadata();
    metadata[0].2 = [&6u64.to_le_bytes()[..], b"falcon"].concat();
    std::fs::write(&path, gguf_bytes(&metadata, 0, 4096 * 4)).unwrap();
    let err = import_gguf(&path, &dir.path().join("out"), OutputDtype::Bf16)
        .unwrap_err()
        .to_string();
    assert!(err.contains("falcon"), "{err}");
}

#[test]
fn a_file_that_is_not_gguf_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.gguf");
    std::fs::write(&path, b"GGML and then some").unwrap();
    let err = import_gguf(&path, &dir.path().join("out"), OutputDtype::Bf16)
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a GGUF file"), "{err}");
}

/// What the CUDA backend says when it refuses the fixture `name` in `precision`, before it
/// looks for a GPU (none is needed to see it).
fn cuda_refusal(name: &str, precision: harvest_core::plan::Precision) -> String {
    let dir = common::fixtures().join(name);
    let weights = LlamaWeights::load(&dir, None).unwrap();
    let spec = CaptureSpec {
        layers: LayerSelection::All
            .resolve(weights.config.num_layers)
            .unwrap(),
        sites: harvest_core::Sites::default(),
        precision,
        directions: None,
    };
    harvester::backend::cuda::forward::CudaBackend::new(weights, spec, 0)
        .unwrap_err()
        .to_string()
}

#[test]
fn the_cuda_backend_refuses_afmoe_by_name_before_it_looks_for_a_gpu() {
    let error = cuda_refusal("tiny-afmoe-bf16", harvest_core::plan::Precision::Bf16);
    assert!(
        error.contains("AFMoE")
            && error.contains("--device cpu")
            && error.contains("HARVEST_CUDA_AFMOE=try"),
        "{error}"
    );
}

#[test]
fn the_cuda_backend_refuses_the_f32_mode_by_name_before_it_looks_for_a_gpu() {
    let error = cuda_refusal(
        "tiny-mistral-window-bf16",
        harvest_core::plan::Precision::F32,
    );
    assert!(
        error.contains("f32 mode")
            && error.contains("--precision bf16")
            && error.contains("HARVEST_CUDA_F32=try"),
        "{error}"
    );
}

#[test]
fn an_afmoe_checkpoint_missing_its_expert_bias_names_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = common::fixtures().join("tiny-afmoe-bf16");
    for file in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture.join(file), dir.path().join(file)).unwrap();
    }
    let bytes = std::fs::read(fixture.join("model.safetensors")).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .tensors()
        .into_iter()
        .filter(|(name, _)| name != "model.layers.3.mlp.expert_bias")
        .collect();
    safetensors::serialize_to_file(kept, None, &dir.path().join("model.safetensors")).unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("model.layers.3.mlp.expert_bias"), "{err}");
}
