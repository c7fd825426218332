//! Element types: the ABI dtype codes and typed views of weight / KV-cache tensors.

use half::{bf16, f16};
use tessera_kernel_abi::{TK_DTYPE_BF16, TK_DTYPE_F16, TK_DTYPE_F32, TK_DTYPE_I32, TkDtype};

use crate::error::{KernelError, Result};

/// A floating-point storage type for weights and the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    Bf16,
}

impl DType {
    /// Parses an ABI dtype code; `what` names the argument for the error message.
    pub fn from_abi(code: TkDtype, what: &str) -> Result<DType> {
        match code {
            TK_DTYPE_F32 => Ok(DType::F32),
            TK_DTYPE_F16 => Ok(DType::F16),
            TK_DTYPE_BF16 => Ok(DType::Bf16),
            TK_DTYPE_I32 => Err(KernelError::Unsupported(format!(
                "{what} dtype i32 ({code}) is not supported here (expected f32, f16 or bf16)"
            ))),
            _ => Err(KernelError::InvalidArgument(format!(
                "{what} has unknown dtype {code} (expected 0 = f32, 1 = f16, 2 = bf16)"
            ))),
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
        }
    }
}

/// A read-only tensor of one of the float storage types.
#[derive(Debug, Clone, Copy)]
pub enum WSlice<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    Bf16(&'a [bf16]),
}

impl<'a> WSlice<'a> {
    pub fn len(&self) -> usize {
        match self {
            WSlice::F32(s) => s.len(),
            WSlice::F16(s) => s.len(),
            WSlice::Bf16(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn dtype(&self) -> DType {
        match self {
            WSlice::F32(_) => DType::F32,
            WSlice::F16(_) => DType::F16,
            WSlice::Bf16(_) => DType::Bf16,
        }
    }

    /// Converts elements `[start, start + dst.len())` to f32 into `dst`.
    pub fn to_f32(&self, start: usize, dst: &mut [f32]) {
        let end = start + dst.len();
        match self {
            WSlice::F32(s) => dst.copy_from_slice(&s[start..end]),
            WSlice::F16(s) => crate::simd::f16_to_f32(&s[start..end], dst),
            WSlice::Bf16(s) => crate::simd::bf16_to_f32(&s[start..end], dst),
        }
    }

    /// The whole tensor as a new f32 vector.
    pub fn to_vec_f32(&self) -> Vec<f32> {
        let mut v = vec![0.0; self.len()];
        self.to_f32(0, &mut v);
        v
    }
}

/// A writable tensor of one of the float storage types (the KV cache).
#[derive(Debug)]
pub enum WSliceMut<'a> {
    F32(&'a mut [f32]),
    F16(&'a mut [f16]),
    Bf16(&'a mut [bf16]),
}

impl<'a> WSliceMut<'a> {
    pub fn len(&self) -> usize {
        match self {
            WSliceMut::F32(s) => s.len(),
            WSliceMut::F16(s) => s.len(),
            WSliceMut::Bf16(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Stores `src` (f32) at `[start, start + src.len())`, rounding to the storage type.
    pub fn store_f32(&mut self, start: usize, src: &[f32]) {
        let end = start + src.len();
        match self {
            WSliceMut::F32(s) => s[start..end].copy_from_slice(src),
            WSliceMut::F16(s) => {
                for (d, &x) in s[start..end].iter_mut().zip(src) {
                    *d = f16::from_f32(x);
                }
            }
            WSliceMut::Bf16(s) => {
                for (d, &x) in s[start..end].iter_mut().zip(src) {
                    *d = bf16::from_f32(x);
                }
            }
        }
    }
}
