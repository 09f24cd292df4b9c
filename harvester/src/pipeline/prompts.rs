//! Prompt files: `.jsonl` (one `{"text": ...}` object per line), `.json` (a list of strings) or
//! `.txt` (one prompt per line). Errors name the file and, for JSONL, the line.

use serde::Deserialize;

use crate::error::{Error, Result};

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
            Err(Error::Prompts {
                source_name: name.to_owned(),
                reason: "unknown prompts format: name the file .jsonl ({\"text\": ...} per line), .json (a list of strings) or .txt (one prompt per line)".into(),
            })
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonLine {
    text: String,
}

/// Parses the bytes of a prompts file named `name`. An empty corpus is an error.
pub fn parse_prompts(name: &str, bytes: &[u8]) -> Result<Vec<String>> {
    let fail = |reason: String| Error::Prompts {
        source_name: name.to_owned(),
        reason,
    };
    let text = std::str::from_utf8(bytes).map_err(|e| {
        fail(format!(
            "not UTF-8 (first bad byte at offset {})",
            e.valid_up_to()
        ))
    })?;
    let prompts = match PromptFormat::for_name(name)? {
        PromptFormat::JsonLines => text
            .lines()
            .enumerate()
            .filter(|(_, line)| !line.trim().is_empty())
            .map(|(n, line)| {
                serde_json::from_str::<JsonLine>(line)
                    .map(|l| l.text)
                    .map_err(|e| {
                        fail(format!(
                            "line {}: {e} (each line must be {{\"text\": \"...\"}})",
                            n + 1
                        ))
                    })
            })
            .collect::<Result<Vec<_>>>()?,
        PromptFormat::JsonList => serde_json::from_str::<Vec<String>>(text)
            .map_err(|e| fail(format!("{e} (expected a JSON list of strings)")))?,
        PromptFormat::Text => text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_owned)
            .collect(),
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
