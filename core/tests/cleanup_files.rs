//! Which files a HarvestJob's cleanup deletes (`files_to_delete`): only those a manifest
//! written for that job's UID lists. `fixtures/manifest-of-a-job.json` is a finished harvest's
//! manifest for UID `uid-1` (the harvester's cleanup test reads it too).
#![allow(clippy::unwrap_used)]

use harvest_core::format::{MANIFEST_FILE, files_to_delete};

const MANIFEST: &str = include_str!("fixtures/manifest-of-a-job.json");

/// The fixture with `job_uid` set to `uid` (removed for `None`) and `more` shards listed.
fn manifest(uid: Option<&str>, more: &[&str]) -> Vec<u8> {
    let mut manifest: serde_json::Value = serde_json::from_str(MANIFEST).unwrap();
    match uid {
        Some(uid) => manifest["job_uid"] = uid.into(),
        None => {
            manifest.as_object_mut().unwrap().remove("job_uid");
        }
    }
    for file in more {
        let mut shard = manifest["shards"][0].clone();
        shard["file"] = (*file).into();
        manifest["shards"].as_array_mut().unwrap().push(shard);
    }
    serde_json::to_vec(&manifest).unwrap()
}

#[test]
fn only_a_manifest_written_for_this_jobs_uid_lets_its_files_be_deleted() {
    let mine = manifest(Some("uid-1"), &[]);
    let files = files_to_delete("s3://b/p", Some(&mine), "uid-1").unwrap();
    assert_eq!(
        files,
        [
            "shard_00000.safetensors",
            "stats.safetensors",
            "result.json",
            MANIFEST_FILE
        ]
    );
    let theirs = files_to_delete("s3://b/p", Some(&mine), "uid-2").unwrap_err();
    assert!(theirs.contains("another job (UID uid-1"), "{theirs}");
    let embedded = files_to_delete("s3://b", Some(&manifest(None, &[])), "uid-1").unwrap_err();
    assert!(embedded.contains("names no job UID"), "{embedded}");
    let none = files_to_delete("s3://b", None, "uid-1").unwrap_err();
    assert!(none.contains("no manifest"), "{none}");
    let junk = files_to_delete("s3://b", Some(b"{"), "uid-1").unwrap_err();
    assert!(junk.contains("cannot be read"), "{junk}");
    assert!(files_to_delete("s3://b/p", Some(&manifest(Some(""), &[])), "").is_err());
}

#[test]
fn a_listed_name_that_would_leave_the_output_is_never_deleted() {
    let climbing = manifest(
        Some("uid-1"),
        &[
            "../other/manifest.json",
            "a/../../b",
            "/etc/passwd",
            "a//b",
            ".",
            "train/t_0.safetensors",
        ],
    );
    let files = files_to_delete("/out/job", Some(&climbing), "uid-1").unwrap();
    assert_eq!(
        files,
        [
            "shard_00000.safetensors",
            "train/t_0.safetensors",
            "stats.safetensors",
            "result.json",
            MANIFEST_FILE
        ]
    );
}
