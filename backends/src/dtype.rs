//! Element types of weights and KV caches: the shared [`DType`], and what only the
//! backends need of it — its ABI code and its names in checkpoint files ([`DTypeExt`]),
//! and the looser spellings a command line accepts ([`parse_dtype`]).

use tessera_kernel_abi as abi;
pub use tessera_quant::GgmlType;
pub use tessera_vocab::{DType, Quantize, UnknownName};

/// [`DType`] as the kernel ABI and checkpoint files name it.
pub trait DTypeExt: Sized {
    fn to_abi(self) -> abi::TkDtype;

    /// The name in a safetensors header.
    fn safetensors_name(self) -> &'static str;

    /// The name in `config.json`'s `torch_dtype`.
    fn torch_name(self) -> &'static str;

    /// The dtype named in a safetensors header.
    fn from_safetensors(dtype: safetensors::Dtype) -> Option<Self>;

    /// The same type in ggml's list.
    fn ggml(self) -> GgmlType;
}

impl DTypeExt for DType {
    fn to_abi(self) -> abi::TkDtype {
        match self {
            DType::F32 => abi::TK_DTYPE_F32,
            DType::F16 => abi::TK_DTYPE_F16,
            DType::Bf16 => abi::TK_DTYPE_BF16,
        }
    }

    fn safetensors_name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::Bf16 => "BF16",
        }
    }

    fn torch_name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::Bf16 => "bfloat16",
        }
    }

    fn from_safetensors(dtype: safetensors::Dtype) -> Option<Self> {
        match dtype {
            safetensors::Dtype::F32 => Some(DType::F32),
            safetensors::Dtype::F16 => Some(DType::F16),
            safetensors::Dtype::BF16 => Some(DType::Bf16),
            _ => None,
        }
    }

    fn ggml(self) -> GgmlType {
        match self {
            DType::F32 => GgmlType::F32,
            DType::F16 => GgmlType::F16,
            DType::Bf16 => GgmlType::Bf16,
        }
    }
}

/// A weight's type as ops take it: a float [`DType`] or any [`GgmlType`].
pub trait WeightType: Copy {
    fn weight_type(self) -> GgmlType;
}

impl WeightType for DType {
    fn weight_type(self) -> GgmlType {
        self.ggml()
    }
}

impl WeightType for GgmlType {
    fn weight_type(self) -> GgmlType {
        self
    }
}

/// What the loader needs of a tensor type beyond its block layout.
pub trait GgmlTypeExt {
    /// The float type, for F32/F16/BF16 (`None` for the block formats).
    fn float(self) -> Option<DType>;

    /// The kernel ABI's dtype code (block formats since ABI 1.2).
    fn to_abi(self) -> abi::TkDtype;
}

impl GgmlTypeExt for GgmlType {
    fn float(self) -> Option<DType> {
        match self {
            GgmlType::F32 => Some(DType::F32),
            GgmlType::F16 => Some(DType::F16),
            GgmlType::Bf16 => Some(DType::Bf16),
            _ => None,
        }
    }

    fn to_abi(self) -> abi::TkDtype {
        match self {
            GgmlType::F32 => abi::TK_DTYPE_F32,
            GgmlType::F16 => abi::TK_DTYPE_F16,
            GgmlType::Bf16 => abi::TK_DTYPE_BF16,
            GgmlType::Q4_0 => abi::TK_DTYPE_Q4_0,
            GgmlType::Q4_1 => abi::TK_DTYPE_Q4_1,
            GgmlType::Q5_0 => abi::TK_DTYPE_Q5_0,
            GgmlType::Q5_1 => abi::TK_DTYPE_Q5_1,
            GgmlType::Q8_0 => abi::TK_DTYPE_Q8_0,
            GgmlType::Q4K => abi::TK_DTYPE_Q4_K,
            GgmlType::Q5K => abi::TK_DTYPE_Q5_K,
            GgmlType::Q6K => abi::TK_DTYPE_Q6_K,
        }
    }
}

/// A dtype as a person types it on a command line: its name in any case, or its torch
/// name (`float16`, `bfloat16`, `half` ...). Topology files and the wire take the exact
/// names only (`DType`'s `FromStr`).
pub fn parse_dtype(text: &str) -> Result<DType, UnknownName> {
    match text.to_ascii_lowercase().as_str() {
        "float32" => Ok(DType::F32),
        "float16" | "half" => Ok(DType::F16),
        "bfloat16" => Ok(DType::Bf16),
        name => name.parse().map_err(|_| UnknownName::new("dtype", text, DType::NAMES)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_line_spellings() {
        let table = [
            ("f32", DType::F32),
            ("float32", DType::F32),
            ("F16", DType::F16),
            ("float16", DType::F16),
            ("half", DType::F16),
            ("bf16", DType::Bf16),
            ("BFloat16", DType::Bf16),
        ];
        for (text, dtype) in table {
            assert_eq!(parse_dtype(text), Ok(dtype), "{text}");
        }
        let e = parse_dtype("F8").unwrap_err().to_string();
        assert_eq!(e, "unknown dtype `F8`; expected f32, f16 or bf16");
    }

    #[test]
    fn abi_and_file_names() {
        for dtype in DType::ALL {
            assert_eq!(dtype.torch_name().parse::<DType>().ok(), None, "torch names are aliases only");
            assert_eq!(parse_dtype(dtype.torch_name()), Ok(dtype));
            assert_eq!(dtype.safetensors_name().to_ascii_lowercase(), dtype.as_str());
        }
        assert_eq!(DType::Bf16.to_abi(), abi::TK_DTYPE_BF16);
    }
}
