//! The admin token `tessera up` makes when the cluster has no keys file, so that admin
//! routes are never open: a fresh random token per start, in a private file under
//! `$TESSERA_HOME/admin/` named by the gateway's address, where the CLI on the same
//! machine finds it.

use crate::files;
use crate::keys::{AuthError, Identity, Role, bearer, constant_time_eq};
use sha2::{Digest, Sha256};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// The key id the audit log and the logs give the generated token.
pub const TOKEN_ID: &str = "generated-admin-token";
const PREFIX: &str = "tsa_";

/// Where the admin token of the gateway listening on `gateway` is kept.
pub fn path(home: &Path, gateway: SocketAddr) -> PathBuf {
    home.join("admin").join(format!("{}.token", file_stem(gateway)))
}

/// A file name for what belongs to the gateway at `gateway`: `127.0.0.1_8000`
/// (an IPv6 address's colons and brackets as `-`).
pub fn file_stem(gateway: SocketAddr) -> String {
    format!("{}_{}", gateway.ip(), gateway.port()).replace([':', '[', ']'], "-")
}

/// What the gateway checks requests against: the token's hash, not the token.
#[derive(Clone)]
pub struct AdminToken {
    hash: [u8; 32],
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(..)")
    }
}

impl AdminToken {
    /// Makes a new token for `gateway` and writes it (private) under `home`, replacing any
    /// token of an earlier start; returns it and its file.
    pub fn create(home: &Path, gateway: SocketAddr) -> std::io::Result<(AdminToken, PathBuf)> {
        let secret = crate::random_bytes::<32>().map_err(std::io::Error::other)?;
        let token = format!("{PREFIX}{}", crate::hex(&secret));
        let file = path(home, gateway);
        let dir = file.parent().unwrap_or(home);
        files::ensure_dir(dir)?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
        files::write_private(&file, format!("{token}\n").as_bytes())?;
        Ok((AdminToken { hash: Sha256::digest(token.as_bytes()).into() }, file))
    }

    /// The admin identity, if the header carries this token.
    pub fn authenticate(&self, authorization: Option<&str>) -> Result<Identity, AuthError> {
        let token = bearer(authorization)?;
        if !token.starts_with(PREFIX) {
            return Err(AuthError::Invalid);
        }
        if !constant_time_eq(&Sha256::digest(token.as_bytes()), &self.hash) {
            return Err(AuthError::Invalid);
        }
        Ok(Identity { key_id: TOKEN_ID.to_owned(), tenant: String::new(), role: Role::Admin })
    }
}

/// The token of the gateway at `gateway` made on this machine, if there is one.
pub fn read(home: &Path, gateway: SocketAddr) -> Option<String> {
    let text = std::fs::read_to_string(path(home, gateway)).ok()?;
    let token = text.trim();
    token.starts_with(PREFIX).then(|| token.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_of_this_start_is_the_only_one_accepted() {
        let home = tempfile::tempdir().unwrap();
        let addr: SocketAddr = "127.0.0.1:8000".parse().unwrap();
        let (first, _) = AdminToken::create(home.path(), addr).unwrap();
        let old = read(home.path(), addr).unwrap();
        assert_eq!(first.authenticate(Some(&format!("Bearer {old}"))).unwrap().role, Role::Admin);
        let (second, file) = AdminToken::create(home.path(), addr).unwrap();
        let new = read(home.path(), addr).unwrap();
        assert_ne!(old, new);
        assert_eq!(second.authenticate(Some(&format!("Bearer {old}"))), Err(AuthError::Invalid));
        assert!(second.authenticate(Some(&format!("Bearer {new}"))).is_ok());
        assert_eq!(second.authenticate(None), Err(AuthError::Missing));
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(file).unwrap().permissions().mode() & 0o777, 0o600);
        // Another gateway's token is another file.
        assert_eq!(read(home.path(), "127.0.0.1:8001".parse().unwrap()), None);
    }
}
