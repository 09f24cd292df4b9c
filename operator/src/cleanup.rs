//! Deleting a job's outputs (for `outputRetention: Delete`): every object under its prefix, on
//! S3 (credentials from the environment) or a local directory.

use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use harvest_core::Location;
use object_store::ObjectStore;
use object_store::path::Path as StorePath;

use crate::error::{Error, Result};

/// Deletes every object under `output` within `timeout`; returns how many.
pub async fn delete_prefix(output: &str, timeout: Duration) -> Result<usize> {
    let fail = |reason: String| Error::Cleanup {
        output: output.to_owned(),
        reason,
    };
    let location = Location::parse(output, "output").map_err(|e| fail(e.to_string()))?;
    let (store, prefix): (Arc<dyn ObjectStore>, StorePath) = match &location {
        Location::Local(path) => {
            if !path.exists() {
                return Ok(0);
            }
            let store = object_store::local::LocalFileSystem::new_with_prefix(path)
                .map_err(|e| fail(e.to_string()))?;
            (Arc::new(store), StorePath::default())
        }
        Location::S3 { bucket, prefix } => {
            let store = object_store::aws::AmazonS3Builder::from_env()
                .with_bucket_name(bucket)
                .build()
                .map_err(|e| fail(e.to_string()))?;
            (Arc::new(store), StorePath::from(prefix.as_str()))
        }
    };
    let work = async {
        let paths = store
            .list(Some(&prefix))
            .map_ok(|meta| meta.location)
            .boxed();
        let deleted: Vec<_> = store
            .delete_stream(paths)
            .try_collect()
            .await
            .map_err(|e| fail(e.to_string()))?;
        if let Location::Local(path) = &location {
            let _ = std::fs::remove_dir_all(path);
        }
        Ok(deleted.len())
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| fail(format!("no answer within {} s", timeout.as_secs())))?
}
