//! Turns the GPT-2-style BPE vocabulary in GGUF metadata into a Hugging Face `tokenizer.json`,
//! laid out as transformers' own GGUF loader builds it, so both encode identically.

use serde_json::{Value as Json, json};

use super::reader::{GgufFile, Value};
use crate::error::{Error, ModelError, Result};

/// GGUF token types (llama.cpp `llama_token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Special token ids and flags read from the GGUF.
#[derive(Debug, Clone, Default)]
pub struct SpecialTokens {
    /// Beginning of sequence.
    pub bos: Option<(u32, String)>,
    /// End of sequence.
    pub eos: Option<(u32, String)>,
    /// Unknown token.
    pub unk: Option<(u32, String)>,
    /// Padding token.
    pub pad: Option<(u32, String)>,
    /// Whether encoding prepends BOS.
    pub add_bos: bool,
    /// Whether encoding appends EOS.
    pub add_eos: bool,
}

/// `tokenizer.json` and the special tokens, built from GGUF metadata.
pub fn build_tokenizer_json(gguf: &GgufFile) -> Result<(Json, SpecialTokens)> {
    let model = match gguf.require("tokenizer.ggml.model")? {
        Value::Str(s) => s.as_str(),
        _ => "",
    };
    if model != "gpt2" {
        return Err(Error::Model(ModelError::Gguf {
            path: gguf.path().to_owned(),
            reason: format!(
                "tokenizer model {model:?} is not supported: import handles GPT-2-style BPE (\"gpt2\") vocabularies"
            ),
        }));
    }
    let tokens = gguf.require_strings("tokenizer.ggml.tokens")?;
    let merges = gguf.require_strings("tokenizer.ggml.merges")?;
    let specials = special_tokens(gguf, &tokens);
    let vocab: serde_json::Map<String, Json> = tokens
        .iter()
        .enumerate()
        .map(|(id, t)| ((*t).to_owned(), json!(id)))
        .collect();
    let merges: Vec<Json> = merges
        .iter()
        .map(|m| match m.split_once(' ') {
            Some((a, b)) => Ok(json!([a, b])),
            None => Err(Error::Model(ModelError::Gguf {
                path: gguf.path().to_owned(),
                reason: format!("BPE merge {m:?} is not two space-separated tokens"),
            })),
        })
        .collect::<Result<_>>()?;
    let added_tokens = added_tokens(gguf, &tokens);
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": post_processor(&specials),
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        },
    });
    Ok((tokenizer, specials))
}

/// BOS, EOS, UNK and PAD with their ids, and whether encoding adds BOS and EOS.
fn special_tokens(gguf: &GgufFile, tokens: &[&str]) -> SpecialTokens {
    let special_id = |key: &str| -> Option<(u32, String)> {
        match gguf.metadata.get(key) {
            Some(Value::UInt(id)) => {
                let id = *id as usize;
                tokens.get(id).map(|t| (id as u32, (*t).to_owned()))
            }
            _ => None,
        }
    };
    let flag = |key: &str, default: bool| match gguf.metadata.get(key) {
        Some(Value::Bool(b)) => *b,
        _ => default,
    };
    SpecialTokens {
        bos: special_id("tokenizer.ggml.bos_token_id"),
        eos: special_id("tokenizer.ggml.eos_token_id"),
        unk: special_id("tokenizer.ggml.unknown_token_id"),
        pad: special_id("tokenizer.ggml.padding_token_id"),
        add_bos: flag("tokenizer.ggml.add_bos_token", false),
        add_eos: flag("tokenizer.ggml.add_eos_token", false),
    }
}

/// The control and user-defined tokens, as `tokenizer.json`'s `added_tokens` (control ones
/// marked special).
fn added_tokens(gguf: &GgufFile, tokens: &[&str]) -> Vec<Json> {
    let types: Vec<i64> = match gguf.metadata.get("tokenizer.ggml.token_type") {
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| match v {
                Value::Int(i) => *i,
                Value::UInt(u) => *u as i64,
                _ => 1,
            })
            .collect(),
        _ => vec![1; tokens.len()],
    };
    types
        .iter()
        .enumerate()
        .filter(|&(_, &t)| t == TOKEN_TYPE_CONTROL || t == TOKEN_TYPE_USER_DEFINED)
        .filter_map(|(id, &t)| {
            tokens.get(id).map(|content| {
                json!({
                    "id": id, "content": content, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": t == TOKEN_TYPE_CONTROL,
                })
            })
        })
        .collect()
}

/// A template that adds BOS and/or EOS as the GGUF flags say.
fn post_processor(specials: &SpecialTokens) -> Json {
    let mut special_tokens = serde_json::Map::new();
    let mut special = |token: &(u32, String)| {
        special_tokens.insert(
            token.1.clone(),
            json!({"id": token.1, "ids": [token.0], "tokens": [token.1]}),
        );
        json!({"SpecialToken": {"id": token.1, "type_id": 0}})
    };
    let bos = specials
        .bos
        .as_ref()
        .filter(|_| specials.add_bos)
        .map(&mut special);
    let eos = specials
        .eos
        .as_ref()
        .filter(|_| specials.add_eos)
        .map(&mut special);
    let wrap = |seq: &str, type_id: u32| -> Vec<Json> {
        let body = json!({"Sequence": {"id": seq, "type_id": type_id}});
        bos.iter()
            .cloned()
            .chain([body])
            .chain(eos.iter().cloned())
            .collect()
    };
    let single = wrap("A", 0);
    let pair: Vec<Json> = single.iter().cloned().chain(wrap("B", 1)).collect();
    json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special_tokens})
}
