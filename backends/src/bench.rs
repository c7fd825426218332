//! `tessera bench engine`: prefill and decode throughput of one chip, set against what
//! the same machine measures in the same run — its memory bandwidth (STREAM-style copy)
//! and its matmul peak (a large f32 GEMM through the device) — as bandwidth and compute
//! utilisation.

use std::time::Instant;

use serde::Serialize;

use crate::dtype::DType;
use crate::error::{BackendError, Result};
use crate::kv::{KvCacheConfig, PagedKvCache, slot_of};
use crate::model::{LogitsWanted, Model, SeqChunk};
use crate::sampling::Rng;

#[derive(Debug, Clone)]
pub struct EngineBenchOptions {
    pub batches: Vec<usize>,
    pub prompt_len: usize,
    pub context: usize,
    pub steps: usize,
    pub kv_dtype: DType,
    /// Time every kernel op of the measured steps (see [`crate::profile`]).
    pub profile: bool,
}

/// Where one step's time went: per kernel op, its calls and milliseconds per step; the
/// rest of the step is the host's (batch metadata, the framework around the ops).
#[derive(Debug, Clone, Serialize)]
pub struct StepProfile {
    /// `prefill` or `decode batch N`.
    pub phase: String,
    pub step_ms: f64,
    pub ops: Vec<OpShare>,
}

#[derive(Debug, Clone, Serialize)]
pub struct OpShare {
    pub op: String,
    pub calls_per_step: f64,
    pub ms_per_step: f64,
}

impl StepProfile {
    /// The op times summed over `steps` steps of `step_s` each (their mean).
    fn of(phase: String, ops: Vec<crate::profile::OpTime>, steps: usize, step_s: f64) -> StepProfile {
        let n = steps.max(1) as f64;
        let ops = ops
            .into_iter()
            .map(|o| OpShare { op: o.op, calls_per_step: o.calls as f64 / n, ms_per_step: o.seconds * 1e3 / n })
            .collect();
        StepProfile { phase, step_ms: step_s * 1e3, ops }
    }

    fn table(&self) -> String {
        let mut s = format!(
            "{}: {:.2} ms per step\n  {:<26} {:>6} {:>10} {:>7}\n",
            self.phase, self.step_ms, "op", "calls", "ms/step", "share"
        );
        let mut in_ops = 0.0;
        for o in &self.ops {
            in_ops += o.ms_per_step;
            s += &format!(
                "  {:<26} {:>6.1} {:>10.3} {:>6.1}%\n",
                o.op,
                o.calls_per_step,
                o.ms_per_step,
                100.0 * o.ms_per_step / self.step_ms
            );
        }
        let host = (self.step_ms - in_ops).max(0.0);
        s += &format!(
            "  {:<26} {:>6} {:>10.3} {:>6.1}%\n",
            "host (outside the ops)",
            "",
            host,
            100.0 * host / self.step_ms
        );
        s
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct PrefillFigures {
    pub tokens: usize,
    pub seconds_median: f64,
    pub tokens_per_s: f64,
    pub flops: f64,
    pub compute_utilisation: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct DecodeFigures {
    pub batch: usize,
    pub step_ms_median: f64,
    pub tokens_per_s: f64,
    pub bytes_per_step: f64,
    pub flops_per_step: f64,
    /// Against the STREAM copy.
    pub bandwidth_utilisation: f64,
    pub bandwidth_utilisation_vs_nt_copy: f64,
    /// Against the read-only stream: how close the step comes to reading at the
    /// machine's read bandwidth.
    pub bandwidth_utilisation_vs_read: f64,
    pub compute_utilisation: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct EngineBenchReport {
    pub device: String,
    pub threads: u32,
    pub weight_dtype: String,
    /// Block formats of the weights (`float` when none is quantized).
    pub weight_format: String,
    pub kv_dtype: String,
    pub linear_params: usize,
    pub weight_bytes: u64,
    /// Bytes of weights one decode step reads, in their device formats (part of every
    /// decode row's `bytes_per_step`, with the KV the step reads).
    pub weight_read_per_step: u64,
    pub memory: MemoryBandwidth,
    /// The arithmetic of prompts' linear layers (`--matmul-precision`).
    pub matmul_precision: String,
    /// A 2048^3 GEMM through the device's `tk_linear`, in f32 products, or in bf16
    /// ones when `matmul_precision` is `bf16`.
    pub gemm_f32_gflop_s: f64,
    pub prefill: PrefillFigures,
    pub decode: Vec<DecodeFigures>,
    /// With `--profile`: where each phase's step time went.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub profile: Vec<StepProfile>,
}

impl EngineBenchReport {
    pub fn table(&self) -> String {
        let mut s = format!(
            "device {}; weights {} ({}; {:.0}M linear params, {:.2} GB, {:.3} GB read per decode step); KV {}\n\
             machine: STREAM copy {:.1} GB/s (non-temporal copy {:.1}, read-only {:.1}); \
             {} GEMM {:.1} GFLOP/s\n\n",
            self.device,
            self.weight_dtype,
            self.weight_format,
            self.linear_params as f64 / 1e6,
            self.weight_bytes as f64 / 1e9,
            self.weight_read_per_step as f64 / 1e9,
            self.kv_dtype,
            self.memory.copy_gb_s,
            self.memory.copy_nt_gb_s,
            self.memory.read_gb_s,
            self.matmul_precision,
            self.gemm_f32_gflop_s
        );
        let p = &self.prefill;
        s += &format!(
            "prefill {} tokens: {:.3} s, {:.1} tok/s, compute utilisation {:.2}\n\n",
            p.tokens, p.seconds_median, p.tokens_per_s, p.compute_utilisation
        );
        s += "batch  step ms     tok/s  GB/step  GFLOP/step  BW util (vs NT copy, read)  compute util\n";
        for d in &self.decode {
            s += &format!(
                "{:>5}  {:>7.2}  {:>8.1}  {:>7.3}  {:>10.2}  {:>7.2} ({:.2}, {:.2})         {:>12.2}\n",
                d.batch,
                d.step_ms_median,
                d.tokens_per_s,
                d.bytes_per_step / 1e9,
                d.flops_per_step / 1e9,
                d.bandwidth_utilisation,
                d.bandwidth_utilisation_vs_nt_copy,
                d.bandwidth_utilisation_vs_read,
                d.compute_utilisation
            );
        }
        for p in &self.profile {
            s += "\n";
            s += &p.table();
        }
        s
    }
}

/// Median of a non-empty sample (callers time at least one run; NaN for none).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The machine's memory bandwidth, measured two ways over arrays far larger than any
/// cache, split across the device's threads (best of several passes each).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct MemoryBandwidth {
    /// STREAM "Copy" with ordinary stores (bytes read + bytes written): the reference
    /// STREAM kernel, and the denominator of `bandwidth_utilisation`.
    pub copy_gb_s: f64,
    /// The same copy as one `memcpy` per thread, which streams its stores past the
    /// caches (non-temporal); it reports more bytes per second than a read-only stream
    /// such as decode reaches on the same machine.
    pub copy_nt_gb_s: f64,
    /// A read-only stream: each thread sums its part of the array. A decode step only
    /// reads its weights, so this is the bandwidth it can reach.
    pub read_gb_s: f64,
}

const BW_BYTES: usize = 512 << 20;

/// Best wall time of `passes` runs of `work(range)` on `threads` threads, one range of
/// `0..n` each.
fn best_parallel(threads: usize, n: usize, passes: usize, work: impl Fn(std::ops::Range<usize>) + Sync) -> f64 {
    let chunk = n.div_ceil(threads);
    let mut best = f64::INFINITY;
    for _ in 0..passes {
        let t = Instant::now();
        std::thread::scope(|scope| {
            for start in (0..n).step_by(chunk) {
                let work = &work;
                scope.spawn(move || work(start..(start + chunk).min(n)));
            }
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

pub fn memory_bandwidth(threads: usize) -> MemoryBandwidth {
    let threads = threads.max(1);
    let n = BW_BYTES / 8;
    let src = vec![1.0f64; n];
    let dst: Vec<std::sync::Mutex<Vec<f64>>> =
        (0..threads).map(|_| std::sync::Mutex::new(vec![0.0f64; n.div_ceil(threads)])).collect();
    let chunk = n.div_ceil(threads);
    // 64 KiB pieces stay below the size at which memcpy switches to non-temporal stores.
    const PIECE: usize = (64 << 10) / 8;
    let copy_pieces = |r: std::ops::Range<usize>| {
        let mut d = dst[r.start / chunk].lock().unwrap_or_else(|e| e.into_inner());
        for (d, s) in d.chunks_mut(PIECE).zip(src[r].chunks(PIECE)) {
            d[..s.len()].copy_from_slice(s);
        }
    };
    let copy_whole = |r: std::ops::Range<usize>| {
        let mut d = dst[r.start / chunk].lock().unwrap_or_else(|e| e.into_inner());
        let len = r.len();
        d[..len].copy_from_slice(&src[r]);
    };
    // Integer sums, which the compiler may reorder and vectorise freely.
    let read = |r: std::ops::Range<usize>| {
        std::hint::black_box(src[r].iter().fold(0u64, |acc, v| acc.wrapping_add(v.to_bits())));
    };
    let copy_s = best_parallel(threads, n, 5, copy_pieces);
    let copy_nt_s = best_parallel(threads, n, 5, copy_whole);
    let read_s = best_parallel(threads, n, 5, read);
    MemoryBandwidth {
        copy_gb_s: 2.0 * BW_BYTES as f64 / copy_s / 1e9,
        copy_nt_gb_s: 2.0 * BW_BYTES as f64 / copy_nt_s / 1e9,
        read_gb_s: BW_BYTES as f64 / read_s / 1e9,
    }
}

/// GFLOP/s of a 2048^3 f32 GEMM through the device (median of 5 after a warm-up).
pub fn gemm_f32_gflop_s(model: &Model) -> Result<f64> {
    const N: usize = 2048;
    let dev = model.device();
    let mut rng = Rng::seeded(1);
    let a: Vec<f32> = (0..N * N).map(|_| rng.next_f64() as f32 - 0.5).collect();
    let (x, w, out) = (dev.upload(&a)?, dev.upload(&a)?, dev.alloc(N * N * 4)?);
    let mut times = Vec::new();
    for i in 0..6 {
        let t = Instant::now();
        dev.linear(out.view(), x.view(), w.view(), DType::F32, None, N as u32, N as u32, N as u32)?;
        dev.synchronize()?;
        if i > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    Ok(2.0 * (N * N * N) as f64 / median(times) / 1e9)
}

/// Attention FLOPs (QKᵀ and PV) of `q_len` queries ending a context of `ctx` tokens.
fn attention_flops(model: &Model, q_len: usize, ctx: usize) -> f64 {
    let c = model.config();
    // Query j (0-based) of the chunk sees ctx - q_len + j + 1 keys.
    let pairs: usize = (0..q_len).map(|j| ctx - q_len + j + 1).sum();
    4.0 * (c.num_heads * c.head_dim * c.num_layers * pairs) as f64
}

fn random_tokens(rng: &mut Rng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|_| (rng.next_u64() % vocab as u64) as u32).collect()
}

/// One sequence of the benchmark: it owns a fixed run of blocks for the whole run (the
/// benchmark times the forward step, so it needs no allocator), of which it uses as many
/// as its `len` tokens fill.
struct BenchSeq {
    blocks: Vec<u32>,
    len: usize,
}

impl BenchSeq {
    /// Sequence `i` of the run: blocks `i * per_seq..(i + 1) * per_seq`.
    fn nth(i: usize, per_seq: usize) -> BenchSeq {
        BenchSeq { blocks: (i * per_seq..(i + 1) * per_seq).map(|b| b as u32).collect(), len: 0 }
    }
}

/// Appends `tokens` for each sequence and runs them as one step.
fn run_step(
    model: &mut Model,
    kv: &PagedKvCache,
    seqs: &mut [BenchSeq],
    tokens: &[Vec<u32>],
    logits: LogitsWanted,
) -> Result<f64> {
    let bs = kv.config().block_size;
    let mut starts = Vec::new();
    let mut slots = Vec::new();
    for (seq, t) in seqs.iter_mut().zip(tokens) {
        let start = seq.len;
        seq.len += t.len();
        let s = (start..seq.len)
            .map(|pos| {
                slot_of(&seq.blocks, bs, pos)
                    .ok_or_else(|| BackendError::KvCache(format!("position {pos} is beyond the sequence's blocks")))
            })
            .collect::<Result<Vec<i32>>>()?;
        starts.push(start);
        slots.push(s);
    }
    let chunks: Vec<SeqChunk<'_>> = seqs
        .iter()
        .zip(tokens)
        .zip(starts.iter().zip(&slots))
        .map(|((seq, t), (&start_pos, slots))| SeqChunk {
            tokens: t,
            start_pos,
            block_table: &seq.blocks[..seq.len.div_ceil(bs)],
            slots,
            logits,
        })
        .collect();
    let t = Instant::now();
    model.forward(kv, &chunks)?;
    model.device().synchronize()?;
    Ok(t.elapsed().as_secs_f64())
}

pub fn run_engine_bench(mut model: Model, opts: &EngineBenchOptions) -> Result<EngineBenchReport> {
    let c = model.config().clone();
    if opts.steps == 0 || opts.prompt_len == 0 || opts.context == 0 || opts.batches.is_empty() {
        return Err(BackendError::Request("steps, prompt length, context and batch sizes must be at least 1".into()));
    }
    if let Some(&b) = opts.batches.iter().find(|&&b| b == 0 || b > 4096) {
        return Err(BackendError::Request(format!("batch size {b} is out of range (1..=4096)")));
    }
    let longest = opts.prompt_len.max(opts.context.saturating_add(opts.steps).saturating_add(1));
    if longest > c.max_context {
        return Err(BackendError::Request(format!(
            "the benchmark needs {longest} tokens of context; the model's context is {}",
            c.max_context
        )));
    }
    let threads = model.device().info().compute_units;
    let memory = memory_bandwidth(threads as usize);
    let gemm = gemm_f32_gflop_s(&model)?;
    let max_batch = opts.batches.iter().copied().max().unwrap_or(1);
    let block_size = crate::kv::DEFAULT_BLOCK_SIZE;
    let per_seq = (opts.context + opts.steps + 2).max(opts.prompt_len).div_ceil(block_size);
    let kv_config = KvCacheConfig { block_size, num_blocks: per_seq * max_batch.max(1), dtype: opts.kv_dtype };
    let kv = PagedKvCache::new(model.device(), &c, kv_config)?;
    let mut rng = Rng::seeded(7);
    let vocab = c.vocab_size;
    let head_params = c.vocab_size * c.hidden_size;
    let body_params = c.linear_params() - head_params;

    // Prefill: one prompt in one step, logits for its last token only.
    let mut prefill_times = Vec::new();
    let mut profile = Vec::new();
    for i in 0..4 {
        let len = if i == 0 { opts.prompt_len.min(64) } else { opts.prompt_len };
        let mut seqs = vec![BenchSeq::nth(0, per_seq)];
        crate::profile::enable(opts.profile && i > 0);
        let t = run_step(&mut model, &kv, &mut seqs, &[random_tokens(&mut rng, len, vocab)], LogitsWanted::Last)?;
        if i > 0 {
            prefill_times.push(t);
        }
    }
    crate::profile::enable(false);
    if opts.profile {
        // Against the mean step (the ops are summed over the same steps).
        let mean = prefill_times.iter().sum::<f64>() / prefill_times.len() as f64;
        let ops = crate::profile::take();
        profile.push(StepProfile::of(format!("prefill {} tokens", opts.prompt_len), ops, prefill_times.len(), mean));
    }
    let p_s = median(prefill_times);
    let p_len = opts.prompt_len;
    // Past its K and V the last layer runs on the one row whose logits are wanted
    // (see `Model::forward_observed`): its q projection on every row, the rest on one.
    let (q_params, kv_params) =
        (c.hidden_size * c.num_heads * c.head_dim, 2 * c.hidden_size * c.num_kv_heads * c.head_dim);
    let tail = body_params / c.num_layers - q_params - kv_params;
    let layers = c.num_layers as f64;
    let p_flops = 2.0 * ((body_params - tail) * p_len + tail + head_params) as f64
        + attention_flops(&model, p_len, p_len) * (layers - 1.0) / layers
        + attention_flops(&model, 1, p_len) / layers;
    let prefill = PrefillFigures {
        tokens: p_len,
        seconds_median: p_s,
        tokens_per_s: p_len as f64 / p_s,
        flops: p_flops,
        compute_utilisation: p_flops / p_s / (gemm * 1e9),
    };

    let kv_token_bytes = c.kv_bytes_per_token(opts.kv_dtype.size_bytes());
    let weight_read = model.decode_read_bytes() as usize;
    let mut decode = Vec::new();
    for &batch in &opts.batches {
        let mut seqs: Vec<BenchSeq> = (0..batch).map(|i| BenchSeq::nth(i, per_seq)).collect();
        let prompts: Vec<Vec<u32>> = (0..batch).map(|_| random_tokens(&mut rng, opts.context, vocab)).collect();
        run_step(&mut model, &kv, &mut seqs, &prompts, LogitsWanted::None)?;
        let mut times = Vec::new();
        let mut bytes = Vec::new();
        let mut flops = Vec::new();
        for i in 0..=opts.steps {
            let next: Vec<Vec<u32>> = (0..batch).map(|_| random_tokens(&mut rng, 1, vocab)).collect();
            let ctx_total: usize = seqs.iter().map(|s| s.len + 1).sum();
            let attn: f64 = seqs.iter().map(|s| attention_flops(&model, 1, s.len + 1)).sum();
            crate::profile::enable(opts.profile && i > 0);
            let t = run_step(&mut model, &kv, &mut seqs, &next, LogitsWanted::Last)?;
            crate::profile::enable(false);
            if i > 0 {
                times.push(t);
                bytes.push((weight_read + ctx_total * kv_token_bytes) as f64);
                flops.push(2.0 * (c.linear_params() * batch) as f64 + attn);
            }
        }
        if opts.profile {
            let mean = times.iter().sum::<f64>() / times.len() as f64;
            let ops = crate::profile::take();
            let phase = format!("decode batch {batch} at {} of context", opts.context);
            profile.push(StepProfile::of(phase, ops, times.len(), mean));
        }
        let step = median(times);
        let (b, f) = (median(bytes), median(flops));
        decode.push(DecodeFigures {
            batch,
            step_ms_median: step * 1e3,
            tokens_per_s: batch as f64 / step,
            bytes_per_step: b,
            flops_per_step: f,
            bandwidth_utilisation: b / step / (memory.copy_gb_s * 1e9),
            bandwidth_utilisation_vs_nt_copy: b / step / (memory.copy_nt_gb_s * 1e9),
            bandwidth_utilisation_vs_read: b / step / (memory.read_gb_s * 1e9),
            compute_utilisation: f / step / (gemm * 1e9),
        });
    }
    Ok(EngineBenchReport {
        device: model.device().info().name.clone(),
        threads,
        weight_dtype: model.dtype().to_string(),
        weight_format: model.weight_format().to_owned(),
        kv_dtype: opts.kv_dtype.to_string(),
        linear_params: c.linear_params(),
        weight_bytes: model.weight_bytes(),
        weight_read_per_step: model.decode_read_bytes(),
        memory,
        matmul_precision: model.device().matmul_precision().to_string(),
        gemm_f32_gflop_s: gemm,
        prefill,
        decode,
        profile,
    })
}
