//! Element types of weights and KV caches as the kernel ABI names them.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use tessera_kernel_abi as abi;

/// A floating-point element type a weight or KV tensor may have (activations are f32).
/// Serialized by its short name ("f32", "f16", "bf16"), as `Display` writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    pub fn to_abi(self) -> abi::TkDtype {
        match self {
            DType::F32 => abi::TK_DTYPE_F32,
            DType::F16 => abi::TK_DTYPE_F16,
            DType::BF16 => abi::TK_DTYPE_BF16,
        }
    }

    /// The name in a safetensors header.
    pub fn safetensors_name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
        }
    }

    /// The name in `config.json`'s `torch_dtype`.
    pub fn torch_name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
        }
    }

    /// The dtype named in a safetensors header.
    pub fn from_safetensors(dtype: safetensors::Dtype) -> Option<Self> {
        match dtype {
            safetensors::Dtype::F32 => Some(DType::F32),
            safetensors::Dtype::F16 => Some(DType::F16),
            safetensors::Dtype::BF16 => Some(DType::BF16),
            _ => None,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        })
    }
}

impl FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(DType::F32),
            "f16" | "float16" | "half" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            other => Err(format!("unknown dtype {other:?} (expected f32, f16 or bf16)")),
        }
    }
}
