//! GGUF import: read a llama-architecture GGUF, dequantise it, and write a Hugging Face
//! checkpoint directory that the rest of the harvester loads like any other.
//!
//! ```text
//! file.gguf ──reader──► metadata + tensor directory ──quant──► f32 ──unpermute Q/K──► safetensors
//!                           └──vocab──► tokenizer.json, tokenizer_config.json, config.json
//! ```

pub mod import;
pub mod quant;
pub mod reader;
pub mod vocab;

pub use import::{ImportSummary, OutputDtype, import_gguf};
