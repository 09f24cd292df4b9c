//! `harvester import-gguf`: a llama-architecture GGUF becomes an ordinary Hugging Face checkpoint
//! directory (config.json, tokenizer.json, tokenizer_config.json, model.safetensors).
//!
//! llama.cpp stores Q and K rows interleaved for its RoPE kernel; they are put back in Hugging
//! Face order here, exactly as transformers' own GGUF loader does.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use safetensors::{Dtype, tensor::TensorView};
use serde_json::json;

use super::quant::GgmlType;
use super::reader::{GgufFile, TensorInfo, Value};
use super::vocab::{SpecialTokens, build_tokenizer_json};
use crate::dtype;
use crate::error::{Error, ModelError, Result, StoreError};

/// The dtype of the written `model.safetensors`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutputDtype {
    /// bfloat16, half the size; what GPU backends upload anyway.
    #[default]
    Bf16,
    /// f32: no rounding beyond the GGUF's own quantisation.
    F32,
}

impl std::str::FromStr for OutputDtype {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "bf16" => Ok(Self::Bf16),
            "f32" => Ok(Self::F32),
            other => Err(format!("unknown dtype {other:?}: use bf16 or f32")),
        }
    }
}

impl std::fmt::Display for OutputDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Bf16 => "bf16",
            Self::F32 => "f32",
        })
    }
}

/// What an import wrote.
#[derive(Debug, Clone)]
pub struct ImportSummary {
    /// The checkpoint directory.
    pub out_dir: PathBuf,
    /// Tensors written.
    pub tensors: usize,
    /// Parameters written.
    pub parameters: usize,
    /// Decoder blocks.
    pub num_layers: usize,
}

/// A tensor ready to write: Hugging Face name, shape, little-endian bytes.
type ConvertedTensor = (String, Vec<usize>, Vec<u8>);

struct Hyper {
    hidden: usize,
    intermediate: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    context: usize,
    rope_theta: f64,
    rms_eps: f64,
}

/// Imports `gguf_path` into `out_dir` (created if needed).
pub fn import_gguf(
    gguf_path: &Path,
    out_dir: &Path,
    out_dtype: OutputDtype,
) -> Result<ImportSummary> {
    let gguf = GgufFile::open(gguf_path)?;
    let fail = |reason: String| {
        Error::Model(ModelError::Gguf {
            path: gguf_path.to_owned(),
            reason,
        })
    };
    match gguf.require("general.architecture")? {
        Value::Str(arch) if arch == "llama" => {}
        other => {
            return Err(fail(format!(
                "architecture {other:?} is not supported: import handles \"llama\" GGUFs"
            )));
        }
    }
    let hyper = read_hyper(&gguf)?;
    let (tokenizer, specials) = build_tokenizer_json(&gguf)?;
    let vocab_size = match gguf.metadata.get("llama.vocab_size") {
        Some(Value::UInt(v)) => *v as usize,
        _ => gguf.require_strings("tokenizer.ggml.tokens")?.len(),
    };
    let rope_scaling = rope_scaling(&gguf, &hyper)?;

    let converted: Vec<ConvertedTensor> = gguf
        .tensors
        .par_iter()
        .map(|info| convert_tensor(&gguf, info, &hyper, out_dtype))
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .flatten()
        .collect();
    let names: HashMap<&str, &Vec<usize>> = converted
        .iter()
        .map(|(n, shape, _)| (n.as_str(), shape))
        .collect();
    check_tensors(&names, &hyper, vocab_size).map_err(fail)?;
    let tie_word_embeddings = !names.contains_key("lm_head.weight");

    std::fs::create_dir_all(out_dir).map_err(|e| Error::io("creating", out_dir, e))?;
    let mut config = config_json(
        &hyper,
        vocab_size,
        tie_word_embeddings,
        &specials,
        out_dtype,
    );
    config["rope_scaling"] = rope_scaling;
    write_json(&out_dir.join("config.json"), &config)?;
    write_json(&out_dir.join("tokenizer.json"), &tokenizer)?;
    write_json(
        &out_dir.join("tokenizer_config.json"),
        &tokenizer_config(&gguf, &specials, hyper.context),
    )?;

    let parameters = converted
        .iter()
        .map(|(_, shape, _)| shape.iter().product::<usize>())
        .sum();
    write_safetensors(&converted, out_dir, out_dtype).map_err(fail)?;
    Ok(ImportSummary {
        out_dir: out_dir.to_owned(),
        tensors: converted.len(),
        parameters,
        num_layers: hyper.layers,
    })
}

/// Every tensor a Llama checkpoint needs is there, and the embedding has the vocabulary's shape.
fn check_tensors(
    names: &HashMap<&str, &Vec<usize>>,
    hyper: &Hyper,
    vocab_size: usize,
) -> std::result::Result<(), String> {
    let embed_shape = names
        .get("model.embed_tokens.weight")
        .ok_or_else(|| "tensor token_embd.weight is missing".to_owned())?;
    if **embed_shape != [vocab_size, hyper.hidden] {
        return Err(format!(
            "token_embd.weight has shape {embed_shape:?}, expected [{vocab_size}, {}]",
            hyper.hidden
        ));
    }
    for layer in 0..hyper.layers {
        for part in [
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ] {
            let name = format!("model.layers.{layer}.{part}.weight");
            if !names.contains_key(name.as_str()) {
                return Err(format!("tensor for {name} is missing"));
            }
        }
    }
    Ok(())
}

/// Writes `model.safetensors` (through a `.partial` file renamed at the end, so a crash never
/// leaves a truncated checkpoint).
fn write_safetensors(
    converted: &[ConvertedTensor],
    out_dir: &Path,
    out_dtype: OutputDtype,
) -> std::result::Result<(), String> {
    let st_dtype = match out_dtype {
        OutputDtype::Bf16 => Dtype::BF16,
        OutputDtype::F32 => Dtype::F32,
    };
    let views = converted
        .iter()
        .map(|(name, shape, bytes)| {
            TensorView::new(st_dtype, shape.clone(), bytes)
                .map(|view| (name.clone(), view))
                .map_err(|e| format!("tensor {name}: {e}"))
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let final_path = out_dir.join("model.safetensors");
    let partial = out_dir.join("model.safetensors.partial");
    let metadata = HashMap::from([("format".to_owned(), "pt".to_owned())]);
    safetensors::serialize_to_file(views, Some(metadata), &partial)
        .map_err(|e| format!("writing {}: {e}", partial.display()))?;
    std::fs::rename(&partial, &final_path)
        .map_err(|e| format!("renaming {}: {e}", partial.display()))
}

fn read_hyper(gguf: &GgufFile) -> Result<Hyper> {
    let uint = |key: &str| gguf.require_uint(key).map(|v| v as usize);
    let hidden = uint("llama.embedding_length")?;
    let heads = uint("llama.attention.head_count")?;
    let kv_heads = match gguf.metadata.get("llama.attention.head_count_kv") {
        Some(_) => uint("llama.attention.head_count_kv")?,
        None => heads,
    };
    let head_dim = match gguf.metadata.get("llama.rope.dimension_count") {
        Some(_) => uint("llama.rope.dimension_count")?,
        None => hidden / heads.max(1),
    };
    if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 || head_dim % 2 != 0 {
        return Err(Error::Model(ModelError::Gguf {
            path: gguf.path().to_owned(),
            reason: format!(
                "head counts {heads}/{kv_heads} with head_dim {head_dim} are inconsistent"
            ),
        }));
    }
    Ok(Hyper {
        hidden,
        intermediate: uint("llama.feed_forward_length")?,
        layers: uint("llama.block_count")?,
        heads,
        kv_heads,
        head_dim,
        context: uint("llama.context_length")?,
        rope_theta: gguf.float("llama.rope.freq_base")?.unwrap_or(10_000.0),
        rms_eps: gguf
            .float("llama.attention.layer_norm_rms_epsilon")?
            .unwrap_or(1e-5),
    })
}

/// Hugging Face name of a GGUF tensor, and whether it is a RoPE-permuted Q (`heads`) or K
/// (`kv_heads`) matrix. `None` for tensors the checkpoint does not need.
fn hf_name(name: &str, hyper: &Hyper) -> Option<(String, Option<usize>)> {
    match name {
        "token_embd.weight" => return Some(("model.embed_tokens.weight".into(), None)),
        "output_norm.weight" => return Some(("model.norm.weight".into(), None)),
        "output.weight" => return Some(("lm_head.weight".into(), None)),
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (hf_part, permute) = match part {
        "attn_norm.weight" => ("input_layernorm.weight", None),
        "ffn_norm.weight" => ("post_attention_layernorm.weight", None),
        "attn_q.weight" => ("self_attn.q_proj.weight", Some(hyper.heads)),
        "attn_k.weight" => ("self_attn.k_proj.weight", Some(hyper.kv_heads)),
        "attn_v.weight" => ("self_attn.v_proj.weight", None),
        "attn_output.weight" => ("self_attn.o_proj.weight", None),
        "ffn_gate.weight" => ("mlp.gate_proj.weight", None),
        "ffn_up.weight" => ("mlp.up_proj.weight", None),
        "ffn_down.weight" => ("mlp.down_proj.weight", None),
        _ => return None,
    };
    Some((format!("model.layers.{layer}.{hf_part}"), permute))
}

/// The RoPE scaling a GGUF carries as its `rope_freqs` tensor (Llama 3.x): one divisor per
/// frequency, applied as llama.cpp applies it (`frequency_factors` in our config), or null.
fn rope_scaling(gguf: &GgufFile, hyper: &Hyper) -> Result<serde_json::Value> {
    let Some(info) = gguf.tensors.iter().find(|t| t.name == "rope_freqs.weight") else {
        return Ok(serde_json::Value::Null);
    };
    let bad = |reason: String| {
        Error::Model(ModelError::Gguf {
            path: gguf.path().to_owned(),
            reason,
        })
    };
    let elements: usize = info.dims.iter().map(|&d| d as usize).product();
    if elements != hyper.head_dim / 2 {
        return Err(bad(format!(
            "rope_freqs.weight has {elements} values, but head_dim {} has {} frequencies",
            hyper.head_dim,
            hyper.head_dim / 2
        )));
    }
    let ggml_type = GgmlType::from_id(info.ggml_type).map_err(|ggml_type| {
        Error::Model(ModelError::UnsupportedGgufType {
            name: info.name.clone(),
            ggml_type,
        })
    })?;
    let byte_len = ggml_type
        .byte_len(elements)
        .ok_or_else(|| bad("rope_freqs.weight is not whole quantisation blocks".into()))?;
    let mut factors = Vec::with_capacity(elements);
    ggml_type.dequantize(gguf.tensor_bytes(info, byte_len)?, &mut factors);
    if let Some(i) = factors.iter().position(|f| !(f.is_finite() && *f > 0.0)) {
        return Err(bad(format!(
            "rope_freqs.weight[{i}] is {}: every factor must be finite and positive",
            factors[i]
        )));
    }
    Ok(json!({"rope_type": "frequency_factors", "factors": factors}))
}

fn convert_tensor(
    gguf: &GgufFile,
    info: &TensorInfo,
    hyper: &Hyper,
    out_dtype: OutputDtype,
) -> Result<Option<ConvertedTensor>> {
    let Some((name, permute_heads)) = hf_name(&info.name, hyper) else {
        return Ok(None);
    };
    let ggml_type = GgmlType::from_id(info.ggml_type).map_err(|ggml_type| {
        Error::Model(ModelError::UnsupportedGgufType {
            name: info.name.clone(),
            ggml_type,
        })
    })?;
    let shape: Vec<usize> = info.dims.iter().rev().map(|&d| d as usize).collect();
    let elements: usize = shape.iter().product();
    let byte_len = ggml_type.byte_len(elements).ok_or_else(|| {
        Error::Model(ModelError::Gguf {
            path: gguf.path().to_owned(),
            reason: format!(
                "tensor {} has {elements} values, not whole quantisation blocks",
                info.name
            ),
        })
    })?;
    let mut values = Vec::with_capacity(elements);
    ggml_type.dequantize(gguf.tensor_bytes(info, byte_len)?, &mut values);
    if let Some(heads) = permute_heads {
        values = unpermute_rope_rows(&values, &shape, heads);
    }
    let bytes = match out_dtype {
        OutputDtype::Bf16 => dtype::to_bf16_bytes(&values),
        OutputDtype::F32 => dtype::to_f32_bytes(&values),
    };
    Ok(Some((name, shape, bytes)))
}

/// Undoes llama.cpp's Q/K permutation: within each head, GGUF row `2i + j` is Hugging Face row
/// `j · head_dim/2 + i`.
fn unpermute_rope_rows(values: &[f32], shape: &[usize], heads: usize) -> Vec<f32> {
    let (rows, cols) = (shape[0], shape.get(1).copied().unwrap_or(1));
    let head_rows = rows / heads;
    let half = head_rows / 2;
    let mut out = vec![0.0; values.len()];
    for head in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let src = head * head_rows + 2 * i + j;
                let dst = head * head_rows + j * half + i;
                out[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&values[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

fn config_json(
    hyper: &Hyper,
    vocab_size: usize,
    tie_word_embeddings: bool,
    specials: &SpecialTokens,
    out_dtype: OutputDtype,
) -> serde_json::Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hyper.hidden,
        "intermediate_size": hyper.intermediate,
        "num_hidden_layers": hyper.layers,
        "num_attention_heads": hyper.heads,
        "num_key_value_heads": hyper.kv_heads,
        "head_dim": hyper.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": hyper.context,
        "rms_norm_eps": hyper.rms_eps,
        "rope_theta": hyper.rope_theta,
        "rope_scaling": null,
        "attention_bias": false,
        "mlp_bias": false,
        "vocab_size": vocab_size,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": specials.bos.as_ref().map(|t| t.0),
        "eos_token_id": specials.eos.as_ref().map(|t| t.0),
        "torch_dtype": match out_dtype { OutputDtype::Bf16 => "bfloat16", OutputDtype::F32 => "float32" },
    })
}

fn tokenizer_config(
    gguf: &GgufFile,
    specials: &SpecialTokens,
    context: usize,
) -> serde_json::Value {
    let content = |t: &Option<(u32, String)>| t.as_ref().map(|t| t.1.clone());
    let mut config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": content(&specials.bos),
        "eos_token": content(&specials.eos),
        "unk_token": content(&specials.unk),
        "pad_token": content(&specials.pad),
        "add_bos_token": specials.add_bos,
        "add_eos_token": specials.add_eos,
        "model_max_length": context,
        "clean_up_tokenization_spaces": false,
    });
    if let Some(Value::Str(template)) = gguf.metadata.get("tokenizer.chat_template") {
        config["chat_template"] = json!(template);
    }
    config
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|source| {
        Error::Store(StoreError::Json {
            path: path.to_owned(),
            source,
        })
    })?;
    std::fs::write(path, text).map_err(|e| Error::io("writing", path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermuting_restores_hugging_face_row_order_per_head() {
        // One head of 4 rows (head_dim 4): GGUF order is [r0, r2, r1, r3] of the HF rows.
        let hf_rows = [10.0, 11.0, 12.0, 13.0];
        let gguf_rows = [10.0, 12.0, 11.0, 13.0];
        assert_eq!(unpermute_rope_rows(&gguf_rows, &[4, 1], 1), hf_rows);
    }

    #[test]
    fn unpermuting_is_per_head() {
        let gguf = [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0];
        let out = unpermute_rope_rows(&gguf, &[8, 1], 2);
        assert_eq!(out, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
    }
}
