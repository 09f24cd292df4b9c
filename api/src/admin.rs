//! The key and account commands of `harvest-api` (`create-key`, `list-keys`, `revoke-key`), on
//! whichever backend the configuration names: the SQLite store, or key Secrets on Kubernetes.

use std::fmt::Write;

use crate::config::ServerConfig;
use crate::error::StartupError;
use crate::keys::KeyInfo;
use crate::kubernetes;
use crate::paths::now;
use crate::server::open_store;

/// Why an admin command failed.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// The store or configuration could not be opened.
    #[error(transparent)]
    Startup(#[from] StartupError),
    /// The store refused.
    #[error(transparent)]
    Store(#[from] crate::embedded::store::StoreError),
    /// The cluster refused.
    #[error(transparent)]
    Kube(#[from] kubernetes::KubeBackendError),
    /// The cluster client could not be made.
    #[error("kubernetes client: {0}")]
    Client(String),
    /// Nothing matched what was to be revoked.
    #[error("{0}")]
    NothingToRevoke(String),
}

/// What `revoke-key` revokes.
#[derive(Debug, Clone)]
pub enum Revoke {
    /// One key, by its plaintext.
    Key(String),
    /// Every active key with this label, of one account when given.
    Label {
        /// The label.
        label: String,
        /// The account, needed when the label names keys of several.
        account: Option<String>,
    },
}

async fn client() -> Result<kube::Client, AdminError> {
    kube::Client::try_default()
        .await
        .map_err(|e| AdminError::Client(e.to_string()))
}

/// Creates a key for `account` (or stores `import`, a key made elsewhere) and returns it.
pub async fn create_key(
    config: &ServerConfig,
    account: &str,
    label: &str,
    import: Option<&str>,
) -> Result<String, AdminError> {
    if let Some(cluster) = &config.kubernetes {
        let key = kubernetes::create_key(
            client().await?,
            cluster.keys_namespace(),
            account,
            label,
            import,
        )
        .await?;
        return Ok(key);
    }
    let store = open_store(config)?;
    match import {
        Some(key) => {
            store.import_key(account, label, key, now())?;
            Ok(key.to_owned())
        }
        None => Ok(store.create_key(account, label, now())?),
    }
}

/// The keys, newest first, as a table: account, label, prefix, created, last used, state.
pub async fn list_keys(config: &ServerConfig, account: Option<&str>) -> Result<String, AdminError> {
    let keys = match &config.kubernetes {
        Some(cluster) => {
            kubernetes::list_keys(client().await?, cluster.keys_namespace(), account).await?
        }
        None => open_store(config)?.list_keys(account)?,
    };
    Ok(key_table(&keys))
}

/// Revokes a key, or every key of a label; says how many.
pub async fn revoke(config: &ServerConfig, what: &Revoke) -> Result<usize, AdminError> {
    let revoked = match (&config.kubernetes, what) {
        (Some(cluster), Revoke::Key(key)) => usize::from(
            kubernetes::revoke_key(client().await?, cluster.keys_namespace(), key).await?,
        ),
        (Some(cluster), Revoke::Label { label, account }) => {
            kubernetes::revoke_label(
                client().await?,
                cluster.keys_namespace(),
                label,
                account.as_deref(),
            )
            .await?
        }
        (None, Revoke::Key(key)) => usize::from(open_store(config)?.revoke_key(key, now())?),
        (None, Revoke::Label { label, account }) => {
            open_store(config)?.revoke_label(label, account.as_deref(), now())?
        }
    };
    if revoked == 0 {
        return Err(AdminError::NothingToRevoke(match what {
            Revoke::Key(_) => "no such active key".into(),
            Revoke::Label { label, .. } => {
                format!("no active key is labelled {label:?}: list-keys shows the labels")
            }
        }));
    }
    Ok(revoked)
}

fn key_table(keys: &[KeyInfo]) -> String {
    let time =
        |t: Option<harvest_core::clock::UnixMillis>| t.map_or("-".to_owned(), |t| t.to_iso8601());
    let mut out = String::from("ACCOUNT\tLABEL\tKEY\tCREATED\tLAST USED\tSTATE\n");
    for key in keys {
        let state = if key.revoked_at.is_some() {
            "revoked"
        } else {
            "active"
        };
        let prefix = if key.prefix.is_empty() {
            "-".to_owned()
        } else {
            format!("{}…", key.prefix)
        };
        let _ = writeln!(
            out,
            "{}\t{}\t{prefix}\t{}\t{}\t{state}",
            key.account,
            if key.label.is_empty() {
                "-"
            } else {
                &key.label
            },
            key.created_at.to_iso8601(),
            time(key.last_used),
        );
    }
    out
}
