//! The ZMTP framing of the vendored zeromq, fed as a peer would at any bus port: greeting,
//! commands, message frames. Input: byte 0 picks the read size (0: all at once, else
//! 1..=255 bytes per read), byte 1 the maximum message size (256 << (b % 17): 256 B to
//! 16 MiB, the bus default, past the decoder's 128 KiB headroom threshold); the rest is
//! what the peer sends. The decoder must refuse, never panic nor reserve past its bound
//! (`decode_for_fuzzing` asserts that), and must answer the same however reads split the
//! bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let [read, max, stream @ ..] = data else { return };
    let chunk = if *read == 0 { usize::MAX } else { usize::from(*read) };
    let max = 256usize << (max % 17);
    let split = zeromq::decode_for_fuzzing(stream, max, chunk).map_err(|e| format!("{e:?}"));
    let whole = zeromq::decode_for_fuzzing(stream, max, usize::MAX).map_err(|e| format!("{e:?}"));
    assert_eq!(split, whole, "the answer depends on how reads split the bytes");
});
