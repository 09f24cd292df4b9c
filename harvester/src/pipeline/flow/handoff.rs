//! What passes between the pipeline's threads (forward, the stages of a staged model,
//! assembly, upload), and which of their failures is reported: the leaf both the single and
//! the staged engine build on.

use crate::backend::Captured;
use crate::error::Error;

/// One forward batch's captured rows and the prompts they hold, in order.
pub(in crate::pipeline) struct ForwardOutput {
    pub(in crate::pipeline) prompts: Vec<usize>,
    pub(in crate::pipeline) captured: Captured,
}

/// The error to report when threads fail: one that failed on its own, not one that only saw its
/// neighbour's channel close.
pub(in crate::pipeline) fn root_cause(errors: impl IntoIterator<Item = Option<Error>>) -> Error {
    let mut lost = None;
    for error in errors.into_iter().flatten() {
        match error {
            Error::ThreadLost { .. } => lost = lost.or(Some(error)),
            real => return real,
        }
    }
    lost.unwrap_or(Error::ThreadLost { thread: "pipeline" })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::StoreError;

    #[test]
    fn the_root_cause_is_the_thread_that_failed_on_its_own() {
        let store = Error::Store(StoreError::Object {
            location: "s3://b/p".into(),
            reason: "403".into(),
        });
        let lost = Error::ThreadLost { thread: "assemble" };
        let cause = root_cause([Some(lost), Some(store), None]);
        assert!(
            matches!(cause, Error::Store(StoreError::Object { .. })),
            "{cause}"
        );
        assert_eq!(
            cause.kind(),
            harvest_core::worker::ErrorKind::Infrastructure
        );
        let only_lost = root_cause([None, Some(Error::ThreadLost { thread: "upload" }), None]);
        assert!(matches!(only_lost, Error::ThreadLost { thread: "upload" }));
    }
}
