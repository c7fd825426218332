//! Who may use a cluster, and a record of what they did: API keys kept as salted hashes
//! in a keys file (`tessera keys add|list|revoke`), the admin token `tessera up` makes
//! when there is no keys file, and the append-only audit log whose entries each carry the
//! hash of the one before (`tessera audit verify`).
//!
//! Plain files and hashing only: no actors, no HTTP, no async. The gateway (an adapter)
//! and the CLI call it; admission (a behavior) sees only the tenant a key resolved to.
#![forbid(unsafe_code)]

pub mod at_rest;
pub mod audit;
pub mod files;
pub mod keys;
pub mod token;

pub use audit::{AuditError, AuditLog, VerifyError, VerifyReport, verify};
pub use keys::{AuthError, Identity, KeyRecord, KeyStore, KeysError, Role};

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(2 * bytes.len());
    for b in bytes {
        out.push(DIGITS[usize::from(b >> 4)] as char);
        out.push(DIGITS[usize::from(b & 15)] as char);
    }
    out
}

/// The bytes of lower- or upper-case hex, `None` if it is not hex of whole bytes.
pub fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    text.as_bytes().chunks_exact(2).map(|pair| Some(digit(pair[0])? << 4 | digit(pair[1])?)).collect()
}

/// `n` bytes from the operating system's random source.
pub fn random_bytes<const N: usize>() -> Result<[u8; N], getrandom::Error> {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes)?;
    Ok(bytes)
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn unix_now_s() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    #[test]
    fn hex_round_trips() {
        let bytes = [0u8, 1, 0x7f, 0x80, 0xfe, 0xff];
        assert_eq!(super::hex(&bytes), "00017f80feff");
        assert_eq!(super::unhex("00017F80feff").as_deref(), Some(&bytes[..]));
        for bad in ["0", "0g", "xyz1"] {
            assert_eq!(super::unhex(bad), None, "{bad}");
        }
    }
}
