//! What the benchmarks need to measure a secured plane: the mode and cipher, fresh host
//! keys for both ends in a private directory removed afterwards, and each end's settings.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tessera_runtime::HostId;
use tessera_runtime::security::{Cipher, HostKeyError, HostKeypair, Keyring, Mode, PlaneSecurity};

/// A secured plane to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BenchSecurity {
    pub mode: Mode,
    pub cipher: Cipher,
}

impl BenchSecurity {
    /// "off", or the mode and cipher, for tables.
    pub fn label(security: Option<BenchSecurity>) -> String {
        security.map_or("off".into(), |s| format!("{} {}", s.mode.name(), s.cipher))
    }

    /// The peer's flags for these settings and keys.
    pub(crate) fn to_args(self, keys: &Path) -> Vec<String> {
        vec![
            "--mode".into(),
            self.mode.name().into(),
            "--cipher".into(),
            self.cipher.to_string(),
            "--keys-dir".into(),
            keys.display().to_string(),
        ]
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SecuredError {
    #[error("benchmark host keys: {0}")]
    Keys(#[from] HostKeyError),
    #[error("no random source for the benchmark's key directory: {0}")]
    Random(#[from] getrandom::Error),
}

pub(crate) const MAIN_NAME: &str = "bench-main";
pub(crate) const PEER_NAME: &str = "bench-peer";

/// The settings of the end named `me`, keys in `dir` (both ends' are there).
pub(crate) fn plane_security(
    sec: BenchSecurity,
    dir: &Path,
    me: &str,
    main: HostId,
    peer: HostId,
) -> Result<PlaneSecurity, SecuredError> {
    let hosts = vec![(main, MAIN_NAME.to_string()), (peer, PEER_NAME.to_string())];
    Ok(PlaneSecurity {
        mode: sec.mode,
        cipher: sec.cipher,
        identity: Arc::new(HostKeypair::load(dir, me)?),
        keyring: Arc::new(Keyring::new(hosts, Default::default(), Some(dir.to_path_buf()))),
    })
}

/// A private directory with both ends' keys, removed on drop.
pub(crate) struct KeysDir(pub PathBuf);

impl KeysDir {
    pub(crate) fn new() -> Result<KeysDir, SecuredError> {
        let nonce: [u8; 8] = tessera_access::random_bytes()?;
        let keys = KeysDir(std::env::temp_dir().join(format!("tessera-bench-keys-{}", u64::from_le_bytes(nonce))));
        for name in [MAIN_NAME, PEER_NAME] {
            HostKeypair::generate()?.write(&keys.0, name)?;
        }
        Ok(keys)
    }
}

impl Drop for KeysDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
