//! Causal GQA attention over the paged KV cache: varlen (chunked) prefill with `gemm`
//! on gathered K/V, and a block-streaming decode kernel.

use gemm::Parallelism;
use rayon::prelude::*;

use super::misc::{CacheLevel, KvGeom};
use super::{SendPtr, Strided, matmul, matmul_into};
use crate::dtype::WSlice;
use crate::error::Result;
use crate::invalid;

/// A read-only view of one layer's KV cache.
#[derive(Debug, Clone, Copy)]
pub struct KvView<'a> {
    pub k: WSlice<'a>,
    pub v: WSlice<'a>,
    pub geom: KvGeom,
}

/// Validates the per-sequence context lengths and the block-table entries they use,
/// and the head configuration.
pub fn validate_tables(
    kv: &KvView,
    context_lens: &[i32],
    block_tables: &[i32],
    max_blocks_per_seq: usize,
    num_heads: usize,
) -> Result<()> {
    let g = &kv.geom;
    if g.num_kv_heads == 0 || num_heads == 0 || !num_heads.is_multiple_of(g.num_kv_heads) {
        return Err(invalid!(
            "num_heads = {num_heads} must be a positive multiple of cache.num_kv_heads = {}",
            g.num_kv_heads
        ));
    }
    if g.block_size == 0 || g.head_dim == 0 {
        return Err(invalid!(
            "cache.block_size = {} and cache.head_dim = {} must be positive",
            g.block_size,
            g.head_dim
        ));
    }
    let cap = max_blocks_per_seq * g.block_size;
    for (s, &c) in context_lens.iter().enumerate() {
        if c < 0 || c as usize > cap {
            return Err(invalid!("context_lens[{s}] = {c} is outside [0, max_blocks_per_seq * block_size = {cap}]"));
        }
        let used = (c as usize).div_ceil(g.block_size);
        for b in 0..used {
            let id = block_tables[s * max_blocks_per_seq + b];
            if id < 0 || id as usize >= g.num_blocks {
                return Err(invalid!("block_tables[{s}][{b}] = {id} is out of range (num_blocks = {})", g.num_blocks));
            }
        }
    }
    Ok(())
}

/// Validates `query_start` against `context_lens` and `total_q`.
pub fn validate_query_start(query_start: &[i32], context_lens: &[i32], total_q: usize) -> Result<()> {
    if query_start.first().is_some_and(|&q| q < 0) {
        return Err(invalid!("query_start[0] = {} is negative", query_start[0]));
    }
    for s in 0..context_lens.len() {
        let (a, b) = (query_start[s], query_start[s + 1]);
        if b < a {
            return Err(invalid!("query_start[{}] = {b} < query_start[{s}] = {a}", s + 1));
        }
        if b as usize > total_q {
            return Err(invalid!("query_start[{}] = {b} exceeds total_q = {total_q}", s + 1));
        }
        if (b - a) > context_lens[s] {
            return Err(invalid!(
                "sequence {s} has {} queries but context_lens[{s}] = {} (queries are the last \
                 tokens of the context)",
                b - a,
                context_lens[s]
            ));
        }
    }
    Ok(())
}

/// Copies the first `ctx` tokens of (seq, kv head) of `cache` to contiguous f32
/// `[ctx][head_dim]`, whatever the cache's layout.
fn gather(cache: WSlice, g: &KvGeom, table: &[i32], kvh: usize, ctx: usize, dst: &mut [f32]) {
    let hd = g.head_dim;
    let mut pos = 0;
    while pos < ctx {
        let blk = table[pos / g.block_size] as usize;
        let rows = g.block_size.min(ctx - pos);
        g.read_head_rows(cache, blk, kvh, rows, &mut dst[pos * hd..(pos + rows) * hd]);
        pos += rows;
    }
}

/// Query tokens per tile of a prefill: a tile attends its tokens for every query head
/// of one KV head's group together, so each key block is read once per tile.
const TQ: usize = 32;
/// Keys per step of a tile's sweep: the tile's scores for one step stay in cache.
const TK: usize = 256;

/// A tile's working state: its queries (`[row][head_dim]`, row = token * group + head
/// in the group), one step's scores (`[row][TK]`), and per row the running output,
/// maximum score and sum of exponentials (online softmax).
#[derive(Default)]
struct Tile {
    q: Vec<f32>,
    s: Vec<f32>,
    o: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
}

/// Prefill attention; see `tk_prefill_attention`. The batch must have been validated.
///
/// Flash-attention style: each (sequence, KV head)'s visible K and V are gathered once
/// as f32; its queries are cut into tiles of [`TQ`] tokens (all `group` query heads of
/// the KV head together), and each tile sweeps its keys in steps of [`TK`], keeping a
/// running softmax, so no score row longer than a step is ever written out. A
/// sequence's result never depends on the batch around it.
#[allow(clippy::too_many_arguments)]
pub fn prefill_attention(
    out: &mut [f32],
    q: &[f32],
    kv: &KvView,
    query_start: &[i32],
    context_lens: &[i32],
    block_tables: &[i32],
    max_blocks_per_seq: usize,
    total_q: usize,
    num_heads: usize,
    scale: f32,
) -> Result<()> {
    validate_tables(kv, context_lens, block_tables, max_blocks_per_seq, num_heads)?;
    validate_query_start(query_start, context_lens, total_q)?;
    let g = kv.geom;
    let hd = g.head_dim;
    let group = num_heads / g.num_kv_heads;
    let row_stride = num_heads * hd;
    assert!(out.len() >= total_q * row_stride && q.len() >= total_q * row_stride);
    let optr = SendPtr(out.as_mut_ptr());
    let tasks: Vec<(usize, usize)> = (0..context_lens.len())
        .filter(|&s| query_start[s + 1] > query_start[s])
        .flat_map(|s| (0..g.num_kv_heads).map(move |h| (s, h)))
        .collect();
    tasks.into_par_iter().for_each(|(s, kvh)| {
        let ctx = context_lens[s] as usize;
        let q0 = query_start[s] as usize;
        let ql = query_start[s + 1] as usize - q0;
        let table = &block_tables[s * max_blocks_per_seq..(s + 1) * max_blocks_per_seq];
        let mut kbuf = vec![0.0f32; ctx * hd];
        let mut vbuf = vec![0.0f32; ctx * hd];
        gather(kv.k, &g, table, kvh, ctx, &mut kbuf);
        gather(kv.v, &g, table, kvh, ctx, &mut vbuf);
        let (kbuf, vbuf) = (&kbuf, &vbuf);
        // The last tiles see the most keys: hand them out first.
        let tiles = ql.div_ceil(TQ);
        (0..tiles).into_par_iter().rev().for_each_init(Tile::default, |tile, ti| {
            let t0 = ti * TQ;
            let tq = TQ.min(ql - t0);
            let rows = tq * group;
            tile.q.clear();
            for t in 0..tq {
                let at = (q0 + t0 + t) * row_stride + kvh * group * hd;
                tile.q.extend_from_slice(&q[at..at + group * hd]);
            }
            // The tile's first token sits at this position of the context.
            let first = ctx - ql + t0;
            attend_tile(tile, rows, group, hd, first, (kbuf, vbuf), scale);
            for t in 0..tq {
                let src = &tile.o[t * group * hd..(t + 1) * group * hd];
                // SAFETY: these are token q0+t0+t's heads kvh*group.. of out, inside it by
                // the assert above, written only by this tile (each (sequence, KV head,
                // tile) is one task, and a task's tokens are its own).
                unsafe {
                    let dst = optr.get().add((q0 + t0 + t) * row_stride + kvh * group * hd);
                    std::ptr::copy_nonoverlapping(src.as_ptr(), dst, group * hd);
                }
            }
        });
    });
    Ok(())
}

/// Attends a tile's `rows` queries (`tile.q`; row r is token `r / group`, at context
/// position `first + r / group`) causally to the keys and values `k`, `v`
/// (`[token][head_dim]`), leaving the normalised output in `tile.o`.
fn attend_tile(
    tile: &mut Tile,
    rows: usize,
    group: usize,
    hd: usize,
    first: usize,
    (k, v): (&[f32], &[f32]),
    scale: f32,
) {
    let end = first + rows / group; // keys the tile's last token sees
    tile.o.clear();
    tile.o.resize(rows * hd, 0.0);
    tile.max.clear();
    tile.max.resize(rows, f32::NEG_INFINITY);
    tile.sum.clear();
    tile.sum.resize(rows, 0.0);
    tile.s.resize(rows * TK, 0.0);
    let mut j0 = 0;
    while j0 < end {
        let kb = TK.min(end - j0);
        // SAFETY: lhs is the tile's rows x hd queries; rhs(d, j) = k[(j0 + j) * hd + d]
        // for j < kb, inside k as j0 + kb <= end <= its tokens; dst is rows x kb of s.
        unsafe {
            matmul(
                rows,
                kb,
                hd,
                Strided { ptr: tile.s.as_mut_ptr(), rs: kb as isize, cs: 1 },
                Strided { ptr: tile.q.as_ptr(), rs: hd as isize, cs: 1 },
                Strided { ptr: k[j0 * hd..].as_ptr(), rs: 1, cs: hd as isize },
                scale,
                Parallelism::None,
            )
        };
        for r in 0..rows {
            // Keys of this step the row's token sees (its own position included).
            let seen = (first + r / group + 1).saturating_sub(j0).min(kb);
            let row = &mut tile.s[r * kb..(r + 1) * kb];
            let (live, masked) = row.split_at_mut(seen);
            masked.fill(0.0);
            if seen == 0 {
                continue;
            }
            let step_max = live.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let max = tile.max[r].max(step_max);
            let sum = exp_shifted(live, max);
            if tile.max[r] != max {
                // Rescale what the row gathered under its old maximum (nothing yet on
                // its first step: exp(-inf) = 0).
                let c = (tile.max[r] - max).exp();
                tile.sum[r] *= c;
                tile.o[r * hd..(r + 1) * hd].iter_mut().for_each(|x| *x *= c);
                tile.max[r] = max;
            }
            tile.sum[r] += sum;
        }
        // SAFETY: o (rows x hd) += s (rows x kb) · v[j0..j0 + kb] (kb x hd), all inside
        // their buffers as above; o is initialised.
        unsafe {
            matmul_into(
                rows,
                hd,
                kb,
                Strided { ptr: tile.o.as_mut_ptr(), rs: hd as isize, cs: 1 },
                true,
                Strided { ptr: tile.s.as_ptr(), rs: kb as isize, cs: 1 },
                Strided { ptr: v[j0 * hd..].as_ptr(), rs: hd as isize, cs: 1 },
                1.0,
                Parallelism::None,
            )
        };
        j0 += kb;
    }
    for (o, &sum) in tile.o.chunks_exact_mut(hd).zip(&tile.sum) {
        let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
        o.iter_mut().for_each(|x| *x *= inv);
    }
}

/// Context tokens per part of a decode: each (sequence, kv head)'s context is split
/// into parts of this many tokens (rounded up to whole blocks), attended in parallel
/// and merged. Fixed, so a sequence's result never depends on the batch around it.
const DECODE_PART: usize = 256;

/// A part's softmax state per query head of a group: its max score, its sum of
/// exponentials, and its unnormalised output (`acc`, `group * head_dim`).
struct PartState<'a> {
    max: &'a mut [f32],
    sum: &'a mut [f32],
    acc: &'a mut [f32],
}

/// Decode attention: one query per sequence attending to all its cached tokens. Each
/// (sequence, kv head)'s context is cut into parts of [`DECODE_PART`] tokens, attended
/// in parallel (a part reads each of its K and V blocks once: on AVX-512 each row
/// straight from the cache for every query head of the group, elsewhere converted to
/// f32 a block at a time), and the parts of a head are merged in order at the end
/// (flash-decoding): a long context keeps every thread busy even at batch 1.
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention(
    out: &mut [f32],
    q: &[f32],
    kv: &KvView,
    block_tables: &[i32],
    context_lens: &[i32],
    num_seqs: usize,
    max_blocks_per_seq: usize,
    num_heads: usize,
    scale: f32,
) -> Result<()> {
    validate_tables(kv, context_lens, block_tables, max_blocks_per_seq, num_heads)?;
    let g = kv.geom;
    let hd = g.head_dim;
    let group = num_heads / g.num_kv_heads;
    if num_seqs == 0 {
        return Ok(());
    }
    let part_len = DECODE_PART.div_ceil(g.block_size) * g.block_size;
    // (sequence, kv head, first token, end) of every part, in order.
    let mut parts = Vec::new();
    for (s, &ctx) in context_lens[..num_seqs].iter().enumerate() {
        let ctx = ctx as usize;
        for kvh in 0..g.num_kv_heads {
            let mut start = 0;
            loop {
                let end = (start + part_len).min(ctx);
                parts.push((s, kvh, start, end));
                start = end;
                if start >= ctx {
                    break;
                }
            }
        }
    }
    // Each part's state: max and sum per query head, then the accumulators.
    let stride = group * (hd + 2);
    let mut states = vec![0.0f32; parts.len() * stride];
    states.par_chunks_mut(stride).zip(&parts).for_each_init(
        || (vec![0.0f32; g.block_size * hd], vec![0.0f32; g.block_size * hd], Vec::new()),
        |(kbuf, vbuf, scores), (chunk, &(s, kvh, start, end))| {
            let (max, rest) = chunk.split_at_mut(group);
            let (sum, acc) = rest.split_at_mut(group);
            let state = PartState { max, sum, acc };
            let table = &block_tables[s * max_blocks_per_seq..(s + 1) * max_blocks_per_seq];
            let qh = &q[(s * num_heads + kvh * group) * hd..][..group * hd];
            attend_part(kv, table, kvh, start, end, qh, scale, (kbuf, vbuf, scores), state);
        },
    );
    // Merge each (sequence, kv head)'s parts into its rows of `out`, in part order.
    let mut first = 0;
    while first < parts.len() {
        let (s, kvh, ..) = parts[first];
        let n = parts[first..].iter().take_while(|p| (p.0, p.1) == (s, kvh)).count();
        let o = &mut out[(s * num_heads + kvh * group) * hd..][..group * hd];
        merge_parts(&states[first * stride..(first + n) * stride], group, hd, o);
        first += n;
    }
    Ok(())
}

/// The rows of `src` for `rows` tokens of kv head `kvh` in `block` as f32: the cache
/// itself when it is f32 and head-major, else converted into `buf`.
fn head_rows<'a>(src: WSlice<'a>, g: &KvGeom, block: usize, kvh: usize, rows: usize, buf: &'a mut [f32]) -> &'a [f32] {
    let n = rows * g.head_dim;
    if let (WSlice::F32(all), super::misc::KvLayout::HeadMajor) = (src, g.layout) {
        let at = g.index(block, kvh, 0);
        return &all[at..at + n];
    }
    g.read_head_rows(src, block, kvh, rows, buf);
    &buf[..n]
}

/// Attends the `group` query heads `qh` (`[group][head_dim]`) to tokens `start..end` of
/// kv head `kvh` (`start` on a block boundary), leaving an unnormalised softmax state:
/// the part's scores first (K blocks), their exponentials, then the weighted V blocks.
#[allow(clippy::too_many_arguments)]
fn attend_part(
    kv: &KvView,
    table: &[i32],
    kvh: usize,
    start: usize,
    end: usize,
    qh: &[f32],
    scale: f32,
    (kbuf, vbuf, scores): (&mut [f32], &mut [f32], &mut Vec<f32>),
    mut st: PartState,
) {
    let g = kv.geom;
    let (hd, bs) = (g.head_dim, g.block_size);
    let group = st.max.len();
    let n = end - start;
    st.acc.fill(0.0);
    if n == 0 {
        st.max.fill(f32::NEG_INFINITY);
        st.sum.fill(0.0);
        return;
    }
    scores.resize(group * n, 0.0);
    #[cfg(target_arch = "x86_64")]
    if x512::usable(kv) {
        let part = x512::Part { kv, table, kvh, start, end };
        // SAFETY: `usable` checked AVX-512, the head size and the storage type; the
        // caller validated the block table against the cache for tokens up to `end`,
        // `qh` holds `group` heads and `scores` `group * n` values.
        unsafe { x512::scores(&part, qh, scale, scores) };
        softmax_rows(scores, n, &mut st);
        // SAFETY: as above; `st.acc` holds `group` heads.
        unsafe { x512::values(&part, scores, st.acc) };
        return;
    }
    let blocks = (start..end).step_by(bs).map(|pos| (pos - start, bs.min(end - pos), table[pos / bs] as usize));
    // Each block's rows are asked for one block ahead (K, then V from the first block).
    let ahead = |src: WSlice, from: usize| {
        let pos = start + from;
        if pos < end {
            g.prefetch_head_rows(src, table[pos / bs] as usize, kvh, bs.min(end - pos), CacheLevel::L1);
        }
    };
    ahead(kv.k, 0);
    for (off, rows, block) in blocks.clone() {
        ahead(kv.k, off + bs);
        let k = head_rows(kv.k, &g, block, kvh, rows, kbuf);
        for (gi, qv) in qh.chunks_exact(hd).enumerate() {
            dots(qv, k, scale, &mut scores[gi * n + off..gi * n + off + rows]);
        }
    }
    ahead(kv.v, 0);
    softmax_rows(scores, n, &mut st);
    for (off, rows, block) in blocks {
        ahead(kv.v, off + bs);
        let v = head_rows(kv.v, &g, block, kvh, rows, vbuf);
        for (gi, acc) in st.acc.chunks_exact_mut(hd).enumerate() {
            weighted_sum(&scores[gi * n + off..gi * n + off + rows], v, acc);
        }
    }
}

/// Each head's row of `n` scores becomes its exponentials less the row's maximum, that
/// maximum and their sum going to the part's state.
fn softmax_rows(scores: &mut [f32], n: usize, st: &mut PartState) {
    for (gi, row) in scores.chunks_exact_mut(n).enumerate().take(st.max.len()) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        st.max[gi] = max;
        st.sum[gi] = exp_shifted(row, max);
    }
}

/// `out[r] = q · k[r] * scale` for each row `r` of `k` (`[out.len()][q.len()]`).
fn dots(q: &[f32], k: &[f32], scale: f32, out: &mut [f32]) {
    let hd = q.len();
    #[cfg(target_arch = "x86_64")]
    if hd.is_multiple_of(8) && crate::simd::has_avx2() {
        // SAFETY: AVX2 and FMA were detected; `hd` is a multiple of 8.
        unsafe { x86::dots(q, k, scale, out) };
        return;
    }
    for (o, krow) in out.iter_mut().zip(k.chunks_exact(hd)) {
        *o = crate::simd::dot(q, krow) * scale;
    }
}

/// `row[i] = exp(row[i] - max)`; returns their sum.
fn exp_shifted(row: &mut [f32], max: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx2() {
        // SAFETY: AVX2 and FMA were detected.
        return unsafe { x86::exp_shifted(row, max) };
    }
    let mut sum = 0.0;
    for x in row.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    sum
}

/// `acc += Σ_r p[r] * v[r]` (`v`: `[p.len()][acc.len()]`).
fn weighted_sum(p: &[f32], v: &[f32], acc: &mut [f32]) {
    let hd = acc.len();
    #[cfg(target_arch = "x86_64")]
    if hd.is_multiple_of(8) && crate::simd::has_avx2() {
        // SAFETY: AVX2 and FMA were detected; `hd` is a multiple of 8.
        unsafe { x86::weighted_sum(p, v, acc) };
        return;
    }
    for (&w, vrow) in p.iter().zip(v.chunks_exact(hd)) {
        crate::simd::axpy(w, vrow, acc);
    }
}

/// Merges the softmax states of a head's parts (`[part][max; sum; acc]`, each
/// `group * (hd + 2)` long) into its normalised output `o` (`[group][hd]`).
fn merge_parts(states: &[f32], group: usize, hd: usize, o: &mut [f32]) {
    let stride = group * (hd + 2);
    for gi in 0..group {
        let max = states.chunks_exact(stride).map(|p| p[gi]).fold(f32::NEG_INFINITY, f32::max);
        let out = &mut o[gi * hd..(gi + 1) * hd];
        out.fill(0.0);
        let mut sum = 0.0f32;
        for p in states.chunks_exact(stride) {
            if p[gi] == f32::NEG_INFINITY {
                continue; // an empty part (a sequence without context)
            }
            let w = (p[gi] - max).exp();
            sum += p[group + gi] * w;
            let acc = &p[2 * group + gi * hd..][..hd];
            crate::simd::axpy(w, acc, out);
        }
        let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
        out.iter_mut().for_each(|x| *x *= inv);
    }
}

/// The decode part's two passes on AVX-512, for heads of 16 to 128 values (multiples of
/// 16) in a float cache: each K and V row is read straight from the cache, converted
/// in registers and used for every query head of the group before the next row (the
/// portable path converts each block into a buffer first and reads it once per head).
/// Heads go in chunks whose accumulators and queries stay in registers.
#[cfg(target_arch = "x86_64")]
mod x512 {
    use std::arch::x86_64::*;

    use super::{CacheLevel, KvView};
    use crate::dtype::WSlice;

    /// f32, f16 and bf16 storage (the `DT` parameter below).
    const F32: u8 = 0;
    const F16: u8 = 1;
    const BF16: u8 = 2;

    /// True when this kernel serves the cache `kv` here.
    pub fn usable(kv: &KvView) -> bool {
        let hd = kv.geom.head_dim;
        hd.is_multiple_of(16)
            && (16..=128).contains(&hd)
            && !matches!(kv.k, WSlice::Quant(..))
            && !matches!(kv.v, WSlice::Quant(..))
            && crate::simd::has_avx512()
    }

    /// The start of a float tensor's storage, its type code and element size.
    fn storage(w: WSlice) -> (*const u8, u8, usize) {
        match w {
            WSlice::F32(s) => (s.as_ptr().cast(), F32, 4),
            WSlice::F16(s) => (s.as_ptr().cast(), F16, 2),
            WSlice::Bf16(s) => (s.as_ptr().cast(), BF16, 2),
            WSlice::Quant(..) => unreachable!("`usable` refuses block formats"),
        }
    }

    /// Blocks between a prefetch and its use: the K pass asks for its blocks into L2
    /// this far ahead, and over its last blocks for the V pass's first; the V pass then
    /// asks for the rest of its own. Measured with caches of written values from DRAM
    /// (the kernel bench's `decode-attention`, Zen 4, 2 threads), 1 x 2,048 tokens: L1
    /// prefetches 1 or 4 blocks ahead 0.27-0.29 ms, none 0.31-0.32; L2 prefetches 1
    /// ahead 0.21, 4 ahead 0.19-0.20, 8 ahead 0.21, 16 ahead 0.28; all of V asked for
    /// during the K pass 0.24-0.25. Three runs in turns: the kernel before (L1, one
    /// ahead) 0.30-0.32 ms against 0.22-0.27 with each pass asking 4 ahead for itself;
    /// that against the K pass also asking for V's first blocks, 0.218-0.223 against
    /// 0.205-0.222, and at 8,192 tokens 0.97-1.08 against 0.88-0.90 (before: 1.16-1.37).
    const AHEAD: usize = 4;

    /// One part of a decode: tokens `start..end` (`start` on a block boundary) of kv
    /// head `kvh`, in the cache blocks `table` of its sequence.
    pub struct Part<'a> {
        pub kv: &'a KvView<'a>,
        pub table: &'a [i32],
        pub kvh: usize,
        pub start: usize,
        pub end: usize,
    }

    impl Part<'_> {
        /// Calls `f(block, rows, off)` for the part's cache blocks in order, `off` being
        /// the block's first token less `start`. Each block's rows of `fetch` (if any)
        /// are asked into L2 [`AHEAD`] blocks before `f` reaches it (the first `AHEAD`
        /// at the start unless `asked`: a pass before this one asked for them), and over
        /// the last `AHEAD` blocks the first ones of `then`, the next pass's tensor.
        #[inline(always)]
        fn blocks(
            &self,
            fetch: Option<WSlice>,
            asked: bool,
            then: Option<WSlice>,
            mut f: impl FnMut(usize, usize, usize),
        ) {
            let (g, start, end) = (&self.kv.geom, self.start, self.end);
            let bs = g.block_size;
            let ask = |at: usize| {
                let (src, at) = if at < end { (fetch, at) } else { (then, start + (at - end)) };
                if let Some(src) = src.filter(|_| at < end) {
                    g.prefetch_head_rows(src, self.table[at / bs] as usize, self.kvh, bs.min(end - at), CacheLevel::L2);
                }
            };
            if !asked {
                for b in 0..AHEAD {
                    ask(start + b * bs);
                }
            }
            let mut pos = self.start;
            while pos < end {
                ask(pos + AHEAD * bs);
                f(self.table[pos / bs] as usize, bs.min(end - pos), pos - self.start);
                pos += bs;
            }
        }
    }

    /// 16 values of type `DT` at `p` as f32.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16<const DT: u8>(p: *const u8) -> __m512 {
        // SAFETY: the caller passes 16 readable elements of type DT.
        unsafe {
            match DT {
                F32 => _mm512_loadu_ps(p.cast()),
                F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
                _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast())))),
            }
        }
    }

    /// Calls `$f::<DT, HV, G>` for the cache's storage type and head size, with `G`
    /// heads per chunk (`G` heads of `HV` vectors: at most 16 accumulator registers).
    macro_rules! dispatch {
        ($f:ident, $w:expr, $hd:expr, ($($arg:expr),*)) => {{
            let (base, dt, es) = storage($w);
            macro_rules! go {
                ($dt:expr) => {
                    match $hd / 16 {
                        1 => $f::<$dt, 1, 8>(base, es, $($arg),*),
                        2 => $f::<$dt, 2, 8>(base, es, $($arg),*),
                        3 => $f::<$dt, 3, 4>(base, es, $($arg),*),
                        4 => $f::<$dt, 4, 4>(base, es, $($arg),*),
                        5 => $f::<$dt, 5, 2>(base, es, $($arg),*),
                        6 => $f::<$dt, 6, 2>(base, es, $($arg),*),
                        7 => $f::<$dt, 7, 2>(base, es, $($arg),*),
                        _ => $f::<$dt, 8, 2>(base, es, $($arg),*),
                    }
                };
            }
            match dt {
                F32 => go!(F32),
                F16 => go!(F16),
                _ => go!(BF16),
            }
        }};
    }

    /// `scores[gi * n + t] = q_gi · k[start + t] * scale` for the group's heads (`qh`,
    /// `[group][head_dim]`) over tokens `start..end` (`n` of them) of kv head `kvh`.
    ///
    /// # Safety
    /// [`usable`] holds for the part's cache; its `table` covers every block of tokens
    /// `0..end` with entries validated against the cache; `qh` holds `group` heads and
    /// `scores` `group * n` values (`group = qh.len() / head_dim`).
    pub unsafe fn scores(part: &Part, qh: &[f32], scale: f32, scores: &mut [f32]) {
        // SAFETY: forwarded contract.
        unsafe { dispatch!(scores_pass, part.kv.k, part.kv.geom.head_dim, (part, qh, scale, scores)) }
    }

    /// `acc[gi] = Σ_t p[gi * n + t] · v[start + t]` for the group's heads over tokens
    /// `start..end` of kv head `kvh` (`acc`: `[group][head_dim]`, overwritten).
    ///
    /// # Safety
    /// As [`scores`], with `p` holding `group * n` values and `acc` `group` heads.
    pub unsafe fn values(part: &Part, p: &[f32], acc: &mut [f32]) {
        // SAFETY: forwarded contract.
        unsafe { dispatch!(values_pass, part.kv.v, part.kv.geom.head_dim, (part, p, acc)) }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn scores_pass<const DT: u8, const HV: usize, const G: usize>(
        base: *const u8,
        es: usize,
        part: &Part,
        qh: &[f32],
        scale: f32,
        scores: &mut [f32],
    ) {
        let (g, kvh) = (part.kv.geom, part.kvh);
        let hd = g.head_dim;
        let (n, group) = (part.end - part.start, qh.len() / hd);
        debug_assert!(hd == 16 * HV && scores.len() >= group * n);
        let sp = scores.as_mut_ptr();
        // SAFETY: (whole function) token rows are read at cache indices from
        // `g.index` of validated blocks, each `hd` elements long; queries at
        // `(g0 + c) * hd + 16 * i < group * hd`; scores at `(g0 + c) * n + t < group * n`.
        unsafe {
            for g0 in (0..group).step_by(G) {
                let gc = G.min(group - g0);
                let q: [[__m512; HV]; G] = std::array::from_fn(|c| {
                    std::array::from_fn(|i| {
                        if c < gc {
                            _mm512_loadu_ps(qh.as_ptr().add((g0 + c) * hd + 16 * i))
                        } else {
                            _mm512_setzero_ps()
                        }
                    })
                });
                let first = g0 == 0;
                part.blocks(first.then_some(part.kv.k), false, first.then_some(part.kv.v), |block, rows, off| {
                    let mut r = 0;
                    // Four tokens at a time where their rows fit in registers: each head's
                    // four dot products are reduced together.
                    while HV <= 4 && r + 4 <= rows {
                        let k: [[__m512; HV]; 4] = std::array::from_fn(|j| {
                            let row = base.add(g.index(block, kvh, r + j) * es);
                            std::array::from_fn(|i| load16::<DT>(row.add(16 * i * es)))
                        });
                        for (c, qc) in q.iter().enumerate() {
                            if c < gc {
                                let a: [__m512; 4] = std::array::from_fn(|j| dot(&k[j], qc));
                                let sums = _mm_mul_ps(reduce4(a), _mm_set1_ps(scale));
                                _mm_storeu_ps(sp.add((g0 + c) * n + off + r), sums);
                            }
                        }
                        r += 4;
                    }
                    for r in r..rows {
                        let row = base.add(g.index(block, kvh, r) * es);
                        let k: [__m512; HV] = std::array::from_fn(|i| load16::<DT>(row.add(16 * i * es)));
                        for (c, qc) in q.iter().enumerate() {
                            if c < gc {
                                let a = dot(&k, qc);
                                // The four-token reduction's lane 0: a token's score
                                // never depends on which tokens share its block, so
                                // caches of other block sizes give the same bits.
                                *sp.add((g0 + c) * n + off + r) = _mm_cvtss_f32(reduce4([a; 4])) * scale;
                            }
                        }
                    }
                });
            }
        }
    }

    /// The lane products of a K row and a query, summed over the row's vectors (one
    /// vector of partial dot products).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn dot<const HV: usize>(k: &[__m512; HV], q: &[__m512; HV]) -> __m512 {
        let mut a = _mm512_mul_ps(k[0], q[0]);
        for i in 1..HV {
            a = _mm512_fmadd_ps(k[i], q[i], a);
        }
        a
    }

    /// The lane sums of four vectors, as the four lanes of one.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn reduce4(a: [__m512; 4]) -> __m128 {
        let half = |v: __m512| {
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
            _mm256_add_ps(_mm512_castps512_ps256(v), hi)
        };
        let (h01, h23) = (_mm256_hadd_ps(half(a[0]), half(a[1])), _mm256_hadd_ps(half(a[2]), half(a[3])));
        let h = _mm256_hadd_ps(h01, h23);
        _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h))
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn values_pass<const DT: u8, const HV: usize, const G: usize>(
        base: *const u8,
        es: usize,
        part: &Part,
        p: &[f32],
        acc_out: &mut [f32],
    ) {
        let (g, kvh) = (part.kv.geom, part.kvh);
        let hd = g.head_dim;
        let (n, group) = (part.end - part.start, acc_out.len() / hd);
        debug_assert!(hd == 16 * HV && p.len() >= group * n);
        let pp = p.as_ptr();
        // SAFETY: (whole function) as in `scores_pass`; weights at `(g0 + c) * n + t`,
        // accumulators stored at `(g0 + c) * hd + 16 * i < group * hd`.
        unsafe {
            for g0 in (0..group).step_by(G) {
                let gc = G.min(group - g0);
                let mut acc = [[_mm512_setzero_ps(); HV]; G];
                part.blocks((g0 == 0).then_some(part.kv.v), true, None, |block, rows, off| {
                    for r in 0..rows {
                        let row = base.add(g.index(block, kvh, r) * es);
                        let v: [__m512; HV] = std::array::from_fn(|i| load16::<DT>(row.add(16 * i * es)));
                        for (c, ac) in acc.iter_mut().enumerate() {
                            if c < gc {
                                let w = _mm512_set1_ps(*pp.add((g0 + c) * n + off + r));
                                for i in 0..HV {
                                    ac[i] = _mm512_fmadd_ps(w, v[i], ac[i]);
                                }
                            }
                        }
                    }
                });
                for (c, ac) in acc.iter().enumerate().take(gc) {
                    for (i, a) in ac.iter().enumerate() {
                        _mm512_storeu_ps(acc_out.as_mut_ptr().add((g0 + c) * hd + 16 * i), *a);
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use crate::simd::x86::{exp8, hsum};
    use std::arch::x86_64::*;

    /// See `dots`: eight key rows at a time, their sums reduced together. A row's eight
    /// lanes are summed in the same order either way, ((0+1)+(2+3))+((4+5)+(6+7)), so a
    /// score does not depend on where its row falls in a block: the same context in
    /// blocks of another size gives the same bits.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dots(q: &[f32], k: &[f32], scale: f32, out: &mut [f32]) {
        let hd = q.len();
        let rows = out.len();
        assert!(hd.is_multiple_of(8) && k.len() >= rows * hd);
        let (qp, kp) = (q.as_ptr(), k.as_ptr());
        let mut r = 0;
        // SAFETY: (whole function) every load reads 8 floats at an offset i < hd (a
        // multiple of 8) of q or of a row r' < rows of k, inside both by the assert.
        unsafe {
            while r + 8 <= rows {
                let mut a = [_mm256_setzero_ps(); 8];
                let mut i = 0;
                while i < hd {
                    let qv = _mm256_loadu_ps(qp.add(i));
                    for (j, aj) in a.iter_mut().enumerate() {
                        *aj = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp.add((r + j) * hd + i)), *aj);
                    }
                    i += 8;
                }
                let u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
                let u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
                let sums = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
                _mm256_storeu_ps(out.as_mut_ptr().add(r), _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
                r += 8;
            }
            while r < rows {
                let mut a = _mm256_setzero_ps();
                let mut i = 0;
                while i < hd {
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(i)), _mm256_loadu_ps(kp.add(r * hd + i)), a);
                    i += 8;
                }
                let h = _mm256_hadd_ps(a, a);
                let h = _mm256_hadd_ps(h, h);
                let sum = _mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
                out[r] = _mm_cvtss_f32(sum) * scale;
                r += 1;
            }
        }
    }

    /// See `exp_shifted`, with `simd::x86::exp8`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_shifted(row: &mut [f32], max: f32) -> f32 {
        let n = row.len();
        let mut total = _mm256_setzero_ps();
        let m = _mm256_set1_ps(max);
        let mut i = 0;
        // SAFETY: i + 8 <= n = row.len().
        unsafe {
            while i + 8 <= n {
                let p = row.as_mut_ptr().add(i);
                let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p), m));
                _mm256_storeu_ps(p, e);
                total = _mm256_add_ps(total, e);
                i += 8;
            }
        }
        // SAFETY: AVX2 and FMA are enabled here.
        let mut sum = unsafe { hsum(total) };
        for x in &mut row[i..] {
            *x = (*x - max).exp();
            sum += *x;
        }
        sum
    }

    /// See `weighted_sum`: the accumulators stay in registers over a block's rows.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn weighted_sum(p: &[f32], v: &[f32], acc: &mut [f32]) {
        let hd = acc.len();
        let rows = p.len();
        assert!(hd.is_multiple_of(8) && v.len() >= rows * hd);
        let mut i = 0;
        while i < hd {
            // SAFETY: i + 8 <= hd; every row r < rows of v holds hd floats by the assert.
            unsafe {
                let ap = acc.as_mut_ptr().add(i);
                let mut a = _mm256_loadu_ps(ap);
                for (r, &w) in p.iter().enumerate() {
                    a = _mm256_fmadd_ps(_mm256_set1_ps(w), _mm256_loadu_ps(v.as_ptr().add(r * hd + i)), a);
                }
                _mm256_storeu_ps(ap, a);
            }
            i += 8;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::WSliceMut;
    use crate::ops::misc::{KvLayout, fill_kv_cache};
    use crate::ops::testutil::*;
    use half::{bf16, f16};
    use proptest::prelude::*;

    /// Contiguous reference: k, v per seq as [ctx][kvh][hd] (already rounded to the
    /// cache dtype), q [total_q][h][hd].
    #[allow(clippy::too_many_arguments)]
    fn naive(
        q: &[f32],
        ks: &[Vec<f32>],
        vs: &[Vec<f32>],
        qstart: &[i32],
        ctx: &[i32],
        h: usize,
        kvh: usize,
        hd: usize,
        scale: f32,
    ) -> Vec<f32> {
        let total_q = *qstart.last().unwrap() as usize;
        let mut out = vec![0.0; total_q * h * hd];
        let g = h / kvh;
        for s in 0..ctx.len() {
            let (q0, q1, c) = (qstart[s] as usize, qstart[s + 1] as usize, ctx[s] as usize);
            for t in q0..q1 {
                let pos = c - (q1 - q0) + (t - q0);
                for hh in 0..h {
                    let kh = hh / g;
                    let qv = &q[(t * h + hh) * hd..][..hd];
                    let sc: Vec<f64> = (0..=pos)
                        .map(|j| {
                            let kv = &ks[s][(j * kvh + kh) * hd..][..hd];
                            qv.iter().zip(kv).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale as f64
                        })
                        .collect();
                    let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    for d in 0..hd {
                        let mut acc = 0.0;
                        for j in 0..=pos {
                            acc += e[j] / sum * vs[s][(j * kvh + kh) * hd + d] as f64;
                        }
                        out[(t * h + hh) * hd + d] = acc as f32;
                    }
                }
            }
        }
        out
    }

    struct Case {
        h: usize,
        kvh: usize,
        hd: usize,
        bs: usize,
        ctx: Vec<i32>,
        qlen: Vec<i32>,
        dtype: u8,
        layout: KvLayout,
        seed: u64,
    }

    fn run(c: &Case) {
        let mut rng = Rng(c.seed | 1);
        let ns = c.ctx.len();
        let mbps = c.ctx.iter().map(|&x| (x as usize).div_ceil(c.bs)).max().unwrap_or(0).max(1) + 1;
        let num_blocks = ns * mbps + 3;
        let geom = KvGeom { num_blocks, block_size: c.bs, num_kv_heads: c.kvh, head_dim: c.hd, layout: c.layout };
        // Random permutation of blocks for the block tables.
        let mut perm: Vec<i32> = (0..num_blocks as i32).collect();
        for i in (1..perm.len()).rev() {
            perm.swap(i, rng.below(i + 1));
        }
        let tables: Vec<i32> = perm[..ns * mbps].to_vec();
        let total = geom.elems().unwrap();
        let (mut k32, mut v32) = (vec![0.0f32; total], vec![0.0f32; total]);
        let (mut k16, mut v16) = (vec![f16::ZERO; total], vec![f16::ZERO; total]);
        let (mut kb, mut vb) = (vec![bf16::ZERO; total], vec![bf16::ZERO; total]);
        let (mut kc, mut vc) = match c.dtype {
            0 => (WSliceMut::F32(&mut k32), WSliceMut::F32(&mut v32)),
            1 => (WSliceMut::F16(&mut k16), WSliceMut::F16(&mut v16)),
            _ => (WSliceMut::Bf16(&mut kb), WSliceMut::Bf16(&mut vb)),
        };
        let round = |x: f32| match c.dtype {
            0 => x,
            1 => f16::from_f32(x).to_f32(),
            _ => bf16::from_f32(x).to_f32(),
        };
        let (mut ks, mut vs) = (vec![], vec![]);
        for s in 0..ns {
            let n = c.ctx[s] as usize;
            let k = rng.vec(n * c.kvh * c.hd);
            let v = rng.vec(n * c.kvh * c.hd);
            let slots: Vec<i32> =
                (0..n).map(|p| tables[s * mbps + p / c.bs] * c.bs as i32 + (p % c.bs) as i32).collect();
            fill_kv_cache(&mut kc, &mut vc, &geom, &k, &v, &slots, n).unwrap();
            ks.push(k.iter().map(|&x| round(x)).collect::<Vec<_>>());
            vs.push(v.iter().map(|&x| round(x)).collect::<Vec<_>>());
        }
        let kv = match (&kc, &vc) {
            (WSliceMut::F32(a), WSliceMut::F32(b)) => (WSlice::F32(a), WSlice::F32(b)),
            (WSliceMut::F16(a), WSliceMut::F16(b)) => (WSlice::F16(a), WSlice::F16(b)),
            (WSliceMut::Bf16(a), WSliceMut::Bf16(b)) => (WSlice::Bf16(a), WSlice::Bf16(b)),
            _ => unreachable!(),
        };
        let view = KvView { k: kv.0, v: kv.1, geom };
        let mut qstart = vec![0i32];
        for &l in &c.qlen {
            qstart.push(qstart.last().unwrap() + l);
        }
        let total_q = *qstart.last().unwrap() as usize;
        let q = rng.vec(total_q * c.h * c.hd);
        let scale = 1.0 / (c.hd as f32).sqrt();
        let mut out = vec![0.0; total_q * c.h * c.hd];
        prefill_attention(&mut out, &q, &view, &qstart, &c.ctx, &tables, mbps, total_q, c.h, scale).unwrap();
        let want = naive(&q, &ks, &vs, &qstart, &c.ctx, c.h, c.kvh, c.hd, scale);
        assert_close(&out, &want, 1e-4, "prefill vs naive");

        // Decode: one query per sequence over its whole context.
        let dq = rng.vec(ns * c.h * c.hd);
        let mut dout = vec![0.0; ns * c.h * c.hd];
        paged_decode_attention(&mut dout, &dq, &view, &tables, &c.ctx, ns, mbps, c.h, scale).unwrap();
        let ones: Vec<i32> = (0..=ns as i32).collect();
        let dwant = naive(&dq, &ks, &vs, &ones, &c.ctx, c.h, c.kvh, c.hd, scale);
        assert_close(&dout, &dwant, 1e-4, "decode vs naive");
    }

    #[test]
    fn prefill_and_decode_match_naive() {
        for layout in [KvLayout::HeadMajor, KvLayout::TokenMajor] {
            for dtype in 0..3 {
                for &(h, kvh) in &[(2, 2), (4, 2), (8, 2)] {
                    for &bs in &[1, 4, 16] {
                        run(&Case {
                            h,
                            kvh,
                            hd: 16,
                            bs,
                            // A full prefill, a chunked prefill over earlier context, a
                            // single-token step.
                            ctx: vec![19, 40, 7],
                            qlen: vec![19, 13, 1],
                            dtype,
                            layout,
                            seed: (dtype as u64) * 100 + h as u64 * 10 + bs as u64,
                        });
                    }
                }
            }
            // A long sequence crossing several query tiles.
            run(&Case { h: 4, kvh: 1, hd: 64, bs: 16, ctx: vec![150], qlen: vec![130], dtype: 0, layout, seed: 5 });
            // Prompts whose tiles sweep their keys in several steps (the running softmax
            // rescaled as later steps raise a row's maximum), one a chunk after cached
            // context, one whole; the portable path (head_dim 12) and the SIMD one.
            for (hd, dtype) in [(64, 0), (12, 1)] {
                let (ctx, qlen) = (vec![700, 530], vec![300, 530]);
                run(&Case { h: 6, kvh: 2, hd, bs: 16, ctx, qlen, dtype, layout, seed: 11 });
            }
            // Decodes over several parts of context (the SIMD path at head_dim 64, the
            // portable one at 12, whose block size does not divide a part).
            for (hd, bs, dtype) in [(64, 16, 0), (64, 16, 1), (12, 5, 2)] {
                let ctx = vec![700, 256, 257, 3];
                run(&Case { h: 6, kvh: 2, hd, bs, ctx, qlen: vec![1, 1, 1, 1], dtype, layout, seed: 9 });
            }
            // The AVX-512 decode kernel's other shapes: heads of 48 and 128 values (3 and
            // 8 vectors), groups of 8 split into chunks of registers, blocks of 5 (four
            // tokens at a time, then one).
            for (hd, bs, dtype) in [(128, 16, 1), (48, 5, 2), (128, 5, 0)] {
                let ctx = vec![300, 9, 1];
                run(&Case { h: 8, kvh: 1, hd, bs, ctx, qlen: vec![1, 1, 1], dtype, layout, seed: 13 });
            }
        }
    }

    #[test]
    fn decode_is_bit_identical_across_block_sizes_and_layouts() {
        // A disaggregated decode chip may hold the same context in blocks of another size
        // and layout; its result must be the same bits (f32 cache: the transfer is exact).
        let (h, kvh, hd, ctx) = (8usize, 2usize, 64usize, 23usize);
        let mut rng = Rng(31);
        let (k, v, q) = (rng.vec(ctx * kvh * hd), rng.vec(ctx * kvh * hd), rng.vec(h * hd));
        let mut outs = Vec::new();
        for (bs, layout) in [(4, KvLayout::HeadMajor), (3, KvLayout::TokenMajor), (16, KvLayout::HeadMajor)] {
            let blocks = ctx.div_ceil(bs);
            let geom = KvGeom { num_blocks: blocks, block_size: bs, num_kv_heads: kvh, head_dim: hd, layout };
            let (mut kc, mut vc) = (vec![0.0f32; geom.elems().unwrap()], vec![0.0f32; geom.elems().unwrap()]);
            let table: Vec<i32> = (0..blocks as i32).rev().collect();
            let slots: Vec<i32> = (0..ctx).map(|p| table[p / bs] * bs as i32 + (p % bs) as i32).collect();
            fill_kv_cache(&mut WSliceMut::F32(&mut kc), &mut WSliceMut::F32(&mut vc), &geom, &k, &v, &slots, ctx)
                .unwrap();
            let view = KvView { k: WSlice::F32(&kc), v: WSlice::F32(&vc), geom };
            let mut out = vec![0.0f32; h * hd];
            paged_decode_attention(&mut out, &q, &view, &table, &[ctx as i32], 1, blocks, h, 0.125).unwrap();
            outs.push(out);
        }
        assert!(outs.iter().all(|o| o.iter().map(|x| x.to_bits()).eq(outs[0].iter().map(|x| x.to_bits()))));
    }

    #[test]
    fn bad_batches_are_refused() {
        let geom = KvGeom { num_blocks: 2, block_size: 4, num_kv_heads: 1, head_dim: 4, layout: KvLayout::HeadMajor };
        let k = vec![0.0f32; 32];
        let view = KvView { k: WSlice::F32(&k), v: WSlice::F32(&k), geom };
        let q = vec![0.0f32; 16];
        let mut out = vec![0.0f32; 16];
        let e = prefill_attention(&mut out, &q, &view, &[0, 4], &[4], &[2, 0], 2, 4, 1, 1.0).unwrap_err();
        assert!(e.to_string().contains("block_tables[0][0] = 2"), "{e}");
        let e = prefill_attention(&mut out, &q, &view, &[0, 4], &[9], &[0, 1], 2, 4, 1, 1.0).unwrap_err();
        assert!(e.to_string().contains("context_lens[0] = 9"), "{e}");
        let e = prefill_attention(&mut out, &q, &view, &[0, 4], &[3], &[0, 1], 2, 4, 1, 1.0).unwrap_err();
        assert!(e.to_string().contains("4 queries"), "{e}");
        let e = prefill_attention(&mut out, &q, &view, &[0, 5], &[5], &[0, 1], 2, 4, 1, 1.0).unwrap_err();
        assert!(e.to_string().contains("exceeds total_q"), "{e}");
        let e = paged_decode_attention(&mut out, &q, &view, &[0, -1], &[5], 1, 2, 1, 1.0).unwrap_err();
        assert!(e.to_string().contains("block_tables[0][1] = -1"), "{e}");
        let g2 = KvGeom { num_blocks: 2, block_size: 4, num_kv_heads: 2, head_dim: 2, layout: KvLayout::TokenMajor };
        let view2 = KvView { k: WSlice::F32(&k), v: WSlice::F32(&k), geom: g2 };
        let e = paged_decode_attention(&mut out, &q, &view2, &[0, 1], &[4], 1, 2, 3, 1.0).unwrap_err();
        assert!(e.to_string().contains("must be a positive multiple"), "{e}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn prefill_decode_naive_random(
            ratio in prop::sample::select(vec![1usize, 2, 4]),
            kvh in 1usize..3,
            hd in prop::sample::select(vec![4usize, 8, 12, 32]),
            bs in prop::sample::select(vec![1usize, 4, 16]),
            seqs in prop::collection::vec((1i32..40, 0i32..40), 1..4),
            dtype in 0u8..3,
            token_major in any::<bool>(),
            seed in any::<u64>(),
        ) {
            let ctx: Vec<i32> = seqs.iter().map(|&(c, _)| c).collect();
            let qlen: Vec<i32> = seqs.iter().map(|&(c, q)| q.min(c)).collect();
            let layout = if token_major { KvLayout::TokenMajor } else { KvLayout::HeadMajor };
            run(&Case { h: kvh * ratio, kvh, hd, bs, ctx, qlen, dtype, layout, seed });
        }
    }
}
