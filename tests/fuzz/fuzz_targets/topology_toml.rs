//! Topology TOML (`tessera_topology::parse`): refused with an error that names a place in
//! the text, or accepted as a spec whose derived figures stay usable (rendered, paced).
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::time::Duration;
use tessera_topology::{Backend, parse, perf};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    match parse(&text, "fuzz.toml") {
        Ok(spec) => {
            let _ = spec.render();
            let _ = spec.disagg.chunk_bytes();
            let _ = Duration::from_millis(spec.supervisor.restart_backoff_ms).checked_mul(32).expect("backoff");
            for (_, _, chip) in spec.chips() {
                let kind = spec.chip_kind(&chip.kind).expect("every chip's kind resolves");
                if let Backend::Emu(_) = chip.backend {
                    let step = spec.emulation.reference_step(kind);
                    assert!(step.time_s.is_finite() && step.time_s <= perf::MAX_STEP_S);
                    let _ = Duration::from_secs_f64(step.time_s);
                }
            }
        }
        Err(e) => {
            assert!(e.line >= 1 && e.column >= 1, "an error without a place: {e:?}");
            let _ = e.to_string();
        }
    }
});
