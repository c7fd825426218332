//! API keys. A key is `tsk_<id>_<secret>`: a public id (what lists, logs and audit
//! entries name) and 256 random bits. The keys file keeps, per key, its id, tenant, role,
//! a random salt and SHA-256(salt ‖ secret) — never the secret, which is shown once when
//! the key is made. A request's key is found by its id and checked against its hash in
//! constant time, so checking costs the same at ten keys or ten thousand.
//!
//! Revoking a key marks it (the record stays, for `list` and the audit trail); the
//! gateway re-reads the file when it changes, so neither needs a restart.

use crate::files;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fmt;
use std::path::Path;

/// What a key may do. Ordered: each role may do what the ones before it may.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The OpenAI API (`/v1/*`).
    User,
    /// Also every `/admin/*` route: roles, fault drills, plans.
    Operator,
    /// Everything an operator may, and managing keys.
    Admin,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::User, Role::Operator, Role::Admin];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::User => "user",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Role, String> {
        Role::ALL
            .into_iter()
            .find(|role| role.as_str() == s)
            .ok_or_else(|| format!("`{s}` is not a role; roles: user, operator, admin"))
    }
}

/// One key as the keys file holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyRecord {
    pub id: String,
    pub tenant: String,
    pub role: Role,
    /// The operator's label for the key (who holds it), if any.
    #[serde(default)]
    pub name: Option<String>,
    /// Hex of 16 random bytes.
    pub salt: String,
    /// Hex of SHA-256(salt ‖ secret).
    pub hash: String,
    pub created_unix: u64,
    #[serde(default)]
    pub revoked_unix: Option<u64>,
}

/// The keys file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeysFile {
    pub version: u32,
    pub keys: Vec<KeyRecord>,
}

const FILE_VERSION: u32 = 1;
const PREFIX: &str = "tsk_";
/// Bytes of a key's id and secret.
const ID_BYTES: usize = 6;
const SECRET_BYTES: usize = 32;
const SALT_BYTES: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    #[error("keys file {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("keys file {path} is not a keys file: {source}")]
    Parse { path: String, source: serde_json::Error },
    #[error("keys file {path}: version {found} is not one this build reads (it reads {FILE_VERSION})")]
    Version { path: String, found: u32 },
    #[error("keys file {path}: key {index} (`{id}`): {why}")]
    Record { path: String, index: usize, id: String, why: String },
    #[error("no key `{id}` in {path}")]
    NoSuchKey { path: String, id: String },
    #[error("key `{id}` was revoked already (at {revoked_unix} s since the epoch)")]
    AlreadyRevoked { id: String, revoked_unix: u64 },
    #[error("the operating system's random source failed: {0}")]
    Random(getrandom::Error),
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    AtRest(#[from] crate::at_rest::AtRestError),
}

/// Who a request's key says it comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The key's public id, for logs and the audit trail.
    pub key_id: String,
    pub tenant: String,
    pub role: Role,
}

/// Why a request was not authenticated. Its `Display` is what the client reads: it never
/// says whether an id exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error(
        "You didn't provide an API key. Send it in an Authorization header as `Bearer YOUR_KEY` (keys are made with `tessera keys add`)."
    )]
    Missing,
    #[error("Incorrect API key provided.")]
    Invalid,
    #[error("The API key provided has been revoked.")]
    Revoked,
}

impl AuthError {
    /// A bounded label for metrics and the audit log.
    pub fn reason(self) -> &'static str {
        match self {
            AuthError::Missing => "missing",
            AuthError::Invalid => "invalid",
            AuthError::Revoked => "revoked",
        }
    }
}

/// A key's id and secret, parsed from its text.
fn split_key(key: &str) -> Option<(&str, &str)> {
    let (id, secret) = key.strip_prefix(PREFIX)?.split_once('_')?;
    let ok = |s: &str, bytes: usize| s.len() == 2 * bytes && s.bytes().all(|b| b.is_ascii_hexdigit());
    (ok(id, ID_BYTES) && ok(secret, SECRET_BYTES)).then_some((id, secret))
}

fn salted_hash(salt: &[u8], secret: &str) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(salt);
    h.update(secret.as_bytes());
    h.finalize().into()
}

/// Equal bytes, in time independent of where they differ.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A new key for `tenant` with `role`: its record, and its text (shown once).
pub fn generate(tenant: &str, role: Role, name: Option<String>) -> Result<(KeyRecord, String), KeysError> {
    let id = crate::hex(&crate::random_bytes::<ID_BYTES>().map_err(KeysError::Random)?);
    let secret = crate::hex(&crate::random_bytes::<SECRET_BYTES>().map_err(KeysError::Random)?);
    let salt = crate::random_bytes::<SALT_BYTES>().map_err(KeysError::Random)?;
    let record = KeyRecord {
        id: id.clone(),
        tenant: tenant.to_owned(),
        role,
        name,
        salt: crate::hex(&salt),
        hash: crate::hex(&salted_hash(&salt, &secret)),
        created_unix: crate::unix_now_s(),
        revoked_unix: None,
    };
    Ok((record, format!("{PREFIX}{id}_{secret}")))
}

/// A tenant name is what the topology's `[[tenants]]` names: letters, digits, `-`, `_`, `.`.
pub fn check_tenant_name(tenant: &str) -> Result<(), String> {
    let ok = !tenant.is_empty()
        && tenant.len() <= 64
        && tenant.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok { Ok(()) } else { Err(format!("`{tenant}` is not a tenant name (1-64 of a-z, A-Z, 0-9, `-`, `_`, `.`)")) }
}

/// A checked record: its salt and hash decoded.
#[derive(Debug, Clone)]
struct Entry {
    record: KeyRecord,
    salt: Vec<u8>,
    hash: Vec<u8>,
}

/// The keys of a keys file, ready to check requests against.
#[derive(Debug, Clone, Default)]
pub struct KeyStore {
    by_id: HashMap<String, Entry>,
}

impl KeyStore {
    /// Reads and checks a keys file; a missing file is an error (the caller decides
    /// whether it may be missing).
    pub fn load(path: &Path) -> Result<KeyStore, KeysError> {
        KeyStore::from_file(&read(path)?, path)
    }

    /// A store of `records` (checked as a keys file's would be).
    pub fn from_records(records: Vec<KeyRecord>) -> Result<KeyStore, KeysError> {
        KeyStore::from_file(&KeysFile { version: FILE_VERSION, keys: records }, Path::new("(in memory)"))
    }

    fn from_file(file: &KeysFile, path: &Path) -> Result<KeyStore, KeysError> {
        let mut by_id = HashMap::with_capacity(file.keys.len());
        for (index, record) in file.keys.iter().enumerate() {
            let bad =
                |why: String| KeysError::Record { path: path.display().to_string(), index, id: record.id.clone(), why };
            let salt = crate::unhex(&record.salt).filter(|s| s.len() == SALT_BYTES);
            let hash = crate::unhex(&record.hash).filter(|h| h.len() == 32);
            let (Some(salt), Some(hash)) = (salt, hash) else {
                return Err(bad("its salt or hash is not the hex of 16 or 32 bytes".into()));
            };
            check_tenant_name(&record.tenant).map_err(bad)?;
            if by_id.insert(record.id.clone(), Entry { record: record.clone(), salt, hash }).is_some() {
                return Err(bad("the id is listed twice".into()));
            }
        }
        Ok(KeyStore { by_id })
    }

    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// The identity of the key in an `Authorization` header's value (`Bearer KEY`).
    pub fn authenticate(&self, authorization: Option<&str>) -> Result<Identity, AuthError> {
        let key = bearer(authorization)?;
        let (id, secret) = split_key(key).ok_or(AuthError::Invalid)?;
        let entry = self.by_id.get(id).ok_or(AuthError::Invalid)?;
        if !constant_time_eq(&salted_hash(&entry.salt, secret), &entry.hash) {
            return Err(AuthError::Invalid);
        }
        if entry.record.revoked_unix.is_some() {
            return Err(AuthError::Revoked);
        }
        Ok(Identity { key_id: entry.record.id.clone(), tenant: entry.record.tenant.clone(), role: entry.record.role })
    }

    /// The records, by id.
    pub fn records(&self) -> Vec<&KeyRecord> {
        let mut records: Vec<&KeyRecord> = self.by_id.values().map(|e| &e.record).collect();
        records.sort_by(|a, b| a.id.cmp(&b.id));
        records
    }
}

/// The key of an `Authorization: Bearer KEY` header value.
pub(crate) fn bearer(authorization: Option<&str>) -> Result<&str, AuthError> {
    let value = authorization.map(str::trim).filter(|v| !v.is_empty()).ok_or(AuthError::Missing)?;
    let (scheme, key) = value.split_once(' ').ok_or(AuthError::Invalid)?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Err(AuthError::Invalid);
    }
    Ok(key.trim())
}

fn read(path: &Path) -> Result<KeysFile, KeysError> {
    let text = std::fs::read(path).map_err(|source| KeysError::Io { path: path.display().to_string(), source })?;
    let text = crate::at_rest::open_file(text, &format!("keys file {}", path.display()))?;
    let file: KeysFile = serde_json::from_slice(&text)
        .map_err(|source| KeysError::Parse { path: path.display().to_string(), source })?;
    if file.version != FILE_VERSION {
        return Err(KeysError::Version { path: path.display().to_string(), found: file.version });
    }
    Ok(file)
}

/// Reads the keys file for a change (empty if it does not exist yet), applies `change`,
/// checks the result and writes it back whole, holding the file's lock throughout.
fn change<T>(path: &Path, change: impl FnOnce(&mut KeysFile) -> Result<T, KeysError>) -> Result<T, KeysError> {
    let io = |source| KeysError::Io { path: path.display().to_string(), source };
    files::ensure_dir(path.parent().unwrap_or(Path::new(""))).map_err(io)?;
    let _lock = files::lock(path).map_err(io)?;
    let mut file = match read(path) {
        Ok(file) => file,
        Err(KeysError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            KeysFile { version: FILE_VERSION, keys: Vec::new() }
        }
        Err(e) => return Err(e),
    };
    let out = change(&mut file)?;
    KeyStore::from_file(&file, path)?;
    let mut bytes = serde_json::to_vec_pretty(&file).map_err(|e| KeysError::Invalid(e.to_string()))?;
    bytes.push(b'\n');
    let bytes = crate::at_rest::seal_file(bytes)?;
    files::write_private(path, &bytes).map_err(io)?;
    Ok(out)
}

/// Adds a new key to the keys file (creating it, private, if missing); returns its record
/// and its text.
pub fn add(path: &Path, tenant: &str, role: Role, name: Option<String>) -> Result<(KeyRecord, String), KeysError> {
    check_tenant_name(tenant).map_err(KeysError::Invalid)?;
    change(path, |file| {
        let (record, key) = generate(tenant, role, name)?;
        file.keys.push(record.clone());
        Ok((record, key))
    })
}

/// Marks key `id` revoked; returns its record.
pub fn revoke(path: &Path, id: &str) -> Result<KeyRecord, KeysError> {
    change(path, |file| {
        let record = file
            .keys
            .iter_mut()
            .find(|r| r.id == id)
            .ok_or_else(|| KeysError::NoSuchKey { path: path.display().to_string(), id: id.to_owned() })?;
        if let Some(revoked_unix) = record.revoked_unix {
            return Err(KeysError::AlreadyRevoked { id: id.to_owned(), revoked_unix });
        }
        record.revoked_unix = Some(crate::unix_now_s());
        Ok(record.clone())
    })
}

/// The keys file's size and modification time: what a watcher compares to see a change.
pub fn stamp(path: &Path) -> Option<(u64, std::time::SystemTime)> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.len(), meta.modified().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_authenticates_until_revoked_and_nothing_else_does() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.json");
        let (alice, alice_key) = add(&path, "team-a", Role::User, Some("alice".into())).unwrap();
        let (_, ops_key) = add(&path, "team-a", Role::Operator, None).unwrap();
        let store = KeyStore::load(&path).unwrap();
        assert_eq!(store.len(), 2);
        let who = store.authenticate(Some(&format!("Bearer {alice_key}"))).unwrap();
        assert_eq!(who, Identity { key_id: alice.id.clone(), tenant: "team-a".into(), role: Role::User });
        assert_eq!(store.authenticate(Some(&format!("bearer  {ops_key} "))).unwrap().role, Role::Operator);
        // (header value, expected refusal)
        let flipped = if alice_key.ends_with('0') { '1' } else { '0' };
        let wrong_secret = format!("{}{flipped}", &alice_key[..alice_key.len() - 1]);
        let table: Vec<(Option<String>, AuthError)> = vec![
            (None, AuthError::Missing),
            (Some("  ".into()), AuthError::Missing),
            (Some(alice_key.clone()), AuthError::Invalid),
            (Some(format!("Basic {alice_key}")), AuthError::Invalid),
            (Some("Bearer tsk_nothing".into()), AuthError::Invalid),
            (Some(format!("Bearer {wrong_secret}")), AuthError::Invalid),
            (Some(format!("Bearer tsk_{}_{}", "0".repeat(12), "0".repeat(64))), AuthError::Invalid),
        ];
        for (header, want) in table {
            assert_eq!(store.authenticate(header.as_deref()), Err(want), "{header:?}");
        }
        revoke(&path, &alice.id).unwrap();
        let store = KeyStore::load(&path).unwrap();
        assert_eq!(store.authenticate(Some(&format!("Bearer {alice_key}"))), Err(AuthError::Revoked));
        assert!(matches!(revoke(&path, &alice.id), Err(KeysError::AlreadyRevoked { .. })));
        assert!(matches!(revoke(&path, "nope"), Err(KeysError::NoSuchKey { .. })));
        // The file holds no secret, and only its owner may read it.
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains(&alice_key[16..]), "the secret is not stored");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
    }

    #[test]
    fn a_damaged_keys_file_is_refused_naming_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.json");
        let (record, _) = add(&path, "t", Role::User, None).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, text.replace(&record.hash, "xyz")).unwrap();
        let err = KeyStore::load(&path).unwrap_err().to_string();
        assert!(err.contains(&record.id) && err.contains("hex"), "{err}");
        std::fs::write(&path, "{").unwrap();
        assert!(KeyStore::load(&path).unwrap_err().to_string().contains("is not a keys file"));
        // A change to a damaged file is refused, and the file is left as it was.
        assert!(add(&path, "t", Role::User, None).is_err());
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{");
        assert!(add(&path, "bad name", Role::User, None).unwrap_err().to_string().contains("not a tenant name"));
    }

    #[test]
    fn roles_are_ordered_and_parse() {
        assert!(Role::User < Role::Operator && Role::Operator < Role::Admin);
        for role in Role::ALL {
            assert_eq!(role.as_str().parse::<Role>(), Ok(role));
        }
        assert!("root".parse::<Role>().unwrap_err().contains("user, operator, admin"));
    }
}
