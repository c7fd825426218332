//! Securing the planes between hosts: host identities (static X25519 keys, listed in the
//! topology), a Noise handshake per connection, and an AEAD on every frame after it
//! (ChaCha20-Poly1305 or SM4-GCM), with counter nonces, a replay window and rekeying.
//!
//! Invariant: a frame is handed on only if it was sealed by a host whose key the
//! cluster lists, under a key that host granted to us, and never before; anything else
//! (plaintext, random bytes, a replay, a flipped bit, an unlisted key) is dropped and
//! counted, never a panic, never a stall.

pub mod aead;
pub mod frame;
pub mod keys;
pub mod noise;

use std::sync::Arc;

pub use aead::Cipher;
pub use keys::{HostKeyError, HostKeypair, Keyring, PublicKey};

/// What the planes guarantee (`[security] mode`; "off" is no [`PlaneSecurity`] at all).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Peers prove their keys and every frame carries a tag; bodies travel in clear.
    Authenticate,
    /// As `Authenticate`, and bodies are encrypted.
    Encrypt,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Authenticate => "authenticate",
            Mode::Encrypt => "encrypt",
        }
    }

    fn wire_byte(self) -> u8 {
        match self {
            Mode::Authenticate => 1,
            Mode::Encrypt => 2,
        }
    }

    fn from_wire_byte(b: u8) -> Option<Mode> {
        match b {
            1 => Some(Mode::Authenticate),
            2 => Some(Mode::Encrypt),
            _ => None,
        }
    }
}

/// How one host secures its links: what it guarantees, with which cipher, as whom, and
/// whom it accepts.
#[derive(Clone)]
pub struct PlaneSecurity {
    pub mode: Mode,
    pub cipher: Cipher,
    pub identity: Arc<HostKeypair>,
    pub keyring: Arc<Keyring>,
}

impl std::fmt::Debug for PlaneSecurity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlaneSecurity")
            .field("mode", &self.mode)
            .field("cipher", &self.cipher)
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}
