//! Where the Kubernetes backend keeps job inputs and finds outputs, and how it links to them;
//! both backends list a running job's outputs through it (the embedded one as `local`).
//!
//! - `local`: a directory that the API and the workers share (one node, or tests). Links are
//!   signed by the API and served by its `/files` route, exactly as on the embedded backend.
//! - `s3`: a bucket. Links are S3 presigned URLs made on every answer. They are signed with the
//!   long-lived access key named in the configuration, never with a Pod's temporary
//!   credentials (a presigned URL dies with the credentials that signed it, and those expire
//!   within hours), and live at most 7 days (the SigV4 limit).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjectPath;
use object_store::signer::{Method, Signer};
use object_store::{ObjectStore, ObjectStoreExt};
use serde::Deserialize;

use crate::error::StartupError;
use crate::paths::JobPaths;

/// The longest an S3 presigned URL may live (SigV4).
pub const MAX_PRESIGNED_SECONDS: u64 = 7 * 24 * 3600;

/// The `storage` section of the Kubernetes backend's configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum StorageConfig {
    /// The data directory, shared with the workers at the same path.
    Local,
    /// An S3-compatible bucket.
    S3 {
        /// The bucket.
        bucket: String,
        /// A key prefix for everything harvest writes (no leading or trailing slash).
        #[serde(default)]
        prefix: String,
        /// The region; unset is `AWS_REGION` from the environment (the ConfigMap the workers
        /// also read), else us-east-1.
        #[serde(default)]
        region: Option<String>,
        /// An S3-compatible endpoint (MinIO, Ceph); unset is the value of `endpoint_env`, or
        /// of `AWS_ENDPOINT_URL` (the workers' variable), if either is set, else AWS.
        #[serde(default)]
        endpoint: Option<String>,
        /// The environment variable that may hold the endpoint, so that the one endpoint is
        /// set in the Secret the workers also read.
        #[serde(default = "default_endpoint_env")]
        endpoint_env: String,
        /// The environment variable holding the long-lived access key id that signs links
        /// (mounted from a Secret).
        #[serde(default = "default_key_id_env")]
        access_key_id_env: String,
        /// The environment variable holding its secret.
        #[serde(default = "default_secret_env")]
        secret_access_key_env: String,
        /// Allow `http://` endpoints (in-cluster MinIO); also allowed when the environment
        /// variable `HARVEST_S3_ALLOW_HTTP` (or the workers' `AWS_ALLOW_HTTP`) is `true`.
        #[serde(default)]
        allow_http: bool,
    },
}

/// The region when neither the configuration nor `AWS_REGION` names one.
const DEFAULT_REGION: &str = "us-east-1";
fn default_endpoint_env() -> String {
    "HARVEST_S3_ENDPOINT".into()
}
fn default_key_id_env() -> String {
    "HARVEST_S3_ACCESS_KEY_ID".into()
}
fn default_secret_env() -> String {
    "HARVEST_S3_SECRET_ACCESS_KEY".into()
}

/// Opened storage.
#[derive(Debug, Clone)]
pub enum Storage {
    /// The shared data directory.
    Local {
        /// Its root.
        root: PathBuf,
    },
    /// A bucket.
    S3 {
        /// The client, which also signs.
        store: Arc<AmazonS3>,
        /// The bucket.
        bucket: String,
        /// The key prefix.
        prefix: String,
    },
}

/// The `Bytes` payload of a finished job file.
pub type Bytes = bytes::Bytes;

impl Storage {
    /// Opens the configured storage; `url_ttl_seconds` is checked against what it can sign.
    pub fn open(
        config: &StorageConfig,
        data_dir: &Path,
        url_ttl_seconds: u64,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, StartupError> {
        match config {
            StorageConfig::Local => Ok(Self::Local {
                root: data_dir.to_owned(),
            }),
            StorageConfig::S3 {
                bucket,
                prefix,
                region,
                endpoint,
                endpoint_env,
                access_key_id_env,
                secret_access_key_env,
                allow_http,
            } => {
                // The workers' own name for it comes last: the ConfigMap an overlay sets once.
                let endpoint = endpoint.clone().or_else(|| {
                    [endpoint_env.as_str(), "AWS_ENDPOINT_URL"]
                        .into_iter()
                        .find_map(|name| env(name).filter(|v| !v.is_empty()))
                });
                let allow_http = *allow_http
                    || ["HARVEST_S3_ALLOW_HTTP", "AWS_ALLOW_HTTP"]
                        .iter()
                        .any(|name| env(name).as_deref() == Some("true"));
                let region = region
                    .clone()
                    .or_else(|| env("AWS_REGION").filter(|v| !v.is_empty()))
                    .unwrap_or_else(|| DEFAULT_REGION.to_owned());
                if url_ttl_seconds > MAX_PRESIGNED_SECONDS {
                    return Err(StartupError::config(format!(
                        "url_ttl_seconds is {url_ttl_seconds}, but S3 presigned URLs live at most {MAX_PRESIGNED_SECONDS} s (7 days): lower it"
                    )));
                }
                let key = |name: &str| {
                    env(name).filter(|v| !v.is_empty()).ok_or_else(|| {
                        StartupError::config(format!(
                            "{name} is not set: links are signed with a long-lived S3 access key, so mount one from a Secret into {name}"
                        ))
                    })
                };
                let mut builder = AmazonS3Builder::new()
                    .with_bucket_name(bucket)
                    .with_region(&region)
                    .with_access_key_id(key(access_key_id_env)?)
                    .with_secret_access_key(key(secret_access_key_env)?)
                    .with_allow_http(allow_http);
                if let Some(endpoint) = &endpoint {
                    builder = builder
                        .with_endpoint(endpoint)
                        .with_virtual_hosted_style_request(false);
                }
                let store = builder
                    .build()
                    .map_err(|e| StartupError::config(format!("s3 storage: {e}")))?;
                Ok(Self::S3 {
                    store: Arc::new(store),
                    bucket: bucket.clone(),
                    prefix: prefix.trim_matches('/').to_owned(),
                })
            }
        }
    }

    fn key(prefix: &str, id: &str, rest: &str) -> String {
        if prefix.is_empty() {
            format!("jobs/{id}/{rest}")
        } else {
            format!("{prefix}/jobs/{id}/{rest}")
        }
    }

    /// Where job `id`'s input file `name` lives, as a HarvestJob location.
    pub fn input_location(&self, id: &str, name: &str) -> String {
        match self {
            Self::Local { root } => JobPaths::new(root, id)
                .input()
                .join(name)
                .display()
                .to_string(),
            Self::S3 { bucket, prefix, .. } => {
                format!(
                    "s3://{bucket}/{}",
                    Self::key(prefix, id, &format!("input/{name}"))
                )
            }
        }
    }

    /// Where job `id`'s outputs go, as a HarvestJob location.
    pub fn output_location(&self, id: &str) -> String {
        match self {
            Self::Local { root } => JobPaths::new(root, id).output().display().to_string(),
            Self::S3 { bucket, prefix, .. } => {
                format!("s3://{bucket}/{}", Self::key(prefix, id, "out"))
            }
        }
    }

    /// Stores job `id`'s input file `name`.
    pub async fn put_input(&self, id: &str, name: &str, bytes: Vec<u8>) -> Result<(), String> {
        match self {
            Self::Local { root } => {
                let dir = JobPaths::new(root, id).input();
                tokio::fs::create_dir_all(&dir)
                    .await
                    .map_err(|e| e.to_string())?;
                tokio::fs::write(dir.join(name), bytes)
                    .await
                    .map_err(|e| e.to_string())
            }
            Self::S3 { store, prefix, .. } => {
                let path = ObjectPath::from(Self::key(prefix, id, &format!("input/{name}")));
                store
                    .put(&path, bytes.into())
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            }
        }
    }

    /// Deletes job `id`'s inputs (its job was never created).
    pub async fn delete_inputs(&self, id: &str) -> Result<(), String> {
        match self {
            Self::Local { root } => {
                match tokio::fs::remove_dir_all(JobPaths::new(root, id).root).await {
                    Ok(()) => Ok(()),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                    Err(e) => Err(e.to_string()),
                }
            }
            Self::S3 { store, prefix, .. } => {
                for name in ["prompts.jsonl", "directions.npy"] {
                    let path = ObjectPath::from(Self::key(prefix, id, &format!("input/{name}")));
                    match store.delete(&path).await {
                        Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                        Err(e) => return Err(e.to_string()),
                    }
                }
                Ok(())
            }
        }
    }

    /// Job `id`'s output file `name`, or `None` when it is not there.
    pub async fn read_output(&self, id: &str, name: &str) -> Result<Option<Bytes>, String> {
        match self {
            Self::Local { root } => {
                match tokio::fs::read(JobPaths::new(root, id).output().join(name)).await {
                    Ok(bytes) => Ok(Some(bytes.into())),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                    Err(e) => Err(e.to_string()),
                }
            }
            Self::S3 { store, prefix, .. } => {
                let path = ObjectPath::from(Self::key(prefix, id, &format!("out/{name}")));
                match store.get(&path).await {
                    Ok(result) => result.bytes().await.map(Some).map_err(|e| e.to_string()),
                    Err(object_store::Error::NotFound { .. }) => Ok(None),
                    Err(e) => Err(e.to_string()),
                }
            }
        }
    }

    /// Job `id`'s output files directly under `folder` (`""` for the top level) with their
    /// sizes, named as under the output (`partial/shard_00000.record.safetensors`); empty when
    /// there is none.
    pub async fn list_output(
        &self,
        id: &str,
        folder: &str,
    ) -> Result<BTreeMap<String, u64>, String> {
        let joined = |name: &str| {
            if folder.is_empty() {
                name.to_owned()
            } else {
                format!("{folder}/{name}")
            }
        };
        let mut files = BTreeMap::new();
        match self {
            Self::Local { root } => {
                let dir = JobPaths::new(root, id).output().join(folder);
                let mut entries = match tokio::fs::read_dir(&dir).await {
                    Ok(entries) => entries,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(files),
                    Err(e) => return Err(format!("{}: {e}", dir.display())),
                };
                while let Some(entry) = entries.next_entry().await.map_err(|e| e.to_string())? {
                    let Ok(meta) = entry.metadata().await else {
                        continue; // removed since the listing: not a file any more
                    };
                    if let (true, Some(name)) = (meta.is_file(), entry.file_name().to_str()) {
                        files.insert(joined(name), meta.len());
                    }
                }
            }
            Self::S3 { store, prefix, .. } => {
                let out = Self::key(prefix, id, "out");
                let under = if folder.is_empty() {
                    out.clone()
                } else {
                    format!("{out}/{folder}")
                };
                let listing = store
                    .list_with_delimiter(Some(&ObjectPath::from(under)))
                    .await
                    .map_err(|e| e.to_string())?;
                for object in listing.objects {
                    if let Some(name) = object.location.filename() {
                        files.insert(joined(name), object.size);
                    }
                }
            }
        }
        Ok(files)
    }

    /// The first `len` bytes of job `id`'s output `name` (at most its size, which the caller
    /// has from a listing), or `None` when it is not there.
    pub async fn read_output_head(
        &self,
        id: &str,
        name: &str,
        len: u64,
    ) -> Result<Option<Bytes>, String> {
        match self {
            Self::Local { root } => {
                use tokio::io::AsyncReadExt;
                let path = JobPaths::new(root, id).output().join(name);
                let file = match tokio::fs::File::open(&path).await {
                    Ok(file) => file,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                    Err(e) => return Err(format!("{}: {e}", path.display())),
                };
                let mut head = Vec::new();
                file.take(len)
                    .read_to_end(&mut head)
                    .await
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                Ok(Some(head.into()))
            }
            Self::S3 { store, prefix, .. } => {
                let path = ObjectPath::from(Self::key(prefix, id, &format!("out/{name}")));
                match store.get_range(&path, 0..len).await {
                    Ok(bytes) => Ok(Some(bytes)),
                    Err(object_store::Error::NotFound { .. }) => Ok(None),
                    Err(e) => Err(e.to_string()),
                }
            }
        }
    }

    /// A presigned GET URL for job `id`'s output `name`, valid for `ttl`; `None` for local
    /// storage (the API signs and serves those itself).
    pub async fn presign(
        &self,
        id: &str,
        name: &str,
        ttl: Duration,
    ) -> Result<Option<String>, String> {
        match self {
            Self::Local { .. } => Ok(None),
            Self::S3 { store, prefix, .. } => {
                let path = ObjectPath::from(Self::key(prefix, id, &format!("out/{name}")));
                let ttl = ttl.min(Duration::from_secs(MAX_PRESIGNED_SECONDS));
                store
                    .signed_url(Method::GET, &path, ttl)
                    .await
                    .map(|url| Some(url.to_string()))
                    .map_err(|e| e.to_string())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s3(ttl: u64, env: &[(&str, &str)]) -> Result<Storage, StartupError> {
        let config: StorageConfig = serde_json::from_value(serde_json::json!({
            "kind": "s3", "bucket": "acts", "prefix": "harvest/", "endpoint": "http://minio:9000", "allow_http": true
        }))
        .unwrap();
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect();
        Storage::open(&config, Path::new("/data"), ttl, move |name| {
            env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
        })
    }

    const KEYS: [(&str, &str); 2] = [
        ("HARVEST_S3_ACCESS_KEY_ID", "AKIAHARVEST"),
        ("HARVEST_S3_SECRET_ACCESS_KEY", "secret"),
    ];

    #[tokio::test]
    async fn presigned_urls_are_signed_by_the_configured_key_and_capped_at_seven_days() {
        let storage = s3(MAX_PRESIGNED_SECONDS, &KEYS).unwrap();
        assert_eq!(
            storage.output_location("j1"),
            "s3://acts/harvest/jobs/j1/out"
        );
        let url = storage
            .presign("j1", "manifest.json", Duration::from_secs(30 * 24 * 3600))
            .await
            .unwrap()
            .unwrap();
        assert!(
            url.starts_with("http://minio:9000/acts/harvest/jobs/j1/out/manifest.json?"),
            "{url}"
        );
        assert!(url.contains("X-Amz-Expires=604800"), "{url}");
        assert!(url.contains("X-Amz-Credential=AKIAHARVEST"), "{url}");
        assert!(url.contains("X-Amz-Signature="), "{url}");
    }

    #[test]
    fn a_ttl_over_seven_days_or_a_missing_signing_key_is_refused_with_the_fix() {
        let long = s3(MAX_PRESIGNED_SECONDS + 1, &KEYS)
            .unwrap_err()
            .to_string();
        assert!(long.contains("604801") && long.contains("7 days"), "{long}");
        let missing = s3(3600, &KEYS[..1]).unwrap_err().to_string();
        assert!(
            missing.contains("HARVEST_S3_SECRET_ACCESS_KEY"),
            "{missing}"
        );
    }
}
