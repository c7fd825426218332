//! The bus envelope codec (`tessera_runtime::codec`): a frame as another host sends it,
//! and the actor message inside it as the receiving host decodes it
//! (`tessera_actors::msg::Msg`, see `runtime/src/host.rs`). Whatever decodes is a
//! version-1 envelope that round-trips through the encoder.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_actors::msg::Msg;
use tessera_runtime::codec::{self, PROTOCOL_VERSION};

fuzz_target!(|data: &[u8]| {
    match codec::decode(data) {
        Ok(env) => {
            assert_eq!(env.v, PROTOCOL_VERSION);
            let frame = codec::encode(&env).expect("a decoded envelope encodes");
            assert_eq!(codec::decode(&frame).expect("an encoded envelope decodes"), env);
            let _ = codec::decode_payload::<Msg>(&env.payload);
        }
        Err(e) => {
            let _ = (e.reason(), e.to_string());
        }
    }
    // The payload decoder on its own, so the fuzzer need not wrap every message. Compared
    // as bytes: a message may carry a NaN, which is not equal to itself.
    if let Ok(msg) = codec::decode_payload::<Msg>(data) {
        let bytes = codec::encode_payload(&msg).expect("a decoded message encodes");
        let again = codec::decode_payload::<Msg>(&bytes).expect("an encoded message decodes");
        assert_eq!(codec::encode_payload(&again).expect("a decoded message encodes"), bytes);
    }
});
