//! Host identities: each host's static X25519 keypair, and the keyring of the public
//! keys a cluster lists.
//!
//! Files (what `tessera keys gen-host` writes): `<dir>/<host>.key` holds the private key
//! in hex and is readable by its owner only (a key others can read is refused, as ssh
//! refuses one); `<dir>/<host>.pub` holds the public key in hex. The keyring takes a
//! host's keys from the topology (inline) and from `<dir>/<host>.pub`, and re-reads the
//! directory when a key it does not know connects, so a host restarted with a new key
//! rejoins once its `.pub` is in place, without restarting the others.

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use snow::resolvers::{CryptoResolver, DefaultResolver};

use crate::addr::HostId;

pub const PUBLIC_KEY_BYTES: usize = 32;
pub type PublicKey = [u8; PUBLIC_KEY_BYTES];

#[derive(Debug, thiserror::Error)]
pub enum HostKeyError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a host key: expected {bytes} bytes in hex")]
    Malformed { path: PathBuf, bytes: usize },
    #[error(
        "{path} can be read by other users (mode {mode:o}); a host's private key must be private: chmod 600 {path}"
    )]
    NotPrivate { path: PathBuf, mode: u32 },
    #[error("{path} already exists; remove it first to replace this host's key")]
    Exists { path: PathBuf },
    #[error("no random source: {0}")]
    Random(getrandom::Error),
    #[error("no X25519 implementation")]
    NoDh,
}

/// One host's static keypair.
pub struct HostKeypair {
    private: [u8; 32],
    public: PublicKey,
}

impl std::fmt::Debug for HostKeypair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostKeypair(public {})", tessera_access::hex(&self.public))
    }
}

impl HostKeypair {
    pub fn generate() -> Result<HostKeypair, HostKeyError> {
        HostKeypair::from_private(tessera_access::random_bytes::<32>().map_err(HostKeyError::Random)?)
    }

    pub fn from_private(private: [u8; 32]) -> Result<HostKeypair, HostKeyError> {
        let mut dh = DefaultResolver.resolve_dh(&snow::params::DHChoice::Curve25519).ok_or(HostKeyError::NoDh)?;
        dh.set(&private);
        let public = dh.pubkey().try_into().map_err(|_| HostKeyError::NoDh)?;
        Ok(HostKeypair { private, public })
    }

    pub fn public(&self) -> &PublicKey {
        &self.public
    }

    pub(crate) fn private(&self) -> &[u8; 32] {
        &self.private
    }

    /// Reads `<dir>/<host>.key`.
    pub fn load(dir: &Path, host: &str) -> Result<HostKeypair, HostKeyError> {
        let path = private_key_path(dir, host);
        let meta = std::fs::metadata(&path).map_err(|source| HostKeyError::Read { path: path.clone(), source })?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(HostKeyError::NotPrivate { path, mode });
        }
        HostKeypair::from_private(read_hex_key(&path)?)
    }

    /// Writes `<dir>/<host>.key` (owner-only) and `<dir>/<host>.pub`; never replaces a
    /// private key.
    pub fn write(&self, dir: &Path, host: &str) -> Result<(PathBuf, PathBuf), HostKeyError> {
        let (key, public) = (private_key_path(dir, host), public_key_path(dir, host));
        if key.exists() {
            return Err(HostKeyError::Exists { path: key });
        }
        let write = |path: &Path, bytes: &[u8]| {
            tessera_access::files::ensure_dir(dir)
                .and_then(|()| tessera_access::files::write_private(path, bytes))
                .map_err(|source| HostKeyError::Write { path: path.to_path_buf(), source })
        };
        write(&key, format!("{}\n", tessera_access::hex(&self.private)).as_bytes())?;
        write(&public, format!("{}\n", tessera_access::hex(&self.public)).as_bytes())?;
        // A public key is for sharing.
        let _ = std::fs::set_permissions(&public, std::fs::Permissions::from_mode(0o644));
        Ok((key, public))
    }
}

pub fn private_key_path(dir: &Path, host: &str) -> PathBuf {
    dir.join(format!("{host}.key"))
}

pub fn public_key_path(dir: &Path, host: &str) -> PathBuf {
    dir.join(format!("{host}.pub"))
}

/// A key in hex (64 digits, surrounding whitespace ignored).
pub fn parse_public_key(text: &str) -> Option<PublicKey> {
    tessera_access::unhex(text.trim())?.try_into().ok()
}

fn read_hex_key(path: &Path) -> Result<[u8; 32], HostKeyError> {
    let text = std::fs::read_to_string(path).map_err(|source| HostKeyError::Read { path: path.into(), source })?;
    parse_public_key(&text).ok_or(HostKeyError::Malformed { path: path.into(), bytes: 32 })
}

/// The public keys a cluster lists, by host.
pub struct Keyring {
    hosts: Vec<(HostId, String)>,
    inline: HashMap<HostId, PublicKey>,
    dir: Option<PathBuf>,
    from_dir: RwLock<HashMap<HostId, PublicKey>>,
    last_read: Mutex<Option<Instant>>,
}

/// A directory is re-read at most this often, however many unknown keys knock.
const REREAD_EVERY: Duration = Duration::from_secs(1);

impl Keyring {
    /// `hosts` are the cluster's (id, name); `inline` the keys the topology gives;
    /// `dir`, if any, holds `<name>.pub` files.
    pub fn new(hosts: Vec<(HostId, String)>, inline: HashMap<HostId, PublicKey>, dir: Option<PathBuf>) -> Keyring {
        let ring = Keyring { hosts, inline, dir, from_dir: RwLock::new(HashMap::new()), last_read: Mutex::new(None) };
        ring.read_dir();
        ring
    }

    /// Hosts that have no key listed (inline or in the directory).
    pub fn missing(&self) -> Vec<String> {
        let from_dir = self.from_dir.read();
        self.hosts
            .iter()
            .filter(|(id, _)| !self.inline.contains_key(id) && !from_dir.contains_key(id))
            .map(|(_, name)| name.clone())
            .collect()
    }

    fn read_dir(&self) {
        let Some(dir) = &self.dir else { return };
        *self.last_read.lock() = Some(Instant::now());
        let mut keys = HashMap::new();
        for (id, name) in &self.hosts {
            let path = public_key_path(dir, name);
            match read_hex_key(&path) {
                Ok(key) => {
                    keys.insert(*id, key);
                }
                Err(HostKeyError::Read { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!("host key ignored: {e}"),
            }
        }
        *self.from_dir.write() = keys;
    }

    fn lookup(&self, key: &PublicKey) -> Option<HostId> {
        let inline = self.inline.iter().find(|(_, k)| *k == key).map(|(id, _)| *id);
        inline.or_else(|| self.from_dir.read().iter().find(|(_, k)| *k == key).map(|(id, _)| *id))
    }

    /// The host `key` belongs to; re-reads the directory (at most once a second) before
    /// saying none.
    pub fn host_of(&self, key: &[u8]) -> Option<HostId> {
        let key: &PublicKey = key.try_into().ok()?;
        if let Some(host) = self.lookup(key) {
            return Some(host);
        }
        let stale = self.last_read.lock().is_none_or(|t| t.elapsed() >= REREAD_EVERY);
        if self.dir.is_some() && stale {
            self.read_dir();
            return self.lookup(key);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_written_private_read_back_and_never_replaced() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pair = HostKeypair::generate().expect("keypair");
        let (key, public) = pair.write(dir.path(), "h0").expect("written");
        assert_eq!(std::fs::metadata(&key).expect("key").permissions().mode() & 0o777, 0o600);
        let again = HostKeypair::load(dir.path(), "h0").expect("loads");
        assert_eq!(again.public(), pair.public());
        assert_eq!(parse_public_key(&std::fs::read_to_string(public).expect("pub")), Some(*pair.public()));
        assert!(matches!(pair.write(dir.path(), "h0"), Err(HostKeyError::Exists { .. })));

        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let err = HostKeypair::load(dir.path(), "h0").unwrap_err();
        assert!(err.to_string().contains("chmod 600"), "{err}");
        std::fs::write(dir.path().join("h1.key"), "nothex").expect("write");
        std::fs::set_permissions(dir.path().join("h1.key"), std::fs::Permissions::from_mode(0o600)).expect("chmod");
        assert!(matches!(HostKeypair::load(dir.path(), "h1"), Err(HostKeyError::Malformed { .. })));
    }

    #[test]
    fn the_keyring_finds_hosts_by_key_and_picks_up_a_new_key_from_the_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (a, b, b2) = (HostKeypair::generate(), HostKeypair::generate(), HostKeypair::generate());
        let (a, b, b2) = (a.expect("a"), b.expect("b"), b2.expect("b2"));
        b.write(dir.path(), "b").expect("b written");
        let hosts = vec![(HostId(0), "a".to_string()), (HostId(1), "b".to_string()), (HostId(2), "c".to_string())];
        let ring = Keyring::new(hosts, HashMap::from([(HostId(0), *a.public())]), Some(dir.path().into()));
        assert_eq!(ring.host_of(a.public()), Some(HostId(0)));
        assert_eq!(ring.host_of(b.public()), Some(HostId(1)));
        assert_eq!(ring.missing(), vec!["c".to_string()]);
        assert_eq!(ring.host_of(&[1; 31]), None, "a short key is nobody's");

        // b gets a new key; the ring sees it once the directory is re-read.
        std::fs::remove_file(dir.path().join("b.key")).expect("rm");
        b2.write(dir.path(), "b").expect("b2 written");
        *ring.last_read.lock() = None;
        assert_eq!(ring.host_of(b2.public()), Some(HostId(1)));
        assert_eq!(ring.host_of(b.public()), None, "the old key is no longer listed");
    }
}
