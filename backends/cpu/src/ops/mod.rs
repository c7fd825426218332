//! Safe implementations of every op on validated slices. They run on the current rayon
//! pool (the FFI layer calls them inside the device's `pool.install`).

pub mod attention;
pub mod dot_tiles;
pub mod linear;
pub mod misc;
pub mod norm;
pub mod panel_tiles;
pub mod prefill_gemm;
pub mod quant;
pub mod rope;
pub mod small_batch;

/// Asks for the lines of `bytes` to be brought into L2 (a hint: nothing is read).
pub(crate) fn prefetch(bytes: std::ops::Range<*const u8>) {
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

/// A raw pointer that may cross into rayon tasks; used only where tasks write
/// provably disjoint parts of one output (and `gemm` needs raw pointers anyway).
#[derive(Clone, Copy)]
pub(crate) struct SendPtr(pub *mut f32);
// SAFETY: users only write disjoint regions through it from different threads.
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    #[inline]
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

/// A strided f32 matrix operand: element (i, j) lives at `ptr + i * rs + j * cs`.
#[derive(Clone, Copy)]
pub(crate) struct Strided<P> {
    pub ptr: P,
    pub rs: isize,
    pub cs: isize,
}

/// `dst = scale * lhs · rhs` for an m x k `lhs` and a k x n `rhs`, with the `gemm` crate.
///
/// # Safety
/// Each operand must address its whole matrix as its strides describe; `dst` must not
/// overlap the inputs, and nobody else may touch it during the call.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn matmul(
    m: usize,
    n: usize,
    k: usize,
    dst: Strided<*mut f32>,
    lhs: Strided<*const f32>,
    rhs: Strided<*const f32>,
    scale: f32,
    parallelism: gemm::Parallelism,
) {
    // SAFETY: forwarded caller contract.
    unsafe { matmul_into(m, n, k, dst, false, lhs, rhs, scale, parallelism) }
}

/// `dst = scale * lhs · rhs`, or with `add`, `dst += scale * lhs · rhs`.
///
/// # Safety
/// As [`matmul`]; with `add`, `dst` must also hold initialised values.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn matmul_into(
    m: usize,
    n: usize,
    k: usize,
    dst: Strided<*mut f32>,
    add: bool,
    lhs: Strided<*const f32>,
    rhs: Strided<*const f32>,
    scale: f32,
    parallelism: gemm::Parallelism,
) {
    // SAFETY: forwarded caller contract. alpha = 1 with read_dst adds to dst; with
    // read_dst = false, dst is overwritten.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.ptr,
            dst.cs,
            dst.rs,
            add,
            lhs.ptr,
            lhs.cs,
            lhs.rs,
            rhs.ptr,
            rhs.cs,
            rhs.rs,
            if add { 1.0 } else { 0.0 },
            scale,
            false,
            false,
            false,
            parallelism,
        )
    }
}

#[cfg(test)]
pub(crate) mod testutil {
    use crate::dtype::WSlice;

    /// A small deterministic PRNG for tests.
    pub struct Rng(pub u64);
    impl Rng {
        pub fn next_u64(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        /// Uniform in [-1, 1).
        pub fn f32(&mut self) -> f32 {
            ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
        pub fn vec(&mut self, n: usize) -> Vec<f32> {
            (0..n).map(|_| self.f32()).collect()
        }
        pub fn below(&mut self, n: usize) -> usize {
            (self.next_u64() % n as u64) as usize
        }
    }

    /// `x[m][k] · w[n][k]ᵀ`, each output summed in f64.
    pub fn naive_linear(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k).map(|kk| x[i * k + kk] as f64 * w[j * k + kk] as f64).sum();
                out[i * n + j] = s as f32;
            }
        }
        out
    }

    /// A tiled linear kernel's contract: `linear(out, x, w, m, n, k)` is close to the f64
    /// sum of the weights as stored, and its first, middle and last rows are
    /// bit-identical to the same row computed alone.
    pub fn assert_tiles_match_naive(
        linear: fn(&mut [f32], &[f32], WSlice, usize, usize, usize),
        x: &[f32],
        w: WSlice,
        (m, n, k): (usize, usize, usize),
        what: &str,
    ) {
        let mut out = vec![f32::NAN; m * n];
        linear(&mut out, x, w, m, n, k);
        let tol = 2e-6 * (k as f32).sqrt() + 1e-5;
        assert_close(&out, &naive_linear(x, &w.to_vec_f32(), m, n, k), tol, what);
        for i in [0, m / 2, m - 1] {
            let mut one = vec![f32::NAN; n];
            linear(&mut one, &x[i * k..(i + 1) * k], w, 1, n, k);
            assert_eq!(one, out[i * n..(i + 1) * n], "{what}: row {i} of {m}");
        }
    }

    pub fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let err = (g - w).abs();
            assert!(err <= tol * (1.0 + w.abs()), "{what}: index {i}: got {g}, want {w} (err {err}, tol {tol})");
        }
    }
}
