//! Causal GQA attention over the paged KV cache: varlen (chunked) prefill with `gemm`
//! on gathered K/V, and a block-streaming decode kernel.

use gemm::Parallelism;
use rayon::prelude::*;

use super::misc::KvGeom;
use super::{SendPtr, Strided, matmul};
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

/// Query rows per score tile.
const TQ: usize = 64;

/// Softmax of `row[..valid]` in place (max-subtracted), zeroing `row[valid..]`.
fn softmax_prefix(row: &mut [f32], valid: usize) {
    let (a, b) = row.split_at_mut(valid);
    let max = a.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for x in a.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
    for x in a.iter_mut() {
        *x *= inv;
    }
    b.fill(0.0);
}

/// Prefill attention; see `tk_prefill_attention`. The batch must have been validated.
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
        let tiles = ql.div_ceil(TQ);
        (0..group * tiles).into_par_iter().for_each_init(Vec::new, |scores, item| {
            let h = kvh * group + item / tiles;
            let t0 = (item % tiles) * TQ;
            let tq = TQ.min(ql - t0);
            // Keys visible to the last query of the tile.
            let kv_len = ctx - ql + t0 + tq;
            scores.resize(tq * kv_len, 0.0);
            let qp = q[(q0 + t0) * row_stride + h * hd..].as_ptr();
            // SAFETY: lhs is tq query rows of head h (row stride num_heads*hd, each hd
            // long, inside q by the assert above); rhs(kk, j) = kbuf[j*hd + kk] for
            // j < kv_len <= ctx; dst is the tq x kv_len scores buffer.
            unsafe {
                matmul(
                    tq,
                    kv_len,
                    hd,
                    Strided { ptr: scores.as_mut_ptr(), rs: kv_len as isize, cs: 1 },
                    Strided { ptr: qp, rs: row_stride as isize, cs: 1 },
                    Strided { ptr: kbuf.as_ptr(), rs: 1, cs: hd as isize },
                    scale,
                    Parallelism::None,
                )
            };
            for r in 0..tq {
                let valid = ctx - ql + t0 + r + 1;
                softmax_prefix(&mut scores[r * kv_len..(r + 1) * kv_len], valid);
            }
            // SAFETY: dst is rows q0+t0 .. q0+t0+tq, head h of out: written only by
            // this task (each (seq, head, tile) is one task); rhs(j, d) = vbuf[j*hd + d].
            unsafe {
                matmul(
                    tq,
                    hd,
                    kv_len,
                    Strided { ptr: optr.get().add((q0 + t0) * row_stride + h * hd), rs: row_stride as isize, cs: 1 },
                    Strided { ptr: scores.as_ptr(), rs: kv_len as isize, cs: 1 },
                    Strided { ptr: vbuf.as_ptr(), rs: hd as isize, cs: 1 },
                    1.0,
                    Parallelism::None,
                )
            };
        });
    });
    Ok(())
}

/// Walks the first `ctx` cached tokens of kv head `kvh` block by block, handing `f`
/// each block's rows as f32 (in `buf`) with the position of its first token.
fn for_each_block(
    src: WSlice,
    g: &KvGeom,
    table: &[i32],
    kvh: usize,
    ctx: usize,
    buf: &mut [f32],
    mut f: impl FnMut(usize, &[f32]),
) {
    let mut pos = 0;
    while pos < ctx {
        let rows = g.block_size.min(ctx - pos);
        let b = &mut buf[..rows * g.head_dim];
        g.read_head_rows(src, table[pos / g.block_size] as usize, kvh, rows, b);
        f(pos, b);
        pos += rows;
    }
}

/// Decode attention: one query per sequence attending to all its cached tokens.
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
    // out[s][kvh*group .. (kvh+1)*group][hd] is contiguous: one chunk per (s, kvh).
    out[..num_seqs * num_heads * hd].par_chunks_mut(group * hd).enumerate().for_each(|(idx, o)| {
        let (s, kvh) = (idx / g.num_kv_heads, idx % g.num_kv_heads);
        let ctx = context_lens[s] as usize;
        let table = &block_tables[s * max_blocks_per_seq..(s + 1) * max_blocks_per_seq];
        let qh = &q[(s * num_heads + kvh * group) * hd..][..group * hd];
        let mut scores = vec![0.0f32; group * ctx];
        let mut buf = vec![0.0f32; g.block_size * hd];
        for_each_block(kv.k, &g, table, kvh, ctx, &mut buf, |pos, b| {
            for (gi, qv) in qh.chunks_exact(hd).enumerate() {
                for (r, krow) in b.chunks_exact(hd).enumerate() {
                    scores[gi * ctx + pos + r] = crate::simd::dot(qv, krow) * scale;
                }
            }
        });
        if ctx > 0 {
            for row in scores.chunks_exact_mut(ctx) {
                softmax_prefix(row, ctx);
            }
        }
        o.fill(0.0);
        for_each_block(kv.v, &g, table, kvh, ctx, &mut buf, |pos, b| {
            for (gi, acc) in o.chunks_exact_mut(hd).enumerate() {
                for (r, vrow) in b.chunks_exact(hd).enumerate() {
                    crate::simd::axpy(scores[gi * ctx + pos + r], vrow, acc);
                }
            }
        });
    });
    Ok(())
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
        }
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
