//! Linear layers for decode batches (up to 64 activation rows) of narrow layers on
//! AVX-512 (see [`takes`]): the activations are transposed once into `xt[k][m_pad]`
//! (small), each group of weight rows is converted to f32 once (no transpose — a plain
//! contiguous conversion), and a register-blocked kernel accumulates `out[i][j]` for up
//! to 64 rows `i` (as 1–4 vectors) times 6–12 weight rows `j` (broadcast) over the full
//! k. Weights are read from memory once per call, which is what a decode step must do;
//! everything else stays in cache.

use rayon::prelude::*;

use super::{SendPtr, prefetch};
use crate::dtype::WSlice;

/// The largest m this kernel serves (4 vectors of 16 lanes).
pub const MAX_M: usize = 64;

/// The most bytes of transposed activations (`k` x `m` rounded up to 16 rows, f32) it
/// takes: every group of weight rows streams them from L2, and past about a fifth of
/// Zen 4's 1 MiB they lost to the cache-blocked GEMM (bench model, ms per decode step,
/// in turns, 24 rows 352-407 for the GEMM against 414-426 with 256 KiB at 2,048 columns
/// and 1 MiB at 8,192; SmolLM2 at Q4_1, whose layers are 576 and 1,536 wide, 32 rows
/// 70-72 here against 75 for the GEMM, 48 rows 106-112 against 112-133).
const MAX_XT_BYTES: usize = 192 << 10;

/// True when this kernel takes `m` rows of `k` columns: `m <= MAX_M` and the transposed
/// activations within `MAX_XT_BYTES`.
pub fn takes(m: usize, k: usize) -> bool {
    m <= MAX_M && k * m.div_ceil(16) * 16 * 4 <= MAX_XT_BYTES
}

/// True when the AVX-512 kernel can run here.
pub fn available() -> bool {
    crate::simd::has_avx512()
}

/// `out[m][n] = x[m][k] · w[n][k]ᵀ` for `m <= MAX_M`. Callers check `available()` and
/// the slice lengths (`out >= m*n`, `x >= m*k`, `w >= n*k`).
pub fn linear(out: &mut [f32], x: &[f32], w: WSlice, m: usize, n: usize, k: usize) {
    assert!((1..=MAX_M).contains(&m) && available());
    assert!(out.len() >= m * n && x.len() >= m * k && w.len() >= n * k);
    let vecs = m.div_ceil(16);
    let m_pad = vecs * 16;
    let mut xt = vec![0.0f32; k * m_pad];
    for i in 0..m {
        for (kk, &v) in x[i * k..(i + 1) * k].iter().enumerate() {
            xt[kk * m_pad + i] = v;
        }
    }
    let rows_per_group = match vecs {
        1 | 2 => 12,
        3 => 8,
        _ => 6,
    };
    let groups = n.div_ceil(rows_per_group);
    // Several groups per task so the task overhead stays small next to the work.
    let groups_per_task = (65536 / (rows_per_group * k * m_pad / 16).max(1)).clamp(1, 16);
    let optr = SendPtr(out.as_mut_ptr());
    let xt = &xt[..];
    (0..groups.div_ceil(groups_per_task)).into_par_iter().for_each_init(
        || vec![0.0f32; rows_per_group * k],
        |wbuf, task| {
            let g_end = ((task + 1) * groups_per_task).min(groups);
            for g in task * groups_per_task..g_end {
                let j0 = g * rows_per_group;
                let rows = rows_per_group.min(n - j0);
                // The next group's weights come from DRAM while this one is computed
                // (its rows follow this group's in memory).
                if g + 1 < g_end {
                    prefetch(w.byte_range((j0 + rows) * k, (j0 + rows + rows_per_group).min(n) * k));
                }
                let wf: &[f32] = match w {
                    WSlice::F32(s) => &s[j0 * k..(j0 + rows) * k],
                    _ => {
                        w.to_f32(j0 * k, &mut wbuf[..rows * k]);
                        &wbuf[..rows * k]
                    }
                };
                let mut tile = [0.0f32; MAX_M * 12];
                #[cfg(target_arch = "x86_64")]
                // SAFETY: avx512f was checked by the caller (asserted above); `xt` holds
                // k * m_pad values, `wf` holds rows * k, `tile` holds rows * m_pad.
                unsafe {
                    x86::tile(vecs, xt, m_pad, wf, rows, k, &mut tile);
                }
                for jj in 0..rows {
                    for i in 0..m {
                        // SAFETY: (i, j0 + jj) is inside the m x n output, and this task
                        // alone writes columns [j0, j0 + rows).
                        unsafe { *optr.get().add(i * n + j0 + jj) = tile[jj * m_pad + i] };
                    }
                }
            }
        },
    );
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// `tile[jj * m_pad + i] = Σ_kk xt[kk * m_pad + i] * w[jj * k + kk]` for `jj < rows`.
    ///
    /// # Safety
    /// avx512f must be available; `xt` holds `k * m_pad`, `w` holds `rows * k`, `tile`
    /// holds `rows * m_pad` values, `m_pad == vecs * 16`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn tile(vecs: usize, xt: &[f32], m_pad: usize, w: &[f32], rows: usize, k: usize, tile: &mut [f32]) {
        debug_assert!(xt.len() >= k * m_pad && w.len() >= rows * k && tile.len() >= rows * m_pad);
        // SAFETY: forwarded contract.
        unsafe {
            match (vecs, rows) {
                (1, 12) => kernel::<1, 12>(xt, m_pad, w, k, tile),
                (2, 12) => kernel::<2, 12>(xt, m_pad, w, k, tile),
                (3, 8) => kernel::<3, 8>(xt, m_pad, w, k, tile),
                (4, 6) => kernel::<4, 6>(xt, m_pad, w, k, tile),
                // A short last group: one row at a time.
                _ => {
                    for jj in 0..rows {
                        let (w1, t1) = (&w[jj * k..], &mut tile[jj * m_pad..]);
                        match vecs {
                            1 => kernel::<1, 1>(xt, m_pad, w1, k, t1),
                            2 => kernel::<2, 1>(xt, m_pad, w1, k, t1),
                            3 => kernel::<3, 1>(xt, m_pad, w1, k, t1),
                            _ => kernel::<4, 1>(xt, m_pad, w1, k, t1),
                        }
                    }
                }
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn kernel<const V: usize, const J: usize>(xt: &[f32], m_pad: usize, w: &[f32], k: usize, tile: &mut [f32]) {
        let mut acc = [[_mm512_setzero_ps(); V]; J];
        let xp = xt.as_ptr();
        let wp = w.as_ptr();
        for kk in 0..k {
            // SAFETY: kk < k, v < V (m_pad = 16 V), j < J rows of k: all in bounds.
            unsafe {
                let mut xv = [_mm512_setzero_ps(); V];
                for (v, x) in xv.iter_mut().enumerate() {
                    *x = _mm512_loadu_ps(xp.add(kk * m_pad + v * 16));
                }
                for (j, a) in acc.iter_mut().enumerate() {
                    let b = _mm512_set1_ps(*wp.add(j * k + kk));
                    for v in 0..V {
                        a[v] = _mm512_fmadd_ps(xv[v], b, a[v]);
                    }
                }
            }
        }
        for (j, a) in acc.iter().enumerate() {
            for (v, r) in a.iter().enumerate() {
                // SAFETY: j < J rows of m_pad in tile.
                unsafe { _mm512_storeu_ps(tile.as_mut_ptr().add(j * m_pad + v * 16), *r) };
            }
        }
    }
}
