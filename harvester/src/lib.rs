//! `harvester`: the worker that turns a model and prompts into residual-stream activations.
//!
//! It never depends on kube or axum; the API and the operator start it as a process and talk
//! to it through the worker protocol of `harvest_core::worker`. The library reads no flags and
//! no environment: `main.rs` parses both and passes values in.
//!
//! ```text
//! HF checkpoint dir ──model::LlamaWeights──┐
//! GGUF file ──gguf::import──► HF dir       │
//! prompts ──tokenizer::PromptTokenizer──► Batch ──backend::Backend (cpu | cuda)──► Captured
//!                                                      └─ projection::Directions (optional)
//! ```

pub mod backend;
pub mod bench;
pub mod cleanup;
pub mod compare;
pub mod dtype;
pub mod error;
pub mod gguf;
pub mod memory;
pub mod model;
pub mod pipeline;
pub mod probe;
pub mod projection;
pub mod synth;
pub mod tokenizer;

pub use error::{Error, InputError, MachineError, ModelError, Result, StoreError};
