//! Measures a lossless 15-bit packing of f16 weights for the batch-1 GEMV, the one lever
//! left on a decode step that reads its weights at the memory's ceiling
//! (`docs/speed-history.md`, the Zen 4's eighth session). Not used by the engine: on 2
//! Zen 4 cores the unpacking caps it near 39 GB/s, so it wins only where the memory
//! reads slower than that (a step 0.79-0.94 of the f16 one at 63-88 ms) and loses where
//! it reads faster (1.07-1.41 at 38-43 ms).
//!
//! Where every weight of a matrix has |w| < 2, the top bit of its f16 exponent is 0. A
//! group of 64 weights then takes 120 bytes instead of 128: their 64 low bytes, then
//! their 64 high bytes with that bit dropped, 7 bits each, 8 to a 7-byte run. The kernel
//! spreads each run over a qword (VPERMB), cuts the 8 fields out (VPMULTISHIFTQB), puts
//! the sign back in bit 7 (`x + (x & 0x40)`), interleaves low and high bytes into f16
//! (the bytes are stored in the order that makes the unpacks give weights in order), and
//! from there is the library's one-row GEMV: the same conversions and FMAs into the
//! same 8 accumulators, so its results are bit-identical to it.
//!
//! Run: `cargo run --release -p tessera-kernels-cpu --example packed15 [rounds]`. It
//! builds 918M random f16 weights (the bench model's linear count) in rows of 2,048
//! both ways, checks the packed GEMV against the library's, then times a "decode step"
//! over all of them (14 slices, rows split over the threads) with each, in turns.
#![allow(unsafe_code)]

use std::time::Instant;

use half::f16;
use rayon::prelude::*;
use tessera_kernels_cpu::device::Device;
use tessera_kernels_cpu::dtype::WSlice;
use tessera_kernels_cpu::simd;

/// Bytes per group of 64 packed weights.
const GROUP: usize = 120;
const K: usize = 2048;
const ROWS: usize = 448 * 1024;

/// `k` (a multiple of 64) f16 weights, each < 2 in magnitude, as `k / 64` groups.
fn encode(src: &[f16], dst: &mut [u8]) {
    for (g, ws) in src.chunks_exact(64).enumerate() {
        let d = &mut dst[g * GROUP..(g + 1) * GROUP];
        let (mut lo, mut hi) = ([0u8; 64], [0u8; 64]);
        for (e, w) in ws.iter().enumerate() {
            // The unpacks take bytes 16L + j (j < 8) to weight 8L + j, and 16L + 8 + j to
            // weight 32 + 8L + j.
            let pos = if e < 32 { 16 * (e / 8) + e % 8 } else { 16 * ((e - 32) / 8) + 8 + (e - 32) % 8 };
            let v = w.to_bits();
            assert!((v >> 10) & 31 < 16, "packing needs |w| < 2: {w}");
            lo[pos] = v as u8;
            let h = (v >> 8) as u8; // s 0eeee mm
            hi[pos] = (h & 0x3f) | ((h >> 7) << 6);
        }
        d[..64].copy_from_slice(&lo);
        for q in 0..8 {
            let run = (0..8).fold(0u64, |v, j| v | (u64::from(hi[8 * q + j]) << (7 * j)));
            d[64 + 7 * q..64 + 7 * q + 7].copy_from_slice(&run.to_le_bytes()[..7]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::GROUP;
    use std::arch::x86_64::*;

    /// `out[r] = w[r] · x` for `rows` packed rows of `k` weights.
    ///
    /// # Safety
    /// AVX-512 F, BW and VBMI; `w` holds `rows * k / 64` groups, `x` k values, `out` rows.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    pub unsafe fn gemv(w: &[u8], rows: usize, x: &[f32], k: usize, out: &mut [f32]) {
        // Qword q takes the 7 bytes of run q; its byte j then holds field j at bit 7j.
        let spread = _mm512_set_epi8(
            55, 55, 54, 53, 52, 51, 50, 49, 48, 48, 47, 46, 45, 44, 43, 42, 41, 41, 40, 39, 38, 37, 36, 35, 34, 34, 33,
            32, 31, 30, 29, 28, 27, 27, 26, 25, 24, 23, 22, 21, 20, 20, 19, 18, 17, 16, 15, 14, 13, 13, 12, 11, 10, 9,
            8, 7, 6, 6, 5, 4, 3, 2, 1, 0,
        );
        let shifts = _mm512_set1_epi64(0x312a_231c_150e_0700);
        let (m7f, m40) = (_mm512_set1_epi8(0x7f), _mm512_set1_epi8(0x40));
        let groups = k / 64;
        assert!(w.len() >= rows * groups * GROUP && x.len() >= k && out.len() >= rows);
        for (r, o) in out.iter_mut().enumerate().take(rows) {
            // SAFETY: group g of row r lies within w (asserted); x has k values.
            unsafe {
                let p = w.as_ptr().add(r * groups * GROUP);
                let mut acc = [_mm512_setzero_ps(); 8];
                for g in 0..groups {
                    let q = p.add(g * GROUP);
                    let lo = _mm512_loadu_si512(q as *const _);
                    let runs = _mm512_maskz_loadu_epi8(0x00ff_ffff_ffff_ffff, q.add(64) as *const i8);
                    let fields = _mm512_and_si512(
                        _mm512_multishift_epi64_epi8(shifts, _mm512_permutexvar_epi8(spread, runs)),
                        m7f,
                    );
                    let hi = _mm512_add_epi8(fields, _mm512_and_si512(fields, m40));
                    let (w0, w1) = (_mm512_unpacklo_epi8(lo, hi), _mm512_unpackhi_epi8(lo, hi));
                    let halves = [
                        _mm512_castsi512_si256(w0),
                        _mm512_extracti64x4_epi64::<1>(w0),
                        _mm512_castsi512_si256(w1),
                        _mm512_extracti64x4_epi64::<1>(w1),
                    ];
                    // The library's accumulator for columns 16u.. of each 128 is u.
                    let base = (g % 2) * 4;
                    for (u, h) in halves.into_iter().enumerate() {
                        let xv = _mm512_loadu_ps(x.as_ptr().add(g * 64 + 16 * u));
                        acc[base + u] = _mm512_fmadd_ps(_mm512_cvtph_ps(h), xv, acc[base + u]);
                    }
                }
                let mut s = acc[0];
                for a in &acc[1..] {
                    s = _mm512_add_ps(s, *a);
                }
                *o = _mm512_reduce_add_ps(s);
            }
        }
    }
}

/// The address of `bytes` of new zeroed device memory (the device maps large buffers on
/// huge pages, as it does the weights), alive while `dev` is.
fn buffer(dev: &Device, bytes: usize) -> usize {
    let id = dev.alloc(bytes as u64).expect("device memory");
    dev.lookup(id).expect("a buffer just allocated").addr
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512vbmi") && std::is_x86_feature_detected!("avx512bw") {
        run();
        return;
    }
    println!("packed15 needs AVX-512 VBMI; this machine has none");
}

#[cfg(target_arch = "x86_64")]
fn run() {
    let rounds: usize = std::env::args().nth(1).map(|s| s.parse().expect("rounds: a number")).unwrap_or(15);
    let row_bytes = K / 64 * GROUP;
    let dev = Device::new(1, 0).expect("a CPU device");
    // SAFETY: two new buffers, 64-byte aligned, of ROWS * K f16 (any bits are one) and
    // ROWS * row_bytes bytes, each reached only through its slice while `dev` lives.
    let (plain, packed) = unsafe {
        (
            std::slice::from_raw_parts_mut(buffer(&dev, ROWS * K * 2) as *mut f16, ROWS * K),
            std::slice::from_raw_parts_mut(buffer(&dev, ROWS * row_bytes) as *mut u8, ROWS * row_bytes),
        )
    };
    plain.par_chunks_mut(K).zip(packed.par_chunks_mut(row_bytes)).enumerate().for_each(|(r, (row, dst))| {
        let mut s = (r as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        for w in row.iter_mut() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            *w = f16::from_f64(((s >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 0.08);
        }
        encode(row, dst);
    });
    let x: Vec<f32> = (0..K).map(|i| ((i * 7919) % 113) as f32 * 1e-2 - 0.5).collect();

    let sample = 256;
    let (mut a, mut b) = (vec![0f32; sample], vec![0f32; sample]);
    simd::gemv(WSlice::F16(plain), 0, sample, &x, 1, K, &mut a);
    // SAFETY: VBMI and BW were detected; the sizes hold.
    unsafe { x86::gemv(packed, sample, &x, K, &mut b) };
    let same = a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits());
    println!(
        "{:.3} GB as f16, {:.3} packed; the first {sample} rows {} the library's GEMV ({})",
        (ROWS * K * 2) as f64 / 1e9,
        (ROWS * row_bytes) as f64 / 1e9,
        if same { "bit-identical to" } else { "DIFFER from" },
        simd::IsaLevel::in_use().name(),
    );
    // Below AVX-512 (TESSERA_CPU_ISA) the library sums in another order.
    if !same && simd::IsaLevel::in_use() == simd::IsaLevel::Avx512 {
        std::process::exit(1);
    }

    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("thread pool");
    let mut out = vec![0f32; ROWS];
    let slices = 14;
    let per = ROWS / slices;
    let mut step = |packed_kind: bool| {
        let t = Instant::now();
        for l in 0..slices {
            pool.install(|| {
                out[l * per..(l + 1) * per].par_chunks_mut(per.div_ceil(threads)).enumerate().for_each(|(c, o)| {
                    let r0 = l * per + c * per.div_ceil(threads);
                    if packed_kind {
                        // SAFETY: as above; rows r0.. lie within the packed buffer.
                        unsafe { x86::gemv(&packed[r0 * row_bytes..], o.len(), &x, K, o) };
                    } else {
                        simd::gemv(WSlice::F16(&plain[r0 * K..]), 0, o.len(), &x, 1, K, o);
                    }
                });
            });
        }
        t.elapsed().as_secs_f64() * 1e3
    };
    println!("step ms ({threads} threads): f16, packed, ratio");
    let mut ratios = vec![];
    for i in 0..rounds {
        // Alternate which goes first, against the machine's drift.
        let (f, p) = if i % 2 == 0 {
            let f = step(false);
            (f, step(true))
        } else {
            let p = step(true);
            (step(false), p)
        };
        println!("{f:8.1} {p:8.1} {:7.3}", p / f);
        ratios.push(p / f);
    }
    ratios.sort_by(f64::total_cmp);
    println!("median ratio {:.3} over {rounds} rounds", ratios[rounds / 2]);
}
