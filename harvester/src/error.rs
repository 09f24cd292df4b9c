//! The harvester's error type: one enum of groups by domain (the model, the job's input, the
//! store, this machine, the GPU), structured variants, messages that name the value and, where
//! there is one, the fix. Whether a retry helps is decided by group ([`Error::kind`]).

use std::path::PathBuf;

use harvest_core::worker::{ErrorKind, ExitStatus};

pub use crate::backend::cuda::error::CudaError;

/// Everything that can go wrong while loading a model, tokenizing or running the forward pass,
/// grouped by where it comes from; each group says whether a retry can help ([`Error::kind`]).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The checkpoint or its tokenizer.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The job's own input.
    #[error(transparent)]
    Input(#[from] InputError),
    /// Files and the object store.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// This machine's memory or CPU.
    #[error(transparent)]
    Machine(#[from] MachineError),
    /// The CUDA backend failed: no usable GPU, an unsupported model, or a fault.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// One of a run's threads (forward, a pipeline stage, assembly, upload) stopped
    /// unexpectedly (a bug).
    #[error("the {thread} thread stopped unexpectedly. This is a bug.")]
    ThreadLost {
        /// The thread.
        thread: &'static str,
    },
    /// A batch handed to a backend breaks its own invariants (a bug in the caller).
    #[error("invalid batch: {reason}")]
    InvalidBatch {
        /// Which invariant.
        reason: String,
    },
}

/// The checkpoint and its tokenizer: a file missing, malformed or of a kind harvest does not
/// run. The job's to fix (another checkpoint, another precision); no retry mends it.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A required file of a checkpoint directory is absent.
    #[error("{path} does not exist: {hint}")]
    MissingFile {
        /// The path we looked for.
        path: PathBuf,
        /// What to do about it.
        hint: &'static str,
    },
    /// `config.json` could not be parsed.
    #[error("invalid model config {path}: {reason}")]
    BadConfig {
        /// The config file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The checkpoint is of an architecture we do not run.
    #[error(
        "unsupported architecture {architecture:?}: harvest runs LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and AfmoeForCausalLM"
    )]
    UnsupportedArchitecture {
        /// What the config says.
        architecture: String,
    },
    /// The compute precision asked for is not offered for this model.
    #[error("precision {precision} is not offered for {what}: use --precision f32")]
    UnsupportedPrecision {
        /// The precision asked for.
        precision: &'static str,
        /// The model, and why.
        what: &'static str,
    },
    /// A safetensors file is truncated or malformed.
    #[error("corrupt safetensors file {path}: {reason}")]
    CorruptSafetensors {
        /// The file.
        path: PathBuf,
        /// The parser's complaint.
        reason: String,
    },
    /// A tensor the architecture needs is not in the checkpoint.
    #[error("tensor {name} is missing from the checkpoint in {dir}")]
    MissingTensor {
        /// The tensor name, in Hugging Face naming.
        name: String,
        /// The checkpoint directory.
        dir: PathBuf,
    },
    /// A tensor has a shape that does not match config.json.
    #[error("tensor {name} has shape {found:?}, but config.json implies {expected:?}")]
    WrongShape {
        /// The tensor name.
        name: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The shape in the file.
        found: Vec<usize>,
    },
    /// A tensor is stored in a dtype we cannot read.
    #[error("tensor {name} has dtype {dtype}, but only bf16, f16 and f32 are supported")]
    UnsupportedDtype {
        /// The tensor name.
        name: String,
        /// The dtype in the file.
        dtype: String,
    },
    /// A GGUF file is malformed or of a kind we cannot import.
    #[error("GGUF {path}: {reason}")]
    Gguf {
        /// The GGUF file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A GGUF tensor is quantized with a type we do not import.
    #[error(
        "GGUF tensor {name} has type {ggml_type}; import supports F32, F16, BF16, Q8_0, Q4_0 and Q4_1 (re-quantize the file with one of them)"
    )]
    UnsupportedGgufType {
        /// The tensor name in GGUF naming.
        name: String,
        /// The GGML type's name or number.
        ggml_type: String,
    },
    /// The tokenizer could not be loaded or could not encode.
    #[error("tokenizer {path}: {reason}")]
    Tokenizer {
        /// The tokenizer file.
        path: PathBuf,
        /// The library's complaint.
        reason: String,
    },
}

/// The job's own input: prompts, conversations, layers, directions, the plan and its output,
/// parts and stages. The job's to fix; no retry mends it.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    /// A conversation could not be rendered: no chat template, or the template refused it.
    #[error("{reason}")]
    Chat {
        /// What is wrong, naming the conversation or the file, and what to do.
        reason: String,
    },
    /// A prompt that tokenizes to nothing cannot be harvested.
    #[error(
        "prompt {index} is empty after tokenization: give it some text, or keep add_special_tokens true"
    )]
    EmptyPrompt {
        /// The prompt's index in the corpus.
        index: usize,
    },
    /// The layer selection does not fit the model.
    #[error(transparent)]
    Layers(#[from] harvest_core::LayerError),
    /// Projection directions are unusable.
    #[error("projection directions: {reason}")]
    BadDirections {
        /// What is wrong with them.
        reason: String,
    },
    /// A prompts file is malformed.
    #[error("prompts {source_name}: {reason}")]
    Prompts {
        /// The prompts file.
        source_name: String,
        /// What is wrong, with the line number where there is one.
        reason: String,
    },
    /// The plan is invalid.
    #[error("invalid plan: {0}")]
    Plan(#[from] harvest_core::PlanError),
    /// An input the plan names (the prompts, the directions) is not in the store: the job's
    /// mistake, which no retry mends.
    #[error("{what} {location} does not exist: upload it there, or name where it is")]
    MissingInput {
        /// What the input is.
        what: &'static str,
        /// Where the plan says it is.
        location: String,
    },
    /// The output location holds files of a different harvest.
    #[error(
        "output {location} holds files of a different harvest (plan {found}, this plan is {expected}): use a new output location, or empty this one"
    )]
    ForeignOutput {
        /// The output location.
        location: String,
        /// The plan fingerprint found there.
        found: String,
        /// This plan's fingerprint.
        expected: String,
    },
    /// A shuffled job writing to an object store was given nowhere to spill its buckets.
    #[error(
        "the shuffled layout of {output} needs a local directory to spill its buckets in (about the job's size): pass --spill-dir"
    )]
    NoSpillDir {
        /// The job's output.
        output: String,
    },
    /// The corpus needs more tokens than the job may use.
    #[error(
        "the corpus tokenizes to {needed} tokens, more than the job's token budget of {budget}: raise the budget (tokenBudget) to at least {needed}, or send fewer or shorter prompts"
    )]
    TokenBudget {
        /// Tokens the corpus needs.
        needed: u64,
        /// The budget.
        budget: u64,
    },
    /// A job cannot be run in parts as asked.
    #[error("{reason}")]
    BadParts {
        /// Why, and what to do.
        reason: String,
    },
    /// The pipeline stages asked for do not fit the model.
    #[error("{reason}")]
    BadStages {
        /// What is wrong, naming the value and its bounds.
        reason: String,
    },
    /// A command that measures speed was given the replay device.
    #[error(
        "{command} measures a real device, and --device cuda-replay replays the GPU's arithmetic slowly on the CPU for tests: use --device cpu or cuda"
    )]
    ReplayNotMeasured {
        /// The command.
        command: &'static str,
    },
}

/// Files and the object store: reading, writing, listing. Another attempt may succeed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A file could not be read or written.
    #[error("{action} {path}: {source}")]
    Io {
        /// What we were doing, e.g. "reading".
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The object store failed (after retries, for transient errors).
    #[error("storage {location}: {reason}")]
    Object {
        /// The object or prefix.
        location: String,
        /// The store's error.
        reason: String,
    },
    /// A JSON file could not be written or parsed.
    #[error("JSON {path}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The serde error.
        source: serde_json::Error,
    },
    /// `harvester finalize` ran before every part had written its shards.
    #[error(
        "{missing} of the job's {of} shards are not written yet (the first is shard {first}): run every part (harvester run --part I/N) before finalize; a rerun of a part resumes"
    )]
    PartsMissing {
        /// Shards missing.
        missing: usize,
        /// Shards in the job.
        of: usize,
        /// The first one missing.
        first: usize,
    },
}

/// This machine: its memory or its CPU's instructions. Another machine may run the job.
#[derive(Debug, thiserror::Error)]
pub enum MachineError {
    /// `HARVEST_CPU_LEVEL` names no kernel level, or one above this CPU's.
    #[error("CPU kernel level: {reason}")]
    CpuLevel {
        /// The value, what the CPU lacks and the fix.
        reason: String,
    },
    /// The model would not fit this machine's memory.
    #[error(
        "the model needs about {needed} bytes of memory ({weights} for the weights of the blocks up to the deepest kept layer, {working} for one batch and the shards in flight), but this machine has {available} bytes available: use a machine with more memory, keep shallower layers (only blocks up to the deepest kept one are loaded), a smaller batch_tokens, or --device cuda"
    )]
    InsufficientMemory {
        /// Bytes needed in all.
        needed: u64,
        /// Of which the weights.
        weights: u64,
        /// Of which one batch, and the capture buffers and shards the pipeline holds.
        working: u64,
        /// Bytes available (MemAvailable).
        available: u64,
    },
    /// A GPU run's host buffers (the captures copied back, the shards in flight) need more of
    /// the host's memory than is available.
    #[error(
        "the GPU run holds about {needed} bytes of host memory for the captures it copies back and the shards in flight, but this machine has {available} bytes available: keep fewer or shallower layers, fewer sites, a smaller batch_tokens or shard_size, or use a machine with more memory"
    )]
    HostMemory {
        /// Bytes the pipeline's host buffers need.
        needed: u64,
        /// Bytes available (MemAvailable, or the cgroup's limit).
        available: u64,
    },
    /// A pipeline stage would not fit its device's memory.
    #[error(
        "pipeline stage {stage} of {stages} (blocks {first}-{last}) needs about {needed} bytes ({weights} for its weights, the rest for one batch), but {available} bytes are available to it: use more stages, devices with more memory, a smaller batch_tokens, or keep shallower layers"
    )]
    StageMemory {
        /// The stage, counted from 1.
        stage: usize,
        /// Stages the model is split into.
        stages: usize,
        /// Its first block.
        first: usize,
        /// Its last block.
        last: usize,
        /// Bytes it needs.
        needed: u64,
        /// Of which its weights.
        weights: u64,
        /// Bytes its device has for it.
        available: u64,
    },
}

/// The harvester's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The process exit status for this error, from the worker protocol's one table.
    pub fn exit_status(&self) -> ExitStatus {
        ExitStatus::Failed(self.kind())
    }

    /// The error's class, which tells a supervisor (the API, the operator) whether a retry can
    /// help: the one table, by group.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Model(_) | Self::Input(_) => ErrorKind::BadInput,
            // Another attempt, or another machine (whose environment may not ask for
            // instructions its CPU lacks), may succeed.
            Self::Store(_) | Self::Machine(_) => ErrorKind::Infrastructure,
            Self::InvalidBatch { .. } | Self::ThreadLost { .. } => ErrorKind::Internal,
            Self::Cuda(error) => error.kind(),
        }
    }

    /// Shorthand for an I/O failure on `path`.
    pub fn io(action: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Store(StoreError::Io {
            action,
            path: path.into(),
            source,
        })
    }
}

impl From<harvest_core::LayerError> for Error {
    fn from(error: harvest_core::LayerError) -> Self {
        Self::Input(InputError::Layers(error))
    }
}

impl From<harvest_core::PlanError> for Error {
    fn from(error: harvest_core::PlanError) -> Self {
        Self::Input(InputError::Plan(error))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whether_a_retry_helps_follows_the_group_and_the_message_is_the_variants_own() {
        let model: Error = ModelError::UnsupportedArchitecture {
            architecture: "GPT2LMHeadModel".into(),
        }
        .into();
        let input: Error = harvest_core::LayerError::OutOfRange {
            layer: 40,
            num_layers: 30,
        }
        .into();
        let store = Error::io("reading", "/x", std::io::Error::other("gone"));
        let machine: Error = MachineError::HostMemory {
            needed: 2,
            available: 1,
        }
        .into();
        let bug = Error::ThreadLost { thread: "upload" };
        let kinds = [&model, &input, &store, &machine, &bug].map(Error::kind);
        assert_eq!(
            kinds,
            [
                ErrorKind::BadInput,
                ErrorKind::BadInput,
                ErrorKind::Infrastructure,
                ErrorKind::Infrastructure,
                ErrorKind::Internal
            ]
        );
        assert!(
            model
                .to_string()
                .starts_with("unsupported architecture \"GPT2LMHeadModel\"")
        );
        assert_eq!(store.to_string(), "reading /x: gone");
    }
}
