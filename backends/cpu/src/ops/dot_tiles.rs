//! Linear layers on AVX2 past the GEMV and the integer kernels (decode batches and
//! prompts; `linear::avx2_tiles` says from how many rows) for f16/bf16 and quantized
//! weights, f16 prompts excepted (they take [`panel_tiles`](super::panel_tiles)):
//! dot-product tiles over the whole of k, as llama.cpp's tinyBLAS computes them.
//! Weights and activations are both contiguous along k, so f16/bf16 weights are neither
//! packed nor converted into a second copy: a tile of 3 weight rows x 4 activation rows
//! keeps 12 accumulators of 8 lanes and, per 8 columns, converts 3 weight vectors and
//! loads 4 activation vectors for 12 FMAs.
//! Quantized weights are dequantized a job's rows at a time (18 rows, in L2 at
//! these widths) into f32, which the job's tiles then load as they are.
//!
//! Work is cut into jobs of 18 weight rows x a block of about 72 activation rows; the
//! jobs of one activation block run one after the other across the weights, so the
//! block stays in L3 while the weights stream past it. Within a job each activation
//! tile meets all of the job's weight rows before the next tile starts: the job's
//! rows stay in L2 and the tile's 4 rows are read from L3 once per job. (Each group
//! of 3 weight rows meeting the whole block first read the block from L3 once per
//! group, since 72 rows at k = 2,048 already outgrow a 512 KiB L2: 0.81-0.98 of
//! this order's rate.)
//!
//! Each output is the sum of its 8 lanes (each lane summed in column order) plus the
//! columns past the last multiple of 8, in order: it does not depend on how many rows
//! the call carries nor on the tile it fell in.

use rayon::prelude::*;

use super::SendPtr;
use crate::dtype::WSlice;

/// Weight rows and activation rows of one tile.
const RW: usize = 3;
const RX: usize = 4;
/// Weight rows of one job: at the widest k here (8,192) its f16 rows (288 KiB) and
/// one activation tile (128 KiB) share a 512 KiB L2.
const JOB_ROWS: usize = 6 * RW;
/// Activation tiles per block (72 rows, as llama.cpp's tinyBLAS).
const BLOCK_TILES: usize = 18;

/// True where this kernel runs: AVX2 with FMA and F16C.
pub fn available() -> bool {
    crate::simd::has_avx2()
}

/// True for the weight storage this kernel takes: f16, bf16 and quantized blocks.
pub fn takes(w: WSlice) -> bool {
    matches!(w, WSlice::F16(_) | WSlice::Bf16(_) | WSlice::Quant(..))
}

/// `out[m][n] = x[m][k] · w[n][k]ᵀ` for weights that [`takes`] accepts. Callers check
/// `available()` and the slice lengths (`out >= m*n`, `x >= m*k`, `w >= n*k`).
pub fn linear(out: &mut [f32], x: &[f32], w: WSlice, m: usize, n: usize, k: usize) {
    assert!(available() && takes(w));
    assert!(out.len() >= m * n && x.len() >= m * k && w.len() >= n * k);
    // Activation rows in blocks of about BLOCK_TILES tiles, of near-equal size.
    let tiles = m.div_ceil(RX);
    let blocks = tiles.div_ceil(BLOCK_TILES).max(1);
    let per_block = tiles.div_ceil(blocks) * RX;
    let groups = n.div_ceil(JOB_ROWS);
    let optr = SendPtr(out.as_mut_ptr());
    // Quantized weights: each job's rows dequantized into its thread's scratch.
    let scratch = || if matches!(w, WSlice::Quant(..)) { vec![0.0f32; JOB_ROWS * k] } else { Vec::new() };
    (0..groups * blocks).into_par_iter().for_each_init(scratch, |scratch, job| {
        let (g, b) = (job % groups, job / groups);
        let (j0, j1) = (g * JOB_ROWS, ((g + 1) * JOB_ROWS).min(n));
        let (i0, i1) = (b * per_block, ((b + 1) * per_block).min(m));
        let rows = match w {
            WSlice::Quant(..) => {
                let rows = &mut scratch[..(j1 - j0) * k];
                w.to_f32(j0 * k, rows);
                WSlice::F32(rows)
            }
            WSlice::F16(s) => WSlice::F16(&s[j0 * k..]),
            WSlice::Bf16(s) => WSlice::Bf16(&s[j0 * k..]),
            WSlice::F32(s) => WSlice::F32(&s[j0 * k..]),
        };
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2/FMA/F16C were asserted; this job writes only rows [i0, i1) x
        // columns [j0, j1) of the m x n output, disjoint from every other job's;
        // `rows` starts at weight row j0 (as stored, or dequantized) and lengths are
        // as asserted.
        unsafe {
            x86::weights_job(optr, x, rows, n, k, i0..i1, j0..j1)
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (optr, i0, i1, j0, j1, rows);
    });
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use half::{bf16, f16};
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{RW, RX, SendPtr};
    use crate::dtype::WSlice;
    use crate::simd::x86::{lane_sum, load8_bf16, load8_f16};

    /// One job: weight rows `rows` (in groups of RW) against activation rows `acts`
    /// (in tiles of RX); `w` starts at weight row `rows.start`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be present; `out` addresses an m x n f32 matrix with
    /// `acts.end <= m`; `x` holds m * k, `w` at least `rows.len() * k` with
    /// `rows.end <= n`; no one else touches `acts` x `rows` of `out` during the call.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)] // the product's shape and the job's place
    unsafe fn job<T: Copy>(
        out: SendPtr,
        x: &[f32],
        w: &[T],
        n: usize,
        k: usize,
        acts: Range<usize>,
        rows: Range<usize>,
        load: impl Fn(*const T) -> __m256 + Copy,
        scalar: impl Fn(T) -> f32 + Copy,
    ) {
        for i in acts.clone().step_by(RX) {
            let rx = RX.min(acts.end - i);
            for j in rows.clone().step_by(RW) {
                let rw = RW.min(rows.end - j);
                let t = Tile { out, x, w: &w[(j - rows.start) * k..], n, k, i, j };
                // SAFETY: forwarded contract; the tile lies inside the job.
                unsafe {
                    match (rw, rx) {
                        (3, 4) => t.run::<3, 4>(load, scalar),
                        (3, 3) => t.run::<3, 3>(load, scalar),
                        (3, 2) => t.run::<3, 2>(load, scalar),
                        (3, _) => t.run::<3, 1>(load, scalar),
                        (2, 4) => t.run::<2, 4>(load, scalar),
                        (2, 3) => t.run::<2, 3>(load, scalar),
                        (2, 2) => t.run::<2, 2>(load, scalar),
                        (2, _) => t.run::<2, 1>(load, scalar),
                        (_, 4) => t.run::<1, 4>(load, scalar),
                        (_, 3) => t.run::<1, 3>(load, scalar),
                        (_, 2) => t.run::<1, 2>(load, scalar),
                        _ => t.run::<1, 1>(load, scalar),
                    }
                }
            }
        }
    }

    /// A tile's place: activation rows from `i`, weight rows (and output columns) from
    /// `j`, whose weights `w` starts at.
    struct Tile<'a, T> {
        out: SendPtr,
        x: &'a [f32],
        w: &'a [T],
        n: usize,
        k: usize,
        i: usize,
        j: usize,
    }

    impl<T: Copy> Tile<'_, T> {
        /// `out[i + b][j + a] = Σ_c w[j + a][c] · x[i + b][c]` for a < W, b < X.
        ///
        /// # Safety
        /// As [`job`], with the tile inside the job.
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn run<const W: usize, const X: usize>(
            &self,
            load: impl Fn(*const T) -> __m256,
            scalar: impl Fn(T) -> f32,
        ) {
            let (k, full) = (self.k, self.k / 8 * 8);
            // SAFETY: (whole body) W rows of w and rows i..i + X of x exist, every
            // column read is < k, and the outputs written are this job's.
            unsafe {
                let wp: [*const T; W] = std::array::from_fn(|a| self.w.as_ptr().add(a * k));
                let xp: [*const f32; X] = std::array::from_fn(|b| self.x.as_ptr().add((self.i + b) * k));
                let mut acc = [[_mm256_setzero_ps(); W]; X];
                let mut c = 0;
                while c < full {
                    // W weight vectors, then one activation vector at a time: 12
                    // accumulators + 3 + 1 fill the 16 registers (activations first
                    // would need 17, and the spilled accumulator halved the rate).
                    let wv: [__m256; W] = std::array::from_fn(|a| load(wp[a].add(c)));
                    for b in 0..X {
                        let xv = _mm256_loadu_ps(xp[b].add(c));
                        for a in 0..W {
                            acc[b][a] = _mm256_fmadd_ps(wv[a], xv, acc[b][a]);
                        }
                    }
                    c += 8;
                }
                for b in 0..X {
                    let o = self.out.get().add((self.i + b) * self.n + self.j);
                    for a in 0..W {
                        *o.add(a) = lane_sum(acc[b][a], (full..k).map(|t| scalar(*wp[a].add(t)) * *xp[b].add(t)));
                    }
                }
            }
        }
    }

    /// [`job`] for f16, bf16 or f32 weights (quantized ones compute nothing).
    ///
    /// # Safety
    /// As [`job`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn weights_job(
        out: SendPtr,
        x: &[f32],
        w: WSlice,
        n: usize,
        k: usize,
        acts: Range<usize>,
        rows: Range<usize>,
    ) {
        // SAFETY: forwarded contract; the loads read 8 elements the tile's bounds allow.
        unsafe {
            match w {
                WSlice::F16(w) => job(out, x, w, n, k, acts, rows, |p: *const f16| load8_f16(p), f16::to_f32),
                WSlice::Bf16(w) => job(out, x, w, n, k, acts, rows, |p: *const bf16| load8_bf16(p), bf16::to_f32),
                WSlice::F32(w) => job(out, x, w, n, k, acts, rows, |p: *const f32| _mm256_loadu_ps(p), |v| v),
                WSlice::Quant(..) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::*;
    use half::{bf16, f16};
    use tessera_quant::GgmlType;

    /// Every tile shape (weight rows: 2 jobs + 5, activation rows up to 3 blocks
    /// with short tiles), columns with and without a tail, f16, bf16 and quantized
    /// weights: close to the f64 sum of the weights as stored, and each row
    /// bit-identical to the same row computed alone.
    #[test]
    fn tiles_match_naive_and_rows_are_independent() {
        if !available() {
            eprintln!("skipped: no AVX2 on this CPU (linear() does not call this kernel here)");
            return;
        }
        let n = 2 * JOB_ROWS + 5;
        for &k in &[45, 1024, 1031] {
            for &m in &[1, 2, 3, 5, 71, 150] {
                let mut rng = Rng((m * 7 + k) as u64);
                let x = rng.vec(m * k);
                let w32 = rng.vec(n * k);
                let w16: Vec<f16> = w32.iter().map(|&v| f16::from_f32(v)).collect();
                let wb: Vec<bf16> = w32.iter().map(|&v| bf16::from_f32(v)).collect();
                let mut weights = vec![WSlice::F16(&w16), WSlice::Bf16(&wb)];
                let quantized: Vec<(GgmlType, Vec<u8>)> = if k % 32 == 0 {
                    [GgmlType::Q4_0, GgmlType::Q8_0]
                        .into_iter()
                        .map(|ty| {
                            let mut q = vec![0u8; n * k / 32 * ty.block_bytes() as usize];
                            tessera_quant::quantize(ty, &w32, &mut q).unwrap();
                            (ty, q)
                        })
                        .collect()
                } else {
                    Vec::new()
                };
                weights.extend(quantized.iter().map(|(ty, q)| WSlice::Quant(*ty, q)));
                for w in weights {
                    let what = match w {
                        WSlice::Quant(ty, _) => ty.to_string(),
                        WSlice::Bf16(_) => "bf16".into(),
                        _ => "f16".into(),
                    };
                    assert_tiles_match_naive(linear, &x, w, (m, n, k), &format!("{what} m={m} k={k}"));
                }
            }
        }
    }
}
