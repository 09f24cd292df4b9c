//! Where the API keeps things on its own disk: each job's inputs and, on the embedded backend
//! (or Kubernetes with local storage), its outputs; and the wall clock the API stamps jobs with.

use std::path::{Path, PathBuf};

use harvest_core::clock::UnixMillis;

/// Where a job's files live under the data directory.
#[derive(Debug, Clone)]
pub struct JobPaths {
    /// `jobs/<id>`.
    pub root: PathBuf,
}

impl JobPaths {
    /// The paths of job `id`.
    pub fn new(data_dir: &Path, id: &str) -> Self {
        Self {
            root: data_dir.join("jobs").join(id),
        }
    }
    /// The inputs folder (prompts, directions, plan).
    pub fn input(&self) -> PathBuf {
        self.root.join("input")
    }
    /// The harvester's output folder.
    pub fn output(&self) -> PathBuf {
        self.root.join("out")
    }
}

/// The current time.
pub fn now() -> UnixMillis {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    UnixMillis(since.as_millis() as i64)
}
