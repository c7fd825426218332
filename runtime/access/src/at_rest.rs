//! Encryption at rest for what Tessera writes that others must not read or change
//! unseen: the keys file and the audit log, sealed with ChaCha20-Poly1305 under one
//! 256-bit key. The key comes from `TESSERA_AT_REST_KEY` (64 hex digits) or the file
//! named by `TESSERA_AT_REST_KEY_FILE` (the same, readable by its owner only), or is
//! installed by the process at start ([`install`]: `[security] at_rest_key_file`).
//!
//! - The keys file, sealed, is [`MAGIC`] then a random 12-byte nonce, the ciphertext and
//!   its tag. A plain keys file still loads; the next change writes it sealed.
//! - Each audit line, sealed, is `sealed:` then the hex of nonce, ciphertext and tag;
//!   the hash chain covers the plaintext entries, so `tessera audit verify` checks the
//!   same chain and also names a line that no longer opens.
//!
//! Without a key, sealed files cannot be read: the error says how to provide it.

use std::path::Path;
use std::sync::OnceLock;

use ring::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};

/// The first bytes of a sealed file.
pub const MAGIC: &[u8] = b"TESSERA-SEALED-1\n";
/// The prefix of a sealed audit line.
pub const LINE_PREFIX: &str = "sealed:";
pub const ENV_KEY: &str = "TESSERA_AT_REST_KEY";
pub const ENV_KEY_FILE: &str = "TESSERA_AT_REST_KEY_FILE";

#[derive(Debug, thiserror::Error)]
pub enum AtRestError {
    #[error("{what} is encrypted at rest and no key is set: set {ENV_KEY} (64 hex digits) or {ENV_KEY_FILE}")]
    NoKey { what: String },
    #[error("{what} does not open with the at-rest key: a different key, or the bytes were changed")]
    Unauthentic { what: String },
    #[error("the at-rest key {0}")]
    BadKey(String),
    #[error("no random source: {0}")]
    Random(#[from] getrandom::Error),
}

/// The key that seals files at rest.
pub struct AtRestKey(LessSafeKey);

impl std::fmt::Debug for AtRestKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AtRestKey(..)")
    }
}

impl AtRestKey {
    /// A key from 64 hex digits.
    pub fn from_hex(text: &str) -> Result<AtRestKey, AtRestError> {
        let bytes = crate::unhex(text.trim()).filter(|b| b.len() == 32);
        let bytes = bytes.ok_or_else(|| AtRestError::BadKey("must be 64 hex digits (32 bytes)".into()))?;
        let key = UnboundKey::new(&CHACHA20_POLY1305, &bytes).map_err(|_| AtRestError::BadKey("is refused".into()))?;
        Ok(AtRestKey(LessSafeKey::new(key)))
    }

    /// A key from a file holding 64 hex digits, readable by its owner only.
    pub fn from_file(path: &Path) -> Result<AtRestKey, AtRestError> {
        use std::os::unix::fs::PermissionsExt;
        let bad = |why: String| AtRestError::BadKey(format!("file {}: {why}", path.display()));
        let meta = std::fs::metadata(path).map_err(|e| bad(e.to_string()))?;
        if meta.permissions().mode() & 0o077 != 0 {
            return Err(bad(format!("can be read by other users; chmod 600 {}", path.display())));
        }
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        AtRestKey::from_hex(&text).map_err(|e| bad(e.to_string()))
    }

    /// A fresh key, as hex (`tessera keys gen-at-rest`).
    pub fn generate_hex() -> Result<String, AtRestError> {
        Ok(crate::hex(&crate::random_bytes::<32>()?))
    }

    /// `plain` sealed: nonce, ciphertext, tag.
    pub fn seal(&self, aad: &[u8], plain: &[u8]) -> Result<Vec<u8>, AtRestError> {
        let nonce: [u8; NONCE_LEN] = crate::random_bytes()?;
        let mut out = nonce.to_vec();
        let mut body = plain.to_vec();
        // Fails only past 2^38 bytes.
        self.0
            .seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::from(aad), &mut body)
            .map_err(|_| AtRestError::BadKey("cannot seal".into()))?;
        out.extend_from_slice(&body);
        Ok(out)
    }

    /// What [`AtRestKey::seal`] sealed, if it opens under this key and `aad`.
    pub fn open(&self, aad: &[u8], sealed: &[u8], what: &str) -> Result<Vec<u8>, AtRestError> {
        let unauthentic = || AtRestError::Unauthentic { what: what.to_owned() };
        let (nonce, body) = sealed.split_at_checked(NONCE_LEN).ok_or_else(unauthentic)?;
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| unauthentic())?;
        let mut body = body.to_vec();
        let plain = self.0.open_in_place(nonce, Aad::from(aad), &mut body).map_err(|_| unauthentic())?;
        Ok(plain.to_vec())
    }
}

static INSTALLED: OnceLock<AtRestKey> = OnceLock::new();
static FROM_ENV: OnceLock<Option<AtRestKey>> = OnceLock::new();

/// Makes `key` this process's at-rest key (before anything is read or written); `false`
/// if one was installed already.
pub fn install(key: AtRestKey) -> bool {
    INSTALLED.set(key).is_ok()
}

/// This process's at-rest key: the installed one, else the environment's. A malformed
/// key in the environment is reported once and treated as none (reads of sealed files
/// then fail saying so).
pub fn key() -> Option<&'static AtRestKey> {
    INSTALLED.get().or_else(|| {
        FROM_ENV
            .get_or_init(|| {
                let key = match (std::env::var(ENV_KEY), std::env::var_os(ENV_KEY_FILE)) {
                    (Ok(hex), _) => AtRestKey::from_hex(&hex),
                    (_, Some(path)) => AtRestKey::from_file(Path::new(&path)),
                    _ => return None,
                };
                key.inspect_err(|e| eprintln!("tessera: {ENV_KEY}/{ENV_KEY_FILE} ignored: {e}")).ok()
            })
            .as_ref()
    })
}

/// A whole file's bytes as written: sealed when a key is set.
pub(crate) fn seal_file(plain: Vec<u8>) -> Result<Vec<u8>, AtRestError> {
    match key() {
        None => Ok(plain),
        Some(key) => {
            let mut out = MAGIC.to_vec();
            out.extend(key.seal(MAGIC, &plain)?);
            Ok(out)
        }
    }
}

/// A whole file's plaintext: opened when it was sealed.
pub(crate) fn open_file(bytes: Vec<u8>, what: &str) -> Result<Vec<u8>, AtRestError> {
    let Some(sealed) = bytes.strip_prefix(MAGIC) else { return Ok(bytes) };
    let key = key().ok_or_else(|| AtRestError::NoKey { what: what.to_owned() })?;
    key.open(MAGIC, sealed, what)
}

const LINE_AAD: &[u8] = b"tessera-audit-line";

/// An audit line as written: sealed when a key is set.
pub(crate) fn seal_line(line: String) -> Result<String, AtRestError> {
    match key() {
        None => Ok(line),
        Some(key) => Ok(format!("{LINE_PREFIX}{}", crate::hex(&key.seal(LINE_AAD, line.as_bytes())?))),
    }
}

/// An audit line's plaintext: opened when it was sealed.
pub(crate) fn open_line(line: &[u8], what: &str) -> Result<Vec<u8>, AtRestError> {
    let Some(hex) = line.strip_prefix(LINE_PREFIX.as_bytes()) else { return Ok(line.to_vec()) };
    let key = key().ok_or_else(|| AtRestError::NoKey { what: what.to_owned() })?;
    let sealed = std::str::from_utf8(hex).ok().and_then(crate::unhex);
    let sealed = sealed.ok_or_else(|| AtRestError::Unauthentic { what: what.to_owned() })?;
    key.open(LINE_AAD, &sealed, what)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_bytes_open_only_under_their_key_and_unchanged() {
        let key = AtRestKey::from_hex(&"11".repeat(32)).expect("key");
        let other = AtRestKey::from_hex(&"22".repeat(32)).expect("key");
        let sealed = key.seal(b"ad", b"the audit entry").expect("seal");
        assert!(!sealed.windows(5).any(|w| w == b"audit"), "in clear");
        assert_eq!(key.open(b"ad", &sealed, "x").expect("opens"), b"the audit entry");
        assert!(matches!(other.open(b"ad", &sealed, "x"), Err(AtRestError::Unauthentic { .. })));
        assert!(key.open(b"other ad", &sealed, "x").is_err());
        for i in 0..sealed.len() {
            let mut bad = sealed.clone();
            bad[i] ^= 1;
            assert!(key.open(b"ad", &bad, "x").is_err(), "byte {i}");
        }
        assert!(key.open(b"ad", &sealed[..5], "x").is_err());
        for bad in ["", "zz", &"1".repeat(63), &"1".repeat(66)] {
            assert!(AtRestKey::from_hex(bad).is_err(), "{bad:?}");
        }
    }
}
