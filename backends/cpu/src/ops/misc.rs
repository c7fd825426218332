//! Embedding lookup, SiLU-and-mul, KV-cache fill, argmax and log-softmax.

use rayon::prelude::*;

use crate::dtype::{WSlice, WSliceMut};
use crate::error::Result;
use crate::invalid;

/// `out[i, :] = table[ids[i], :]` as f32.
pub fn embedding(out: &mut [f32], table: WSlice, ids: &[i32], n: usize, hidden: usize, vocab: usize) -> Result<()> {
    for (i, &id) in ids[..n].iter().enumerate() {
        if id < 0 || id as usize >= vocab {
            return Err(invalid!("ids[{i}] = {id} is out of range for vocab = {vocab}"));
        }
    }
    if hidden == 0 {
        return Ok(());
    }
    out[..n * hidden]
        .par_chunks_mut(hidden)
        .zip(ids[..n].par_iter())
        .for_each(|(o, &id)| table.to_f32(id as usize * hidden, o));
    Ok(())
}

/// `out = silu(gate) * up`, elementwise.
pub fn silu_and_mul(out: &mut [f32], gate: &[f32], up: &[f32]) {
    const CHUNK: usize = 16384;
    out.par_chunks_mut(CHUNK).zip(gate.par_chunks(CHUNK)).zip(up.par_chunks(CHUNK)).for_each(|((o, g), u)| {
        #[cfg(target_arch = "x86_64")]
        if crate::simd::has_avx2() {
            // SAFETY: AVX2 and FMA were detected.
            unsafe { crate::simd::x86::silu_and_mul(o, g, u) };
            return;
        }
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
    });
}

/// How a KV block orders its tokens and heads (`TK_KV_LAYOUT_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvLayout {
    /// `[num_kv_heads][block_size][head_dim]`: one head's tokens are contiguous.
    HeadMajor,
    /// `[block_size][num_kv_heads][head_dim]`: one token's heads are contiguous.
    TokenMajor,
}

impl KvLayout {
    /// Parses `tk_kv_cache.layout`; an unknown value is refused, never guessed.
    pub fn from_abi(code: u32) -> Result<KvLayout> {
        match code {
            tessera_kernel_abi::TK_KV_LAYOUT_HEAD_MAJOR => Ok(KvLayout::HeadMajor),
            tessera_kernel_abi::TK_KV_LAYOUT_TOKEN_MAJOR => Ok(KvLayout::TokenMajor),
            _ => Err(invalid!("cache.layout = {code} is unknown (expected 0 = head-major, 1 = token-major)")),
        }
    }
}

/// The cache a prefetch asks lines into: L1 for what the next few hundred
/// instructions read, L2 for lines asked for further ahead (more of them can be in
/// flight, and they do not evict the data being worked on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheLevel {
    L1,
    L2,
}

/// Geometry of one layer's paged KV cache.
#[derive(Debug, Clone, Copy)]
pub struct KvGeom {
    pub num_blocks: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub layout: KvLayout,
}

impl KvGeom {
    /// Elements in each of k and v.
    pub fn elems(&self) -> Option<usize> {
        self.num_blocks.checked_mul(self.block_size)?.checked_mul(self.num_kv_heads)?.checked_mul(self.head_dim)
    }

    /// Element index of (block, kv head, offset in block, 0).
    #[inline]
    pub fn index(&self, block: usize, head: usize, off: usize) -> usize {
        match self.layout {
            KvLayout::HeadMajor => ((block * self.num_kv_heads + head) * self.block_size + off) * self.head_dim,
            KvLayout::TokenMajor => ((block * self.block_size + off) * self.num_kv_heads + head) * self.head_dim,
        }
    }

    /// Asks the CPU to start loading `rows` tokens of kv head `head` of `block` (from
    /// offset 0) into its caches, `into` L1 or only L2: a paged cache's blocks lie
    /// apart, so the hardware prefetcher, which follows one run at a time, stalls at
    /// every block boundary. Only a hint: it changes no result.
    #[inline]
    pub fn prefetch_head_rows(&self, src: WSlice, block: usize, head: usize, rows: usize, into: CacheLevel) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_MM_HINT_T0, _MM_HINT_T1, _mm_prefetch};
            let (base, es) = match src {
                WSlice::F32(s) => (s.as_ptr().cast::<u8>(), 4),
                WSlice::F16(s) => (s.as_ptr().cast::<u8>(), 2),
                WSlice::Bf16(s) => (s.as_ptr().cast::<u8>(), 2),
                WSlice::Quant(..) => return,
            };
            let row_bytes = self.head_dim * es;
            let (runs, run_bytes) = match self.layout {
                KvLayout::HeadMajor => (1, rows * row_bytes),
                KvLayout::TokenMajor => (rows, row_bytes),
            };
            for r in 0..runs {
                let start = base.wrapping_add(self.index(block, head, r) * es);
                for at in (0..run_bytes).step_by(64) {
                    // SAFETY: a prefetch only hints; it never faults, whatever the address.
                    unsafe {
                        let p = start.wrapping_add(at).cast::<i8>();
                        match into {
                            CacheLevel::L1 => _mm_prefetch::<_MM_HINT_T0>(p),
                            CacheLevel::L2 => _mm_prefetch::<_MM_HINT_T1>(p),
                        }
                    }
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (src, block, head, rows, into);
    }

    /// Converts `rows` consecutive tokens of kv head `head`, from offset 0 of `block`,
    /// to f32 `[rows][head_dim]` in `dst`: one run when head-major, row by row when
    /// token-major (a head's rows are `num_kv_heads * head_dim` apart there).
    #[inline]
    pub fn read_head_rows(&self, src: WSlice, block: usize, head: usize, rows: usize, dst: &mut [f32]) {
        let hd = self.head_dim;
        match self.layout {
            KvLayout::HeadMajor => src.to_f32(self.index(block, head, 0), &mut dst[..rows * hd]),
            KvLayout::TokenMajor => {
                for (r, d) in dst[..rows * hd].chunks_exact_mut(hd).enumerate() {
                    src.to_f32(self.index(block, head, r), d);
                }
            }
        }
    }
}

/// Writes k, v (`[n][num_kv_heads][head_dim]`) into the cache at `slots`.
pub fn fill_kv_cache(
    kc: &mut WSliceMut,
    vc: &mut WSliceMut,
    g: &KvGeom,
    k: &[f32],
    v: &[f32],
    slots: &[i32],
    n: usize,
) -> Result<()> {
    let total = g.num_blocks * g.block_size;
    for (i, &s) in slots[..n].iter().enumerate() {
        if s >= 0 && s as usize >= total {
            return Err(invalid!(
                "slot_mapping[{i}] = {s} is out of range: the cache has {} blocks of {} = {total} slots",
                g.num_blocks,
                g.block_size
            ));
        }
    }
    let hd = g.head_dim;
    for (t, &s) in slots[..n].iter().enumerate() {
        if s < 0 {
            continue;
        }
        let (blk, off) = (s as usize / g.block_size, s as usize % g.block_size);
        for h in 0..g.num_kv_heads {
            let src = (t * g.num_kv_heads + h) * hd;
            let dst = g.index(blk, h, off);
            kc.store_f32(dst, &k[src..src + hd]);
            vc.store_f32(dst, &v[src..src + hd]);
        }
    }
    Ok(())
}

/// Index of the maximum of `row` (lowest index on ties; NaNs are skipped).
pub fn argmax_row(row: &[f32]) -> i32 {
    let mut best = 0usize;
    let mut bv = f32::NEG_INFINITY;
    let mut found = false;
    for (i, &v) in row.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        if !found || v > bv {
            best = i;
            bv = v;
            found = true;
        }
    }
    best as i32
}

/// `out[i] = argmax(logits[i, :])`.
pub fn argmax(out: &mut [i32], logits: &[f32], n: usize, vocab: usize) {
    if vocab == 0 {
        out[..n].fill(0);
        return;
    }
    out[..n].par_iter_mut().zip(logits[..n * vocab].par_chunks(vocab)).for_each(|(o, r)| *o = argmax_row(r));
}

fn log_softmax_row(src: &[f32], dst: &mut [f32]) {
    let max = src.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = src.iter().map(|&x| (x - max).exp()).sum();
    let lse = max + sum.ln();
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = s - lse;
    }
}

fn log_softmax_row_inplace(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = row.iter().map(|&x| (x - max).exp()).sum();
    let lse = max + sum.ln();
    for x in row.iter_mut() {
        *x -= lse;
    }
}

/// `out = log_softmax(logits)` per row of `vocab`.
pub fn log_softmax(out: &mut [f32], logits: &[f32], n: usize, vocab: usize) {
    if vocab == 0 {
        return;
    }
    out[..n * vocab]
        .par_chunks_mut(vocab)
        .zip(logits[..n * vocab].par_chunks(vocab))
        .for_each(|(o, l)| log_softmax_row(l, o));
}

/// `log_softmax` in place (the case `out == logits`).
pub fn log_softmax_inplace(x: &mut [f32], n: usize, vocab: usize) {
    if vocab == 0 {
        return;
    }
    x[..n * vocab].par_chunks_mut(vocab).for_each(log_softmax_row_inplace);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::*;
    use half::{bf16, f16};

    #[test]
    fn embedding_all_dtypes() {
        let mut rng = Rng(11);
        let (vocab, hidden, n) = (37, 24, 9);
        let t32 = rng.vec(vocab * hidden);
        let t16: Vec<f16> = t32.iter().map(|&v| f16::from_f32(v)).collect();
        let tb: Vec<bf16> = t32.iter().map(|&v| bf16::from_f32(v)).collect();
        let ids: Vec<i32> = (0..n).map(|_| rng.below(vocab) as i32).collect();
        for t in [WSlice::F32(&t32), WSlice::F16(&t16), WSlice::Bf16(&tb)] {
            let tf = t.to_vec_f32();
            let mut out = vec![0.0; n * hidden];
            embedding(&mut out, t, &ids, n, hidden, vocab).unwrap();
            for (i, &id) in ids.iter().enumerate() {
                let id = id as usize;
                assert_eq!(&out[i * hidden..][..hidden], &tf[id * hidden..][..hidden]);
            }
        }
        let mut out = vec![0.0; hidden];
        let err = embedding(&mut out, WSlice::F32(&t32), &[37], 1, hidden, vocab).unwrap_err();
        assert!(err.to_string().contains("ids[0] = 37"), "{err}");
        assert!(embedding(&mut out, WSlice::F32(&t32), &[-1], 1, hidden, vocab).is_err());
    }

    #[test]
    fn silu_matches_naive() {
        let mut rng = Rng(5);
        // Several chunks and a tail shorter than a vector; gates far into both saturated
        // ends, and NaN passed through.
        let n = 40003;
        let mut g: Vec<f32> = rng.vec(n).iter().map(|v| v * 30.0).collect();
        g[..4].copy_from_slice(&[-120.0, 120.0, 0.0, -0.0]);
        let u = rng.vec(n);
        let mut out = vec![0.0; n];
        silu_and_mul(&mut out, &g, &u);
        let want: Vec<f32> =
            g.iter().zip(&u).map(|(&g, &u)| ((g as f64) / (1.0 + (-g as f64).exp()) * u as f64) as f32).collect();
        assert_close(&out, &want, 1e-5, "silu");
        g[7] = f32::NAN;
        silu_and_mul(&mut out, &g, &u);
        assert!(out[7].is_nan());
    }

    #[test]
    fn argmax_ties_and_nan() {
        let l = [1.0, 3.0, 3.0, f32::NAN, -1.0, 2.0, 2.0, 0.0];
        let mut out = [9; 2];
        argmax(&mut out, &l, 2, 4);
        assert_eq!(out, [1, 1]);
        assert_eq!(argmax_row(&[f32::NAN, 5.0, 5.0]), 1);
    }

    #[test]
    fn log_softmax_both_forms() {
        let mut rng = Rng(9);
        let (n, vocab) = (3, 1001);
        let l: Vec<f32> = rng.vec(n * vocab).iter().map(|v| v * 50.0).collect();
        let mut want = vec![0.0; n * vocab];
        for (r, w) in l.chunks(vocab).zip(want.chunks_mut(vocab)) {
            let m = r.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
            let s: f64 = r.iter().map(|&x| (x as f64 - m).exp()).sum();
            for (wi, &x) in w.iter_mut().zip(r) {
                *wi = (x as f64 - m - s.ln()) as f32;
            }
        }
        let mut out = vec![0.0; n * vocab];
        log_softmax(&mut out, &l, n, vocab);
        assert_close(&out, &want, 1e-5, "log_softmax");
        let mut inplace = l.clone();
        log_softmax_inplace(&mut inplace, n, vocab);
        assert_close(&inplace, &want, 1e-5, "log_softmax in place");
    }

    #[test]
    fn layout_codes_parse_and_unknown_is_refused() {
        assert_eq!(KvLayout::from_abi(0).unwrap(), KvLayout::HeadMajor);
        assert_eq!(KvLayout::from_abi(1).unwrap(), KvLayout::TokenMajor);
        let err = KvLayout::from_abi(7).unwrap_err().to_string();
        assert!(err.contains("cache.layout = 7 is unknown"), "{err}");
    }

    #[test]
    fn fill_kv_cache_all_dtypes_and_errors() {
        for layout in [KvLayout::HeadMajor, KvLayout::TokenMajor] {
            fill_kv_cache_case(layout);
        }
    }

    /// Where (block, head, offset) lives, written out independently of `KvGeom::index`.
    fn naive_index(layout: KvLayout, blk: usize, h: usize, off: usize) -> usize {
        // 2 kv heads, block size 4, head dim 8.
        match layout {
            KvLayout::HeadMajor => blk * 64 + h * 32 + off * 8,
            KvLayout::TokenMajor => blk * 64 + off * 16 + h * 8,
        }
    }

    fn fill_kv_cache_case(layout: KvLayout) {
        let mut rng = Rng(13);
        let g = KvGeom { num_blocks: 3, block_size: 4, num_kv_heads: 2, head_dim: 8, layout };
        let n = 5;
        let k = rng.vec(n * 2 * 8);
        let v = rng.vec(n * 2 * 8);
        let slots = [0, 11, -1, 5, 6];
        let total = g.elems().unwrap();
        let mut k32 = vec![0.0f32; total];
        let mut v32 = vec![0.0f32; total];
        let mut k16 = vec![f16::ZERO; total];
        let mut v16 = vec![f16::ZERO; total];
        let mut kb = vec![bf16::ZERO; total];
        let mut vb = vec![bf16::ZERO; total];
        let caches = vec![
            (WSliceMut::F32(&mut k32), WSliceMut::F32(&mut v32), 0.0f32),
            (WSliceMut::F16(&mut k16), WSliceMut::F16(&mut v16), 1e-3),
            (WSliceMut::Bf16(&mut kb), WSliceMut::Bf16(&mut vb), 1e-2),
        ];
        for (mut kc, mut vc, tol) in caches {
            fill_kv_cache(&mut kc, &mut vc, &g, &k, &v, &slots, n).unwrap();
            let err = fill_kv_cache(&mut kc, &mut vc, &g, &k, &v, &[12], 1).unwrap_err();
            assert!(err.to_string().contains("slot_mapping[0] = 12"), "{err}");
            let (kf, vf) = match (&kc, &vc) {
                (WSliceMut::F32(a), WSliceMut::F32(b)) => (a.to_vec(), b.to_vec()),
                (WSliceMut::F16(a), WSliceMut::F16(b)) => (WSlice::F16(a).to_vec_f32(), WSlice::F16(b).to_vec_f32()),
                (WSliceMut::Bf16(a), WSliceMut::Bf16(b)) => {
                    (WSlice::Bf16(a).to_vec_f32(), WSlice::Bf16(b).to_vec_f32())
                }
                _ => unreachable!(),
            };
            for (t, &s) in slots.iter().enumerate() {
                if s < 0 {
                    continue;
                }
                for h in 0..2 {
                    let d = naive_index(layout, s as usize / 4, h, s as usize % 4);
                    assert_eq!(d, g.index(s as usize / 4, h, s as usize % 4));
                    let src = (t * 2 + h) * 8;
                    assert_close(&kf[d..d + 8], &k[src..src + 8], tol, "k");
                    assert_close(&vf[d..d + 8], &v[src..src + 8], tol, "v");
                }
            }
            // Slot 1 (token skipped / never written) stays zero.
            assert!(kf[naive_index(layout, 0, 0, 1)..][..8].iter().all(|&x| x == 0.0));
        }
    }
}
