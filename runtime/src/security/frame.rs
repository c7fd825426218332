//! Sealed frames: what goes on the wire once a peer is authenticated.
//!
//! ```text
//! 0      magic 'T'
//! 1      kind       (handshake 1..=5, direct data 16, direct control 17, broadcast 32)
//! 2      mode       (1 authenticate, 2 encrypt)
//! 3..5   sender host id, big-endian
//! 5..9   key epoch, big-endian
//! 9..17  frame counter within the epoch, big-endian
//! 17..   body, then a 16-byte tag
//! ```
//!
//! The nonce is `epoch || counter`, unique per key because every key has its own epoch
//! and a sender never reuses a counter (it takes a new key first, see
//! [`Sealer::needs_rekey`]). The header is the associated data, so none of it can be
//! changed; in `authenticate` mode the body travels in clear and is associated data too.
//! A receiver keeps a window of the counters it has accepted per key and drops any
//! counter seen before or older than the window.

use std::collections::VecDeque;

use super::Mode;
use super::aead::{AeadKey, Cipher, KEY_BYTES, TAG_BYTES};

pub const MAGIC: u8 = b'T';
pub const HEADER_BYTES: usize = 17;
/// The smallest sealed frame: a header and a tag.
pub const MIN_SEALED_BYTES: usize = HEADER_BYTES + TAG_BYTES;

/// What a frame is. Handshake frames carry Noise messages in clear after a 3-byte
/// prefix (magic, kind, mode); the rest are sealed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Hello = 1,
    HelloReply = 2,
    HelloDone = 3,
    Refused = 4,
    /// A data-plane server's word that it accepted the reader's key.
    Welcome = 5,
    Data = 16,
    Control = 17,
    Broadcast = 32,
}

impl Kind {
    fn from_byte(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Hello,
            2 => Kind::HelloReply,
            3 => Kind::HelloDone,
            4 => Kind::Refused,
            5 => Kind::Welcome,
            16 => Kind::Data,
            17 => Kind::Control,
            32 => Kind::Broadcast,
            _ => return None,
        })
    }
}

/// Why a frame was dropped; a bounded label for `tessera_bus_frames_dropped_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Reject {
    /// Not a sealed frame of this protocol (plaintext, random bytes, a ZMTP greeting).
    #[error("not a sealed frame")]
    Unsealed,
    /// Sealed in the other mode (authenticate vs encrypt).
    #[error("sealed in the other security mode")]
    Mode,
    /// No key for it: its sender has not completed a handshake, or the epoch is unknown.
    #[error("no key for this frame (sender not authenticated, or unknown key epoch)")]
    NoKey,
    /// A broadcast from a publisher whose first key has not arrived yet: its PUB link
    /// came up before its direct link finished the handshake (expected at start).
    #[error("a broadcast before its publisher's key arrived")]
    AwaitingKey,
    /// Its counter was accepted before or is older than the replay window.
    #[error("replayed or too old")]
    Replayed,
    /// The tag does not verify: a changed bit, or a key that is not the sender's.
    #[error("tag does not verify")]
    Tampered,
}

impl Reject {
    pub fn reason(self) -> &'static str {
        match self {
            Reject::Unsealed => "unauthenticated",
            Reject::Mode => "mode",
            Reject::NoKey => "unknown_key",
            Reject::AwaitingKey => "awaiting_key",
            Reject::Replayed => "replayed",
            Reject::Tampered => "tampered",
        }
    }
}

/// A sealed frame's header, read without trusting it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub mode: Mode,
    pub host: u16,
    pub epoch: u32,
    pub counter: u64,
}

impl Header {
    fn write(&self, out: &mut Vec<u8>) {
        out.push(MAGIC);
        out.push(self.kind as u8);
        out.push(self.mode.wire_byte());
        out.extend_from_slice(&self.host.to_be_bytes());
        out.extend_from_slice(&self.epoch.to_be_bytes());
        out.extend_from_slice(&self.counter.to_be_bytes());
    }

    /// The header of `frame`, if it looks like a sealed frame at all.
    pub fn parse(frame: &[u8]) -> Result<Header, Reject> {
        if frame.len() < MIN_SEALED_BYTES || frame[0] != MAGIC {
            return Err(Reject::Unsealed);
        }
        let kind = Kind::from_byte(frame[1]).ok_or(Reject::Unsealed)?;
        let mode = Mode::from_wire_byte(frame[2]).ok_or(Reject::Unsealed)?;
        let be = |range: std::ops::Range<usize>| frame[range].iter().fold(0u64, |acc, b| acc << 8 | u64::from(*b));
        Ok(Header { kind, mode, host: be(3..5) as u16, epoch: be(5..9) as u32, counter: be(9..17) })
    }

    fn nonce(&self) -> [u8; 12] {
        let mut nonce = [0u8; 12];
        nonce[..4].copy_from_slice(&self.epoch.to_be_bytes());
        nonce[4..].copy_from_slice(&self.counter.to_be_bytes());
        nonce
    }
}

/// The kind of a frame, if it is one of this protocol's (sealed or handshake).
pub fn kind_of(frame: &[u8]) -> Option<Kind> {
    if frame.len() >= 3 && frame[0] == MAGIC { Kind::from_byte(frame[1]) } else { None }
}

/// A handshake frame: the 3-byte prefix then the Noise message.
pub fn handshake_frame(kind: Kind, mode: Mode, noise: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(3 + noise.len());
    out.extend_from_slice(&[MAGIC, kind as u8, mode.wire_byte()]);
    out.extend_from_slice(noise);
    out
}

/// The Noise message inside a handshake frame of `kind` sealed for `mode`.
pub fn handshake_body(frame: &[u8], kind: Kind, mode: Mode) -> Result<&[u8], Reject> {
    match frame {
        [MAGIC, k, m, body @ ..] if *k == kind as u8 => {
            if *m == mode.wire_byte() {
                Ok(body)
            } else {
                Err(Reject::Mode)
            }
        }
        _ => Err(Reject::Unsealed),
    }
}

/// Frames sealed under one key before the sender moves to a fresh one.
pub const REKEY_AFTER_FRAMES: u64 = 1 << 24;

/// One direction's sending side: the current key and the next counter.
pub struct Sealer {
    mode: Mode,
    host: u16,
    epoch: u32,
    key: AeadKey,
    next: u64,
    rekey_after: u64,
}

impl Sealer {
    pub fn new(mode: Mode, cipher: Cipher, host: u16, epoch: u32, material: &[u8; KEY_BYTES]) -> Sealer {
        Sealer { mode, host, epoch, key: AeadKey::new(cipher, material), next: 0, rekey_after: REKEY_AFTER_FRAMES }
    }

    /// Rekeys after `frames` instead of [`REKEY_AFTER_FRAMES`] (tests exercise rotation).
    pub fn rekey_after(mut self, frames: u64) -> Sealer {
        self.rekey_after = frames.max(1);
        self
    }

    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    /// Frames sealed under the current key.
    pub fn used(&self) -> u64 {
        self.next
    }

    /// Whether this key has sealed its share; the owner then installs a new one
    /// ([`Sealer::rekey`]) after telling the receivers.
    pub fn needs_rekey(&self) -> bool {
        self.next >= self.rekey_after
    }

    pub fn rekey(&mut self, cipher: Cipher, epoch: u32, material: &[u8; KEY_BYTES]) {
        self.epoch = epoch;
        self.key = AeadKey::new(cipher, material);
        self.next = 0;
    }

    /// `body` as a sealed frame of `kind`.
    pub fn seal(&mut self, kind: Kind, body: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_BYTES + body.len() + TAG_BYTES);
        self.seal_append(kind, &mut out, |out| out.extend_from_slice(body));
        out
    }

    /// Appends a sealed frame of `kind` to `out`, its body whatever `body` appends: the
    /// bytes are encrypted where they land, with no copy of their own.
    pub fn seal_append(&mut self, kind: Kind, out: &mut Vec<u8>, body: impl FnOnce(&mut Vec<u8>)) {
        let header = Header { kind, mode: self.mode, host: self.host, epoch: self.epoch, counter: self.next };
        self.next += 1;
        let start = out.len();
        header.write(out);
        body(out);
        let frame = &mut out[start..];
        let tag = match self.mode {
            Mode::Encrypt => {
                let (aad, text) = frame.split_at_mut(HEADER_BYTES);
                self.key.seal_in_place(&header.nonce(), aad, text)
            }
            // The whole frame is associated data; nothing is encrypted.
            Mode::Authenticate => self.key.seal_in_place(&header.nonce(), frame, &mut []),
        };
        out.extend_from_slice(&tag);
    }
}

/// Counters accepted under one key: the highest, and a bitmap of the 1,024 below it.
#[derive(Debug, Clone, Default)]
pub struct ReplayWindow {
    /// One more than the highest counter accepted (0: none yet).
    top: u64,
    bits: [u64; Self::WORDS],
}

impl ReplayWindow {
    const WORDS: usize = 16;
    pub const SPAN: u64 = 64 * Self::WORDS as u64;

    /// Whether `counter` would be accepted (not seen, not too old). Does not record it.
    pub fn fresh(&self, counter: u64) -> bool {
        if counter >= self.top {
            return true;
        }
        let behind = self.top - 1 - counter;
        behind < Self::SPAN && self.bits[(behind / 64) as usize] & (1 << (behind % 64)) == 0
    }

    /// Records `counter` as accepted; call only after its tag verified.
    pub fn record(&mut self, counter: u64) {
        if counter >= self.top {
            let shift = counter + 1 - self.top;
            self.shift(shift);
            self.top = counter + 1;
            self.bits[0] |= 1;
        } else {
            let behind = self.top - 1 - counter;
            if behind < Self::SPAN {
                self.bits[(behind / 64) as usize] |= 1 << (behind % 64);
            }
        }
    }

    fn shift(&mut self, by: u64) {
        if by >= Self::SPAN {
            self.bits = [0; Self::WORDS];
            return;
        }
        let (words, bits) = ((by / 64) as usize, (by % 64) as u32);
        for i in (0..Self::WORDS).rev() {
            let lo = i.checked_sub(words).map_or(0, |j| self.bits[j]);
            let carry = match (bits, i.checked_sub(words + 1)) {
                (0, _) | (_, None) => 0,
                (b, Some(j)) => self.bits[j] >> (64 - b),
            };
            self.bits[i] = lo << bits | carry;
        }
    }
}

/// A receiver's keys for one sender: the newest few epochs, each with its window.
#[derive(Debug, Default)]
pub struct Opener {
    keys: VecDeque<(u32, AeadKey, ReplayWindow)>,
}

impl Opener {
    /// Epochs kept: the current one and the one before it, so frames sealed just before
    /// a rotation still open.
    const KEPT: usize = 2;

    pub fn new() -> Opener {
        Opener::default()
    }

    /// Adds the key of `epoch` (replacing one of the same epoch: a restarted sender).
    pub fn install(&mut self, cipher: Cipher, epoch: u32, material: &[u8; KEY_BYTES]) {
        self.keys.retain(|(e, _, _)| *e != epoch);
        self.keys.push_back((epoch, AeadKey::new(cipher, material), ReplayWindow::default()));
        while self.keys.len() > Self::KEPT {
            self.keys.pop_front();
        }
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The body of `frame` if it is a fresh frame of `mode` sealed by the holder of one
    /// of our keys; records its counter.
    pub fn open(&mut self, mode: Mode, frame: &[u8]) -> Result<(Header, Vec<u8>), Reject> {
        let mut owned = frame.to_vec();
        let (header, body) = self.open_in_place(mode, &mut owned)?;
        owned.truncate(body.end);
        owned.drain(..body.start);
        Ok((header, owned))
    }

    /// [`Opener::open`] without a copy: decrypts `frame` where it is and says where in it
    /// the body lies. On failure `frame` is left unspecified.
    pub fn open_in_place(&mut self, mode: Mode, frame: &mut [u8]) -> Result<(Header, std::ops::Range<usize>), Reject> {
        let header = Header::parse(frame)?;
        if header.mode != mode {
            return Err(Reject::Mode);
        }
        let (_, key, window) = self.keys.iter_mut().find(|(e, _, _)| *e == header.epoch).ok_or(Reject::NoKey)?;
        if !window.fresh(header.counter) {
            return Err(Reject::Replayed);
        }
        let end = frame.len() - TAG_BYTES;
        let (sealed, tag) = frame.split_at_mut(end);
        let tag: &[u8; TAG_BYTES] = (&*tag).try_into().map_err(|_| Reject::Unsealed)?;
        match mode {
            Mode::Encrypt => {
                let (aad, body) = sealed.split_at_mut(HEADER_BYTES);
                key.open_in_place(&header.nonce(), aad, body, tag).map_err(|_| Reject::Tampered)?;
            }
            Mode::Authenticate => {
                key.open_in_place(&header.nonce(), sealed, &mut [], tag).map_err(|_| Reject::Tampered)?;
            }
        }
        window.record(header.counter);
        Ok((header, HEADER_BYTES..end))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const KEY: [u8; KEY_BYTES] = [7; KEY_BYTES];

    fn pair(mode: Mode, cipher: Cipher) -> (Sealer, Opener) {
        let mut opener = Opener::new();
        opener.install(cipher, 9, &KEY);
        (Sealer::new(mode, cipher, 3, 9, &KEY), opener)
    }

    #[test]
    fn a_sealed_frame_opens_once_and_hides_its_body_when_encrypting() {
        for cipher in [Cipher::ChaCha20Poly1305, Cipher::Sm4Gcm] {
            for mode in [Mode::Encrypt, Mode::Authenticate] {
                let (mut sealer, mut opener) = pair(mode, cipher);
                let body = b"the quick brown fox prompt";
                let frame = sealer.seal(Kind::Data, body);
                let in_clear = frame.windows(body.len()).any(|w| w == body);
                assert_eq!(in_clear, mode == Mode::Authenticate, "{cipher:?} {mode:?}");
                let (header, opened) = opener.open(mode, &frame).expect("opens");
                assert_eq!((header.kind, header.host, header.epoch, header.counter), (Kind::Data, 3, 9, 0));
                assert_eq!(opened, body);
                assert_eq!(opener.open(mode, &frame).unwrap_err(), Reject::Replayed, "a replay is dropped");
            }
        }
    }

    #[test]
    fn every_flipped_bit_is_caught() {
        for mode in [Mode::Encrypt, Mode::Authenticate] {
            let (mut sealer, _) = pair(mode, Cipher::ChaCha20Poly1305);
            let frame = sealer.seal(Kind::Broadcast, b"heartbeat");
            for bit in 0..frame.len() * 8 {
                let mut bad = frame.clone();
                bad[bit / 8] ^= 1 << (bit % 8);
                let (_, mut opener) = pair(mode, Cipher::ChaCha20Poly1305);
                assert!(opener.open(mode, &bad).is_err(), "{mode:?}: bit {bit} flipped and accepted");
            }
        }
    }

    #[test]
    fn wrong_mode_unknown_epoch_and_plaintext_are_refused() {
        let (mut sealer, mut opener) = pair(Mode::Encrypt, Cipher::ChaCha20Poly1305);
        let frame = sealer.seal(Kind::Data, b"x");
        assert_eq!(opener.open(Mode::Authenticate, &frame).unwrap_err(), Reject::Mode);
        let mut other = Sealer::new(Mode::Encrypt, Cipher::ChaCha20Poly1305, 3, 10, &KEY);
        assert_eq!(opener.open(Mode::Encrypt, &other.seal(Kind::Data, b"x")).unwrap_err(), Reject::NoKey);
        let plain = rmp_serde::to_vec_named(&("hello", 1)).expect("encodes");
        assert_eq!(opener.open(Mode::Encrypt, &plain).unwrap_err(), Reject::Unsealed);
        assert_eq!(opener.open(Mode::Encrypt, b"").unwrap_err(), Reject::Unsealed);
        // Another key under the same epoch (a forger's) fails the tag.
        let mut forger = Sealer::new(Mode::Encrypt, Cipher::ChaCha20Poly1305, 3, 9, &[8; KEY_BYTES]);
        assert_eq!(opener.open(Mode::Encrypt, &forger.seal(Kind::Data, b"x")).unwrap_err(), Reject::Tampered);
        // And the real frame still opens: failed attempts record nothing.
        assert!(opener.open(Mode::Encrypt, &frame).is_ok());
    }

    #[test]
    fn rotation_keeps_the_previous_epoch_open() {
        let cipher = Cipher::Sm4Gcm;
        let (sealer, mut opener) = pair(Mode::Encrypt, cipher);
        let mut sealer = sealer.rekey_after(2);
        let a = sealer.seal(Kind::Broadcast, b"a");
        let b = sealer.seal(Kind::Broadcast, b"b");
        assert!(sealer.needs_rekey());
        sealer.rekey(cipher, 10, &[1; KEY_BYTES]);
        opener.install(cipher, 10, &[1; KEY_BYTES]);
        let c = sealer.seal(Kind::Broadcast, b"c");
        assert!(!sealer.needs_rekey());
        // Late frames of the old epoch still open, in any order; the new one too.
        for f in [&c, &b, &a] {
            assert!(opener.open(Mode::Encrypt, f).is_ok());
        }
        opener.install(cipher, 11, &[2; KEY_BYTES]);
        opener.install(cipher, 12, &[3; KEY_BYTES]);
        assert_eq!(opener.open(Mode::Encrypt, &c).unwrap_err(), Reject::NoKey, "epoch 10 was retired");
    }

    proptest! {
        /// The window accepts exactly the counters a set of seen counters and the span allow.
        #[test]
        fn replay_window_matches_a_naive_set(counters in proptest::collection::vec(0u64..3000, 1..400)) {
            let mut window = ReplayWindow::default();
            let mut seen = std::collections::BTreeSet::new();
            for c in counters {
                let top = seen.iter().next_back().map_or(0, |t| t + 1);
                let expected = !seen.contains(&c) && (c >= top || top - 1 - c < ReplayWindow::SPAN);
                prop_assert_eq!(window.fresh(c), expected, "counter {}", c);
                if expected {
                    window.record(c);
                    seen.insert(c);
                }
            }
        }
    }
}
