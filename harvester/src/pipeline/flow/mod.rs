//! How a run's work flows: its concurrent threads (`threads`: forward, assembly, upload, joined by
//! bounded queues), what passes between them (`handoff`), and the progress they report.

pub(super) mod handoff;
pub mod progress;
pub(super) mod threads;
