//! ggml's tensor types and their block layouts (`ggml-common.h`), with dequantization
//! to f32 following ggml's reference formulas (`dequantize_row_*` in `ggml-quants.c`).
//!
//! A quantized row is a run of blocks; each block holds `block_elements` values in
//! `block_bytes` bytes: f16 scales (and mins) followed by packed integers. Quantization
//! (`quantize`, for Q8_0 and Q4_0) follows `quantize_row_*_ref`, so a tensor quantized
//! here has the bytes llama.cpp's `llama-quantize` would write for it.
//!
//! Shared by the loader (GGUF files, load-time quantization) and the CPU kernel library
//! (which dequantizes tiles and unpacks blocks in its integer kernels).

use half::{bf16, f16};
use std::fmt;

/// The ggml tensor types Tessera reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GgmlType {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
}

/// Values per block of the k-quants.
pub const QK_K: usize = 256;

impl GgmlType {
    pub const ALL: [GgmlType; 11] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Bf16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ];

    /// ggml's `enum ggml_type` value.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::Bf16 => 30,
        }
    }

    pub fn from_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.into_iter().find(|t| t.id() == id)
    }

    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Bf16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
        }
    }

    pub fn supported_names() -> String {
        GgmlType::ALL.map(GgmlType::name).join(", ")
    }

    /// Values per block (1 for the plain float types).
    pub fn block_elements(self) -> u64 {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => 32,
            GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => QK_K as u64,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> u64 {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::Bf16 => 2,
            GgmlType::Q4_0 => 2 + 16,
            GgmlType::Q4_1 => 2 + 2 + 16,
            GgmlType::Q5_0 => 2 + 4 + 16,
            GgmlType::Q5_1 => 2 + 2 + 4 + 16,
            GgmlType::Q8_0 => 2 + 32,
            GgmlType::Q4K => 2 + 2 + 12 + QK_K as u64 / 2,
            GgmlType::Q5K => 2 + 2 + 12 + QK_K as u64 / 8 + QK_K as u64 / 2,
            GgmlType::Q6K => QK_K as u64 / 2 + QK_K as u64 / 4 + QK_K as u64 / 16 + 2,
        }
    }

    pub fn is_quantized(self) -> bool {
        self.block_elements() > 1
    }

    /// Bytes of one row of `k` values, or `None` when `k` is not a whole number of blocks
    /// (ggml quantizes rows block by block) or the size overflows.
    pub fn row_bytes(self, k: usize) -> Option<usize> {
        let n = self.block_elements() as usize;
        if !k.is_multiple_of(n) {
            return None;
        }
        (k / n).checked_mul(self.block_bytes() as usize)
    }

    /// The lower-case name used on command lines and in topology files (`q4_0`).
    pub fn lower_name(self) -> String {
        self.name().to_ascii_lowercase()
    }

    /// Dequantizes whole blocks: `out.len()` values from `bytes` (which must hold exactly
    /// `out.len() / block_elements` blocks; both lengths are the caller's to check).
    pub fn dequantize(self, bytes: &[u8], out: &mut [f32]) {
        let n = self.block_elements() as usize;
        let b = self.block_bytes() as usize;
        debug_assert_eq!(out.len() % n, 0);
        debug_assert_eq!(bytes.len(), out.len() / n * b);
        for (block, y) in bytes.chunks_exact(b).zip(out.chunks_exact_mut(n)) {
            match self {
                GgmlType::F32 => y[0] = f32::from_le_bytes([block[0], block[1], block[2], block[3]]),
                GgmlType::F16 => y[0] = f16_at(block, 0),
                GgmlType::Bf16 => y[0] = bf16::from_le_bytes([block[0], block[1]]).to_f32(),
                GgmlType::Q4_0 => dequantize_q4_0(block, y),
                GgmlType::Q4_1 => dequantize_q4_1(block, y),
                GgmlType::Q5_0 => dequantize_q5_0(block, y),
                GgmlType::Q5_1 => dequantize_q5_1(block, y),
                GgmlType::Q8_0 => dequantize_q8_0(block, y),
                GgmlType::Q4K => dequantize_q4_k(block, y),
                GgmlType::Q5K => dequantize_q5_k(block, y),
                GgmlType::Q6K => dequantize_q6_k(block, y),
            }
        }
    }
}

/// Quantizes `x` (a whole number of blocks) into `out` (exactly the bytes those blocks
/// take), as ggml's `quantize_row_q8_0_ref` / `quantize_row_q4_0_ref` do. Only the
/// formats Tessera quantizes to at load time are supported.
pub fn quantize(ty: GgmlType, x: &[f32], out: &mut [u8]) -> Result<(), String> {
    let n = ty.block_elements() as usize;
    let b = ty.block_bytes() as usize;
    if !x.len().is_multiple_of(n) || out.len() != x.len() / n * b {
        return Err(format!(
            "{} values do not fill {} blocks of {n} in {} bytes",
            x.len(),
            out.len() / b.max(1),
            out.len()
        ));
    }
    for (x, y) in x.chunks_exact(n).zip(out.chunks_exact_mut(b)) {
        match ty {
            GgmlType::Q8_0 => quantize_q8_0(x, y),
            GgmlType::Q4_0 => quantize_q4_0(x, y),
            other => return Err(format!("quantizing to {other} is not supported (q8_0 and q4_0 are)")),
        }
    }
    Ok(())
}

/// `d = max|x| / 127`, `q = round(x / d)`.
fn quantize_q8_0(x: &[f32], y: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    y[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    for (q, &v) in y[2..34].iter_mut().zip(x) {
        *q = (v * id).round() as i8 as u8;
    }
}

/// `d = x_maxabs / -8` (signed: the value of largest magnitude maps to nibble 0),
/// `nibble = min(15, trunc(x / d + 8.5))`.
fn quantize_q4_0(x: &[f32], y: &mut [u8]) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    y[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    for j in 0..16 {
        // As C's `(int8_t)(x*id + 8.5f)` then MIN(15, ..): truncation toward zero of a
        // value that is never below 0.5.
        let lo = ((x[j] * id + 8.5) as i8).min(15) as u8;
        let hi = ((x[j + 16] * id + 8.5) as i8).min(15) as u8;
        y[2 + j] = lo | (hi << 4);
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

fn f16_at(block: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([block[at], block[at + 1]]).to_f32()
}

/// `block_q4_0 { half d; uint8_t qs[16]; }`: x = (nibble - 8) * d; low nibbles are
/// values 0..16, high nibbles 16..32.
fn dequantize_q4_0(block: &[u8], y: &mut [f32]) {
    let d = f16_at(block, 0);
    let qs = &block[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0x0f) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

/// `block_q4_1 { half d; half m; uint8_t qs[16]; }`: x = nibble * d + m.
fn dequantize_q4_1(block: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(block, 0), f16_at(block, 2));
    let qs = &block[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0x0f) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

/// The 5th bits of the 32 values of a Q5 block: value j's in bit j of `qh`.
fn fifth_bits(qh: u32, j: usize) -> (u8, u8) {
    ((((qh >> j) << 4) & 0x10) as u8, ((qh >> (j + 12)) & 0x10) as u8)
}

/// `block_q5_0 { half d; uint8_t qh[4]; uint8_t qs[16]; }`: x = (5-bit value - 16) * d.
fn dequantize_q5_0(block: &[u8], y: &mut [f32]) {
    let d = f16_at(block, 0);
    let qh = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
    let qs = &block[6..22];
    for j in 0..16 {
        let (h0, h1) = fifth_bits(qh, j);
        y[j] = (((qs[j] & 0x0f) | h0) as i32 - 16) as f32 * d;
        y[j + 16] = (((qs[j] >> 4) | h1) as i32 - 16) as f32 * d;
    }
}

/// `block_q5_1 { half d; half m; uint8_t qh[4]; uint8_t qs[16]; }`: x = value * d + m.
fn dequantize_q5_1(block: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(block, 0), f16_at(block, 2));
    let qh = u32::from_le_bytes([block[4], block[5], block[6], block[7]]);
    let qs = &block[8..24];
    for j in 0..16 {
        let (h0, h1) = fifth_bits(qh, j);
        y[j] = ((qs[j] & 0x0f) | h0) as f32 * d + m;
        y[j + 16] = ((qs[j] >> 4) | h1) as f32 * d + m;
    }
}

/// `block_q8_0 { half d; int8_t qs[32]; }`: x = q * d.
fn dequantize_q8_0(block: &[u8], y: &mut [f32]) {
    let d = f16_at(block, 0);
    for (y, &q) in y.iter_mut().zip(&block[2..34]) {
        *y = q as i8 as f32 * d;
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K block's 12 scale bytes.
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// `block_q4_K { half d; half dmin; uint8_t scales[12]; uint8_t qs[128]; }`: eight
/// sub-blocks of 32 with 6-bit scales and mins; x = d * scale * nibble - dmin * min.
fn dequantize_q4_k(block: &[u8], y: &mut [f32]) {
    dequantize_k_scale_min(block, &block[16..144], None, y);
}

/// `block_q5_K { half d; half dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; }`:
/// Q4_K's layout plus a fifth bit per value (bit `2c` / `2c + 1` of `qh[l]` for the low /
/// high nibbles of chunk `c`); x = d * scale * (nibble + 16 * bit) - dmin * min.
fn dequantize_q5_k(block: &[u8], y: &mut [f32]) {
    dequantize_k_scale_min(block, &block[48..176], Some(&block[16..48]), y);
}

/// Q4_K and Q5_K: `d`, `dmin` and the 12 scale bytes first, then nibbles `qs` (chunks of
/// 32 bytes, low nibbles one sub-block, high nibbles the next) and, for Q5_K, the fifth
/// bits `qh`.
fn dequantize_k_scale_min(block: &[u8], qs: &[u8], qh: Option<&[u8]>, y: &mut [f32]) {
    let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
    let scales = &block[4..16];
    for (chunk, (q, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        // The fifth bits as 0 or 16 per value (all 0 for Q4_K), so one loop serves both.
        let (mut lo5, mut hi5) = ([0u8; 32], [0u8; 32]);
        if let Some(h) = qh {
            for l in 0..32 {
                lo5[l] = ((h[l] >> (2 * chunk)) & 1) << 4;
                hi5[l] = ((h[l] >> (2 * chunk + 1)) & 1) << 4;
            }
        }
        for l in 0..32 {
            y[l] = d1 * ((q[l] & 0x0f) + lo5[l]) as f32 - m1;
            y[l + 32] = d2 * ((q[l] >> 4) + hi5[l]) as f32 - m2;
        }
    }
}

/// `block_q6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; half d; }`: 16
/// sub-blocks of 16 with signed 8-bit scales; x = d * scale * (6-bit value - 32).
fn dequantize_q6_k(block: &[u8], y: &mut [f32]) {
    let d = f16_at(block, 208);
    for half in 0..2 {
        let ql = &block[half * 64..half * 64 + 64];
        let qh = &block[128 + half * 32..128 + half * 32 + 32];
        let sc = &block[192 + half * 8..192 + half * 8 + 8];
        let y = &mut y[half * 128..half * 128 + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// ggml's `quantize_row_q8_0_ref` for one block, written as in C.
    fn reference_q8_0(x: &[f32]) -> Vec<u8> {
        let mut amax = 0.0f32;
        for v in x {
            amax = amax.max(v.abs());
        }
        let d = amax / ((1 << 7) - 1) as f32;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut y = f16::from_f32(d).to_le_bytes().to_vec();
        y.extend(x.iter().map(|v| (v * id).round() as i8 as u8));
        y
    }

    /// ggml's `quantize_row_q4_0_ref` for one block, written as in C.
    fn reference_q4_0(x: &[f32]) -> Vec<u8> {
        let mut amax = 0.0f32;
        let mut max = 0.0f32;
        for &v in x {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut y = f16::from_f32(d).to_le_bytes().to_vec();
        for j in 0..16 {
            let x0 = x[j] * id;
            let x1 = x[16 + j] * id;
            let xi0 = 15u8.min((x0 + 8.5) as i8 as u8);
            let xi1 = 15u8.min((x1 + 8.5) as i8 as u8);
            y.push(xi0 | (xi1 << 4));
        }
        y
    }

    fn values() -> impl Strategy<Value = Vec<f32>> {
        let v = prop_oneof![-4.0f32..4.0, Just(0.0f32), Just(-0.0f32), -1e-6f32..1e-6, Just(1e4f32)];
        proptest::collection::vec(v, 32)
    }

    proptest! {
        #[test]
        fn quantization_equals_ggml_reference(x in values()) {
            for (ty, reference) in [(GgmlType::Q8_0, reference_q8_0(&x)), (GgmlType::Q4_0, reference_q4_0(&x))] {
                let mut y = vec![0u8; ty.block_bytes() as usize];
                quantize(ty, &x, &mut y).unwrap();
                prop_assert_eq!(&y, &reference, "{}", ty);
                // Round trip: within half a step of the block's scale. Q4_0's codes reach
                // 8 steps on the side of the largest magnitude and only 7 on the other,
                // so a value beyond 7 steps there saturates (as in ggml).
                let mut back = vec![0.0f32; 32];
                ty.dequantize(&y, &mut back);
                let d = f16::from_le_bytes([y[0], y[1]]).to_f32().abs();
                for (a, b) in x.iter().zip(&back) {
                    let saturated = if ty == GgmlType::Q4_0 { (a.abs() - 7.0 * d).max(0.0) } else { 0.0 };
                    let bound = d * 0.5 + d * 1e-3 + amax_ulp(&x) + saturated;
                    prop_assert!((a - b).abs() <= bound, "{ty}: {a} vs {b} (d {d})");
                }
            }
        }
    }

    /// f16 rounding of the scale moves values by up to max|x| * 2^-11.
    fn amax_ulp(x: &[f32]) -> f32 {
        x.iter().fold(0.0f32, |a, v| a.max(v.abs())) * 1e-3
    }

    #[test]
    fn rows_are_whole_blocks() {
        assert_eq!(GgmlType::Q4_0.row_bytes(64), Some(36));
        assert_eq!(GgmlType::Q4_0.row_bytes(48), None);
        assert_eq!(GgmlType::Q6K.row_bytes(512), Some(420));
        assert_eq!(GgmlType::F16.row_bytes(3), Some(6));
        assert!(quantize(GgmlType::Q4K, &[0.0; 256], &mut [0u8; 144]).is_err());
        assert!(quantize(GgmlType::Q8_0, &[0.0; 31], &mut [0u8; 34]).is_err());
        assert_eq!(GgmlType::Q5K.row_bytes(512), Some(352));
        assert_eq!(GgmlType::from_id(13), Some(GgmlType::Q5K));
    }

    /// A Q5_K block built by hand from ggml-common.h's layout: value `i` of the block is
    /// in sub-block `s = i / 32`, chunk `c = i / 64`; its low four bits are nibble
    /// `i % 32` of `qs[32c ..]` (low nibble for even `s`, high for odd), its fifth is bit
    /// `s` of `qh[i % 32]`.
    #[test]
    fn q5_k_blocks_follow_ggml_layout() {
        let mut block = vec![0u8; 176];
        let (d, dmin) = (0.5f32, 0.25f32);
        block[0..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
        block[2..4].copy_from_slice(&f16::from_f32(dmin).to_le_bytes());
        // Scales 1..=8 and mins 8..=1 through the 6-bit packing of scale_min_k4.
        let (scale, min) = (|s: usize| s as u8 + 1, |s: usize| 8 - s as u8);
        for s in 0..4 {
            block[4 + s] = scale(s);
            block[8 + s] = min(s);
        }
        for s in 4..8 {
            block[8 + s] = scale(s) | (min(s) << 4);
        }
        let value5 = |i: usize| ((i * 7 + 3) % 32) as u8;
        for i in 0..QK_K {
            let (s, c, l) = (i / 32, i / 64, i % 32);
            let v = value5(i);
            let q = &mut block[48 + 32 * c + l];
            *q |= if s % 2 == 0 { v & 0x0f } else { (v & 0x0f) << 4 };
            if v & 16 != 0 {
                block[16 + l] |= 1 << s;
            }
        }
        let mut y = vec![0.0f32; QK_K];
        GgmlType::Q5K.dequantize(&block, &mut y);
        for (i, got) in y.iter().enumerate() {
            let s = i / 32;
            let want = d * scale(s) as f32 * value5(i) as f32 - dmin * min(s) as f32;
            assert_eq!(*got, want, "value {i}");
        }
    }
}
