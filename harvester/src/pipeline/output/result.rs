//! What a finished run reports: `result.json` beside the manifest, the same JSON on stdout, and
//! a short termination message for Kubernetes. The types are the worker protocol's, in
//! `harvest_core::worker`, so the API and the operator read exactly what is written here.

use harvest_core::worker::{ErrorKind, RunFailure};
pub use harvest_core::worker::{RESULT_FILE, RunResult, Termination, Timings};

use crate::error::Error;

/// The termination message for an outcome: the result, or the error with its exit code.
pub fn termination(outcome: Result<Termination, Error>) -> Termination {
    match outcome {
        Ok(done) => done,
        Err(error) => failure(error.kind(), &error.to_string()),
    }
}

/// The termination message of a run that failed before it had a plan (an unreadable plan
/// file, say): always bad input.
pub fn bad_input(message: &str) -> Termination {
    failure(ErrorKind::BadInput, message)
}

fn failure(kind: ErrorKind, message: &str) -> Termination {
    Termination::Failed(RunFailure::new(kind, message))
}

#[cfg(test)]
mod tests {
    use crate::error::InputError;
    use harvest_core::worker::TERMINATION_MESSAGE_LIMIT;

    use super::*;

    #[test]
    fn a_long_error_is_cut_to_the_kubernetes_limit_with_its_exit_code() {
        let error = Error::Input(InputError::Prompts {
            source_name: "p.jsonl".into(),
            reason: "é".repeat(5000),
        });
        let message = termination(Err(error)).to_message();
        assert!(message.len() <= TERMINATION_MESSAGE_LIMIT);
        let Some(Termination::Failed(failure)) = Termination::parse(&message) else {
            panic!("{message}");
        };
        assert_eq!((failure.exit_code, failure.kind), (2, ErrorKind::BadInput));
    }
}
