//! GGUF files (`tessera_backends::gguf::Gguf::from_bytes`), then what loading one does:
//! the config from its metadata (`ModelConfig::from_dir`), `tessera model info`
//! (`gguf::info::describe`), its vocabulary (`TextTokenizer::from_gguf`) and its tensors
//! (`Checkpoint::open`, each tensor dequantized). Refused with an error, or every tensor's
//! bytes are exactly what its type and shape need, inside the file.
#![no_main]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tessera_backends::config::ModelConfig;
use tessera_backends::gguf::{Gguf, hf, info};
use tessera_backends::tokenizer::TextTokenizer;
use tessera_backends::weights::Checkpoint;

/// Dequantized values per input, at most (4 MiB of f32s): bounds the work on one input,
/// not what the parser accepts.
const MAX_VALUES: u64 = 1 << 20;

/// One file per fuzzing process, rewritten on every input.
fn file() -> &'static PathBuf {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("tessera-fuzz-gguf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        dir.join("model.gguf")
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(g) = Gguf::from_bytes(data.to_vec(), Path::new("fuzz.gguf")) else { return };
    let mut values = 0u64;
    for t in g.tensors() {
        assert_eq!(g.tensor(&t.name), Some(t), "tensors are found by name");
        let elements = t.elements();
        assert_eq!(elements / t.ty.block_elements() * t.ty.block_bytes(), t.size);
        assert_eq!(g.tensor_bytes(t).len() as u64, t.size);
        assert!(t.size <= data.len() as u64);
        values = values.saturating_add(elements);
        if values <= MAX_VALUES {
            assert_eq!(g.tensor_f32(t).len() as u64, elements);
        }
    }
    if let Ok(hf) = hf::hf_config(&g) {
        let _ = ModelConfig::from_hf(&hf, g.path());
    }
    if let Ok(described) = info::describe(&g) {
        let _ = described.render();
    }
    let _ = hf::tokenizer_json(&g);

    // The loaders open the file by path (memory-mapped).
    let path = file();
    std::fs::write(path, data).expect("writing the scratch file");
    let _ = ModelConfig::from_dir(path);
    if let Ok(tok) = TextTokenizer::from_gguf(path) {
        if let Ok(ids) = tok.encode("Hello, world! 12345 <|im_start|>", true) {
            let _ = tok.decode(&ids);
        }
    }
    if values <= MAX_VALUES {
        let _ = Checkpoint::open(path);
    }
});
