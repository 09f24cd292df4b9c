//! Prompt tokenization with the `tokenizers` crate on a checkpoint's `tokenizer.json`.
//!
//! `add_special_tokens` means exactly what it means in Hugging Face: the tokenizer's own
//! post-processor decides what is added (BOS for Llama 3, nothing for SmolLM2). Prompts longer
//! than the context window are cut to fit, and the cut is reported.
//!
//! A conversation is rendered by the checkpoint's chat template (`tokenizer_config.json`'s
//! `chat_template`, written there for a GGUF import from its `tokenizer.chat_template`), then
//! tokenized without special tokens, as transformers' `apply_chat_template(tokenize=True)`
//! does, with exactly one BOS at the start wherever the model has one
//! (`harvest_core::chat::bos_once`), and each token's role and turn found from its byte offsets
//! in the text (`harvest_core::chat::conversation_tokens`).

use std::path::{Path, PathBuf};

use harvest_core::chat::{
    ChatTemplate, Conversation, TokenRoles, conversation_tokens, from_tokenizer_config,
};
use rayon::prelude::*;
use tokenizers::Tokenizer;

use crate::error::{Error, InputError, ModelError, Result};

/// A tokenized prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    /// The ids that will run, at most the context window long.
    pub ids: Vec<u32>,
    /// The length before truncation, when the prompt was truncated.
    pub truncated_from: Option<usize>,
    /// For a conversation: each token's role and turn, as long as `ids`.
    pub roles: Option<TokenRoles>,
}

/// A checkpoint's tokenizer with the context limit applied.
#[derive(Debug, Clone)]
pub struct PromptTokenizer {
    inner: Tokenizer,
    path: PathBuf,
    max_tokens: usize,
    bos_id: Option<u32>,
    /// The chat template, where the checkpoint has one.
    chat: Option<ChatTemplate>,
    /// Whether the tokenizer puts BOS before plain text (its post-processor).
    adds_bos: bool,
}

impl PromptTokenizer {
    /// Loads `dir/tokenizer.json` (and the BOS token named in `dir/tokenizer_config.json`, if
    /// any), truncating prompts to `max_tokens`.
    pub fn from_dir(dir: &Path, max_tokens: usize) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(Error::Model(ModelError::MissingFile {
                path,
                hint: "the checkpoint directory needs a Hugging Face tokenizer.json",
            }));
        }
        let inner = Tokenizer::from_file(&path).map_err(|e| {
            Error::Model(ModelError::Tokenizer {
                path: path.clone(),
                reason: e.to_string(),
            })
        })?;
        let config_path = dir.join("tokenizer_config.json");
        let (template, special) = from_tokenizer_config(&tokenizer_config(&config_path));
        let bos_id = special
            .bos
            .as_deref()
            .and_then(|token| inner.token_to_id(token));
        let adds_bos = bos_id.is_some_and(|bos| {
            inner
                .encode_fast("a", true)
                .is_ok_and(|e| e.get_ids().first() == Some(&bos))
        });
        let chat = match template {
            Some(source) => Some(ChatTemplate::new(&source, special).map_err(|e| {
                Error::Input(InputError::Chat {
                    reason: format!("{}: {e}", config_path.display()),
                })
            })?),
            None => None,
        };
        Ok(Self {
            inner,
            path,
            max_tokens: max_tokens.max(1),
            bos_id,
            chat,
            adds_bos,
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
            .map_err(|e| {
                Error::Model(ModelError::Tokenizer {
                    path: self.path.clone(),
                    reason: format!("prompt {index}: {e}"),
                })
            })?;
        self.cut(index, encoding.get_ids().to_vec(), None)
    }

    /// Whether the checkpoint has a chat template, so conversations can run.
    pub fn has_chat_template(&self) -> bool {
        self.chat.is_some()
    }

    /// Renders conversation `index` with the chat template and tokenizes it as
    /// `apply_chat_template(tokenize=True)` does, BOS once. A checkpoint without a template,
    /// or a template that refuses the conversation, is an error naming it.
    pub fn encode_conversation(
        &self,
        index: usize,
        conversation: &Conversation,
    ) -> Result<Encoded> {
        let chat = self.chat.as_ref().ok_or_else(|| Error::Input(InputError::Chat {
            reason: format!(
                "the model has no chat template ({} names no chat_template), so it cannot run conversations: send prompts instead, rendered as the model expects them, or use a checkpoint with a chat template",
                self.path.with_file_name("tokenizer_config.json").display()
            ),
        }))?;
        let (text, spans) = chat.spans(index, conversation).map_err(|e| {
            Error::Input(InputError::Chat {
                reason: e.to_string(),
            })
        })?;
        // Byte offsets (`encode`, not `encode_fast`): the spans are byte ranges of the text.
        let encoding = self.inner.encode(text.as_str(), false).map_err(|e| {
            Error::Model(ModelError::Tokenizer {
                path: self.path.clone(),
                reason: format!("conversation {index}: {e}"),
            })
        })?;
        let (ids, roles) = conversation_tokens(
            encoding.get_ids().to_vec(),
            encoding.get_offsets(),
            &spans,
            (self.bos_id, self.adds_bos),
        );
        self.cut(index, ids, Some(roles))
    }

    /// `ids` of prompt `index` (and their roles) cut to the context window; none at all is an
    /// error.
    fn cut(
        &self,
        index: usize,
        mut ids: Vec<u32>,
        mut roles: Option<TokenRoles>,
    ) -> Result<Encoded> {
        if ids.is_empty() {
            return Err(Error::Input(InputError::EmptyPrompt { index }));
        }
        let truncated_from = (ids.len() > self.max_tokens).then_some(ids.len());
        ids.truncate(self.max_tokens);
        if let Some(roles) = roles.as_mut() {
            roles.truncate(self.max_tokens);
        }
        Ok(Encoded {
            ids,
            truncated_from,
            roles,
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

/// A `tokenizer_config.json`, or nothing where it is absent or unreadable.
fn tokenizer_config(path: &Path) -> serde_json::Value {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or(serde_json::Value::Null)
}
