//! The reference CPU kernel library of Tessera: a `cdylib` that exports the Tessera
//! kernel ABI (`backends/include/tessera_kernels.h`) and implements every op on the host
//! CPU with rayon thread pools, hand-written AVX2/FMA/F16C GEMV kernels and the `gemm`
//! crate. Tessera loads it with `dlopen` and calls it only through that ABI.
//!
//! It depends only on `tessera-kernel-abi` (the ABI types) and numeric crates (`gemm`,
//! `half`, `rayon`); it must never depend on `tessera-backends` or anything else of the
//! runtime. The safe Rust implementations of the ops live in [`ops`] and are tested
//! against naive references; [`ffi`] is the only place that touches raw ABI pointers.

pub mod device;
pub mod dtype;
pub mod error;
pub mod ffi;
pub mod ops;
pub mod simd;

pub use error::KernelError;
