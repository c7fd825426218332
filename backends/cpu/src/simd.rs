//! Vector kernels: the small-m GEMV over f32/f16/bf16 weights (AVX-512, AVX2+FMA+F16C
//! or a portable fallback, chosen at run time) and conversion / dot-product helpers.

use half::{bf16, f16};

use crate::dtype::WSlice;

/// The x86 kernels' instruction sets, lowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum IsaLevel {
    /// No SIMD kernels: the portable code (what a CPU other than x86-64 runs).
    Portable,
    /// AVX2 with FMA and F16C.
    Avx2,
    /// AVX-512 (F and BW; VNNI, VL and BF16 where the CPU has them).
    Avx512,
}

impl IsaLevel {
    /// Every level, widest first.
    pub const ALL: [IsaLevel; 3] = [IsaLevel::Avx512, IsaLevel::Avx2, IsaLevel::Portable];

    /// The level's name, as `TESSERA_CPU_ISA` takes it.
    pub fn name(self) -> &'static str {
        match self {
            IsaLevel::Avx512 => "avx512",
            IsaLevel::Avx2 => "avx2",
            IsaLevel::Portable => "portable",
        }
    }

    /// The widest level this CPU runs under the cap (the one the kernels take).
    pub fn in_use() -> IsaLevel {
        if has_avx512() {
            IsaLevel::Avx512
        } else if has_avx2() {
            IsaLevel::Avx2
        } else {
            IsaLevel::Portable
        }
    }
}

/// The environment variable that caps the kernels' instruction set: `avx512`, `avx2` or
/// `portable` (as oneDNN's `ONEDNN_MAX_CPU_ISA` does). The kernels a cap leaves out
/// are never called, so one machine can run (and test, and time) the code paths of a
/// CPU without AVX-512 or without x86 SIMD. A cap above what the CPU has changes
/// nothing. Read once per process. The `gemm` crate, which serves the prompts of f32
/// and quantized weights where AVX-512 is not used, picks its instructions itself.
pub const ISA_ENV: &str = "TESSERA_CPU_ISA";

/// The cap `TESSERA_CPU_ISA` sets: `Ok(None)` when it is unset or empty, an error
/// message when it names no level (then the device refuses to start: see
/// `Device::new`; the kernels themselves run uncapped).
pub fn isa_cap() -> &'static Result<Option<IsaLevel>, String> {
    static CAP: std::sync::OnceLock<Result<Option<IsaLevel>, String>> = std::sync::OnceLock::new();
    CAP.get_or_init(|| parse_isa_cap(std::env::var_os(ISA_ENV).as_deref()))
}

fn parse_isa_cap(value: Option<&std::ffi::OsStr>) -> Result<Option<IsaLevel>, String> {
    let Some(value) = value else { return Ok(None) };
    let text = value.to_str().map(str::trim).unwrap_or("\u{fffd}");
    if text.is_empty() {
        return Ok(None);
    }
    IsaLevel::ALL.into_iter().find(|level| level.name().eq_ignore_ascii_case(text)).map(Some).ok_or_else(|| {
        let names: Vec<&str> = IsaLevel::ALL.iter().map(|level| level.name()).collect();
        format!("{ISA_ENV}={value:?} names no instruction set: expected one of {}", names.join(", "))
    })
}

/// True unless `TESSERA_CPU_ISA` caps the kernels below `level`.
#[inline]
fn isa_allows(level: IsaLevel) -> bool {
    !matches!(isa_cap(), Ok(Some(cap)) if *cap < level)
}

/// True when the AVX2 + FMA + F16C kernels can run on this CPU (and the cap allows them).
#[inline]
pub fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        isa_allows(IsaLevel::Avx2)
            && std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// True when the AVX-512 (F + BW) kernels can run on this CPU (and the cap allows them).
#[inline]
pub fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        isa_allows(IsaLevel::Avx512)
            && std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// True where the CPU runs AVX-512 on 256-bit units: AMD's Zen 4 (family 19h; Zen 3,
/// the same family, has no AVX-512). A 512-bit FMA there is two 256-bit ones, so the
/// 256-bit kernels' peak is AVX-512's, and where their loop is the better one they are
/// the faster (see `ops::linear`'s use of it).
pub fn avx512_on_256_bit_units() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static ZEN4: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        has_avx512() && *ZEN4.get_or_init(|| amd_family() == Some(0x19))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The CPU's family (base plus extended, as CPUID reports it) on an AMD CPU.
#[cfg(target_arch = "x86_64")]
fn amd_family() -> Option<u32> {
    use std::arch::x86_64::__cpuid;
    let vendor = __cpuid(0);
    let name: Vec<u8> = [vendor.ebx, vendor.edx, vendor.ecx].iter().flat_map(|r| r.to_le_bytes()).collect();
    if name != b"AuthenticAMD" {
        return None;
    }
    let eax = __cpuid(1).eax;
    let base = (eax >> 8) & 0xf;
    Some(if base == 0xf { base + ((eax >> 20) & 0xff) } else { base })
}

/// The most activation rows `gemv` serves on this CPU in one pass over the weights.
#[inline]
pub fn gemv_max_m() -> usize {
    if has_avx2() || has_avx512() { 8 } else { 4 }
}

/// The L1 data cache of the first CPU in bytes (from sysfs), or 32 KiB where it cannot
/// be read (once; later calls return the first answer).
pub fn l1d_bytes() -> usize {
    static BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BYTES.get_or_init(read_l1d_bytes)
}

fn read_l1d_bytes() -> usize {
    let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    let read = |index: &str, file: &str| std::fs::read_to_string(dir.join(index).join(file)).ok();
    (0..8)
        .map(|i| format!("index{i}"))
        .find(|i| {
            read(i, "level").as_deref().map(str::trim) == Some("1")
                && read(i, "type").as_deref().map(str::trim) == Some("Data")
        })
        .and_then(|i| read(&i, "size"))
        .and_then(|s| s.trim().strip_suffix('K').and_then(|k| k.parse::<usize>().ok()))
        .map_or(32 << 10, |k| k << 10)
}

/// f16 -> f32 conversion of a slice.
pub fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the required CPU features were detected just above.
        unsafe { x512::f16_to_f32(src, dst) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the required CPU features were detected just above.
        unsafe { x86::f16_to_f32(src, dst) };
        return;
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

/// bf16 -> f32 conversion of a slice (a shift; the compiler vectorises it).
pub fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits((s.to_bits() as u32) << 16);
    }
}

/// Dot product of two f32 slices of equal length, 8 independent lanes.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        s += x * y;
    }
    s
}

/// `y += a * x`.
#[inline]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// GEMV for `m` (1..=`gemv_max_m()`) activation rows: for each weight row `row0 + r` (r < rows) and
/// activation row `i`, `out[r * m + i] = dot(w[row0 + r, :], x[i, :])`. Each weight row
/// is read once for all `m` activation rows.
pub fn gemv(w: WSlice, row0: usize, rows: usize, x: &[f32], m: usize, k: usize, out: &mut [f32]) {
    assert!((1..=gemv_max_m()).contains(&m));
    assert!(x.len() >= m * k && out.len() >= rows * m);
    assert!(w.len() >= (row0 + rows) * k);
    if let WSlice::Quant(..) = w {
        // Quantized weights take `ops::quant`'s integer kernels; this dequantizing path
        // is their reference.
        gemv_scalar(w, row0, rows, x, m, k, out);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU features were detected, and the asserts above guarantee every
        // row read (`w[(row0 + r) * k ..][..k]`, `x[i * k ..][..k]`) is in bounds.
        unsafe {
            match w {
                WSlice::F32(s) => x512::gemv_f32(s, row0, rows, x, m, k, out),
                WSlice::F16(s) => x512::gemv_f16(s, row0, rows, x, m, k, out),
                WSlice::Bf16(s) => x512::gemv_bf16(s, row0, rows, x, m, k, out),
                WSlice::Quant(..) => {}
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: as above.
        unsafe {
            match w {
                WSlice::F32(s) => x86::gemv_f32(s, row0, rows, x, m, k, out),
                WSlice::F16(s) => x86::gemv_f16(s, row0, rows, x, m, k, out),
                WSlice::Bf16(s) => x86::gemv_bf16(s, row0, rows, x, m, k, out),
                WSlice::Quant(..) => {}
            }
        }
        return;
    }
    gemv_scalar(w, row0, rows, x, m, k, out);
}

/// `x` (`m` rows of `k`) as groups of `lanes` columns, each row's group after the
/// other: `xil[(c * m + i) * lanes + l] = x[i * k + lanes * c + l]`, a short last group
/// padded with zeros. The GEMVs of several rows read them so: one pointer walks every
/// row, and a block of columns of every row is one contiguous run (rows `k` apart would
/// share the same few L1 sets).
pub fn interleave(x: &[f32], m: usize, k: usize, lanes: usize) -> Vec<f32> {
    let groups = k.div_ceil(lanes);
    let mut xil = vec![0.0f32; groups * m * lanes];
    for i in 0..m {
        for (c, src) in x[i * k..(i + 1) * k].chunks(lanes).enumerate() {
            xil[(c * m + i) * lanes..][..src.len()].copy_from_slice(src);
        }
    }
    xil
}

/// The vector width in f32 lanes of the activations [`gemv_interleaved`] reads for `m`
/// rows on this CPU ([`interleave`]), or `None` where `gemv` reads them row by row.
pub fn interleave_lanes(m: usize) -> Option<usize> {
    if has_avx512() && m >= 2 {
        Some(16)
    } else if has_avx2() && m >= 5 {
        Some(8)
    } else {
        None
    }
}

/// [`gemv`] for activation rows given as [`interleave`] lays them out with
/// [`interleave_lanes`]`(m)` lanes (which must be `Some`): a product split into tasks
/// interleaves its activations once.
pub fn gemv_interleaved(w: WSlice, row0: usize, rows: usize, xil: &[f32], m: usize, k: usize, out: &mut [f32]) {
    assert!((1..=gemv_max_m()).contains(&m));
    let lanes = interleave_lanes(m).expect("gemv_interleaved serves the m for which interleave_lanes is Some");
    assert!(!matches!(w, WSlice::Quant(..)), "quantized weights take ops::quant's kernels");
    assert!(xil.len() >= k.div_ceil(lanes) * m * lanes && out.len() >= rows * m);
    assert!(w.len() >= (row0 + rows) * k);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: interleave_lanes is Some only where the kernel's CPU features were
    // detected, and the asserts above guarantee every row read (`w[(row0 + r) * k
    // ..][..k]`, `lanes * m` values of `xil` per `lanes` columns) is in bounds.
    unsafe {
        match (lanes, w) {
            (16, WSlice::F32(s)) => x512::gemv_f32_il(s, row0, rows, xil, m, k, out),
            (16, WSlice::F16(s)) => x512::gemv_f16_il(s, row0, rows, xil, m, k, out),
            (16, WSlice::Bf16(s)) => x512::gemv_bf16_il(s, row0, rows, xil, m, k, out),
            (_, WSlice::F32(s)) => x86::gemv_f32_il(s, row0, rows, xil, m, k, out),
            (_, WSlice::F16(s)) => x86::gemv_f16_il(s, row0, rows, xil, m, k, out),
            (_, WSlice::Bf16(s)) => x86::gemv_bf16_il(s, row0, rows, xil, m, k, out),
            (_, WSlice::Quant(..)) => {}
        }
    }
}

/// How far ahead of the current weight position, in each row's own stream, the SIMD
/// GEMVs prefetch lines into L2: far enough to keep the L2 miss queue full, which the
/// hardware prefetcher alone does not on these kernels (measured: AVX-512 f16 DRAM GEMV
/// 17.7 -> 23.1 GB/s on 2 cores).
const PREFETCH_AHEAD_BYTES: usize = 8192;

/// Where a GEMV reading `R` weight rows of `row_bytes` side by side, `step_bytes` of
/// each per step over `steps` steps, prefetches: a row's step `c` asks for the line at
/// `row + c * step_bytes + before` while `c < wrap`, and `+ after` from there on, where
/// `PREFETCH_AHEAD_BYTES` on lands past the row's end, in the next group's rows (R rows
/// on), where this row's place is read next.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct RowPrefetch {
    wrap: usize,
    before: isize,
    after: isize,
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
impl RowPrefetch {
    fn new<const R: usize>(row_bytes: usize, step_bytes: usize, steps: usize) -> RowPrefetch {
        let whole_groups = (PREFETCH_AHEAD_BYTES / row_bytes * R * row_bytes) as isize;
        let within = PREFETCH_AHEAD_BYTES % row_bytes;
        let before = whole_groups + within as isize;
        RowPrefetch {
            wrap: (row_bytes - within).div_ceil(step_bytes).min(steps),
            before,
            after: before + ((R - 1) * row_bytes) as isize,
        }
    }
}

/// The portable GEMV (also the reference for the SIMD one).
pub fn gemv_scalar(w: WSlice, row0: usize, rows: usize, x: &[f32], m: usize, k: usize, out: &mut [f32]) {
    let mut row = vec![0.0f32; k];
    for r in 0..rows {
        w.to_f32((row0 + r) * k, &mut row);
        for i in 0..m {
            out[r * m + i] = dot(&row, &x[i * k..(i + 1) * k]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
        let n = src.len();
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n = src.len() = dst.len().
            unsafe {
                let v = _mm256_cvtph_ps(_mm_loadu_si128(src.as_ptr().add(i) as *const __m128i));
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), v);
            }
            i += 8;
        }
        for j in i..n {
            dst[j] = src[j].to_f32();
        }
    }

    /// The sum of the eight lanes of `v`.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// e^x for 8 lanes (x clamped to f32's range): range reduction to 2^n · e^f,
    /// |f| <= ln2/2, and a degree-5 polynomial (Cephes' expf: relative error about 1e-7).
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn exp8(x: __m256) -> __m256 {
        let x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.376_26)), _mm256_set1_ps(-87.336_55));
        let fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E), _mm256_set1_ps(0.5)));
        let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693_359_4), x);
        let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.121_944_4e-4), x);
        let mut y = _mm256_set1_ps(1.987_569_1e-4);
        for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
            y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c));
        }
        let y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0));
        let pow2n = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)));
        _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n))
    }

    /// `out = silu(g) * u = g / (1 + e^-g) * u`, elementwise.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn silu_and_mul(out: &mut [f32], g: &[f32], u: &[f32]) {
        let n = out.len().min(g.len()).min(u.len());
        let one = _mm256_set1_ps(1.0);
        let mut i = 0;
        // SAFETY: i + 8 <= n, within all three slices.
        unsafe {
            while i + 8 <= n {
                let gv = _mm256_loadu_ps(g.as_ptr().add(i));
                let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
                let s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
                _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(s, _mm256_loadu_ps(u.as_ptr().add(i))));
                i += 8;
            }
        }
        for j in i..n {
            out[j] = g[j] / (1.0 + (-g[j]).exp()) * u[j];
        }
    }

    /// 8 f16 weights from `p` as f32.
    ///
    /// # Safety
    /// F16C must be present; `p` addresses 8 readable elements.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    pub(crate) unsafe fn load8_f16(p: *const f16) -> __m256 {
        // SAFETY: forwarded contract.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }

    /// 8 bf16 weights from `p` as f32 (each the high half of its f32).
    ///
    /// # Safety
    /// AVX2 must be present; `p` addresses 8 readable elements.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(crate) unsafe fn load8_bf16(p: *const bf16) -> __m256 {
        // SAFETY: forwarded contract.
        unsafe {
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i)), 16))
        }
    }

    /// One output of the GEMVs and the dot tiles: the 8 lanes of its accumulator
    /// summed, then the products of the `k % 8` tail columns in column order. Every
    /// AVX2 kernel of weight rows against activation rows finishes here, so each sums
    /// an output in the same order whatever the rows.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn lane_sum(acc: __m256, tail: impl Iterator<Item = f32>) -> f32 {
        // SAFETY: the features were enabled by the caller's target_feature.
        tail.fold(unsafe { hsum(acc) }, |s, p| s + p)
    }

    /// Generates a GEMV kernel for one weight type: `$load` turns a pointer to 8
    /// weights into a __m256, `$scalar` converts one weight.
    macro_rules! gemv_kernel {
        ($name:ident, $il:ident, $inner:ident, $blocked:ident, $t:ty, $load:expr, $scalar:expr) => {
            /// R weight rows at a time against M activation rows, 8 columns per step:
            /// each activation vector is loaded once for all R rows (one row at a time
            /// read the activations once per weight row, from L2 once they outgrow L1),
            /// R*M accumulators, and each row's lines prefetched into L2 a few KiB
            /// ahead in the order they are read.
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn $inner<const M: usize, const R: usize>(
                w: &[$t],
                row0: usize,
                rows: usize,
                x: &[f32],
                k: usize,
                out: &mut [f32],
            ) {
                let load = $load;
                let scalar = $scalar;
                let xp = x.as_ptr();
                let size = std::mem::size_of::<$t>();
                let full = k / 8;
                let pf = super::RowPrefetch::new::<R>(k * size, 8 * size, full);
                // Steps per cache line of a row: one prefetch per line.
                let per_line = (64 / (8 * size)).max(1);
                let mut r = 0;
                while r < rows {
                    let live = R.min(rows - r);
                    // SAFETY: (whole block) the caller checked that w holds
                    // (row0 + rows) * k elements and x holds M * k; rows past `live`
                    // repeat the last live row (read, never stored); every offset read
                    // is < k within its row. Prefetch addresses use wrapping arithmetic
                    // and are never dereferenced.
                    unsafe {
                        let wr: [*const $t; R] =
                            std::array::from_fn(|j| w.as_ptr().add((row0 + r + j.min(live - 1)) * k));
                        // One flat array (accumulator `j * M + mi`), kept in registers.
                        let mut acc = [_mm256_setzero_ps(); 16];
                        let mut step = |c: usize, ahead: isize| {
                            let i = 8 * c;
                            if c % per_line == 0 {
                                for p in wr {
                                    _mm_prefetch::<_MM_HINT_T1>(
                                        (p as *const i8).wrapping_offset(ahead).wrapping_add(i * size),
                                    );
                                }
                            }
                            let wv: [__m256; R] = std::array::from_fn(|j| load(wr[j].add(i)));
                            for mi in 0..M {
                                let xv = _mm256_loadu_ps(xp.add(mi * k + i));
                                for j in 0..R {
                                    acc[j * M + mi] = _mm256_fmadd_ps(wv[j], xv, acc[j * M + mi]);
                                }
                            }
                        };
                        for c in 0..pf.wrap {
                            step(c, pf.before);
                        }
                        for c in pf.wrap..full {
                            step(c, pf.after);
                        }
                        for j in 0..live {
                            for mi in 0..M {
                                out[(r + j) * M + mi] = lane_sum(
                                    acc[j * M + mi],
                                    (8 * full..k).map(|t| scalar(*wr[j].add(t)) * *xp.add(mi * k + t)),
                                );
                            }
                        }
                    }
                    r += R;
                }
            }

            /// M (5 to 8) activation rows, interleaved ([`super::interleave`], 8
            /// lanes), one weight row at a time over blocks of columns. Eight rows of
            /// decode activations outgrow L1 (8 x 4,096 f32 is 128 KiB), and streaming
            /// them from L2 for every weight row is slower than the weights from DRAM:
            /// the eight rows cost as much as two passes of four. So a band of weight
            /// rows is read one block of columns at a time while that block of the M
            /// activation rows (half of L1, one contiguous run) stays in L1, and the
            /// band's accumulators wait in a small buffer between blocks. Each lane
            /// still sums its columns in order: the results are bit-identical to the
            /// kernel above and to one row at a time.
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn $blocked<const M: usize>(
                w: &[$t],
                row0: usize,
                rows: usize,
                xil: &[f32],
                k: usize,
                out: &mut [f32],
            ) {
                // Weight rows whose accumulators wait between blocks (8 KiB at M = 8).
                const BAND: usize = 32;
                let load = $load;
                let scalar = $scalar;
                let xp = xil.as_ptr();
                let size = std::mem::size_of::<$t>();
                let full = k / 8;
                let block = (super::l1d_bytes() / 2 / (M * 32)).clamp(1, full.max(1));
                let blocks = full.div_ceil(block);
                // Segments (one row's block) between reading one and prefetching it.
                let ahead = super::PREFETCH_AHEAD_BYTES.div_ceil(block * 8 * size);
                let per_line = (64 / (8 * size)).max(1);
                let mut waiting = [[_mm256_setzero_ps(); M]; BAND];
                let mut band0 = 0;
                while band0 < rows {
                    let band = BAND.min(rows - band0);
                    waiting[..band].fill([_mm256_setzero_ps(); M]);
                    for b in 0..blocks {
                        let (c0, c1) = (b * block, ((b + 1) * block).min(full));
                        for (g, acc) in waiting[..band].iter_mut().enumerate() {
                            // The segment read `ahead` segments later: further on in
                            // this band, or in the next band's first blocks.
                            let s = b * band + g + ahead;
                            let (pb, pg) = match s.checked_sub(blocks * band) {
                                None => (s / band, s % band),
                                Some(next) => (next / BAND, band + next % BAND),
                            };
                            // Never dereferenced: wrapping arithmetic.
                            let pf = w.as_ptr().wrapping_add((row0 + band0 + pg) * k + pb * block * 8) as *const i8;
                            // SAFETY: the caller checked that w holds (row0 + rows) * k
                            // elements and xil k.div_ceil(8) * M * 8; every column read
                            // is < 8 * full <= k within its row.
                            unsafe {
                                let wr = w.as_ptr().add((row0 + band0 + g) * k);
                                let mut a = *acc;
                                for c in c0..c1 {
                                    if (c - c0) % per_line == 0 {
                                        _mm_prefetch::<_MM_HINT_T1>(pf.wrapping_add((c - c0) * 8 * size));
                                    }
                                    let wv = load(wr.add(8 * c));
                                    for mi in 0..M {
                                        a[mi] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xp.add((c * M + mi) * 8)), a[mi]);
                                    }
                                }
                                *acc = a;
                            }
                        }
                    }
                    for (g, acc) in waiting[..band].iter().enumerate() {
                        // SAFETY: as above; the tail columns 8 * full..k are in bounds.
                        unsafe {
                            let wr = w.as_ptr().add((row0 + band0 + g) * k);
                            for mi in 0..M {
                                out[(band0 + g) * M + mi] = lane_sum(
                                    acc[mi],
                                    (8 * full..k).map(|t| scalar(*wr.add(t)) * *xp.add((full * M + mi) * 8 + t % 8)),
                                );
                            }
                        }
                    }
                    band0 += band;
                }
            }

            #[target_feature(enable = "avx2,fma,f16c")]
            pub unsafe fn $name(w: &[$t], row0: usize, rows: usize, x: &[f32], m: usize, k: usize, out: &mut [f32]) {
                // SAFETY: forwarded caller contract. R keeps the R*M accumulators, R
                // weight vectors and an activation vector within 16 registers.
                unsafe {
                    match m {
                        1 => $inner::<1, 4>(w, row0, rows, x, k, out),
                        2 => $inner::<2, 4>(w, row0, rows, x, k, out),
                        3 => $inner::<3, 3>(w, row0, rows, x, k, out),
                        4 => $inner::<4, 2>(w, row0, rows, x, k, out),
                        _ => $il(w, row0, rows, &super::interleave(x, m, k, 8), m, k, out),
                    }
                }
            }

            /// As the GEMV above for 5 to 8 activation rows given interleaved
            /// ([`super::interleave`], 8 lanes), as callers that split one product into
            /// tasks interleave them once.
            #[target_feature(enable = "avx2,fma,f16c")]
            pub unsafe fn $il(w: &[$t], row0: usize, rows: usize, xil: &[f32], m: usize, k: usize, out: &mut [f32]) {
                // SAFETY: forwarded caller contract.
                unsafe {
                    match m {
                        5 => $blocked::<5>(w, row0, rows, xil, k, out),
                        6 => $blocked::<6>(w, row0, rows, xil, k, out),
                        7 => $blocked::<7>(w, row0, rows, xil, k, out),
                        _ => $blocked::<8>(w, row0, rows, xil, k, out),
                    }
                }
            }
        };
    }

    gemv_kernel!(
        gemv_f32,
        gemv_f32_il,
        gemv_f32_m,
        gemv_f32_blocked,
        f32,
        // SAFETY: callers pass pointers with 8 readable elements.
        |p: *const f32| unsafe { _mm256_loadu_ps(p) },
        |v: f32| v
    );
    gemv_kernel!(
        gemv_f16,
        gemv_f16_il,
        gemv_f16_m,
        gemv_f16_blocked,
        f16,
        // SAFETY: callers pass pointers with 8 readable elements.
        |p: *const f16| unsafe { load8_f16(p) },
        |v: f16| v.to_f32()
    );
    gemv_kernel!(
        gemv_bf16,
        gemv_bf16_il,
        gemv_bf16_m,
        gemv_bf16_blocked,
        bf16,
        // SAFETY: callers pass pointers with 8 readable elements.
        |p: *const bf16| unsafe { load8_bf16(p) },
        |v: bf16| v.to_f32()
    );
}

/// AVX-512 GEMV: 16-lane vectors, independent accumulator chains per activation row,
/// and, where several weight rows are read side by side, a software prefetch a few KiB
/// ahead in the order the weights are read, so that one core keeps enough loads in
/// flight to stream weights from DRAM at full speed. One row at a time is one
/// sequential stream, which the hardware prefetcher follows better alone.
#[cfg(target_arch = "x86_64")]
mod x512 {
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    use super::PREFETCH_AHEAD_BYTES;

    /// Columns from which one activation row is read for several weight rows at a time:
    /// beyond two thirds of the L1 data cache in f32 activations, the row no longer stays
    /// in L1 beside the streaming weights, and reading it again from L2 for every weight
    /// row cost a quarter of the bandwidth (32 KiB L1, 2048 x 8192 f16: 16 vs 22 GB/s on
    /// 1 core). Below that one row at a time is the faster (48 KiB L1, 8192 x 4096 f16
    /// on 2 cores: 145 vs 100 GB/s from cache; DRAM, 2048 x 8192: 41 vs 39 GB/s).
    fn shared_x_cols() -> usize {
        static COLS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
        *COLS.get_or_init(|| crate::simd::l1d_bytes() * 2 / 3 / 4)
    }

    /// `simd::f16_to_f32` 16 values at a time (the prompt GEMM converts every weight
    /// block with it: 4.5% of a 330-token prefill at 8 per instruction).
    #[target_feature(enable = "avx512f")]
    pub unsafe fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
        let n = src.len();
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n = src.len() = dst.len().
            unsafe {
                let v = _mm512_cvtph_ps(_mm256_loadu_si256(src.as_ptr().add(i) as *const __m256i));
                _mm512_storeu_ps(dst.as_mut_ptr().add(i), v);
            }
            i += 16;
        }
        for j in i..n {
            dst[j] = src[j].to_f32();
        }
    }

    macro_rules! gemv512 {
        ($name:ident, $il:ident, $inner:ident, $multi:ident, $t:ty, $load:expr, $scalar:expr) => {
            /// R weight rows at a time against M activation rows, U vectors of 16 per
            /// step: the M activation vectors are loaded once per step and serve all R
            /// rows, and R*U*M accumulators keep the FMA units busy. PF: prefetch each
            /// row's lines `PREFETCH_AHEAD_BYTES` ahead.
            #[target_feature(enable = "avx512f,avx512bw")]
            unsafe fn $inner<const M: usize, const R: usize, const U: usize, const PF: bool>(
                w: &[$t],
                row0: usize,
                rows: usize,
                x: &[f32],
                k: usize,
                out: &mut [f32],
            ) {
                let load = $load;
                let scalar = $scalar;
                let xp = x.as_ptr();
                let size = std::mem::size_of::<$t>();
                let step = 16 * U;
                // Prefetches follow the order of reading: R rows side by side, then
                // the next R rows.
                let row_bytes = k * size;
                let pf_rows = (PREFETCH_AHEAD_BYTES / row_bytes * R * row_bytes) as isize;
                let pf_within = PREFETCH_AHEAD_BYTES % row_bytes;
                let mut r = 0;
                while r + R <= rows {
                    // SAFETY: (whole block) the caller checked that w holds
                    // (row0 + rows) * k elements and x holds M * k; every offset read is
                    // < k within its row. Prefetch addresses are computed with
                    // wrapping arithmetic and never dereferenced.
                    unsafe {
                        let wr: [*const $t; R] = std::array::from_fn(|j| w.as_ptr().add((row0 + r + j) * k));
                        let mut acc = [[[_mm512_setzero_ps(); M]; U]; R];
                        let mut i = 0;
                        while i + step <= k {
                            // Off (PF false) where one row is one stream.
                            if PF {
                                for p in wr {
                                    // Past the row's end the address lands R rows on,
                                    // where this row's place will be read next.
                                    let mut at = i * size + pf_within;
                                    let mut skip = pf_rows;
                                    if at >= row_bytes {
                                        at -= row_bytes;
                                        skip += (R * row_bytes) as isize;
                                    }
                                    let pf = (p as *const i8).wrapping_offset(skip).wrapping_add(at);
                                    let mut off = 0;
                                    while off < step * size {
                                        _mm_prefetch::<_MM_HINT_T1>(pf.wrapping_add(off));
                                        off += 64;
                                    }
                                }
                            }
                            for u in 0..U {
                                let xs: [__m512; M] =
                                    std::array::from_fn(|mi| _mm512_loadu_ps(xp.add(mi * k + i + 16 * u)));
                                for j in 0..R {
                                    let wv = load(wr[j].add(i + 16 * u));
                                    for mi in 0..M {
                                        acc[j][u][mi] = _mm512_fmadd_ps(wv, xs[mi], acc[j][u][mi]);
                                    }
                                }
                            }
                            i += step;
                        }
                        while i + 16 <= k {
                            for j in 0..R {
                                let wv = load(wr[j].add(i));
                                for mi in 0..M {
                                    let xv = _mm512_loadu_ps(xp.add(mi * k + i));
                                    acc[j][0][mi] = _mm512_fmadd_ps(wv, xv, acc[j][0][mi]);
                                }
                            }
                            i += 16;
                        }
                        for j in 0..R {
                            for mi in 0..M {
                                let mut v = acc[j][0][mi];
                                for a in &acc[j][1..] {
                                    v = _mm512_add_ps(v, a[mi]);
                                }
                                let mut s = _mm512_reduce_add_ps(v);
                                for t in i..k {
                                    s += scalar(*wr[j].add(t)) * *xp.add(mi * k + t);
                                }
                                out[(r + j) * M + mi] = s;
                            }
                        }
                    }
                    r += R;
                }
                if r < rows {
                    // SAFETY: the remaining rows, same contract.
                    unsafe { $inner::<M, 1, U, PF>(w, row0 + r, rows - r, x, k, &mut out[r * M..]) };
                }
            }

            /// M >= 2 activation rows, interleaved ([`interleave`], 16 lanes) so that one pointer
            /// walks them all: R weight vectors are loaded once per 16 columns, then each
            /// activation vector in turn serves all R of them. R*M accumulators, R weight
            /// vectors and one activation vector stay in registers (rows of `x` side by
            /// side spilled accumulators to the stack: 22 GB/s at M = 8).
            #[target_feature(enable = "avx512f,avx512bw")]
            unsafe fn $multi<const M: usize, const R: usize>(
                w: &[$t],
                row0: usize,
                rows: usize,
                xil: &[f32],
                k: usize,
                out: &mut [f32],
            ) {
                let load = $load;
                let scalar = $scalar;
                let xp = xil.as_ptr();
                let size = std::mem::size_of::<$t>();
                let full = k / 16;
                // Prefetches follow the order of reading, as in the one-row kernel.
                let pf = super::RowPrefetch::new::<R>(k * size, 16 * size, full);
                let mut r = 0;
                while r < rows {
                    let live = R.min(rows - r);
                    // SAFETY: (whole block) the caller checked that w holds
                    // (row0 + rows) * k elements; rows past `live` repeat the last live
                    // row (read, never stored); xil holds k.div_ceil(16) * M * 16 values.
                    // Prefetch addresses use wrapping arithmetic and are never dereferenced.
                    unsafe {
                        let wr: [*const $t; R] =
                            std::array::from_fn(|j| w.as_ptr().add((row0 + r + j.min(live - 1)) * k));
                        // One flat array (accumulator `j * M + mi`): nested arrays of
                        // 5 to 7 rows were kept on the stack.
                        let mut acc = [_mm512_setzero_ps(); 32];
                        let mut chunk = |c: usize, ahead: isize| {
                            let i = 16 * c;
                            for p in wr {
                                _mm_prefetch::<_MM_HINT_T1>(
                                    (p as *const i8).wrapping_offset(ahead).wrapping_add(i * size),
                                );
                            }
                            let wv: [__m512; R] = std::array::from_fn(|j| load(wr[j].add(i)));
                            let xc = xp.add(c * M * 16);
                            for mi in 0..M {
                                let xv = _mm512_loadu_ps(xc.add(mi * 16));
                                for j in 0..R {
                                    acc[j * M + mi] = _mm512_fmadd_ps(wv[j], xv, acc[j * M + mi]);
                                }
                            }
                        };
                        for c in 0..pf.wrap {
                            chunk(c, pf.before);
                        }
                        for c in pf.wrap..full {
                            chunk(c, pf.after);
                        }
                        for j in 0..live {
                            for mi in 0..M {
                                let mut s = _mm512_reduce_add_ps(acc[j * M + mi]);
                                for t in 16 * full..k {
                                    s += scalar(*wr[j].add(t)) * *xp.add((full * M + mi) * 16 + t % 16);
                                }
                                out[(r + j) * M + mi] = s;
                            }
                        }
                    }
                    r += R;
                }
            }

            #[target_feature(enable = "avx512f,avx512bw")]
            pub unsafe fn $name(w: &[$t], row0: usize, rows: usize, x: &[f32], m: usize, k: usize, out: &mut [f32]) {
                // SAFETY: forwarded caller contract. Row blocking keeps accumulators
                // plus activation vectors within the 32 vector registers.
                unsafe {
                    if m == 1 {
                        // One weight row at a time is a single sequential stream: there
                        // eight accumulators and no software prefetch read fastest. Zen 4,
                        // 2 threads, f16, 1.8 GB of weights from DRAM (the machine's
                        // memory has a faster and a slower state; a plain read loop
                        // reaches 57-61 and 35 GB/s): a dot product of one stream with 8
                        // accumulators and no prefetch 52-56 and 35.5 GB/s, with 4 and a
                        // prefetch 8 KiB ahead (the kernel before) 40-42 and 32. The bench
                        // model's batch-1 decode step, in turns: 46.9 -> 37.2 and
                        // 59.4 -> 50-54 ms. Four rows side by side (activations past L1)
                        // are four streams, and there the prefetch pays: without it they
                        // read at 0.8-0.9x the rate, and the kernel of several activation
                        // rows (R rows side by side too) took a batch-8 step 1.4x as long.
                        if k <= shared_x_cols() {
                            $inner::<1, 1, 8, false>(w, row0, rows, x, k, out)
                        } else {
                            $inner::<1, 4, 1, true>(w, row0, rows, x, k, out)
                        }
                        return;
                    }
                    $il(w, row0, rows, &super::interleave(x, m, k, 16), m, k, out)
                }
            }

            /// As the GEMV above for 2 to 8 activation rows given interleaved
            /// ([`super::interleave`], 16 lanes), as callers that split one product into tasks
            /// interleave them once.
            #[target_feature(enable = "avx512f,avx512bw")]
            pub unsafe fn $il(w: &[$t], row0: usize, rows: usize, xil: &[f32], m: usize, k: usize, out: &mut [f32]) {
                // SAFETY: forwarded caller contract.
                unsafe {
                    match m {
                        2 => $multi::<2, 4>(w, row0, rows, xil, k, out),
                        3 => $multi::<3, 4>(w, row0, rows, xil, k, out),
                        4 => $multi::<4, 4>(w, row0, rows, xil, k, out),
                        5 => $multi::<5, 4>(w, row0, rows, xil, k, out),
                        6 => $multi::<6, 4>(w, row0, rows, xil, k, out),
                        7 => $multi::<7, 3>(w, row0, rows, xil, k, out),
                        _ => $multi::<8, 3>(w, row0, rows, xil, k, out),
                    }
                }
            }
        };
    }

    gemv512!(
        gemv_f32,
        gemv_f32_il,
        gemv_f32_m,
        gemv_f32_multi,
        f32,
        // SAFETY: callers pass pointers with 16 readable elements.
        |p: *const f32| unsafe { _mm512_loadu_ps(p) },
        |v: f32| v
    );
    gemv512!(
        gemv_f16,
        gemv_f16_il,
        gemv_f16_m,
        gemv_f16_multi,
        f16,
        // SAFETY: callers pass pointers with 16 readable elements.
        |p: *const f16| unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) },
        |v: f16| v.to_f32()
    );
    gemv512!(
        gemv_bf16,
        gemv_bf16_il,
        gemv_bf16_m,
        gemv_bf16_multi,
        bf16,
        // SAFETY: callers pass pointers with 16 readable elements.
        |p: *const bf16| unsafe {
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i)), 16))
        },
        |v: bf16| v.to_f32()
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::{Rng, assert_close};

    #[test]
    fn the_isa_cap_names_a_level_or_says_which_it_takes() {
        use std::ffi::OsStr;
        assert_eq!(parse_isa_cap(None), Ok(None));
        assert_eq!(parse_isa_cap(Some(OsStr::new(" "))), Ok(None));
        assert_eq!(parse_isa_cap(Some(OsStr::new("avx2"))), Ok(Some(IsaLevel::Avx2)));
        assert_eq!(parse_isa_cap(Some(OsStr::new("AVX512"))), Ok(Some(IsaLevel::Avx512)));
        assert_eq!(parse_isa_cap(Some(OsStr::new("portable\n"))), Ok(Some(IsaLevel::Portable)));
        let err = parse_isa_cap(Some(OsStr::new("sse4"))).unwrap_err();
        assert!(err.contains("TESSERA_CPU_ISA=\"sse4\"") && err.contains("avx512, avx2, portable"), "{err}");
        assert!(IsaLevel::Portable < IsaLevel::Avx2 && IsaLevel::Avx2 < IsaLevel::Avx512);
    }

    #[test]
    fn l1_data_cache_size_is_read_or_defaulted() {
        let b = l1d_bytes();
        assert!((8 << 10..=4 << 20).contains(&b) && b.is_multiple_of(1 << 10), "{b}");
        let read = |f: &str| std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu0/cache/index0/{f}"));
        if let (Ok(level), Ok(kind), Ok(size)) = (read("level"), read("type"), read("size"))
            && level.trim() == "1"
            && kind.trim() == "Data"
            && size.trim().ends_with('K')
        {
            assert_eq!(format!("{}K", b >> 10), size.trim());
        }
    }

    /// Each activation row's outputs do not depend on the other rows that share the
    /// call: the kernels of 2 to 8 rows (on AVX2, 5 to 8 read the weights in blocks of
    /// columns, across several bands of weight rows here) sum every output in one order,
    /// so a decode step's logits do not depend on its batch. On AVX2 one row alone sums
    /// in that order too (on AVX-512 it takes eight accumulators per row, or four rows
    /// side by side).
    #[test]
    fn gemv_rows_are_bit_identical_to_one_row_at_a_time() {
        let mut rng = Rng(11);
        for &k in &[45usize, 4109] {
            let n = 70;
            let w32 = rng.vec(n * k);
            let w16: Vec<f16> = w32.iter().map(|&v| f16::from_f32(v)).collect();
            let wb: Vec<bf16> = w32.iter().map(|&v| bf16::from_f32(v)).collect();
            let x = rng.vec(8 * k);
            for w in [WSlice::F32(&w32), WSlice::F16(&w16), WSlice::Bf16(&wb)] {
                // Each row beside a copy of itself.
                let mut alone = vec![0.0f32; 8 * n];
                for i in 0..8 {
                    let pair = [&x[i * k..(i + 1) * k], &x[i * k..(i + 1) * k]].concat();
                    let mut o = vec![0.0f32; 2 * n];
                    gemv(w, 0, n, &pair, 2, k, &mut o);
                    for r in 0..n {
                        alone[i * n + r] = o[2 * r];
                    }
                }
                let fewest = if has_avx512() { 2 } else { 1 };
                for m in fewest..=gemv_max_m() {
                    let mut got = vec![f32::NAN; n * m];
                    gemv(w, 0, n, &x, m, k, &mut got);
                    let mut il = vec![f32::NAN; n * m];
                    if let Some(lanes) = interleave_lanes(m) {
                        gemv_interleaved(w, 0, n, &interleave(&x, m, k, lanes), m, k, &mut il);
                        assert_eq!(
                            il.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                            "interleaved m={m} k={k}"
                        );
                    }
                    for r in 0..n {
                        for i in 0..m {
                            assert_eq!(
                                got[r * m + i].to_bits(),
                                alone[i * n + r].to_bits(),
                                "m={m} k={k} row {r} act {i}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Every SIMD GEMV this CPU can run, called directly (the dispatcher alone would
    /// only ever exercise the widest one), against the portable kernel.
    #[test]
    fn each_simd_gemv_matches_scalar() {
        let mut rng = Rng(5);
        // k: below one vector, vector tails, a multiple of the 64-wide unroll, and a row
        // long enough for the batch-1 AVX-512 kernel to take four weight rows at a time
        // (13 rows: a short last group).
        for &k in &[7usize, 16, 45, 64, 130, 4109] {
            let rows = 14;
            let w32 = rng.vec(rows * k);
            let w16: Vec<f16> = w32.iter().map(|&v| f16::from_f32(v)).collect();
            let wb: Vec<bf16> = w32.iter().map(|&v| bf16::from_f32(v)).collect();
            let x = rng.vec(8 * k);
            for w in [WSlice::F32(&w32), WSlice::F16(&w16), WSlice::Bf16(&wb)] {
                for m in 1..=8 {
                    let n = rows - 1;
                    let mut want = vec![0.0; n * m];
                    gemv_scalar(w, 1, n, &x, m, k, &mut want);
                    let tol = 1e-5 * (k as f32).sqrt();
                    #[cfg(target_arch = "x86_64")]
                    {
                        if has_avx2() {
                            let mut got = vec![f32::NAN; n * m];
                            // SAFETY: features detected; lengths as gemv asserts.
                            unsafe {
                                match w {
                                    WSlice::F32(s) => x86::gemv_f32(s, 1, n, &x, m, k, &mut got),
                                    WSlice::F16(s) => x86::gemv_f16(s, 1, n, &x, m, k, &mut got),
                                    WSlice::Bf16(s) => x86::gemv_bf16(s, 1, n, &x, m, k, &mut got),
                                    WSlice::Quant(..) => unreachable!("float weights only"),
                                }
                            }
                            assert_close(&got, &want, tol, &format!("avx2 m={m} k={k}"));
                        }
                        if has_avx512() {
                            let mut got = vec![f32::NAN; n * m];
                            // SAFETY: as above.
                            unsafe {
                                match w {
                                    WSlice::F32(s) => x512::gemv_f32(s, 1, n, &x, m, k, &mut got),
                                    WSlice::F16(s) => x512::gemv_f16(s, 1, n, &x, m, k, &mut got),
                                    WSlice::Bf16(s) => x512::gemv_bf16(s, 1, n, &x, m, k, &mut got),
                                    WSlice::Quant(..) => unreachable!("float weights only"),
                                }
                            }
                            assert_close(&got, &want, tol, &format!("avx512 m={m} k={k}"));
                        }
                    }
                }
            }
        }
    }
}
