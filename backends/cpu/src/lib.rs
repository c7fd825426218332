//! The reference CPU kernel library of Tessera: a `cdylib` that exports the Tessera
//! kernel ABI (`backends/include/tessera_kernels.h`) and implements every op on the host
//! CPU with rayon thread pools, hand-written AVX2/FMA/F16C GEMV kernels and the `gemm`
//! crate. Tessera loads it with `dlopen` and calls it only through that ABI.
//!
//! It depends only on `tessera-kernel-abi` (the ABI types) and numeric crates (`gemm`,
//! `half`, `rayon`); it must never depend on `tessera-backends` or anything else of the
//! runtime. The safe Rust implementations of the ops live in [`ops`] and are tested
//! against naive references; [`ffi`] is the only place that touches raw ABI pointers.

// `unsafe` is denied by the workspace's lints but for the modules whose SAFETY contracts
// need it: host allocations (`device`), the C ABI exports (`ffi`), raw `gemm` calls and
// disjoint writes from rayon tasks (`ops`), SIMD intrinsics (`simd`), and the
// collectives' disjoint writes into every rank's buffer (`comm`).
#[allow(unsafe_code)]
pub mod comm;
#[allow(unsafe_code)]
pub mod device;
pub mod dtype;
pub mod error;
#[allow(unsafe_code)]
pub mod ffi;
#[allow(unsafe_code)]
pub mod ops;
#[allow(unsafe_code)]
pub mod simd;

pub use error::KernelError;
