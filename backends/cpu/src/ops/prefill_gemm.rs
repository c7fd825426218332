//! Linear layers for prompts (more activation rows than a decode batch) on AVX-512 or
//! AVX2: a cache-blocked GEMM in the manner of BLIS, for weights of every storage type,
//! in one of two arithmetics ([`Precision`]).
//!
//! - The activations are packed once per call into panels of 64 rows, transposed so
//!   that each column step is 4 vectors of 16 (`xp[panel][kk][64]` on AVX-512; on AVX2
//!   `xp[panel][run][kk][16]`, runs of 16 rows: see [`Isa::sub`]).
//! - Each task takes `NC` weight rows. For each block of `KC` columns it converts those
//!   rows once (dequantizing quantized weights once per call, not once per panel of
//!   activations), in groups of `J` rows (`wp[row][kk]`): a micro-kernel's broadcasts
//!   walk `J` short rows (6 KiB) that stay in L1.
//! - On AVX-512 the micro-kernel keeps a 64 x `J` tile of the output in 24 registers
//!   across the block's columns: per column step, 4 activation vectors (from L2) and `J`
//!   broadcasts feed 24 multiply-adds. A last panel's rows take whole vectors and, where
//!   the rest fits in 8 lanes, a 256-bit half (on Zen 4's 256-bit units half the work
//!   of a vector: a 178-row prompt computes 184 rows, not 192; the engine's 178-token
//!   prompt went from 1.804 to 1.743 s, medians of 8 runs in turns). On AVX2 (16
//!   registers of 8 lanes) it takes the tile 16 rows at a time: 2 activation vectors
//!   and `J` broadcasts feed 12 FMAs into 12 registers. The task's output columns
//!   accumulate across blocks in a transposed tile (`ct[row][activation]`), written to
//!   the output once at the end.
//!
//! With [`Precision::F32`] a column step is one column and its multiply-adds are f32
//! FMAs, each output summed in column order on either instruction set. With
//! [`Precision::Bf16`] (AVX512-BF16 only) activations and weights are rounded to
//! bfloat16 (to nearest even) as they are packed, a column step is a pair of columns
//! (one 32-bit lane holds both values), and each multiply-add is a `vdpbf16ps`: two
//! products per lane into an f32 sum, twice the FMA's work per instruction.
//!
//! On AVX-512 it serves prompts and decode batches beyond the GEMV (33 rows up; but f16
//! prompts in f32 arithmetic on Zen 4's 256-bit units take AVX2's `panel_tiles`): the
//! `gemm` crate it replaced converted weight tiles for every call into a second copy,
//! and on the bench model's prompts this kernel is the faster of the two. On AVX2 it
//! serves decode batches beyond the GEMV (17 to 64 rows)
//! of weights other than f16/bf16 (those take `dot_tiles`), where the `gemm` crate on
//! converted tiles ran at half its rate (bench model, batch 32: ~1,250 against ~620 ms
//! per step); prompts of f32 or quantized weights stay with the `gemm` crate (prefill
//! 512 tokens, in turns: 72, 72, 63 tok/s against this kernel's 63, 61, 59).

use std::cell::RefCell;

use rayon::prelude::*;

use super::{SendPtr, prefetch};
use crate::dtype::WSlice;

/// The arithmetic of a prompt's linear layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(u8)]
pub enum Precision {
    /// f32 products of f32 activations and the weights as stored (converted to f32).
    #[default]
    F32 = 0,
    /// bfloat16 products (8 significant bits per operand) summed in f32: about twice
    /// the f32 rate on CPUs with AVX512-BF16, like PyTorch's "medium" float32 matmul
    /// precision. Elsewhere it falls back to `F32`.
    Bf16 = 1,
}

/// Activation rows per panel (4 vectors of 16).
const MR: usize = 64;
/// Weight rows per micro-kernel (broadcast operands).
const J: usize = 6;
/// Weight rows per task: 8 micro-kernel groups.
const NC: usize = 8 * J;
/// Activation rows per call of the blocked GEMM (8 panels): a row block's packed
/// activations, 16 MiB at 8,192 columns, stay in the last-level cache.
const MC: usize = 512;
/// Columns per block: one group's packed panel is 6 KiB and one activation panel 64 KiB
/// (f32; half of that in bf16).
const KC: usize = 256;

/// The most packed activations (in 4-byte lanes) kept between calls: 64 MiB, a row
/// block of `MC` rows of a 32,768-wide layer in f32. Wider ones are allocated for their
/// call only.
const KEEP_PACKED: usize = 16 << 20;

/// The micro-kernel's instruction set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isa {
    /// 16-lane vectors, the whole 64-row tile in registers (and bf16 pairs where the
    /// CPU has AVX512-BF16).
    Avx512,
    /// 8-lane vectors with FMA and F16C, the tile 16 rows at a time.
    Avx2,
}

impl Isa {
    /// Activation rows side by side in a packed panel: each column step of a panel is
    /// `MR / sub` runs of `sub` lanes, each run's steps contiguous. AVX-512 reads all
    /// 64 rows per step; AVX2 takes 16 rows through all of a block's steps, which then
    /// stream from consecutive lines (at a stride of 64 rows, its loads waited on L2).
    const fn sub(self) -> usize {
        match self {
            Isa::Avx512 => MR,
            Isa::Avx2 => 16,
        }
    }

    /// True when this CPU runs it.
    pub(crate) fn here(self) -> bool {
        match self {
            Isa::Avx512 => crate::simd::has_avx512(),
            Isa::Avx2 => crate::simd::has_avx2(),
        }
    }

    /// The widest one this CPU runs, if any.
    pub(crate) fn best() -> Option<Isa> {
        [Isa::Avx512, Isa::Avx2].into_iter().find(|isa| isa.here())
    }
}

/// True when the kernel can run here (AVX-512, or AVX2 with FMA and F16C).
pub fn available() -> bool {
    Isa::best().is_some()
}

/// True when `Precision::Bf16` runs as bf16 here (AVX512-BF16, with AVX512VL).
pub fn bf16_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::simd::has_avx512()
            && std::is_x86_feature_detected!("avx512bf16")
            && std::is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out[m][n] = x[m][k] · w[n][k]ᵀ`. Callers check `available()` and the slice lengths
/// (`out >= m*n`, `x >= m*k`, `w >= n*k`); quantized `w` needs `KC` to be a whole number
/// of its blocks and rows of whole blocks, as every supported format has.
pub fn linear(out: &mut [f32], x: &[f32], w: WSlice, m: usize, n: usize, k: usize, precision: Precision) {
    let isa = Isa::best().expect("callers check `available()`");
    linear_on(isa, out, x, w, m, n, k, precision);
}

/// [`linear`] on the instruction set `isa`, which the CPU must have (tests run each).
#[allow(clippy::too_many_arguments)] // `linear`'s, and the instruction set
pub(crate) fn linear_on(
    isa: Isa,
    out: &mut [f32],
    x: &[f32],
    w: WSlice,
    m: usize,
    n: usize,
    k: usize,
    precision: Precision,
) {
    assert!(isa.here());
    assert!(out.len() >= m * n && x.len() >= m * k && w.len() >= n * k);
    if m == 0 || n == 0 || k == 0 {
        out[..m * n].fill(0.0);
        return;
    }
    let bf16 = precision == Precision::Bf16 && isa == Isa::Avx512 && bf16_available();
    // Row blocks of MC: each task streams its block's packed activations once per KC
    // columns, and those of a long prompt outgrow the last-level cache (bench model,
    // f32: prefill 2,048 tokens 169 -> 185 tok/s, 8,000 tokens 113 -> 134).
    for (o, xs) in out[..m * n].chunks_mut(MC * n).zip(x[..m * k].chunks(MC * k)) {
        let rows = xs.len() / k;
        if bf16 { gemm::<Bf16Pairs>(isa, o, xs, w, rows, n, k) } else { gemm::<F32Lanes>(isa, o, xs, w, rows, n, k) }
    }
}

/// One arithmetic: how values are packed into 4-byte lanes and multiplied.
trait Arith {
    /// Columns per packed lane: 1 (f32 lanes, multiplied by FMAs) or 2 (bf16 pairs,
    /// multiplied by `vdpbf16ps`).
    const COLS: usize;
    /// `dst[i]` = the lane of columns `[i * COLS, (i + 1) * COLS)` of `src` (a short
    /// last lane padded with zeros). `dst.len() == src.len().div_ceil(COLS)`.
    fn pack(src: &[f32], dst: &mut [u32]);
    /// Weight columns `[start, start + dst.len() * COLS)` (clipped at `end`) packed.
    fn pack_weights(w: WSlice, start: usize, end: usize, dst: &mut [u32], scratch: &mut Vec<f32>) {
        scratch.resize(end - start, 0.0);
        w.to_f32(start, scratch);
        Self::pack(scratch, dst);
    }
    /// `tile[j * ld + i] (+)= Σ_p x(p, i) · wp[j * kp + p]` over `kp` lanes for `j < J`
    /// and `i < rows` (and the rest of the last vector: 16 lanes, or on AVX-512 8 where
    /// 8 cover the rows left), added to the tile's values unless `first`; `x(p, i)` is
    /// `xp[i / sub * stride + p * sub + i % sub]` with `isa`'s [`Isa::sub`].
    ///
    /// # Safety
    /// `isa` (and the arithmetic's own feature: bf16 pairs need AVX-512 with
    /// AVX512-BF16 and AVX512VL) must be available; `xp` holds every `x(p, i)` read,
    /// `wp` holds `kp * J` lanes, `tile` holds `(J - 1) * ld + rows.next_multiple_of(16)`
    /// values; `rows` is 1 to `MR`.
    #[allow(clippy::too_many_arguments)] // the tile's operands, and the instruction set
    unsafe fn kernel(
        isa: Isa,
        rows: usize,
        xp: &[u32],
        stride: usize,
        wp: &[u32],
        kp: usize,
        tile: &mut [f32],
        ld: usize,
        first: bool,
    ) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: forwarded contract.
        unsafe {
            match (Self::COLS, isa) {
                (2, _) => x86::kernel_bf16(rows, xp, wp, kp, tile, ld, first),
                (_, Isa::Avx512) => x86::kernel_f32(rows, xp, wp, kp, tile, ld, first),
                (_, Isa::Avx2) => x86::kernel_f32_avx2(rows.div_ceil(16), xp, stride, wp, kp, tile, ld, first),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!(
            "the GEMM runs on x86_64 only ({isa:?} {rows} {} {stride} {} {kp} {} {ld} {first})",
            xp.len(),
            wp.len(),
            tile.len()
        )
    }
}

struct F32Lanes;

impl Arith for F32Lanes {
    const COLS: usize = 1;
    fn pack(src: &[f32], dst: &mut [u32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.to_bits();
        }
    }
    fn pack_weights(w: WSlice, start: usize, end: usize, dst: &mut [u32], _: &mut Vec<f32>) {
        // f32 lanes are the values themselves: convert straight into place.
        let dst: &mut [f32] = bytemuck::cast_slice_mut(&mut dst[..end - start]);
        w.to_f32(start, dst);
    }
}

struct Bf16Pairs;

impl Arith for Bf16Pairs {
    const COLS: usize = 2;
    fn pack(src: &[f32], dst: &mut [u32]) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: callers reach this only after `bf16_available()`; lengths as documented.
        unsafe {
            x86::pack_bf16(src, dst)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("bf16 lanes are packed on x86_64 only ({} {})", src.len(), dst.len())
    }
}

fn gemm<A: Arith>(isa: Isa, out: &mut [f32], x: &[f32], w: WSlice, m: usize, n: usize, k: usize) {
    let panels = m.div_ceil(MR);
    let m_pad = panels * MR;
    // Packed lanes per row; a block of KC columns starts at lane k0 / COLS (KC is a
    // whole number of lanes).
    let kl = k.div_ceil(A::COLS);
    // The buffers of the last call are reused (fresh ones of this size are pages the
    // kernel must map and zero on every call). Rows past m in the last panel keep old
    // values: they only reach output rows that are never written out.
    thread_local! {
        static PACKED: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
        static TASK: RefCell<Scratch> = const { RefCell::new(Scratch::new()) };
    }
    let sub = isa.sub();
    let mut xp = PACKED.with(|b| b.try_borrow_mut().map(|mut b| std::mem::take(&mut *b)).unwrap_or_default());
    if xp.len() < panels * kl * MR {
        xp.resize(panels * kl * MR, 0);
    }
    xp.par_chunks_mut(kl * MR).take(panels).enumerate().for_each(|(p, panel)| {
        let rows = MR.min(m - p * MR);
        // A block of lanes at a time for every row: the block's panel rows (16 of MR
        // lanes, 4 KiB) stay in L1 while the rows fill them. Whole rows at a time wrote
        // each value to another line of a panel far larger than L1 (~2% of a served
        // step of 8 decodes and ~300 prompt tokens).
        const LB: usize = 16;
        let mut lanes = [0u32; LB];
        for l0 in (0..kl).step_by(LB) {
            let nl = LB.min(kl - l0);
            let cols = l0 * A::COLS..((l0 + nl) * A::COLS).min(k);
            for i in 0..rows {
                A::pack(&x[(p * MR + i) * k..][cols.clone()], &mut lanes[..nl]);
                let run = &mut panel[i / sub * kl * sub + i % sub..];
                for (t, &v) in lanes[..nl].iter().enumerate() {
                    run[(l0 + t) * sub] = v;
                }
            }
        }
    });
    let xp_all = &xp[..];
    let optr = SendPtr(out.as_mut_ptr());
    // Tasks of up to NC rows (whole groups of J), as many as a multiple of the threads
    // so that each thread gets the same work: on 2 threads a 512-row layer is 12 tasks
    // of 7 or 8 groups, not 11 of 8 (6 against 5).
    let all_groups = n.div_ceil(J);
    let tasks = all_groups.div_ceil(NC / J).next_multiple_of(rayon::current_num_threads().max(1)).min(all_groups);
    (0..tasks).into_par_iter().for_each(|task| {
        TASK.with(|scratch| {
            let mut fresh = Scratch::new();
            let mut guard = scratch.try_borrow_mut().ok();
            let Scratch { wp, ct, row } = match guard.as_deref_mut() {
                Some(held) => held,
                None => &mut fresh,
            };
            wp.resize(wp.len().max(NC * KC), 0);
            ct.resize(ct.len().max(NC * m_pad), 0.0);
            let j0 = task * all_groups / tasks * J;
            let nc = ((task + 1) * all_groups / tasks * J).min(n) - j0;
            let groups = nc.div_ceil(J);
            for k0 in (0..k).step_by(KC) {
                let kc = KC.min(k - k0);
                let kp = kc.div_ceil(A::COLS);
                for jj in 0..groups * J {
                    let lanes = &mut wp[jj * kp..][..kp];
                    if jj < nc {
                        let at = (j0 + jj) * k + k0;
                        A::pack_weights(w, at, at + kc, lanes, row);
                        // The next block of this row comes from DRAM while this one is
                        // computed.
                        prefetch(w.byte_range(at + kc, (j0 + jj) * k + (k0 + kc + KC).min(k)));
                    } else {
                        lanes.fill(0);
                    }
                }
                for p in 0..panels {
                    let rows = (m - p * MR).min(MR);
                    // The block's first step of the first run, to the panel's end.
                    let xpanel = &xp_all[p * kl * MR + k0 / A::COLS * sub..(p + 1) * kl * MR];
                    for g in 0..groups {
                        let wpanel = &wp[g * kp * J..][..kp * J];
                        let tile = &mut ct[g * J * m_pad + p * MR..];
                        // SAFETY: `isa` was asserted by `linear_on`, and the bf16
                        // arithmetic is chosen only where `bf16_available()`;
                        // `xpanel` holds the block's steps of every run, `wpanel`
                        // kp * J lanes, and `tile` reaches the J rows of m_pad values
                        // from its start, each of which covers the panel's rows
                        // rounded up to whole vectors.
                        unsafe { A::kernel(isa, rows, xpanel, kl * sub, wpanel, kp, tile, m_pad, k0 == 0) };
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

/// A task's buffers, kept per thread between calls.
struct Scratch {
    /// Packed weight lanes of a block (`NC` rows).
    wp: Vec<u32>,
    /// The task's output columns, transposed.
    ct: Vec<f32>,
    /// One weight row's block in f32, before it is packed as bf16.
    row: Vec<f32>,
}

impl Scratch {
    const fn new() -> Scratch {
        Scratch { wp: Vec::new(), ct: Vec::new(), row: Vec::new() }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{J, MR};

    /// `Arith::kernel` for f32 lanes: FMAs.
    ///
    /// # Safety
    /// As `Arith::kernel`.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn kernel_f32(rows: usize, xp: &[u32], wp: &[u32], kp: usize, tile: &mut [f32], ld: usize, first: bool) {
        // SAFETY: forwarded contract.
        unsafe { by_rows::<false>(rows, xp, wp, kp, tile, ld, first) }
    }

    /// `Arith::kernel` for bf16 pairs: `vdpbf16ps`.
    ///
    /// # Safety
    /// As `Arith::kernel`, and avx512bf16 and avx512vl must be available.
    #[target_feature(enable = "avx512f,avx512bf16,avx512vl")]
    pub unsafe fn kernel_bf16(
        rows: usize,
        xp: &[u32],
        wp: &[u32],
        kp: usize,
        tile: &mut [f32],
        ld: usize,
        first: bool,
    ) {
        // SAFETY: forwarded contract.
        unsafe { by_rows::<true>(rows, xp, wp, kp, tile, ld, first) }
    }

    /// The tile in halves of 8 rows: whole 16-lane vectors, and one 256-bit half where
    /// the rows left fit in it (see the module's notes). Inlined into the two kernels
    /// above, so it is compiled with their features.
    #[inline(always)]
    unsafe fn by_rows<const BF16: bool>(
        rows: usize,
        xp: &[u32],
        wp: &[u32],
        kp: usize,
        tile: &mut [f32],
        ld: usize,
        first: bool,
    ) {
        debug_assert!((1..=MR).contains(&rows));
        debug_assert!(
            xp.len() >= kp * MR && wp.len() >= kp * J && tile.len() >= (J - 1) * ld + rows.next_multiple_of(16)
        );
        // SAFETY: forwarded contract.
        unsafe {
            match rows.div_ceil(8) {
                1 => tile_v::<0, true, BF16>(xp, wp, kp, tile, ld, first),
                2 => tile_v::<1, false, BF16>(xp, wp, kp, tile, ld, first),
                3 => tile_v::<1, true, BF16>(xp, wp, kp, tile, ld, first),
                4 => tile_v::<2, false, BF16>(xp, wp, kp, tile, ld, first),
                5 => tile_v::<2, true, BF16>(xp, wp, kp, tile, ld, first),
                6 => tile_v::<3, false, BF16>(xp, wp, kp, tile, ld, first),
                7 => tile_v::<3, true, BF16>(xp, wp, kp, tile, ld, first),
                _ => tile_v::<4, false, BF16>(xp, wp, kp, tile, ld, first),
            }
        }
    }

    /// `V` vectors of 16 rows, then an 8-row half if `H`.
    #[inline(always)]
    unsafe fn tile_v<const V: usize, const H: bool, const BF16: bool>(
        xp: &[u32],
        wp: &[u32],
        kp: usize,
        tile: &mut [f32],
        ld: usize,
        first: bool,
    ) {
        let tp = tile.as_mut_ptr();
        // SAFETY: every offset below is within the lengths the caller guarantees.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); V]; J];
            let mut half = [_mm256_setzero_ps(); J];
            if !first {
                for (j, a) in acc.iter_mut().enumerate() {
                    for (v, r) in a.iter_mut().enumerate() {
                        *r = _mm512_loadu_ps(tp.add(j * ld + v * 16));
                    }
                }
                if H {
                    for (j, h) in half.iter_mut().enumerate() {
                        *h = _mm256_loadu_ps(tp.add(j * ld + V * 16));
                    }
                }
            }
            let (xptr, wptr) = (xp.as_ptr(), wp.as_ptr());
            for p in 0..kp {
                let xs: [__m512i; V] = std::array::from_fn(|v| _mm512_loadu_si512(xptr.add(p * MR + v * 16).cast()));
                let xh = if H { _mm256_loadu_si256(xptr.add(p * MR + V * 16).cast()) } else { _mm256_setzero_si256() };
                for (j, a) in acc.iter_mut().enumerate() {
                    let b = _mm512_set1_epi32(*wptr.add(j * kp + p) as i32);
                    if H {
                        let bh = _mm512_castsi512_si256(b);
                        half[j] = if BF16 {
                            _mm256_dpbf16_ps(
                                half[j],
                                std::mem::transmute::<__m256i, __m256bh>(xh),
                                std::mem::transmute::<__m256i, __m256bh>(bh),
                            )
                        } else {
                            _mm256_fmadd_ps(_mm256_castsi256_ps(xh), _mm256_castsi256_ps(bh), half[j])
                        };
                    }
                    for v in 0..V {
                        a[v] = if BF16 {
                            _mm512_dpbf16_ps(
                                a[v],
                                std::mem::transmute::<__m512i, __m512bh>(xs[v]),
                                std::mem::transmute::<__m512i, __m512bh>(b),
                            )
                        } else {
                            _mm512_fmadd_ps(_mm512_castsi512_ps(xs[v]), _mm512_castsi512_ps(b), a[v])
                        };
                    }
                }
            }
            for (j, a) in acc.iter().enumerate() {
                for (v, r) in a.iter().enumerate() {
                    _mm512_storeu_ps(tp.add(j * ld + v * 16), *r);
                }
                if H {
                    _mm256_storeu_ps(tp.add(j * ld + V * 16), half[j]);
                }
            }
        }
    }

    /// `Arith::kernel` for f32 lanes on AVX2: the tile one run of 16 rows at a time,
    /// each over all `kp` columns with its 16 x `J` outputs in 12 registers (of 16): per
    /// column, two activation vectors and `J` broadcasts feed 12 FMAs.
    ///
    /// # Safety
    /// As `Arith::kernel`, on AVX2 with FMA.
    #[allow(clippy::too_many_arguments)] // `Arith::kernel`'s
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn kernel_f32_avx2(
        vecs: usize,
        xp: &[u32],
        stride: usize,
        wp: &[u32],
        kp: usize,
        tile: &mut [f32],
        ld: usize,
        first: bool,
    ) {
        debug_assert!(xp.len() >= (vecs - 1) * stride + kp * 16 && wp.len() >= kp * J);
        debug_assert!(tile.len() >= (J - 1) * ld + 16 * vecs);
        let tp = tile.as_mut_ptr();
        let (xptr, wptr) = (xp.as_ptr().cast::<f32>(), wp.as_ptr().cast::<f32>());
        // SAFETY: every offset below is within the lengths the caller guarantees.
        unsafe {
            for s in 0..vecs.min(MR / 16) {
                let mut acc = [_mm256_setzero_ps(); 2 * J];
                if !first {
                    for (a, r) in acc.iter_mut().enumerate() {
                        *r = _mm256_loadu_ps(tp.add(a / 2 * ld + s * 16 + a % 2 * 8));
                    }
                }
                let xs = xptr.add(s * stride);
                for p in 0..kp {
                    let x0 = _mm256_loadu_ps(xs.add(p * 16));
                    let x1 = _mm256_loadu_ps(xs.add(p * 16 + 8));
                    for j in 0..J {
                        let b = _mm256_broadcast_ss(&*wptr.add(j * kp + p));
                        acc[2 * j] = _mm256_fmadd_ps(x0, b, acc[2 * j]);
                        acc[2 * j + 1] = _mm256_fmadd_ps(x1, b, acc[2 * j + 1]);
                    }
                }
                for (a, r) in acc.iter().enumerate() {
                    _mm256_storeu_ps(tp.add(a / 2 * ld + s * 16 + a % 2 * 8), *r);
                }
            }
        }
    }

    /// `dst[i]` = the bf16 pair (low half: `src[2i]`, high half: `src[2i + 1]`, or 0
    /// past the end), each rounded to nearest even.
    ///
    /// # Safety
    /// avx512bf16 must be available; `dst.len() == src.len().div_ceil(2)`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn pack_bf16(src: &[f32], dst: &mut [u32]) {
        debug_assert_eq!(dst.len(), src.len().div_ceil(2));
        let mut i = 0;
        // SAFETY: 32 values from i are in `src`, and their 16 lanes from i / 2 in `dst`.
        unsafe {
            while i + 32 <= src.len() {
                let lo = _mm512_loadu_ps(src.as_ptr().add(i));
                let hi = _mm512_loadu_ps(src.as_ptr().add(i + 16));
                // The second operand fills the low 16 bf16 values.
                let packed: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
                _mm512_storeu_si512(dst.as_mut_ptr().add(i / 2).cast(), packed);
                i += 32;
            }
        }
        let bits = |at: usize| src.get(at).map_or(0, |&v| half::bf16::from_f32(v).to_bits() as u32);
        while i < src.len() {
            dst[i / 2] = bits(i) | bits(i + 1) << 16;
            i += 2;
        }
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::*;
    use half::{bf16, f16};

    #[test]
    fn blocks_panels_and_tasks_of_every_size_match_naive() {
        let isas: Vec<Isa> = [Isa::Avx512, Isa::Avx2].into_iter().filter(|isa| isa.here()).collect();
        if isas.is_empty() {
            eprintln!("skipped: neither AVX-512 nor AVX2 on this CPU (linear's tests cover the gemm crate path)");
            return;
        }
        // m: a partial last panel of 0 to 3 vectors with an 8-row half (65, 88, 100, 184)
        // or 1 to 4 whole ones (89, 191), and whole panels; n: tasks of NC rows with a
        // short last group; k: one block, whole blocks, a short last block. m: also
        // several row blocks of MC with a short last one.
        for &(m, n, k) in &[
            (65, 7, 40),
            (88, 20, 70),
            (89, 30, 33),
            (100, 50, 256),
            (184, 9, 260),
            (128, 97, 600),
            (191, 49, 513),
            (64 * 3 + 48, 13, 300),
            (2 * MC + 70, 11, 90),
        ] {
            let mut rng = Rng((m * 1000 + n * 10 + k) as u64);
            let x = rng.vec(m * k);
            let w32 = rng.vec(n * k);
            let w16: Vec<f16> = w32.iter().map(|&v| f16::from_f32(v)).collect();
            let wb: Vec<bf16> = w32.iter().map(|&v| bf16::from_f32(v)).collect();
            for (name, w) in [("f32", WSlice::F32(&w32)), ("f16", WSlice::F16(&w16)), ("bf16", WSlice::Bf16(&wb))] {
                let want = naive_linear(&x, &w.to_vec_f32(), m, n, k);
                let mut first: Option<Vec<f32>> = None;
                for &isa in &isas {
                    let mut out = vec![f32::NAN; m * n];
                    linear_on(isa, &mut out, &x, w, m, n, k, Precision::F32);
                    let what = format!("{isa:?} m={m} n={n} k={k} {name}");
                    assert_close(&out, &want, 2e-6 * (k as f32).sqrt() + 1e-5, &what);
                    // Both sum each output in column order: the same bits.
                    if let Some(f) = &first {
                        assert!(f.iter().zip(&out).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: not AVX-512's");
                    }
                    first.get_or_insert(out);
                }
            }
        }
    }

    fn round_bf16(v: &[f32]) -> Vec<f32> {
        v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
    }

    #[test]
    fn bf16_products_are_those_of_the_operands_rounded_to_bf16() {
        if !bf16_available() {
            eprintln!("skipped: no AVX512-BF16 on this CPU (Precision::Bf16 runs as F32 here)");
            return;
        }
        // Odd k (a zero-padded last pair), a short last block, every panel width (and
        // 8-row halves after 0, 2 and 3 vectors).
        for &(m, n, k) in
            &[(65, 7, 41), (100, 50, 256), (184, 9, 261), (191, 49, 513), (64 * 3 + 48, 13, 301), (MC + 30, 5, 33)]
        {
            let mut rng = Rng((m * 7 + n * 3 + k) as u64);
            let x = rng.vec(m * k);
            let w32 = rng.vec(n * k);
            let w16: Vec<f16> = w32.iter().map(|&v| f16::from_f32(v)).collect();
            for (name, w) in [("f32", WSlice::F32(&w32)), ("f16", WSlice::F16(&w16))] {
                let want = naive_linear(&round_bf16(&x), &round_bf16(&w.to_vec_f32()), m, n, k);
                let mut out = vec![f32::NAN; m * n];
                linear(&mut out, &x, w, m, n, k, Precision::Bf16);
                assert_close(&out, &want, 2e-6 * (k as f32).sqrt() + 1e-5, &format!("bf16 m={m} n={n} k={k} {name}"));
                // And it is not the f32 result: the rounding is real.
                let exact = naive_linear(&x, &w.to_vec_f32(), m, n, k);
                assert!(out.iter().zip(&exact).any(|(a, b)| (a - b).abs() > 1e-4), "{name}: no bf16 rounding seen");
            }
        }
    }

    #[test]
    fn bf16_packing_rounds_to_nearest_even_and_pads_odd_rows() {
        if !bf16_available() {
            eprintln!("skipped: no AVX512-BF16 on this CPU");
            return;
        }
        let mut rng = Rng(5);
        for len in [1, 2, 31, 32, 33, 64, 67] {
            let mut src = rng.vec(len);
            // Ties: 1 + 2^-8 rounds down to 1 (even), 1 + 3 * 2^-8 up to 1 + 2^-6.
            src[0] = 1.0 + 1.0 / 256.0;
            if len > 1 {
                src[1] = 1.0 + 3.0 / 256.0;
            }
            let mut lanes = vec![u32::MAX; len.div_ceil(2)];
            Bf16Pairs::pack(&src, &mut lanes);
            for (i, &v) in src.iter().enumerate() {
                let bits = (lanes[i / 2] >> (16 * (i % 2))) as u16;
                assert_eq!(bits, bf16::from_f32(v).to_bits(), "len {len} value {i}");
            }
            if len % 2 == 1 {
                assert_eq!(lanes[len / 2] >> 16, 0, "len {len}: the padding is not zero");
            }
        }
    }
}
