//! RMS norm and the fused residual-add + RMS norm.

use rayon::prelude::*;

use crate::dtype::WSlice;

fn norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f32 = crate::simd::dot(x, x);
    let inv = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    for ((o, xi), wi) in out.iter_mut().zip(x).zip(w) {
        *o = xi * inv * wi;
    }
}

/// `out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * weight` for `n` rows of `hidden`.
pub fn rms_norm(out: &mut [f32], x: &[f32], weight: WSlice, n: usize, hidden: usize, eps: f32) {
    if n == 0 || hidden == 0 {
        return;
    }
    let w = weight.to_vec_f32();
    out[..n * hidden]
        .par_chunks_mut(hidden)
        .zip(x[..n * hidden].par_chunks(hidden))
        .for_each(|(o, xr)| norm_row(xr, &w, eps, o));
}

/// `residual += x; out = rms_norm(residual) * weight`.
pub fn add_rms_norm(
    residual: &mut [f32],
    x: &[f32],
    weight: WSlice,
    out: &mut [f32],
    n: usize,
    hidden: usize,
    eps: f32,
) {
    if n == 0 || hidden == 0 {
        return;
    }
    let w = weight.to_vec_f32();
    residual[..n * hidden]
        .par_chunks_mut(hidden)
        .zip(x[..n * hidden].par_chunks(hidden))
        .zip(out[..n * hidden].par_chunks_mut(hidden))
        .for_each(|((r, xr), o)| {
            for (ri, xi) in r.iter_mut().zip(xr) {
                *ri += xi;
            }
            norm_row(r, &w, eps, o);
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::*;
    use half::{bf16, f16};

    fn naive(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
        let h = w.len();
        let mut out = vec![0.0; x.len()];
        for (r, o) in x.chunks(h).zip(out.chunks_mut(h)) {
            let ms = r.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>() / h as f64;
            let inv = 1.0 / (ms + eps as f64).sqrt();
            for j in 0..h {
                o[j] = (r[j] as f64 * inv * w[j] as f64) as f32;
            }
        }
        out
    }

    #[test]
    fn rms_norm_matches_naive_all_dtypes() {
        let mut rng = Rng(7);
        for &(n, h) in &[(1, 1), (3, 17), (5, 64), (2, 1000)] {
            let x = rng.vec(n * h);
            let w32 = rng.vec(h);
            let w16: Vec<f16> = w32.iter().map(|&v| f16::from_f32(v)).collect();
            let wb: Vec<bf16> = w32.iter().map(|&v| bf16::from_f32(v)).collect();
            for w in [WSlice::F32(&w32), WSlice::F16(&w16), WSlice::Bf16(&wb)] {
                let wf = w.to_vec_f32();
                let mut out = vec![0.0; n * h];
                rms_norm(&mut out, &x, w, n, h, 1e-5);
                assert_close(&out, &naive(&x, &wf, 1e-5), 1e-4, "rms_norm");

                let mut res = rng.vec(n * h);
                let sum: Vec<f32> = res.iter().zip(&x).map(|(a, b)| a + b).collect();
                let mut out2 = vec![0.0; n * h];
                add_rms_norm(&mut res, &x, w, &mut out2, n, h, 1e-6);
                assert_close(&res, &sum, 1e-6, "add_rms_norm residual");
                assert_close(&out2, &naive(&sum, &wf, 1e-6), 1e-4, "add_rms_norm out");
            }
        }
    }
}
