//! The TCP data-plane frames. Little-endian, fixed size, no allocation to parse.
//!
//! ```text
//! request  (32 B): magic u32 | version u16 | op u16 | region u64 | offset u64 | len u64
//!          op 2 (read with a capability) is followed by the 16-byte capability
//! response (16 B): magic u32 | status u16  | 0 u16  | len u64
//!                  then `len` bytes: the region's bytes (status OK) or UTF-8 error text
//! ```
//! A client may pipeline requests; responses come back in request order. After a
//! request whose header cannot be trusted (bad magic, version or op) the server replies
//! with an error and closes the connection; after a well-formed request it refuses
//! (unknown region, out of bounds, too long) it replies with an error and keeps serving.
//! A server refusing a new connection (`TooManyConnections`) replies before any request
//! and closes: the client reads it as the answer to its first request. Error text names
//! only what the request named, never other regions.
#![forbid(unsafe_code)]

pub(crate) const MAGIC: u32 = u32::from_le_bytes(*b"TSXF");
pub(crate) const RESPONSE_MAGIC: u32 = u32::from_le_bytes(*b"TSXR");
pub(crate) const VERSION: u16 = 1;
pub(crate) const OP_READ: u16 = 1;
/// A read carrying a capability (the 16 bytes after the header).
pub(crate) const OP_READ_CAP: u16 = 2;
pub(crate) const CAPABILITY_BYTES: usize = 16;
pub(crate) const REQUEST_BYTES: usize = 32;
pub(crate) const RESPONSE_BYTES: usize = 16;
/// Longest single request a server accepts; clients split into `chunk_bytes` anyway.
pub(crate) const MAX_REQUEST_LEN: u64 = 1 << 30;
/// Longest error text a client accepts in a response.
pub(crate) const MAX_ERROR_TEXT: u64 = 64 * 1024;

/// A read of `len` bytes at `offset` of region `region`; `capability`: the 16 bytes
/// that follow the header (op 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Request {
    pub region: u64,
    pub offset: u64,
    pub len: u64,
    pub capability: bool,
}

/// Why a request header was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum HeaderError {
    #[error("bad magic {0:#010x} (expected {MAGIC:#010x}, \"TSXF\")")]
    Magic(u32),
    #[error("unsupported protocol version {0} (this server speaks {VERSION})")]
    Version(u16),
    #[error("unknown op {0} (only {OP_READ} = read and {OP_READ_CAP} = read with a capability)")]
    Op(u16),
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

impl Request {
    pub(crate) fn encode(&self) -> [u8; REQUEST_BYTES] {
        let mut b = [0u8; REQUEST_BYTES];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&(if self.capability { OP_READ_CAP } else { OP_READ }).to_le_bytes());
        b[8..16].copy_from_slice(&self.region.to_le_bytes());
        b[16..24].copy_from_slice(&self.offset.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8; REQUEST_BYTES]) -> Result<Request, HeaderError> {
        let magic = u32_at(b, 0);
        if magic != MAGIC {
            return Err(HeaderError::Magic(magic));
        }
        let version = u16_at(b, 4);
        if version != VERSION {
            return Err(HeaderError::Version(version));
        }
        let op = u16_at(b, 6);
        if op != OP_READ && op != OP_READ_CAP {
            return Err(HeaderError::Op(op));
        }
        Ok(Request { region: u64_at(b, 8), offset: u64_at(b, 16), len: u64_at(b, 24), capability: op == OP_READ_CAP })
    }
}

/// Response status; anything but `Ok` carries error text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Status {
    Ok,
    UnknownRegion,
    OutOfBounds,
    TooLarge,
    BadRequest,
    /// The range is being written by the owner right now.
    Busy,
    TooManyConnections,
    /// No valid capability for the range (a secured server reads only what it offered).
    Forbidden,
}

impl Status {
    fn code(self) -> u16 {
        match self {
            Status::Ok => 0,
            Status::UnknownRegion => 1,
            Status::OutOfBounds => 2,
            Status::TooLarge => 3,
            Status::BadRequest => 4,
            Status::Busy => 5,
            Status::TooManyConnections => 6,
            Status::Forbidden => 7,
        }
    }

    fn from_code(code: u16) -> Option<Status> {
        Some(match code {
            0 => Status::Ok,
            1 => Status::UnknownRegion,
            2 => Status::OutOfBounds,
            3 => Status::TooLarge,
            4 => Status::BadRequest,
            5 => Status::Busy,
            6 => Status::TooManyConnections,
            7 => Status::Forbidden,
            _ => return None,
        })
    }

    /// Metric label.
    pub(crate) fn reason(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::UnknownRegion => "unknown_region",
            Status::OutOfBounds => "out_of_bounds",
            Status::TooLarge => "too_large",
            Status::BadRequest => "bad_request",
            Status::Busy => "range_busy",
            Status::TooManyConnections => "too_many_connections",
            Status::Forbidden => "forbidden",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Response {
    pub status: Status,
    pub len: u64,
}

impl Response {
    pub(crate) fn encode(&self) -> [u8; RESPONSE_BYTES] {
        let mut b = [0u8; RESPONSE_BYTES];
        b[0..4].copy_from_slice(&RESPONSE_MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&self.status.code().to_le_bytes());
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// The error says what was wrong, for a protocol error naming the peer.
    pub(crate) fn decode(b: &[u8; RESPONSE_BYTES]) -> Result<Response, String> {
        let magic = u32_at(b, 0);
        if magic != RESPONSE_MAGIC {
            return Err(format!("bad response magic {magic:#010x} (expected {RESPONSE_MAGIC:#010x})"));
        }
        let code = u16_at(b, 4);
        let status = Status::from_code(code).ok_or_else(|| format!("unknown response status {code}"))?;
        Ok(Response { status, len: u64_at(b, 8) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trips() {
        for capability in [false, true] {
            let r = Request { region: 0xdead_beef_0000_0001, offset: 1 << 40, len: 12345, capability };
            assert_eq!(Request::decode(&r.encode()), Ok(r));
        }
    }

    #[test]
    fn request_header_errors_name_the_field() {
        let good = Request { region: 1, offset: 2, len: 3, capability: false }.encode();
        let mut b = good;
        b[0] = b'X';
        assert!(Request::decode(&b).unwrap_err().to_string().contains("bad magic"));
        let mut b = good;
        b[4] = 9;
        assert_eq!(Request::decode(&b), Err(HeaderError::Version(9)));
        let mut b = good;
        b[6] = 7;
        assert_eq!(Request::decode(&b), Err(HeaderError::Op(7)));
    }

    #[test]
    fn response_round_trips_and_rejects_garbage() {
        for status in [Status::Ok, Status::UnknownRegion, Status::OutOfBounds, Status::Busy] {
            let r = Response { status, len: 77 };
            assert_eq!(Response::decode(&r.encode()), Ok(r));
        }
        assert!(Response::decode(&[0u8; RESPONSE_BYTES]).unwrap_err().contains("bad response magic"));
        let mut b = Response { status: Status::Ok, len: 0 }.encode();
        b[4] = 200;
        assert!(Response::decode(&b).unwrap_err().contains("unknown response status 200"));
    }
}

/// Bounded fuzzing of both header parsers (CI): arbitrary headers, and valid ones with
/// extreme fields and flipped bytes. A header is accepted exactly when its magic,
/// version and op (status) are right, and an accepted one re-encodes to its bytes.
/// The coverage-guided target is `tests/fuzz/fuzz_targets/transfer_header.rs`.
#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    fn extreme() -> impl Strategy<Value = u64> {
        prop_oneof![
            Just(0u64),
            Just(1),
            Just(MAX_REQUEST_LEN),
            Just(MAX_REQUEST_LEN + 1),
            Just(MAX_ERROR_TEXT + 1),
            Just(i64::MAX as u64),
            Just(1 << 63),
            Just(u64::MAX),
            any::<u64>(),
        ]
    }

    fn request_accepted(b: &[u8; REQUEST_BYTES]) -> bool {
        u32_at(b, 0) == MAGIC && u16_at(b, 4) == VERSION && matches!(u16_at(b, 6), OP_READ | OP_READ_CAP)
    }

    /// Cases per property: `PROPTEST_CASES` when set (a longer local run), else what CI runs.
    fn cases(ci: u32) -> u32 {
        std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(ci)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: cases(4096), ..ProptestConfig::default() })]

        #[test]
        fn arbitrary_request_headers(b in any::<[u8; REQUEST_BYTES]>()) {
            match Request::decode(&b) {
                Ok(r) => prop_assert_eq!(r.encode(), b),
                Err(e) => {
                    prop_assert!(!request_accepted(&b));
                    prop_assert!(!e.to_string().is_empty());
                }
            }
        }

        #[test]
        fn valid_request_headers_with_extremes_and_a_flip(
            region in extreme(),
            offset in extreme(),
            len in extreme(),
            flip in proptest::option::of((0..REQUEST_BYTES, 1..=255u8)),
        ) {
            let request = Request { region, offset, len, capability: false };
            let mut b = request.encode();
            if let Some((at, xor)) = flip {
                b[at] ^= xor;
            }
            match Request::decode(&b) {
                Ok(r) => {
                    // op 1 -> 3 is refused, 1 -> 2 (a read with a capability) is an op too.
                    let op_flip_to_cap = flip.is_some_and(|(at, xor)| at == 6 && xor == 3);
                    prop_assert!(flip.is_none_or(|(at, _)| at >= 8) || op_flip_to_cap, "a flip in magic/version/op was accepted");
                    prop_assert_eq!(r.encode(), b);
                    if flip.is_none() {
                        prop_assert_eq!(r, request);
                    }
                    prop_assert_eq!(r.capability, op_flip_to_cap);
                }
                Err(e) => {
                    let (at, _) = flip.ok_or_else(|| TestCaseError::fail(format!("valid header refused: {e}")))?;
                    let expected = match at {
                        0..4 => matches!(e, HeaderError::Magic(_)),
                        4..6 => matches!(e, HeaderError::Version(_)),
                        _ => matches!(e, HeaderError::Op(_)),
                    };
                    prop_assert!(expected, "flip at byte {} gave {:?}", at, e);
                }
            }
        }

        #[test]
        fn arbitrary_response_headers(b in any::<[u8; RESPONSE_BYTES]>(), valid_magic in any::<bool>()) {
            let mut b = b;
            if valid_magic {
                b[0..4].copy_from_slice(&RESPONSE_MAGIC.to_le_bytes());
            }
            let accepted = u32_at(&b, 0) == RESPONSE_MAGIC && Status::from_code(u16_at(&b, 4)).is_some();
            match Response::decode(&b) {
                Ok(r) => {
                    prop_assert!(accepted);
                    prop_assert_eq!(r.len, u64_at(&b, 8));
                    // Bytes 6..8 are reserved: ignored on read, zero on write.
                    let mut expected = b;
                    expected[6..8].fill(0);
                    prop_assert_eq!(r.encode(), expected);
                }
                Err(e) => {
                    prop_assert!(!accepted);
                    prop_assert!(!e.is_empty());
                }
            }
        }

        #[test]
        fn the_fuzzing_hook_agrees_with_the_parsers(bytes in proptest::collection::vec(any::<u8>(), 0..48)) {
            let (request, response) = super::super::decode_headers_for_fuzzing(&bytes);
            let expected_request = bytes
                .first_chunk::<REQUEST_BYTES>()
                .and_then(|b| Request::decode(b).ok())
                .map(|r| [r.region, r.offset, r.len]);
            prop_assert_eq!(request, expected_request);
            let expected_response =
                bytes.first_chunk::<RESPONSE_BYTES>().and_then(|b| Response::decode(b).ok()).map(|r| (r.status, r.len));
            prop_assert_eq!(response, expected_response);
        }
    }
}
