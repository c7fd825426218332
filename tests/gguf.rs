//! A real model from a single GGUF file: the shared SmolLM2-135M-Instruct (Q4_1 linears,
//! Q8_0 embedding) through `tessera generate`.

use std::path::{Path, PathBuf};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_tessera");

fn smollm2() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// Greedy generation: (text on stdout, stderr).
fn generate(model: &Path, prompt: &str, max_tokens: usize) -> (String, String) {
    let out = Command::new(BIN)
        .args(["generate", "--model"])
        .arg(model)
        .args(["--prompt", prompt, "--max-tokens", &max_tokens.to_string()])
        .env_remove("TESSERA_KERNEL_LIB")
        .output()
        .expect("run tessera");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "generate failed: {stderr}");
    (stdout, stderr)
}

#[test]
fn smollm2_gguf_knows_the_capital_of_france() {
    let (text, stderr) = generate(&smollm2(), "The capital of France is", 4);
    assert!(text.starts_with(" Paris"), "continued with {text:?}; {stderr}");
}

#[test]
fn damaged_gguf_files_exit_non_zero_with_a_clear_message() {
    let good = std::fs::read(smollm2()).expect("the shared model");
    let dir = tempfile::tempdir().expect("tempdir");
    let cases: [(&str, Vec<u8>, &str); 3] = [
        ("truncated.gguf", good[..good.len() / 2].to_vec(), "past the end of the file"),
        ("magic.gguf", [b"GGML".as_slice(), &good[4..4096]].concat(), "not a GGUF file"),
        ("short.gguf", good[..100].to_vec(), "cannot fit"),
    ];
    for (name, bytes, expect) in cases {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).expect("write");
        let out = Command::new(BIN)
            .args(["generate", "--model"])
            .arg(&path)
            .args(["--prompt", "hi"])
            .env_remove("TESSERA_KERNEL_LIB")
            .output()
            .expect("run tessera");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name} was accepted");
        assert!(stderr.contains(expect) && stderr.contains(name), "{name}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}
