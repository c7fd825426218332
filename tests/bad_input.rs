//! The CLI refuses bad input with a clear error and a non-zero exit, never a panic.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tempfile::TempDir;
use tessera_backends::synth::{self, Preset, SynthArch, SynthSpec};

const BIN: &str = env!("CARGO_BIN_EXE_tessera");

/// A fresh tiny llama checkpoint in its own temp dir.
fn tiny() -> (TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    synth::write_checkpoint(&dir, &SynthSpec::new(Preset::Tiny, SynthArch::Llama)).unwrap();
    (tmp, dir)
}

fn run(args: &[&str]) -> Output {
    Command::new(BIN).args(args).env_remove("TESSERA_KERNEL_LIB").output().expect("run tessera")
}

fn generate(model: &Path, extra: &[&str]) -> Output {
    let model = model.to_str().unwrap();
    let mut args = vec!["generate", "--model", model, "--prompt", "hi"];
    if !extra.contains(&"--max-tokens") {
        args.extend_from_slice(&["--max-tokens", "2"]);
    }
    args.extend_from_slice(extra);
    run(&args)
}

/// Asserts a clean refusal: non-zero exit, no panic, and every phrase in stderr.
#[track_caller]
fn assert_refused(out: &Output, phrases: &[&str]) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "expected failure, got success; stderr:\n{stderr}");
    assert!(out.status.code().is_some(), "killed by a signal: {:?}; stderr:\n{stderr}", out.status);
    assert!(!stderr.contains("panicked"), "panicked:\n{stderr}");
    assert!(!stderr.contains("RUST_BACKTRACE"), "panicked:\n{stderr}");
    for p in phrases {
        assert!(stderr.contains(p), "stderr lacks {p:?}:\n{stderr}");
    }
    stderr
}

fn deps_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().to_path_buf()
}

fn fixture(name: &str) -> PathBuf {
    let (prefix, suffix) = (std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX);
    let path = deps_dir().join(format!("{prefix}tessera_fixture_kernels_{name}{suffix}"));
    assert!(path.is_file(), "fixture library {} was not built", path.display());
    path
}

/// Rewrites `dir/model.safetensors` through `edit`, which sees every (name, dtype,
/// shape, bytes) and returns the tensors to keep.
fn rewrite_weights(
    dir: &Path,
    edit: impl FnOnce(
        Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>,
    ) -> Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>,
) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let tensors: Vec<_> =
        st.tensors().into_iter().map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec())).collect();
    let kept = edit(tensors);
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = kept
        .iter()
        .map(|(n, dt, shape, data)| {
            (n.clone(), safetensors::tensor::TensorView::new(*dt, shape.clone(), data).unwrap())
        })
        .collect();
    let out = safetensors::serialize(views, None).unwrap();
    std::fs::write(&path, out).unwrap();
}

#[test]
fn good_checkpoint_generates() {
    // The baseline the other cases break: the same command succeeds.
    let (_tmp, dir) = tiny();
    let out = generate(&dir, &[]);
    assert!(out.status.success(), "stderr:\n{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn truncated_safetensors() {
    let (_tmp, dir) = tiny();
    let path = dir.join("model.safetensors");
    let len = std::fs::metadata(&path).unwrap().len();
    for keep in [len - 1000, len / 2, 100, 7, 0] {
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(keep).unwrap();
        drop(f);
        let out = generate(&dir, &[]);
        assert_refused(&out, &["model.safetensors", "invalid safetensors"]);
    }
}

#[test]
fn garbage_safetensors_header() {
    let (_tmp, dir) = tiny();
    let path = dir.join("model.safetensors");
    // A header length far larger than the file.
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    assert_refused(&generate(&dir, &[]), &["model.safetensors", "invalid safetensors"]);
    // A header that is not JSON.
    bytes[..8].copy_from_slice(&16u64.to_le_bytes());
    bytes[8..24].copy_from_slice(b"this is no json!");
    std::fs::write(&path, &bytes).unwrap();
    assert_refused(&generate(&dir, &[]), &["model.safetensors", "invalid safetensors"]);
}

#[test]
fn missing_tensor() {
    let (_tmp, dir) = tiny();
    let victim = "model.layers.1.self_attn.k_proj.weight";
    rewrite_weights(&dir, |ts| {
        assert!(ts.iter().any(|t| t.0 == victim), "tiny checkpoint has {victim}");
        ts.into_iter().filter(|t| t.0 != victim).collect()
    });
    assert_refused(&generate(&dir, &[]), &["missing tensor", victim]);
}

#[test]
fn missing_norm_tensor() {
    let (_tmp, dir) = tiny();
    rewrite_weights(&dir, |ts| ts.into_iter().filter(|t| t.0 != "model.norm.weight").collect());
    assert_refused(&generate(&dir, &[]), &["missing tensor", "model.norm.weight"]);
}

#[test]
fn tensor_of_wrong_shape() {
    let (_tmp, dir) = tiny();
    let victim = "model.layers.0.mlp.gate_proj.weight";
    rewrite_weights(&dir, |mut ts| {
        let t = ts.iter_mut().find(|t| t.0 == victim).unwrap();
        assert_eq!(t.2.len(), 2);
        t.2.reverse(); // same number of elements, transposed shape
        ts
    });
    assert_refused(&generate(&dir, &[]), &[victim, "shape", "expected"]);
}

#[test]
fn tensor_of_unsupported_dtype() {
    let (_tmp, dir) = tiny();
    let victim = "model.norm.weight";
    rewrite_weights(&dir, |mut ts| {
        let t = ts.iter_mut().find(|t| t.0 == victim).unwrap();
        t.1 = safetensors::Dtype::I32;
        ts
    });
    assert_refused(&generate(&dir, &[]), &[victim, "dtype"]);
}

#[test]
fn unknown_architecture() {
    let (_tmp, dir) = tiny();
    let path = dir.join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg["architectures"] = serde_json::json!(["MambaForCausalLM"]);
    std::fs::write(&path, serde_json::to_string(&cfg).unwrap()).unwrap();
    assert_refused(&generate(&dir, &[]), &["unsupported architecture", "MambaForCausalLM", "LlamaForCausalLM"]);
}

#[test]
fn malformed_config() {
    let (_tmp, dir) = tiny();
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, &text[..text.len() / 2]).unwrap();
    assert_refused(&generate(&dir, &[]), &["config.json", "invalid model config"]);
    std::fs::write(&path, "[1, 2, 3]").unwrap();
    assert_refused(&generate(&dir, &[]), &["config.json", "invalid model config"]);
    // Well-formed JSON with an impossible value.
    let mut cfg: serde_json::Value = serde_json::from_str(&text).unwrap();
    cfg["num_attention_heads"] = serde_json::json!(0);
    std::fs::write(&path, serde_json::to_string(&cfg).unwrap()).unwrap();
    assert_refused(&generate(&dir, &[]), &["config.json"]);
    // Heads not divisible by kv heads.
    let mut cfg: serde_json::Value = serde_json::from_str(&text).unwrap();
    cfg["num_key_value_heads"] = serde_json::json!(3);
    std::fs::write(&path, serde_json::to_string(&cfg).unwrap()).unwrap();
    assert_refused(&generate(&dir, &[]), &["config.json"]);
    // Sizes that would overflow or exhaust memory before any tensor is read.
    for (key, value, phrase) in [
        ("num_hidden_layers", serde_json::json!(200_000_000), "`num_hidden_layers` = 200000000 is out of range"),
        ("head_dim", serde_json::json!(4_611_686_018_427_387_904u64), "`head_dim`"),
        ("head_dim", serde_json::json!(9_223_372_036_854_775_840u64), "`head_dim`"),
        ("vocab_size", serde_json::json!(1u64 << 40), "`vocab_size`"),
    ] {
        let mut cfg: serde_json::Value = serde_json::from_str(&text).unwrap();
        cfg[key] = value;
        std::fs::write(&path, serde_json::to_string(&cfg).unwrap()).unwrap();
        assert_refused(&generate(&dir, &[]), &["config.json", phrase]);
    }
}

#[test]
fn no_tokenizer() {
    let (_tmp, dir) = tiny();
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    assert_refused(&generate(&dir, &[]), &["tokenizer.json"]);
    // Also with --prompt-ids, which needs the tokenizer only to print the output.
    let out = run(&["generate", "--model", dir.to_str().unwrap(), "--prompt-ids", "1,2", "--max-tokens", "2"]);
    assert_refused(&out, &["tokenizer.json"]);
}

#[test]
fn malformed_tokenizer() {
    let (_tmp, dir) = tiny();
    std::fs::write(dir.join("tokenizer.json"), "{\"model\": 42").unwrap();
    assert_refused(&generate(&dir, &[]), &["tokenizer.json"]);
}

#[test]
fn missing_weights_file() {
    let (_tmp, dir) = tiny();
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    assert_refused(&generate(&dir, &[]), &["model.safetensors"]);
}

#[test]
fn missing_shard() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("sharded");
    let spec = SynthSpec { shards: 2, ..SynthSpec::new(Preset::Tiny, SynthArch::Llama) };
    synth::write_checkpoint(&dir, &spec).unwrap();
    let shard = dir.join("model-00002-of-00002.safetensors");
    assert!(shard.is_file());
    std::fs::remove_file(&shard).unwrap();
    assert_refused(&generate(&dir, &[]), &["model-00002-of-00002.safetensors"]);
}

#[test]
fn nonexistent_or_unreadable_model_dir() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-such-model");
    let stderr = assert_refused(&generate(&missing, &[]), &["no-such-model"]);
    assert!(stderr.contains("config.json") || stderr.contains("No such file"), "{stderr}");
    // A regular file where the directory should be.
    let file = tmp.path().join("a-file");
    std::fs::write(&file, "not a directory").unwrap();
    assert_refused(&generate(&file, &[]), &["a-file"]);
    // An empty directory.
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    assert_refused(&generate(&empty, &[]), &["config.json"]);
    // A directory whose config.json is a directory (unreadable as a file, even as root).
    let weird = tmp.path().join("weird");
    std::fs::create_dir_all(weird.join("config.json")).unwrap();
    assert_refused(&generate(&weird, &[]), &["config.json"]);
    // An unknown builtin model.
    assert_refused(&run(&["generate", "--model", "builtin:huge", "--prompt", "hi"]), &["huge"]);
}

#[test]
fn kernel_lib_old_abi() {
    let (_tmp, dir) = tiny();
    let lib = fixture("old_abi");
    let out = generate(&dir, &["--kernel-lib", lib.to_str().unwrap()]);
    assert_refused(&out, &[lib.to_str().unwrap(), "ABI version 0.9", "needs 1.x"]);
}

#[test]
fn kernel_lib_partial() {
    let (_tmp, dir) = tiny();
    let lib = fixture("partial");
    let out = generate(&dir, &["--kernel-lib", lib.to_str().unwrap()]);
    assert_refused(&out, &[lib.to_str().unwrap(), "missing symbol", "tk_device_create"]);
    // At 1.4, some of the collectives without the rest are refused, naming all four.
    let out = Command::new(BIN)
        .env_remove("TESSERA_KERNEL_LIB")
        .args(["generate", "--model", dir.to_str().unwrap(), "--prompt", "hi", "--max-tokens", "2"])
        .args(["--kernel-lib", lib.to_str().unwrap()])
        .env("TESSERA_FIXTURE_ABI_MINOR", "4")
        .output()
        .unwrap();
    assert_refused(&out, &[lib.to_str().unwrap(), "some of the collectives", "tk_all_reduce_sum_f32"]);
}

#[test]
fn kernel_lib_not_a_library() {
    let (_tmp, dir) = tiny();
    let not_lib = dir.join("config.json");
    let out = generate(&dir, &["--kernel-lib", not_lib.to_str().unwrap()]);
    // The loader's reason, not just "dlopen failed".
    assert_refused(&out, &["kernel library", not_lib.to_str().unwrap(), "ELF header"]);
    // A directory.
    let out = generate(&dir, &["--kernel-lib", dir.to_str().unwrap()]);
    assert_refused(&out, &["kernel library", dir.to_str().unwrap()]);
    // A shared library that is not a kernel library (no tk_abi_version).
    let other = std::fs::read_dir(deps_dir()).unwrap().map(|e| e.unwrap().path()).find(|p| {
        let name = p.file_name().unwrap().to_string_lossy();
        name.ends_with(std::env::consts::DLL_SUFFIX) && !name.contains("tessera")
    });
    if let Some(other) = other {
        let out = generate(&dir, &["--kernel-lib", other.to_str().unwrap()]);
        assert_refused(&out, &["kernel library", other.to_str().unwrap()]);
    }
}

#[test]
fn kernel_lib_missing_path() {
    let (tmp, dir) = tiny();
    let missing = tmp.path().join("libnope.so");
    let out = generate(&dir, &["--kernel-lib", missing.to_str().unwrap()]);
    assert_refused(&out, &[missing.to_str().unwrap(), "no such file"]);
    // Through the environment variable too.
    let out = Command::new(BIN)
        .args(["generate", "--model", dir.to_str().unwrap(), "--prompt", "hi", "--max-tokens", "2"])
        .env("TESSERA_KERNEL_LIB", &missing)
        .output()
        .unwrap();
    assert_refused(&out, &[missing.to_str().unwrap()]);
}

#[test]
fn absurd_thread_count() {
    let (_tmp, dir) = tiny();
    let out = generate(&dir, &["--threads", "100000"]);
    assert_refused(&out, &["tk_device_create", "100000"]);
}

#[test]
fn out_of_vocab_prompt_id() {
    let (_tmp, dir) = tiny();
    let d = dir.to_str().unwrap();
    let out = run(&["generate", "--model", d, "--prompt-ids", "1,5000,2", "--max-tokens", "2"]);
    assert_refused(&out, &["5000", "outside the vocabulary"]);
    let out = run(&["generate", "--model", d, "--prompt-ids", "1024", "--max-tokens", "2"]);
    assert_refused(&out, &["1024", "outside the vocabulary"]);
    // Not a number at all: clap refuses.
    let out = run(&["generate", "--model", d, "--prompt-ids", "1,x", "--max-tokens", "2"]);
    assert_refused(&out, &["--prompt-ids"]);
    let out = run(&["generate", "--model", d, "--prompt-ids", "-3", "--max-tokens", "2"]);
    assert_refused(&out, &[]);
}

#[test]
fn zero_max_tokens() {
    let (_tmp, dir) = tiny();
    let out = generate(&dir, &["--max-tokens", "0"]);
    assert_refused(&out, &["max_tokens"]);
}

#[test]
fn bad_sampling_and_cache_options() {
    let (_tmp, dir) = tiny();
    assert_refused(&generate(&dir, &["--block-size", "0"]), &["block"]);
    assert_refused(&generate(&dir, &["--temperature=-1"]), &["temperature"]);
    assert_refused(&generate(&dir, &["--top-p", "1.5"]), &["top_p"]);
    assert_refused(&generate(&dir, &["--kv-dtype", "int8"]), &["int8"]);
    assert_refused(&generate(&dir, &["--block-size", "2305843009213693952"]), &["block size"]);
    let d = dir.to_str().unwrap();
    for (args, phrase) in [
        (vec!["--steps", "0"], "at least 1"),
        (vec!["--batch", "0"], "batch size 0"),
        (vec!["--prompt-len", "100000"], "model's context is"),
    ] {
        let mut all = vec!["bench", "engine", "--model", d];
        all.extend(args);
        assert_refused(&run(&all), &[phrase]);
    }
    // More tokens than the model's context is clamped to the context, not refused.
    let out = generate(&dir, &["--max-tokens", "100000000", "--block-size", "4096"]);
    assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"));
    let out = generate(&dir, &["--max-tokens", "18446744073709551615", "--stop-token-ids", "1"]);
    assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"));
}

#[test]
fn empty_prompt() {
    let (_tmp, dir) = tiny();
    let out = run(&["generate", "--model", dir.to_str().unwrap(), "--prompt", "", "--max-tokens", "2"]);
    // An empty prompt may become just BOS; it must either work or be refused cleanly.
    if !out.status.success() {
        assert_refused(&out, &["prompt"]);
    }
}

#[test]
fn make_tiny_bad_arguments() {
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("m");
    let o = out_dir.to_str().unwrap();
    assert_refused(&run(&["model", "make-tiny", "--out", o, "--shards", "0"]), &["shards"]);
    assert_refused(&run(&["model", "make-tiny", "--out", o, "--shards", "100000"]), &["shards"]);
    assert_refused(&run(&["model", "make-tiny", "--out", o, "--arch", "gpt2"]), &["gpt2"]);
    // Output path under a regular file.
    let file = tmp.path().join("file");
    std::fs::write(&file, "x").unwrap();
    let under = file.join("m");
    assert_refused(&run(&["model", "make-tiny", "--out", under.to_str().unwrap()]), &["file"]);
}

/// BUG (backends/src/error.rs): `BackendError::Io` prints its `source` in its own
/// message AND exposes it as the error source, so the CLI's `{e:#}` repeats the OS
/// error: "cannot read DIR: No such file or directory (os error 2): No such file or
/// directory (os error 2)".
#[test]
fn io_error_message_is_not_repeated() {
    let tmp = tempfile::tempdir().unwrap();
    let out = generate(&tmp.path().join("nope"), &[]);
    let stderr = assert_refused(&out, &["No such file or directory"]);
    assert_eq!(stderr.matches("No such file or directory").count(), 1, "{stderr}");
}
