//! Element types: the ABI dtype codes and typed views of weight / KV-cache tensors.

use half::{bf16, f16};
use tessera_kernel_abi::*;
use tessera_quant::GgmlType;

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
            _ if WType::quant_from_abi(code).is_some() => {
                Err(KernelError::Unsupported(format!("{what} cannot be quantized ({code}); expected f32, f16 or bf16")))
            }
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

/// The storage type of a weight tensor: a float type, or (since ABI 1.2) one of ggml's
/// block formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WType {
    Float(DType),
    Quant(GgmlType),
}

impl WType {
    /// Parses an ABI dtype code for a weight that may be quantized (`tk_linear`'s `w`,
    /// `tk_embedding`'s table).
    pub fn from_abi(code: TkDtype, what: &str) -> Result<WType> {
        match WType::quant_from_abi(code) {
            Some(q) => Ok(WType::Quant(q)),
            None => DType::from_abi(code, what).map(WType::Float).map_err(|e| match e {
                KernelError::InvalidArgument(_) => KernelError::InvalidArgument(format!(
                    "{what} has unknown dtype {code} (expected 0 = f32, 1 = f16, 2 = bf16, or a quantized \
                     format 16..=22)"
                )),
                other => other,
            }),
        }
    }

    fn quant_from_abi(code: TkDtype) -> Option<GgmlType> {
        Some(match code {
            TK_DTYPE_Q4_0 => GgmlType::Q4_0,
            TK_DTYPE_Q4_1 => GgmlType::Q4_1,
            TK_DTYPE_Q5_0 => GgmlType::Q5_0,
            TK_DTYPE_Q5_1 => GgmlType::Q5_1,
            TK_DTYPE_Q8_0 => GgmlType::Q8_0,
            TK_DTYPE_Q4_K => GgmlType::Q4K,
            TK_DTYPE_Q5_K => GgmlType::Q5K,
            TK_DTYPE_Q6_K => GgmlType::Q6K,
            _ => return None,
        })
    }

    /// Bytes of a `[rows][cols]` tensor, refusing rows that are not whole blocks.
    pub fn tensor_bytes(self, what: &str, rows: usize, cols: usize) -> Result<usize> {
        let row = match self {
            WType::Float(d) => cols.checked_mul(d.size()),
            WType::Quant(q) => {
                let n = q.block_elements();
                if !(cols as u64).is_multiple_of(n) {
                    return Err(KernelError::InvalidArgument(format!(
                        "{what}: rows of {cols} values are not whole {q} blocks of {n}"
                    )));
                }
                q.row_bytes(cols)
            }
        };
        row.and_then(|r| r.checked_mul(rows))
            .ok_or_else(|| KernelError::InvalidArgument(format!("{what}: size {rows} x {cols} overflows")))
    }

    /// The alignment a tensor of this type needs (quantized blocks are read bytewise).
    pub fn align(self) -> usize {
        match self {
            WType::Float(d) => d.size(),
            WType::Quant(_) => 1,
        }
    }
}

/// A read-only tensor of one of the float storage types, or a quantized one (whole
/// blocks; element indices count values, and ranges must start and end on blocks).
#[derive(Debug, Clone, Copy)]
pub enum WSlice<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    Bf16(&'a [bf16]),
    Quant(GgmlType, &'a [u8]),
}

impl<'a> WSlice<'a> {
    pub fn len(&self) -> usize {
        match self {
            WSlice::F32(s) => s.len(),
            WSlice::F16(s) => s.len(),
            WSlice::Bf16(s) => s.len(),
            WSlice::Quant(q, b) => b.len() / q.block_bytes() as usize * q.block_elements() as usize,
        }
    }

    /// Where the stored bytes of elements `[start, end)` lie (for quantized formats, of
    /// the whole blocks they fall in); empty where the range lies outside.
    pub fn byte_range(&self, start: usize, end: usize) -> std::ops::Range<*const u8> {
        fn raw<T>(s: &[T], start: usize, end: usize) -> std::ops::Range<*const u8> {
            let r = s.get(start..end.min(s.len())).unwrap_or(&[]).as_ptr_range();
            r.start as *const u8..r.end as *const u8
        }
        match *self {
            WSlice::F32(s) => raw(s, start, end),
            WSlice::F16(s) => raw(s, start, end),
            WSlice::Bf16(s) => raw(s, start, end),
            WSlice::Quant(q, b) => {
                let (n, bb) = (q.block_elements() as usize, q.block_bytes() as usize);
                raw(b, start / n * bb, end.div_ceil(n) * bb)
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Converts elements `[start, start + dst.len())` to f32 into `dst`.
    pub fn to_f32(&self, start: usize, dst: &mut [f32]) {
        let end = start + dst.len();
        match self {
            WSlice::F32(s) => dst.copy_from_slice(&s[start..end]),
            WSlice::F16(s) => crate::simd::f16_to_f32(&s[start..end], dst),
            WSlice::Bf16(s) => crate::simd::bf16_to_f32(&s[start..end], dst),
            WSlice::Quant(q, b) => {
                let (n, bb) = (q.block_elements() as usize, q.block_bytes() as usize);
                assert!(start.is_multiple_of(n) && end.is_multiple_of(n), "{q} range {start}..{end} splits a block");
                crate::ops::quant::dequantize(*q, &b[start / n * bb..end / n * bb], dst);
            }
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
