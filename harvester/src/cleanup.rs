//! `harvester cleanup`: deletes what one HarvestJob wrote under its output, for
//! `outputRetention: Delete` where the operator cannot reach the output itself (a directory on
//! the workers' volumes; the operator's Pod mounts none of them). Only the files the output's
//! manifest lists, and the job's `partial/` records, and only when that manifest was written
//! for the job's UID (`harvest_core::format::files_to_delete`).

use harvest_core::Location;
use harvest_core::format::files_to_delete;
use harvest_core::partial::PARTIAL_DIR;
use serde::Serialize;

use crate::error::Result;
use crate::pipeline::store::{S3Config, Store};

/// What a cleanup did; its JSON is the cleanup Pod's termination message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cleanup {
    /// The job's files were deleted: this many.
    Deleted(usize),
    /// Nothing was deleted, for this reason.
    Kept(String),
}

/// Deletes the outputs the job with UID `job_uid` wrote under `output`.
pub fn delete_job_outputs(output: &Location, s3: &S3Config, job_uid: &str) -> Result<Cleanup> {
    if let Location::Local(path) = output
        && !path.exists()
    {
        return Ok(Cleanup::Kept(format!("{output} does not exist")));
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| crate::Error::io("starting", "the I/O runtime", e))?;
    runtime.block_on(delete(output, s3, job_uid))
}

async fn delete(output: &Location, s3: &S3Config, job_uid: &str) -> Result<Cleanup> {
    let store = Store::open(output, s3)?;
    let manifest = store.get(harvest_core::format::MANIFEST_FILE).await?;
    let files = match files_to_delete(&output.to_string(), manifest.as_deref(), job_uid) {
        Ok(files) => files,
        Err(why) => return Ok(Cleanup::Kept(why)),
    };
    let records = store.list(PARTIAL_DIR).await?;
    // The manifest (last in the list) goes last, so an interrupted cleanup is run again.
    let mut deleted = 0;
    for name in records.iter().chain(&files) {
        store.delete(name).await?;
        deleted += 1;
    }
    if let Location::Local(path) = output {
        // Only directories the deletions emptied; anything else stays.
        let _ = std::fs::remove_dir(path.join(PARTIAL_DIR));
        let _ = std::fs::remove_dir(path);
    }
    Ok(Cleanup::Deleted(deleted))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(dir: &std::path::Path, uid: &str) -> Cleanup {
        let s3 = S3Config::from_vars(|_| None);
        delete_job_outputs(&Location::Local(dir.to_owned()), &s3, uid).unwrap()
    }

    #[test]
    fn only_the_files_the_jobs_own_manifest_lists_and_its_records_are_deleted() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        std::fs::create_dir_all(out.join(PARTIAL_DIR)).unwrap();
        // A finished harvest's manifest for UID uid-1 (core's fixture), listing one name more
        // that would leave the output.
        let mut manifest: serde_json::Value = serde_json::from_str(include_str!(
            "../../core/tests/fixtures/manifest-of-a-job.json"
        ))
        .unwrap();
        let mut escape = manifest["shards"][0].clone();
        escape["file"] = "../escape.safetensors".into();
        manifest["shards"].as_array_mut().unwrap().push(escape);
        std::fs::write(out.join("manifest.json"), manifest.to_string()).unwrap();
        for name in [
            "shard_00000.safetensors",
            "stats.safetensors",
            "result.json",
            "partial/shard_00000.record.safetensors",
            "notes.txt",
        ] {
            std::fs::write(out.join(name), b"x").unwrap();
        }
        std::fs::write(dir.path().join("escape.safetensors"), b"x").unwrap();
        // Another job's UID: nothing goes.
        let kept = run(&out, "uid-2");
        assert!(
            matches!(&kept, Cleanup::Kept(why) if why.contains("another job")),
            "{kept:?}"
        );
        assert!(out.join("manifest.json").exists());
        // Its own: the listed files and the record; a file it did not write stays, and so
        // does a listed name outside the output.
        assert_eq!(run(&out, "uid-1"), Cleanup::Deleted(5));
        let left: Vec<_> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(left, ["notes.txt"]);
        assert!(dir.path().join("escape.safetensors").exists());
        assert_eq!(
            run(&dir.path().join("gone"), "uid-1"),
            Cleanup::Kept(format!(
                "{} does not exist",
                dir.path().join("gone").display()
            ))
        );
    }
}
