//! The executor, paged KV cache and local engine (the chip's batcher and KV pool over
//! the model) against a plain reference forward pass (`common::reference`) on tiny
//! synthetic Llama and Qwen2 checkpoints.

use crate::common::reference::{Reference, argmax};
use crate::common::{
    Kv, SeqKv, TempCkpt, assert_close, kv_cache, kv_cache_in, load, max_abs, max_abs_diff, run_chunk, tokens,
};
use tessera_actors::msg::Finish;
use tessera_backends::dtype::DType;
use tessera_backends::kv::KvCacheConfig;
use tessera_backends::model::{LogitsWanted, Model, SeqChunk};
use tessera_backends::sampling::SamplingParams;
use tessera_backends::synth::SynthArch;
use tessera_chip_executor::local::{Completion, EngineConfig, LocalEngine};

/// Max abs logits difference allowed between the f32 executor and the f64 reference
/// (logits have std ≈ 4, so this is ~1e-5 relative).
const TOL: f32 = 1e-4;

const ARCHS: [SynthArch; 2] = [SynthArch::Llama, SynthArch::Qwen2];

/// Rows of `all` (flat `[n][vocab]`) from `from` to `to`.
fn rows(all: &[f32], vocab: usize, from: usize, to: usize) -> &[f32] {
    &all[from * vocab..to * vocab]
}

// ---------------------------------------------------------------------------------------
// 1. The paged, batched forward equals the reference.

#[test]
fn one_prefill_matches_reference_for_every_block_size() {
    for arch in ARCHS {
        let ck = TempCkpt::tiny("prefill", arch, 11, None, 1);
        let reference = Reference::load(ck.path());
        let mut model = load(ck.path(), None);
        let vocab = model.config().vocab_size;
        let prompt = tokens(40, 1, vocab);
        let want = reference.logits(&prompt);
        for bs in [1, 4, 16] {
            let mut kv = kv_cache(&model, bs, 128 / bs + 4, DType::F32);
            let mut seq = SeqKv::default();
            let got = run_chunk(&mut model, &mut kv, &mut seq, &prompt, LogitsWanted::All);
            assert_close(&format!("{arch} block {bs} prefill"), &got, &want, vocab, TOL);
            // `Last` is the last of those rows.
            let mut seq2 = SeqKv::default();
            let last = run_chunk(&mut model, &mut kv, &mut seq2, &prompt, LogitsWanted::Last);
            assert_close(&format!("{arch} block {bs} last"), &last, rows(&want, vocab, 39, 40), vocab, TOL);
            kv.release(&mut seq);
            kv.release(&mut seq2);
            assert_eq!(kv.used_blocks(), 0);
        }
    }
}

#[test]
fn a_batch_of_sequences_matches_each_reference() {
    use LogitsWanted::{All, Last};
    const NONE: LogitsWanted = LogitsWanted::None;
    // Lengths, and which rows each sequence asks for (a mix, to check row order). With at
    // most one row per sequence the last layer runs past its K and V on those rows
    // alone; with none it stops there.
    let lens = [1usize, 9, 40, 23, 16];
    for (arch, wants) in ARCHS.into_iter().flat_map(|arch| {
        [[All, Last, All, NONE, All], [All, Last, Last, NONE, Last], [NONE; 5]].map(|wants| (arch, wants))
    }) {
        let ck = TempCkpt::tiny("batch", arch, 12, None, 1);
        let reference = Reference::load(ck.path());
        let mut model = load(ck.path(), None);
        let vocab = model.config().vocab_size;
        let prompts: Vec<Vec<u32>> = lens.iter().enumerate().map(|(i, &n)| tokens(n, 100 + i as u64, vocab)).collect();
        for bs in [1, 4, 16] {
            let mut kv = kv_cache(&model, bs, 2 * 100 / bs + 8, DType::F32);
            // Reserve round-robin, one block's worth per sequence at a time, so the
            // block tables interleave instead of being contiguous ranges.
            let mut seqs = (0..lens.len()).map(|_| SeqKv::default()).collect::<Vec<_>>();
            let mut slots: Vec<Vec<i32>> = vec![Vec::new(); lens.len()];
            for r in 0..40usize.div_ceil(bs) {
                for (i, p) in prompts.iter().enumerate() {
                    let (a, b) = ((r * bs).min(p.len()), ((r + 1) * bs).min(p.len()));
                    if a < b {
                        slots[i].extend(kv.append(&mut seqs[i], &p[a..b]));
                    }
                }
            }
            if bs < 40 {
                let t = seqs[2].block_table();
                assert!(t.windows(2).any(|w| w[1] != w[0] + 1), "block table {t:?} is contiguous");
            }
            let chunks: Vec<SeqChunk<'_>> = (0..lens.len())
                .map(|i| SeqChunk {
                    tokens: &prompts[i],
                    start_pos: 0,
                    block_table: seqs[i].block_table(),
                    slots: &slots[i],
                    logits: wants[i],
                })
                .collect();
            let got = model.forward(&kv, &chunks).unwrap();
            let mut row = 0;
            for (i, p) in prompts.iter().enumerate() {
                let all = reference.logits(p);
                let want = match wants[i] {
                    LogitsWanted::All => &all[..],
                    LogitsWanted::Last => rows(&all, vocab, p.len() - 1, p.len()),
                    LogitsWanted::None => &[],
                };
                let n = want.len() / vocab;
                assert!(got.len() >= (row + n) * vocab, "too few logits rows: {}", got.len() / vocab);
                assert_close(&format!("{arch} block {bs} seq {i}"), rows(&got, vocab, row, row + n), want, vocab, TOL);
                row += n;
            }
            assert_eq!(got.len(), row * vocab, "extra logits rows");
            for s in &mut seqs {
                kv.release(s);
            }
            assert_eq!(kv.used_blocks(), 0);
        }
    }
}

#[test]
fn llama3_and_linear_rope_scaling_match_reference() {
    // The tiny preset has no rope scaling; patch config.json so the scaled paths run.
    // original_max_position 64 with head_dim 32 and theta 1e4 puts rotary pairs in all
    // three Llama-3 bands (wavelength < 16 kept, > 64 divided by factor, between smoothed).
    let ck = TempCkpt::tiny("rope", SynthArch::Llama, 13, None, 1);
    let cfg_path = ck.path().join("config.json");
    let original = std::fs::read_to_string(&cfg_path).unwrap();
    let scalings = [
        serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        serde_json::json!({"type": "linear", "factor": 4.0}),
    ];
    for scaling in scalings {
        let mut cfg: serde_json::Value = serde_json::from_str(&original).unwrap();
        cfg["rope_scaling"] = scaling.clone();
        std::fs::write(&cfg_path, cfg.to_string()).unwrap();
        let reference = Reference::load(ck.path());
        let mut model = load(ck.path(), None);
        let vocab = model.config().vocab_size;
        let prompt = tokens(40, 3, vocab);
        let mut kv = kv_cache(&model, 4, 16, DType::F32);
        let mut seq = SeqKv::default();
        let got = run_chunk(&mut model, &mut kv, &mut seq, &prompt, LogitsWanted::All);
        assert_close(&format!("rope_scaling {scaling}"), &got, &reference.logits(&prompt), vocab, TOL);
    }
    // The three llama3 bands are really exercised.
    use tessera_backends::config::RopeKind;
    let base = crate::common::reference::inv_freq(32, 10_000.0, RopeKind::None);
    let scaled = crate::common::reference::inv_freq(
        32,
        10_000.0,
        RopeKind::Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 64 },
    );
    let kept = base.iter().zip(&scaled).filter(|(b, s)| b == s).count();
    let divided = base.iter().zip(&scaled).filter(|(b, s)| (*b / 8.0 - *s).abs() < 1e-15).count();
    assert!(kept > 0 && divided > 0 && kept + divided < base.len(), "kept {kept}, divided {divided}");
}

// ---------------------------------------------------------------------------------------
// 2. Chunked prefill and decode steps equal the whole prefill and the reference.

#[test]
fn chunked_prefill_and_decode_match_whole_prefill_and_reference() {
    for arch in ARCHS {
        let ck = TempCkpt::tiny("chunked", arch, 21, None, 1);
        let reference = Reference::load(ck.path());
        let mut model = load(ck.path(), None);
        let vocab = model.config().vocab_size;
        let full = tokens(46, 7, vocab);
        let (prompt, extra) = full.split_at(40);
        let want = reference.logits(&full);
        let other = tokens(13, 8, vocab);
        let other_want = reference.logits(&other);
        for bs in [4, 16] {
            let mut kv = kv_cache(&model, bs, 200 / bs + 8, DType::F32);
            let mut whole_seq = SeqKv::default();
            let whole = run_chunk(&mut model, &mut kv, &mut whole_seq, prompt, LogitsWanted::All);
            assert_close(&format!("{arch} bs {bs} whole"), &whole, rows(&want, vocab, 0, 40), vocab, TOL);

            let mut seq = SeqKv::default();
            let mut at = 0;
            for n in [7, 16, 17] {
                let got = run_chunk(&mut model, &mut kv, &mut seq, &prompt[at..at + n], LogitsWanted::All);
                let what = format!("{arch} bs {bs} chunk {at}..{}", at + n);
                assert_close(&what, &got, rows(&whole, vocab, at, at + n), vocab, TOL);
                at += n;
            }
            assert_eq!(seq.len(), 40);

            // Single-token decode steps (the paged decode-attention path).
            for (j, &t) in extra[..3].iter().enumerate() {
                let pos = 40 + j;
                let got = run_chunk(&mut model, &mut kv, &mut seq, &[t], LogitsWanted::Last);
                assert_close(
                    &format!("{arch} bs {bs} decode {pos}"),
                    &got,
                    rows(&want, vocab, pos, pos + 1),
                    vocab,
                    TOL,
                );
            }

            // A batch of decode steps over sequences of different lengths.
            let mut seq2 = SeqKv::default();
            run_chunk(&mut model, &mut kv, &mut seq2, &other[..10], LogitsWanted::None);
            for j in 0..2 {
                let (pa, pb) = (43 + j, 10 + j);
                let sa = kv.append(&mut seq, &full[pa..pa + 1]);
                let sb = kv.append(&mut seq2, &other[pb..pb + 1]);
                let chunks = [
                    SeqChunk {
                        tokens: &full[pa..pa + 1],
                        start_pos: pa,
                        block_table: seq.block_table(),
                        slots: &sa,
                        logits: LogitsWanted::Last,
                    },
                    SeqChunk {
                        tokens: &other[pb..pb + 1],
                        start_pos: pb,
                        block_table: seq2.block_table(),
                        slots: &sb,
                        logits: LogitsWanted::Last,
                    },
                ];
                let got = model.forward(&kv, &chunks).unwrap();
                assert_close(
                    &format!("{arch} bs {bs} batched decode a {pa}"),
                    rows(&got, vocab, 0, 1),
                    rows(&want, vocab, pa, pa + 1),
                    vocab,
                    TOL,
                );
                assert_close(
                    &format!("{arch} bs {bs} batched decode b {pb}"),
                    rows(&got, vocab, 1, 2),
                    rows(&other_want, vocab, pb, pb + 1),
                    vocab,
                    TOL,
                );
            }

            // A mixed step: one decode token and a prefill chunk in the same forward.
            let sa = kv.append(&mut seq, &full[45..46]);
            let sb = kv.append(&mut seq2, &other[12..13]);
            let mut whole2 = SeqKv::default();
            let sc = kv.append(&mut whole2, &other[..5]);
            let chunks = [
                SeqChunk {
                    tokens: &full[45..46],
                    start_pos: 45,
                    block_table: seq.block_table(),
                    slots: &sa,
                    logits: LogitsWanted::Last,
                },
                SeqChunk {
                    tokens: &other[..5],
                    start_pos: 0,
                    block_table: whole2.block_table(),
                    slots: &sc,
                    logits: LogitsWanted::All,
                },
                SeqChunk {
                    tokens: &other[12..13],
                    start_pos: 12,
                    block_table: seq2.block_table(),
                    slots: &sb,
                    logits: LogitsWanted::Last,
                },
            ];
            let got = model.forward(&kv, &chunks).unwrap();
            assert_close(
                &format!("{arch} bs {bs} mixed decode"),
                rows(&got, vocab, 0, 1),
                rows(&want, vocab, 45, 46),
                vocab,
                TOL,
            );
            assert_close(
                &format!("{arch} bs {bs} mixed prefill"),
                rows(&got, vocab, 1, 6),
                rows(&other_want, vocab, 0, 5),
                vocab,
                TOL,
            );
            assert_close(
                &format!("{arch} bs {bs} mixed decode 2"),
                rows(&got, vocab, 6, 7),
                rows(&other_want, vocab, 12, 13),
                vocab,
                TOL,
            );

            for s in [&mut seq, &mut seq2, &mut whole_seq, &mut whole2] {
                kv.release(s);
            }
            assert_eq!(kv.used_blocks(), 0);
        }
    }
}

// ---------------------------------------------------------------------------------------
// 3. Greedy generation alone equals generation in a mixed batch, with and without
//    preemption; and matches the reference.

fn engine(dir: &std::path::Path, block_size: usize, num_blocks: usize, max_batch_tokens: usize) -> LocalEngine {
    let model = load(dir, None);
    let kv = KvCacheConfig { block_size, num_blocks, dtype: DType::F32 };
    LocalEngine::new(model, kv, EngineConfig { max_batch_tokens, keep_logits: true, ..Default::default() }).unwrap()
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) }
}

/// Decode batches of up to 40 sequences run through every linear kernel regime (GEMV
/// passes up to 16 rows, the decode-batch kernel beyond, gemm for prefill chunks); the
/// summation orders differ, so logits agree to rounding, and greedy tokens must agree
/// exactly (DESIGN §9.5).
#[test]
fn greedy_tokens_are_batch_invariant_across_kernel_regimes() {
    for arch in [SynthArch::Llama, SynthArch::Qwen2] {
        let ck = TempCkpt::tiny("invariance", arch, 7, None, 1);
        let vocab = load(ck.path(), None).config().vocab_size;
        let n = 40;
        let prompts: Vec<Vec<u32>> = (0..n).map(|i| tokens(5 + (i * 7) % 40, 1000 + i as u64, vocab)).collect();
        let mut all = engine(ck.path(), 16, 512, 2048);
        // Staggered lengths: the batch shrinks through every regime as requests finish.
        let max_tokens = |i: usize| 4 + (i % 8) * 4;
        for (i, p) in prompts.iter().enumerate() {
            all.add_request(i as u64, p, greedy(max_tokens(i))).unwrap();
        }
        let together = by_id(all.run_to_completion().unwrap());
        for (i, p) in prompts.iter().enumerate() {
            let mut solo = engine(ck.path(), 16, 64, 2048);
            solo.add_request(0, p, greedy(max_tokens(i))).unwrap();
            let alone = solo.run_to_completion().unwrap().remove(0);
            assert_eq!(alone.tokens, together[i].tokens, "{arch:?} request {i}: alone vs in a batch of {n}");
        }
    }
}

/// Completions sorted by request id.
fn by_id(mut done: Vec<Completion>) -> Vec<Completion> {
    done.sort_by_key(|c| c.id);
    done
}

/// Checks teacher-forced that every generated token is the reference's argmax (or
/// within `TOL` of it: a near-tie may legitimately go either way), and that the logits
/// rows the engine kept are the reference's rows.
fn assert_reference_greedy(reference: &Reference, prompt: &[u32], done: &Completion, what: &str) {
    let vocab = reference.cfg.vocab_size;
    let generated = &done.tokens;
    let seq: Vec<u32> = prompt.iter().chain(generated).copied().collect();
    let logits = reference.logits(&seq[..seq.len() - 1]);
    let want = rows(&logits, vocab, prompt.len() - 1, seq.len() - 1);
    assert_close(&format!("{what}: kept logits"), &done.logits, want, vocab, TOL);
    for (j, &t) in generated.iter().enumerate() {
        let row = rows(&logits, vocab, prompt.len() - 1 + j, prompt.len() + j);
        let best = argmax(row);
        assert!(
            t == best || row[best as usize] - row[t as usize] <= TOL,
            "{what}: token {j} is {t} (logit {}), reference argmax {best} (logit {})",
            row[t as usize],
            row[best as usize]
        );
    }
}

#[test]
fn greedy_alone_equals_greedy_in_a_mixed_batch_and_under_preemption() {
    let ck = TempCkpt::tiny("engine", SynthArch::Qwen2, 31, None, 1);
    let reference = Reference::load(ck.path());
    let vocab = reference.cfg.vocab_size;
    let lens = [5usize, 40, 12, 33, 1, 27, 60, 9];
    let max_tokens = [8usize, 12, 5, 16, 10, 3, 7, 14];
    let probe = 3;
    let prompts: Vec<Vec<u32>> = lens.iter().enumerate().map(|(i, &n)| tokens(n, 300 + i as u64, vocab)).collect();

    // The probe alone, one prefill (large token budget).
    let mut solo = engine(ck.path(), 4, 256, 2048);
    solo.add_request(probe as u64, &prompts[probe], greedy(max_tokens[probe])).unwrap();
    let alone = solo.run_to_completion().unwrap();
    assert_eq!(alone.len(), 1);
    let alone = &alone[0];
    assert_eq!((alone.tokens.len(), alone.finish), (max_tokens[probe], Finish::Length));
    assert_eq!(solo.pool().used(), 0);
    assert_reference_greedy(&reference, &prompts[probe], alone, "probe alone");

    // All 8 together, with a 32-token step budget (so long prompts are chunked).
    let mut batch = engine(ck.path(), 4, 256, 32);
    for (i, p) in prompts.iter().enumerate() {
        batch.add_request(i as u64, p, greedy(max_tokens[i])).unwrap();
    }
    let together = by_id(batch.run_to_completion().unwrap());
    assert_eq!(batch.pool().used(), 0);
    assert_eq!(together.len(), 8);
    assert_eq!(together[probe].tokens, alone.tokens, "probe in a batch of 8 differs from its solo run");
    for (i, c) in together.iter().enumerate() {
        assert_eq!((c.id, c.prompt_tokens, c.tokens.len()), (i as u64, lens[i], max_tokens[i]));
        assert_reference_greedy(&reference, &prompts[i], c, &format!("request {i} in batch"));
    }

    // Again with only 20 blocks of 4 (80 tokens for ~270 of demand): sequences get
    // preempted and recomputed. Count the tokens the steps carried to prove it.
    let mut scarce = engine(ck.path(), 4, 20, 32);
    for (i, p) in prompts.iter().enumerate() {
        scarce.add_request(i as u64, p, greedy(max_tokens[i])).unwrap();
    }
    let mut carried = 0;
    let mut steps = 0;
    while scarce.has_work() {
        let report = scarce.step().unwrap();
        assert!(report.seqs > 0, "a step scheduled nothing");
        assert!(report.tokens <= 32);
        carried += report.tokens;
        steps += 1;
        assert!(steps < 10_000);
    }
    let preempted = by_id(scarce.take_finished());
    assert_eq!(scarce.pool().used(), 0);
    // Without preemption each request's tokens are fed once (its last sample never is).
    let once: usize = (0..8).map(|i| lens[i] + max_tokens[i] - 1).sum();
    assert!(carried > once, "no preemption happened ({carried} tokens carried, {once} without recompute)");
    assert_eq!(preempted.len(), 8);
    for i in 0..8 {
        assert_eq!(preempted[i].tokens, together[i].tokens, "request {i} differs under preemption");
        // Recomputed sequences sample from the same logits (a prefill row, not a decode row).
        let what = format!("request {i} logits under preemption");
        assert_close(&what, &preempted[i].logits, &together[i].logits, vocab, TOL);
    }
}

// ---------------------------------------------------------------------------------------
// 4. Seeded sampling is reproducible; other seeds give other tokens.

fn sampled(seed: u64, max_tokens: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.8,
        top_k: 50,
        top_p: 0.9,
        seed: Some(seed),
        max_tokens,
        stop_token_ids: vec![],
        ignore_eos: true,
        penalties: Default::default(),
    }
}

#[test]
fn seeded_sampling_is_deterministic() {
    let ck = TempCkpt::tiny("seed", SynthArch::Llama, 41, None, 1);
    let vocab = 1024;
    let prompt = tokens(20, 5, vocab);
    let run = |seed: u64, with_others: bool| -> Vec<u32> {
        let mut e = engine(ck.path(), 16, 64, 32);
        e.add_request(0, &prompt, sampled(seed, 24)).unwrap();
        if with_others {
            for i in 1..4u64 {
                e.add_request(i, &tokens(10 + 9 * i as usize, i, vocab), sampled(1000 + i, 6 + i as usize)).unwrap();
            }
        }
        let done = by_id(e.run_to_completion().unwrap());
        assert_eq!(e.pool().used(), 0);
        assert_eq!(done[0].tokens.len(), 24);
        done[0].tokens.clone()
    };
    let a = run(42, false);
    assert_eq!(a, run(42, false), "same seed, different tokens");
    assert_eq!(a, run(42, true), "same seed in a batch, different tokens");
    assert_ne!(a, run(43, false), "seeds 42 and 43 sampled the same 24 tokens");
    // Sampling really samples: it is not the greedy continuation.
    let mut e = engine(ck.path(), 16, 64, 32);
    e.add_request(0, &prompt, greedy(24)).unwrap();
    assert_ne!(a, e.run_to_completion().unwrap()[0].tokens, "sampling at temperature 0.8 equals greedy");
}

// ---------------------------------------------------------------------------------------
// 5. Weight and KV dtypes, sharded checkpoints.

/// Logits of one whole prefill of `prompt` with a KV cache of `kv_dtype`.
fn prefill_logits(model: &mut Model, prompt: &[u32], kv_dtype: DType) -> Vec<f32> {
    let mut kv: Kv = kv_cache(model, 16, 8, kv_dtype);
    let mut seq = SeqKv::default();
    run_chunk(model, &mut kv, &mut seq, prompt, LogitsWanted::All)
}

#[test]
fn weight_and_kv_dtypes_stay_close_to_reference() {
    for arch in ARCHS {
        let ck = TempCkpt::tiny("dtype", arch, 51, None, 1);
        let reference = Reference::load(ck.path());
        let vocab = reference.cfg.vocab_size;
        let prompt = tokens(40, 9, vocab);
        let want = reference.logits(&prompt);
        let scale = max_abs(&want);

        // f32 weights converted at load. Against a reference with the same rounded weights
        // the executor is as exact as in f32; against the f32 reference the error is the
        // rounding's: f16 (11-bit mantissa) within 0.5%, bf16 (8-bit) within 3% of max |logit|
        // (measured: ~0.13% and ~1.1%).
        for (dtype, rel) in [(DType::F16, 0.005), (DType::Bf16, 0.03)] {
            let mut model = load(ck.path(), Some(dtype));
            assert_eq!(model.dtype(), dtype);
            let got = prefill_logits(&mut model, &prompt, DType::F32);
            let rounded = Reference::load_rounded(ck.path(), dtype).logits(&prompt);
            assert_close(&format!("{arch} {dtype} vs rounded reference"), &got, &rounded, vocab, 2.0 * TOL);
            let d = max_abs_diff(&got, &want);
            eprintln!("{arch} {dtype} weights: max diff {d} (scale {scale})");
            assert!(d <= rel * scale, "{arch} {dtype} weights: max diff {d} > {rel} x {scale}");
        }

        // KV cache in f16 and bf16 against f32 KV: within 0.2% and 1% of max |logit|
        // (measured: ~0.04% and ~0.3%).
        let mut model = load(ck.path(), None);
        for (dtype, rel) in [(DType::F16, 0.002), (DType::Bf16, 0.01)] {
            let got = prefill_logits(&mut model, &prompt, dtype);
            let d = max_abs_diff(&got, &want);
            eprintln!("{arch} {dtype} kv: max diff {d} (scale {scale})");
            assert!(d <= rel * scale, "{arch} kv {dtype}: max diff {d} > {rel} x {scale}");
            assert!(d > 0.0, "{arch} kv {dtype}: identical to f32, was the dtype ignored?");
        }
    }
}

#[test]
fn f16_checkpoint_loads_as_stored_and_shards_are_bit_identical() {
    for arch in ARCHS {
        let one = TempCkpt::tiny("f16-one", arch, 61, Some(DType::F16), 1);
        let three = TempCkpt::tiny("f16-three", arch, 61, Some(DType::F16), 3);
        assert!(three.path().join("model.safetensors.index.json").is_file());
        let reference = Reference::load(one.path());
        let vocab = reference.cfg.vocab_size;
        let prompt = tokens(33, 10, vocab);
        let mut m1 = load(one.path(), None);
        assert_eq!(m1.dtype(), DType::F16);
        let a = prefill_logits(&mut m1, &prompt, DType::F32);
        // The reference reads the same f16 values, so only arithmetic differs.
        assert_close(&format!("{arch} f16 checkpoint"), &a, &reference.logits(&prompt), vocab, 2.0 * TOL);
        let mut m3 = load(three.path(), None);
        assert_eq!(m3.dtype(), DType::F16);
        let b = prefill_logits(&mut m3, &prompt, DType::F32);
        assert!(a == b, "{arch} f16: sharded logits differ from unsharded (max {})", max_abs_diff(&a, &b));

        // f32, sharded vs not.
        let one = TempCkpt::tiny("f32-one", arch, 62, None, 1);
        let three = TempCkpt::tiny("f32-three", arch, 62, None, 3);
        let a = prefill_logits(&mut load(one.path(), None), &prompt, DType::F32);
        let b = prefill_logits(&mut load(three.path(), None), &prompt, DType::F32);
        assert!(a == b, "{arch} f32: sharded logits differ from unsharded (max {})", max_abs_diff(&a, &b));
    }
}

// ---------------------------------------------------------------------------------------
// 6. Refused requests name the problem and change nothing.

#[test]
fn bad_requests_are_refused_and_change_nothing() {
    let ck = TempCkpt::tiny("errors", SynthArch::Llama, 71, None, 1);
    // 8 blocks of 4: at most 32 tokens of prompt + output.
    let mut e = engine(ck.path(), 4, 8, 64);
    let (vocab, ctx) = (e.config().vocab_size, e.config().max_context);
    assert_eq!((vocab, ctx), (1024, 2048));
    let ok_prompt = tokens(10, 11, vocab);
    let long_prompt = tokens(ctx, 12, vocab);
    let oov = format!("token id {vocab} is outside the vocabulary");
    let cases: Vec<(&str, Vec<u32>, SamplingParams, &str)> = vec![
        ("empty prompt", vec![], greedy(4), "prompt is empty"),
        ("out-of-vocab token", vec![1, 2, vocab as u32, 3], greedy(4), &oov),
        ("prompt as long as the context", long_prompt, greedy(4), "context is 2048"),
        (
            "output that never fits the KV cache",
            ok_prompt.clone(),
            greedy(100),
            "need 28 KV blocks but the cache holds 8",
        ),
        ("negative temperature", ok_prompt.clone(), SamplingParams { temperature: -1.0, ..greedy(4) }, "temperature"),
        ("top_p of 0", ok_prompt.clone(), SamplingParams { top_p: 0.0, ..greedy(4) }, "top_p"),
        ("max_tokens of 0", ok_prompt.clone(), greedy(0), "max_tokens"),
    ];
    for (what, prompt, params, needle) in &cases {
        let err = e.add_request(1, prompt, params.clone()).expect_err(what).to_string();
        assert!(err.contains(needle), "{what}: error {err:?} does not contain {needle:?}");
        assert!(!e.has_work(), "{what}: a refused request was admitted");
        assert_eq!(e.pool().used(), 0, "{what}");
    }
    // A duplicate id is refused while the first is running.
    e.add_request(1, &ok_prompt, greedy(6)).unwrap();
    let err = e.add_request(1, &ok_prompt, greedy(6)).unwrap_err().to_string();
    assert!(err.contains("request id 1 is already running"), "{err}");
    // The engine still runs a good request, and exactly as a fresh engine does.
    let done = e.run_to_completion().unwrap();
    assert_eq!(done.len(), 1);
    assert_eq!(e.pool().used(), 0);
    let mut fresh = engine(ck.path(), 4, 8, 64);
    fresh.add_request(1, &ok_prompt, greedy(6)).unwrap();
    assert_eq!(done[0].tokens, fresh.run_to_completion().unwrap()[0].tokens);
    assert_eq!(done[0].tokens.len(), 6);
}

// ---------------------------------------------------------------------------------------
// More: random chunkings, stops, context limit, abort, forward refusals.

#[test]
fn random_chunkings_and_block_sizes_match_reference() {
    let ck = TempCkpt::tiny("random-chunks", SynthArch::Qwen2, 81, None, 1);
    let reference = Reference::load(ck.path());
    let mut model = load(ck.path(), None);
    let vocab = model.config().vocab_size;
    for case in 0..6u64 {
        let r = tokens(8, 900 + case, 1 << 20);
        let bs = [1, 2, 3, 5, 8, 16][r[0] as usize % 6];
        let len = 20 + r[1] as usize % 30;
        let prompt = tokens(len, 1000 + case, vocab);
        let want = reference.logits(&prompt);
        let mut kv = kv_cache(&model, bs, 64 / bs + 2, DType::F32);
        let mut seq = SeqKv::default();
        let mut at = 0;
        let mut k = 2;
        let mut chunks = vec![];
        while at < len {
            let n = (1 + r[k % 8] as usize % 13).min(len - at);
            k += 1;
            let got = run_chunk(&mut model, &mut kv, &mut seq, &prompt[at..at + n], LogitsWanted::All);
            let what = format!("case {case}: block {bs}, chunk {at}..{} of {len}", at + n);
            assert_close(&what, &got, rows(&want, vocab, at, at + n), vocab, TOL);
            chunks.push(n);
            at += n;
        }
        assert_eq!(seq.block_table().len(), len.div_ceil(bs), "chunks {chunks:?}");
        kv.release(&mut seq);
        assert_eq!(kv.used_blocks(), 0);
    }
}

#[test]
fn stop_tokens_context_limit_and_abort_finish_cleanly() {
    let ck = TempCkpt::tiny("stops", SynthArch::Llama, 91, None, 1);
    let vocab = 1024;
    let prompt = tokens(12, 13, vocab);
    let mut e = engine(ck.path(), 4, 64, 32);
    e.add_request(0, &prompt, greedy(12)).unwrap();
    let free_run = e.run_to_completion().unwrap().remove(0).tokens;
    assert_eq!(free_run.len(), 12);

    // A stop token ends generation at its first occurrence (included), as Stop.
    let stop = free_run[4];
    let first = free_run.iter().position(|&t| t == stop).unwrap();
    let params = SamplingParams { stop_token_ids: vec![stop], ..greedy(12) };
    e.add_request(1, &prompt, params).unwrap();
    let done = e.run_to_completion().unwrap().remove(0);
    assert_eq!(done.finish, Finish::Stop);
    assert_eq!(done.tokens, free_run[..=first]);
    assert_eq!(e.pool().used(), 0);

    // Abort frees the blocks of a request mid-generation.
    e.add_request(2, &prompt, greedy(12)).unwrap();
    e.step().unwrap();
    assert!(e.pool().used() > 0);
    assert!(e.abort(2));
    assert!(!e.abort(2));
    assert!(!e.has_work());
    assert_eq!(e.pool().used(), 0);
    assert!(e.take_finished().is_empty());

    // The model's context ends generation as Length: shrink it to 16 in config.json.
    let cfg_path = ck.path().join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["max_position_embeddings"] = 16.into();
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let mut e = engine(ck.path(), 4, 64, 32);
    assert_eq!(e.config().max_context, 16);
    e.add_request(0, &prompt, greedy(12)).unwrap();
    let done = e.run_to_completion().unwrap().remove(0);
    assert_eq!((done.finish, done.tokens.len()), (Finish::Length, 4));
    assert_eq!(done.tokens, free_run[..4]);
    assert_eq!(e.pool().used(), 0);
    let err = e.add_request(1, &tokens(16, 1, vocab), greedy(1)).unwrap_err().to_string();
    assert!(err.contains("the prompt has 16 tokens; the model's context is 16"), "{err}");
}

#[test]
fn forward_refuses_malformed_steps() {
    let ck = TempCkpt::tiny("forward-errors", SynthArch::Llama, 95, None, 1);
    let mut model = load(ck.path(), None);
    let vocab = model.config().vocab_size;
    let mut kv = kv_cache(&model, 4, 8, DType::F32);
    let mut seq = SeqKv::default();
    let toks = tokens(6, 1, vocab);
    let slots = kv.append(&mut seq, &toks);
    let good = SeqChunk {
        tokens: &toks,
        start_pos: 0,
        block_table: seq.block_table(),
        slots: &slots,
        logits: LogitsWanted::Last,
    };
    let bad_tok = [1, vocab as u32, 2, 3, 4, 5];
    let mut foreign_slots = slots.clone();
    foreign_slots[3] = 31;
    let cases: Vec<(Vec<SeqChunk<'_>>, &str)> = vec![
        (vec![], "at least one token"),
        (vec![SeqChunk { tokens: &[], slots: &[], ..good }], "at least one token"),
        (vec![SeqChunk { slots: &slots[..5], ..good }], "6 tokens, 5 slots"),
        (vec![SeqChunk { block_table: &seq.block_table()[..1], ..good }], "1 blocks of 4"),
        (vec![SeqChunk { tokens: &bad_tok, ..good }], "outside the vocabulary"),
        (vec![SeqChunk { slots: &foreign_slots, ..good }], "slot 31 for position 3 is not in its block table"),
    ];
    for (batch, needle) in cases {
        let err = model.forward(&kv, &batch).unwrap_err().to_string();
        assert!(err.contains(needle), "{err:?} does not contain {needle:?}");
    }
    // The good step still runs afterwards.
    assert_eq!(model.forward(&kv, &[good]).unwrap().len(), vocab);
}

// ---------------------------------------------------------------------------------------
// 7. KV layouts, layer-observed steps and the prefill -> decode handoff of KV.

use tessera_backends::compat::{CompatInfo, compat_hash, compat_mismatch};
use tessera_backends::kv_format::{KvLayout, decode_tokens};

#[test]
fn token_major_caches_match_reference_and_head_major_bit_for_bit() {
    let ck = TempCkpt::tiny("layout", SynthArch::Qwen2, 61, None, 1);
    let reference = Reference::load(ck.path());
    let mut model = load(ck.path(), None);
    let vocab = model.config().vocab_size;
    let prompt = tokens(30, 4, vocab);
    let want = reference.logits(&prompt);
    for dtype in [DType::F32, DType::F16, DType::Bf16] {
        for bs in [1, 5, 16] {
            let mut outs = Vec::new();
            for layout in KvLayout::ALL {
                let mut kv = kv_cache_in(&model, bs, 64 / bs + 4, dtype, layout);
                assert_eq!(kv.format().layout, layout);
                let mut seq = SeqKv::default();
                // A chunked prefill then two decode steps: both attention kernels read the layout.
                let mut got = run_chunk(&mut model, &mut kv, &mut seq, &prompt[..20], LogitsWanted::All);
                got.extend(run_chunk(&mut model, &mut kv, &mut seq, &prompt[20..28], LogitsWanted::All));
                for t in 28..30 {
                    got.extend(run_chunk(&mut model, &mut kv, &mut seq, &prompt[t..t + 1], LogitsWanted::Last));
                }
                if dtype == DType::F32 {
                    assert_close(&format!("{layout} block {bs}"), &got, &want, vocab, TOL);
                }
                outs.push(got);
            }
            // Layout moves values, never changes them.
            assert!(outs[0] == outs[1], "{dtype} block {bs}: token-major logits differ from head-major");
        }
    }
}

#[test]
fn forward_observed_sees_each_layer_right_after_its_kv_is_written() {
    let ck = TempCkpt::tiny("observe", SynthArch::Llama, 62, None, 1);
    let mut model = load(ck.path(), None);
    let (vocab, layers) = (model.config().vocab_size, model.config().num_layers);
    assert!(layers >= 2, "the tiny model needs several layers for this test");
    let mut kv = kv_cache_in(&model, 4, 8, DType::F32, KvLayout::TokenMajor);
    let bb = kv.format().block_bytes();
    let prompt = tokens(7, 3, vocab);
    let mut seq = SeqKv::default();
    let slots = kv.append(&mut seq, &prompt);
    let table = seq.block_table().to_vec();
    let chunk =
        SeqChunk { tokens: &prompt, start_pos: 0, block_table: &table, slots: &slots, logits: LogitsWanted::Last };
    let mut seen = Vec::new();
    let kv_ref = &kv;
    let got = model
        .forward_observed(kv_ref, &[chunk], &mut |li, dev| {
            // This layer's KV is in the cache; the next layer's is still all zeros.
            let (mut k, mut v) = (vec![0u8; table.len() * bb], vec![0u8; table.len() * bb]);
            kv_ref.read_blocks(dev, li, &table, &mut k, &mut v)?;
            let written = k.iter().any(|&b| b != 0) && v.iter().any(|&b| b != 0);
            let next_empty = li + 1 == layers || {
                kv_ref.read_blocks(dev, li + 1, &table, &mut k, &mut v)?;
                k.iter().chain(&v).all(|&b| b == 0)
            };
            seen.push((li, written, next_empty));
            Ok(())
        })
        .unwrap();
    assert_eq!(seen, (0..layers).map(|li| (li, true, true)).collect::<Vec<_>>());
    // Same logits as the unobserved step over the same KV.
    let mut kv2 = kv_cache_in(&model, 4, 8, DType::F32, KvLayout::TokenMajor);
    let mut seq2 = SeqKv::default();
    assert!(got == run_chunk(&mut model, &mut kv2, &mut seq2, &prompt, LogitsWanted::Last));

    // An observer error ends the step with that error, after the layer it saw.
    kv.release(&mut seq);
    let slots = kv.append(&mut seq, &prompt);
    let table = seq.block_table().to_vec();
    let chunk =
        SeqChunk { tokens: &prompt, start_pos: 0, block_table: &table, slots: &slots, logits: LogitsWanted::Last };
    let mut calls = 0;
    let err = model
        .forward_observed(&kv, &[chunk], &mut |li, _| {
            calls += 1;
            if li == 0 {
                return Err(tessera_backends::error::BackendError::KvCache("staging region is full".into()));
            }
            Ok(())
        })
        .unwrap_err()
        .to_string();
    assert_eq!((calls, err.as_str()), (1, "KV cache: staging region is full"));
    // The model is still usable.
    assert_eq!(model.forward(&kv, &[chunk]).unwrap().len(), vocab);
}

/// The disaggregated path end to end: prefill chip P stages each layer's blocks from
/// the layer observer; decode chip D (another device, its own copy of the weights,
/// another block size and layout) decodes and installs them, then decodes. Its tokens
/// and logits equal P's own colocated decode (f32 KV on both sides: the transfer is
/// exact).
#[test]
fn prefill_kv_handed_to_a_decode_chip_of_another_format_decodes_identically() {
    let ck = TempCkpt::tiny("handoff", SynthArch::Llama, 63, None, 1);
    let mut p = load(ck.path(), None);
    let mut d = load(ck.path(), None);
    assert_eq!(compat_mismatch(&CompatInfo::of(&p), &CompatInfo::of(&d)), None);
    assert_eq!(CompatInfo::of(&p).hash(), CompatInfo::of(&d).hash());
    assert_eq!(compat_hash(p.config()), compat_hash(d.config()));
    let vocab = p.config().vocab_size;
    let layers = p.config().num_layers;
    let prompt = tokens(21, 8, vocab);

    let mut kv_p = kv_cache_in(&p, 4, 16, DType::F32, KvLayout::HeadMajor);
    let mut kv_d = kv_cache_in(&d, 3, 24, DType::F32, KvLayout::TokenMajor);
    let (fp, bb) = (kv_p.format(), kv_p.format().block_bytes());
    assert_ne!(fp, kv_d.format());

    // P: prefill, staging every layer as soon as it is written.
    let mut seq_p = SeqKv::default();
    let slots = kv_p.append(&mut seq_p, &prompt);
    let table = seq_p.block_table().to_vec();
    let chunk =
        SeqChunk { tokens: &prompt, start_pos: 0, block_table: &table, slots: &slots, logits: LogitsWanted::Last };
    let mut staged: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
    let kv_p_ref = &kv_p;
    let last_p = p
        .forward_observed(kv_p_ref, &[chunk], &mut |li, dev| {
            let (mut k, mut v) = (vec![0u8; table.len() * bb], vec![0u8; table.len() * bb]);
            kv_p_ref.read_blocks(dev, li, &table, &mut k, &mut v)?;
            staged.push((k, v));
            Ok(())
        })
        .unwrap();
    assert_eq!(staged.len(), layers);

    // D: reserve the prompt's slots in its own pool, install every layer.
    let mut seq_d = SeqKv::default();
    let dst_slots = kv_d.append(&mut seq_d, &prompt);
    for (li, (k, v)) in staged.iter().enumerate() {
        let (mut k_rows, mut v_rows) = (Vec::new(), Vec::new());
        decode_tokens(&fp, k, 0, 0..prompt.len(), &mut k_rows).unwrap();
        decode_tokens(&fp, v, 0, 0..prompt.len(), &mut v_rows).unwrap();
        kv_d.write_tokens(d.device(), li, &k_rows, &v_rows, &dst_slots).unwrap();
    }

    // Both decode greedily from the prompt's last logits; D never ran the prompt.
    let first = argmax(&last_p);
    let (mut tok_p, mut tok_d) = (first, first);
    for step in 0..6 {
        let lp = run_chunk(&mut p, &mut kv_p, &mut seq_p, &[tok_p], LogitsWanted::Last);
        let ld = run_chunk(&mut d, &mut kv_d, &mut seq_d, &[tok_d], LogitsWanted::Last);
        assert!(lp == ld, "decode step {step}: D's logits differ from P's colocated decode");
        (tok_p, tok_d) = (argmax(&lp), argmax(&ld));
    }
    kv_p.release(&mut seq_p);
    kv_d.release(&mut seq_d);
    assert_eq!(kv_p.used_blocks() + kv_d.used_blocks(), 0);
}

#[test]
fn model_reports_params_fingerprint_and_compat() {
    let ck = TempCkpt::tiny("params", SynthArch::Qwen2, 64, None, 1);
    let f32_model = load(ck.path(), None);
    let c = f32_model.config().clone();
    // Every tensor the executor loads: embeddings, per-layer norms and projections (with
    // q/k/v biases for Qwen2), the final norm, and an LM head unless tied.
    let (h, q, kvd, i) = (c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size);
    let per_layer = 2 * h + h * q + q + 2 * (h * kvd + kvd) + q * h + 3 * h * i;
    let head = if c.tie_word_embeddings { 0 } else { c.vocab_size * h };
    let want = c.vocab_size * h + c.num_layers * per_layer + h + head;
    assert_eq!(f32_model.param_count(), want as u64);
    assert_eq!(f32_model.weight_bytes(), 4 * want as u64);
    // The same checkpoint held as bf16 on another chip: same params, fingerprint and
    // compatibility; a differently seeded checkpoint of the same shapes is refused by
    // its weights.
    let bf16_model = load(ck.path(), Some(DType::Bf16));
    assert_eq!(bf16_model.param_count(), f32_model.param_count());
    assert_eq!(bf16_model.weights_fingerprint(), f32_model.weights_fingerprint());
    assert_eq!(compat_mismatch(&CompatInfo::of(&f32_model), &CompatInfo::of(&bf16_model)), None);
    let other = TempCkpt::tiny("params-other", SynthArch::Qwen2, 65, None, 1);
    let other = load(other.path(), None);
    assert_eq!(compat_hash(other.config()), compat_hash(&c));
    let why = compat_mismatch(&CompatInfo::of(&f32_model), &CompatInfo::of(&other)).expect("weights differ");
    assert!(why.starts_with("weights fingerprint "), "{why}");
}

/// A prompt that starts with a prefix the engine computed for an earlier request reuses
/// that prefix's cached KV blocks (the first step computes only the rest), and its
/// greedy tokens equal a fresh engine's that computes everything; its logits agree to
/// rounding (the chunks differ, so the summation orders do).
#[test]
fn reused_prefixes_give_the_tokens_of_recomputed_ones() {
    for arch in [SynthArch::Llama, SynthArch::Qwen2] {
        let ck = TempCkpt::tiny("prefix-reuse", arch, 11, None, 1);
        let vocab = load(ck.path(), None).config().vocab_size;
        let system = tokens(48, 5, vocab); // three blocks of 16
        let ask = |tail: u64| -> Vec<u32> { system.iter().copied().chain(tokens(9, tail, vocab)).collect() };
        let mut warm = engine(ck.path(), 16, 64, 2048);
        warm.add_request(1, &ask(100), greedy(6)).unwrap();
        warm.run_to_completion().unwrap();
        assert!(warm.pool().cached() >= 3, "the system prompt's blocks stay cached");
        warm.add_request(2, &ask(200), greedy(12)).unwrap();
        let first = warm.step().unwrap();
        assert_eq!(first.tokens, 9, "only the 9 tokens after the cached 48 are computed");
        let reused = by_id(warm.run_to_completion().unwrap());
        let mut cold = engine(ck.path(), 16, 64, 2048);
        cold.add_request(2, &ask(200), greedy(12)).unwrap();
        let fresh = by_id(cold.run_to_completion().unwrap());
        assert_eq!(reused[0].tokens, fresh[0].tokens, "{arch:?}: greedy tokens");
        assert_close(&format!("{arch:?} logits"), &reused[0].logits, &fresh[0].logits, vocab, TOL);
        assert_eq!(warm.pool().used(), 0);
    }
}
