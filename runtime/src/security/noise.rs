//! The handshake that opens a secured link: Noise XX over X25519 (ChaChaPoly, BLAKE2s),
//! both hosts proving their static keys, then the initiator granting the frame keys.
//!
//! ```text
//! initiator (DEALER)                 responder (ROUTER)
//!   Hello      -> e
//!              <- e, ee, s, es        HelloReply   (initiator checks s is the peer's listed key)
//!   HelloDone  -> s, se + grants      (responder checks s is some listed host's key)
//!              <- Refused             only if it was not
//! ```
//!
//! The grants, inside the encrypted last message: the key for this link's direct frames
//! and the initiator's current broadcast key. Both are fresh random keys, so each link
//! and each broadcast epoch has keys of its own; later keys travel in sealed control
//! frames. The prologue binds the mode and cipher: hosts configured differently fail the
//! handshake instead of talking past each other.

use snow::{Builder, HandshakeState};

use super::Mode;
use super::aead::{Cipher, KEY_BYTES};
use super::frame::{self, Kind, Reject};
use super::keys::{HostKeypair, Keyring};
use crate::addr::HostId;

const PATTERN: &str = "Noise_XX_25519_ChaChaPoly_BLAKE2s";
/// Noise's own limit on one message.
const MAX_NOISE_BYTES: usize = 65_535;

#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("not a handshake frame: {0}")]
    Frame(#[from] Reject),
    #[error("handshake failed (a peer with another mode or cipher, or a corrupt message): {0}")]
    Noise(#[from] snow::Error),
    #[error("the peer's key {key} is not listed for any host of this cluster")]
    UnknownKey { key: String },
    #[error("the peer presented the key of host {got}, not of {expected}")]
    WrongHost { expected: HostId, got: HostId },
    #[error("malformed key grants")]
    Grants,
}

impl HandshakeError {
    /// A bounded label for `tessera_bus_handshakes_total{outcome}`.
    pub fn outcome(&self) -> &'static str {
        match self {
            HandshakeError::UnknownKey { .. } | HandshakeError::WrongHost { .. } => "refused_key",
            _ => "failed",
        }
    }
}

/// Which key a grant is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum GrantKind {
    /// Seals the frames of the link it travels on.
    Direct = 0,
    /// Seals the granting host's broadcasts of one epoch.
    Broadcast = 1,
}

/// A key handed to a peer.
#[derive(Clone, PartialEq, Eq)]
pub struct Grant {
    pub kind: GrantKind,
    pub epoch: u32,
    pub key: [u8; KEY_BYTES],
}

impl std::fmt::Debug for Grant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Grant({:?}, epoch {})", self.kind, self.epoch)
    }
}

impl Grant {
    pub fn fresh(kind: GrantKind, epoch: u32) -> Result<Grant, getrandom::Error> {
        Ok(Grant { kind, epoch, key: tessera_access::random_bytes()? })
    }
}

const GRANT_BYTES: usize = 1 + 4 + KEY_BYTES;

pub fn encode_grants(grants: &[Grant]) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + grants.len() * GRANT_BYTES);
    out.push(grants.len() as u8);
    for g in grants {
        out.push(g.kind as u8);
        out.extend_from_slice(&g.epoch.to_be_bytes());
        out.extend_from_slice(&g.key);
    }
    out
}

pub fn decode_grants(bytes: &[u8]) -> Result<Vec<Grant>, HandshakeError> {
    let (&n, rest) = bytes.split_first().ok_or(HandshakeError::Grants)?;
    if rest.len() != usize::from(n) * GRANT_BYTES {
        return Err(HandshakeError::Grants);
    }
    rest.chunks_exact(GRANT_BYTES)
        .map(|g| {
            let kind = match g[0] {
                0 => GrantKind::Direct,
                1 => GrantKind::Broadcast,
                _ => return Err(HandshakeError::Grants),
            };
            let epoch = u32::from_be_bytes([g[1], g[2], g[3], g[4]]);
            let key = g[5..].try_into().map_err(|_| HandshakeError::Grants)?;
            Ok(Grant { kind, epoch, key })
        })
        .collect()
}

fn prologue(mode: Mode, cipher: Cipher) -> Vec<u8> {
    format!("tessera-bus/1 {} {}", mode.name(), cipher.as_str()).into_bytes()
}

fn builder<'a>(me: &'a HostKeypair, prologue: &'a [u8]) -> Result<Builder<'a>, HandshakeError> {
    let params = PATTERN.parse().map_err(HandshakeError::Noise)?;
    Ok(Builder::new(params).local_private_key(me.private()).prologue(prologue))
}

fn write(hs: &mut HandshakeState, payload: &[u8]) -> Result<Vec<u8>, HandshakeError> {
    let mut out = vec![0u8; MAX_NOISE_BYTES];
    let n = hs.write_message(payload, &mut out)?;
    out.truncate(n);
    Ok(out)
}

fn read(hs: &mut HandshakeState, message: &[u8]) -> Result<Vec<u8>, HandshakeError> {
    let mut out = vec![0u8; MAX_NOISE_BYTES];
    let n = hs.read_message(message, &mut out)?;
    out.truncate(n);
    Ok(out)
}

/// The connecting side, between its Hello and the peer's reply.
pub struct Initiator {
    hs: HandshakeState,
    mode: Mode,
}

impl Initiator {
    /// Starts a handshake; returns the Hello frame to send.
    pub fn start(me: &HostKeypair, mode: Mode, cipher: Cipher) -> Result<(Initiator, Vec<u8>), HandshakeError> {
        let prologue = prologue(mode, cipher);
        let mut hs = builder(me, &prologue)?.build_initiator()?;
        let hello = frame::handshake_frame(Kind::Hello, mode, &write(&mut hs, &[])?);
        Ok((Initiator { hs, mode }, hello))
    }

    /// Takes the peer's reply, checks it is `peer`'s listed key (any listed host's when
    /// `None`), and returns the HelloDone frame carrying `grants`.
    pub fn finish(
        mut self,
        reply: &[u8],
        ring: &Keyring,
        peer: Option<HostId>,
        grants: &[Grant],
    ) -> Result<Vec<u8>, HandshakeError> {
        read(&mut self.hs, frame::handshake_body(reply, Kind::HelloReply, self.mode)?)?;
        let key = self.hs.get_remote_static().unwrap_or_default();
        match (ring.host_of(key), peer) {
            (Some(host), Some(peer)) if host != peer => {
                return Err(HandshakeError::WrongHost { expected: peer, got: host });
            }
            (Some(_), _) => {}
            (None, _) => return Err(HandshakeError::UnknownKey { key: tessera_access::hex(key) }),
        }
        Ok(frame::handshake_frame(Kind::HelloDone, self.mode, &write(&mut self.hs, &encode_grants(grants))?))
    }
}

/// The accepting side, between its reply and the peer's HelloDone.
pub struct Responder {
    hs: HandshakeState,
    mode: Mode,
}

impl Responder {
    /// Takes a Hello; returns the reply frame to send.
    pub fn reply(
        me: &HostKeypair,
        mode: Mode,
        cipher: Cipher,
        hello: &[u8],
    ) -> Result<(Responder, Vec<u8>), HandshakeError> {
        let prologue = prologue(mode, cipher);
        let mut hs = builder(me, &prologue)?.build_responder()?;
        read(&mut hs, frame::handshake_body(hello, Kind::Hello, mode)?)?;
        let reply = frame::handshake_frame(Kind::HelloReply, mode, &write(&mut hs, &[])?);
        Ok((Responder { hs, mode }, reply))
    }

    /// Takes the HelloDone: the host the peer proved to be, and the keys it granted.
    pub fn accept(mut self, done: &[u8], ring: &Keyring) -> Result<(HostId, Vec<Grant>), HandshakeError> {
        let payload = read(&mut self.hs, frame::handshake_body(done, Kind::HelloDone, self.mode)?)?;
        let key = self.hs.get_remote_static().unwrap_or_default();
        let host = ring.host_of(key).ok_or_else(|| HandshakeError::UnknownKey { key: tessera_access::hex(key) })?;
        Ok((host, decode_grants(&payload)?))
    }
}

/// The frame a responder sends when it refuses a peer's key (no body: the reason is in
/// the responder's log and metrics, not told to a stranger).
pub fn refused_frame(mode: Mode) -> Vec<u8> {
    frame::handshake_frame(Kind::Refused, mode, &[])
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn ring(keys: &[(u16, &HostKeypair)]) -> Keyring {
        let hosts = keys.iter().map(|(id, _)| (HostId(*id), format!("h{id}"))).collect();
        Keyring::new(hosts, keys.iter().map(|(id, k)| (HostId(*id), *k.public())).collect::<HashMap<_, _>>(), None)
    }

    #[test]
    fn listed_hosts_complete_the_handshake_and_the_grants_arrive() {
        let (a, b) = (HostKeypair::generate().expect("a"), HostKeypair::generate().expect("b"));
        let ring = ring(&[(0, &a), (1, &b)]);
        let grants = vec![
            Grant::fresh(GrantKind::Direct, 0).expect("grant"),
            Grant::fresh(GrantKind::Broadcast, 77).expect("grant"),
        ];
        for cipher in [Cipher::ChaCha20Poly1305, Cipher::Sm4Gcm] {
            let (init, hello) = Initiator::start(&a, Mode::Encrypt, cipher).expect("hello");
            let (resp, reply) = Responder::reply(&b, Mode::Encrypt, cipher, &hello).expect("reply");
            let done = init.finish(&reply, &ring, Some(HostId(1)), &grants).expect("done");
            let (host, got) = resp.accept(&done, &ring).expect("accepted");
            assert_eq!(host, HostId(0));
            assert_eq!(got, grants);
            // The grants never travel in clear.
            assert!(!done.windows(KEY_BYTES).any(|w| w == grants[0].key));
        }
    }

    #[test]
    fn an_unlisted_key_is_refused_on_both_sides() {
        let (a, b, stranger) = (
            HostKeypair::generate().expect("a"),
            HostKeypair::generate().expect("b"),
            HostKeypair::generate().expect("s"),
        );
        let ring = ring(&[(0, &a), (1, &b)]);
        let cipher = Cipher::ChaCha20Poly1305;
        // A stranger connecting to b.
        let (init, hello) = Initiator::start(&stranger, Mode::Encrypt, cipher).expect("hello");
        let (resp, reply) = Responder::reply(&b, Mode::Encrypt, cipher, &hello).expect("reply");
        let done = init.finish(&reply, &ring, Some(HostId(1)), &[]).expect("the stranger knows b's key");
        assert_eq!(resp.accept(&done, &ring).unwrap_err().outcome(), "refused_key");
        // a connecting to a stranger posing as b.
        let (init, hello) = Initiator::start(&a, Mode::Encrypt, cipher).expect("hello");
        let (_, reply) = Responder::reply(&stranger, Mode::Encrypt, cipher, &hello).expect("reply");
        assert!(matches!(init.finish(&reply, &ring, Some(HostId(1)), &[]), Err(HandshakeError::UnknownKey { .. })));
        // a connecting to b's address but reaching a (a listed host, not the one meant).
        let (init, hello) = Initiator::start(&a, Mode::Encrypt, cipher).expect("hello");
        let (_, reply) = Responder::reply(&a, Mode::Encrypt, cipher, &hello).expect("reply");
        assert!(matches!(init.finish(&reply, &ring, Some(HostId(1)), &[]), Err(HandshakeError::WrongHost { .. })));
    }

    #[test]
    fn hosts_configured_differently_fail_the_handshake() {
        let (a, b) = (HostKeypair::generate().expect("a"), HostKeypair::generate().expect("b"));
        let ring = ring(&[(0, &a), (1, &b)]);
        let (init, hello) = Initiator::start(&a, Mode::Encrypt, Cipher::Sm4Gcm).expect("hello");
        let (_, reply) = Responder::reply(&b, Mode::Encrypt, Cipher::ChaCha20Poly1305, &hello).expect("reply");
        assert_eq!(init.finish(&reply, &ring, Some(HostId(1)), &[]).unwrap_err().outcome(), "failed");
        let (_, hello) = Initiator::start(&a, Mode::Authenticate, Cipher::Sm4Gcm).expect("hello");
        assert!(matches!(
            Responder::reply(&b, Mode::Encrypt, Cipher::Sm4Gcm, &hello),
            Err(HandshakeError::Frame(Reject::Mode))
        ));
        for junk in [&b""[..], b"T", b"\x00\x01\x02", &[b'T', 1, 2, 0xff, 0xee]] {
            assert!(Responder::reply(&b, Mode::Encrypt, Cipher::Sm4Gcm, junk).is_err());
        }
        assert!(decode_grants(&[2, 0, 0]).is_err());
    }
}
