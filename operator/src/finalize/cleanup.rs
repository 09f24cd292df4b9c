//! Deleting a job's outputs on S3 (for `outputRetention: Delete`; credentials from the
//! environment or the paying account). Only what the job itself wrote goes: the files its
//! manifest lists, and its `partial/` records, and only when that manifest was written for the
//! job's UID (`harvest_core::format::files_to_delete`). A tenant's `spec.output` pointing at
//! someone else's prefix, or at a whole bucket, deletes nothing. A local directory is on the
//! workers' volumes, which the operator does not mount: the job's cleanup Pod (`harvester
//! cleanup`, see `reconcile`) deletes it with the same rules.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::TryStreamExt;
use harvest_core::Location;
use harvest_core::format::{MANIFEST_FILE, files_to_delete};
use harvest_core::partial::PARTIAL_DIR;
use object_store::path::Path as StorePath;
use object_store::{ObjectStore, ObjectStoreExt};

use crate::error::{Error, Result};

/// What a cleanup did; as JSON, what `harvester cleanup` answers in its termination message.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cleanup {
    /// The job's files were deleted: this many.
    Deleted(usize),
    /// Nothing was deleted, for this reason.
    Kept(String),
}

/// Deletes the outputs the job with UID `job_uid` wrote under `output`, within `timeout`. On
/// S3, `credentials` (the `AWS_*` keys of the paying account's `credentialsSecret`, empty for
/// none) go over the operator's own environment, so the account's files are deleted with the
/// account's key, as its workers wrote them.
pub async fn delete_outputs(
    output: &str,
    job_uid: &str,
    timeout: Duration,
    credentials: &BTreeMap<String, String>,
) -> Result<Cleanup> {
    let fail = |reason: String| Error::Cleanup {
        output: output.to_owned(),
        reason,
    };
    let location = Location::parse(output, "output").map_err(|e| fail(e.to_string()))?;
    let (store, prefix): (Arc<dyn ObjectStore>, StorePath) = match &location {
        Location::Local(_) => {
            return Err(fail(
                "a local directory is deleted by the job's cleanup Pod, not the operator".into(),
            ));
        }
        Location::S3 { bucket, prefix } => {
            // Like `from_env`, but an empty variable is unset, as the workers read it, and the
            // account's own keys win.
            let mut builder = object_store::aws::AmazonS3Builder::new();
            for (key, value) in std::env::vars().chain(credentials.clone()) {
                if key.starts_with("AWS_")
                    && !value.is_empty()
                    && let Ok(config_key) = key.to_ascii_lowercase().parse()
                {
                    builder = builder.with_config(config_key, value);
                }
            }
            let store = builder
                .with_bucket_name(bucket)
                .build()
                .map_err(|e| fail(e.to_string()))?;
            (Arc::new(store), StorePath::from(prefix.as_str()))
        }
    };
    let work = async {
        let manifest = match store.get(&prefix.clone().join(MANIFEST_FILE)).await {
            Ok(found) => Some(found.bytes().await.map_err(|e| fail(e.to_string()))?),
            Err(object_store::Error::NotFound { .. }) => None,
            Err(e) => return Err(fail(e.to_string())),
        };
        let files = match files_to_delete(output, manifest.as_deref(), job_uid) {
            Ok(files) => files,
            Err(why) => return Ok(Cleanup::Kept(why)),
        };
        let partial = prefix.clone().join(PARTIAL_DIR);
        let records: Vec<StorePath> = store
            .list(Some(&partial))
            .map_ok(|meta| meta.location)
            .try_collect()
            .await
            .map_err(|e| fail(e.to_string()))?;
        // The manifest (last in the list) goes last, so an interrupted cleanup is retried.
        let paths: Vec<StorePath> = records
            .into_iter()
            .chain(files.iter().filter_map(|file| object_path(&prefix, file)))
            .collect();
        let mut deleted = 0;
        for path in &paths {
            match store.delete(path).await {
                Ok(()) => deleted += 1,
                Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(fail(e.to_string())),
            }
        }
        Ok(Cleanup::Deleted(deleted))
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| fail(format!("no answer within {} s", timeout.as_secs())))?
}

/// `file` (a manifest's relative name) under `prefix`; `None` for a name that would leave it.
fn object_path(prefix: &StorePath, file: &str) -> Option<StorePath> {
    let mut path = prefix.clone();
    for segment in file.split('/') {
        if matches!(segment, "" | "." | "..") {
            return None;
        }
        path = path.join(segment);
    }
    Some(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listed_name_that_climbs_out_of_the_output_names_no_object() {
        let prefix = StorePath::from("api/acct/job");
        let inside = object_path(&prefix, "train/train_00000.safetensors").unwrap();
        assert_eq!(
            inside.as_ref(),
            "api/acct/job/train/train_00000.safetensors"
        );
        for bad in ["../other/manifest.json", "a/../../b", "/etc", "a//b", "."] {
            assert_eq!(object_path(&prefix, bad), None, "{bad}");
        }
    }
}
