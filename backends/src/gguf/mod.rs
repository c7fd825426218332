//! GGUF files (llama.cpp's single-file checkpoints, versions 2 and 3): the header, the
//! metadata, the tensor infos and the memory-mapped tensor data.
//!
//! Everything in the file is untrusted: every count, length, offset and shape is
//! checked against the bytes actually present before it is used, so a damaged file is a
//! [`GgufError`] naming what was wrong and where, never a panic, a huge allocation or a
//! read out of bounds.

pub mod hf;
pub mod info;
pub use tessera_quant as quant;
pub mod spm;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::error::BackendError;
use crate::mmap::map_file;
pub use quant::GgmlType;

/// `"GGUF"` read as a little-endian u32.
const MAGIC: [u8; 4] = *b"GGUF";
/// Tensor data alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Dimensions a tensor may have (ggml's `GGML_MAX_DIMS`).
const MAX_DIMS: u32 = 4;
/// Nesting depth of metadata arrays (arrays of arrays) accepted.
const MAX_ARRAY_DEPTH: u32 = 2;

/// What was wrong with a GGUF file, and where in it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GgufError {
    #[error("not a GGUF file (magic {found:02x?}, expected \"GGUF\")")]
    BadMagic { found: [u8; 4] },
    #[error("GGUF version {0} is not supported (supported: 2, 3)")]
    Version(u32),
    #[error("truncated at byte {at}: {what} needs {need} bytes, {left} left")]
    Truncated { at: u64, what: String, need: u64, left: u64 },
    #[error("at byte {at}: {what}")]
    Invalid { at: u64, what: String },
    #[error("metadata key {key:?}: {what}")]
    Metadata { key: String, what: String },
    #[error("tensor {name:?}: {what}")]
    Tensor { name: String, what: String },
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    /// The value as an unsigned integer, when it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F32(_) => "f32",
            Value::F64(_) => "f64",
            Value::Bool(_) => "bool",
            Value::Str(_) => "string",
            Value::Array(_) => "array",
        }
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Str(s) if s.len() > 60 => {
                let cut = (0..=60).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
                write!(f, "{:?}… ({} bytes)", &s[..cut], s.len())
            }
            Value::Str(s) => write!(f, "{s:?}"),
            Value::Array(a) => match a.first() {
                Some(first) => write!(f, "[{} x {}]", a.len(), first.type_name()),
                None => f.write_str("[]"),
            },
            Value::F32(v) => write!(f, "{v}"),
            Value::F64(v) => write!(f, "{v}"),
            Value::Bool(v) => write!(f, "{v}"),
            other => write!(f, "{}", other.as_u64().map_or_else(|| format!("{other:?}"), |v| v.to_string())),
        }
    }
}

/// One tensor's description; its bytes are [`Gguf::tensor_bytes`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the innermost (contiguous) dimension — the number of
    /// columns of a weight matrix; a `[rows, cols]` PyTorch tensor is `[cols, rows]` here.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// From the start of the data section.
    pub offset: u64,
    /// Bytes of data, from the type's block layout.
    pub size: u64,
}

impl TensorInfo {
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// The shape in row-major (PyTorch) order: outermost first.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// Is `path` a single-file model (GGUF) rather than a checkpoint directory?
pub fn is_model_file(path: &Path) -> bool {
    path.is_file()
}

/// The parsed header of a GGUF file over its bytes.
pub struct Gguf {
    path: PathBuf,
    bytes: Bytes,
    pub version: u32,
    pub alignment: u64,
    metadata: BTreeMap<String, Value>,
    /// In file order.
    tensors: Vec<TensorInfo>,
    by_name: BTreeMap<String, usize>,
    /// Where the data section starts in the file.
    data_start: u64,
}

enum Bytes {
    Map(Arc<Mmap>),
    Owned(Vec<u8>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Map(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

impl fmt::Debug for Gguf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gguf")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish_non_exhaustive()
    }
}

impl Gguf {
    /// Maps and parses `path`.
    pub fn open(path: &Path) -> Result<Gguf, BackendError> {
        let map = map_file(path)?;
        Gguf::parse(Bytes::Map(map), path).map_err(|e| BackendError::Gguf { path: path.to_owned(), reason: e })
    }

    /// Parses a file already in memory (`path` names it in errors).
    pub fn from_bytes(bytes: Vec<u8>, path: &Path) -> Result<Gguf, GgufError> {
        Gguf::parse(Bytes::Owned(bytes), path)
    }

    fn parse(bytes: Bytes, path: &Path) -> Result<Gguf, GgufError> {
        let mut r = Reader { buf: bytes.as_slice(), at: 0 };
        let magic = r.array::<4>("the magic")?;
        if magic != MAGIC {
            return Err(GgufError::BadMagic { found: magic });
        }
        let version = r.u32("the version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::Version(version));
        }
        let tensor_count = r.u64("the tensor count")?;
        let kv_count = r.u64("the metadata count")?;
        // Each entry takes at least 8 (key length) + 4 (type) + 1 bytes; each tensor info
        // 8 + 4 + 4 + 8: a count the file cannot hold is refused before any allocation.
        r.check_count(kv_count, 13, "metadata entries")?;
        let mut metadata = BTreeMap::new();
        for _ in 0..kv_count {
            let key_at = r.at;
            let key = r.string("a metadata key")?;
            let ty = r.u32("a metadata value type")?;
            let value = r.value(ty, 0).map_err(|e| match e {
                GgufError::Invalid { what, .. } => GgufError::Metadata { key: key.clone(), what },
                other => other,
            })?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(GgufError::Invalid {
                    at: key_at as u64,
                    what: format!("metadata key {key:?} appears twice"),
                });
            }
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a.is_power_of_two() && a <= 1 << 20 => a,
                _ => {
                    return Err(GgufError::Metadata {
                        key: "general.alignment".into(),
                        what: format!("{v} is not a power of two up to 1 MiB"),
                    });
                }
            },
        };

        r.check_count(tensor_count, 24, "tensor infos")?;
        let mut tensors = Vec::with_capacity(tensor_count as usize);
        let mut by_name = BTreeMap::new();
        for _ in 0..tensor_count {
            let name = r.string("a tensor name")?;
            let fail = |what: String| GgufError::Tensor { name: name.clone(), what };
            let n_dims = r.u32("a tensor's dimension count")?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(fail(format!("{n_dims} dimensions (1..={MAX_DIMS} allowed)")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64("a tensor dimension")?);
            }
            let raw_type = r.u32("a tensor type")?;
            let ty = GgmlType::from_id(raw_type).ok_or_else(|| {
                fail(format!("unsupported tensor type {raw_type} (supported: {})", GgmlType::supported_names()))
            })?;
            let offset = r.u64("a tensor offset")?;
            if dims.contains(&0) {
                return Err(fail(format!("a zero dimension in {dims:?}")));
            }
            let elements = dims
                .iter()
                .try_fold(1u64, |n, &d| n.checked_mul(d))
                .ok_or_else(|| fail(format!("dimensions {dims:?} overflow")))?;
            if dims[0] % ty.block_elements() != 0 {
                return Err(fail(format!(
                    "{ty} stores blocks of {} values, but a row has {}",
                    ty.block_elements(),
                    dims[0]
                )));
            }
            let size = (elements / ty.block_elements())
                .checked_mul(ty.block_bytes())
                .ok_or_else(|| fail(format!("dimensions {dims:?} overflow")))?;
            if offset % alignment != 0 {
                return Err(fail(format!("offset {offset} is not a multiple of the alignment {alignment}")));
            }
            if by_name.insert(name.clone(), tensors.len()).is_some() {
                return Err(fail("appears twice".into()));
            }
            tensors.push(TensorInfo { name, dims, ty, offset, size });
        }
        let data_start = (r.at as u64).next_multiple_of(alignment);
        let file_len = bytes.as_slice().len() as u64;
        for t in &tensors {
            let end = data_start.checked_add(t.offset).and_then(|s| s.checked_add(t.size));
            match end {
                Some(end) if end <= file_len => {}
                _ => {
                    return Err(GgufError::Tensor {
                        name: t.name.clone(),
                        what: format!(
                            "{} bytes at data offset {} run past the end of the file ({file_len} bytes)",
                            t.size, t.offset
                        ),
                    });
                }
            }
        }
        // Tensors may not share bytes (llama.cpp lays them out one after another): a
        // tensor dequantizes to a few times its bytes, so loading stays proportional to
        // the file; overlapping infos would multiply it by the number of tensors.
        let mut spans: Vec<(u64, u64, usize)> =
            tensors.iter().enumerate().map(|(i, t)| (t.offset, t.offset + t.size, i)).collect();
        spans.sort_unstable();
        for pair in spans.windows(2) {
            let ((start, end, first), (next, _, second)) = (pair[0], pair[1]);
            if next < end {
                return Err(GgufError::Tensor {
                    name: tensors[second].name.clone(),
                    what: format!(
                        "its data at offset {next} overlaps tensor {:?}'s (data offsets {start}..{end})",
                        tensors[first].name
                    ),
                });
            }
        }
        Ok(Gguf { path: path.to_owned(), bytes, version, alignment, metadata, tensors, by_name, data_start })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn metadata(&self) -> &BTreeMap<String, Value> {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Option<&str> {
        self.get("general.architecture").and_then(Value::as_str)
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// A tensor's raw bytes (bounds were checked when the file was parsed).
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        &self.bytes.as_slice()[self.tensor_range(info)]
    }

    /// Where a tensor's bytes lie in the file.
    pub fn tensor_range(&self, info: &TensorInfo) -> std::ops::Range<usize> {
        let start = (self.data_start + info.offset) as usize;
        start..start + info.size as usize
    }

    /// The file's memory map, when it was opened from disk ([`Gguf::open`]).
    pub fn map(&self) -> Option<&Arc<Mmap>> {
        match &self.bytes {
            Bytes::Map(m) => Some(m),
            Bytes::Owned(_) => None,
        }
    }

    /// A tensor's values as f32 (dequantized when quantized).
    pub fn tensor_f32(&self, info: &TensorInfo) -> Vec<f32> {
        let mut out = vec![0.0; info.elements() as usize];
        info.ty.dequantize(self.tensor_bytes(info), &mut out);
        out
    }
}

/// A bounds-checked cursor over the file.
struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn left(&self) -> u64 {
        (self.buf.len() - self.at) as u64
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&[u8], GgufError> {
        if n > self.left() {
            return Err(GgufError::Truncated { at: self.at as u64, what: what.into(), need: n, left: self.left() });
        }
        let start = self.at;
        self.at += n as usize;
        Ok(&self.buf[start..self.at])
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let bytes = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        self.array::<4>(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        self.array::<8>(what).map(u64::from_le_bytes)
    }

    /// Refuses `count` items of at least `min_bytes` each when fewer bytes are left.
    fn check_count(&self, count: u64, min_bytes: u64, what: &str) -> Result<(), GgufError> {
        if count.saturating_mul(min_bytes) > self.left() {
            return Err(GgufError::Invalid {
                at: self.at as u64,
                what: format!("{count} {what} cannot fit in the {} bytes left", self.left()),
            });
        }
        Ok(())
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let at = self.at as u64;
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::Invalid { at, what: format!("{what} is not UTF-8") })
    }

    fn value(&mut self, ty: u32, depth: u32) -> Result<Value, GgufError> {
        let at = self.at as u64;
        Ok(match ty {
            0 => Value::U8(self.array::<1>("a u8")?[0]),
            1 => Value::I8(self.array::<1>("an i8")?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array("a u16")?)),
            3 => Value::I16(i16::from_le_bytes(self.array("an i16")?)),
            4 => Value::U32(self.u32("a u32")?),
            5 => Value::I32(i32::from_le_bytes(self.array("an i32")?)),
            6 => Value::F32(f32::from_le_bytes(self.array("an f32")?)),
            7 => match self.array::<1>("a bool")?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(GgufError::Invalid { at, what: format!("bool byte {b} (0 or 1 allowed)") }),
            },
            8 => Value::Str(self.string("a string")?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::Invalid { at, what: "arrays nested too deep".into() });
                }
                let item = self.u32("an array's item type")?;
                let count = self.u64("an array's length")?;
                let min = match item {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    other => return Err(GgufError::Invalid { at, what: format!("unknown array item type {other}") }),
                };
                self.check_count(count, min, "array items")?;
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(item, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64("a u64")?),
            11 => Value::I64(i64::from_le_bytes(self.array("an i64")?)),
            12 => Value::F64(f64::from_le_bytes(self.array("an f64")?)),
            other => return Err(GgufError::Invalid { at, what: format!("unknown value type {other}") }),
        })
    }
}

#[cfg(test)]
mod fuzz_tests;
#[cfg(test)]
mod tests;
