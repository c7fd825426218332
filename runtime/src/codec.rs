//! The bus wire format: one MessagePack [`Envelope`] per ZeroMQ frame, with the actor
//! message inside it as a MessagePack payload.
//!
//! Both levels use named fields (`rmp_serde::to_vec_named`), so a node may add a field
//! and an older node still decodes the frame (unknown fields are ignored). Decoding never
//! panics on any input: every failure is a [`CodecError`] the bus counts and drops.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::addr::Addr;

/// The envelope layout this build speaks. A frame with another `v` is refused.
pub const PROTOCOL_VERSION: u16 = 1;

/// Largest encoded envelope accepted either way. Bulk bytes travel on the data plane.
pub const MAX_FRAME_BYTES: usize = 16 << 20;

/// Nesting limit while decoding: an envelope is shallow, so a deeply nested frame is
/// hostile or corrupt, and refusing it early keeps the decoder's stack small.
const MAX_DECODE_DEPTH: usize = 64;

/// One bus message: who sent it, where it goes (an actor, or a topic for broadcasts),
/// what it is, and the encoded message itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// Protocol version of the sender ([`PROTOCOL_VERSION`]).
    pub v: u16,
    pub from: Addr,
    /// Destination of a direct message; `None` on broadcasts.
    pub to: Option<Addr>,
    /// Topic of a broadcast; `None` on direct messages.
    pub topic: Option<String>,
    /// Message type name, so the receiving host picks the payload's decoder.
    pub kind: String,
    /// Correlation id tying a reply to its request (0 = none).
    pub corr: u64,
    /// The message, encoded with [`encode_payload`].
    #[serde(with = "serde_bytes")]
    pub payload: Vec<u8>,
}

impl Envelope {
    /// A direct message of this build's protocol version.
    pub fn direct(from: Addr, to: Addr, kind: impl Into<String>, corr: u64, payload: Vec<u8>) -> Envelope {
        Envelope { v: PROTOCOL_VERSION, from, to: Some(to), topic: None, kind: kind.into(), corr, payload }
    }

    /// A broadcast on `topic` of this build's protocol version.
    pub fn broadcast(from: Addr, topic: impl Into<String>, kind: impl Into<String>, payload: Vec<u8>) -> Envelope {
        Envelope { v: PROTOCOL_VERSION, from, to: None, topic: Some(topic.into()), kind: kind.into(), corr: 0, payload }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("frame of {len} bytes exceeds the {max}-byte limit")]
    TooLarge { len: usize, max: usize },
    #[error("malformed frame: {0}")]
    Malformed(String),
    #[error("unsupported protocol version {got} (this node speaks version {supported})")]
    UnsupportedVersion { got: u16, supported: u16 },
    #[error("cannot encode: {0}")]
    Encode(String),
}

impl CodecError {
    /// A bounded label value for `tessera_bus_frames_dropped_total{reason}`.
    pub fn reason(&self) -> &'static str {
        match self {
            CodecError::TooLarge { .. } => "too_large",
            CodecError::Malformed(_) => "malformed",
            CodecError::UnsupportedVersion { .. } => "version",
            CodecError::Encode(_) => "encode",
        }
    }
}

/// Encodes an envelope into one frame.
pub fn encode(env: &Envelope) -> Result<Vec<u8>, CodecError> {
    let frame = rmp_serde::to_vec_named(env).map_err(|e| CodecError::Encode(e.to_string()))?;
    if frame.len() > MAX_FRAME_BYTES {
        return Err(CodecError::TooLarge { len: frame.len(), max: MAX_FRAME_BYTES });
    }
    Ok(frame)
}

/// Only the version, read before the rest so that a future layout is refused by
/// version rather than reported as malformed.
#[derive(Deserialize)]
struct VersionProbe {
    v: u16,
}

fn from_slice<M: DeserializeOwned>(bytes: &[u8]) -> Result<M, CodecError> {
    let mut de = rmp_serde::Deserializer::from_read_ref(bytes);
    de.set_max_depth(MAX_DECODE_DEPTH);
    M::deserialize(&mut de).map_err(|e| CodecError::Malformed(e.to_string()))
}

/// Decodes one frame: size first, then version, then the envelope.
pub fn decode(frame: &[u8]) -> Result<Envelope, CodecError> {
    if frame.len() > MAX_FRAME_BYTES {
        return Err(CodecError::TooLarge { len: frame.len(), max: MAX_FRAME_BYTES });
    }
    let probe: VersionProbe = from_slice(frame)?;
    if probe.v != PROTOCOL_VERSION {
        return Err(CodecError::UnsupportedVersion { got: probe.v, supported: PROTOCOL_VERSION });
    }
    from_slice(frame)
}

/// Encodes an actor message for [`Envelope::payload`] (named fields).
pub fn encode_payload<M: Serialize>(msg: &M) -> Result<Vec<u8>, CodecError> {
    let bytes = rmp_serde::to_vec_named(msg).map_err(|e| CodecError::Encode(e.to_string()))?;
    if bytes.len() > MAX_FRAME_BYTES {
        return Err(CodecError::TooLarge { len: bytes.len(), max: MAX_FRAME_BYTES });
    }
    Ok(bytes)
}

/// Decodes an actor message from [`Envelope::payload`].
pub fn decode_payload<M: DeserializeOwned>(bytes: &[u8]) -> Result<M, CodecError> {
    if bytes.len() > MAX_FRAME_BYTES {
        return Err(CodecError::TooLarge { len: bytes.len(), max: MAX_FRAME_BYTES });
    }
    from_slice(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::addr::HostId;
    use proptest::prelude::*;

    fn arb_addr() -> impl Strategy<Value = Addr> {
        (any::<u16>(), any::<u64>()).prop_map(|(h, a)| Addr::new(HostId(h), a))
    }

    fn arb_envelope() -> impl Strategy<Value = Envelope> {
        (
            arb_addr(),
            proptest::option::of(arb_addr()),
            proptest::option::of(".{0,24}"),
            ".{0,24}",
            any::<u64>(),
            proptest::collection::vec(any::<u8>(), 0..512),
        )
            .prop_map(|(from, to, topic, kind, corr, payload)| Envelope {
                v: PROTOCOL_VERSION,
                from,
                to,
                topic,
                kind,
                corr,
                payload,
            })
    }

    /// The same envelope as a newer node might send it: one field more.
    #[derive(Serialize)]
    struct EnvelopeV1Plus<'a> {
        v: u16,
        from: Addr,
        to: Option<Addr>,
        topic: Option<&'a str>,
        kind: &'a str,
        corr: u64,
        #[serde(with = "serde_bytes")]
        payload: &'a [u8],
        deadline_ms: u64,
    }

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Ping {
        seq: u32,
        note: String,
    }

    proptest! {
        #[test]
        fn envelope_round_trips(env in arb_envelope()) {
            let frame = encode(&env).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let back = decode(&frame).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(back, env);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode(&bytes);
            let _ = decode_payload::<Ping>(&bytes);
            let _ = decode_payload::<Envelope>(&bytes);
        }

        #[test]
        fn mutated_and_truncated_frames_never_panic(
            env in arb_envelope(),
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
            cut in any::<usize>(),
        ) {
            let frame = encode(&env).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let mut mutated = frame.clone();
            for (at, byte) in flips {
                let i = at % mutated.len();
                mutated[i] = byte;
            }
            let _ = decode(&mutated);
            let _ = decode_payload::<Ping>(&mutated);
            let truncated = &frame[..cut % frame.len()];
            prop_assert!(decode(truncated).is_err());
        }

        #[test]
        fn other_versions_are_refused_by_name(env in arb_envelope(), v in any::<u16>()) {
            prop_assume!(v != PROTOCOL_VERSION);
            let frame = encode(&Envelope { v, ..env }).map_err(|e| TestCaseError::fail(e.to_string()))?;
            match decode(&frame) {
                Err(CodecError::UnsupportedVersion { got, supported }) => {
                    prop_assert_eq!(got, v);
                    prop_assert_eq!(supported, PROTOCOL_VERSION);
                }
                other => prop_assert!(false, "expected a version refusal, got {:?}", other),
            }
        }

        #[test]
        fn unknown_fields_are_ignored(env in arb_envelope(), deadline_ms in any::<u64>()) {
            let newer = EnvelopeV1Plus {
                v: env.v,
                from: env.from,
                to: env.to,
                topic: env.topic.as_deref(),
                kind: &env.kind,
                corr: env.corr,
                payload: &env.payload,
                deadline_ms,
            };
            let frame = rmp_serde::to_vec_named(&newer).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let back = decode(&frame).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(back, env);
        }

        #[test]
        fn payload_round_trips(seq in any::<u32>(), note in ".{0,32}") {
            let msg = Ping { seq, note };
            let bytes = encode_payload(&msg).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(decode_payload::<Ping>(&bytes).map_err(|e| TestCaseError::fail(e.to_string()))?, msg);
        }
    }

    #[test]
    fn version_two_is_refused_naming_both_versions() {
        let env = Envelope::direct(Addr::new(HostId(0), 1), Addr::new(HostId(1), 2), "Ping", 7, vec![1, 2, 3]);
        let frame = encode(&Envelope { v: 2, ..env }).expect("encoding a local envelope");
        let err = decode(&frame).expect_err("version 2 must be refused");
        assert!(matches!(err, CodecError::UnsupportedVersion { got: 2, supported: 1 }));
        let text = err.to_string();
        assert!(text.contains("version 2") && text.contains("version 1"), "{text}");
    }

    #[test]
    fn oversized_frames_are_refused_before_parsing() {
        let big = vec![0u8; MAX_FRAME_BYTES + 1];
        assert!(matches!(decode(&big), Err(CodecError::TooLarge { .. })));
        let env = Envelope::broadcast(Addr::new(HostId(0), 1), "t", "Big", vec![0u8; MAX_FRAME_BYTES]);
        assert!(matches!(encode(&env), Err(CodecError::TooLarge { .. })));
    }

    #[test]
    fn deep_nesting_is_refused_not_overflowed() {
        // {"x": [[[[...nil...]]]]} with 100k levels: an unknown field the decoder must
        // skip, shaped as a stack-overflow attempt.
        let mut frame = vec![0x81u8, 0xa1, b'x'];
        frame.extend(std::iter::repeat_n(0x91u8, 100_000));
        frame.push(0xc0);
        assert!(decode(&frame).is_err());
        assert!(decode_payload::<Ping>(&frame).is_err());
    }
}

/// Bounded fuzzing of [`decode`] (CI): frames written by hand, field by field, as a
/// hostile or buggy peer might — each field valid, of the wrong type, an extreme number,
/// a length prefix past the end of the frame, or missing; unknown and repeated keys;
/// then bytes flipped, cut or inserted. No panic, no allocation sized by a length prefix,
/// and whatever decodes is a version-1 envelope that round-trips. The coverage-guided
/// target is `tests/fuzz/fuzz_targets/bus_envelope.rs`.
#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    /// MessagePack values that no valid envelope field holds, or holds only at an extreme.
    const HOSTILE: &[&[u8]] = &[
        &[0xc0],                                                 // nil
        &[0xc3],                                                 // true
        &[0x00],                                                 // 0
        &[0xff],                                                 // -1
        &[0xcd, 0xff, 0xff],                                     // u16::MAX
        &[0xce, 0xff, 0xff, 0xff, 0xff],                         // u32::MAX
        &[0xcf, 0x80, 0, 0, 0, 0, 0, 0, 0],                      // 2^63
        &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff], // u64::MAX
        &[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0],                      // i64::MIN
        &[0xcb, 0x7e, 0x37, 0xe4, 0x3c, 0x88, 0x00, 0x75, 0x9c], // 1e300
        &[0xcb, 0x7f, 0xf8, 0, 0, 0, 0, 0, 0],                   // NaN
        &[0xca, 0x80, 0, 0, 0],                                  // -0.0f32
        &[0xd9, 0xff, b'a'],                                     // str8 of 255, 1 present
        &[0xdb, 0xff, 0xff, 0xff, 0xff, b'a'],                   // str32 of 2^32-1
        &[0xa2, 0xff, 0xfe],                                     // invalid UTF-8
        &[0xc6, 0xff, 0xff, 0xff, 0xff, 0],                      // bin32 of 2^32-1
        &[0xdd, 0xff, 0xff, 0xff, 0xff, 0],                      // array32 of 2^32-1
        &[0xdf, 0xff, 0xff, 0xff, 0xff, 0xa1, b'x', 0],          // map32 of 2^32-1
        &[0xc9, 0xff, 0xff, 0xff, 0xff, 0x01],                   // ext32 of 2^32-1
        &[0xd4, 0x01, 0x00],                                     // fixext1
        &[0xc1],                                                 // reserved
        &[0x90],                                                 // []
        &[0x80],                                                 // {}
        &[0x93, 0x01, 0x02, 0x03],                               // [1, 2, 3]
        // an Addr
        &[0x82, 0xa4, b'h', b'o', b's', b't', 0x01, 0xa5, b'a', b'c', b't', b'o', b'r', 0x02],
        // an Addr as an array
        &[0x92, 0xcd, 0xff, 0xff, 0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
        &[0xa1, b'x'], // "x"
        &[],           // the value is missing
    ];

    const FIELDS: &[&str] = &["v", "from", "to", "topic", "kind", "corr", "payload"];

    /// A key (short: a fixstr).
    fn str_bytes(s: &str) -> Vec<u8> {
        let mut out = vec![0xa0 | s.len() as u8];
        out.extend_from_slice(s.as_bytes());
        out
    }

    /// One field as written: its valid encoding, a hostile value, or absent.
    #[derive(Debug, Clone, Copy)]
    enum Slot {
        Valid,
        Hostile(usize),
        Absent,
    }

    fn arb_slot() -> impl Strategy<Value = Slot> {
        prop_oneof![12 => Just(Slot::Valid), 3 => (0..HOSTILE.len()).prop_map(Slot::Hostile), 1 => Just(Slot::Absent)]
    }

    #[derive(Debug, Clone)]
    enum Edit {
        None,
        Flip(usize, u8),
        Truncate(usize),
        Insert(usize, Vec<u8>),
        Delete(usize, usize),
    }

    fn arb_edit() -> impl Strategy<Value = Edit> {
        prop_oneof![
            3 => Just(Edit::None),
            1 => (any::<usize>(), 1..=255u8).prop_map(|(at, x)| Edit::Flip(at, x)),
            1 => any::<usize>().prop_map(Edit::Truncate),
            1 => (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..9)).prop_map(|(at, b)| Edit::Insert(at, b)),
            1 => (any::<usize>(), 1..9usize).prop_map(|(at, n)| Edit::Delete(at, n)),
        ]
    }

    /// A frame with `env`'s fields in `slots`' forms, an optional unknown and repeated
    /// key, and a map header that may claim more entries than follow.
    fn write_frame(
        env: &Envelope,
        slots: &[Slot],
        extra: Option<usize>,
        repeat: Option<usize>,
        overclaim: u16,
    ) -> Vec<u8> {
        // Each field's valid encoding, as `to_vec_named` writes it inside the envelope.
        let valid = |field: &str| -> Vec<u8> {
            let bytes = match field {
                "v" => rmp_serde::to_vec(&env.v),
                "from" => rmp_serde::to_vec_named(&env.from),
                "to" => rmp_serde::to_vec_named(&env.to),
                "topic" => rmp_serde::to_vec(&env.topic),
                "kind" => rmp_serde::to_vec(&env.kind),
                "corr" => rmp_serde::to_vec(&env.corr),
                _ => rmp_serde::to_vec(&serde_bytes::Bytes::new(&env.payload)),
            };
            bytes.unwrap_or_default()
        };
        let mut entries: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        for (i, slot) in slots.iter().enumerate() {
            match slot {
                Slot::Valid => entries.push((str_bytes(FIELDS[i]), valid(FIELDS[i]))),
                Slot::Hostile(h) => entries.push((str_bytes(FIELDS[i]), HOSTILE[*h].to_vec())),
                Slot::Absent => {}
            }
        }
        if let Some(h) = extra {
            entries.push((str_bytes("deadline_ms"), HOSTILE[h].to_vec()));
        }
        if let Some(i) = repeat
            && !entries.is_empty()
        {
            let again = entries[i % entries.len()].clone();
            entries.push(again);
        }
        let mut frame = vec![0xde];
        frame.extend_from_slice(&(entries.len() as u16).saturating_add(overclaim).to_be_bytes());
        for (key, value) in entries {
            frame.extend_from_slice(&key);
            frame.extend_from_slice(&value);
        }
        frame
    }

    fn apply(frame: &mut Vec<u8>, edit: &Edit) {
        let n = frame.len().max(1);
        match edit {
            Edit::None => {}
            Edit::Flip(at, x) => frame[at % n] ^= x,
            Edit::Truncate(at) => frame.truncate(at % n),
            Edit::Insert(at, bytes) => {
                let at = at % (frame.len() + 1);
                frame.splice(at..at, bytes.iter().copied());
            }
            Edit::Delete(at, len) => {
                let at = at % n;
                frame.drain(at..(at + len).min(frame.len()));
            }
        }
    }

    fn arb_env() -> impl Strategy<Value = Envelope> {
        (
            (any::<u16>(), any::<u64>(), proptest::option::of((any::<u16>(), any::<u64>()))),
            proptest::option::of("[a-z./]{0,40}"),
            ".{0,12}",
            any::<u64>(),
            proptest::collection::vec(any::<u8>(), 0..300),
        )
            .prop_map(|((fh, fa, to), topic, kind, corr, payload)| Envelope {
                v: PROTOCOL_VERSION,
                from: Addr::new(crate::addr::HostId(fh), fa),
                to: to.map(|(h, a)| Addr::new(crate::addr::HostId(h), a)),
                topic,
                kind,
                corr,
                payload,
            })
    }

    /// Cases per property: `PROPTEST_CASES` when set (a longer local run), else what CI runs.
    fn cases(ci: u32) -> u32 {
        std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(ci)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: cases(2048), ..ProptestConfig::default() })]

        #[test]
        fn hand_written_frames_decode_or_refuse(
            env in arb_env(),
            slots in proptest::collection::vec(arb_slot(), FIELDS.len()),
            extra in proptest::option::weighted(0.2, 0..HOSTILE.len()),
            repeat in proptest::option::weighted(0.2, any::<usize>()),
            overclaim in prop_oneof![5 => Just(0u16), 1 => Just(1u16), 1 => Just(u16::MAX)],
            edit in arb_edit(),
        ) {
            let mut frame = write_frame(&env, &slots, extra, repeat, overclaim);
            let pristine = matches!(edit, Edit::None)
                && overclaim == 0
                && repeat.is_none()
                && extra.is_none()
                && slots.iter().all(|s| matches!(s, Slot::Valid));
            apply(&mut frame, &edit);
            match decode(&frame) {
                Ok(back) => {
                    prop_assert_eq!(back.v, PROTOCOL_VERSION);
                    let again = encode(&back).map_err(|e| TestCaseError::fail(e.to_string()))?;
                    prop_assert_eq!(decode(&again).map_err(|e| TestCaseError::fail(e.to_string()))?, back.clone());
                    if pristine {
                        prop_assert_eq!(back, env);
                    }
                }
                Err(e) => {
                    prop_assert!(!pristine, "a valid hand-written frame was refused: {}", e);
                    let _ = (e.reason(), e.to_string());
                }
            }
        }
    }

    proptest! {
        /// The valid hand-written frames above are what the encoder writes, in substance.
        #[test]
        fn valid_hand_written_frames_decode_to_their_envelope(env in arb_env()) {
            let frame = write_frame(&env, &[Slot::Valid; FIELDS.len()], None, None, 0);
            prop_assert_eq!(decode(&frame).map_err(|e| TestCaseError::fail(e.to_string()))?, env);
        }
    }

    /// Length prefixes far past the end of the frame are refused without allocating
    /// what they announce.
    #[test]
    fn length_prefixes_past_the_end_are_refused() {
        let env = Envelope::direct(
            Addr::new(crate::addr::HostId(1), 2),
            Addr::new(crate::addr::HostId(3), 4),
            "K",
            5,
            vec![6],
        );
        let slots = vec![Slot::Valid; FIELDS.len()];
        for (h, hostile) in HOSTILE.iter().enumerate() {
            if hostile.len() > 4 && matches!(hostile[0], 0xdb | 0xc6 | 0xdd | 0xdf | 0xc9) {
                for field in 1..FIELDS.len() {
                    let mut slots = slots.clone();
                    slots[field] = Slot::Hostile(h);
                    let frame = write_frame(&env, &slots, None, None, 0);
                    assert!(decode(&frame).is_err(), "{} as {hostile:02x?}", FIELDS[field]);
                }
            }
        }
    }
}
