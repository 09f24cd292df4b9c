//! What a finished run reports: `result.json` beside the manifest, the same JSON on stdout, and
//! a short termination message for Kubernetes.

use harvest_core::format::Contents;
use serde::{Deserialize, Serialize};

use crate::error::Error;

/// Most bytes Kubernetes keeps of a termination message.
pub const TERMINATION_MESSAGE_LIMIT: usize = 4096;

/// Seconds spent per stage. Stages overlap, so they need not add up to the wall time.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Timings {
    /// Reading inputs, tokenizer and weights.
    pub load_s: f64,
    /// Forward passes.
    pub forward_s: f64,
    /// Assembling and serialising shards, statistics and manifest.
    pub save_s: f64,
    /// Writing objects to the store.
    pub upload_s: f64,
}

/// `result.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunResult {
    /// Shards in the output.
    pub n_shards: usize,
    /// Prompts harvested.
    #[serde(default)]
    pub n_prompts: usize,
    /// Kept layers, ascending.
    pub layer_indices: Vec<usize>,
    /// Tokens run, over all prompts.
    pub tokens: u64,
    /// Bytes of shards, statistics and manifest.
    pub bytes_written: u64,
    /// Activations or projections.
    pub contents: Contents,
    /// Per-stage seconds of this process.
    pub timings: Timings,
    /// Where the files are.
    pub output: String,
    /// Shards found complete from an earlier run and not recomputed.
    pub resumed_shards: usize,
}

/// The termination message for an outcome: the result JSON, or the error with its exit code,
/// cut to [`TERMINATION_MESSAGE_LIMIT`] bytes on a character boundary.
pub fn termination_message(outcome: Result<&RunResult, &Error>) -> String {
    let text = match outcome {
        Ok(result) => serde_json::to_string(result).unwrap_or_default(),
        Err(error) => serde_json::json!({
            "error": cut(&error.to_string(), TERMINATION_MESSAGE_LIMIT - 200),
            "exit_code": error.exit_code(),
            "kind": error.kind(),
        })
        .to_string(),
    };
    cut(&text, TERMINATION_MESSAGE_LIMIT).to_owned()
}

fn cut(text: &str, limit: usize) -> &str {
    let mut end = text.len().min(limit);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_error_is_cut_to_the_kubernetes_limit_on_a_char_boundary() {
        let error = Error::Prompts {
            source_name: "p.jsonl".into(),
            reason: "é".repeat(5000),
        };
        let message = termination_message(Err(&error));
        assert!(message.len() <= TERMINATION_MESSAGE_LIMIT);
        let parsed: serde_json::Value = serde_json::from_str(&message).unwrap();
        assert_eq!(parsed["exit_code"], 2);
    }
}
