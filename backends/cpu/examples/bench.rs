//! Throughput of the hot ops through the exported ABI, against STREAM copy and a
//! large f32 GEMM. Run: `cargo run --release -p tessera-kernels-cpu --example bench
//! [gemv|linear [MxNxK,...]|prompt [MxNxK,...]|attention|decode-attention]` (no argument:
//! all sections but `prompt`, which calls two of the library's f16 prompt kernels directly).
// It calls the library's C ABI exports directly, as a loader would.
#![allow(unsafe_code)]

use std::time::Instant;

use half::f16;
use rayon::prelude::*;
use tessera_kernel_abi::*;
use tessera_kernels_cpu::dtype::WSlice;
use tessera_kernels_cpu::ffi::*;
use tessera_kernels_cpu::ops::{panel_tiles, prefill_gemm};

fn alloc(dev: *mut TkDevice, bytes: usize) -> TkPtr {
    let mut b = std::ptr::null_mut();
    // SAFETY: valid device and out pointer.
    assert_eq!(unsafe { tk_alloc(dev, bytes as u64, &mut b) }, TK_OK);
    TkPtr { buf: b, offset: 0 }
}

/// `alloc` of `bytes` written through the ABI with 16-bit values in [0x3000, 0x3400):
/// small normal numbers read as f16 or bf16, and in pairs as f32. A buffer never
/// written reads the kernel's shared zero page, which sits in cache and would make a
/// DRAM-bound kernel look several times faster than it is.
fn filled(dev: *mut TkDevice, bytes: usize) -> TkPtr {
    let b = alloc(dev, bytes);
    let vals: Vec<u16> =
        (0..bytes.div_ceil(2)).map(|i| 0x3000 + (i.wrapping_mul(2_654_435_761) % 1024) as u16).collect();
    // SAFETY: valid device, a buffer of `bytes` and a host source of at least `bytes`.
    assert_eq!(unsafe { tk_copy_h2d(dev, b, vals.as_ptr().cast(), bytes as u64) }, TK_OK);
    b
}

fn time(mut f: impl FnMut(), iters: usize) -> f64 {
    f();
    let t = Instant::now();
    for _ in 0..iters {
        f();
    }
    t.elapsed().as_secs_f64() / iters as f64
}

fn main() {
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let cfg = TkDeviceConfig { threads: threads as u32, device_index: 0, memory_limit_bytes: 0 };
    let mut dev = std::ptr::null_mut();
    // SAFETY: valid pointers.
    assert_eq!(unsafe { tk_device_create(&cfg, &mut dev) }, TK_OK);

    // STREAM copy with the same thread count.
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    let n = 64 << 20; // 64 Mi f32 = 256 MiB per array
    let src = vec![1.0f32; n];
    let mut dst = vec![0.0f32; n];
    let t = time(
        || {
            pool.install(|| {
                dst.par_chunks_mut(1 << 16).zip(src.par_chunks(1 << 16)).for_each(|(d, s)| d.copy_from_slice(s))
            })
        },
        5,
    );
    let stream = 2.0 * 4.0 * n as f64 / t / 1e9;
    println!("STREAM copy ({threads} threads): {stream:.1} GB/s");
    drop((src, dst));

    // Big f32 GEMM through tk_linear.
    let s = 2048usize;
    let (o, x, w) = (alloc(dev, s * s * 4), filled(dev, s * s * 4), filled(dev, s * s * 4));
    let t = time(
        || {
            assert_eq!(
                // SAFETY: valid device and buffers of the right size.
                unsafe { tk_linear(dev, o, x, w, TK_DTYPE_F32, TkPtr::NULL, s as u32, s as u32, s as u32,) },
                TK_OK
            )
        },
        3,
    );
    let big = 2.0 * (s * s * s) as f64 / t / 1e9;
    println!("tk_linear f32 2048^3: {big:.1} GFLOP/s");

    let section = std::env::args().nth(1);
    // `linear` takes its shapes as a second argument, `MxNxK,...`.
    let linear_shapes: Vec<(usize, usize, usize)> = match std::env::args().nth(2) {
        Some(list) => list
            .split(',')
            .map(|t| match t.split('x').map(str::parse).collect::<Result<Vec<usize>, _>>().as_deref() {
                Ok(&[m, n, k]) => (m, n, k),
                _ => panic!("linear shapes are MxNxK,...: {t:?}"),
            })
            .collect(),
        None => vec![(32, 2048, 2048), (32, 8192, 2048), (512, 2048, 2048), (512, 8192, 2048)],
    };
    let run = |name: &str| section.as_deref().is_none_or(|s| s == name);

    // GEMV.
    for &(dt, name, es) in &[(TK_DTYPE_F16, "f16", 2usize), (TK_DTYPE_BF16, "bf16", 2), (TK_DTYPE_F32, "f32", 4)] {
        if !run("gemv") {
            break;
        }
        for &m in &[1usize, 2, 4, 6, 8] {
            let (n, k) = (8192usize, 4096usize);
            // Cycle through more weight bytes than the last-level cache holds, so the
            // figure is DRAM bandwidth, as in a real decode step.
            let copies = (1usize << 30).div_ceil(n * k * es);
            let (o, x) = (alloc(dev, m * n * 4), filled(dev, m * k * 4));
            // Written, which also keeps first-touch page faults out of the timing.
            let ws: Vec<TkPtr> = (0..copies).map(|_| filled(dev, n * k * es)).collect();
            let mut next = 0;
            let t = time(
                || {
                    let w = ws[next % copies];
                    next += 1;
                    // SAFETY: as above.
                    assert_eq!(unsafe { tk_linear(dev, o, x, w, dt, TkPtr::NULL, m as u32, n as u32, k as u32) }, TK_OK)
                },
                2 * copies,
            );
            for w in ws {
                // SAFETY: allocated above, freed once.
                unsafe { tk_free(dev, w.buf) };
            }
            let bw = (n * k * es) as f64 / t / 1e9;
            println!(
                "GEMV {name} m={m} n={n} k={k}: {bw:.1} GB/s weights ({:.0}% of STREAM copy)",
                bw / stream * 100.0
            );
        }
    }

    // Mid / large m with half weights.
    for &(dt, name) in &[(TK_DTYPE_F16, "f16"), (TK_DTYPE_BF16, "bf16"), (TK_DTYPE_F32, "f32")] {
        if !run("linear") {
            break;
        }
        for &(m, n, k) in &linear_shapes {
            let es = if dt == TK_DTYPE_F32 { 4 } else { 2 };
            let (o, x, w) = (alloc(dev, m * n * 4), filled(dev, m * k * 4), filled(dev, n * k * es));
            let t = time(
                // SAFETY: as above.
                || assert_eq!(unsafe { tk_linear(dev, o, x, w, dt, TkPtr::NULL, m as u32, n as u32, k as u32) }, TK_OK),
                5,
            );
            let gf = 2.0 * (m * n * k) as f64 / t / 1e9;
            println!("linear {name} m={m} n={n} k={k}: {gf:.1} GFLOP/s ({:.0}% of big f32 GEMM)", gf / big * 100.0);
        }
    }

    // The two f16 prompt kernels of AVX-512 CPUs side by side, in turns in this process
    // (machine states that last minutes tilt comparisons across runs): the cache-blocked
    // GEMM and the 256-bit panel tiles, which `linear` picks on Zen 4. Shapes as for
    // `linear`; without them, the bench model's prompt shapes.
    if section.as_deref() == Some("prompt") && panel_tiles::available() && prefill_gemm::available() {
        let shapes = match std::env::args().nth(2) {
            Some(_) => linear_shapes.clone(),
            None => vec![(64, 2048, 2048), (178, 2048, 2048), (178, 8192, 2048), (178, 2048, 8192), (512, 2048, 2048)],
        };
        const CALLS: usize = 15;
        for (m, n, k) in shapes {
            let x: Vec<f32> = (0..m * k).map(|i| (i.wrapping_mul(7919) % 1000) as f32 * 1e-3 - 0.5).collect();
            let w: Vec<f16> =
                (0..n * k).map(|i| f16::from_f32((i.wrapping_mul(104_729) % 1000) as f32 * 1e-3 - 0.5)).collect();
            let (mut gemm_out, mut tiles_out) = (vec![0f32; m * n], vec![0f32; m * n]);
            let (mut gemm, mut tiles) = (Vec::new(), Vec::new());
            pool.install(|| {
                for _ in 0..CALLS {
                    let t = Instant::now();
                    prefill_gemm::linear(&mut gemm_out, &x, WSlice::F16(&w), m, n, k, prefill_gemm::Precision::F32);
                    gemm.push(t.elapsed().as_secs_f64());
                    let t = Instant::now();
                    panel_tiles::linear(&mut tiles_out, &x, WSlice::F16(&w), m, n, k);
                    tiles.push(t.elapsed().as_secs_f64());
                }
            });
            assert!(gemm_out == tiles_out, "{m}x{n}x{k}: the two kernels' outputs differ");
            let median = |v: &mut Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[CALLS / 2]
            };
            let (g, t) = (median(&mut gemm), median(&mut tiles));
            let flop = 2.0 * (m * n * k) as f64 / 1e9;
            println!(
                "prompt f16 m={m} n={n} k={k}: GEMM {:.1}, panel tiles {:.1} GFLOP/s (medians of {CALLS} in turns); tiles' time {:.3} of the GEMM's, same bits",
                flop / g,
                flop / t,
                t / g
            );
        }
    }

    // Prefill attention of one whole prompt at several lengths, with SmolLM2's heads
    // (9 query heads over 3 KV heads) and a Llama-3-8B-like 32/8, head_dim 64, block 16.
    for &(tq, h, kvh) in &[(512usize, 32usize, 8usize), (512, 9, 3), (2048, 9, 3), (8192, 9, 3)] {
        for &(dt, name, es) in &[(TK_DTYPE_F32, "f32", 4usize), (TK_DTYPE_F16, "f16", 2)] {
            if !run("attention") {
                break;
            }
            let (hd, bs) = (64usize, 16usize);
            let nb = tq / bs;
            let kc = filled(dev, nb * kvh * bs * hd * es);
            let vc = filled(dev, nb * kvh * bs * hd * es);
            let cache = TkKvCache {
                k: kc,
                v: vc,
                dtype: dt,
                num_blocks: nb as u32,
                block_size: bs as u32,
                num_kv_heads: kvh as u32,
                head_dim: hd as u32,
                layout: TK_KV_LAYOUT_HEAD_MAJOR,
            };
            let qs = alloc(dev, 8);
            let cl = alloc(dev, 4);
            let bt = alloc(dev, nb * 4);
            let table: Vec<i32> = (0..nb as i32).collect();
            // SAFETY: valid buffers and host sources.
            unsafe {
                assert_eq!(tk_copy_h2d(dev, qs, [0i32, tq as i32].as_ptr().cast(), 8), TK_OK);
                assert_eq!(tk_copy_h2d(dev, cl, [tq as i32].as_ptr().cast(), 4), TK_OK);
                assert_eq!(tk_copy_h2d(dev, bt, table.as_ptr().cast(), (nb * 4) as u64), TK_OK);
            }
            let batch = TkAttnBatch {
                num_seqs: 1,
                max_blocks_per_seq: nb as u32,
                query_start: qs,
                context_lens: cl,
                block_tables: bt,
            };
            let (o, q) = (alloc(dev, tq * h * hd * 4), filled(dev, tq * h * hd * 4));
            let pairs = (tq * (tq + 1) / 2) as f64;
            let flop = 4.0 * hd as f64 * pairs * h as f64;
            // About a second of work at 50 GFLOP/s, at least twice.
            let iters = ((50e9 / flop) as usize).max(2);
            let t = time(
                || {
                    assert_eq!(
                        // SAFETY: valid device, buffers of the right size, a cache and batch built above.
                        unsafe { tk_prefill_attention(dev, o, q, &cache, &batch, tq as u32, h as u32, 0.125) },
                        TK_OK
                    )
                },
                iters,
            );
            let gf = flop / t / 1e9;
            println!(
                "prefill attention {name} cache {tq} tok {h}/{kvh} heads hd {hd}: {:.2} ms, {gf:.1} GFLOP/s ({:.0}% of big f32 GEMM)",
                t * 1e3,
                gf / big * 100.0
            );
            for b in [kc, vc, qs, cl, bt, o, q] {
                // SAFETY: allocated above, freed once.
                unsafe { tk_free(dev, b.buf) };
            }
        }
    }
    // Decode attention of one sequence (batch 1) and of 8, 32/8 heads of 64, f16 cache
    // in blocks of 16, at the contexts the engine is compared at: bytes of K and V read
    // per call against STREAM copy. The caches hold written values (see `filled`).
    for &(seqs, ctx) in &[(1usize, 512usize), (1, 2048), (1, 8192), (8, 2048)] {
        if !run("decode-attention") {
            break;
        }
        let (h, kvh, hd, bs, es) = (32usize, 8usize, 64usize, 16usize, 2usize);
        let per_seq = ctx.div_ceil(bs);
        let nb = seqs * per_seq;
        // As many caches as it takes to outgrow the last-level cache, used in turns like
        // the layers of a decode step.
        let cache_bytes = nb * kvh * bs * hd * es;
        let copies = (256usize << 20).div_ceil(2 * cache_bytes);
        let caches: Vec<TkKvCache> = (0..copies)
            .map(|_| TkKvCache {
                k: filled(dev, cache_bytes),
                v: filled(dev, cache_bytes),
                dtype: TK_DTYPE_F16,
                num_blocks: nb as u32,
                block_size: bs as u32,
                num_kv_heads: kvh as u32,
                head_dim: hd as u32,
                layout: TK_KV_LAYOUT_HEAD_MAJOR,
            })
            .collect();
        let (bt, cl) = (alloc(dev, nb * 4), alloc(dev, seqs * 4));
        let table: Vec<i32> = (0..nb as i32).collect();
        let lens = vec![ctx as i32; seqs];
        // SAFETY: valid buffers and host sources of the buffers' sizes.
        unsafe {
            assert_eq!(tk_copy_h2d(dev, bt, table.as_ptr().cast(), (nb * 4) as u64), TK_OK);
            assert_eq!(tk_copy_h2d(dev, cl, lens.as_ptr().cast(), (seqs * 4) as u64), TK_OK);
        }
        let (o, q) = (alloc(dev, seqs * h * hd * 4), filled(dev, seqs * h * hd * 4));
        let bytes = 2.0 * (seqs * ctx * kvh * hd * es) as f64;
        let mut next = 0;
        let t = time(
            || {
                let cache = &caches[next % copies];
                next += 1;
                // SAFETY: valid device, buffers of the right size, a cache and tables built above.
                let st = unsafe {
                    tk_paged_decode_attention(dev, o, q, cache, bt, cl, seqs as u32, per_seq as u32, h as u32, 0.125)
                };
                assert_eq!(st, TK_OK)
            },
            ((2e9 / bytes) as usize).max(2 * copies),
        );
        let bw = bytes / t / 1e9;
        println!(
            "decode attention f16 {seqs} x {ctx} tok {h}/{kvh} heads hd {hd}: {:.3} ms, {bw:.1} GB/s of K and V ({:.0}% of STREAM copy)",
            t * 1e3,
            bw / stream * 100.0
        );
        for b in caches.iter().flat_map(|c| [c.k, c.v]).chain([bt, cl, o, q]) {
            // SAFETY: allocated above, freed once.
            unsafe { tk_free(dev, b.buf) };
        }
    }
    // SAFETY: valid device.
    unsafe { tk_device_destroy(dev) };
}
