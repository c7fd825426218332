//! Prompts' linear layers on f16 weights on AVX2 without AVX-512, and on AVX-512 that
//! runs on 256-bit units (Zen 4), where they outrun the AVX-512 GEMM (`linear`'s
//! `avx2_panels` has the figures): outer-product tiles over weight panels packed per
//! job, in the manner of BLIS's micro-kernels.
//!
//! - A job takes `PANELS` panels of 16 weight rows and a block of activation rows. It
//!   first transposes its panels into its thread's scratch (`[k][16]` f16 per panel,
//!   rows past `n` zero), in 8 x 8 blocks of 16-bit lanes; every tile of the block
//!   then reads them.
//! - A tile is 6 activation rows x one panel: per column, 2 converted weight vectors
//!   (16 outputs) and 6 broadcast activations feed 12 FMAs into 12 accumulators. That
//!   is 1 conversion per 6 FMAs, against [`dot_tiles`](super::dot_tiles)' 1 per 4,
//!   whose 4 activation rows also streamed 4 vectors a column from L2 where this reads
//!   6 scalars. On this kernel's machine (Zen 3, 2 cores) a 3x4 dot tile reached 75-86%
//!   of the FMA peak in real linears and these tiles reach 90-96% (bench model shapes,
//!   168 and 510 rows, 2 threads: 189-199 GFLOP/s against 155-171, in turns).
//! - Activation tiles run over the job's panels before the next, so a tile's 6 rows
//!   (48 KiB at k = 2,048) stay in L2; blocks of activation rows run one after the
//!   other across all the weights, so a block stays in L3 while the weights stream past.
//!
//! Each output is the f32 sum of its products in column order: it does not depend on
//! how many rows the call carries nor on the tile it fell in (but it is not the
//! GEMV's 8-lane order, so a prompt's row and the same row decoded differ in the last
//! bits).

use half::f16;
use rayon::prelude::*;

use super::SendPtr;
use crate::dtype::WSlice;

/// Weight rows per panel (2 vectors of 8 outputs) and activation rows per tile.
const NR: usize = 16;
const MR: usize = 6;
/// Panels per job: 4 x 16 rows, 256 KiB of packed f16 at k = 2,048.
const PANELS: usize = 4;
/// Activation rows per block (a multiple of `MR`): 1 MiB of f32 at k = 2,048, 4 MiB at
/// 8,192, in L3 while the weights stream past; each panel is packed once per block.
const BLOCK_ROWS: usize = 32 * MR;

/// True where this kernel runs: AVX2 with FMA and F16C.
pub fn available() -> bool {
    crate::simd::has_avx2()
}

/// True for the weight storage this kernel takes: f16.
pub fn takes(w: WSlice) -> bool {
    matches!(w, WSlice::F16(_))
}

/// `out[m][n] = x[m][k] · w[n][k]ᵀ` for f16 weights. Callers check `available()` and
/// the slice lengths (`out >= m*n`, `x >= m*k`, `w >= n*k`).
pub fn linear(out: &mut [f32], x: &[f32], w: WSlice, m: usize, n: usize, k: usize) {
    let WSlice::F16(w) = w else { panic!("panel tiles take f16 weights") };
    assert!(available());
    assert!(out.len() >= m * n && x.len() >= m * k && w.len() >= n * k);
    if m == 0 || n == 0 {
        return;
    }
    // Activation blocks of near-equal size, each a whole number of tiles.
    let blocks = m.div_ceil(BLOCK_ROWS);
    let per_block = m.div_ceil(blocks).div_ceil(MR) * MR;
    let groups = n.div_ceil(PANELS * NR);
    let optr = SendPtr(out.as_mut_ptr());
    let scratch = || vec![f16::ZERO; PANELS * NR * k];
    (0..groups * blocks).into_par_iter().for_each_init(scratch, |packed, job| {
        let (g, b) = (job % groups, job / groups);
        let (j0, j1) = (g * PANELS * NR, ((g + 1) * PANELS * NR).min(n));
        let (i0, i1) = (b * per_block, ((b + 1) * per_block).min(m));
        if i0 >= i1 {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2/FMA/F16C were asserted; this job writes only rows [i0, i1) x
        // columns [j0, j1) of the m x n output, disjoint from every other job's; the
        // scratch holds PANELS panels of k x 16 and lengths are as asserted.
        unsafe {
            x86::job(optr, x, w, packed, n, k, i0..i1, j0..j1)
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (optr, packed, i0, i1, j0, j1);
    });
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use half::f16;
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{MR, NR, SendPtr};

    /// One job: packs weight rows `rows` into `packed`, then computes activation rows
    /// `acts` against them.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be present; `out` addresses an m x n f32 matrix with
    /// `acts.end <= m`; `x` holds m * k, `w` n * k with `rows.end <= n`, `packed` at
    /// least `rows.len().div_ceil(NR) * NR * k`; no one else touches `acts` x `rows`
    /// of `out` during the call.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)] // the product's shape, the job's place and its scratch
    pub unsafe fn job(
        out: SendPtr,
        x: &[f32],
        w: &[f16],
        packed: &mut [f16],
        n: usize,
        k: usize,
        acts: Range<usize>,
        rows: Range<usize>,
    ) {
        let panels = rows.len().div_ceil(NR);
        for p in 0..panels {
            let (j0, j1) = (rows.start + p * NR, (rows.start + (p + 1) * NR).min(rows.end));
            pack(&w[j0 * k..j1 * k], j1 - j0, k, &mut packed[p * NR * k..(p + 1) * NR * k]);
        }
        for i in acts.clone().step_by(MR) {
            let rx = MR.min(acts.end - i);
            for p in 0..panels {
                let j = rows.start + p * NR;
                let t = Tile { out, x, w: &packed[p * NR * k..], n, k, i, j, cols: NR.min(rows.end - j) };
                // SAFETY: forwarded contract; the tile lies inside the job.
                unsafe {
                    match rx {
                        6 => t.run::<6>(),
                        5 => t.run::<5>(),
                        4 => t.run::<4>(),
                        3 => t.run::<3>(),
                        2 => t.run::<2>(),
                        _ => t.run::<1>(),
                    }
                }
            }
        }
    }

    /// `dst[c][r] = src[r][c]` for `rows` (<= 16) rows of `k` columns, rows past them 0:
    /// 8 x 8 blocks of 16-bit lanes through three rounds of unpacks, the tail columns
    /// one by one.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn pack(src: &[f16], rows: usize, k: usize, dst: &mut [f16]) {
        assert!(rows <= NR && src.len() >= rows * k && dst.len() >= NR * k);
        let full = k / 8 * 8;
        for h in 0..NR / 8 {
            for c in (0..full).step_by(8) {
                // SAFETY: row r < rows reads columns c..c + 8 < k of src; the stores
                // write dst[(c + t) * NR + h * 8..][..8] for t < 8, inside NR * k.
                unsafe {
                    let a: [__m128i; 8] = std::array::from_fn(|t| {
                        let r = h * 8 + t;
                        if r < rows { _mm_loadu_si128(src.as_ptr().add(r * k + c).cast()) } else { _mm_setzero_si128() }
                    });
                    let t0 = _mm_unpacklo_epi16(a[0], a[1]);
                    let t1 = _mm_unpackhi_epi16(a[0], a[1]);
                    let t2 = _mm_unpacklo_epi16(a[2], a[3]);
                    let t3 = _mm_unpackhi_epi16(a[2], a[3]);
                    let t4 = _mm_unpacklo_epi16(a[4], a[5]);
                    let t5 = _mm_unpackhi_epi16(a[4], a[5]);
                    let t6 = _mm_unpacklo_epi16(a[6], a[7]);
                    let t7 = _mm_unpackhi_epi16(a[6], a[7]);
                    let u = [
                        _mm_unpacklo_epi32(t0, t2),
                        _mm_unpackhi_epi32(t0, t2),
                        _mm_unpacklo_epi32(t1, t3),
                        _mm_unpackhi_epi32(t1, t3),
                        _mm_unpacklo_epi32(t4, t6),
                        _mm_unpackhi_epi32(t4, t6),
                        _mm_unpacklo_epi32(t5, t7),
                        _mm_unpackhi_epi32(t5, t7),
                    ];
                    for q in 0..4 {
                        let d = dst.as_mut_ptr().add((c + 2 * q) * NR + h * 8);
                        _mm_storeu_si128(d.cast(), _mm_unpacklo_epi64(u[q], u[q + 4]));
                        _mm_storeu_si128(d.add(NR).cast(), _mm_unpackhi_epi64(u[q], u[q + 4]));
                    }
                }
            }
        }
        for c in full..k {
            for r in 0..NR {
                dst[c * NR + r] = if r < rows { src[r * k + c] } else { f16::ZERO };
            }
        }
    }

    /// A tile's place: activation rows from `i`, output columns from `j` (`cols` of
    /// them, at most 16), whose packed panel `w` starts at.
    struct Tile<'a> {
        out: SendPtr,
        x: &'a [f32],
        w: &'a [f16],
        n: usize,
        k: usize,
        i: usize,
        j: usize,
        cols: usize,
    }

    impl Tile<'_> {
        /// `out[i + b][j + a] = Σ_c w[j + a][c] · x[i + b][c]` for a < cols, b < R.
        ///
        /// # Safety
        /// As [`job`], with the tile inside the job and the panel packed.
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn run<const R: usize>(&self) {
            // SAFETY: (whole body) rows i..i + R of x exist, the panel holds k x 16,
            // and the outputs written are this tile's.
            unsafe {
                let (xp, wp, k) = (self.x.as_ptr().add(self.i * self.k), self.w.as_ptr(), self.k);
                let mut acc = [[_mm256_setzero_ps(); 2]; R];
                for c in 0..k {
                    let w0 = _mm256_cvtph_ps(_mm_loadu_si128(wp.add(c * NR).cast()));
                    let w1 = _mm256_cvtph_ps(_mm_loadu_si128(wp.add(c * NR + 8).cast()));
                    for (b, acc) in acc.iter_mut().enumerate() {
                        let xv = _mm256_broadcast_ss(&*xp.add(b * k + c));
                        acc[0] = _mm256_fmadd_ps(xv, w0, acc[0]);
                        acc[1] = _mm256_fmadd_ps(xv, w1, acc[1]);
                    }
                }
                for (b, acc) in acc.iter().enumerate() {
                    let o = self.out.get().add((self.i + b) * self.n + self.j);
                    if self.cols == NR {
                        _mm256_storeu_ps(o, acc[0]);
                        _mm256_storeu_ps(o.add(8), acc[1]);
                    } else {
                        let mut lanes = [0.0f32; NR];
                        _mm256_storeu_ps(lanes.as_mut_ptr(), acc[0]);
                        _mm256_storeu_ps(lanes.as_mut_ptr().add(8), acc[1]);
                        std::ptr::copy_nonoverlapping(lanes.as_ptr(), o, self.cols);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::prefill_gemm;
    use crate::ops::testutil::*;

    /// Every tile height (activation rows up to 2 blocks, with short tiles), short
    /// last panels and groups, columns with and without a tail of 8: close to the f64
    /// sum of the weights as stored, and each row bit-identical to the same row
    /// computed alone.
    #[test]
    fn tiles_match_naive_and_rows_are_independent() {
        if !available() {
            eprintln!("skipped: no AVX2 on this CPU (linear() does not call this kernel here)");
            return;
        }
        for &n in &[5, 16, PANELS * NR + 21] {
            for &k in &[7, 64, 1031] {
                for &m in &[1, 5, 6, 71, BLOCK_ROWS + 13] {
                    let mut rng = Rng((m * 7 + k * 3 + n) as u64);
                    let x = rng.vec(m * k);
                    let w32 = rng.vec(n * k);
                    let w16: Vec<f16> = w32.iter().map(|&v| f16::from_f32(v)).collect();
                    let what = format!("m={m} n={n} k={k}");
                    assert_tiles_match_naive(linear, &x, WSlice::F16(&w16), (m, n, k), &what);
                }
            }
        }
    }

    /// The tiles and the cache-blocked GEMM in f32 arithmetic give the same bits (each
    /// output's products summed in column order with FMAs), so `linear` may hand f16
    /// prompts to either: to the tiles on Zen 4.
    #[test]
    fn tiles_give_the_cache_blocked_gemms_bits() {
        if !available() || !prefill_gemm::available() {
            eprintln!("skipped: no AVX2 on this CPU");
            return;
        }
        for &(m, n, k) in &[(64, 37, 300), (71, 16, 1031), (BLOCK_ROWS + 13, PANELS * NR + 21, 257)] {
            let mut rng = Rng((m + n + k) as u64);
            let x = rng.vec(m * k);
            let w16: Vec<f16> = rng.vec(n * k).iter().map(|&v| f16::from_f32(v)).collect();
            let (mut tiles, mut gemm) = (vec![0f32; m * n], vec![0f32; m * n]);
            linear(&mut tiles, &x, WSlice::F16(&w16), m, n, k);
            prefill_gemm::linear(&mut gemm, &x, WSlice::F16(&w16), m, n, k, prefill_gemm::Precision::F32);
            assert!(tiles == gemm, "m={m} n={n} k={k}: the tiles' outputs are not the GEMM's");
        }
    }
}
