//! Prompt tokenization with the `tokenizers` crate on a checkpoint's `tokenizer.json`.
//!
//! `add_special_tokens` means exactly what it means in Hugging Face: the tokenizer's own
//! post-processor decides what is added (BOS for Llama 3, nothing for SmolLM2). Prompts longer
//! than the context window are cut to fit, and the cut is reported.

use std::path::{Path, PathBuf};

use rayon::prelude::*;
use tokenizers::Tokenizer;

use crate::error::{Error, Result};

/// A tokenized prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    /// The ids that will run, at most the context window long.
    pub ids: Vec<u32>,
    /// The length before truncation, when the prompt was truncated.
    pub truncated_from: Option<usize>,
}

/// A checkpoint's tokenizer with the context limit applied.
#[derive(Debug, Clone)]
pub struct PromptTokenizer {
    inner: Tokenizer,
    path: PathBuf,
    max_tokens: usize,
    bos_id: Option<u32>,
}

impl PromptTokenizer {
    /// Loads `dir/tokenizer.json` (and the BOS token named in `dir/tokenizer_config.json`, if
    /// any), truncating prompts to `max_tokens`.
    pub fn from_dir(dir: &Path, max_tokens: usize) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(Error::MissingFile {
                path,
                hint: "the checkpoint directory needs a Hugging Face tokenizer.json",
            });
        }
        let inner = Tokenizer::from_file(&path).map_err(|e| Error::Tokenizer {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        let bos_id = bos_token(&dir.join("tokenizer_config.json"))
            .and_then(|token| inner.token_to_id(&token));
        Ok(Self {
            inner,
            path,
            max_tokens: max_tokens.max(1),
            bos_id,
        })
    }

    /// The BOS id, if the tokenizer config names one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// The context limit applied to every prompt.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// Every id the tokenizer marks special (BOS, EOS, chat markers), ascending.
    pub fn special_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self
            .inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, token)| token.special)
            .map(|(id, _)| id)
            .collect();
        ids.sort_unstable();
        ids
    }

    /// Tokenizes prompt `index`. An empty result is an error naming the prompt.
    pub fn encode(&self, index: usize, text: &str, add_special_tokens: bool) -> Result<Encoded> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| Error::Tokenizer {
                path: self.path.clone(),
                reason: format!("prompt {index}: {e}"),
            })?;
        let mut ids = encoding.get_ids().to_vec();
        if ids.is_empty() {
            return Err(Error::EmptyPrompt { index });
        }
        let truncated_from = (ids.len() > self.max_tokens).then_some(ids.len());
        ids.truncate(self.max_tokens);
        Ok(Encoded {
            ids,
            truncated_from,
        })
    }

    /// Tokenizes many prompts in parallel, in order.
    pub fn encode_all<S: AsRef<str> + Sync>(
        &self,
        texts: &[S],
        add_special_tokens: bool,
    ) -> Result<Vec<Encoded>> {
        texts
            .par_iter()
            .enumerate()
            .map(|(index, text)| self.encode(index, text.as_ref(), add_special_tokens))
            .collect()
    }
}

/// The `bos_token` of a `tokenizer_config.json`, in either its string or its object form.
fn bos_token(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let config: serde_json::Value = serde_json::from_str(&text).ok()?;
    match config.get("bos_token")? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}
