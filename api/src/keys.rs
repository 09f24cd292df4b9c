//! API keys, as both backends keep them: only a key's sha256 is stored, the formats a key to
//! import may have, and what `list-keys` shows of one.

use harvest_core::clock::UnixMillis;
use sha2::{Digest, Sha256};

/// The hash under which a key is stored: hex sha256 of the key.
pub fn key_hash(key: &str) -> String {
    Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// How many characters of a key after its scheme (`sk-hv-`, `sk-acs-`, `acs-bm-`) are kept
/// to tell keys apart in `list-keys`.
const SHOWN_KEY_CHARS: usize = 4;

/// The key formats `create-key --import` takes: ours, the hosted service's, and its old
/// platform's, each a scheme and at least 16 characters of letters, digits, `-` or `_`.
pub const KEY_SCHEMES: [&str; 3] = ["sk-hv-", "sk-acs-", "acs-bm-"];

/// Checks a key to import against [`KEY_SCHEMES`].
pub fn check_key_format(key: &str) -> Result<(), String> {
    let body = KEY_SCHEMES
        .iter()
        .find_map(|scheme| key.strip_prefix(scheme))
        .ok_or_else(|| {
            format!(
                "a key to import starts with {}; this one starts with {:?}",
                KEY_SCHEMES.join(", "),
                key.chars().take(7).collect::<String>()
            )
        })?;
    if body.len() < 16
        || !body
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(format!(
            "after its scheme a key has at least 16 letters, digits, '-' or '_'; this one has {} characters{}",
            body.len(),
            if body
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                ""
            } else {
                ", some of them others"
            }
        ));
    }
    Ok(())
}

/// What `list-keys` shows of a key: its scheme and first characters, never the whole key.
pub fn shown_prefix(key: &str) -> String {
    let scheme = KEY_SCHEMES
        .iter()
        .find(|scheme| key.starts_with(*scheme))
        .map_or(0, |scheme| scheme.len());
    key.chars().take(scheme + SHOWN_KEY_CHARS).collect()
}

/// A key as `list-keys` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyInfo {
    /// Its account.
    pub account: String,
    /// Its label.
    pub label: String,
    /// Its scheme and first characters (empty for keys made before prefixes were kept).
    pub prefix: String,
    /// When it was made.
    pub created_at: UnixMillis,
    /// When it last authenticated a request (to the minute), if ever.
    pub last_used: Option<UnixMillis>,
    /// When it was revoked, if it was.
    pub revoked_at: Option<UnixMillis>,
}

/// A fresh API key: `sk-hv-` and 64 random hex digits.
pub fn new_key() -> String {
    format!(
        "sk-hv-{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// Why a label that names keys of several accounts cannot say which keys to revoke.
pub fn ambiguous_label(label: &str, accounts: &[String]) -> String {
    format!(
        "label {label:?} names keys of accounts {}: add --account to say whose",
        accounts.join(", ")
    )
}
