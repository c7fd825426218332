//! Checkpoint loading (`tessera_backends::weights::Checkpoint::open`): the bytes as
//! `model.safetensors` of a checkpoint directory. Refused with an error, or every tensor
//! is readable with exactly the bytes its dtype and shape need.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tessera_backends::weights::Checkpoint;

/// One directory per fuzzing process, rewritten on every input.
fn dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("tessera-fuzz-safetensors-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        dir
    })
}

fuzz_target!(|data: &[u8]| {
    let dir = dir();
    std::fs::write(dir.join("model.safetensors"), data).expect("writing the scratch file");
    let Ok(ckpt) = Checkpoint::open(dir) else { return };
    let st = safetensors::SafeTensors::deserialize(data).expect("what the loader accepted parses");
    for (name, view) in st.tensors() {
        let entry = ckpt.get(&name, view.shape()).expect("every tensor is found with its shape");
        let elements: usize = view.shape().iter().product();
        assert_eq!(ckpt.bytes(entry).len(), elements * entry.dtype.size_bytes());
        let values = ckpt.to_f32(&name, view.shape()).expect("to f32");
        assert_eq!(values.len(), elements);
    }
});
