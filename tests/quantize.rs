//! Load-time quantization (`--quantize q8_0|q4_0`, a chip's `quantize` key): the weights
//! go to the device in ggml block formats, the step reads a fraction of the bytes, the
//! logits stay close to the float model's, and the KV compatibility hash tells the two
//! apart.

use std::process::Command;

use tessera_backends::dtype::{DType, Quantize};
use tessera_backends::model::{LoadOptions, LogitsWanted, Model};
use tessera_backends::synth::SynthArch;

use crate::common::{SeqKv, TempCkpt, device, kv_cache, max_abs, max_abs_diff, run_chunk, tokens};

fn load(ckpt: &TempCkpt, quantize: Option<Quantize>) -> Model {
    Model::load_with(ckpt.path(), device(), LoadOptions { dtype: None, quantize })
        .unwrap_or_else(|e| panic!("loading {}: {e}", ckpt.path().display()))
}

/// Logits of every position of one prompt.
fn logits(model: &mut Model, prompt: &[u32]) -> Vec<f32> {
    let mut kv = kv_cache(model, 16, 64, DType::F32);
    let mut seq = SeqKv::default();
    run_chunk(model, &mut kv, &mut seq, prompt, LogitsWanted::All)
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum();
    let norm = |v: &[f32]| v.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

#[test]
fn quantized_weights_read_fewer_bytes_and_keep_the_logits_close() {
    let ckpt = TempCkpt::tiny("quantize", SynthArch::Llama, 3, None, 1);
    let mut float = load(&ckpt, None);
    let vocab = float.config().vocab_size;
    let prompt = tokens(40, 11, vocab);
    let want = logits(&mut float, &prompt);
    let scale = max_abs(&want);
    assert_eq!(float.weight_format(), "float");
    // A random-weight model is harder on 4 bits than a trained one (no outliers to
    // spare, errors compound through every layer); measured: q8_0 0.018 and 0.99982, q4_0
    // 0.26 and 0.971.
    let cases = [(Quantize::Q8_0, "q8_0", 0.30, 0.03, 0.9995), (Quantize::Q4_0, "q4_0+q8_0", 0.30, 0.5, 0.95)];
    for (q, format, shrink, tol, min_cos) in cases {
        let mut model = load(&ckpt, Some(q));
        assert_eq!(model.weight_format(), format);
        // f32 weights: Q8_0 is 34 bytes per 32 values (27%), Q4_0 18 (14%); the norms
        // stay f32, and under q4_0 the embedding / LM head are q8_0.
        let ratio = model.decode_read_bytes() as f64 / float.decode_read_bytes() as f64;
        assert!(ratio < shrink, "{q}: reads {ratio:.3} of the float model's bytes");
        assert_ne!(model.compat_info().hash(), float.compat_info().hash(), "{q}: the compat hash covers the format");
        let got = logits(&mut model, &prompt);
        let err = max_abs_diff(&got, &want) / scale;
        let cos = cosine(&got, &want);
        eprintln!("{q}: max error {err:.4} of the logits' scale, cosine {cos:.5}");
        assert!(err < tol, "{q}: logits differ by {err:.4} of their scale (tolerance {tol})");
        assert!(cos > min_cos, "{q}: cosine similarity {cos:.5} to the float logits (at least {min_cos})");
        // The same weights again give the same logits, byte for byte.
        let again = logits(&mut load(&ckpt, Some(q)), &prompt);
        assert_eq!(got, again, "{q}: deterministic");
    }
}

#[test]
fn generate_quantizes_on_request_and_refuses_unknown_formats() {
    let ckpt = TempCkpt::tiny("quantize-cli", SynthArch::Llama, 5, None, 1);
    let run = |extra: &[&str]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tessera"));
        cmd.args(["generate", "--model"]).arg(ckpt.path());
        cmd.args(["--prompt-ids", "1,2,3,4,5", "--max-tokens", "6", "--threads", "2"]).args(extra);
        let out = cmd.output().expect("run tessera");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, q8, err) = run(&["--quantize", "q8_0"]);
    assert!(ok, "{err}");
    let (ok, again, err) = run(&["--quantize", "q8_0"]);
    assert!(ok, "{err}");
    assert_eq!(q8, again, "greedy output of a quantized model is deterministic");
    let (ok, _, err) = run(&["--quantize", "q4_0"]);
    assert!(ok, "{err}");
    let (ok, _, err) = run(&["--quantize", "q3_k"]);
    assert!(!ok);
    assert!(err.contains("q3_k") && err.contains("q8_0") && err.contains("q4_0"), "{err}");
}
