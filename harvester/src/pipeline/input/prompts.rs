//! Prompt files: `.jsonl` (one `{"text": ...}` object per line, or one conversation
//! `{"messages": [{"role": ..., "content": ...}, ...], "add_generation_prompt": false}` per
//! line, rendered by the model's chat template), `.json` (a list of strings) or `.txt` (one
//! prompt per line). Errors name the file and, for JSONL, the line.

use harvest_core::chat::Conversation;
use serde::Deserialize;

use crate::error::{Error, InputError, Result};

/// A job's corpus: plain prompts, or conversations (never both in one file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Corpus {
    /// Prompts, tokenized as they are.
    Texts(Vec<String>),
    /// Conversations, rendered by the model's chat template first.
    Conversations(Vec<Conversation>),
}

impl Corpus {
    /// Items in it.
    pub fn len(&self) -> usize {
        match self {
            Self::Texts(texts) => texts.len(),
            Self::Conversations(conversations) => conversations.len(),
        }
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The formats a prompts file may have, decided by its extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptFormat {
    /// One JSON object `{"text": ...}` per line; blank lines are skipped.
    JsonLines,
    /// A JSON list of strings.
    JsonList,
    /// One prompt per line; blank lines are skipped.
    Text,
}

impl PromptFormat {
    /// The format for a file name, or an error naming the accepted extensions.
    pub fn for_name(name: &str) -> Result<Self> {
        let lower = name.to_ascii_lowercase();
        if lower.ends_with(".jsonl") {
            Ok(Self::JsonLines)
        } else if lower.ends_with(".json") {
            Ok(Self::JsonList)
        } else if lower.ends_with(".txt") {
            Ok(Self::Text)
        } else {
            Err(Error::Input(InputError::Prompts {
                source_name: name.to_owned(),
                reason: "unknown prompts format: name the file .jsonl ({\"text\": ...} per line), .json (a list of strings) or .txt (one prompt per line)".into(),
            }))
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonLine {
    text: String,
}

/// One JSONL line: a prompt or a conversation.
enum Line {
    Text(String),
    Conversation(Conversation),
}

/// Reads JSONL line `number` (from 1): `{"text": ...}` or `{"messages": [...], ...}`.
fn parse_line(number: usize, line: &str) -> std::result::Result<Line, String> {
    const SHAPE: &str = "each line must be {\"text\": \"...\"}, or {\"messages\": [{\"role\": \"user\", \"content\": \"...\"}, ...]} for a conversation";
    let value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("line {number}: {e} ({SHAPE})"))?;
    if value.get("messages").is_some() {
        serde_json::from_value::<Conversation>(value)
            .map(Line::Conversation)
            .map_err(|e| format!("line {number}: {e} (roles are system, user, assistant and tool; each message has a role and a content)"))
    } else {
        serde_json::from_value::<JsonLine>(value)
            .map(|l| Line::Text(l.text))
            .map_err(|e| format!("line {number}: {e} ({SHAPE})"))
    }
}

/// Parses the bytes of a JSONL prompts file: all prompts, or all conversations.
fn parse_lines(text: &str) -> std::result::Result<Corpus, String> {
    let mut texts = Vec::new();
    let mut conversations = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match parse_line(n + 1, line)? {
            Line::Text(text) => texts.push(text),
            Line::Conversation(conversation) => {
                if conversation.messages.is_empty() {
                    return Err(format!(
                        "line {}: the conversation has no messages: give it at least one",
                        n + 1
                    ));
                }
                conversations.push(conversation);
            }
        }
        if !texts.is_empty() && !conversations.is_empty() {
            return Err(format!(
                "line {}: the file mixes prompts ({{\"text\"}}) and conversations ({{\"messages\"}}): give a job one kind",
                n + 1
            ));
        }
    }
    Ok(if conversations.is_empty() {
        Corpus::Texts(texts)
    } else {
        Corpus::Conversations(conversations)
    })
}

/// Parses the bytes of a prompts file named `name` that holds plain prompts only (the bench's
/// corpus). An empty corpus is an error.
pub fn parse_prompts(name: &str, bytes: &[u8]) -> Result<Vec<String>> {
    match parse_corpus(name, bytes)? {
        Corpus::Texts(texts) => Ok(texts),
        Corpus::Conversations(_) => Err(Error::Input(InputError::Prompts {
            source_name: name.to_owned(),
            reason: "this command takes prompts ({\"text\"} lines), not conversations".into(),
        })),
    }
}

/// Parses the bytes of a prompts file named `name`. An empty corpus is an error.
pub fn parse_corpus(name: &str, bytes: &[u8]) -> Result<Corpus> {
    let fail = |reason: String| {
        Error::Input(InputError::Prompts {
            source_name: name.to_owned(),
            reason,
        })
    };
    let text = std::str::from_utf8(bytes).map_err(|e| {
        fail(format!(
            "not UTF-8 (first bad byte at offset {})",
            e.valid_up_to()
        ))
    })?;
    let prompts = match PromptFormat::for_name(name)? {
        PromptFormat::JsonLines => parse_lines(text).map_err(fail)?,
        PromptFormat::JsonList => Corpus::Texts(
            serde_json::from_str::<Vec<String>>(text)
                .map_err(|e| fail(format!("{e} (expected a JSON list of strings)")))?,
        ),
        PromptFormat::Text => Corpus::Texts(
            text.lines()
                .filter(|l| !l.trim().is_empty())
                .map(str::to_owned)
                .collect(),
        ),
    };
    if prompts.is_empty() {
        return Err(fail("the corpus is empty: give at least one prompt".into()));
    }
    if prompts.len() > harvest_core::plan::MAX_PROMPTS {
        return Err(fail(format!(
            "{} prompts is more than the {} a job may hold: split the corpus into several jobs",
            prompts.len(),
            harvest_core::plan::MAX_PROMPTS
        )));
    }
    Ok(prompts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jsonl_skips_blank_lines_and_keeps_order() {
        let prompts =
            parse_prompts("p.jsonl", b"{\"text\": \"a\"}\n\n{\"text\": \"b\\nc\"}\n").unwrap();
        assert_eq!(prompts, ["a", "b\nc"]);
    }

    #[test]
    fn a_malformed_jsonl_line_is_named_by_number() {
        let err = parse_prompts("p.jsonl", b"{\"text\": \"a\"}\n{\"txt\": \"b\"}\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 2") && err.contains("p.jsonl"), "{err}");
    }

    #[test]
    fn conversation_lines_parse_and_a_file_of_both_kinds_or_a_bad_message_is_named() {
        let corpus = parse_corpus(
            "c.jsonl",
            b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"add_generation_prompt\": true}\n\n{\"messages\": [{\"role\": \"system\", \"content\": \"s\"}]}\n",
        )
        .unwrap();
        let Corpus::Conversations(conversations) = corpus else {
            panic!("{corpus:?}")
        };
        assert_eq!(conversations.len(), 2);
        assert!(conversations[0].add_generation_prompt && !conversations[1].add_generation_prompt);
        let error = parse_corpus(
            "c.jsonl",
            b"{\"text\": \"a\"}\n{\"messages\": [{\"role\": \"user\", \"content\": \"b\"}]}\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            error.contains("line 2") && error.contains("mixes"),
            "{error}"
        );
        let error = parse_corpus(
            "c.jsonl",
            b"{\"messages\": [{\"role\": \"narrator\", \"content\": \"b\"}]}\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            error.contains("line 1") && error.contains("narrator"),
            "{error}"
        );
        let error = parse_corpus("c.jsonl", b"{\"messages\": []}\n")
            .unwrap_err()
            .to_string();
        assert!(error.contains("no messages"), "{error}");
        let error = parse_prompts(
            "c.jsonl",
            b"{\"messages\": [{\"role\": \"user\", \"content\": \"b\"}]}\n",
        )
        .unwrap_err()
        .to_string();
        assert!(error.contains("not conversations"), "{error}");
    }

    #[test]
    fn json_lists_and_text_files_parse() {
        assert_eq!(
            parse_prompts("p.json", b"[\"x\", \"y\"]").unwrap(),
            ["x", "y"]
        );
        assert_eq!(
            parse_prompts("p.TXT", b"one\n\ntwo\n").unwrap(),
            ["one", "two"]
        );
    }

    #[test]
    fn an_empty_corpus_and_an_unknown_extension_are_rejected() {
        assert!(
            parse_prompts("p.json", b"[]")
                .unwrap_err()
                .to_string()
                .contains("empty")
        );
        assert!(
            parse_prompts("p.csv", b"a")
                .unwrap_err()
                .to_string()
                .contains(".jsonl")
        );
    }
}
