//! Linear layers on quantized weights for small batches (decode): the weights stay in
//! ggml's block formats and are read once per call, which is what makes a quantized
//! decode step cheaper than an f16 one — it moves a quarter of the bytes.
//!
//! As llama.cpp does, the activations are quantized on the fly, per block of 32 values,
//! to 8 bits with an f32 scale (`dx = max|x| / 127`, `qx = round(x / dx)`), so each
//! block's dot product is an integer one. A weight group of 32 values decodes to
//! unsigned codes `u` with `w = dw * u + cw` (Q4_0: `cw = -8 dw`; Q4_1: `cw = min`;
//! Q4_K: a sub-block's `d * scale` and `-dmin * min`), or, for Q8_0, to signed codes
//! with `cw = 0`. Then
//!
//! `sum(w * x) ~= dw * dx * sum(u * qx) + cw * dx * sum(qx)`.
//!
//! The only error beyond f32 rounding is the activations' rounding, at most `dx / 2` per
//! value: `|result - exact| <= sum over blocks of (max|x_b| / 254) * sum|w_b|`. The
//! tests hold every path to that bound against dequantize-then-f32.
//!
//! Paths: AVX-512 VNNI (`vpdpbusd` on 256-bit vectors), AVX2 (`vpmaddubsw` +
//! `vpmaddwd`) and a scalar one; all three compute the same integer sums. Q5_K and Q6_K
//! (16-value sub-blocks) are not served here: `linear` dequantizes them tile by tile.

use rayon::prelude::*;
use tessera_quant::GgmlType;

use super::SendPtr;

/// Values per activation block (and per weight group).
const QK: usize = 32;

/// The most activation rows one pass serves (more take several passes).
pub const MAX_M: usize = 8;

/// Which instructions compute the integer dot products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    Scalar,
    Avx2,
    Avx512Vnni,
}

impl Path {
    /// The fastest path this CPU runs.
    pub fn best() -> Path {
        [Path::Avx512Vnni, Path::Avx2].into_iter().find(|p| p.available()).unwrap_or(Path::Scalar)
    }

    pub fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            match self {
                Path::Scalar => true,
                Path::Avx2 => crate::simd::has_avx2(),
                Path::Avx512Vnni => {
                    Path::Avx2.available()
                        && crate::simd::has_avx512()
                        && std::is_x86_feature_detected!("avx512vl")
                        && std::is_x86_feature_detected!("avx512vnni")
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Path::Scalar
        }
    }
}

/// Dequantizes whole blocks of `ty` into `out` (as [`GgmlType::dequantize`], which it
/// equals exactly): with AVX-512 or AVX2 for Q4_0, Q4_1 and Q8_0 — the prefill paths
/// convert every weight once per block of prompt rows, so this is much of a quantized
/// prefill's cost.
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    let (n, bb) = (ty.block_elements() as usize, ty.block_bytes() as usize);
    assert_eq!(bytes.len() / bb * n, out.len(), "{ty}: whole blocks");
    #[cfg(target_arch = "x86_64")]
    if matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0) {
        if crate::simd::has_avx512() {
            // SAFETY: avx512f was detected; `bytes` holds out.len() / 32 blocks of `ty`.
            unsafe { x86::dequantize_avx512(ty, bytes, out) };
            return;
        }
        if crate::simd::has_avx2() {
            // SAFETY: avx2 and f16c were detected; `bytes` holds out.len() / 32 blocks.
            unsafe { x86::dequantize_avx2(ty, bytes, out) };
            return;
        }
    }
    ty.dequantize(bytes, out);
}

/// True when `ty` has an integer kernel here (every block format but Q5_K and Q6_K).
pub fn supports(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 | GgmlType::Q4K)
}

/// Activations quantized per block of 32: codes, scales, and scale times code sum.
pub struct QActs {
    q: Vec<i8>,
    d: Vec<f32>,
    ds: Vec<f32>,
    /// Blocks per row (`k / 32`).
    blocks: usize,
}

impl QActs {
    /// Quantizes `m` rows of `k` values (`k` a multiple of 32).
    pub fn new(x: &[f32], m: usize, k: usize) -> QActs {
        assert!(k.is_multiple_of(QK) && x.len() >= m * k);
        let blocks = k / QK;
        let mut q = vec![0i8; m * k];
        let (mut d, mut ds) = (vec![0.0f32; m * blocks], vec![0.0f32; m * blocks]);
        for (b, (xs, qs)) in x[..m * k].chunks_exact(QK).zip(q.chunks_exact_mut(QK)).enumerate() {
            let amax = xs.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let scale = amax / 127.0;
            let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
            let mut sum = 0i32;
            for (q, &v) in qs.iter_mut().zip(xs) {
                *q = (v * inv).round().clamp(-127.0, 127.0) as i8;
                sum += *q as i32;
            }
            d[b] = scale;
            ds[b] = scale * sum as f32;
        }
        QActs { q, d, ds, blocks }
    }
}

/// `out[i][j] = x[i] · w[j]` for `m` rows of `x` (any m; passes of up to `MAX_M`), `w`
/// being `n` rows of `k` values of format `ty` (`supports(ty)`, `k` a multiple of the
/// block size). `path` must be available.
#[allow(clippy::too_many_arguments)]
pub fn linear(out: &mut [f32], x: &[f32], ty: GgmlType, w: &[u8], m: usize, n: usize, k: usize, path: Path) {
    assert!(supports(ty) && path.available());
    let row_bytes = ty.row_bytes(k).expect("k is a whole number of blocks");
    assert!(out.len() >= m * n && x.len() >= m * k && w.len() >= n * row_bytes);
    if m == 0 || n == 0 {
        return;
    }
    let acts = QActs::new(x, m, k);
    let threads = rayon::current_num_threads().max(1);
    // Enough chunks to balance, each large enough to amortise the task overhead.
    let chunk = n.div_ceil(threads * 8).clamp((8192 / k).clamp(1, 64), 64);
    let optr = SendPtr(out.as_mut_ptr());
    for i0 in (0..m).step_by(MAX_M) {
        let mm = MAX_M.min(m - i0);
        let acts = &acts;
        (0..n.div_ceil(chunk)).into_par_iter().for_each(|c| {
            let j0 = c * chunk;
            let rows = chunk.min(n - j0);
            let mut tile = [0.0f32; 64 * MAX_M];
            let tile = &mut tile[..rows * mm];
            rows_dot(path, ty, &w[j0 * row_bytes..(j0 + rows) * row_bytes], acts, i0, mm, tile);
            for (r, vs) in tile.chunks_exact(mm).enumerate() {
                for (i, v) in vs.iter().enumerate() {
                    // SAFETY: (i0 + i, j0 + r) is inside the m x n output, and only this
                    // task writes columns [j0, j0 + rows).
                    unsafe { *optr.get().add((i0 + i) * n + j0 + r) = *v };
                }
            }
        });
    }
}

/// A SIMD row kernel instance (see `x86`).
#[cfg(target_arch = "x86_64")]
type Kernel = unsafe fn(GgmlType, &[u8], &QActs, usize, &mut [f32]);

/// Dots every weight row of `w` with activation rows `i0..i0 + mm` into
/// `out[r * mm + i]`.
fn rows_dot(path: Path, ty: GgmlType, w: &[u8], acts: &QActs, i0: usize, mm: usize, out: &mut [f32]) {
    // The activation-row count is a constant of each kernel instance, so its
    // accumulators live in registers.
    #[cfg(target_arch = "x86_64")]
    macro_rules! simd {
        ($kernel:ident) => {{
            let kernel: Kernel = match mm {
                1 => x86::$kernel::<1>,
                2 => x86::$kernel::<2>,
                3 => x86::$kernel::<3>,
                4 => x86::$kernel::<4>,
                5 => x86::$kernel::<5>,
                6 => x86::$kernel::<6>,
                7 => x86::$kernel::<7>,
                8 => x86::$kernel::<8>,
                _ => unreachable!("at most MAX_M rows per pass"),
            };
            // SAFETY: the caller checked `path.available()`; `linear` checked that `w`
            // holds whole rows of `acts.blocks` groups, that `acts` holds rows
            // i0..i0 + mm, and that `out` holds mm values per row.
            unsafe { kernel(ty, w, acts, i0, out) }
        }};
    }
    match path {
        Path::Scalar => scalar::rows_dot(ty, w, acts, i0, mm, out),
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 => simd!(row_dot_avx2),
        #[cfg(target_arch = "x86_64")]
        Path::Avx512Vnni if matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0) => simd!(row_dot_vnni_pairs),
        #[cfg(target_arch = "x86_64")]
        Path::Avx512Vnni => simd!(row_dot_vnni),
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("only the scalar path is available off x86-64"),
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Byte offset, within a row, of the block holding group `g`, and the group's index in
/// that block.
fn group_of(ty: GgmlType, g: usize) -> (usize, usize) {
    let per = ty.block_elements() as usize / QK;
    (g / per * ty.block_bytes() as usize, g % per)
}

/// A weight group's scale `dw` and offset `cw` (`w = dw * u + cw`).
fn group_scales(ty: GgmlType, blk: &[u8], sub: usize) -> (f32, f32) {
    match ty {
        GgmlType::Q4_0 => {
            let d = f16_at(blk, 0);
            (d, -8.0 * d)
        }
        GgmlType::Q5_0 => {
            let d = f16_at(blk, 0);
            (d, -16.0 * d)
        }
        GgmlType::Q4_1 | GgmlType::Q5_1 => (f16_at(blk, 0), f16_at(blk, 2)),
        GgmlType::Q8_0 => (f16_at(blk, 0), 0.0),
        GgmlType::Q4K => {
            let (sc, mn) = tessera_quant::scale_min_k4(sub, &blk[4..16]);
            (f16_at(blk, 0) * sc as f32, -f16_at(blk, 2) * mn as f32)
        }
        other => unreachable!("{other} has no integer kernel"),
    }
}

mod scalar {
    use super::*;

    /// A group's 32 codes in value order.
    fn codes(ty: GgmlType, blk: &[u8], sub: usize) -> [i32; QK] {
        let mut u = [0i32; QK];
        match ty {
            GgmlType::Q4_0 | GgmlType::Q4_1 => {
                let qs = &blk[if ty == GgmlType::Q4_0 { 2 } else { 4 }..];
                for j in 0..16 {
                    u[j] = (qs[j] & 0x0f) as i32;
                    u[j + 16] = (qs[j] >> 4) as i32;
                }
            }
            GgmlType::Q5_0 | GgmlType::Q5_1 => {
                let at = if ty == GgmlType::Q5_0 { 2 } else { 4 };
                let qh = u32::from_le_bytes([blk[at], blk[at + 1], blk[at + 2], blk[at + 3]]);
                let qs = &blk[at + 4..];
                for j in 0..16 {
                    u[j] = (qs[j] & 0x0f) as i32 | (((qh >> j) & 1) << 4) as i32;
                    u[j + 16] = (qs[j] >> 4) as i32 | (((qh >> (j + 16)) & 1) << 4) as i32;
                }
            }
            GgmlType::Q8_0 => {
                for (u, &q) in u.iter_mut().zip(&blk[2..34]) {
                    *u = q as i8 as i32;
                }
            }
            GgmlType::Q4K => {
                let q = &blk[16 + sub / 2 * 32..][..32];
                for (u, &q) in u.iter_mut().zip(q) {
                    *u = if sub.is_multiple_of(2) { q & 0x0f } else { q >> 4 } as i32;
                }
            }
            other => unreachable!("{other} has no integer kernel"),
        }
        u
    }

    /// As the SIMD kernels: `out[r * mm + i]` for every row r of `w`.
    pub fn rows_dot(ty: GgmlType, w: &[u8], acts: &QActs, i0: usize, mm: usize, out: &mut [f32]) {
        let row_bytes = acts.blocks * QK / ty.block_elements() as usize * ty.block_bytes() as usize;
        for (wrow, out) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(mm)) {
            row_dot(ty, wrow, acts, i0, mm, out);
        }
    }

    fn row_dot(ty: GgmlType, wrow: &[u8], acts: &QActs, i0: usize, mm: usize, out: &mut [f32]) {
        let mut acc = [0.0f32; MAX_M];
        for g in 0..acts.blocks {
            let (at, sub) = group_of(ty, g);
            let blk = &wrow[at..];
            let u = codes(ty, blk, sub);
            let (dw, cw) = group_scales(ty, blk, sub);
            for (i, acc) in acc[..mm].iter_mut().enumerate() {
                let b = (i0 + i) * acts.blocks + g;
                let qx = &acts.q[b * QK..][..QK];
                let isum: i32 = u.iter().zip(qx).map(|(&u, &q)| u * q as i32).sum();
                *acc += dw * acts.d[b] * isum as f32 + cw * acts.ds[b];
            }
        }
        out[..mm].copy_from_slice(&acc[..mm]);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// Bit j of `x` as byte j (0xff or 0) of a 256-bit vector (llama.cpp's
    /// `bytes_from_bits_32`).
    #[inline(always)]
    unsafe fn bits_to_bytes(x: u32) -> __m256i {
        // SAFETY: register-only intrinsics; callers enable avx2.
        unsafe {
            let shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
            let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x as i32), shuf);
            let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe_u64 as i64));
            _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1))
        }
    }

    /// 16 bytes of nibbles as 32 codes in value order (low nibbles, then high).
    #[inline(always)]
    unsafe fn nibbles(p: *const u8) -> __m256i {
        // SAFETY: the caller guarantees 16 readable bytes at p.
        unsafe {
            let q = _mm_loadu_si128(p as *const __m128i);
            let m4 = _mm_set1_epi8(0x0f);
            let lo = _mm_and_si128(q, m4);
            let hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
            _mm256_set_m128i(hi, lo)
        }
    }

    /// How far ahead of the group being read the weights are prefetched.
    const PREFETCH_BYTES: usize = 4096;

    /// The two f16 at `p` (unaligned) as f32: a block's scale and its min (or the next
    /// two bytes, for blocks with one scale). Read as one 32-bit load: a 16-bit one
    /// becomes `vpinsrw`, which merges into whatever register the compiler picks — at
    /// times the accumulator, chaining every group to the one before.
    #[inline(always)]
    unsafe fn f16x2_at(p: *const u8) -> (f32, f32) {
        // SAFETY: the caller guarantees 4 readable bytes at p (every block format has
        // its scale first, and more than 4 bytes); callers enable f16c.
        unsafe {
            let v = _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const u32).read_unaligned() as i32));
            (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
        }
    }

    /// Defines a row kernel for one instruction set: `$dot(u, qx)` sums `u * qx` (u
    /// unsigned bytes, qx signed bytes) into eight i32 lanes.
    macro_rules! row_kernel {
        ($name:ident, $features:literal, $vnni:literal) => {
            /// `out[r * M + i]` = weight row r of `w` (rows of `acts.blocks` groups of
            /// `ty`) dotted with activation row `i0 + i`, for every row of `w`.
            ///
            /// # Safety
            /// The CPU has the features; `w` holds whole rows; `acts` holds rows
            /// `i0..i0 + M`; `out` holds `M` values per row of `w`.
            #[target_feature(enable = $features)]
            pub unsafe fn $name<const M: usize>(ty: GgmlType, w: &[u8], acts: &QActs, i0: usize, out: &mut [f32]) {
                let bb = ty.block_bytes() as usize;
                let row_bytes = acts.blocks * QK / ty.block_elements() as usize * bb;
                for (wrow, out) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(M)) {
                // SAFETY: every load below reads inside the group's block (offsets from
                // ggml's block layouts; the row holds `acts.blocks` groups) or inside
                // activation rows i0..i0 + M, per the contract.
                unsafe {
                    let (mut acc, mut acc2) = ([_mm256_setzero_ps(); M], [_mm256_setzero_ps(); M]);
                    let (mut corr, mut corr2) = ([0.0f32; M], [0.0f32; M]);
                    let wp = wrow.as_ptr();
                    let nb = acts.blocks;
                    // One loop per format, so the decode is straight-line code:
                    // `$blk` is the group's block, `$g` its index; `$decode` gives the
                    // codes, `$scales` the group's (dw, cw).
                    macro_rules! groups {
                        (@one $blk:ident, $g:ident, $at:expr, $decode:expr, $scales:expr, $signed:expr, $acc:ident, $corr:ident) => {{
                            let $blk = wp.add($at);
                            // The weights stream from memory once: ask for them early.
                            _mm_prefetch::<_MM_HINT_T0>($blk.wrapping_add(PREFETCH_BYTES) as *const i8);
                            let (dw, cw): (f32, f32) = $scales;
                            accumulate::<M, $signed, $vnni>($decode, dw, cw, &acts, i0, $g, &mut $acc, &mut $corr);
                        }};
                        (|$blk:ident, $g:ident| at = $at:expr, $decode:expr, $scales:expr, signed = $signed:expr) => {{
                            // Two groups per iteration into two sets of accumulators:
                            // two dependency chains instead of one.
                            let mut $g = 0;
                            while $g + 1 < nb {
                                groups!(@one $blk, $g, $at, $decode, $scales, $signed, acc, corr);
                                $g += 1;
                                groups!(@one $blk, $g, $at, $decode, $scales, $signed, acc2, corr2);
                                $g += 1;
                            }
                            if $g < nb {
                                groups!(@one $blk, $g, $at, $decode, $scales, $signed, acc, corr);
                            }
                        }};
                    }
                    match ty {
                        GgmlType::Q4_0 => groups!(
                            |blk, g| at = g * bb,
                            nibbles(blk.add(2)),
                            {
                                let d = f16x2_at(blk).0;
                                (d, -8.0 * d)
                            },
                            signed = false
                        ),
                        GgmlType::Q4_1 => groups!(
                            |blk, g| at = g * bb,
                            nibbles(blk.add(4)),
                            f16x2_at(blk),
                            signed = false
                        ),
                        GgmlType::Q5_0 => groups!(
                            |blk, g| at = g * bb,
                            {
                                let qh = (blk.add(2) as *const u32).read_unaligned();
                                let fifth = _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10));
                                _mm256_or_si256(nibbles(blk.add(6)), fifth)
                            },
                            {
                                let d = f16x2_at(blk).0;
                                (d, -16.0 * d)
                            },
                            signed = false
                        ),
                        GgmlType::Q5_1 => groups!(
                            |blk, g| at = g * bb,
                            {
                                let qh = (blk.add(4) as *const u32).read_unaligned();
                                let fifth = _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10));
                                _mm256_or_si256(nibbles(blk.add(8)), fifth)
                            },
                            f16x2_at(blk),
                            signed = false
                        ),
                        GgmlType::Q8_0 => groups!(
                            |blk, g| at = g * bb,
                            _mm256_loadu_si256(blk.add(2) as *const __m256i),
                            (f16x2_at(blk).0, 0.0),
                            signed = true
                        ),
                        GgmlType::Q4K => groups!(
                            |blk, g| at = g / 8 * bb,
                            {
                                let sub = g % 8;
                                let q = _mm256_loadu_si256(blk.add(16 + sub / 2 * 32) as *const __m256i);
                                let q = if sub.is_multiple_of(2) { q } else { _mm256_srli_epi16(q, 4) };
                                _mm256_and_si256(q, _mm256_set1_epi8(0x0f))
                            },
                            {
                                let scales = std::slice::from_raw_parts(blk.add(4), 12);
                                let (sc, mn) = tessera_quant::scale_min_k4(g % 8, scales);
                                let (d, dmin) = f16x2_at(blk);
                                (d * sc as f32, -dmin * mn as f32)
                            },
                            signed = false
                        ),
                        other => unreachable!("{other} has no integer kernel"),
                    }
                    for i in 0..M {
                        let v = _mm256_add_ps(acc[i], acc2[i]);
                        corr[i] += corr2[i];
                        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
                        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
                        out[i] = _mm_cvtss_f32(s) + corr[i];
                    }
                }
                }
            }
        };
    }

    /// `vpmaddubsw` pairs (no overflow: |u| <= 128 and |qx| <= 127 keep each pair
    /// within i16), then `vpmaddwd` by ones.
    #[inline(always)]
    unsafe fn dot_avx2(u: __m256i, qx: __m256i) -> __m256i {
        // SAFETY: register-only intrinsics; callers enable avx2.
        unsafe { _mm256_madd_epi16(_mm256_maddubs_epi16(u, qx), _mm256_set1_epi16(1)) }
    }

    /// `vpdpbusd`: four u8 x i8 products summed into each i32 lane.
    #[inline(always)]
    unsafe fn dot_vnni(u: __m256i, qx: __m256i) -> __m256i {
        // SAFETY: register-only intrinsic; callers enable avx512vnni and avx512vl.
        unsafe { _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, qx) }
    }

    /// A Q4_0 / Q4_1 block pair's codes as one 512-bit vector in value order: group
    /// `a`'s 32 values, then group `b`'s (`at`: the nibbles' offset in a block).
    #[inline(always)]
    unsafe fn nibble_pair(a: *const u8, b: *const u8, at: usize) -> __m512i {
        // SAFETY: 16 readable bytes at a + at and b + at (the caller's block layout);
        // callers enable avx512f/bw.
        unsafe {
            let q = _mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128(a.add(at) as *const __m128i)),
                _mm_loadu_si128(b.add(at) as *const __m128i),
                1,
            );
            let m4 = _mm256_set1_epi8(0x0f);
            // lo = [a 0..16 | b 0..16], hi = [a 16..32 | b 16..32] (16-byte lanes).
            let lo = _mm256_and_si256(q, m4);
            let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            let v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            // [a lo, b lo, a hi, b hi] -> [a lo, a hi, b lo, b hi]
            _mm512_shuffle_i64x2(v, v, 0b11_01_10_00)
        }
    }

    /// The f16 at `a` and at `b` (unaligned) as f32 lanes 0 and 1, and the f16 two
    /// bytes after each (a block's min) as lanes 2 and 3.
    #[inline(always)]
    unsafe fn f16_pair(a: *const u8, b: *const u8) -> __m128 {
        // SAFETY: 4 readable bytes at a and at b; callers enable f16c.
        unsafe {
            let x = _mm_cvtsi32_si128((a as *const u32).read_unaligned() as i32);
            let x = _mm_insert_epi32(x, (b as *const u32).read_unaligned() as i32, 1);
            // [da, ma, db, mb] -> [da, db, ma, mb]
            _mm_shuffle_ps(_mm_cvtph_ps(x), _mm_cvtph_ps(x), 0b11_01_10_00)
        }
    }

    /// The VNNI row kernel for Q4_0, Q4_1 and Q8_0 on 512-bit vectors: two groups per
    /// `vpdpbusd`, their two scales spread over the vector's halves, the offsets and
    /// mins (`cw * dx * sum(qx)`) summed two at a time. Same contract as the other row
    /// kernels.
    ///
    /// # Safety
    /// As for `row_dot_vnni`, and the CPU has avx512bw.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn row_dot_vnni_pairs<const M: usize>(ty: GgmlType, w: &[u8], acts: &QActs, i0: usize, out: &mut [f32]) {
        let bb = ty.block_bytes() as usize;
        let nb = acts.blocks;
        let row_bytes = nb * bb;
        // SAFETY: every load reads inside a block of the row (scales first; nibbles at
        // 2 / 4, codes at 2) or inside activation rows i0..i0 + M; `out` holds M values
        // per row.
        unsafe {
            // Lane i of the 16 takes group (i / 8) of a pair's scale.
            let spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
            for (wrow, out) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(M)) {
                let wp = wrow.as_ptr();
                let mut acc = [_mm512_setzero_ps(); M];
                let mut corr = [_mm_setzero_ps(); M];
                let mut g = 0;
                while g + 2 <= nb {
                    let (a, b) = (wp.add(g * bb), wp.add((g + 1) * bb));
                    _mm_prefetch::<_MM_HINT_T0>(a.wrapping_add(PREFETCH_BYTES) as *const i8);
                    let scales = f16_pair(a, b);
                    // Codes (unsigned) and, for Q8_0, the signs to move onto qx.
                    let (u, neg, dw, cw) = match ty {
                        GgmlType::Q8_0 => {
                            let q = _mm512_inserti64x4(
                                _mm512_castsi256_si512(_mm256_loadu_si256(a.add(2) as *const __m256i)),
                                _mm256_loadu_si256(b.add(2) as *const __m256i),
                                1,
                            );
                            (_mm512_abs_epi8(q), _mm512_movepi8_mask(q), scales, _mm_setzero_ps())
                        }
                        GgmlType::Q4_0 => {
                            let cw = _mm_mul_ps(scales, _mm_set1_ps(-8.0));
                            (nibble_pair(a, b, 2), 0, scales, cw)
                        }
                        _ => (nibble_pair(a, b, 4), 0, scales, _mm_movehl_ps(scales, scales)),
                    };
                    for i in 0..M {
                        let blk = (i0 + i) * nb + g;
                        let mut qx = _mm512_loadu_si512(acts.q.as_ptr().add(blk * QK) as *const __m512i);
                        if ty == GgmlType::Q8_0 {
                            qx = _mm512_mask_sub_epi8(qx, neg, _mm512_setzero_si512(), qx);
                        }
                        let sums = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, qx));
                        // [dw_a * dx_a, dw_b * dx_b] spread over the halves.
                        let dx = _mm_castpd_ps(_mm_load_sd(acts.d.as_ptr().add(blk) as *const f64));
                        let s = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(dw, dx)));
                        acc[i] = _mm512_fmadd_ps(sums, s, acc[i]);
                        let ds = _mm_castpd_ps(_mm_load_sd(acts.ds.as_ptr().add(blk) as *const f64));
                        corr[i] = _mm_fmadd_ps(cw, ds, corr[i]);
                    }
                    g += 2;
                }
                let mut tail = [0.0f32; M];
                if g < nb {
                    // An odd group count: the last group on the 256-bit kernel's step.
                    let blk = wp.add(g * bb);
                    let (d, m) = f16x2_at(blk);
                    let (code, dw, cw) = match ty {
                        GgmlType::Q8_0 => (_mm256_loadu_si256(blk.add(2) as *const __m256i), d, 0.0),
                        GgmlType::Q4_0 => (nibbles(blk.add(2)), d, -8.0 * d),
                        _ => (nibbles(blk.add(4)), d, m),
                    };
                    let mut a = [_mm256_setzero_ps(); M];
                    let mut c = [0.0f32; M];
                    if ty == GgmlType::Q8_0 {
                        accumulate::<M, true, true>(code, dw, cw, acts, i0, g, &mut a, &mut c);
                    } else {
                        accumulate::<M, false, true>(code, dw, cw, acts, i0, g, &mut a, &mut c);
                    }
                    for i in 0..M {
                        tail[i] = hsum256(a[i]) + c[i];
                    }
                }
                for i in 0..M {
                    let c = corr[i];
                    let c = _mm_add_ss(c, _mm_shuffle_ps(c, c, 1));
                    out[i] = _mm512_reduce_add_ps(acc[i]) + _mm_cvtss_f32(c) + tail[i];
                }
            }
        }
    }

    /// The sum of a vector's 8 lanes.
    #[inline(always)]
    unsafe fn hsum256(v: __m256) -> f32 {
        // SAFETY: register-only intrinsics; callers enable avx.
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
        }
    }

    /// [`super::dequantize`] of Q4_0, Q4_1 or Q8_0 blocks: 16 values per vector.
    ///
    /// # Safety
    /// The CPU has avx512f; `bytes` holds `out.len() / 32` blocks of `ty`.
    #[target_feature(enable = "avx512f,f16c")]
    pub unsafe fn dequantize_avx512(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
        let bb = ty.block_bytes() as usize;
        // SAFETY: each block's loads stay inside its `bb` bytes (scales first, then 16
        // nibble bytes or 32 code bytes); each store writes 16 of its 32 outputs.
        unsafe {
            for (blk, y) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(QK)) {
                let p = blk.as_ptr();
                let (d, m) = f16x2_at(p);
                let (lo, hi) = match ty {
                    GgmlType::Q8_0 => {
                        let q = |at: usize| {
                            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(at) as *const __m128i)))
                        };
                        let d = _mm512_set1_ps(d);
                        (_mm512_mul_ps(q(2), d), _mm512_mul_ps(q(18), d))
                    }
                    _ => {
                        let at = if ty == GgmlType::Q4_0 { 2 } else { 4 };
                        let q = _mm_loadu_si128(p.add(at) as *const __m128i);
                        let m4 = _mm_set1_epi8(0x0f);
                        let u = |v: __m128i| _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
                        let (lo, hi) = (u(_mm_and_si128(q, m4)), u(_mm_and_si128(_mm_srli_epi16(q, 4), m4)));
                        // Q4_0: (u - 8) * d, exactly as the reference computes it.
                        if ty == GgmlType::Q4_0 {
                            let (eight, d) = (_mm512_set1_ps(8.0), _mm512_set1_ps(d));
                            (_mm512_mul_ps(_mm512_sub_ps(lo, eight), d), _mm512_mul_ps(_mm512_sub_ps(hi, eight), d))
                        } else {
                            let (d, m) = (_mm512_set1_ps(d), _mm512_set1_ps(m));
                            // u * d + m with one rounding less than the reference would
                            // differ: multiply, then add, as it does.
                            (_mm512_add_ps(_mm512_mul_ps(lo, d), m), _mm512_add_ps(_mm512_mul_ps(hi, d), m))
                        }
                    }
                };
                _mm512_storeu_ps(y.as_mut_ptr(), lo);
                _mm512_storeu_ps(y.as_mut_ptr().add(16), hi);
            }
        }
    }

    /// [`super::dequantize`] of Q4_0, Q4_1 or Q8_0 blocks on AVX2: 8 values per vector.
    ///
    /// # Safety
    /// The CPU has avx2 and f16c; `bytes` holds `out.len() / 32` blocks of `ty`.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn dequantize_avx2(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
        let bb = ty.block_bytes() as usize;
        let m4 = _mm_set1_epi8(0x0f);
        // SAFETY: each block's loads stay inside its `bb` bytes (scales first, then 16
        // nibble bytes or 32 code bytes); the stores write its 32 outputs, 8 at a time.
        unsafe {
            for (blk, y) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(QK)) {
                let p = blk.as_ptr();
                let (d, m) = f16x2_at(p);
                let load = |at: usize| _mm_loadu_si128(p.add(at) as *const __m128i);
                // Values 0..16 and 16..32 as 16 bytes each.
                let halves = match ty {
                    GgmlType::Q8_0 => [load(2), load(18)],
                    GgmlType::Q4_0 => [_mm_and_si128(load(2), m4), _mm_and_si128(_mm_srli_epi16(load(2), 4), m4)],
                    _ => [_mm_and_si128(load(4), m4), _mm_and_si128(_mm_srli_epi16(load(4), 4), m4)],
                };
                let (dv, mv) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
                for (h, bytes16) in halves.into_iter().enumerate() {
                    for (e, b) in [bytes16, _mm_srli_si128(bytes16, 8)].into_iter().enumerate() {
                        // As the reference computes each value: Q8_0 q * d, Q4_0
                        // (u - 8) * d, Q4_1 u * d + m (multiply, then add).
                        let v = match ty {
                            GgmlType::Q8_0 => _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), dv),
                            GgmlType::Q4_0 => {
                                let u = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
                                _mm256_mul_ps(_mm256_sub_ps(u, _mm256_set1_ps(8.0)), dv)
                            }
                            _ => _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), dv), mv),
                        };
                        _mm256_storeu_ps(y.as_mut_ptr().add(h * 16 + e * 8), v);
                    }
                }
            }
        }
    }

    /// One group's contribution to activation rows `i0..i0 + M`: `w` are its codes
    /// (signed bytes when `SIGNED`, else unsigned), `dw` and `cw` its scales.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn accumulate<const M: usize, const SIGNED: bool, const VNNI: bool>(
        w: __m256i,
        dw: f32,
        cw: f32,
        acts: &QActs,
        i0: usize,
        g: usize,
        acc: &mut [__m256; M],
        corr: &mut [f32; M],
    ) {
        // SAFETY: the caller (a row kernel) guarantees activation rows i0..i0 + M exist
        // and g < acts.blocks; register intrinsics need the caller's features.
        unsafe {
            let u = if SIGNED { _mm256_sign_epi8(w, w) } else { w };
            for i in 0..M {
                let b = (i0 + i) * acts.blocks + g;
                let mut qx = _mm256_loadu_si256(acts.q.as_ptr().add(b * QK) as *const __m256i);
                if SIGNED {
                    qx = _mm256_sign_epi8(qx, w);
                }
                let sums = if VNNI { dot_vnni(u, qx) } else { dot_avx2(u, qx) };
                let s = _mm256_cvtepi32_ps(sums);
                acc[i] = _mm256_fmadd_ps(s, _mm256_set1_ps(dw * *acts.d.get_unchecked(b)), acc[i]);
                corr[i] += cw * *acts.ds.get_unchecked(b);
            }
        }
    }

    row_kernel!(row_dot_avx2, "avx2,fma,f16c", false);
    row_kernel!(row_dot_vnni, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni", true);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::WSlice;
    use crate::ops::{self, prefill_gemm::Precision, testutil::Rng};
    use proptest::prelude::*;

    /// Random blocks of `ty`: f16 scales of either sign (and zero), random codes.
    fn random_row(ty: GgmlType, k: usize, rng: &mut Rng) -> Vec<u8> {
        let nb = k / ty.block_elements() as usize;
        let bb = ty.block_bytes() as usize;
        let mut row = Vec::with_capacity(nb * bb);
        for _ in 0..nb {
            let mut blk: Vec<u8> = (0..bb).map(|_| rng.next_u64() as u8).collect();
            let scale = |rng: &mut Rng| half::f16::from_f32(rng.f32() * 0.1).to_le_bytes();
            let at: &[usize] = match ty {
                GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
                GgmlType::Q6K => &[208],
                _ => &[0],
            };
            for &a in at {
                blk[a..a + 2].copy_from_slice(&scale(rng));
            }
            row.extend(blk);
        }
        row
    }

    /// Checks `linear` on `path` against dequantize-then-f64 within the stated bound.
    fn check(ty: GgmlType, path: Path, m: usize, n: usize, k: usize, seed: u64) {
        check_with(ty, m, n, k, seed, &|out, x, w| linear(out, x, ty, w, m, n, k, path));
    }

    type Linear<'a> = dyn Fn(&mut [f32], &[f32], &[u8]) + 'a;

    fn check_with(ty: GgmlType, m: usize, n: usize, k: usize, seed: u64, run: &Linear) {
        let path = "";
        let mut rng = Rng(seed | 1);
        let w: Vec<u8> = (0..n).flat_map(|_| random_row(ty, k, &mut rng)).collect();
        let mut x = rng.vec(m * k);
        if seed.is_multiple_of(3) {
            // A zero block and a block with one large value.
            x[..QK.min(k)].fill(0.0);
            x[k - 1] = 50.0;
        }
        let mut wf = vec![0.0f32; n * k];
        ty.dequantize(&w, &mut wf);
        let mut out = vec![f32::NAN; m * n];
        run(&mut out, &x, &w);
        for i in 0..m {
            for j in 0..n {
                let (xr, wr) = (&x[i * k..][..k], &wf[j * k..][..k]);
                let exact: f64 = xr.iter().zip(wr).map(|(&a, &b)| a as f64 * b as f64).sum();
                let mut bound = 0.0f64;
                let mut mag = 0.0f64;
                for (xb, wb) in xr.chunks(QK).zip(wr.chunks(QK)) {
                    let amax = xb.iter().fold(0.0f32, |a, v| a.max(v.abs())) as f64;
                    let wsum: f64 = wb.iter().map(|v| v.abs() as f64).sum();
                    bound += amax / 254.0 * wsum;
                    mag += amax * wsum;
                }
                // f32 rounding of the per-block products and sums.
                let tol = bound * 1.0001 + mag * 1e-6 + 1e-6;
                let got = out[i * n + j] as f64;
                assert!(
                    (got - exact).abs() <= tol,
                    "{ty} {path} m={m} n={n} k={k} ({i},{j}): {got} vs {exact} (bound {tol})"
                );
            }
        }
    }

    const FORMATS: [GgmlType; 6] =
        [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::Q4K];

    fn paths() -> Vec<Path> {
        [Path::Scalar, Path::Avx2, Path::Avx512Vnni].into_iter().filter(|p| p.available()).collect()
    }

    #[test]
    fn every_format_and_path_within_the_bound() {
        for ty in FORMATS {
            let kb = ty.block_elements() as usize;
            for path in paths() {
                for &(m, n, k) in &[(1, 1, kb), (1, 7, 3 * kb), (3, 5, 2 * kb), (8, 9, kb), (9, 4, kb), (17, 3, 2 * kb)]
                {
                    check(ty, path, m, n, k, (m * 31 + n * 7 + k) as u64);
                }
            }
        }
    }

    #[test]
    fn paths_agree_on_integer_sums() {
        // Same integer sums and the same scales: the paths differ by f32 summation order.
        let mut rng = Rng(5);
        for ty in FORMATS {
            let k = 2 * ty.block_elements() as usize;
            let w = random_row(ty, k, &mut rng);
            let x = rng.vec(3 * k);
            let acts = QActs::new(&x, 3, k);
            let mut want = [0.0f32; 3];
            rows_dot(Path::Scalar, ty, &w, &acts, 0, 3, &mut want);
            for path in paths() {
                let mut got = [0.0f32; 3];
                rows_dot(path, ty, &w, &acts, 0, 3, &mut got);
                for i in 0..3 {
                    assert!((got[i] - want[i]).abs() <= 1e-4 * want[i].abs().max(1.0), "{ty} {path:?}");
                }
            }
        }
    }

    #[test]
    fn the_linear_op_serves_every_format_in_every_regime() {
        // Integer kernels (m <= 16, one or two passes), then dequantized tiles through
        // the decode-batch kernel or the cache-blocked GEMM (or gemm, or AVX2's tiles);
        // Q5_K and Q6_K always dequantize.
        // The prompt GEMM dequantizes in blocks of 256 columns: rows of 10 blocks of 32
        // span a second, short column block.
        let all = FORMATS.into_iter().chain([GgmlType::Q5K, GgmlType::Q6K]);
        for ty in all {
            let kb = ty.block_elements() as usize;
            let cases = [1, 5, 8, 16, 17, 40, 70].map(|m| (m, 2 * kb)).into_iter().chain([(70, 10 * kb)]);
            for (m, k) in cases {
                check_with(ty, m, 13, k, m as u64 * 7 + 1, &|out, x, w| {
                    crate::ops::linear::linear(out, x, WSlice::Quant(ty, w), None, m, 13, k, Default::default())
                });
            }
        }
    }

    #[test]
    fn embedding_rows_of_a_quantized_table() {
        let mut rng = Rng(9);
        for ty in FORMATS.into_iter().chain([GgmlType::Q5K, GgmlType::Q6K]) {
            let (vocab, hidden) = (5, ty.block_elements() as usize * 2);
            let table: Vec<u8> = (0..vocab).flat_map(|_| random_row(ty, hidden, &mut rng)).collect();
            let mut all = vec![0.0f32; vocab * hidden];
            ty.dequantize(&table, &mut all);
            let mut out = vec![f32::NAN; 3 * hidden];
            crate::ops::misc::embedding(&mut out, WSlice::Quant(ty, &table), &[4, 0, 2], 3, hidden, vocab).unwrap();
            for (r, id) in [4, 0, 2].into_iter().enumerate() {
                assert_eq!(&out[r * hidden..][..hidden], &all[id * hidden..][..hidden], "{ty}");
            }
        }
    }

    /// The whole dispatch (`ops::linear`) on every block format, at row counts on both
    /// sides of each switch (integer kernels, dot tiles, GEMMs on dequantized weights).
    #[test]
    fn linear_dispatch_on_quantized_weights() {
        for ty in FORMATS.into_iter().chain([GgmlType::Q5K, GgmlType::Q6K]) {
            let k = 2 * ty.block_elements() as usize;
            for (s, &m) in [1usize, 5, 6, 8, 16, 17, 40, 80].iter().enumerate() {
                check_with(ty, m, 29, k, 7 + s as u64, &|out, x, w| {
                    ops::linear::linear(out, x, WSlice::Quant(ty, w), None, m, 29, k, Precision::F32)
                });
            }
        }
    }

    #[test]
    fn simd_dequantization_equals_the_reference_exactly() {
        let mut rng = Rng(17);
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let bytes = random_row(ty, 32 * 7, &mut rng);
            let mut want = vec![0.0f32; 32 * 7];
            ty.dequantize(&bytes, &mut want);
            let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            let mut got = vec![f32::NAN; 32 * 7];
            dequantize(ty, &bytes, &mut got);
            assert_eq!(bits(&got), bits(&want), "{ty}");
            // Each SIMD variant this CPU runs, not only the one `dequantize` picks.
            #[cfg(target_arch = "x86_64")]
            {
                if crate::simd::has_avx2() {
                    got.fill(f32::NAN);
                    // SAFETY: avx2/f16c detected; `bytes` holds 7 blocks.
                    unsafe { x86::dequantize_avx2(ty, &bytes, &mut got) };
                    assert_eq!(bits(&got), bits(&want), "{ty} avx2");
                }
                if crate::simd::has_avx512() {
                    got.fill(f32::NAN);
                    // SAFETY: avx512f detected; `bytes` holds 7 blocks.
                    unsafe { x86::dequantize_avx512(ty, &bytes, &mut got) };
                    assert_eq!(bits(&got), bits(&want), "{ty} avx512");
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn ragged_shapes(fi in 0usize..6, m in 1usize..12, n in 1usize..20, blocks in 1usize..5, seed in any::<u64>()) {
            let ty = FORMATS[fi];
            for path in paths() {
                check(ty, path, m, n, blocks * ty.block_elements() as usize, seed);
            }
        }
    }
}
