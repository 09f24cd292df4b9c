//! What a run starts from: where its plan comes from (`source`), the prompts and conversations
//! (`prompts`), projection directions (`directions`), the plan's fingerprint, and everything before
//! the weights load (`prepare`).

pub mod directions;
pub(super) mod fingerprint;
pub(super) mod prepare;
pub mod prompts;
pub(super) mod source;
