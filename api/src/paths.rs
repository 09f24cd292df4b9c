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

/// Writes a file only its owner can read or write (mode 0600 from its creation, so it is never
/// readable by others even for a moment).
pub fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(bytes)
}

/// Creates an empty file of mode 0600 at `path` unless one exists (SQLite then opens it, and
/// gives its journal files the same mode).
pub fn create_private(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
    {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

/// Whether others than the owner (group or world) may read `path`.
pub fn readable_by_others(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.permissions().mode() & 0o044 != 0)
}

/// The current time.
pub fn now() -> UnixMillis {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    UnixMillis(since.as_millis() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_database_file_is_created_for_its_owner_alone_and_an_existing_one_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("harvest.db");
        create_private(&path).unwrap();
        assert!(!readable_by_others(&path));
        std::fs::write(&path, b"kept").unwrap();
        create_private(&path).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"kept");
        // The check itself sees a file that others may read.
        use std::os::unix::fs::PermissionsExt;
        let open = dir.path().join("open");
        std::fs::write(&open, b"").unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(readable_by_others(&open));
    }
}
