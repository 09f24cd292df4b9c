//! The I/O of one reconcile: the job, the clients its steps go through, and the writes more
//! than one step makes (a Pod's deletion, an Event, the field manager).

use kube::api::{DeleteParams, PostParams};
use kube::runtime::events::{Event, EventType};
use kube::{Api, Resource};
use tracing::warn;

use harvest_crds::HarvestJob;
use k8s_openapi::api::core::v1::Pod;

use crate::context::Context;
use crate::error::Result;

/// The I/O of one reconcile: the job and the clients its actions go through.
pub(crate) struct Shell<'a> {
    pub(crate) ctx: &'a Context,
    pub(crate) job: &'a HarvestJob,
    pub(crate) jobs: Api<HarvestJob>,
    /// In the namespace the job's Pods run in.
    pub(crate) pods: Api<Pod>,
    /// Whether that is the operator's worker namespace, not the job's own.
    pub(crate) elsewhere: bool,
}

/// The field manager of the operator's writes.
const MANAGER: &str = "harvest-operator";
pub(crate) fn post_params() -> PostParams {
    PostParams {
        field_manager: Some(MANAGER.into()),
        ..PostParams::default()
    }
}

pub(crate) async fn delete_pod(pods: &Api<Pod>, name: &str) -> Result<()> {
    match pods.delete(name, &DeleteParams::background()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Events are best effort: a failure to record one is logged, never fails the reconcile.
/// The most bytes of an Event's note the apiserver takes (events.k8s.io/v1 validation counts
/// bytes, not characters).
const NOTE_LIMIT_BYTES: usize = 1024;

/// `note` cut to [`NOTE_LIMIT_BYTES`] at a character boundary, so a long message in any script
/// still makes an Event instead of a 422.
fn event_note(note: &str) -> &str {
    let mut end = note.len().min(NOTE_LIMIT_BYTES);
    while !note.is_char_boundary(end) {
        end -= 1;
    }
    &note[..end]
}

pub(crate) async fn publish(
    ctx: &Context,
    job: &HarvestJob,
    warning: bool,
    reason: &str,
    note: &str,
) {
    let event = Event {
        type_: if warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: reason.to_owned(),
        note: Some(event_note(note).to_owned()),
        action: "Reconcile".into(),
        secondary: None,
    };
    if let Err(error) = ctx.recorder.publish(&event, &job.object_ref(&())).await {
        warn!(%error, reason, "could not record an event");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_note_is_cut_to_1024_bytes_at_a_character_boundary() {
        assert_eq!(event_note("short"), "short");
        let ascii = "x".repeat(2000);
        assert_eq!(event_note(&ascii).len(), 1024);
        // 600 three-byte characters are 1,800 bytes: 1,000 characters would be refused.
        let wide = "\u{4e2d}".repeat(600);
        let cut = event_note(&wide);
        assert_eq!((cut.len(), cut.chars().count()), (1023, 341));
    }
}
