//! The bus's secured mode: who may talk, and the keys that seal what they say.
//!
//! - Direct links: each DEALER connection opens with a Noise handshake
//!   ([`crate::security::noise`]); the ROUTER keeps one session per authenticated
//!   connection (keyed by its ZeroMQ identity) and one live session per peer host. Frames
//!   on the connection are sealed with the key the initiator granted in its last
//!   handshake message; a fresh key follows in a sealed control frame every
//!   `rekey_after_frames`.
//! - Broadcasts: each host seals its PUB frames with its own epoch key and hands the key
//!   to every peer over its direct links (in the handshake, and again on rotation, ahead
//!   of using it). Subscribers hold one opener per publisher.
//!
//! Nothing here trusts a frame before its tag verified: unknown identities, unlisted keys,
//! replays and flipped bits are refused with a reason the bus counts.

use std::collections::HashMap;
use std::time::Instant;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::watch;

use crate::addr::HostId;
use crate::security::PlaneSecurity;
use crate::security::frame::{self, Kind, Opener, Reject, Sealer};
use crate::security::noise::{self, Grant, GrantKind, HandshakeError, Responder};

/// What the receive side holds: the settings, and every publisher's broadcast keys.
pub(super) struct Secured {
    pub sec: PlaneSecurity,
    groups: HashMap<HostId, Mutex<Opener>>,
}

impl Secured {
    pub fn new(sec: PlaneSecurity, peers: impl Iterator<Item = HostId>) -> Secured {
        Secured { sec, groups: peers.map(|h| (h, Mutex::new(Opener::new()))).collect() }
    }

    /// The envelope bytes inside a broadcast frame from `peer`'s PUB.
    pub fn open_broadcast(&self, peer: HostId, sealed: &[u8]) -> Result<Vec<u8>, Reject> {
        let header = frame::Header::parse(sealed)?;
        if header.kind != Kind::Broadcast || header.host != peer.0 {
            return Err(Reject::NoKey);
        }
        let mut opener = self.groups.get(&peer).ok_or(Reject::NoKey)?.lock();
        if opener.is_empty() {
            return Err(Reject::AwaitingKey);
        }
        opener.open(self.sec.mode, sealed).map(|(_, body)| body)
    }

    fn install(&self, host: HostId, grants: &[Grant], direct: &mut Opener) {
        for g in grants {
            match g.kind {
                GrantKind::Direct => direct.install(self.sec.cipher, g.epoch, &g.key),
                GrantKind::Broadcast => {
                    if let Some(opener) = self.groups.get(&host) {
                        opener.lock().install(self.sec.cipher, g.epoch, &g.key);
                    }
                }
            }
        }
    }
}

/// What the ROUTER does with one frame.
pub(super) enum Inbound {
    /// An envelope's bytes from an authenticated `host`.
    Deliver { host: HostId, envelope: Vec<u8> },
    /// Send this frame back to the connection (a handshake step or a refusal).
    Reply(Vec<u8>),
    /// Handled (keys installed).
    Done,
}

/// Why the ROUTER refused a frame.
pub(super) enum Refusal {
    Frame(Reject),
    /// A handshake that failed; `reply` tells the initiator it was refused.
    Handshake {
        error: HandshakeError,
        reply: Option<Vec<u8>>,
    },
}

struct Session {
    host: HostId,
    opener: Opener,
}

/// Pending handshakes kept at once; a flood of Hellos evicts the oldest.
const MAX_PENDING: usize = 64;

/// The ROUTER task's sessions, by connection identity.
pub(super) struct Sessions {
    own: HostId,
    live: HashMap<Bytes, Session>,
    pending: HashMap<Bytes, (Responder, Instant)>,
    handshake_timeout: std::time::Duration,
}

impl Sessions {
    pub fn new(own: HostId, handshake_timeout: std::time::Duration) -> Sessions {
        Sessions { own, live: HashMap::new(), pending: HashMap::new(), handshake_timeout }
    }

    pub fn on_frame(&mut self, secured: &Secured, identity: &Bytes, sealed: &[u8]) -> Result<Inbound, Refusal> {
        let mode = secured.sec.mode;
        match frame::kind_of(sealed) {
            Some(Kind::Hello) => {
                let (responder, reply) = Responder::reply(&secured.sec.identity, mode, secured.sec.cipher, sealed)
                    .map_err(|error| Refusal::Handshake { error, reply: None })?;
                self.pending.retain(|_, (_, t)| t.elapsed() < self.handshake_timeout);
                if self.pending.len() >= MAX_PENDING
                    && let Some(oldest) = self.pending.iter().min_by_key(|(_, (_, t))| *t).map(|(id, _)| id.clone())
                {
                    self.pending.remove(&oldest);
                }
                self.pending.insert(identity.clone(), (responder, Instant::now()));
                Ok(Inbound::Reply(reply))
            }
            Some(Kind::HelloDone) => {
                let Some((responder, _)) = self.pending.remove(identity) else {
                    return Err(Refusal::Frame(Reject::NoKey));
                };
                let refuse = |error| Refusal::Handshake { error, reply: Some(noise::refused_frame(mode)) };
                let (host, grants) = responder.accept(sealed, &secured.sec.keyring).map_err(refuse)?;
                if host == self.own {
                    return Err(refuse(HandshakeError::WrongHost { expected: self.own, got: host }));
                }
                // One live link per peer: its older connections are gone or going.
                self.live.retain(|_, s| s.host != host);
                let mut opener = Opener::new();
                secured.install(host, &grants, &mut opener);
                self.live.insert(identity.clone(), Session { host, opener });
                tracing::info!(peer = %host, "bus peer authenticated");
                Ok(Inbound::Done)
            }
            Some(Kind::Data | Kind::Control) => {
                let session = self.live.get_mut(identity).ok_or(Refusal::Frame(Reject::NoKey))?;
                let (header, body) = session.opener.open(mode, sealed).map_err(Refusal::Frame)?;
                if header.host != session.host.0 {
                    return Err(Refusal::Frame(Reject::NoKey));
                }
                if header.kind == Kind::Data {
                    return Ok(Inbound::Deliver { host: session.host, envelope: body });
                }
                let grants = noise::decode_grants(&body).map_err(|_| Refusal::Frame(Reject::Unsealed))?;
                let host = session.host;
                secured.install(host, &grants, &mut session.opener);
                Ok(Inbound::Done)
            }
            _ => Err(Refusal::Frame(Reject::Unsealed)),
        }
    }

    /// Is `identity` an authenticated connection? (tests)
    #[cfg(test)]
    pub fn is_live(&self, identity: &Bytes) -> bool {
        self.live.contains_key(identity)
    }
}

/// This host's broadcast keys: the publisher seals with them; dealers hand them out.
pub(super) struct BroadcastKeys {
    sealer: Sealer,
    current: Grant,
    next: Option<Grant>,
    rekey_after: u64,
    granted: watch::Sender<Vec<Grant>>,
}

impl BroadcastKeys {
    pub fn new(sec: &PlaneSecurity, own: HostId, rekey_after: u64) -> Result<BroadcastKeys, getrandom::Error> {
        // A random first epoch: a restarted host never reuses its previous life's epochs.
        let epoch = u32::from_be_bytes(tessera_access::random_bytes()?) >> 1;
        let current = Grant::fresh(GrantKind::Broadcast, epoch)?;
        let sealer = Sealer::new(sec.mode, sec.cipher, own.0, epoch, &current.key).rekey_after(rekey_after);
        let (granted, _) = watch::channel(vec![current.clone()]);
        Ok(BroadcastKeys { sealer, current, next: None, rekey_after, granted })
    }

    /// What dealers watch: the grants peers need to open our broadcasts.
    pub fn subscribe(&self) -> watch::Receiver<Vec<Grant>> {
        self.granted.subscribe()
    }

    /// Seals one broadcast. The next key is granted a good while before it is used
    /// (an eighth of a key's share ahead), so peers hold it by then.
    pub fn seal(&mut self, cipher: crate::security::Cipher, envelope: &[u8]) -> Vec<u8> {
        let lead = (self.rekey_after / 8).max(1);
        if self.next.is_none()
            && self.sealer.used() + lead >= self.rekey_after
            && let Ok(next) = Grant::fresh(GrantKind::Broadcast, self.current.epoch.wrapping_add(1))
        {
            self.next = Some(next.clone());
            self.granted.send_replace(vec![self.current.clone(), next]);
        }
        if self.sealer.needs_rekey()
            && let Some(next) = self.next.take()
        {
            self.sealer.rekey(cipher, next.epoch, &next.key);
            self.current = next;
            self.granted.send_replace(vec![self.current.clone()]);
        }
        self.sealer.seal(Kind::Broadcast, envelope)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Arc;

    use super::*;
    use crate::security::noise::Initiator;
    use crate::security::{Cipher, HostKeypair, Keyring, Mode};

    fn cluster(n: u16) -> (Vec<PlaneSecurity>, Vec<Arc<HostKeypair>>) {
        let pairs: Vec<_> = (0..n).map(|_| Arc::new(HostKeypair::generate().expect("key"))).collect();
        let hosts: Vec<_> = (0..n).map(|i| (HostId(i), format!("h{i}"))).collect();
        let inline: HashMap<_, _> = (0..n).map(|i| (HostId(i), *pairs[usize::from(i)].public())).collect();
        let ring = Arc::new(Keyring::new(hosts, inline, None));
        let secs = pairs
            .iter()
            .map(|p| PlaneSecurity {
                mode: Mode::Encrypt,
                cipher: Cipher::ChaCha20Poly1305,
                identity: p.clone(),
                keyring: ring.clone(),
            })
            .collect();
        (secs, pairs)
    }

    /// Host 0 connects to host 1's ROUTER; returns host 1's sessions and host 0's sealer.
    fn connect(secs: &[PlaneSecurity], responder: &Secured, id: &Bytes) -> (Sessions, Sealer, Vec<Grant>) {
        let mut sessions = Sessions::new(HostId(1), std::time::Duration::from_secs(5));
        let s0 = &secs[0];
        let (init, hello) = Initiator::start(&s0.identity, s0.mode, s0.cipher).expect("hello");
        let Ok(Inbound::Reply(reply)) = sessions.on_frame(responder, id, &hello) else { panic!("no reply") };
        let grants = vec![
            Grant::fresh(GrantKind::Direct, 5).expect("grant"),
            Grant::fresh(GrantKind::Broadcast, 40).expect("grant"),
        ];
        let done = init.finish(&reply, &s0.keyring, Some(HostId(1)), &grants).expect("done");
        assert!(matches!(sessions.on_frame(responder, id, &done), Ok(Inbound::Done)));
        let sealer = Sealer::new(s0.mode, s0.cipher, 0, 5, &grants[0].key);
        (sessions, sealer, grants)
    }

    #[test]
    fn an_authenticated_link_delivers_and_a_replay_or_a_stranger_is_refused() {
        let (secs, _) = cluster(3);
        let responder = Secured::new(secs[1].clone(), [HostId(0), HostId(2)].into_iter());
        let id = Bytes::from_static(b"conn-1");
        let (mut sessions, mut sealer, grants) = connect(&secs, &responder, &id);
        assert!(sessions.is_live(&id));

        let frame = sealer.seal(Kind::Data, b"envelope");
        let Ok(Inbound::Deliver { host, envelope }) = sessions.on_frame(&responder, &id, &frame) else {
            panic!("not delivered")
        };
        assert_eq!((host, envelope.as_slice()), (HostId(0), &b"envelope"[..]));
        assert!(matches!(sessions.on_frame(&responder, &id, &frame), Err(Refusal::Frame(Reject::Replayed))));
        // The same frame on another connection: no session there.
        let other = Bytes::from_static(b"conn-2");
        assert!(matches!(sessions.on_frame(&responder, &other, &frame), Err(Refusal::Frame(Reject::NoKey))));
        // Plain MessagePack or junk on an authenticated connection.
        assert!(matches!(sessions.on_frame(&responder, &id, b"\x87junk"), Err(Refusal::Frame(Reject::Unsealed))));
        // The broadcast key granted in the handshake opens host 0's broadcasts.
        let mut publisher = Sealer::new(Mode::Encrypt, Cipher::ChaCha20Poly1305, 0, 40, &grants[1].key);
        let event = publisher.seal(Kind::Broadcast, b"heartbeat");
        assert_eq!(responder.open_broadcast(HostId(0), &event).expect("opens"), b"heartbeat");
        assert!(responder.open_broadcast(HostId(2), &event).is_err(), "not host 2's broadcast");
    }

    #[test]
    fn a_broadcast_ahead_of_its_publishers_key_is_awaited_not_taken_for_a_forgery() {
        let (secs, _) = cluster(2);
        let responder = Secured::new(secs[1].clone(), [HostId(0)].into_iter());
        let mut publisher = Sealer::new(Mode::Encrypt, Cipher::ChaCha20Poly1305, 0, 40, &[5; 32]);
        let early = publisher.seal(Kind::Broadcast, b"heartbeat");
        assert_eq!(responder.open_broadcast(HostId(0), &early), Err(Reject::AwaitingKey));
        let id = Bytes::from_static(b"conn");
        let (_sessions, _, grants) = connect(&secs, &responder, &id);
        // Keyed now: a frame under another key of the same epoch is a forgery, not early.
        assert_eq!(responder.open_broadcast(HostId(0), &early), Err(Reject::Tampered));
        let mut keyed = Sealer::new(Mode::Encrypt, Cipher::ChaCha20Poly1305, 0, 40, &grants[1].key);
        assert!(responder.open_broadcast(HostId(0), &keyed.seal(Kind::Broadcast, b"heartbeat")).is_ok());
    }

    #[test]
    fn a_control_frame_rotates_the_direct_key_and_grants_broadcast_keys() {
        let (secs, _) = cluster(2);
        let responder = Secured::new(secs[1].clone(), [HostId(0)].into_iter());
        let id = Bytes::from_static(b"conn");
        let (mut sessions, mut sealer, _) = connect(&secs, &responder, &id);
        let direct = Grant::fresh(GrantKind::Direct, 6).expect("grant");
        let broadcast = Grant::fresh(GrantKind::Broadcast, 41).expect("grant");
        let control = sealer.seal(Kind::Control, &noise::encode_grants(&[direct.clone(), broadcast.clone()]));
        assert!(matches!(sessions.on_frame(&responder, &id, &control), Ok(Inbound::Done)));
        sealer.rekey(Cipher::ChaCha20Poly1305, 6, &direct.key);
        assert!(matches!(
            sessions.on_frame(&responder, &id, &sealer.seal(Kind::Data, b"x")),
            Ok(Inbound::Deliver { .. })
        ));
        let mut publisher = Sealer::new(Mode::Encrypt, Cipher::ChaCha20Poly1305, 0, 41, &broadcast.key);
        assert!(responder.open_broadcast(HostId(0), &publisher.seal(Kind::Broadcast, b"e")).is_ok());
    }

    #[test]
    fn an_unlisted_host_is_refused_and_told_so() {
        let (secs, _) = cluster(2);
        let responder = Secured::new(secs[1].clone(), [HostId(0)].into_iter());
        let stranger = HostKeypair::generate().expect("key");
        let mut sessions = Sessions::new(HostId(1), std::time::Duration::from_secs(5));
        let id = Bytes::from_static(b"stranger");
        let (init, hello) = Initiator::start(&stranger, Mode::Encrypt, Cipher::ChaCha20Poly1305).expect("hello");
        let Ok(Inbound::Reply(reply)) = sessions.on_frame(&responder, &id, &hello) else { panic!("no reply") };
        let done = init.finish(&reply, &secs[0].keyring, Some(HostId(1)), &[]).expect("done");
        let Err(Refusal::Handshake { error, reply: Some(reply) }) = sessions.on_frame(&responder, &id, &done) else {
            panic!("not refused")
        };
        assert_eq!(error.outcome(), "refused_key");
        assert_eq!(frame::kind_of(&reply), Some(Kind::Refused));
        assert!(!sessions.is_live(&id));
    }

    #[test]
    fn broadcast_keys_are_granted_ahead_of_their_use() {
        let (secs, _) = cluster(2);
        let mut keys = BroadcastKeys::new(&secs[0], HostId(0), 16).expect("keys");
        let first_epoch = keys.current.epoch;
        let granted = keys.subscribe();
        let responder = Secured::new(secs[1].clone(), [HostId(0)].into_iter());
        let mut sink = Opener::new();
        responder.install(HostId(0), &granted.borrow(), &mut sink);
        for i in 0..100u32 {
            let frame = keys.seal(Cipher::ChaCha20Poly1305, &i.to_be_bytes());
            // The subscriber learns of new grants only when they were published before
            // this frame was sealed (as the dealers would have sent them).
            if let Err(e) = responder.open_broadcast(HostId(0), &frame) {
                panic!("frame {i}: {e}");
            }
            responder.install(HostId(0), &granted.borrow(), &mut sink);
        }
        assert_eq!(keys.current.epoch.wrapping_sub(first_epoch), 6, "100 frames at 16 a key");
    }
}
