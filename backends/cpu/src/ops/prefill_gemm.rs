//! Linear layers for prompts (more activation rows than a decode batch) on AVX-512: a
//! cache-blocked GEMM in the manner of BLIS, for weights of every storage type.
//!
//! - The activations are packed once per call into panels of 64 rows, transposed so
//!   that each column step is 4 contiguous vectors (`xp[panel][kk][64]`).
//! - Each task takes `NC` weight rows. For each block of `KC` columns it converts those
//!   rows to f32 once (dequantizing quantized weights once per call, not once per panel
//!   of activations), in groups of `J` rows (`wp[row][kk]`): a micro-kernel's
//!   broadcasts walk `J` short rows (6 KiB) that stay in L1.
//! - The micro-kernel keeps a 64 x `J` tile of the output in 24 registers across the
//!   block's columns: per column, 4 activation vectors (from L2) and `J` broadcasts feed
//!   24 FMAs. The task's output columns accumulate across blocks in a transposed tile
//!   (`ct[row][activation]`), written to the output once at the end.
//!
//! The `gemm` crate runs AVX2 kernels only, and converting weight tiles for it cost a
//! second copy; on the bench model's prompts this kernel is the faster of the two.

use std::cell::RefCell;

use rayon::prelude::*;

use super::SendPtr;
use crate::dtype::WSlice;

/// Activation rows per panel (4 vectors of 16).
const MR: usize = 64;
/// Weight rows per micro-kernel (broadcast operands).
const J: usize = 6;
/// Weight rows per task: 8 micro-kernel groups.
const NC: usize = 8 * J;
/// Columns per block: one group's packed panel is 6 KiB and one activation panel 64 KiB.
const KC: usize = 256;

/// The most packed activations (f32 values) kept between calls: 64 MiB, a 2,048-token
/// chunk of an 8,192-wide layer. Longer ones are allocated for their call only.
const KEEP_PACKED: usize = 16 << 20;

/// True when the AVX-512 kernel can run here.
pub fn available() -> bool {
    super::small_batch::available()
}

/// `out[m][n] = x[m][k] · w[n][k]ᵀ`. Callers check `available()` and the slice lengths
/// (`out >= m*n`, `x >= m*k`, `w >= n*k`); quantized `w` needs `KC` to be a whole number
/// of its blocks and rows of whole blocks, as every supported format has.
pub fn linear(out: &mut [f32], x: &[f32], w: WSlice, m: usize, n: usize, k: usize) {
    assert!(available());
    assert!(out.len() >= m * n && x.len() >= m * k && w.len() >= n * k);
    if m == 0 || n == 0 || k == 0 {
        out[..m * n].fill(0.0);
        return;
    }
    let panels = m.div_ceil(MR);
    let m_pad = panels * MR;
    // The buffers of the last call are reused (fresh ones of this size are pages the
    // kernel must map and zero on every call). Rows past m in the last panel keep old
    // values: they only reach output rows that are never written out.
    thread_local! {
        static PACKED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
        static TASK: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
    }
    let mut xp = PACKED.with(|b| b.try_borrow_mut().map(|mut b| std::mem::take(&mut *b)).unwrap_or_default());
    if xp.len() < panels * k * MR {
        xp.resize(panels * k * MR, 0.0);
    }
    xp.par_chunks_mut(k * MR).take(panels).enumerate().for_each(|(p, panel)| {
        let rows = MR.min(m - p * MR);
        for i in 0..rows {
            let row = &x[(p * MR + i) * k..][..k];
            for (kk, &v) in row.iter().enumerate() {
                panel[kk * MR + i] = v;
            }
        }
    });
    let xp_all = &xp[..];
    let optr = SendPtr(out.as_mut_ptr());
    (0..n.div_ceil(NC)).into_par_iter().for_each(|task| {
        TASK.with(|scratch| {
            let mut fresh = (Vec::new(), Vec::new());
            let mut guard = scratch.try_borrow_mut().ok();
            let (wp, ct) = match guard.as_deref_mut() {
                Some(held) => held,
                None => &mut fresh,
            };
            wp.resize(wp.len().max(NC * KC), 0.0);
            ct.resize(ct.len().max(NC * m_pad), 0.0);
            let j0 = task * NC;
            let nc = NC.min(n - j0);
            let groups = nc.div_ceil(J);
            for k0 in (0..k).step_by(KC) {
                let kc = KC.min(k - k0);
                for jj in 0..groups * J {
                    let row = &mut wp[jj * kc..][..kc];
                    if jj < nc {
                        w.to_f32((j0 + jj) * k + k0, row);
                        // The next block of this row comes from DRAM while this one is
                        // computed.
                        prefetch(w.byte_range((j0 + jj) * k + k0 + kc, (j0 + jj) * k + (k0 + kc + KC).min(k)));
                    } else {
                        row.fill(0.0);
                    }
                }
                for p in 0..panels {
                    let vecs = (m - p * MR).min(MR).div_ceil(16);
                    let xpanel = &xp_all[p * k * MR + k0 * MR..][..kc * MR];
                    for g in 0..groups {
                        let wpanel = &wp[g * kc * J..][..kc * J];
                        let tile = &mut ct[g * J * m_pad + p * MR..];
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: avx512f was checked (asserted above); `xpanel` holds
                        // kc * MR values, `wpanel` kc * J, and `tile` reaches the J rows
                        // of m_pad values from its start, each of which the last panel
                        // still covers with its `vecs` vectors.
                        unsafe {
                            x86::kernel(vecs, xpanel, wpanel, kc, tile, m_pad, k0 == 0)
                        };
                    }
                }
            }
            for i in 0..m {
                for jj in 0..nc {
                    // SAFETY: (i, j0 + jj) is inside the m x n output, and this task
                    // alone writes columns [j0, j0 + nc).
                    unsafe { *optr.get().add(i * n + j0 + jj) = ct[jj * m_pad + i] };
                }
            }
        })
    });
    if xp.len() <= KEEP_PACKED {
        PACKED.with(|b| {
            if let Ok(mut b) = b.try_borrow_mut() {
                *b = xp;
            }
        });
    }
}

/// Asks for the lines of `bytes` to be brought into L2 (a hint: nothing is read).
fn prefetch(bytes: std::ops::Range<*const u8>) {
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
    #[cfg(target_arch = "x86_64")]
    {
        let mut at = bytes.start;
        while at < bytes.end {
            // SAFETY: a prefetch never faults and dereferences nothing.
            unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(at as *const i8) };
            at = at.wrapping_add(64);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{J, MR};

    /// `tile[j * ld + i] (+)= Σ_kk xp[kk * MR + i] * wp[j * kc + kk]` for `j < J` and
    /// `i < 16 * vecs`, added to the tile's values unless `first`.
    ///
    /// # Safety
    /// avx512f must be available; `xp` holds `kc * MR`, `wp` holds `kc * J` values, and
    /// `tile` holds `(J - 1) * ld + 16 * vecs`; `vecs` is 1 to 4.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn kernel(vecs: usize, xp: &[f32], wp: &[f32], kc: usize, tile: &mut [f32], ld: usize, first: bool) {
        debug_assert!(xp.len() >= kc * MR && wp.len() >= kc * J && tile.len() >= (J - 1) * ld + 16 * vecs);
        // SAFETY: forwarded contract.
        unsafe {
            match vecs {
                1 => tile_v::<1>(xp, wp, kc, tile, ld, first),
                2 => tile_v::<2>(xp, wp, kc, tile, ld, first),
                3 => tile_v::<3>(xp, wp, kc, tile, ld, first),
                _ => tile_v::<4>(xp, wp, kc, tile, ld, first),
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn tile_v<const V: usize>(xp: &[f32], wp: &[f32], kc: usize, tile: &mut [f32], ld: usize, first: bool) {
        let tp = tile.as_mut_ptr();
        // SAFETY: every offset below is within the lengths the caller guarantees.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); V]; J];
            if !first {
                for (j, a) in acc.iter_mut().enumerate() {
                    for (v, r) in a.iter_mut().enumerate() {
                        *r = _mm512_loadu_ps(tp.add(j * ld + v * 16));
                    }
                }
            }
            let (xptr, wptr) = (xp.as_ptr(), wp.as_ptr());
            for kk in 0..kc {
                let xs: [__m512; V] = std::array::from_fn(|v| _mm512_loadu_ps(xptr.add(kk * MR + v * 16)));
                for (j, a) in acc.iter_mut().enumerate() {
                    let b = _mm512_set1_ps(*wptr.add(j * kc + kk));
                    for v in 0..V {
                        a[v] = _mm512_fmadd_ps(xs[v], b, a[v]);
                    }
                }
            }
            for (j, a) in acc.iter().enumerate() {
                for (v, r) in a.iter().enumerate() {
                    _mm512_storeu_ps(tp.add(j * ld + v * 16), *r);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::*;
    use half::{bf16, f16};

    fn naive(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k).map(|kk| x[i * k + kk] as f64 * w[j * k + kk] as f64).sum();
                out[i * n + j] = s as f32;
            }
        }
        out
    }

    #[test]
    fn blocks_panels_and_tasks_of_every_size_match_naive() {
        if !available() {
            eprintln!("skipped: no AVX-512 on this CPU (linear's tests cover the gemm crate path)");
            return;
        }
        // m: a partial last panel of 1 to 4 vectors and whole panels; n: tasks of NC
        // rows with a short last group; k: one block, whole blocks, a short last block.
        for &(m, n, k) in &[(65, 7, 40), (100, 50, 256), (128, 97, 600), (191, 49, 513), (64 * 3 + 48, 13, 300)] {
            let mut rng = Rng((m * 1000 + n * 10 + k) as u64);
            let x = rng.vec(m * k);
            let w32 = rng.vec(n * k);
            let w16: Vec<f16> = w32.iter().map(|&v| f16::from_f32(v)).collect();
            let wb: Vec<bf16> = w32.iter().map(|&v| bf16::from_f32(v)).collect();
            for (name, w) in [("f32", WSlice::F32(&w32)), ("f16", WSlice::F16(&w16)), ("bf16", WSlice::Bf16(&wb))] {
                let want = naive(&x, &w.to_vec_f32(), m, n, k);
                let mut out = vec![f32::NAN; m * n];
                linear(&mut out, &x, w, m, n, k);
                assert_close(&out, &want, 2e-6 * (k as f32).sqrt() + 1e-5, &format!("m={m} n={n} k={k} {name}"));
            }
        }
    }
}
