//! The object store behind a harvest's inputs and outputs: a local directory (the embedded
//! default) or any S3-compatible server, through the `object_store` crate.
//!
//! S3 settings are an [`S3Config`] value; the binary builds it from the usual variables
//! (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION` or
//! `AWS_DEFAULT_REGION`, `AWS_ENDPOINT` or `AWS_ENDPOINT_URL` for non-AWS servers,
//! `AWS_ALLOW_HTTP=true` for plain HTTP, and `AWS_VIRTUAL_HOSTED_STYLE_REQUEST=true` to leave
//! path-style addressing, the default that S3-compatible servers expect) through
//! [`S3Config::from_vars`]; the library itself reads no environment. Transient errors are
//! retried with exponential backoff.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::TryStreamExt;
use harvest_core::Location;
use object_store::aws::AmazonS3Builder;
use object_store::local::LocalFileSystem;
use object_store::path::Path as StorePath;
use object_store::{
    BackoffConfig, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig, WriteMultipart,
};

use crate::error::{Error, ModelError, Result, StoreError};

/// Objects at least this large are uploaded in parts.
pub const MULTIPART_THRESHOLD: usize = 16 << 20;
/// Size of one part of a multipart upload.
pub const MULTIPART_CHUNK: usize = 8 << 20;
/// Parts in flight at once during a multipart upload.
pub const MULTIPART_CONCURRENCY: usize = 4;

/// How to reach an S3-compatible server. Every field left `None` falls back to the
/// object_store defaults (AWS itself, credentials from the instance or web identity).
#[derive(Clone, Default)]
pub struct S3Config {
    /// A non-AWS endpoint such as `http://127.0.0.1:8333`.
    pub endpoint: Option<String>,
    /// The region (S3-compatible servers accept any, typically `us-east-1`).
    pub region: Option<String>,
    /// Access key id.
    pub access_key_id: Option<String>,
    /// Secret access key.
    pub secret_access_key: Option<String>,
    /// Session token of temporary credentials.
    pub session_token: Option<String>,
    /// Permit plain HTTP.
    pub allow_http: bool,
    /// Virtual-hosted-style addressing (`bucket.host`) instead of path style.
    pub virtual_hosted_style: bool,
}

impl std::fmt::Debug for S3Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Config")
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("access_key_id", &self.access_key_id)
            .field(
                "secret_access_key",
                &self.secret_access_key.as_ref().map(|_| "<redacted>"),
            )
            .field("allow_http", &self.allow_http)
            .field("virtual_hosted_style", &self.virtual_hosted_style)
            .finish_non_exhaustive()
    }
}

impl S3Config {
    /// Builds the settings from the usual variables, looked up by `lookup` (the binary passes
    /// the environment): `AWS_ENDPOINT_URL` (or `AWS_ENDPOINT`), `AWS_REGION` (or
    /// `AWS_DEFAULT_REGION`), `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
    /// `AWS_ALLOW_HTTP` and `AWS_VIRTUAL_HOSTED_STYLE_REQUEST`. Empty values count as unset.
    pub fn from_vars(lookup: impl Fn(&str) -> Option<String>) -> Self {
        let var = |names: &[&str]| {
            names
                .iter()
                .find_map(|n| lookup(n).filter(|v| !v.is_empty()))
        };
        let flag =
            |name: &str| lookup(name).is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1");
        Self {
            endpoint: var(&["AWS_ENDPOINT_URL", "AWS_ENDPOINT"]),
            region: var(&["AWS_REGION", "AWS_DEFAULT_REGION"]),
            access_key_id: var(&["AWS_ACCESS_KEY_ID"]),
            secret_access_key: var(&["AWS_SECRET_ACCESS_KEY"]),
            session_token: var(&["AWS_SESSION_TOKEN"]),
            allow_http: flag("AWS_ALLOW_HTTP"),
            virtual_hosted_style: flag("AWS_VIRTUAL_HOSTED_STYLE_REQUEST"),
        }
    }

    fn builder(&self, bucket: &str) -> AmazonS3Builder {
        let mut builder = AmazonS3Builder::new()
            .with_bucket_name(bucket)
            .with_retry(retry_config())
            .with_allow_http(self.allow_http)
            .with_virtual_hosted_style_request(self.virtual_hosted_style)
            .with_region(self.region.clone().unwrap_or_else(|| "us-east-1".into()));
        if let Some(endpoint) = &self.endpoint {
            builder = builder.with_endpoint(endpoint);
        }
        if let (Some(id), Some(secret)) = (&self.access_key_id, &self.secret_access_key) {
            builder = builder
                .with_access_key_id(id)
                .with_secret_access_key(secret);
        }
        if let Some(token) = &self.session_token {
            builder = builder.with_token(token);
        }
        builder
    }
}

/// An object store rooted at a prefix.
#[derive(Debug, Clone)]
pub struct Store {
    inner: Arc<dyn ObjectStore>,
    prefix: StorePath,
    location: Location,
}

/// Retries for transient failures: about a minute of exponential backoff.
fn retry_config() -> RetryConfig {
    RetryConfig {
        backoff: BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(10),
            base: 2.0,
        },
        max_retries: 8,
        retry_timeout: Duration::from_secs(120),
    }
}

impl Store {
    /// Opens the store that holds `location` (a directory or `s3://bucket/prefix`). A local
    /// directory is created if missing.
    pub fn open(location: &Location, s3: &S3Config) -> Result<Self> {
        let fail = |reason: String| {
            Error::Store(StoreError::Object {
                location: location.to_string(),
                reason,
            })
        };
        let (inner, prefix): (Arc<dyn ObjectStore>, StorePath) = match location {
            Location::Local(path) => {
                std::fs::create_dir_all(path).map_err(|e| Error::io("creating", path, e))?;
                let fs = LocalFileSystem::new_with_prefix(path)
                    .map_err(|e| fail(e.to_string()))?
                    .with_automatic_cleanup(true);
                (Arc::new(fs), StorePath::default())
            }
            Location::S3 { bucket, prefix } => {
                let s3 = s3
                    .builder(bucket)
                    .build()
                    .map_err(|e| fail(e.to_string()))?;
                (Arc::new(s3), StorePath::from(prefix.as_str()))
            }
        };
        Ok(Self {
            inner,
            prefix,
            location: location.clone(),
        })
    }

    /// Opens the store holding a single object (its parent) and returns the object's name.
    pub fn open_object(location: &Location, s3: &S3Config) -> Result<(Self, String)> {
        let bad = || {
            Error::Store(StoreError::Object {
                location: location.to_string(),
                reason: "names no object".into(),
            })
        };
        match location {
            Location::Local(path) => {
                let name = path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .ok_or_else(bad)?
                    .to_owned();
                let parent = path
                    .parent()
                    .filter(|p| !p.as_os_str().is_empty())
                    .unwrap_or(std::path::Path::new("."));
                if !path.exists() {
                    return Err(Error::Model(ModelError::MissingFile {
                        path: path.clone(),
                        hint: "check the path",
                    }));
                }
                Ok((Self::open(&Location::Local(parent.to_owned()), s3)?, name))
            }
            Location::S3 { bucket, prefix } => {
                let (dir, name) = prefix.rsplit_once('/').unwrap_or(("", prefix));
                if name.is_empty() {
                    return Err(bad());
                }
                let parent = Location::S3 {
                    bucket: bucket.clone(),
                    prefix: dir.to_owned(),
                };
                Ok((Self::open(&parent, s3)?, name.to_owned()))
            }
        }
    }

    /// Where this store is rooted.
    pub fn location(&self) -> &Location {
        &self.location
    }

    fn path(&self, name: &str) -> StorePath {
        self.prefix
            .parts()
            .chain(StorePath::from(name).parts())
            .collect()
    }

    fn error(&self, name: &str, e: object_store::Error) -> Error {
        Error::Store(StoreError::Object {
            location: format!("{}/{name}", self.location),
            reason: e.to_string(),
        })
    }

    /// Writes `bytes` to `name` atomically: readers see the old object or the whole new one.
    pub async fn put(&self, name: &str, bytes: Bytes) -> Result<()> {
        let path = self.path(name);
        if bytes.len() < MULTIPART_THRESHOLD {
            self.inner
                .put(&path, PutPayload::from(bytes))
                .await
                .map_err(|e| self.error(name, e))?;
            return Ok(());
        }
        let upload = self
            .inner
            .put_multipart(&path)
            .await
            .map_err(|e| self.error(name, e))?;
        let mut writer = WriteMultipart::new_with_chunk_size(upload, MULTIPART_CHUNK);
        for chunk in bytes.chunks(MULTIPART_CHUNK) {
            if let Err(e) = writer.wait_for_capacity(MULTIPART_CONCURRENCY).await {
                let _ = writer.abort().await;
                return Err(self.error(name, e));
            }
            writer.put(bytes.slice_ref(chunk));
        }
        writer.finish().await.map_err(|e| self.error(name, e))?;
        Ok(())
    }

    /// Reads the whole object `name`; `None` if it does not exist.
    pub async fn get(&self, name: &str) -> Result<Option<Bytes>> {
        match self.inner.get(&self.path(name)).await {
            Ok(result) => Ok(Some(result.bytes().await.map_err(|e| self.error(name, e))?)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.error(name, e)),
        }
    }

    /// Deletes `name`; a missing object is not an error.
    pub async fn delete(&self, name: &str) -> Result<()> {
        match self.inner.delete(&self.path(name)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.error(name, e)),
        }
    }

    /// Names (relative to the prefix) of every object under `dir`.
    pub async fn list(&self, dir: &str) -> Result<Vec<String>> {
        let base = self.path(dir);
        let objects: Vec<_> = self
            .inner
            .list(Some(&base))
            .try_collect()
            .await
            .map_err(|e| self.error(dir, e))?;
        let skip = self.prefix.parts().count();
        Ok(objects
            .into_iter()
            .map(|meta| {
                meta.location
                    .parts()
                    .skip(skip)
                    .map(|p| p.as_ref().to_owned())
                    .collect::<Vec<_>>()
                    .join("/")
            })
            .collect())
    }
}
