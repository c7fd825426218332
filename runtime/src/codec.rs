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
