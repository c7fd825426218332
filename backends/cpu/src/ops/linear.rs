//! `out[m][n] = x[m][k] . w[n][k]^T (+ bias)`: a SIMD GEMV (passes of up to 8 rows each:
//! up to four on AVX-512, two elsewhere), an AVX-512 register-blocked kernel for decode
//! batches of narrow layers ([`small_batch`]), and an AVX-512 cache-blocked GEMM for
//! the rest, wide layers' decode batches and prompts ([`prefill_gemm`]), except f16
//! weights in f32 arithmetic where AVX-512 runs on 256-bit units (Zen 4): past the GEMV
//! passes (decode batches from 33 rows, prompts) those take AVX2's [`panel_tiles`] (see
//! `avx2_panels`). On AVX2, f16 weights take
//! [`panel_tiles`] from `PANEL_TILES_MIN_M` rows up (prompts and mixed steps); below
//! that, and for bf16 and quantized weights at any size, [`dot_tiles`] from
//! `AVX2_TILES_MIN_M` rows up (see `avx2_tiles`); that GEMM takes f32 weights' decode
//! batches (17 to 64 rows). Elsewhere, the `gemm` crate (directly for f32 weights; on f32 tiles
//! of converted weight rows for f16/bf16 weights). Quantized weights take [`quant`]'s
//! integer kernels up to `QUANT_MAX_M` rows (decode; fewer on AVX2), and dequantized
//! tiles through the float paths beyond (prefill, where the tile's conversion is shared
//! by every row).

use gemm::Parallelism;
use rayon::prelude::*;
use tessera_quant::GgmlType;

use super::prefill_gemm::Precision;
use super::{SendPtr, Strided, dot_tiles, matmul, panel_tiles, prefill_gemm, quant, small_batch};
use crate::dtype::WSlice;
use crate::simd;

/// Activation rows up to which quantized weights take the integer kernels (each pass of
/// `quant::MAX_M` rows reads the weights once).
const QUANT_MAX_M: usize = 2 * quant::MAX_M;

/// GEMV passes (of `simd::gemv_max_m()` rows each) before a call takes a GEMM: on AVX-512
/// four, where they beat the cache-blocked GEMM on f16 weights (bench model, 2 threads,
/// `bench engine` ms per decode step, in turns: 20 rows 216-260 against 350-364, 24 rows
/// 249-265 against 356-370, 32 rows 338-351 against 355-359; at 48 rows six passes would
/// tie it). Elsewhere two: AVX2 f32 weights' batches from 17 rows take the GEMM (f16,
/// bf16 and quantized weights take tiles or integer kernels before the GEMV is asked).
fn gemv_passes() -> usize {
    if simd::has_avx512() { 4 } else { 2 }
}

/// Activation rows up to which AVX2 takes [`prefill_gemm`] for f32 weights (decode
/// batches); prompts stay with the `gemm` crate there (see that module).
const AVX2_GEMM_MAX_M: usize = 64;

/// Activation rows from which [`dot_tiles`] take the weights they can on AVX2 without
/// AVX-512: there they beat the GEMV on f16/bf16 weights (bench model shapes, 2 threads,
/// in turns, time of the GEMV over the tiles: 2 rows 0.70-1.12, 3 rows 0.78-1.22, 4 rows
/// 1.01-1.30, 5 rows 0.78-1.25, 6 rows 1.06-1.26, 8 rows 1.14-1.69, 16 rows 1.20-1.57;
/// both sum each output in the same order, so the outputs are identical) and the integer
/// kernels on quantized weights (SmolLM2's linears at Q4_0, integer kernels over dot
/// tiles: 2 / 4 rows 0.75-0.79 / 0.77-0.87, 6 rows 1.01-1.07, 8 rows 1.14-1.21, 12 / 16
/// rows 1.39-1.54).
const AVX2_TILES_MIN_M: usize = 6;

/// Activation rows from which [`panel_tiles`] take f16 weights on AVX2 without AVX-512,
/// where their per-call packing has paid for itself (bench model shapes, 2 threads, in
/// turns, time of the dot tiles over the panels: 16 / 32 rows 0.79-0.94 / 0.81-0.92,
/// 48 rows 0.94-1.07, 64 rows 0.98-1.09, 96 rows 1.07-1.19, 168 to 2,000 rows
/// 1.07-1.19).
const PANEL_TILES_MIN_M: usize = 64;

/// True where [`panel_tiles`] take this call: f16 weights from `PANEL_TILES_MIN_M` rows
/// (prompts and mixed steps) on AVX2 without AVX-512, and in f32 arithmetic on AVX-512
/// that runs on 256-bit units (Zen 4) from the first row past the GEMV passes, where
/// these 256-bit tiles outrun the AVX-512 kernels. Bench model shapes, 2 threads, in
/// turns in one process, time of the tiles over the kernel they replace:
/// - prompts against the GEMM ([`prefill_gemm`]), medians of 15 calls of each
///   (`examples/bench prompt`): 178 rows 0.86-0.96, 64 rows 0.92-0.95, 512 rows
///   0.95-1.02. Both sum each output's products in column order with FMAs, so they
///   give the same bits;
/// - decode batches of 33 to 63 rows against [`small_batch`] and the GEMM, medians of
///   21 calls of each on weights cycled through from DRAM, two runs: 33 rows
///   0.72-0.89, 40 rows 0.73-1.00, 48 rows 0.91-1.00 (one 1.44), 56 rows 0.84-1.08,
///   63 rows 0.90-1.02. Up to 32 rows the GEMV passes stay ahead of the tiles (16 rows
///   1.24-1.37, 32 rows 1.03-1.20).
fn avx2_panels(w: WSlice, m: usize, precision: Precision) -> bool {
    if !panel_tiles::available() || !panel_tiles::takes(w) {
        return false;
    }
    if !simd::has_avx512() {
        m >= PANEL_TILES_MIN_M
    } else {
        simd::avx512_on_256_bit_units() && precision == Precision::F32 && m > gemv_passes() * simd::gemv_max_m()
    }
}

/// True where [`dot_tiles`] take this call: AVX2 without AVX-512, weights they take,
/// from `AVX2_TILES_MIN_M` rows, except Q5_0 / Q5_1, whose rows dequantize slowly (no
/// SIMD dequantizer): they keep the integer kernels through `QUANT_MAX_M` rows (768- and
/// 1,536-wide layers, in turns, integer kernels over tiles: Q5_0 / Q5_1 0.28-0.38 at 6
/// rows, 0.59-0.63 at 16; Q4_K 0.98 at 6, 1.09 at 8, 1.55 at 16; Q8_0 1.28 at 6; past 16
/// rows, the GEMM on dequantized weights over tiles: Q5_0 1.27 at 17, 1.11 at 32).
fn avx2_tiles(w: WSlice, m: usize) -> bool {
    if simd::has_avx512() || !dot_tiles::available() || !dot_tiles::takes(w) {
        return false;
    }
    match w {
        WSlice::Quant(GgmlType::Q5_0 | GgmlType::Q5_1, _) => m > QUANT_MAX_M,
        _ => m >= AVX2_TILES_MIN_M,
    }
}

/// Computes the linear layer. Slices must hold exactly `m*n`, `m*k`, `n*k` and `n`
/// (bias) elements; the FFI layer checks that. `precision` applies to prompts (the
/// cache-blocked GEMM); decode-sized calls compute in f32.
#[allow(clippy::too_many_arguments)] // the ABI call's own arguments
pub fn linear(
    out: &mut [f32],
    x: &[f32],
    w: WSlice,
    bias: Option<WSlice>,
    m: usize,
    n: usize,
    k: usize,
    precision: Precision,
) {
    assert!(out.len() >= m * n && x.len() >= m * k && w.len() >= n * k);
    if m == 0 || n == 0 {
        return;
    }
    let out = &mut out[..m * n];
    if k == 0 {
        out.fill(0.0);
    } else if avx2_panels(w, m, precision) {
        // f16 prompts on AVX2, and on Zen 4 f16 prompts and decode batches past the
        // GEMV passes: outer-product tiles on panels packed per job, at 90-96% of the
        // FMA peak where the dot tiles reach 75-86% (see PANEL_TILES_MIN_M) and
        // 0.86-0.96 of the AVX-512 GEMM's time (see avx2_panels).
        panel_tiles::linear(out, x, w, m, n, k);
    } else if avx2_tiles(w, m) {
        // f16 decode batches, bf16 and quantized weights on AVX2: dot-product tiles on
        // the weights as stored, faster than the GEMV (see AVX2_TILES_MIN_M), the
        // cache-blocked GEMM on decode batches (32 / 48 / 64 rows: 1.2-1.7 / 1.0-1.4 /
        // 1.1-1.3x) and the `gemm` crate on converted tiles on prompts (96 / 256 / 512
        // / 2,048 rows: 1.5 / 1.1-1.2 / 0.95-1.1 / 1.0-1.6x), bench model shapes, 2
        // threads, in turns.
        // Quantized weights: on rows dequantized per job, faster than the integer
        // kernels (idem) and the GEMMs on dequantized weights (SmolLM2 at Q4_0, in
        // turns: 17 / 32 / 64 / 71 rows 1.8 / 1.1-1.2 / 1.3 / 1.4x, 128-384 rows
        // 1.05-1.2x, 512 / 1,024 rows 0.83-1.07 / 0.99-1.15x).
        dot_tiles::linear(out, x, w, m, n, k);
    } else if let WSlice::Quant(ty, bytes) = w
        && quant::supports(ty)
        && m <= QUANT_MAX_M
    {
        quant::linear(out, x, ty, bytes, m, n, k, quant::Path::best());
    } else if m <= gemv_passes() * simd::gemv_max_m() && !matches!(w, WSlice::Quant(..)) {
        // GEMV passes over the weights (see `gemv_passes`): each pass reads the weights
        // once and feeds every value loaded to 8 rows' FMAs. On AVX2, against the
        // cache-blocked GEMM, as fast at 16 rows and faster at 12 (bench model, in
        // turns: 415 / 357 against 454 / 422 ms per step).
        let h = simd::gemv_max_m();
        for (o, xs) in out.chunks_mut(h * n).zip(x[..m * k].chunks(h * k)) {
            gemv(o, xs, w, xs.len() / k, n, k);
        }
    } else if small_batch::available() && small_batch::takes(m, k) {
        // Decode batches of narrow layers (quantized ones from 17 rows, float ones from
        // 33) on AVX-512: whole rows at a time, while the transposed activations stay
        // in L2 (see `small_batch::MAX_XT_BYTES`).
        small_batch::linear(out, x, w, m, n, k);
    } else if prefill_gemm::available() && (simd::has_avx512() || m <= AVX2_GEMM_MAX_M) {
        // Decode batches beyond the GEMV and prompts on AVX-512, decode batches on
        // AVX2: the cache-blocked GEMM, each weight converted or dequantized once per
        // call (see its module for why AVX2 prompts stay with the `gemm` crate). On
        // AVX-512 it takes wide layers' decode batches, where `small_batch`'s transposed
        // activations outgrow L2 (see `small_batch::MAX_XT_BYTES`; bench model, ms per
        // decode step, in turns: 48 rows 498-519 against 574-599, 64 rows 641-688
        // against 695-708).
        prefill_gemm::linear(out, x, w, m, n, k, precision);
    } else {
        match w {
            WSlice::F32(w) => gemm_f32(out, x, w, m, n, k),
            _ => gemm_tiled(out, x, w, m, n, k),
        }
    }
    if let Some(b) = bias {
        let b = b.to_vec_f32();
        out.par_chunks_mut(n).for_each(|row| {
            for (o, bi) in row.iter_mut().zip(&b) {
                *o += bi;
            }
        });
    }
}

fn gemv(out: &mut [f32], x: &[f32], w: WSlice, m: usize, n: usize, k: usize) {
    let threads = rayon::current_num_threads().max(1);
    // Enough chunks to balance, each large enough to amortise the task overhead.
    let chunk = n.div_ceil(threads * 8).max((16384 / k).clamp(1, 64)).max(1);
    if m == 1 {
        out.par_chunks_mut(chunk).enumerate().for_each(|(ci, o)| {
            let rows = o.len();
            simd::gemv(w, ci * chunk, rows, x, 1, k, o);
        });
        return;
    }
    // Results land as [n][m] (contiguous per chunk), then are transposed.
    let mut tmp = vec![0.0f32; n * m];
    // The kernels of several rows read them interleaved: done once here, not per task.
    let xil = simd::interleave_lanes(m).map(|lanes| simd::interleave(x, m, k, lanes));
    tmp.par_chunks_mut(chunk * m).enumerate().for_each(|(ci, o)| {
        let rows = o.len() / m;
        match &xil {
            Some(xil) => simd::gemv_interleaved(w, ci * chunk, rows, xil, m, k, o),
            None => simd::gemv(w, ci * chunk, rows, x, m, k, o),
        }
    });
    for (j, r) in tmp.chunks_exact(m).enumerate() {
        for (i, v) in r.iter().enumerate() {
            out[i * n + j] = *v;
        }
    }
}

fn gemm_f32(out: &mut [f32], x: &[f32], w: &[f32], m: usize, n: usize, k: usize) {
    let threads = rayon::current_num_threads();
    // SAFETY: out is m x n row-major (rs n, cs 1), x is m x k (rs k, cs 1), and
    // rhs(kk, j) = w[j * k + kk] (rs 1, cs k); the caller checked all lengths.
    unsafe {
        matmul(
            m,
            n,
            k,
            Strided { ptr: out.as_mut_ptr(), rs: n as isize, cs: 1 },
            Strided { ptr: x.as_ptr(), rs: k as isize, cs: 1 },
            Strided { ptr: w.as_ptr(), rs: 1, cs: k as isize },
            1.0,
            Parallelism::Rayon(threads),
        )
    }
}

/// Rows of weights converted per tile: about 512 KiB of f32.
fn tile_rows(k: usize) -> usize {
    ((256 * 1024) / k.max(1)).clamp(16, 256) / 16 * 16
}

fn gemm_tiled(out: &mut [f32], x: &[f32], w: WSlice, m: usize, n: usize, k: usize) {
    let tn = tile_rows(k);
    let tiles = n.div_ceil(tn);
    let optr = SendPtr(out.as_mut_ptr());
    (0..tiles).into_par_iter().for_each_init(
        || vec![0.0f32; tn * k],
        |scratch, t| {
            let j0 = t * tn;
            let rows = tn.min(n - j0);
            let buf = &mut scratch[..rows * k];
            w.to_f32(j0 * k, buf);
            // Solved transposed, outᵀ[j0.., :] = tile · xᵀ: a tall (rows x m) product
            // suits gemm's micro-kernels far better than a short m x rows one when m
            // is a decode batch (tens of rows).
            // SAFETY: this task writes only columns [j0, j0 + rows) of the m x n
            // output (dst(j, i) = out[i * n + j0 + j]), disjoint from every other task;
            // buf is rows x k row-major; rhs(kk, i) = x[i * k + kk].
            unsafe {
                matmul(
                    rows,
                    m,
                    k,
                    Strided { ptr: optr.get().add(j0), rs: 1, cs: n as isize },
                    Strided { ptr: buf.as_ptr(), rs: k as isize, cs: 1 },
                    Strided { ptr: x.as_ptr(), rs: 1, cs: k as isize },
                    1.0,
                    Parallelism::None,
                )
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::*;
    use half::{bf16, f16};
    use proptest::prelude::*;

    fn naive(x: &[f32], w: &[f32], b: Option<&[f32]>, m: usize, n: usize, k: usize) -> Vec<f32> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0f64;
                for kk in 0..k {
                    s += x[i * k + kk] as f64 * w[j * k + kk] as f64;
                }
                out[i * n + j] = (s + b.map_or(0.0, |b| b[j] as f64)) as f32;
            }
        }
        out
    }

    fn check(m: usize, n: usize, k: usize, dtype: u8, with_bias: bool, seed: u64) {
        let mut rng = Rng(seed | 1);
        let x = rng.vec(m * k);
        let w32 = rng.vec(n * k);
        let b32 = rng.vec(n);
        let w16: Vec<f16> = w32.iter().map(|&v| f16::from_f32(v)).collect();
        let wb: Vec<bf16> = w32.iter().map(|&v| bf16::from_f32(v)).collect();
        let b16: Vec<f16> = b32.iter().map(|&v| f16::from_f32(v)).collect();
        let bb: Vec<bf16> = b32.iter().map(|&v| bf16::from_f32(v)).collect();
        let (w, b) = match dtype {
            0 => (WSlice::F32(&w32), WSlice::F32(&b32)),
            1 => (WSlice::F16(&w16), WSlice::F16(&b16)),
            _ => (WSlice::Bf16(&wb), WSlice::Bf16(&bb)),
        };
        let (wf, bf) = (w.to_vec_f32(), b.to_vec_f32());
        let mut out = vec![f32::NAN; m * n];
        linear(&mut out, &x, w, with_bias.then_some(b), m, n, k, Precision::F32);
        let want = naive(&x, &wf, with_bias.then_some(&bf[..]), m, n, k);
        // Errors scale with sqrt(k) for sums of k products of magnitude <= 1.
        let tol = 2e-6 * (k as f32).sqrt() + 1e-5;
        assert_close(&out, &want, tol, &format!("linear m={m} n={n} k={k} dtype={dtype}"));
    }

    #[test]
    fn linear_fixed_shapes() {
        for &(m, n, k) in
            &[(1, 1, 1), (1, 37, 19), (2, 64, 64), (3, 130, 33), (4, 17, 200), (5, 33, 70), (32, 100, 300)]
        {
            for dt in 0..3 {
                check(m, n, k, dt, true, (m * 1000 + n * 10 + k) as u64);
                check(m, n, k, dt, false, 99 + dt as u64);
            }
        }
    }

    #[test]
    fn gemv_simd_matches_scalar() {
        let mut rng = Rng(77);
        let (n, k) = (9, 45);
        let w = rng.vec(n * k);
        let x = rng.vec(8 * k);
        for m in 1..=simd::gemv_max_m() {
            let mut a = vec![0.0; n * m];
            let mut b = vec![0.0; n * m];
            simd::gemv(WSlice::F32(&w), 1, n - 1, &x, m, k, &mut a);
            simd::gemv_scalar(WSlice::F32(&w), 1, n - 1, &x, m, k, &mut b);
            assert_close(&a, &b, 1e-5, "gemv");
        }
    }

    #[test]
    fn every_kernel_regime_matches_naive() {
        // m: each GEMV pass count (rows of 4, or 8 with AVX2/AVX-512; up to 4 passes on
        // AVX-512), each vector count of the decode-batch kernel (1..=16, 17..=32,
        // 33..=48, 49..=64: 67 columns keep its activations small), and the GEMM (65+).
        // n: full and short last row groups.
        for &m in &[1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 24, 25, 31, 32, 33, 48, 49, 64, 65, 80] {
            for &n in &[1, 11, 12, 25, 97] {
                for dt in 0..3 {
                    check(m, n, 67, dt, m % 2 == 0, (m * 131 + n) as u64);
                }
            }
        }
    }

    /// Where AVX-512 runs on 256-bit units, f16 weights in f32 arithmetic leave the GEMV
    /// passes for the panel tiles at the first row past them; bf16 arithmetic and other
    /// weights keep the AVX-512 kernels.
    #[test]
    fn zen4_takes_the_panel_tiles_past_the_gemv_passes() {
        if !(simd::has_avx512() && simd::avx512_on_256_bit_units() && panel_tiles::available()) {
            eprintln!("skipped: not AVX-512 on 256-bit units");
            return;
        }
        let (w16, w32) = (vec![f16::ZERO; 4], vec![0f32; 4]);
        let last_gemv = gemv_passes() * simd::gemv_max_m();
        assert!(!avx2_panels(WSlice::F16(&w16), last_gemv, Precision::F32));
        for m in [last_gemv + 1, 63, 64, 512] {
            assert!(avx2_panels(WSlice::F16(&w16), m, Precision::F32), "m={m}");
            assert!(!avx2_panels(WSlice::F16(&w16), m, Precision::Bf16), "m={m}, bf16 arithmetic");
            assert!(!avx2_panels(WSlice::F32(&w32), m, Precision::F32), "m={m}, f32 weights");
        }
    }

    #[test]
    fn wide_layers_decode_batches_take_the_gemm_and_match_naive() {
        // Columns enough that `small_batch` passes on AVX-512 (its transposed activations
        // past 192 KiB): the GEMM's last panel of 3 and 4 vectors at decode sizes (f16
        // weights on Zen 4: the panel tiles, past the GEMV passes).
        let k = 1100;
        for &m in &[33, 48, 49, 64] {
            assert!(!small_batch::takes(m, k), "m={m}: still the decode-batch kernel");
            for dt in 0..3 {
                check(m, 11, k, dt, m % 2 == 1, (m * 17 + dt as usize) as u64);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn linear_random_shapes(m in 1usize..40, n in 1usize..80, k in 1usize..150,
                                dt in 0u8..3, bias in any::<bool>(), seed in any::<u64>()) {
            check(m, n, k, dt, bias, seed);
        }
    }
}
