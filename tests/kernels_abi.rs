//! Every kernel op, called THROUGH THE LOADED LIBRARY (dlopen + the safe `Device`
//! wrapper), checked against plain Rust reference implementations written here; plus
//! ABI misuse, which must come back as a clean error naming the op, never a crash.

use std::sync::Arc;

use proptest::prelude::*;
use tessera_backends::device::{AttnBatchView, Buffer, Device, DeviceConfig, KvCacheView, MatmulPrecision};
use tessera_backends::dtype::DType;
use tessera_backends::kv_format::KvLayout;
use tessera_backends::loader::KernelLibrary;
use tessera_kernel_abi as abi;

// ---------------------------------------------------------------------------------------
// Helpers

fn lib() -> Arc<KernelLibrary> {
    KernelLibrary::load_default().expect("the CPU kernel library is built next to the test binary")
}

fn dev() -> Device {
    Device::open(&lib(), &DeviceConfig { threads: 2, ..Default::default() }).expect("open CPU device")
}

/// SplitMix64: deterministic test data without a dependency.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn f32(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
    }
}

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::Bf16];

/// `x` as stored in `dt` and read back.
fn round(x: f32, dt: DType) -> f32 {
    match dt {
        DType::F32 => x,
        DType::F16 => half::f16::from_f32(x).to_f32(),
        DType::Bf16 => half::bf16::from_f32(x).to_f32(),
    }
}

fn encode(xs: &[f32], dt: DType) -> Vec<u8> {
    let mut out = Vec::with_capacity(xs.len() * dt.size_bytes());
    for &x in xs {
        match dt {
            DType::F32 => out.extend_from_slice(&x.to_le_bytes()),
            DType::F16 => out.extend_from_slice(&half::f16::from_f32(x).to_le_bytes()),
            DType::Bf16 => out.extend_from_slice(&half::bf16::from_f32(x).to_le_bytes()),
        }
    }
    out
}

fn decode(bytes: &[u8], dt: DType) -> Vec<f32> {
    match dt {
        DType::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
        DType::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes(c.try_into().unwrap()).to_f32()).collect(),
        DType::Bf16 => {
            bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes(c.try_into().unwrap()).to_f32()).collect()
        }
    }
}

/// Uploads `xs` stored as `dt`; returns the buffer and the values the device sees.
fn upload_dt(d: &Device, xs: &[f32], dt: DType) -> (Buffer, Vec<f32>) {
    let buf = d.upload::<u8>(&encode(xs, dt)).unwrap();
    (buf, xs.iter().map(|&x| round(x, dt)).collect())
}

fn read_f32(d: &Device, b: &Buffer, n: usize) -> Vec<f32> {
    d.read_vec::<f32>(b.view(), n).unwrap()
}

/// `|got - want| <= rel * scale + abs` elementwise, where `scale` is per element.
fn assert_close(what: &str, got: &[f32], want: &[f64], scale: &[f64], rel: f64, abs: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, ((&g, &w), &s)) in got.iter().zip(want).zip(scale).enumerate() {
        let tol = rel * s.abs().max(w.abs()) + abs;
        assert!((g as f64 - w).abs() <= tol && g.is_finite(), "{what}: element {i}: got {g}, want {w} (tol {tol:e})");
    }
}

fn assert_close_simple(what: &str, got: &[f32], want: &[f64], rel: f64, abs: f64) {
    let scale: Vec<f64> = want.iter().map(|w| w.abs()).collect();
    assert_close(what, got, want, &scale, rel, abs);
}

fn err_text<T>(r: tessera_backends::error::Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error, the call succeeded"),
        Err(e) => e.to_string(),
    }
}

// ---------------------------------------------------------------------------------------
// Device basics

#[test]
fn device_info_and_memory_roundtrip() {
    let d = dev();
    let info = d.info();
    assert!(!info.name.is_empty(), "device name");
    assert!(info.compute_units >= 1);
    assert!(info.memory_bytes > 0);
    let data: Vec<f32> = (0..100).map(|i| i as f32 * 0.5).collect();
    let b = d.upload(&data).unwrap();
    assert_eq!(b.len_bytes(), 400);
    // Offset reads and device-to-device copies.
    assert_eq!(d.read_vec::<f32>(b.at(40), 5).unwrap(), &data[10..15]);
    let c = d.alloc(400).unwrap();
    assert_eq!(read_f32(&d, &c, 100), vec![0.0; 100], "alloc is zeroed");
    d.copy(c.at(8), b.at(16), 80).unwrap();
    d.synchronize().unwrap();
    let got = read_f32(&d, &c, 100);
    assert_eq!(&got[2..22], &data[4..24]);
    assert_eq!(got[0], 0.0);
    assert_eq!(got[22], 0.0);
}

#[test]
fn memory_limit_refuses_large_alloc() {
    let d =
        Device::open(&lib(), &DeviceConfig { memory_limit_bytes: 1 << 20, threads: 1, ..Default::default() }).unwrap();
    assert_eq!(d.info().memory_bytes, 1 << 20, "info reports the limit");
    let msg = err_text(d.alloc(2 << 20));
    assert!(msg.contains("memory"), "{msg}");
    assert!(msg.contains("tk_alloc"), "{msg}");
    // Allocations under the limit still work, and freed memory is returned.
    for _ in 0..4 {
        let b = d.alloc(600 << 10).unwrap();
        drop(b);
    }
    let a = d.alloc(600 << 10).unwrap();
    let msg = err_text(d.alloc(600 << 10));
    assert!(msg.contains("memory"), "two 600 KiB buffers under a 1 MiB limit: {msg}");
    drop(a);
}

#[test]
fn buffers_of_another_device_are_refused() {
    let (a, b) = (dev(), dev());
    let x = a.upload(&[1.0f32; 8]).unwrap();
    let out = b.alloc(8 * 4).unwrap();
    let w = b.upload(&[1.0f32; 8]).unwrap();
    let msg = err_text(b.linear(out.view(), x.view(), w.view(), DType::F32, None, 1, 1, 8));
    assert!(msg.contains("another device"), "{msg}");
    let msg = err_text(b.copy(out.view(), x.view(), 32));
    assert!(msg.contains("another device"), "{msg}");
    // The same call with b's own buffers works.
    let x = b.upload(&[1.0f32; 8]).unwrap();
    b.linear(out.view(), x.view(), w.view(), DType::F32, None, 1, 1, 8).unwrap();
    assert_eq!(b.read_vec::<f32>(out.view(), 1).unwrap(), vec![8.0]);
}

// ---------------------------------------------------------------------------------------
// embedding

#[test]
fn embedding_all_dtypes() {
    let d = dev();
    let mut rng = Rng(1);
    let (vocab, hidden) = (37, 24);
    let table = rng.vec(vocab * hidden);
    let ids: Vec<i32> = vec![0, 36, 5, 5, 17, 1, 36];
    let n = ids.len();
    for dt in DTYPES {
        let (tb, seen) = upload_dt(&d, &table, dt);
        let idb = d.upload(&ids).unwrap();
        let out = d.alloc(n * hidden * 4).unwrap();
        d.embedding(out.view(), tb.view(), dt, idb.view(), n as u32, hidden as u32, vocab as u32).unwrap();
        let got = read_f32(&d, &out, n * hidden);
        let want: Vec<f32> =
            ids.iter().flat_map(|&i| seen[i as usize * hidden..(i as usize + 1) * hidden].to_vec()).collect();
        assert_eq!(got, want, "embedding {dt}");
    }
}

#[test]
fn embedding_out_of_vocab_id_is_an_error() {
    let d = dev();
    let (vocab, hidden) = (8, 4);
    let tb = d.upload(&vec![1.0f32; vocab * hidden]).unwrap();
    let out = d.alloc(2 * hidden * 4).unwrap();
    for bad in [8i32, -1, i32::MAX] {
        let idb = d.upload(&[0i32, bad]).unwrap();
        let msg = err_text(d.embedding(out.view(), tb.view(), DType::F32, idb.view(), 2, hidden as u32, vocab as u32));
        assert!(msg.contains("tk_embedding"), "{msg}");
    }
}

// ---------------------------------------------------------------------------------------
// linear

fn check_linear(d: &Device, rng: &mut Rng, m: usize, n: usize, k: usize, dt: DType, with_bias: bool) {
    let x = rng.vec(m * k);
    let w = rng.vec(n * k);
    let bias = rng.vec(n);
    let xb = d.upload(&x).unwrap();
    let (wb, wr) = upload_dt(d, &w, dt);
    let (bb, br) = upload_dt(d, &bias, dt);
    let out = d.alloc(m * n * 4).unwrap();
    d.linear(out.view(), xb.view(), wb.view(), dt, with_bias.then(|| bb.view()), m as u32, n as u32, k as u32).unwrap();
    let got = read_f32(d, &out, m * n);
    let mut want = vec![0f64; m * n];
    let mut scale = vec![0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0f64;
            let mut mag = 0f64;
            for p in 0..k {
                let t = x[i * k + p] as f64 * wr[j * k + p] as f64;
                acc += t;
                mag += t.abs();
            }
            if with_bias {
                acc += br[j] as f64;
                mag += (br[j] as f64).abs();
            }
            want[i * n + j] = acc;
            scale[i * n + j] = mag;
        }
    }
    assert_close(&format!("linear m={m} n={n} k={k} {dt} bias={with_bias}"), &got, &want, &scale, 1e-5, 1e-6);
}

/// A device opened with bf16 matmuls computes prompts' linear layers from operands
/// rounded to bf16 (close to f32, not equal), and decode-sized calls exactly as f32 does;
/// a CPU without bf16 dot products refuses the device with the reason.
#[test]
fn bf16_matmul_precision_rounds_prompts_only() {
    let config = DeviceConfig { threads: 2, matmul_precision: MatmulPrecision::Bf16, ..Default::default() };
    let bf = match Device::open(&lib(), &config) {
        Ok(d) => d,
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains("matmul precision bf16") && msg.contains("AVX512-BF16"), "{msg}");
            return;
        }
    };
    assert_eq!(bf.matmul_precision(), MatmulPrecision::Bf16);
    let f = dev();
    let mut rng = Rng(11);
    let (n, k) = (40, 300);
    let w = rng.vec(n * k);
    for (m, prompt) in [(5, false), (200, true)] {
        let x = rng.vec(m * k);
        let run = |d: &Device| {
            let (xb, (wb, _)) = (d.upload(&x).unwrap(), upload_dt(d, &w, DType::F16));
            let out = d.alloc(m * n * 4).unwrap();
            d.linear(out.view(), xb.view(), wb.view(), DType::F16, None, m as u32, n as u32, k as u32).unwrap();
            read_f32(d, &out, m * n)
        };
        let (got, exact) = (run(&bf), run(&f));
        if !prompt {
            assert_eq!(got, exact, "a decode batch of {m} computes in f32");
            continue;
        }
        // Each product is off by at most ~2^-8 of its size (two roundings to 8 bits).
        let mut differs = false;
        for i in 0..m {
            for j in 0..n {
                let mag: f32 = (0..k).map(|p| (x[i * k + p] * w[j * k + p]).abs()).sum();
                let (g, e) = (got[i * n + j], exact[i * n + j]);
                assert!((g - e).abs() <= mag / 128.0, "({i}, {j}): {g} vs {e}, magnitude {mag}");
                differs |= g != e;
            }
        }
        assert!(differs, "a prompt of {m} rows computed exactly as f32");
    }
}

#[test]
fn linear_small_and_large_m_all_dtypes() {
    let d = dev();
    let mut rng = Rng(2);
    for m in [1, 3, 5, 33] {
        for dt in DTYPES {
            for with_bias in [false, true] {
                check_linear(&d, &mut rng, m, 19, 70, dt, with_bias);
                check_linear(&d, &mut rng, m, 64, 128, dt, with_bias);
            }
        }
    }
}

#[test]
fn linear_respects_offsets_and_does_not_write_past_out() {
    let d = dev();
    let mut rng = Rng(3);
    let (m, n, k) = (3, 5, 8);
    let x = rng.vec(m * k);
    let w = rng.vec(n * k);
    // Tensors at non-zero offsets inside larger buffers.
    let mut xpad = vec![9.0f32; 7];
    xpad.extend_from_slice(&x);
    let mut wpad = vec![9.0f32; 3];
    wpad.extend_from_slice(&w);
    let xb = d.upload(&xpad).unwrap();
    let wb = d.upload(&wpad).unwrap();
    let sentinel = vec![-7.0f32; m * n + 10];
    let out = d.upload(&sentinel).unwrap();
    d.linear(out.at(20), xb.at(28), wb.at(12), DType::F32, None, m as u32, n as u32, k as u32).unwrap();
    let got = read_f32(&d, &out, m * n + 10);
    assert_eq!(&got[..5], &[-7.0; 5], "wrote before out");
    assert_eq!(&got[5 + m * n..], &[-7.0; 5], "wrote past out");
    for i in 0..m {
        for j in 0..n {
            let want: f64 = (0..k).map(|p| x[i * k + p] as f64 * w[j * k + p] as f64).sum();
            assert!((got[5 + i * n + j] as f64 - want).abs() < 1e-5, "({i},{j})");
        }
    }
}

// ---------------------------------------------------------------------------------------
// rms_norm / add_rms_norm

fn ref_rms(x: &[f64], w: &[f32], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, &w)| v * inv * w as f64).collect()
}

#[test]
fn rms_norm_all_dtypes() {
    let d = dev();
    let mut rng = Rng(4);
    for (n, hidden) in [(1, 8), (3, 100), (5, 257), (2, 1024)] {
        for dt in DTYPES {
            let x: Vec<f32> = rng.vec(n * hidden).iter().map(|v| v * 3.0).collect();
            let w: Vec<f32> = rng.vec(hidden).iter().map(|v| 1.0 + v * 0.5).collect();
            let eps = 1e-5f32;
            let xb = d.upload(&x).unwrap();
            let (wb, wr) = upload_dt(&d, &w, dt);
            let out = d.alloc(n * hidden * 4).unwrap();
            d.rms_norm(out.view(), xb.view(), wb.view(), dt, n as u32, hidden as u32, eps).unwrap();
            let got = read_f32(&d, &out, n * hidden);
            let want: Vec<f64> = x
                .chunks(hidden)
                .flat_map(|row| ref_rms(&row.iter().map(|&v| v as f64).collect::<Vec<_>>(), &wr, eps as f64))
                .collect();
            assert_close_simple(&format!("rms_norm n={n} h={hidden} {dt}"), &got, &want, 1e-5, 1e-5);
        }
    }
}

#[test]
fn rms_norm_in_place_and_eps() {
    let d = dev();
    // All-zero rows: out = 0 (eps keeps it finite).
    let x = vec![0.0f32; 16];
    let xb = d.upload(&x).unwrap();
    let wb = d.upload(&[1.0f32; 16]).unwrap();
    let out = d.alloc(64).unwrap();
    d.rms_norm(out.view(), xb.view(), wb.view(), DType::F32, 1, 16, 1e-6).unwrap();
    assert_eq!(read_f32(&d, &out, 16), vec![0.0; 16]);
    // Large eps dominates.
    let x: Vec<f32> = (0..16).map(|i| i as f32 * 0.01).collect();
    let xb = d.upload(&x).unwrap();
    d.rms_norm(out.view(), xb.view(), wb.view(), DType::F32, 1, 16, 100.0).unwrap();
    let want = ref_rms(&x.iter().map(|&v| v as f64).collect::<Vec<_>>(), &[1.0; 16], 100.0);
    assert_close_simple("rms_norm eps", &read_f32(&d, &out, 16), &want, 1e-5, 1e-7);
}

#[test]
fn add_rms_norm_all_dtypes() {
    let d = dev();
    let mut rng = Rng(5);
    for (n, hidden) in [(1, 16), (4, 96), (3, 513)] {
        for dt in DTYPES {
            let res = rng.vec(n * hidden);
            let x = rng.vec(n * hidden);
            let w: Vec<f32> = rng.vec(hidden).iter().map(|v| 1.0 + v * 0.5).collect();
            let eps = 1e-6f32;
            let rb = d.upload(&res).unwrap();
            let xb = d.upload(&x).unwrap();
            let (wb, wr) = upload_dt(&d, &w, dt);
            let out = d.alloc(n * hidden * 4).unwrap();
            d.add_rms_norm(rb.view(), xb.view(), wb.view(), dt, out.view(), n as u32, hidden as u32, eps).unwrap();
            let sum: Vec<f64> = res.iter().zip(&x).map(|(&a, &b)| a as f64 + b as f64).collect();
            let got_res = read_f32(&d, &rb, n * hidden);
            assert_close_simple(&format!("add_rms_norm residual {dt}"), &got_res, &sum, 1e-6, 1e-7);
            let want: Vec<f64> = sum.chunks(hidden).flat_map(|row| ref_rms(row, &wr, eps as f64)).collect();
            let got = read_f32(&d, &out, n * hidden);
            assert_close_simple(&format!("add_rms_norm out n={n} h={hidden} {dt}"), &got, &want, 1e-5, 1e-5);
            // x is untouched.
            assert_eq!(read_f32(&d, &xb, n * hidden), x);
        }
    }
}

// ---------------------------------------------------------------------------------------
// rotary embedding

/// HF `inv_freq`, including `_compute_llama3_parameters`, in f64.
fn ref_inv_freq(rope: &abi::TkRope, d: usize) -> Vec<f64> {
    let base: Vec<f64> = (0..d / 2).map(|i| (rope.theta as f64).powf(-(2.0 * i as f64) / d as f64)).collect();
    match rope.scaling {
        abi::TK_ROPE_NONE => base,
        abi::TK_ROPE_LINEAR => base.iter().map(|f| f / rope.factor as f64).collect(),
        abi::TK_ROPE_LLAMA3 => {
            let factor = rope.factor as f64;
            let lo = rope.low_freq_factor as f64;
            let hi = rope.high_freq_factor as f64;
            let old = rope.original_max_position as f64;
            let low_wl = old / lo;
            let high_wl = old / hi;
            base.iter()
                .map(|&f| {
                    let wl = 2.0 * std::f64::consts::PI / f;
                    if wl < high_wl {
                        f
                    } else if wl > low_wl {
                        f / factor
                    } else {
                        let smooth = (old / wl - lo) / (hi - lo);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
        s => panic!("scaling {s}"),
    }
}

/// Rotate-half: dim i pairs with i + d/2.
fn ref_rope(x: &[f32], heads: usize, d: usize, positions: &[i32], inv: &[f64]) -> Vec<f64> {
    let mut out = vec![0f64; x.len()];
    for (t, &p) in positions.iter().enumerate() {
        for h in 0..heads {
            let base = (t * heads + h) * d;
            for i in 0..d / 2 {
                let ang = p as f64 * inv[i];
                let (s, c) = ang.sin_cos();
                let a = x[base + i] as f64;
                let b = x[base + i + d / 2] as f64;
                out[base + i] = a * c - b * s;
                out[base + i + d / 2] = b * c + a * s;
            }
        }
    }
    out
}

fn rope_cases() -> Vec<(&'static str, abi::TkRope)> {
    vec![
        ("none", abi::TkRope { theta: 10_000.0, scaling: abi::TK_ROPE_NONE, factor: 1.0, ..Default::default() }),
        ("none-1e6", abi::TkRope { theta: 1_000_000.0, scaling: abi::TK_ROPE_NONE, factor: 1.0, ..Default::default() }),
        ("linear", abi::TkRope { theta: 10_000.0, scaling: abi::TK_ROPE_LINEAR, factor: 4.0, ..Default::default() }),
        (
            "llama3",
            abi::TkRope {
                theta: 500_000.0,
                scaling: abi::TK_ROPE_LLAMA3,
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 8192,
            },
        ),
        (
            "llama3-small-orig",
            abi::TkRope {
                theta: 10_000.0,
                scaling: abi::TK_ROPE_LLAMA3,
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 64,
            },
        ),
    ]
}

#[test]
fn rope_all_scalings_match_hf() {
    let d = dev();
    let mut rng = Rng(6);
    let positions: Vec<i32> = vec![0, 1, 2, 7, 100, 1000, 4095];
    let n = positions.len();
    for (heads, kv_heads, hd) in [(4, 2, 32), (2, 2, 8), (8, 1, 64), (3, 3, 128)] {
        for (name, rope) in rope_cases() {
            let q = rng.vec(n * heads * hd);
            let k = rng.vec(n * kv_heads * hd);
            let qb = d.upload(&q).unwrap();
            let kb = d.upload(&k).unwrap();
            let pb = d.upload(&positions).unwrap();
            d.apply_rotary_pos_emb(
                qb.view(),
                kb.view(),
                pb.view(),
                n as u32,
                heads as u32,
                kv_heads as u32,
                hd as u32,
                &rope,
            )
            .unwrap();
            let inv = ref_inv_freq(&rope, hd);
            let wq = ref_rope(&q, heads, hd, &positions, &inv);
            let wk = ref_rope(&k, kv_heads, hd, &positions, &inv);
            // The angle is computed in f32 on the device (as HF does): allow ~pos * eps.
            let what = format!("rope {name} H={heads} KVH={kv_heads} d={hd}");
            assert_close_simple(&format!("{what} q"), &read_f32(&d, &qb, q.len()), &wq, 1e-4, 2e-3);
            assert_close_simple(&format!("{what} k"), &read_f32(&d, &kb, k.len()), &wk, 1e-4, 2e-3);
        }
    }
}

#[test]
fn rope_pairs_dims_by_rotate_half_not_interleaved() {
    let d = dev();
    let hd = 8;
    // q = e_0 at position 1: rotate-half moves mass into dim d/2 = 4, not dim 1.
    let mut q = vec![0f32; hd];
    q[0] = 1.0;
    let qb = d.upload(&q).unwrap();
    let kb = d.upload(&q).unwrap();
    let pb = d.upload(&[1i32]).unwrap();
    let rope = abi::TkRope { theta: 10_000.0, scaling: abi::TK_ROPE_NONE, factor: 1.0, ..Default::default() };
    d.apply_rotary_pos_emb(qb.view(), kb.view(), pb.view(), 1, 1, 1, hd as u32, &rope).unwrap();
    let got = read_f32(&d, &qb, hd);
    assert!((got[0] - 1f32.cos()).abs() < 1e-6, "{got:?}");
    assert!((got[4] - 1f32.sin()).abs() < 1e-6, "{got:?}");
    for i in [1, 2, 3, 5, 6, 7] {
        assert_eq!(got[i], 0.0, "dim {i}: {got:?}");
    }
    // Position 0 is the identity.
    let x: Vec<f32> = (0..hd).map(|i| i as f32).collect();
    let qb = d.upload(&x).unwrap();
    let kb = d.upload(&x).unwrap();
    let pb = d.upload(&[0i32]).unwrap();
    d.apply_rotary_pos_emb(qb.view(), kb.view(), pb.view(), 1, 1, 1, hd as u32, &rope).unwrap();
    assert_eq!(read_f32(&d, &qb, hd), x);
    assert_eq!(read_f32(&d, &kb, hd), x);
}

#[test]
fn rope_bad_params_are_errors() {
    let d = dev();
    let qb = d.upload(&[0.5f32; 16]).unwrap();
    let kb = d.upload(&[0.5f32; 16]).unwrap();
    let pb = d.upload(&[3i32, 4]).unwrap();
    let good = abi::TkRope { theta: 10_000.0, scaling: abi::TK_ROPE_NONE, factor: 1.0, ..Default::default() };
    // Unknown scaling kind.
    let bad = abi::TkRope { scaling: 77, ..good };
    let msg = err_text(d.apply_rotary_pos_emb(qb.view(), kb.view(), pb.view(), 2, 1, 1, 8, &bad));
    assert!(msg.contains("tk_apply_rotary_pos_emb"), "{msg}");
    // Odd head_dim cannot be split in halves.
    let msg = err_text(d.apply_rotary_pos_emb(qb.view(), kb.view(), pb.view(), 2, 1, 1, 7, &good));
    assert!(msg.contains("tk_apply_rotary_pos_emb"), "{msg}");
}

// ---------------------------------------------------------------------------------------
// silu_and_mul, argmax, log_softmax

#[test]
fn silu_and_mul_matches() {
    let d = dev();
    let mut rng = Rng(7);
    for (n, inter) in [(1, 1), (3, 37), (5, 352), (2, 1000)] {
        let g: Vec<f32> = rng.vec(n * inter).iter().map(|v| v * 8.0).collect();
        let u = rng.vec(n * inter);
        let gb = d.upload(&g).unwrap();
        let ub = d.upload(&u).unwrap();
        let out = d.alloc(n * inter * 4).unwrap();
        d.silu_and_mul(out.view(), gb.view(), ub.view(), n as u32, inter as u32).unwrap();
        let want: Vec<f64> =
            g.iter().zip(&u).map(|(&g, &u)| g as f64 / (1.0 + (-(g as f64)).exp()) * u as f64).collect();
        assert_close_simple(&format!("silu_and_mul {n}x{inter}"), &read_f32(&d, &out, n * inter), &want, 1e-5, 1e-6);
    }
}

#[test]
fn argmax_lowest_index_wins_ties() {
    let d = dev();
    let vocab = 10;
    let ninf = f32::NEG_INFINITY;
    #[rustfmt::skip]
    let rows: Vec<Vec<f32>> = vec![
        vec![0.0, 1.0, 5.0, 5.0, 2.0, 5.0, 0.0, 0.0, 0.0, 0.0],
        vec![3.0; 10],
        vec![ninf, ninf, ninf, -1e30, ninf, ninf, ninf, ninf, ninf, -1e30],
        vec![-5.0, -4.0, -3.0, -2.0, -1.0, -1.0, -2.0, -3.0, -4.0, -5.0],
        vec![0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1e-30],
        vec![7.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 7.0, 7.0],
    ];
    let want = [2i32, 0, 3, 4, 9, 0];
    let flat: Vec<f32> = rows.concat();
    let lb = d.upload(&flat).unwrap();
    let out = d.upload(&vec![-1i32; rows.len()]).unwrap();
    d.argmax(out.view(), lb.view(), rows.len() as u32, vocab).unwrap();
    assert_eq!(d.read_vec::<i32>(out.view(), rows.len()).unwrap(), want);

    // A long row (vector paths) whose maximum appears several times.
    let mut rng = Rng(8);
    let big = 4099;
    let mut row = rng.vec(big);
    for &i in &[1234usize, 77, 4000, 4098] {
        row[i] = 2.0;
    }
    let lb = d.upload(&row).unwrap();
    let out = d.alloc(4).unwrap();
    d.argmax(out.view(), lb.view(), 1, big as u32).unwrap();
    assert_eq!(d.read_vec::<i32>(out.view(), 1).unwrap(), [77]);
}

fn ref_log_softmax(row: &[f32]) -> Vec<f64> {
    let m = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
    let lse = m + row.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
    row.iter().map(|&v| v as f64 - lse).collect()
}

#[test]
fn log_softmax_out_of_place_and_in_place() {
    let d = dev();
    let mut rng = Rng(9);
    for (n, vocab) in [(1, 1), (1, 7), (3, 1024), (2, 4099)] {
        let mut logits: Vec<f32> = rng.vec(n * vocab).iter().map(|v| v * 20.0).collect();
        if vocab > 7 {
            logits[1] = 1000.0; // large values must not overflow
            logits[vocab + 2] = -1000.0;
        }
        let want: Vec<f64> = logits.chunks(vocab).flat_map(ref_log_softmax).collect();
        let lb = d.upload(&logits).unwrap();
        let out = d.alloc(n * vocab * 4).unwrap();
        d.log_softmax(out.view(), lb.view(), n as u32, vocab as u32).unwrap();
        let what = format!("log_softmax {n}x{vocab}");
        assert_close_simple(&what, &read_f32(&d, &out, n * vocab), &want, 1e-5, 1e-4);
        assert_eq!(read_f32(&d, &lb, n * vocab), logits, "{what}: input untouched");
        // In place: out == logits.
        d.log_softmax(lb.view(), lb.view(), n as u32, vocab as u32).unwrap();
        assert_close_simple(&format!("{what} in place"), &read_f32(&d, &lb, n * vocab), &want, 1e-5, 1e-4);
        // Rows sum to one in probability space.
        for row in read_f32(&d, &out, n * vocab).chunks(vocab) {
            let s: f64 = row.iter().map(|&v| (v as f64).exp()).sum();
            assert!((s - 1.0).abs() < 1e-4, "{what}: sum {s}");
        }
    }
}

// ---------------------------------------------------------------------------------------
// Paged KV cache and attention

#[derive(Debug, Clone)]
struct AttnCase {
    /// (context_len, q_len) per sequence; q_len <= context_len.
    seqs: Vec<(usize, usize)>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    dtype: DType,
    layout: KvLayout,
    /// Unused blocks in the pool beyond what the sequences need.
    spare_blocks: usize,
    seed: u64,
}

struct Seq {
    blocks: Vec<usize>,
    /// [ctx][kv_heads][head_dim], as stored in the cache (rounded to its dtype).
    k: Vec<f32>,
    v: Vec<f32>,
}

/// Reference attention of one query head vector at position `pos` over `seq`.
fn ref_attend(c: &AttnCase, seq: &Seq, q: &[f32], h: usize, pos: usize, scale: f64) -> Vec<f64> {
    let (kvh, hd) = (c.kv_heads, c.head_dim);
    let g = h / (c.heads / kvh);
    let scores: Vec<f64> = (0..=pos)
        .map(|t| {
            let kk = &seq.k[(t * kvh + g) * hd..(t * kvh + g + 1) * hd];
            q.iter().zip(kk).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * scale
        })
        .collect();
    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
    let z: f64 = e.iter().sum();
    let mut out = vec![0f64; hd];
    for (t, w) in e.iter().enumerate() {
        let vv = &seq.v[(t * kvh + g) * hd..(t * kvh + g + 1) * hd];
        for (o, &x) in out.iter_mut().zip(vv) {
            *o += w / z * x as f64;
        }
    }
    out
}

/// Fills a shuffled paged cache through `fill_kv_cache` (checking its contents), then
/// runs prefill over the last `q_len` tokens of every sequence and decode of one more
/// query per sequence, both against the reference.
fn run_attention_case(c: &AttnCase) {
    assert!(c.heads.is_multiple_of(c.kv_heads));
    let d = dev();
    let mut rng = Rng(c.seed);
    let (bs, kvh, hd, dt) = (c.block_size, c.kv_heads, c.head_dim, c.dtype);
    let needed: Vec<usize> = c.seqs.iter().map(|&(ctx, _)| ctx.div_ceil(bs)).collect();
    let num_blocks = needed.iter().sum::<usize>() + c.spare_blocks;
    let mut pool: Vec<usize> = (0..num_blocks).collect();
    rng.shuffle(&mut pool);
    let mut next = 0;
    let seqs: Vec<Seq> = c
        .seqs
        .iter()
        .zip(&needed)
        .map(|(&(ctx, _), &nb)| {
            let blocks = pool[next..next + nb].to_vec();
            next += nb;
            let k: Vec<f32> = rng.vec(ctx * kvh * hd).iter().map(|&x| round(x, dt)).collect();
            let v: Vec<f32> = rng.vec(ctx * kvh * hd).iter().map(|&x| round(x, dt)).collect();
            Seq { blocks, k, v }
        })
        .collect();
    let max_blocks = needed.iter().copied().max().unwrap_or(1).max(1) + 1;

    // The cache, zeroed.
    let block_elems = kvh * bs * hd;
    let cache_bytes = num_blocks * block_elems * dt.size_bytes();
    let kc = d.alloc(cache_bytes).unwrap();
    let vc = d.alloc(cache_bytes).unwrap();
    let cache = KvCacheView {
        k: kc.view(),
        v: vc.view(),
        dtype: dt,
        num_blocks: num_blocks as u32,
        block_size: bs as u32,
        num_kv_heads: kvh as u32,
        head_dim: hd as u32,
        layout: c.layout,
    };

    // Fill every token of every sequence in one call, shuffled, with decoy tokens at
    // slot -1 (which must be skipped) mixed in.
    let mut tokens: Vec<(Option<(usize, usize)>, i32)> = Vec::new();
    for (s, seq) in seqs.iter().enumerate() {
        for t in 0..c.seqs[s].0 {
            let slot = seq.blocks[t / bs] * bs + t % bs;
            tokens.push((Some((s, t)), slot as i32));
        }
    }
    for _ in 0..3 {
        tokens.push((None, -1));
    }
    rng.shuffle(&mut tokens);
    let row = kvh * hd;
    let mut kin = Vec::with_capacity(tokens.len() * row);
    let mut vin = Vec::with_capacity(tokens.len() * row);
    let mut slots = Vec::new();
    for (who, slot) in &tokens {
        match who {
            Some((s, t)) => {
                kin.extend_from_slice(&seqs[*s].k[t * row..(t + 1) * row]);
                vin.extend_from_slice(&seqs[*s].v[t * row..(t + 1) * row]);
            }
            None => {
                kin.extend(std::iter::repeat_n(1000.0f32, row));
                vin.extend(std::iter::repeat_n(-1000.0f32, row));
            }
        }
        slots.push(*slot);
    }
    let kb = d.upload(&kin).unwrap();
    let vb = d.upload(&vin).unwrap();
    let sb = d.upload(&slots).unwrap();
    d.fill_kv_cache(&cache, kb.view(), vb.view(), sb.view(), tokens.len() as u32).unwrap();

    // The cache holds exactly what was written, in the documented layout
    // ([block][kv_head][block_size][head_dim] head-major, [block][block_size][kv_head]
    // [head_dim] token-major); untouched slots stay zero.
    let kcache = decode(&d.read_vec::<u8>(kc.view(), cache_bytes).unwrap(), dt);
    let vcache = decode(&d.read_vec::<u8>(vc.view(), cache_bytes).unwrap(), dt);
    let mut expect_k = vec![0f32; num_blocks * block_elems];
    let mut expect_v = vec![0f32; num_blocks * block_elems];
    for (s, seq) in seqs.iter().enumerate() {
        for t in 0..c.seqs[s].0 {
            let (blk, off) = (seq.blocks[t / bs], t % bs);
            for g in 0..kvh {
                for e in 0..hd {
                    let at = match c.layout {
                        KvLayout::HeadMajor => ((blk * kvh + g) * bs + off) * hd + e,
                        KvLayout::TokenMajor => ((blk * bs + off) * kvh + g) * hd + e,
                    };
                    expect_k[at] = seq.k[(t * kvh + g) * hd + e];
                    expect_v[at] = seq.v[(t * kvh + g) * hd + e];
                }
            }
        }
    }
    assert!(kcache == expect_k, "fill_kv_cache: K cache contents differ ({c:?})");
    assert!(vcache == expect_v, "fill_kv_cache: V cache contents differ ({c:?})");

    let mut tables = vec![0i32; c.seqs.len() * max_blocks];
    for (s, seq) in seqs.iter().enumerate() {
        for (j, &b) in seq.blocks.iter().enumerate() {
            tables[s * max_blocks + j] = b as i32;
        }
    }
    let tb = d.upload(&tables).unwrap();
    let ctx: Vec<i32> = c.seqs.iter().map(|&(l, _)| l as i32).collect();
    let cb = d.upload(&ctx).unwrap();
    let scale = 1.0 / (hd as f32).sqrt();
    let qrow = c.heads * hd;

    // Prefill: packed queries for the last q_len tokens of each sequence.
    let mut qstart = vec![0i32];
    for &(_, ql) in &c.seqs {
        qstart.push(qstart.last().unwrap() + ql as i32);
    }
    let total_q = *qstart.last().unwrap() as usize;
    let q = rng.vec(total_q * qrow);
    let qb = d.upload(&q).unwrap();
    let qsb = d.upload(&qstart).unwrap();
    let out = d.upload(&vec![f32::NAN; total_q * qrow]).unwrap();
    let batch = AttnBatchView {
        num_seqs: c.seqs.len() as u32,
        max_blocks_per_seq: max_blocks as u32,
        query_start: qsb.view(),
        context_lens: cb.view(),
        block_tables: tb.view(),
    };
    d.prefill_attention(out.view(), qb.view(), &cache, &batch, total_q as u32, c.heads as u32, scale).unwrap();
    let got = read_f32(&d, &out, total_q * qrow);
    let mut want = Vec::with_capacity(total_q * qrow);
    for (s, &(l, ql)) in c.seqs.iter().enumerate() {
        for j in 0..ql {
            let qi = qstart[s] as usize + j;
            for h in 0..c.heads {
                let qv = &q[(qi * c.heads + h) * hd..(qi * c.heads + h + 1) * hd];
                want.extend(ref_attend(c, &seqs[s], qv, h, l - ql + j, scale as f64));
            }
        }
    }
    assert_close_simple(&format!("prefill_attention {c:?}"), &got, &want, 1e-4, 1e-4);

    // Decode: one query per sequence over all of its context.
    let n = c.seqs.len();
    let q = rng.vec(n * qrow);
    let qb = d.upload(&q).unwrap();
    let out = d.upload(&vec![f32::NAN; n * qrow]).unwrap();
    d.paged_decode_attention(
        out.view(),
        qb.view(),
        &cache,
        tb.view(),
        cb.view(),
        n as u32,
        max_blocks as u32,
        c.heads as u32,
        scale,
    )
    .unwrap();
    let got = read_f32(&d, &out, n * qrow);
    let mut want = Vec::with_capacity(n * qrow);
    for (s, &(l, _)) in c.seqs.iter().enumerate() {
        for h in 0..c.heads {
            want.extend(ref_attend(
                c,
                &seqs[s],
                &q[(s * c.heads + h) * hd..(s * c.heads + h + 1) * hd],
                h,
                l - 1,
                scale as f64,
            ));
        }
    }
    assert_close_simple(&format!("paged_decode_attention {c:?}"), &got, &want, 1e-4, 1e-4);
}

#[test]
fn attention_fixed_cases() {
    let mut seed = 100;
    for layout in KvLayout::ALL {
        for dtype in DTYPES {
            for (heads, kv_heads) in [(4, 4), (4, 2), (8, 2)] {
                for block_size in [1, 3, 16] {
                    seed += 1;
                    run_attention_case(&AttnCase {
                        // Pure prefill, chunked prefill over earlier context, single tokens.
                        seqs: vec![(7, 7), (20, 5), (1, 1), (33, 1), (17, 16)],
                        heads,
                        kv_heads,
                        head_dim: 16,
                        block_size,
                        dtype,
                        layout,
                        spare_blocks: 3,
                        seed,
                    });
                }
            }
        }
    }
}

#[test]
fn attention_long_context_head_dim_128() {
    for layout in KvLayout::ALL {
        run_attention_case(&AttnCase {
            seqs: vec![(300, 40), (129, 129)],
            heads: 4,
            kv_heads: 2,
            head_dim: 128,
            block_size: 16,
            dtype: DType::F16,
            layout,
            spare_blocks: 0,
            seed: 7,
        });
    }
}

fn dtype_strategy() -> impl Strategy<Value = DType> {
    prop_oneof![Just(DType::F32), Just(DType::F16), Just(DType::Bf16)]
}

fn layout_strategy() -> impl Strategy<Value = KvLayout> {
    prop_oneof![Just(KvLayout::HeadMajor), Just(KvLayout::TokenMajor)]
}

fn fast_config(cases: u32) -> ProptestConfig {
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

proptest! {
    #![proptest_config(fast_config(64))]

    #[test]
    fn prop_attention(
        seqs in prop::collection::vec((1usize..150, 0.0f64..1.0), 1..5),
        kv_heads in 1usize..4,
        ratio in prop::sample::select(vec![1usize, 2, 4]),
        head_dim in prop::sample::select(vec![4usize, 8, 16, 32, 64]),
        block_size in prop::sample::select(vec![1usize, 2, 3, 5, 8, 16, 32]),
        dtype in dtype_strategy(),
        layout in layout_strategy(),
        spare_blocks in 0usize..4,
        seed in any::<u64>(),
    ) {
        let seqs = seqs.into_iter().map(|(ctx, frac)| (ctx, ((ctx as f64 * frac).ceil() as usize).clamp(1, ctx))).collect();
        run_attention_case(&AttnCase { seqs, heads: kv_heads * ratio, kv_heads, head_dim, block_size, dtype, layout, spare_blocks, seed });
    }

    #[test]
    fn prop_linear(
        m in 1usize..48,
        n in 1usize..80,
        k in 1usize..160,
        dtype in dtype_strategy(),
        bias in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let d = dev();
        check_linear(&d, &mut Rng(seed), m, n, k, dtype, bias);
    }

    #[test]
    fn prop_argmax_and_log_softmax(
        rows in prop::collection::vec(prop::collection::vec(-4i32..4, 1..300), 1..4),
    ) {
        // Small integer logits: many ties.
        let vocab = rows[0].len();
        let rows: Vec<Vec<f32>> = rows.iter().map(|r| (0..vocab).map(|i| r[i % r.len()] as f32).collect()).collect();
        let d = dev();
        let flat: Vec<f32> = rows.concat();
        let lb = d.upload(&flat).unwrap();
        let out = d.alloc(rows.len() * 4).unwrap();
        d.argmax(out.view(), lb.view(), rows.len() as u32, vocab as u32).unwrap();
        let got = d.read_vec::<i32>(out.view(), rows.len()).unwrap();
        for (r, row) in rows.iter().enumerate() {
            let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let first = row.iter().position(|&v| v == max).unwrap();
            prop_assert_eq!(got[r] as usize, first, "row {}", r);
        }
        let ls = d.alloc(flat.len() * 4).unwrap();
        d.log_softmax(ls.view(), lb.view(), rows.len() as u32, vocab as u32).unwrap();
        let want: Vec<f64> = rows.iter().flat_map(|r| ref_log_softmax(r)).collect();
        assert_close_simple("log_softmax", &read_f32(&d, &ls, flat.len()), &want, 1e-5, 1e-5);
    }

    #[test]
    fn prop_norms(n in 1usize..6, hidden in 1usize..600, dtype in dtype_strategy(), seed in any::<u64>()) {
        let d = dev();
        let mut rng = Rng(seed);
        let x = rng.vec(n * hidden);
        let res = rng.vec(n * hidden);
        let w = rng.vec(hidden);
        let xb = d.upload(&x).unwrap();
        let rb = d.upload(&res).unwrap();
        let (wb, wr) = upload_dt(&d, &w, dtype);
        let out = d.alloc(n * hidden * 4).unwrap();
        d.rms_norm(out.view(), xb.view(), wb.view(), dtype, n as u32, hidden as u32, 1e-5).unwrap();
        let want: Vec<f64> = x.chunks(hidden).flat_map(|r| ref_rms(&r.iter().map(|&v| v as f64).collect::<Vec<_>>(), &wr, 1e-5)).collect();
        assert_close_simple("rms_norm", &read_f32(&d, &out, n * hidden), &want, 1e-5, 1e-5);
        d.add_rms_norm(rb.view(), xb.view(), wb.view(), dtype, out.view(), n as u32, hidden as u32, 1e-5).unwrap();
        let sum: Vec<f64> = res.iter().zip(&x).map(|(&a, &b)| a as f64 + b as f64).collect();
        let want: Vec<f64> = sum.chunks(hidden).flat_map(|r| ref_rms(r, &wr, 1e-5)).collect();
        assert_close_simple("add_rms_norm", &read_f32(&d, &out, n * hidden), &want, 1e-5, 1e-5);
    }
}

// ---------------------------------------------------------------------------------------
// ABI misuse: clean errors that name the op

#[test]
fn tensor_past_end_of_buffer_is_refused() {
    let d = dev();
    let (m, n, k) = (2usize, 3usize, 4usize);
    let x = d.upload(&vec![1.0f32; m * k]).unwrap();
    let w = d.upload(&vec![1.0f32; n * k]).unwrap();
    let out = d.alloc(m * n * 4).unwrap();
    let small = d.alloc(m * n * 4 - 4).unwrap();
    let cases: Vec<(&str, tessera_backends::error::Result<()>)> = vec![
        // x one element short (through an offset).
        ("x offset", d.linear(out.view(), x.at(4), w.view(), DType::F32, None, m as u32, n as u32, k as u32)),
        // out one element short.
        ("out short", d.linear(small.view(), x.view(), w.view(), DType::F32, None, m as u32, n as u32, k as u32)),
        // w read as f32 when it holds too few bytes for the shape.
        ("w too big k", d.linear(out.view(), x.view(), w.view(), DType::F32, None, 1, n as u32, (k * 2 + 1) as u32)),
        // Offset far beyond the buffer (must not overflow).
        (
            "huge offset",
            d.linear(out.view(), x.at(usize::MAX / 2), w.view(), DType::F32, None, m as u32, n as u32, k as u32),
        ),
        // Bias too short.
        (
            "bias short",
            d.linear(
                out.view(),
                x.view(),
                w.view(),
                DType::F32,
                Some(small.at(small.len_bytes() - 4)),
                m as u32,
                n as u32,
                k as u32,
            ),
        ),
    ];
    for (what, r) in cases {
        let msg = err_text(r);
        assert!(msg.contains("tk_linear"), "{what}: {msg}");
    }
    // Other ops and copies.
    let msg = err_text(d.silu_and_mul(out.view(), x.view(), w.at(8), 1, n as u32 * k as u32));
    assert!(msg.contains("tk_silu_and_mul"), "{msg}");
    let msg = err_text(d.rms_norm(out.view(), x.view(), w.view(), DType::F32, 1, 100, 1e-5));
    assert!(msg.contains("tk_rms_norm"), "{msg}");
    let msg = err_text(d.log_softmax(out.view(), out.view(), 2, 4));
    assert!(msg.contains("tk_log_softmax"), "{msg}");
    let msg = err_text(d.argmax(small.at(small.len_bytes()), out.view(), 1, 4));
    assert!(msg.contains("tk_argmax"), "{msg}");
    let msg = err_text(d.write(out.at(4), &vec![0f32; m * n]));
    assert!(msg.contains("tk_copy_h2d"), "{msg}");
    let mut sink = vec![0f32; m * n + 1];
    let msg = err_text(d.read(out.view(), &mut sink));
    assert!(msg.contains("tk_copy_d2h"), "{msg}");
    let msg = err_text(d.copy(out.view(), small.view(), m * n * 4));
    assert!(msg.contains("tk_copy_d2d"), "{msg}");
    // The buffers are intact and usable afterwards.
    d.linear(out.view(), x.view(), w.view(), DType::F32, None, m as u32, n as u32, k as u32).unwrap();
    assert_eq!(read_f32(&d, &out, m * n), vec![4.0; m * n]);
}

#[test]
fn block_id_out_of_range_is_refused() {
    let d = dev();
    let (nb, bs, kvh, hd, heads) = (4usize, 4usize, 1usize, 8usize, 2usize);
    let bytes = nb * bs * kvh * hd * 4;
    let kc = d.alloc(bytes).unwrap();
    let vc = d.alloc(bytes).unwrap();
    let cache = KvCacheView {
        k: kc.view(),
        v: vc.view(),
        dtype: DType::F32,
        num_blocks: nb as u32,
        block_size: bs as u32,
        num_kv_heads: kvh as u32,
        head_dim: hd as u32,
        layout: KvLayout::HeadMajor,
    };
    let q = d.upload(&vec![0.1f32; 8 * heads * hd]).unwrap();
    let out = d.alloc(8 * heads * hd * 4).unwrap();
    for bad in [nb as i32, 1000, -1] {
        // context 6 uses blocks [0] and [1] of the table.
        let tb = d.upload(&[2i32, bad]).unwrap();
        let cb = d.upload(&[6i32]).unwrap();
        let msg = err_text(d.paged_decode_attention(
            out.view(),
            q.view(),
            &cache,
            tb.view(),
            cb.view(),
            1,
            2,
            heads as u32,
            0.3,
        ));
        assert!(msg.contains("tk_paged_decode_attention"), "block {bad}: {msg}");
        let qs = d.upload(&[0i32, 2]).unwrap();
        let batch = AttnBatchView {
            num_seqs: 1,
            max_blocks_per_seq: 2,
            query_start: qs.view(),
            context_lens: cb.view(),
            block_tables: tb.view(),
        };
        let msg = err_text(d.prefill_attention(out.view(), q.view(), &cache, &batch, 2, heads as u32, 0.3));
        assert!(msg.contains("tk_prefill_attention"), "block {bad}: {msg}");
    }
    // Context longer than the block table covers.
    let tb = d.upload(&[0i32, 1]).unwrap();
    let cb = d.upload(&[9i32]).unwrap();
    let msg =
        err_text(d.paged_decode_attention(out.view(), q.view(), &cache, tb.view(), cb.view(), 1, 2, heads as u32, 0.3));
    assert!(msg.contains("tk_paged_decode_attention"), "{msg}");
    // A slot past the cache in fill_kv_cache.
    let kv = d.upload(&vec![0.5f32; kvh * hd]).unwrap();
    let sb = d.upload(&[(nb * bs) as i32]).unwrap();
    let msg = err_text(d.fill_kv_cache(&cache, kv.view(), kv.view(), sb.view(), 1));
    assert!(msg.contains("tk_fill_kv_cache"), "{msg}");
    // Heads not a multiple of kv heads.
    let cache3 = KvCacheView { num_kv_heads: 2, head_dim: 4, ..cache };
    let tb = d.upload(&[0i32]).unwrap();
    let cb = d.upload(&[1i32]).unwrap();
    let msg = err_text(d.paged_decode_attention(out.view(), q.view(), &cache3, tb.view(), cb.view(), 1, 1, 3, 0.3));
    assert!(msg.contains("tk_paged_decode_attention"), "{msg}");
    // Zero heads is an invalid argument, not an internal error.
    let msg = err_text(d.paged_decode_attention(out.view(), q.view(), &cache, tb.view(), cb.view(), 1, 1, 0, 0.3));
    assert!(msg.contains("invalid argument") && msg.contains("num_heads = 0"), "{msg}");
}

#[test]
fn wrapped_host_buffer_is_read_only() {
    let d = dev();
    let host: Arc<Vec<u8>> = Arc::new(bytemuck::cast_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]).to_vec());
    let wrapped = d.wrap_host(host.clone(), 0..32).unwrap();
    assert_eq!(wrapped.len_bytes(), 32);
    // Readable as an input.
    assert_eq!(d.read_vec::<f32>(wrapped.at(8), 2).unwrap(), [3.0, 4.0]);
    let ones = d.upload(&[1.0f32; 8]).unwrap();
    let out = d.alloc(32).unwrap();
    d.silu_and_mul(out.view(), ones.view(), wrapped.view(), 1, 8).unwrap();
    // Refused as an output of ops and as a copy destination.
    let msg = err_text(d.silu_and_mul(wrapped.view(), ones.view(), ones.view(), 1, 8));
    assert!(msg.contains("tk_silu_and_mul"), "{msg}");
    let msg = err_text(d.log_softmax(wrapped.view(), wrapped.view(), 1, 8));
    assert!(msg.contains("tk_log_softmax"), "{msg}");
    let msg = err_text(d.argmax(wrapped.view(), ones.view(), 1, 8));
    assert!(msg.contains("tk_argmax"), "{msg}");
    let msg = err_text(d.add_rms_norm(wrapped.view(), ones.view(), ones.view(), DType::F32, out.view(), 1, 8, 1e-5));
    assert!(msg.contains("tk_add_rms_norm"), "{msg}");
    let pos = d.upload(&[1i32]).unwrap();
    let rope = abi::TkRope { theta: 10_000.0, scaling: abi::TK_ROPE_NONE, factor: 1.0, ..Default::default() };
    let msg = err_text(d.apply_rotary_pos_emb(wrapped.view(), ones.view(), pos.view(), 1, 1, 1, 8, &rope));
    assert!(msg.contains("tk_apply_rotary_pos_emb"), "{msg}");
    let msg = err_text(d.write(wrapped.view(), &[0f32; 2]));
    assert!(msg.contains("tk_copy_h2d"), "{msg}");
    let msg = err_text(d.copy(wrapped.view(), ones.view(), 8));
    assert!(msg.contains("tk_copy_d2d"), "{msg}");
    let cache = KvCacheView {
        k: wrapped.view(),
        v: out.view(),
        dtype: DType::F32,
        num_blocks: 1,
        block_size: 1,
        num_kv_heads: 1,
        head_dim: 8,
        layout: KvLayout::TokenMajor,
    };
    let sb = d.upload(&[0i32]).unwrap();
    let msg = err_text(d.fill_kv_cache(&cache, ones.view(), ones.view(), sb.view(), 1));
    assert!(msg.contains("tk_fill_kv_cache"), "{msg}");
    // The host memory was not changed.
    assert_eq!(bytemuck::cast_slice::<u8, f32>(&host[..]), &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
    // A range outside the owner is refused before reaching the library.
    assert!(d.wrap_host(host, 0..33).is_err());
}

/// Raw ABI calls with dtype codes the safe wrapper cannot express.
#[test]
#[allow(unsafe_code)]
fn bad_dtype_codes_are_refused_by_the_library() {
    let path = tessera_backends::loader::default_library_path().expect("CPU library path");
    // SAFETY: the CPU kernel library is trusted code built by this workspace; every
    // symbol below is called with the signature the ABI header gives it.
    unsafe {
        let lib = libloading::Library::new(&path).unwrap();
        let create: libloading::Symbol<abi::DeviceCreateFn> = lib.get(b"tk_device_create\0").unwrap();
        let destroy: libloading::Symbol<abi::DeviceDestroyFn> = lib.get(b"tk_device_destroy\0").unwrap();
        let alloc: libloading::Symbol<abi::AllocFn> = lib.get(b"tk_alloc\0").unwrap();
        let free: libloading::Symbol<abi::FreeFn> = lib.get(b"tk_free\0").unwrap();
        let last_error: libloading::Symbol<abi::LastErrorFn> = lib.get(b"tk_last_error\0").unwrap();
        let linear: libloading::Symbol<abi::LinearFn> = lib.get(b"tk_linear\0").unwrap();
        let embedding: libloading::Symbol<abi::EmbeddingFn> = lib.get(b"tk_embedding\0").unwrap();
        let rms: libloading::Symbol<abi::RmsNormFn> = lib.get(b"tk_rms_norm\0").unwrap();
        let fill: libloading::Symbol<abi::FillKvCacheFn> = lib.get(b"tk_fill_kv_cache\0").unwrap();

        let cfg = abi::TkDeviceConfig { threads: 1, ..Default::default() };
        let mut dev = std::ptr::null_mut();
        assert_eq!(create(&cfg, &mut dev), abi::TK_OK);
        assert!(!dev.is_null());
        let mut bufs = Vec::new();
        for _ in 0..4 {
            let mut b = std::ptr::null_mut();
            assert_eq!(alloc(dev, 4096, &mut b), abi::TK_OK);
            bufs.push(b);
        }
        let p = |i: usize| abi::TkPtr { buf: bufs[i], offset: 0 };
        let message = || std::ffi::CStr::from_ptr(last_error()).to_string_lossy().into_owned();
        for bad in [abi::TK_DTYPE_I32, 7, -1] {
            let s = linear(dev, p(0), p(1), p(2), bad, abi::TkPtr::NULL, 2, 2, 2);
            assert_ne!(s, abi::TK_OK, "tk_linear accepted dtype {bad}");
            assert!(message().to_lowercase().contains("dtype"), "tk_linear dtype {bad}: {}", message());
            let s = embedding(dev, p(0), p(1), bad, p(2), 1, 4, 4);
            assert_ne!(s, abi::TK_OK, "tk_embedding accepted dtype {bad}");
            assert!(!message().is_empty());
            let s = rms(dev, p(0), p(1), p(2), bad, 1, 4, 1e-5);
            assert_ne!(s, abi::TK_OK, "tk_rms_norm accepted dtype {bad}");
            let cache = abi::TkKvCache {
                k: p(0),
                v: p(1),
                dtype: bad,
                num_blocks: 1,
                block_size: 1,
                num_kv_heads: 1,
                head_dim: 4,
                layout: abi::TK_KV_LAYOUT_HEAD_MAJOR,
            };
            let s = fill(dev, &cache, p(2), p(2), p(3), 1);
            assert_ne!(s, abi::TK_OK, "tk_fill_kv_cache accepted dtype {bad}");
        }
        // An unknown KV layout (ABI 1.1 knows 0 and 1) is refused, naming the field.
        for bad in [2u32, 0xffff_ffff] {
            let cache = abi::TkKvCache {
                k: p(0),
                v: p(1),
                dtype: abi::TK_DTYPE_F32,
                num_blocks: 1,
                block_size: 1,
                num_kv_heads: 1,
                head_dim: 4,
                layout: bad,
            };
            let s = fill(dev, &cache, p(2), p(2), p(3), 1);
            assert_eq!(s, abi::TK_ERR_INVALID_ARGUMENT, "tk_fill_kv_cache accepted layout {bad}");
            assert!(message().contains(&format!("cache.layout = {bad} is unknown")), "{}", message());
        }
        // Null buffers where a tensor is required.
        let s = linear(dev, abi::TkPtr::NULL, p(1), p(2), abi::TK_DTYPE_F32, abi::TkPtr::NULL, 2, 2, 2);
        assert_ne!(s, abi::TK_OK, "tk_linear accepted a null out");
        let mut null_dev_buf = std::ptr::null_mut();
        assert_ne!(alloc(std::ptr::null_mut(), 16, &mut null_dev_buf), abi::TK_OK, "tk_alloc on a null device");
        for b in bufs {
            assert_eq!(free(dev, b), abi::TK_OK);
        }
        destroy(dev);
    }
}

#[test]
fn devices_on_separate_threads_agree() {
    // A device is used by one thread at a time, but several devices may run at once.
    let mut rng = Rng(11);
    let (m, n, k) = (9usize, 31usize, 200usize);
    let x = Arc::new(rng.vec(m * k));
    let w = Arc::new(rng.vec(n * k));
    let results: Vec<Vec<f32>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|_| {
                let (x, w) = (x.clone(), w.clone());
                s.spawn(move || {
                    let d = dev();
                    let xb = d.upload(&x[..]).unwrap();
                    let wb = d.upload(&w[..]).unwrap();
                    let out = d.alloc(m * n * 4).unwrap();
                    for _ in 0..20 {
                        d.linear(out.view(), xb.view(), wb.view(), DType::F32, None, m as u32, n as u32, k as u32)
                            .unwrap();
                    }
                    read_f32(&d, &out, m * n)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(results[0], results[1]);
    assert_eq!(results[0], results[2]);
}

#[test]
fn log_softmax_with_neg_infinity() {
    let d = dev();
    let ninf = f32::NEG_INFINITY;
    let row = [ninf, 0.0, ninf, 2.0f32.ln(), ninf];
    let lb = d.upload(&row).unwrap();
    let out = d.alloc(20).unwrap();
    d.log_softmax(out.view(), lb.view(), 1, 5).unwrap();
    let got = read_f32(&d, &out, 5);
    assert_eq!(got[0], ninf);
    assert_eq!(got[2], ninf);
    assert_eq!(got[4], ninf);
    assert!((got[1] as f64 - (1.0f64 / 3.0).ln()).abs() < 1e-6, "{got:?}");
    assert!((got[3] as f64 - (2.0f64 / 3.0).ln()).abs() < 1e-6, "{got:?}");
}

#[test]
fn attention_does_not_write_outside_out() {
    let d = dev();
    let (bs, kvh, hd, heads) = (4usize, 2usize, 8usize, 4usize);
    let nb = 3;
    let mut rng = Rng(12);
    let kc = d.upload(&rng.vec(nb * kvh * bs * hd)).unwrap();
    let vc = d.upload(&rng.vec(nb * kvh * bs * hd)).unwrap();
    let cache = KvCacheView {
        k: kc.view(),
        v: vc.view(),
        dtype: DType::F32,
        num_blocks: nb as u32,
        block_size: bs as u32,
        num_kv_heads: kvh as u32,
        head_dim: hd as u32,
        layout: KvLayout::TokenMajor,
    };
    let row = heads * hd;
    let q = d.upload(&rng.vec(3 * row)).unwrap();
    let tb = d.upload(&[2i32, 0, 1]).unwrap();
    let cb = d.upload(&[10i32]).unwrap();
    let qs = d.upload(&[0i32, 3]).unwrap();
    let out = d.upload(&vec![-9.0f32; 5 * row]).unwrap();
    let batch = AttnBatchView {
        num_seqs: 1,
        max_blocks_per_seq: 3,
        query_start: qs.view(),
        context_lens: cb.view(),
        block_tables: tb.view(),
    };
    d.prefill_attention(out.at(row * 4), q.view(), &cache, &batch, 3, heads as u32, 0.35).unwrap();
    let got = read_f32(&d, &out, 5 * row);
    assert!(got[..row].iter().all(|&v| v == -9.0), "wrote before out");
    assert!(got[4 * row..].iter().all(|&v| v == -9.0), "wrote after out");
    assert!(got[row..4 * row].iter().all(|&v| v != -9.0 && v.is_finite()));
    let out2 = d.upload(&vec![-9.0f32; 3 * row]).unwrap();
    d.paged_decode_attention(out2.at(row * 4), q.view(), &cache, tb.view(), cb.view(), 1, 3, heads as u32, 0.35)
        .unwrap();
    let got = read_f32(&d, &out2, 3 * row);
    assert!(got[..row].iter().all(|&v| v == -9.0) && got[2 * row..].iter().all(|&v| v == -9.0));
}

// ---------------------------------------------------------------------------------------
// KV staging (prefill side) and install (decode side) across KV formats

use tessera_backends::config::ModelConfig;
use tessera_backends::kv::{KvCacheConfig, PagedKvCache};
use tessera_backends::kv_format::{KvFormat, decode_tokens};

/// A model config with only the KV shape mattering.
fn kv_model(num_layers: usize, kv_heads: usize, head_dim: usize) -> ModelConfig {
    let heads = kv_heads * 2;
    let json = format!(
        r#"{{"architectures": ["LlamaForCausalLM"], "hidden_size": {}, "intermediate_size": 8,
            "num_hidden_layers": {num_layers}, "num_attention_heads": {heads},
            "num_key_value_heads": {kv_heads}, "head_dim": {head_dim}, "vocab_size": 16}}"#,
        heads * head_dim
    );
    ModelConfig::from_json(&json, std::path::Path::new("config.json")).unwrap()
}

/// A KV format on the wire: what one chip's cache is.
#[derive(Debug, Clone, Copy)]
struct WireFmt {
    block_size: usize,
    layout: KvLayout,
    dtype: DType,
}

fn wire_fmt_strategy() -> impl Strategy<Value = WireFmt> {
    (1usize..=32, layout_strategy(), dtype_strategy()).prop_map(|(block_size, layout, dtype)| WireFmt {
        block_size,
        layout,
        dtype,
    })
}

/// A cache of `f` for `len` tokens plus spare blocks, a shuffled block table for the
/// sequence, and the slot of every position.
fn cache_for(d: &Device, m: &ModelConfig, f: WireFmt, len: usize, rng: &mut Rng) -> (PagedKvCache, Vec<u32>, Vec<i32>) {
    let bs = f.block_size;
    let num_blocks = len.div_ceil(bs) + 3;
    let config = KvCacheConfig { block_size: bs, num_blocks, dtype: f.dtype };
    let cache = PagedKvCache::with_layout(d, m, config, f.layout).unwrap();
    let mut pool: Vec<u32> = (0..num_blocks as u32).collect();
    rng.shuffle(&mut pool);
    let table = pool[..len.div_ceil(bs)].to_vec();
    let slots = (0..len).map(|p| (table[p / bs] as usize * bs + p % bs) as i32).collect();
    (cache, table, slots)
}

/// Stages `blocks` of `layer` and decodes `positions` (the first block starts at
/// `first_pos`) to f32 K and V rows.
fn stage_and_decode(
    d: &Device,
    cache: &PagedKvCache,
    layer: usize,
    blocks: &[u32],
    first_pos: usize,
    positions: std::ops::Range<usize>,
) -> (Vec<f32>, Vec<f32>) {
    let f: KvFormat = cache.format();
    let mut k = vec![0u8; blocks.len() * f.block_bytes()];
    let mut v = vec![0u8; blocks.len() * f.block_bytes()];
    cache.read_blocks(d, layer, blocks, &mut k, &mut v).unwrap();
    let (mut kr, mut vr) = (Vec::new(), Vec::new());
    decode_tokens(&f, &k, first_pos, positions.clone(), &mut kr).unwrap();
    decode_tokens(&f, &v, first_pos, positions, &mut vr).unwrap();
    (kr, vr)
}

/// Prefill chip A (format `a`) holds `len` tokens in every layer; decode chip B (format
/// `b`) already holds positions `< first` and receives `first..len`: A stages the blocks
/// covering them in its native bytes, B decodes and installs them with `write_tokens`.
///
/// Tolerance: B must hold exactly A's value rounded once to B's dtype (round to nearest
/// even). So the transfer is exact when B's dtype is at least as wide as A's (B is f32,
/// or both share a dtype); otherwise each value is within half a unit in the last place
/// of B's dtype: |b - a| <= 2^-11 |a| + 2^-25 for f16 (11-bit significand, subnormal
/// spacing 2^-24), |b - a| <= 2^-8 |a| for bf16 (8-bit significand, f32's range).
fn check_kv_transfer(a: WireFmt, b: WireFmt, kv_heads: usize, head_dim: usize, len: usize, first: usize, seed: u64) {
    let d = dev();
    let mut rng = Rng(seed);
    let m = kv_model(2, kv_heads, head_dim);
    let row = kv_heads * head_dim;
    let (ca, ta, sa) = cache_for(&d, &m, a, len, &mut rng);
    let (cb, tb, sb) = cache_for(&d, &m, b, len, &mut rng);
    assert_eq!(ca.format().block_bytes(), a.block_size * row * a.dtype.size_bytes());
    let what = format!("A {a:?} -> B {b:?}, {kv_heads} kv heads x {head_dim}, {len} tokens from {first}");
    for layer in 0..2 {
        let k = rng.vec(len * row);
        let v = rng.vec(len * row);
        ca.write_tokens(&d, layer, &k, &v, &sa).unwrap();
        // B's prefix comes from elsewhere (its own earlier prefill); mark it.
        let prefix = vec![0.5f32; first * row];
        cb.write_tokens(&d, layer, &prefix, &prefix, &sb[..first]).unwrap();

        // A holds exactly what it was given, rounded to its dtype, in any order of
        // blocks read.
        let (ka, va) = stage_and_decode(&d, &ca, layer, &ta, 0, 0..len);
        let want_k: Vec<f32> = k.iter().map(|&x| round(x, a.dtype)).collect();
        let want_v: Vec<f32> = v.iter().map(|&x| round(x, a.dtype)).collect();
        assert!(ka == want_k && va == want_v, "{what}: layer {layer}: A does not hold what was written");

        // P stages only the blocks covering first..len; D installs them.
        let j0 = first / a.block_size;
        let (k_rows, v_rows) = stage_and_decode(&d, &ca, layer, &ta[j0..], j0 * a.block_size, first..len);
        cb.write_tokens(&d, layer, &k_rows, &v_rows, &sb[first..]).unwrap();

        let (kb, vb) = stage_and_decode(&d, &cb, layer, &tb, 0, 0..len);
        let lossless = b.dtype == DType::F32 || a.dtype == b.dtype;
        let (rel, abs) = match b.dtype {
            DType::F32 => (0.0, 0.0),
            DType::F16 => (2f32.powi(-11), 2f32.powi(-25)),
            DType::Bf16 => (2f32.powi(-8), 0.0),
        };
        for (name, got, src) in [("K", &kb, &ka), ("V", &vb, &va)] {
            assert!(got[..first * row].iter().all(|&x| x == 0.5), "{what}: layer {layer} {name}: prefix overwritten");
            for (i, (&g, &w)) in got[first * row..].iter().zip(&src[first * row..]).enumerate() {
                assert_eq!(g, round(w, b.dtype), "{what}: layer {layer} {name}[{i}]: not one rounding of {w}");
                if lossless {
                    assert_eq!(g, w, "{what}: layer {layer} {name}[{i}]");
                } else {
                    assert!((g - w).abs() <= rel * w.abs() + abs, "{what}: layer {layer} {name}[{i}]: {g} vs {w}");
                }
            }
        }
    }
}

#[test]
fn kv_transfer_every_layout_and_dtype_pair() {
    let mut seed = 500;
    for la in KvLayout::ALL {
        for lb in KvLayout::ALL {
            for da in DTYPES {
                for db in DTYPES {
                    seed += 1;
                    let a = WireFmt { block_size: 4, layout: la, dtype: da };
                    let b = WireFmt { block_size: 3, layout: lb, dtype: db };
                    check_kv_transfer(a, b, 2, 8, 23, 9, seed);
                }
            }
        }
    }
}

#[test]
fn kv_same_format_blocks_copy_as_bytes() {
    let d = dev();
    let mut rng = Rng(77);
    let m = kv_model(3, 2, 4);
    let f = WireFmt { block_size: 5, layout: KvLayout::TokenMajor, dtype: DType::Bf16 };
    let (a, ta, sa) = cache_for(&d, &m, f, 17, &mut rng);
    let (b, tb, _) = cache_for(&d, &m, f, 17, &mut rng);
    assert_eq!(a.format(), b.format());
    let bb = a.format().block_bytes();
    for layer in 0..3 {
        let k = rng.vec(17 * 8);
        let v = rng.vec(17 * 8);
        a.write_tokens(&d, layer, &k, &v, &sa).unwrap();
        let (mut ks, mut vs) = (vec![0u8; ta.len() * bb], vec![0u8; ta.len() * bb]);
        a.read_blocks(&d, layer, &ta, &mut ks, &mut vs).unwrap();
        b.write_blocks(&d, layer, &tb, &ks, &vs).unwrap();
        let (mut kb, mut vb) = (vec![0u8; tb.len() * bb], vec![0u8; tb.len() * bb]);
        b.read_blocks(&d, layer, &tb, &mut kb, &mut vb).unwrap();
        assert!(kb == ks && vb == vs, "layer {layer}: blocks differ after a byte copy");
    }
    // Blocks read in a caller-chosen order, runs and all: [4, 5, 6] is one run.
    let num_blocks = a.config().num_blocks;
    assert_eq!(num_blocks, 7);
    let mut all_k = vec![0u8; num_blocks * bb];
    let mut all_v = vec![0u8; num_blocks * bb];
    a.read_blocks(&d, 1, &(0..num_blocks as u32).collect::<Vec<u32>>(), &mut all_k, &mut all_v).unwrap();
    let order = [4u32, 5, 6, 0, 3, 1];
    let (mut ko, mut vo) = (vec![0u8; order.len() * bb], vec![0u8; order.len() * bb]);
    a.read_blocks(&d, 1, &order, &mut ko, &mut vo).unwrap();
    for (i, &blk) in order.iter().enumerate() {
        let at = blk as usize * bb;
        assert_eq!(&ko[i * bb..(i + 1) * bb], &all_k[at..at + bb], "block {blk}");
        assert_eq!(&vo[i * bb..(i + 1) * bb], &all_v[at..at + bb], "block {blk}");
    }
}

#[test]
fn kv_staging_and_install_refuse_bad_arguments() {
    let d = dev();
    let m = kv_model(2, 1, 4);
    let cache = PagedKvCache::new(&d, &m, KvCacheConfig { block_size: 2, num_blocks: 3, dtype: DType::F16 }).unwrap();
    assert_eq!(cache.layout(), KvLayout::HeadMajor, "`new` keeps the head-major layout");
    let bb = cache.format().block_bytes();
    assert_eq!(bb, 2 * 4 * 2);
    let (mut k, mut v) = (vec![0u8; bb], vec![0u8; bb]);
    let msg = err_text(cache.read_blocks(&d, 0, &[3], &mut k, &mut v));
    assert!(msg.contains("block 3 does not exist (the cache has 3)"), "{msg}");
    let msg = err_text(cache.read_blocks(&d, 2, &[0], &mut k, &mut v));
    assert!(msg.contains("layer 2 does not exist (the cache has 2)"), "{msg}");
    let msg = err_text(cache.read_blocks(&d, 0, &[0, 1], &mut k, &mut v));
    assert!(msg.contains("2 blocks of 16 bytes need 32-byte K and V buffers, got 16 and 16"), "{msg}");
    let msg = err_text(cache.write_blocks(&d, 0, &[0], &k, &v[..8]));
    assert!(msg.contains("got 16 and 8"), "{msg}");
    let rows = vec![1.0f32; 8];
    let msg = err_text(cache.write_tokens(&d, 0, &rows, &rows[..4], &[0, 1]));
    assert!(msg.contains("2 slots need 8 K and V values (1 kv heads x 4 dims each), got 8 and 4"), "{msg}");
    let msg = err_text(cache.write_tokens(&d, 0, &rows, &rows, &[0, 6]));
    assert!(msg.contains("slot 6 is outside the cache's 6 slots"), "{msg}");
    let msg = err_text(cache.write_tokens(&d, 5, &rows, &rows, &[0, 1]));
    assert!(msg.contains("layer 5 does not exist"), "{msg}");
    // A negative slot skips its row; nothing was written by the refused calls.
    cache.write_tokens(&d, 0, &rows, &rows, &[-1, 1]).unwrap();
    cache.read_blocks(&d, 0, &[0], &mut k, &mut v).unwrap();
    let got = decode(&k, DType::F16);
    assert_eq!(got, [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]);
    // A cache of another device is refused, not touched.
    let other = dev();
    let msg = err_text(cache.read_blocks(&other, 0, &[0], &mut k, &mut v));
    assert!(msg.contains("another device"), "{msg}");
}

proptest! {
    #![proptest_config(fast_config(64))]

    #[test]
    fn prop_kv_transfer_between_formats(
        a in wire_fmt_strategy(),
        b in wire_fmt_strategy(),
        kv_heads in 1usize..4,
        head_dim in prop::sample::select(vec![2usize, 4, 8, 16]),
        len in 1usize..80,
        first_frac in 0.0f64..1.0,
        seed in any::<u64>(),
    ) {
        let first = ((len as f64 * first_frac) as usize).min(len - 1);
        check_kv_transfer(a, b, kv_heads, head_dim, len, first, seed);
    }
}
