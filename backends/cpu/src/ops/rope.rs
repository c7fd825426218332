//! Rotary position embedding, HF "rotate half" convention, with Llama-3 and linear
//! frequency scaling.

use rayon::prelude::*;
use tessera_kernel_abi::{TK_ROPE_LINEAR, TK_ROPE_LLAMA3, TK_ROPE_NONE, TkRope};

use crate::error::{KernelError, Result};
use crate::invalid;

/// The (scaled) inverse frequencies, `head_dim / 2` of them, as HF computes them.
pub fn inv_freq(rope: &TkRope, head_dim: usize) -> Result<Vec<f32>> {
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(invalid!("head_dim = {head_dim} must be even and positive"));
    }
    if !(rope.theta.is_finite() && rope.theta > 0.0) {
        return Err(invalid!("rope.theta = {} must be positive", rope.theta));
    }
    let base: Vec<f32> =
        (0..head_dim / 2).map(|i| 1.0 / (rope.theta as f64).powf((2 * i) as f64 / head_dim as f64) as f32).collect();
    match rope.scaling {
        TK_ROPE_NONE => Ok(base),
        TK_ROPE_LINEAR => {
            if !(rope.factor.is_finite() && rope.factor > 0.0) {
                return Err(invalid!("rope.factor = {} must be positive", rope.factor));
            }
            Ok(base.iter().map(|f| f / rope.factor).collect())
        }
        TK_ROPE_LLAMA3 => {
            let (factor, lo, hi) = (rope.factor, rope.low_freq_factor, rope.high_freq_factor);
            let old = rope.original_max_position as f32;
            if !(factor.is_finite() && factor > 0.0) {
                return Err(invalid!("rope.factor = {factor} must be positive"));
            }
            if !(lo > 0.0 && hi > lo) || old <= 0.0 {
                return Err(invalid!(
                    "llama3 rope needs 0 < low_freq_factor ({lo}) < high_freq_factor ({hi}) \
                     and original_max_position ({}) > 0",
                    rope.original_max_position
                ));
            }
            let low_wl = old / lo;
            let high_wl = old / hi;
            Ok(base
                .iter()
                .map(|&f| {
                    let wl = 2.0 * std::f32::consts::PI / f;
                    if wl < high_wl {
                        f
                    } else if wl > low_wl {
                        f / factor
                    } else {
                        let s = (old / wl - lo) / (hi - lo);
                        (1.0 - s) * f / factor + s * f
                    }
                })
                .collect())
        }
        s => Err(KernelError::Unsupported(format!("rope.scaling = {s} is unknown (0 none, 1 llama3, 2 linear)"))),
    }
}

fn rotate(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    let (a, b) = x.split_at_mut(half);
    for i in 0..half {
        let (x1, x2) = (a[i], b[i]);
        a[i] = x1 * cos[i] - x2 * sin[i];
        b[i] = x2 * cos[i] + x1 * sin[i];
    }
}

/// Applies rope in place to q `[n][num_heads][head_dim]` and k `[n][num_kv_heads][head_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn apply_rotary_pos_emb(
    q: &mut [f32],
    k: &mut [f32],
    positions: &[i32],
    n: usize,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    rope: &TkRope,
) -> Result<()> {
    let inv = inv_freq(rope, head_dim)?;
    if n == 0 {
        return Ok(());
    }
    let half = head_dim / 2;
    let qs = num_heads * head_dim;
    let ks = num_kv_heads * head_dim;
    let apply = |pos: i32, rows: &mut [f32]| {
        let mut cos = vec![0.0f32; half];
        let mut sin = vec![0.0f32; half];
        for i in 0..half {
            let a = pos as f32 * inv[i];
            cos[i] = a.cos();
            sin[i] = a.sin();
        }
        for h in rows.chunks_exact_mut(head_dim) {
            rotate(h, &cos, &sin);
        }
    };
    if qs > 0 {
        q[..n * qs].par_chunks_mut(qs).zip(positions[..n].par_iter()).for_each(|(r, &p)| apply(p, r));
    }
    if ks > 0 {
        k[..n * ks].par_chunks_mut(ks).zip(positions[..n].par_iter()).for_each(|(r, &p)| apply(p, r));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::*;

    /// HF `_compute_llama3_parameters`, written out in f64.
    fn naive_inv_freq(rope: &TkRope, d: usize) -> Vec<f64> {
        let base: Vec<f64> = (0..d / 2).map(|i| 1.0 / (rope.theta as f64).powf(2.0 * i as f64 / d as f64)).collect();
        match rope.scaling {
            TK_ROPE_LINEAR => base.iter().map(|f| f / rope.factor as f64).collect(),
            TK_ROPE_LLAMA3 => {
                let old = rope.original_max_position as f64;
                let (fac, lo, hi) = (rope.factor as f64, rope.low_freq_factor as f64, rope.high_freq_factor as f64);
                base.iter()
                    .map(|&f| {
                        let wl = 2.0 * std::f64::consts::PI / f;
                        let scaled = if wl > old / lo { f / fac } else { f };
                        let medium = wl >= old / hi && wl <= old / lo;
                        if medium {
                            let s = (old / wl - lo) / (hi - lo);
                            (1.0 - s) * scaled / fac + s * scaled
                        } else {
                            scaled
                        }
                    })
                    .collect()
            }
            _ => base,
        }
    }

    fn naive(x: &[f32], pos: &[i32], heads: usize, d: usize, inv: &[f64]) -> Vec<f32> {
        let mut out = x.to_vec();
        for (t, &p) in pos.iter().enumerate() {
            for h in 0..heads {
                let o = (t * heads + h) * d;
                for i in 0..d / 2 {
                    let a = p as f64 * inv[i];
                    let (x1, x2) = (x[o + i] as f64, x[o + i + d / 2] as f64);
                    out[o + i] = (x1 * a.cos() - x2 * a.sin()) as f32;
                    out[o + i + d / 2] = (x2 * a.cos() + x1 * a.sin()) as f32;
                }
            }
        }
        out
    }

    #[test]
    fn rope_matches_naive_all_scalings() {
        let mut rng = Rng(3);
        let ropes = [
            TkRope { theta: 10000.0, ..Default::default() },
            TkRope { theta: 500000.0, scaling: TK_ROPE_LINEAR, factor: 4.0, ..Default::default() },
            TkRope {
                theta: 500000.0,
                scaling: TK_ROPE_LLAMA3,
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 8192,
            },
        ];
        for rope in &ropes {
            for &(n, h, kvh, d) in &[(1, 1, 1, 2), (5, 4, 2, 64), (3, 8, 2, 128)] {
                let q = rng.vec(n * h * d);
                let k = rng.vec(n * kvh * d);
                let pos: Vec<i32> = (0..n).map(|_| rng.below(3000) as i32).collect();
                let (mut q2, mut k2) = (q.clone(), k.clone());
                apply_rotary_pos_emb(&mut q2, &mut k2, &pos, n, h, kvh, d, rope).unwrap();
                let inv = naive_inv_freq(rope, d);
                let got: Vec<f64> = inv_freq(rope, d).unwrap().iter().map(|&v| v as f64).collect();
                for (g, w) in got.iter().zip(&inv) {
                    assert!((g - w).abs() <= 1e-6 * w.abs(), "inv_freq {g} vs {w}");
                }
                // Angles up to ~3000 rad in f32 lose ~1e-4 absolute.
                assert_close(&q2, &naive(&q, &pos, h, d, &inv), 2e-3, "rope q");
                assert_close(&k2, &naive(&k, &pos, kvh, d, &inv), 2e-3, "rope k");
            }
        }
    }

    #[test]
    fn rope_rejects_bad_config() {
        let r = TkRope { theta: 10000.0, scaling: 9, ..Default::default() };
        assert!(matches!(inv_freq(&r, 8), Err(KernelError::Unsupported(_))));
        let r = TkRope { theta: 10000.0, ..Default::default() };
        assert!(inv_freq(&r, 7).is_err());
    }
}
