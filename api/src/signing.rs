//! Download links the server signs and serves itself: HMAC-SHA256 over job, file and expiry,
//! with a secret generated on first start and kept in the data directory. Links need no key.

use std::path::Path;

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Why a link is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    /// Past its expiry.
    #[error("this link has expired: ask the API for the job again to get fresh links")]
    Expired,
    /// The signature does not match (tampered or foreign).
    #[error("this link's signature is invalid")]
    Invalid,
}

/// Signs and checks download links.
#[derive(Clone)]
pub struct Signer {
    secret: Vec<u8>,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Signer(<secret>)")
    }
}

impl Signer {
    /// Reads the secret at `path`, creating it (32 random bytes, hex) on first use.
    pub fn load_or_create(path: &Path) -> std::io::Result<Self> {
        if let Ok(text) = std::fs::read_to_string(path) {
            let secret: Vec<u8> = (0..text.trim().len() / 2)
                .filter_map(|i| u8::from_str_radix(text.trim().get(2 * i..2 * i + 2)?, 16).ok())
                .collect();
            if secret.len() >= 32 {
                return Ok(Self { secret });
            }
        }
        let secret: Vec<u8> = uuid::Uuid::new_v4()
            .as_bytes()
            .iter()
            .chain(uuid::Uuid::new_v4().as_bytes())
            .copied()
            .collect();
        let hex: String = secret.iter().map(|b| format!("{b:02x}")).collect();
        crate::paths::write_private(path, hex.as_bytes())?;
        Ok(Self { secret })
    }

    /// A signer with a given secret (tests).
    pub fn with_secret(secret: &[u8]) -> Self {
        Self {
            secret: secret.to_vec(),
        }
    }

    fn mac(&self, job: &str, file: &str, expires: i64) -> Hmac<Sha256> {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.secret)
            .expect("HMAC accepts keys of any length. This is a bug.");
        mac.update(format!("{job}\n{file}\n{expires}").as_bytes());
        mac
    }

    /// The signature of a link, hex.
    pub fn sign(&self, job: &str, file: &str, expires: i64) -> String {
        self.mac(job, file, expires)
            .finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// A full link: `{base}/files/{job}/{file}?expires={unix seconds}&sig={hex}`.
    pub fn url(&self, base: &str, job: &str, file: &str, expires: i64) -> String {
        format!(
            "{}/files/{job}/{file}?expires={expires}&sig={}",
            base.trim_end_matches('/'),
            self.sign(job, file, expires)
        )
    }

    /// Checks a link's signature (in constant time) and expiry.
    pub fn verify(
        &self,
        job: &str,
        file: &str,
        expires: i64,
        sig: &str,
        now_s: i64,
    ) -> Result<(), LinkError> {
        // Exactly the 64 hex digits `sign` writes: nothing appended, nothing skipped.
        if sig.len() != 64 || !sig.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(LinkError::Invalid);
        }
        let bytes: Vec<u8> = (0..32)
            .filter_map(|i| u8::from_str_radix(sig.get(2 * i..2 * i + 2)?, 16).ok())
            .collect();
        self.mac(job, file, expires)
            .verify_slice(&bytes)
            .map_err(|_| LinkError::Invalid)?;
        if now_s >= expires {
            return Err(LinkError::Expired);
        }
        Ok(())
    }
}

/// The links this server signs, served by its own `/files` route.
#[derive(Debug, Clone)]
pub struct Links {
    /// The signer.
    pub signer: Signer,
    /// The base URL clients reach this server at.
    pub public_url: String,
}

impl Links {
    /// A link to `file` of job `job` that works until `expires` (Unix seconds).
    pub fn url(&self, job: &str, file: &str, expires: i64) -> String {
        self.signer.url(&self.public_url, job, file, expires)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signed_link_verifies_until_it_expires_and_tampering_is_caught() {
        let signer = Signer::with_secret(b"0123456789abcdef0123456789abcdef");
        let sig = signer.sign("job", "shard_00000.safetensors", 1_000);
        assert_eq!(
            signer.verify("job", "shard_00000.safetensors", 1_000, &sig, 999),
            Ok(())
        );
        assert_eq!(
            signer.verify("job", "shard_00000.safetensors", 1_000, &sig, 1_000),
            Err(LinkError::Expired)
        );
        assert_eq!(
            signer.verify("job", "shard_00001.safetensors", 1_000, &sig, 10),
            Err(LinkError::Invalid)
        );
        assert_eq!(
            signer.verify("job", "shard_00000.safetensors", 9_999, &sig, 10),
            Err(LinkError::Invalid)
        );
        assert_eq!(
            signer.verify("job", "shard_00000.safetensors", 1_000, "zz", 10),
            Err(LinkError::Invalid)
        );
    }

    #[test]
    fn a_signature_with_junk_appended_or_a_digit_missing_is_refused() {
        let signer = Signer::with_secret(b"0123456789abcdef0123456789abcdef");
        let sig = signer.sign("job", "manifest.json", 1_000);
        assert_eq!(sig.len(), 64);
        for bad in [
            format!("{sig}zz"),
            format!("{sig}00"),
            sig[..63].to_owned(),
            format!("{}g", &sig[..63]),
            sig.to_uppercase()
                .replace(|c: char| c.is_ascii_digit(), "x"),
        ] {
            assert_eq!(
                signer.verify("job", "manifest.json", 1_000, &bad, 10),
                Err(LinkError::Invalid),
                "{bad}"
            );
        }
        assert_eq!(
            signer.verify("job", "manifest.json", 1_000, &sig, 10),
            Ok(())
        );
    }

    #[test]
    fn the_secret_persists_across_restarts_and_only_its_owner_can_read_it() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        let first = Signer::load_or_create(&path).unwrap().sign("j", "f", 1);
        let second = Signer::load_or_create(&path).unwrap().sign("j", "f", 1);
        assert_eq!(first, second);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
    }
}
