//! Bounded fuzzing, for CI, of the ZMTP framing: the receive decoder of the vendored
//! zeromq (`zeromq::decode_for_fuzzing`) is the first code that reads a peer's bytes at
//! every bus port, before any handshake. Inputs are arbitrary bytes and valid streams
//! (greeting, READY, multipart messages) mutated where a hostile peer would: flipped,
//! cut and inserted bytes, and frame lengths replaced by extremes. The decoder must
//! answer with an error, never a panic nor a reservation past its bound (the hook
//! asserts that itself). The coverage-guided targets live in `tests/fuzz`.

use proptest::prelude::*;
use zeromq::{FRAME_OVERHEAD, decode_for_fuzzing};

/// A ZMTP 3.0 greeting of the NULL mechanism, as a client sends it.
fn greeting() -> Vec<u8> {
    let mut g = vec![0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// A message frame's body, and whether to write its length in the long (8-byte) form
/// even when it would fit one byte.
type FrameSpec = (Vec<u8>, bool);

/// A valid byte stream and where its frame lengths are, for targeted mutations.
#[derive(Debug, Clone, Default)]
struct Stream {
    bytes: Vec<u8>,
    /// Offset of each frame's length field and whether it is the 8-byte (long) form.
    lengths: Vec<(usize, bool)>,
}

impl Stream {
    fn frame(&mut self, flags: u8, body: &[u8], force_long: bool) {
        let long = force_long || body.len() > 255;
        self.bytes.push(flags | if long { 0b10 } else { 0 });
        self.lengths.push((self.bytes.len(), long));
        if long {
            self.bytes.extend_from_slice(&(body.len() as u64).to_be_bytes());
        } else {
            self.bytes.push(body.len() as u8);
        }
        self.bytes.extend_from_slice(body);
    }

    fn ready(&mut self, socket_type: &str) {
        let mut body = vec![5];
        body.extend_from_slice(b"READY");
        body.push(11);
        body.extend_from_slice(b"Socket-Type");
        body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
        body.extend_from_slice(socket_type.as_bytes());
        self.frame(0b100, &body, false);
    }

    fn message(&mut self, frames: &[FrameSpec]) {
        for (i, (body, force_long)) in frames.iter().enumerate() {
            let more = u8::from(i + 1 < frames.len());
            self.frame(more, body, *force_long);
        }
    }
}

/// Bytes a message of these frames counts against the maximum message size.
fn message_cost(frames: &[FrameSpec]) -> usize {
    frames.iter().map(|(body, _)| body.len() + FRAME_OVERHEAD).sum()
}

fn arb_messages() -> impl Strategy<Value = Vec<Vec<FrameSpec>>> {
    let frame = (
        prop_oneof![3 => proptest::collection::vec(any::<u8>(), 0..40), 1 => proptest::collection::vec(any::<u8>(), 200..700)],
        any::<bool>(),
    );
    proptest::collection::vec(proptest::collection::vec(frame, 1..5), 0..5)
}

fn valid_stream(messages: &[Vec<FrameSpec>]) -> Stream {
    let mut stream = Stream { bytes: greeting(), lengths: Vec::new() };
    stream.ready("ROUTER");
    for message in messages {
        stream.message(message);
    }
    stream
}

/// Lengths a hostile peer announces: around a small bound and the default one, past the
/// read-chunk headroom (64 KiB reads), and where arithmetic wraps.
fn extreme_length() -> impl Strategy<Value = u64> {
    let overhead = FRAME_OVERHEAD as u64;
    let near = |max: u64| prop_oneof![Just(max - overhead), Just(max - overhead + 1), Just(max), Just(max + 1)];
    prop_oneof![
        Just(0u64),
        Just(255),
        Just(256),
        near(1024),
        near(zeromq::DEFAULT_MAX_MESSAGE_SIZE as u64),
        Just(3 * 64 * 1024),
        Just(1 << 31),
        Just(1 << 32),
        Just(1 << 60),
        Just((1 << 63) - 1),
        Just(1 << 63),
        Just(u64::MAX - 64 * 1024),
        Just(u64::MAX),
        any::<u64>(),
    ]
}

#[derive(Debug, Clone)]
enum Mutation {
    Flip {
        at: usize,
        xor: u8,
    },
    Truncate {
        at: usize,
    },
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
    Delete {
        at: usize,
        len: usize,
    },
    /// Sets the `which`-th length field (modulo their count) to `value`, cut to the
    /// field's width.
    Length {
        which: usize,
        value: u64,
    },
    /// Sets the flags byte before the `which`-th length field.
    Flags {
        which: usize,
        flags: u8,
    },
}

fn arb_mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        1 => (any::<usize>(), 1..=255u8).prop_map(|(at, xor)| Mutation::Flip { at, xor }),
        1 => any::<usize>().prop_map(|at| Mutation::Truncate { at }),
        1 => (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..12))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        1 => (any::<usize>(), 1..16usize).prop_map(|(at, len)| Mutation::Delete { at, len }),
        3 => (any::<usize>(), extreme_length()).prop_map(|(which, value)| Mutation::Length { which, value }),
        1 => (any::<usize>(), any::<u8>()).prop_map(|(which, flags)| Mutation::Flags { which, flags }),
    ]
}

fn mutate(stream: &Stream, mutations: &[Mutation]) -> Vec<u8> {
    let mut bytes = stream.bytes.clone();
    // Length-field mutations first, while the recorded offsets still hold.
    for mutation in mutations {
        match *mutation {
            Mutation::Length { which, value } if !stream.lengths.is_empty() => {
                let (at, long) = stream.lengths[which % stream.lengths.len()];
                if long {
                    bytes[at..at + 8].copy_from_slice(&value.to_be_bytes());
                } else {
                    bytes[at] = value as u8;
                }
            }
            Mutation::Flags { which, flags } if !stream.lengths.is_empty() => {
                let (at, _) = stream.lengths[which % stream.lengths.len()];
                bytes[at - 1] = flags;
            }
            _ => {}
        }
    }
    for mutation in mutations {
        let n = bytes.len().max(1);
        match mutation {
            Mutation::Flip { at, xor } if !bytes.is_empty() => bytes[at % n] ^= xor,
            Mutation::Truncate { at } => bytes.truncate(at % (n + 1)),
            Mutation::Insert { at, bytes: extra } => {
                let at = at % (bytes.len() + 1);
                bytes.splice(at..at, extra.iter().copied());
            }
            Mutation::Delete { at, len } if !bytes.is_empty() => {
                let at = at % n;
                bytes.drain(at..(at + len).min(bytes.len()));
            }
            _ => {}
        }
    }
    bytes
}

/// Every maximum the hook is run with: its floor (256), small, and the bus default.
fn arb_max() -> impl Strategy<Value = usize> {
    prop_oneof![Just(0usize), Just(256), Just(1024), Just(4096), Just(zeromq::DEFAULT_MAX_MESSAGE_SIZE)]
}

/// The decoder's answer as comparable text: how many units, or which error.
fn outcome(bytes: &[u8], max: usize, chunk: usize) -> Result<usize, String> {
    decode_for_fuzzing(bytes, max, chunk).map_err(|e| format!("{e:?}"))
}

/// Cases per property: `PROPTEST_CASES` when set (a longer local run), else what CI runs.
fn cases(ci: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(ci)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(2048), ..ProptestConfig::default() })]

    /// Greeting, READY and every message decode, whatever the read size, exactly when
    /// each message fits the bound; a message over it is an error.
    #[test]
    fn valid_streams_decode_iff_within_the_bound(
        messages in arb_messages(),
        max in arb_max(),
        chunk in prop_oneof![1..97usize, Just(usize::MAX)],
    ) {
        let stream = valid_stream(&messages);
        let bound = max.max(256);
        let fits = messages.iter().all(|m| message_cost(m) <= bound);
        match decode_for_fuzzing(&stream.bytes, max, chunk) {
            Ok(units) => {
                prop_assert!(fits, "a message over {bound} bytes was accepted");
                prop_assert_eq!(units, 2 + messages.len());
            }
            Err(e) => prop_assert!(!fits, "a valid stream within the bound was refused: {e}"),
        }
    }

    /// Mutated valid streams: no panic, no reservation past the bound (the hook asserts
    /// it), and the answer does not depend on how reads split the bytes.
    #[test]
    fn mutated_streams_never_panic(
        messages in arb_messages(),
        max in arb_max(),
        mutations in proptest::collection::vec(arb_mutation(), 1..5),
        chunk in 1..200usize,
    ) {
        let bytes = mutate(&valid_stream(&messages), &mutations);
        let whole = outcome(&bytes, max, usize::MAX);
        prop_assert_eq!(outcome(&bytes, max, chunk), whole);
    }

    /// Arbitrary bytes, half of the time behind a valid greeting so that they reach the
    /// frame decoder.
    #[test]
    fn arbitrary_bytes_never_panic(
        tail in proptest::collection::vec(any::<u8>(), 0..512),
        greeted in any::<bool>(),
        max in arb_max(),
        chunk in 1..64usize,
    ) {
        let mut bytes = if greeted { greeting() } else { Vec::new() };
        bytes.extend_from_slice(&tail);
        let whole = outcome(&bytes, max, usize::MAX);
        prop_assert_eq!(outcome(&bytes, max, chunk), whole);
    }
}

/// The attack PATCH.md names: a greeting, then a long frame header announcing ~2^60
/// bytes (or any length past the bound) is refused before anything is reserved.
#[test]
fn announced_lengths_past_the_bound_are_refused() {
    for flags in [0b010u8, 0b011, 0b110] {
        for announced in [1u64 << 60, u64::MAX, 1 << 63, (1 << 24) + 1, 4096] {
            let mut bytes = greeting();
            bytes.push(flags);
            bytes.extend_from_slice(&announced.to_be_bytes());
            for chunk in [1, usize::MAX] {
                assert!(
                    decode_for_fuzzing(&bytes, 4096, chunk).is_err(),
                    "flags {flags:#05b}, {announced} bytes announced, read {chunk} at a time"
                );
            }
        }
    }
}

/// Empty frames cost `FRAME_OVERHEAD` each, so a flood of them ends at the bound.
#[test]
fn a_flood_of_empty_frames_hits_the_bound() {
    let mut stream = Stream { bytes: greeting(), lengths: Vec::new() };
    stream.ready("DEALER");
    let fits = 1024 / FRAME_OVERHEAD;
    stream.message(&vec![(Vec::new(), false); fits]);
    assert_eq!(decode_for_fuzzing(&stream.bytes, 1024, 7).ok(), Some(3));
    stream.message(&vec![(Vec::new(), false); fits + 1]);
    assert!(decode_for_fuzzing(&stream.bytes, 1024, 7).is_err());
}
